"""Cluster job files from plain option dataclasses: Slurm batch scripts (checked with
`bash -n` and by what each task then detects), Kubernetes JobSet manifests (read back as
YAML, and what each pod then detects), and the YAML emitter."""

import os
import re
import shlex
import subprocess
import sys

import pytest
from jobset_schema import check_jobset
from yaml_subset import check_yaml

from jaxlearn.launch.cluster import detect_cluster
from jaxlearn.launch.job import JobSpecError, JobTarget, job_name, same_jaxlearn
from jaxlearn.launch.k8s import (
    K8sOptions,
    Volume,
    jobset_file,
    jobset_manifest,
    to_yaml,
    tpu_topology,
)
from jaxlearn.launch.slurm import SlurmOptions, slurm_script

ARGV = ("train", "--experiment", "tiny-llama", "--output_dir", "/shared/runs/x")


def _target(platform, kind, devices, per_host, name="job"):
    return JobTarget(name=name, experiment="tiny-llama", selector=f"{kind}-{devices}",
                     kind=kind, platform=platform, devices=devices, devices_per_host=per_host,
                     argv=ARGV)


def _srun(script):
    return shlex.split(script[script.index("\nsrun "):].replace("\\\n", " "))


def test_job_name_and_command():
    assert job_name("My Job_1") == "my-job-1"
    with pytest.raises(JobSpecError, match="1-40 characters"):
        job_name("x" * 41)
    with pytest.raises(JobSpecError, match="1-40 characters"):
        job_name("___")
    t = _target("cpu", "cpu", 8, None)
    assert t.command("python3 -m jaxlearn.cli", 4) == [
        "python3", "-m", "jaxlearn.cli", *ARGV, "--num_cpu_devices", "4"]
    assert t.command("jl", None) == ["jl", *ARGV]


def test_slurm_cpu_target_splits_devices_over_tasks(tmp_path):
    options = SlurmOptions(nodes=2, processes_per_node=2, env=(("A", "b c"),),
                           heartbeat_timeout=50, coordinator_port=1234, exclusive=False,
                           setup=("module load x",))
    script = slurm_script(options, _target("cpu", "cpu", 8, None))
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", script, re.M))
    assert directives == {"job-name": "job", "nodes": "2", "ntasks-per-node": "2",
                          "output": "slurm-%x-%j.out"}
    assert "\nmodule load x\nexport A='b c'\nexport JAXLEARN_HEARTBEAT_TIMEOUT=50\n" \
           "export JAXLEARN_COORDINATOR_PORT=1234\n" in script
    assert _srun(script) == ["srun", "--label", "--kill-on-bad-exit=1", "--ntasks-per-node=2",
                             "python3", "-m", "jaxlearn.cli", *ARGV, "--num_cpu_devices", "2"]
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    with pytest.raises(JobSpecError, match="8 CPU devices do not split over 3 process"):
        slurm_script(SlurmOptions(nodes=3), _target("cpu", "cpu", 8, None))


FAKE_SCONTROL = """#!/bin/sh
# `scontrol show hostnames LIST` / `scontrol show node -o NAME`, as Slurm answers them.
case "$2" in
  hostnames) echo "$3" | tr ',' '\\n' ;;
  node) echo "NodeName=$4 Arch=x86_64 CoresPerSocket=2 $NODE_ADDR State=IDLE" ;;
esac
"""


def _run_script(tmp_path, script, **env):
    """Runs `script` with bash, a fake scontrol and an srun that prints the coordinator."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", FAKE_SCONTROL),
                       ("srun", "#!/bin/sh\necho \"$JAXLEARN_COORDINATOR_ADDRESS\"\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    full = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4100",
            **env}
    done = subprocess.run(["bash", str(path)], env=full, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_slurm_script_names_the_coordinator_by_slurm_address(tmp_path):
    """The first node of the allocation, by its NodeAddr (else its name); the port from
    the job id as JAX derives it, or the one given."""
    script = slurm_script(SlurmOptions(nodes=2), _target("cpu", "cpu", 8, None))
    nodes = {"SLURM_JOB_NODELIST": "gpu7,gpu8"}
    assert _run_script(tmp_path, script, NODE_ADDR="NodeAddr=10.1.2.7 NodeHostName=gpu7",
                       **nodes) == "10.1.2.7:61444"
    assert _run_script(tmp_path, script, NODE_ADDR="", **nodes) == "gpu7:61444"
    script = slurm_script(SlurmOptions(nodes=2, coordinator_port=1234),
                          _target("cpu", "cpu", 8, None))
    assert _run_script(tmp_path, script, NODE_ADDR="NodeAddr=gpu7", **nodes) == "gpu7:1234"


def test_slurm_log_goes_where_asked():
    target = _target("cpu", "cpu", 8, None)
    assert "\n#SBATCH --output=slurm-%x-%j.out\n" in slurm_script(SlurmOptions(), target)
    script = slurm_script(SlurmOptions(log="/logs/%j.txt"), target)
    assert "\n#SBATCH --output=/logs/%j.txt\n" in script


def test_same_jaxlearn_entrypoint(tmp_path):
    """The jaxlearn a node runs: the one this process runs, by absolute path."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    console = bin_dir / "jaxlearn"
    console.write_text("#!/bin/sh\n")
    console.chmod(0o755)
    checkout = tmp_path / "my checkout"
    (checkout / "tools").mkdir(parents=True)
    (checkout / "tools" / "jaxlearn").write_text("#!/bin/sh\n")
    (checkout / "tools" / "jaxlearn").chmod(0o755)
    py = sys.executable
    assert same_jaxlearn("x", {"JAXLEARN_ENTRYPOINT": "/c/tools/jaxlearn"}, py,
                         str(checkout)) == "/c/tools/jaxlearn"
    assert same_jaxlearn(str(console), {}, py, str(checkout)) == str(console)
    assert same_jaxlearn("jaxlearn", {"PATH": str(bin_dir)}, py, None) == str(console)
    main = "/src/jaxlearn/cli/__main__.py"
    words = shlex.split(same_jaxlearn(main, {}, py, str(checkout)))
    assert words == [str(checkout / "tools" / "jaxlearn")]
    assert same_jaxlearn(main, {}, py, str(tmp_path / "none")) == \
        shlex.join([os.path.abspath(py), "-m", "jaxlearn.cli"])


def test_slurm_gpu_and_tpu_hosts():
    gpu = _target("gpu", "gpu-h100", 16, 8)
    script = slurm_script(SlurmOptions(processes_per_node=4, partition="a3"), gpu)
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --gpus-per-node=8\n" in script
    assert "#SBATCH --partition=a3\n" in script and "#SBATCH --exclusive" in script
    assert "--gpus-per-task=2" in _srun(script)
    with pytest.raises(JobSpecError, match=r"is 16 GPUs, but 3 node\(s\) x 8 GPU\(s\) = 24"):
        slurm_script(SlurmOptions(nodes=3), gpu)
    with pytest.raises(JobSpecError, match="--processes_per_node 3 does not divide 8"):
        slurm_script(SlurmOptions(processes_per_node=3), gpu)
    tpu = slurm_script(SlurmOptions(), _target("tpu", "tpu-v5p", 32, 4))
    assert "#SBATCH --nodes=8\n" in tpu and "gpus-per-node" not in tpu
    # Rank 13 of 16 tasks, as srun describes it, finds the first node as coordinator.
    spec = detect_cluster({"SLURM_JOB_ID": "77", "SLURM_PROCID": "13", "SLURM_LOCALID": "1",
                           "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_NODELIST": "a3-[0012-0013]"})
    assert spec is not None
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == \
        (f"a3-0012:{77 + 61440}", 16, 13)


def _pod_spec(manifest):
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    return job, job["template"]["spec"]


def test_jobset_cpu_pods_and_their_detected_places():
    options = K8sOptions(image="img", num_processes=2, coordinator_port=9000,
                         initialization_timeout=60, env=(("X", "1"),), namespace="ml")
    text = jobset_file(options, _target("cpu", "cpu", 8, None, name="tiny"))
    assert text.startswith("# Generated by `jaxlearn launch k8s` on ")
    manifest = check_jobset(check_yaml(text))
    assert manifest == jobset_manifest(options, _target("cpu", "cpu", 8, None, name="tiny"))
    job, pod = _pod_spec(manifest)
    assert (job["parallelism"], job["completionMode"], job["backoffLimit"]) == (2, "Indexed", 0)
    (c,) = pod["containers"]
    assert c["command"][-2:] == ["--num_cpu_devices", "4"] and "resources" not in c
    assert "nodeSelector" not in pod and "tolerations" not in pod
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["JAXLEARN_COORDINATOR_ADDRESS"] == "tiny-workers-0-0.tiny:9000"
    assert env["JAXLEARN_INITIALIZATION_TIMEOUT"] == "60" and env["X"] == "1"
    # Pod 1 with the annotations JobSet sets, resolved as the downward API does.
    pod_env = {k: v for k, v in env.items() if v is not None}
    pod_env.update(JOB_COMPLETION_INDEX="1", JOBSET_NAME="tiny", REPLICATED_JOB_NAME="workers",
                   JOB_INDEX="0", JOB_GLOBAL_INDEX="0")
    spec = detect_cluster(pod_env)
    assert spec is not None
    assert (spec.source, spec.num_processes, spec.process_id) == ("jobset", 2, 1)
    with pytest.raises(JobSpecError, match=r"8 CPU devices do not split over 3 pod\(s\)"):
        jobset_manifest(K8sOptions(image="img", num_processes=3), _target("cpu", "cpu", 8, None))


def test_jobset_accelerators():
    tpu = check_jobset(jobset_manifest(K8sOptions(image="i", node_selector=(("pool", "p1"),)),
                                       _target("tpu", "tpu-v6e", 16, 4)))
    _, pod = _pod_spec(tpu)
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4", "pool": "p1"}
    assert pod["containers"][0]["resources"] == {"limits": {"google.com/tpu": 4}}
    with pytest.raises(JobSpecError, match="--tpu_topology 2x2 is 4 chips"):
        jobset_manifest(K8sOptions(image="i", tpu_topology="2x2"),
                        _target("tpu", "tpu-v6e", 16, 4))
    trn = check_jobset(jobset_manifest(K8sOptions(image="i", cpu="8"),
                                       _target("neuron", "trn2", 32, 16)))
    job, pod = _pod_spec(trn)
    assert job["parallelism"] == 2
    assert pod["containers"][0]["resources"] == {"limits": {"aws.amazon.com/neuron": 4},
                                                 "requests": {"cpu": "8"}}
    with pytest.raises(JobSpecError, match=r"--num_processes 3: gpu-h100-16 needs 2 pod\(s\)"):
        jobset_manifest(K8sOptions(image="i", num_processes=3), _target("gpu", "gpu-h100", 16, 8))


def test_jobset_shared_storage_restarts_and_shm():
    """PVC and CSI volumes in every pod, /dev/shm in memory on GPU pods, whole-set restarts
    with preemptions not counted."""
    volumes = (Volume(mount="/runs", claim="shared-runs"),
               Volume(mount="/gcs", driver="gcsfuse.csi.storage.gke.io",
                      attributes=(("bucketName", "b1"),)))
    m = check_jobset(check_yaml(jobset_file(K8sOptions(image="i", volumes=volumes),
                                            _target("gpu", "gpu-h100", 16, 8))))
    job, pod = _pod_spec(m)
    assert pod["restartPolicy"] == "Never" and job["backoffLimit"] == 0
    assert m["spec"]["failurePolicy"] == {"maxRestarts": 3, "rules": [{
        "name": "preemption-restarts-do-not-count",
        "action": "RestartJobSetAndIgnoreMaxRestarts",
        "onJobFailureReasons": ["PodFailurePolicy"]}]}
    assert job["podFailurePolicy"] == {"rules": [{"action": "FailJob", "onPodConditions": [
        {"type": "DisruptionTarget", "status": "True"}]}]}
    assert pod["volumes"] == [
        {"name": "shared-0", "persistentVolumeClaim": {"claimName": "shared-runs"}},
        {"name": "shared-1", "csi": {"driver": "gcsfuse.csi.storage.gke.io",
                                     "volumeAttributes": {"bucketName": "b1"}}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "shared-0", "mountPath": "/runs"}, {"name": "shared-1", "mountPath": "/gcs"},
        {"name": "dshm", "mountPath": "/dev/shm"}]
    template = m["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert template["metadata"] == {"annotations": {"gke-gcsfuse/volumes": "true"}}
    # TPU and CPU pods: no /dev/shm volume; no volumes at all unless asked.
    _, tpu = _pod_spec(jobset_manifest(K8sOptions(image="i", max_restarts=0),
                                       _target("tpu", "tpu-v6e", 16, 4)))
    assert "volumes" not in tpu and "volumeMounts" not in tpu["containers"][0]
    for volume, message in ((Volume(mount="runs", claim="c"), "must be an absolute path"),
                            (Volume(mount="/dev/shm", claim="c"), "other than / and /dev/shm"),
                            (Volume(mount="/r", claim="Bad_Name"), "not a PersistentVolumeClaim")):
        with pytest.raises(JobSpecError, match=message):
            jobset_manifest(K8sOptions(image="i", volumes=(volume,)),
                            _target("cpu", "cpu", 8, None))
    with pytest.raises(JobSpecError, match="/r is mounted twice"):
        jobset_manifest(K8sOptions(image="i", volumes=(Volume(mount="/r", claim="a"),
                                                       Volume(mount="/r", claim="b"))),
                        _target("cpu", "cpu", 8, None))
    with pytest.raises(JobSpecError, match="--max_restarts -1: must be >= 0"):
        jobset_manifest(K8sOptions(image="i", max_restarts=-1), _target("cpu", "cpu", 8, None))


def test_jobset_schema_rejects_unknown_fields():
    """The schema check itself: a misspelt field, a wrong type, a value off its enum."""
    good = jobset_manifest(K8sOptions(image="i"), _target("cpu", "cpu", 8, None))
    check_jobset(good)
    bad = jobset_manifest(K8sOptions(image="i"), _target("cpu", "cpu", 8, None))
    bad["spec"]["failurepolicy"] = bad["spec"].pop("failurePolicy")
    with pytest.raises(AssertionError, match=r"\['failurepolicy'\] are not in JobSetSpec"):
        check_jobset(bad)
    _, pod = _pod_spec(good)
    pod["restartPolicy"] = "never"
    with pytest.raises(AssertionError, match="'never' is not one of"):
        check_jobset(good)
    pod["restartPolicy"] = "Never"
    good["spec"]["replicatedJobs"][0]["replicas"] = "1"
    with pytest.raises(AssertionError, match="replicas: expected int"):
        check_jobset(good)


@pytest.mark.parametrize("kind,chips,topology", [
    ("tpu-v5p", 4, "2x2x1"), ("tpu-v5p", 8, "2x2x2"), ("tpu-v4", 16, "2x2x4"),
    ("tpu-v5p", 32, "2x4x4"), ("tpu-v5p", 64, "4x4x4"), ("tpu-v5p", 128, "4x4x8"),
    ("tpu-v5e", 1, "1x1"), ("tpu-v5e", 8, "2x4"), ("tpu-v6e", 16, "4x4"),
    ("tpu-v6e", 256, "16x16"),
])
def test_tpu_topology_names(kind, chips, topology):
    assert tpu_topology(kind, chips) == topology


def test_tpu_topology_needs_a_power_of_two():
    with pytest.raises(JobSpecError, match="12 TPU chips is not a power of two"):
        tpu_topology("tpu-v5p", 12)


def test_yaml_round_trip():
    tricky: dict = {"a": "yes", "b": "2", "c": "x: y", "d": 'q"uote', "e": [], "f": {}, "g": None,
                    "h": [1, [2, "3"], {"i": "true", "j": ["-m", "a b"]}], "k.l/m": "host:1",
                    "n": "1:30", "o": 1.5, "p": False, "q": "", "r": "ends:"}
    check_yaml(to_yaml(tricky), tricky)
