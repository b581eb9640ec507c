"""`jaxlearn launch` and multi-process `jaxlearn train`, end to end.

The Slurm job is the generated sbatch script, submitted to a fake `sbatch` that runs it with
a fake `srun`, which starts the tasks on this machine with Slurm's real variables (`launch
local --emulate slurm`); and, where `sbatch`/`srun` exist and a cluster of 2 or more nodes
answers `sinfo` (e.g. Debian's slurm-wlm with two slurmd on this host; SLURM_CONF set), the
same script submitted unmodified to that real Slurm (skipped, with the reason, otherwise).
The Kubernetes job is the generated JobSet manifest, whose pods a fake kubelet starts with
the manifest's command and env (annotations resolved as the downward API does,
JOB_COMPLETION_INDEX as Kubernetes sets it). Both are 2 processes x 4 CPU
devices training tiny-llama; their losses must equal one process with 8 devices, and their
checkpoints must resume across process counts (2 -> 1 and 1 -> 2).

The manifests are read back with `yaml_subset` from packages/launch/tests (on the import
path with the package sources: `PYTHONPATH=...:packages/launch/tests`).
"""

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobset_schema import check_jobset
from yaml_subset import check_yaml

from jaxlearn.cli.main import main
from jaxlearn.launch.cluster import detect_cluster
from jaxlearn.launch.local import free_port


def _detect(env):
    """detect_cluster, asserting that it found a cluster."""
    spec = detect_cluster(env)
    assert spec is not None
    return spec

FAST = ["--set", "input.seq_len=32", "--set", "input.global_batch_size=8",
        "--set", "eval_every_n_steps=0", "--set", "log_every_n_steps=1",
        "--set", "learner.warmup_steps=0", "--mesh_selector", "cpu-8"]
# Four steps in all (the LR schedule spans 4 even when a run stops at 2), saves at 2 and 4.
COMMON = ["--experiment", "tiny-llama", *FAST, "--set", "learner.total_steps=4",
          "--set", "save_every_n_steps=2"]
ENTRYPOINT = f"{sys.executable} -m jaxlearn.cli"
TIMEOUTS = ["--initialization_timeout", "90", "--heartbeat_timeout", "90"]


def _losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}  # Last one wins.


def _assert_same_losses(got, want, steps):
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-6), (s, got, want)


@pytest.fixture(scope="module", autouse=True)
def fit_cache(tmp_path_factory):
    """The launch fit check's cache, fresh for this module (its figures are computed once
    per config here, then read back)."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("fit-cache")
        mp.setenv("JAXLEARN_FIT_CACHE", str(path))
        mp.setenv("JAXLEARN_AOT_MATRIX", str(path / "aot_matrix.json"))  # None recorded.
        yield path


@pytest.fixture(scope="module")
def env_for_children():
    """Children run the same interpreter with the same import path, and no inherited fake
    device count."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
        mp.delenv("XLA_FLAGS", raising=False)
        yield mp


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 8 devices, 4 steps."""
    out = str(tmp_path_factory.mktemp("ref") / "run")
    assert main(["train", *COMMON, "--output_dir", out, "--max_step", "4"]) == 0
    losses = _losses(out)
    assert sorted(losses) == [1, 2, 3, 4]
    return losses


# ---- Slurm: generated script -> fake sbatch -> fake srun -> 2 processes ----------------------

FAKE_SBATCH = """#!{python}
# Fake sbatch: runs the script now (synchronously) the way slurmctld would start it.
import os, re, subprocess, sys
script = sys.argv[-1]
text = open(script).read()
opts = dict(re.findall(r"^#SBATCH --([\\w-]+)=(\\S+)", text, re.M))
env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_JOB_NAME=opts["job-name"],
           SLURM_NNODES=opts["nodes"], SLURM_NTASKS_PER_NODE=opts["ntasks-per-node"],
           SLURM_JOB_NODELIST="localhost", SLURM_PROCID="0", SLURM_LOCALID="0")
with open(script + ".out", "w") as log:
    rc = subprocess.call(["bash", script], env=env, stdout=log, stderr=subprocess.STDOUT)
open(script + ".rc", "w").write(str(rc))
print("Submitted batch job 4242")
"""

FAKE_SCONTROL = """#!/bin/sh
# Fake scontrol: this machine is the allocation's only node.
case "$2" in
  hostnames) echo localhost ;;
  node) echo "NodeName=localhost Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=localhost" ;;
esac
"""

FAKE_SRUN = """#!{python}
# Fake srun: one step of SLURM_NNODES x ntasks-per-node tasks, all on this machine, each
# with the variables slurmstepd would give it; --kill-on-bad-exit as launch local does.
import os, sys
args = sys.argv[1:]
opts = {{}}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
assert opts.get("kill-on-bad-exit") == "1", opts
n = int(os.environ["SLURM_NNODES"]) * int(opts.get("ntasks-per-node", 1))
os.execv(sys.executable, [sys.executable, "-m", "jaxlearn.cli", "launch", "local",
                          "--emulate", "slurm", "--num_processes", str(n), "--", *args])
"""


@pytest.fixture(scope="module")
def fake_slurm(tmp_path_factory):
    """A directory with the fake sbatch, srun and scontrol (put on PATH only while used)."""
    bin_dir = tmp_path_factory.mktemp("slurm-bin")
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN),
                       ("scontrol", FAKE_SCONTROL)):
        path = bin_dir / name
        path.write_text(text.format(python=sys.executable) if "{python}" in text else text)
        path.chmod(0o755)
    return bin_dir


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory, fake_slurm, env_for_children, reference):
    """`jaxlearn launch slurm --nodes 2 --submit` of the first 2 of the 4 steps."""
    work = tmp_path_factory.mktemp("slurm")
    out, script = str(work / "run"), str(work / "job.sbatch")
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{fake_slurm}{os.pathsep}{os.environ['PATH']}")
        rc = main(["launch", "slurm", "--nodes", "2", "--no_exclusive", "--entrypoint",
                   ENTRYPOINT, *TIMEOUTS, "--script", script, "--submit", "--",
                   "train", *COMMON, "--output_dir", out, "--max_step", "2"])
    seconds = time.monotonic() - t0
    log = Path(script + ".out").read_text() if os.path.exists(script + ".out") else ""
    assert rc == 0 and Path(script + ".rc").read_text() == "0", log[-4000:]
    print(f"slurm job (2 processes x 4 devices, 2 steps): {seconds:.1f}s")
    return {"out": out, "log": log, "script": Path(script).read_text()}


def test_slurm_job_two_processes_match_one_process(slurm_run, reference):
    log = slurm_run["log"]
    assert "--num_cpu_devices 4" in slurm_run["script"]  # cpu-8 over 2 nodes.
    for i in (0, 1):
        assert f"[{i}] jaxlearn: process {i} of 2 joined (slurm, coordinator localhost:" in log
        assert f"[{i}] jaxlearn: training tiny-llama on 8 device(s)" in log
    assert "all 2 processes finished" in log
    losses = _losses(slurm_run["out"])
    assert sorted(losses) == [1, 2]
    _assert_same_losses(losses, reference, [1, 2])


def test_only_process_zero_writes_summaries_every_process_writes_shards(slurm_run):
    out = Path(slurm_run["out"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if r["split"] == "train"]
    assert train_steps == [1, 2]  # Not once per process.
    assert len(list((out / "tensorboard").glob("events.out*"))) == 1
    assert (out / "config.txt").is_file()
    step = out / "checkpoints" / "step_00000002"
    assert (step / "state" / "ocdbt.process_0").is_dir()
    assert (step / "state" / "ocdbt.process_1").is_dir()
    assert len(list((step / "data_iterator").glob("process_0000[01].*"))) == 2


def test_two_process_checkpoint_resumes_in_one_process(slurm_run, reference, tmp_path):
    out = str(tmp_path / "resumed")
    shutil.copytree(slurm_run["out"], out)
    assert main(["train", *COMMON, "--output_dir", out, "--max_step", "4"]) == 0
    _assert_same_losses(_losses(out), reference, [3, 4])


# ---- a real Slurm: the generated script, unmodified, under sbatch/srun ----------------------

CHECKOUT = Path(__file__).resolve().parents[3]


def _real_slurm_missing():
    """Why no real Slurm can run the job here (None: one can)."""
    for tool in ("sbatch", "srun", "sinfo", "scontrol"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH (no Slurm client tools)"
    try:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True,
                              text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20s"
    if done.returncode:
        return f"no Slurm cluster answers sinfo: {done.stderr.strip()[-200:]} (is SLURM_CONF set?)"
    usable = {line.split()[0] for line in done.stdout.splitlines()
              if re.match(r"\S+ (idle|mixed|allocated|completing)", line)}
    if len(usable) < 2:
        return f"the Slurm cluster has {len(usable)} usable node(s), the job needs 2"
    return None


@pytest.fixture(scope="module")
def real_slurm_run(tmp_path_factory, env_for_children, reference):
    """`jaxlearn launch slurm --nodes 2 --submit --wait` of the first 2 of the 4 steps on a
    real Slurm, with the default entrypoint and log; the work directory (this host's
    tmp) must be visible to the nodes, as it is for slurmd daemons on this host."""
    missing = _real_slurm_missing()
    if missing:
        pytest.skip(f"no real Slurm: {missing}")
    work = tmp_path_factory.mktemp("real-slurm")
    out, script = str(work / "run"), str(work / "job.sbatch")
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)  # The log's default place: the directory sbatch runs in.
        mp.delenv("JAXLEARN_ENTRYPOINT", raising=False)
        rc = main(["launch", "slurm", "--nodes", "2", "--no_exclusive", "--time", "20:00",
                   *TIMEOUTS, "--script", script, "--submit", "--wait", "--",
                   "train", *COMMON, "--output_dir", out, "--max_step", "2"])
    seconds = time.monotonic() - t0
    logs = sorted(work.glob("slurm-jaxlearn-tiny-llama-*.out"))
    log = logs[0].read_text() if logs else ""
    assert rc == 0 and len(logs) == 1, (rc, logs, log[-4000:])
    print(f"real Slurm job (2 nodes x 4 devices, 2 steps): {seconds:.1f}s")
    job_id = int(re.search(r"-(\d+)\.out$", logs[0].name).group(1))
    return {"out": out, "log": log, "script": Path(script).read_text(), "job_id": job_id}


def test_real_slurm_runs_the_generated_script(real_slurm_run, reference):
    script, log = real_slurm_run["script"], real_slurm_run["log"]
    srun = shlex.split(script[script.index("\nsrun "):].replace("\\\n", " "))
    assert srun[:2] == ["srun", "--label"]
    assert srun[4] == str(CHECKOUT / "tools" / "jaxlearn")  # The jaxlearn the test runs.
    # Every line labelled with its rank; both ranks name the same coordinator, at the port
    # derived from the job id.
    joined = re.findall(r"^(\d+): jaxlearn: process (\d+) of 2 joined \(slurm, coordinator "
                        r"(\S+):(\d+)[,)]", log, re.M)
    assert sorted((r, p) for r, p, _, _ in joined) == [("0", "0"), ("1", "1")], log[-4000:]
    assert len({(h, p) for _, _, h, p in joined}) == 1
    assert int(joined[0][3]) == real_slurm_run["job_id"] % 4096 + 61440
    for i in (0, 1):
        assert f"\n{i}: jaxlearn: training tiny-llama on 8 device(s)" in log
    losses = _losses(real_slurm_run["out"])
    assert sorted(losses) == [1, 2]
    _assert_same_losses(losses, reference, [1, 2])
    step = Path(real_slurm_run["out"]) / "checkpoints" / "step_00000002" / "state"
    assert (step / "ocdbt.process_0").is_dir() and (step / "ocdbt.process_1").is_dir()


def test_real_slurm_checkpoint_resumes_in_one_process(real_slurm_run, reference, tmp_path):
    out = str(tmp_path / "resumed")
    shutil.copytree(real_slurm_run["out"], out)
    assert main(["train", *COMMON, "--output_dir", out, "--max_step", "4"]) == 0
    _assert_same_losses(_losses(out), reference, [3, 4])


def test_tools_jaxlearn_first_use_creates_the_venv_once(tmp_path):
    """Two nodes' first uses of the checkout's tools/jaxlearn at once, on a shared home:
    one creates the venv (under the lock), the other waits and then uses it."""
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("# nothing to install: the venv itself is what is created\n")
    venv = tmp_path / "shared-home" / "venv"
    # This interpreter is a Python 3.11 (a test sandbox may have no python3.11 on PATH).
    env = dict(os.environ, JAXLEARN_VENV=str(venv), JAXLEARN_REQUIREMENTS=str(reqs),
               JAXLEARN_PYTHON=sys.executable)
    argv = [str(CHECKOUT / "tools" / "jaxlearn"), "python", "-c",
            "import sys; print(sys.prefix)"]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert [out.strip() for out, _ in results] == [str(venv)] * 2
    created = sum(err.count("first run: creating") for _, err in results)
    assert created == 1, results
    assert (venv / ".ok").is_file()


# ---- Kubernetes: generated JobSet -> fake kubelet -> 2 pods ---------------------------------


def _pods(manifest):
    rjob = manifest["spec"]["replicatedJobs"][0]
    return rjob, rjob["template"]["spec"], rjob["template"]["spec"]["template"]["spec"]


def _pod_env(manifest, index, base):
    """What a JobSet pod's container sees: the manifest env with the downward API resolved
    from the pod annotations JobSet sets, plus what Kubernetes adds."""
    name = manifest["metadata"]["name"]
    rjob, _, pod = _pods(manifest)
    annotations = {"jobset.sigs.k8s.io/jobset-name": name,
                   "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                   "jobset.sigs.k8s.io/job-index": "0", "jobset.sigs.k8s.io/job-global-index": "0"}
    env = dict(base)
    for var in pod["containers"][0]["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            m = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path)
            assert m, path
            env[var["name"]] = annotations[m.group(1)]
    env.update(JOB_COMPLETION_INDEX=str(index), HOSTNAME=f"{name}-{rjob['name']}-0-{index}",
               KUBERNETES_SERVICE_HOST="10.0.0.1")
    return env


def _run_pods(manifest, coordinator):
    """Starts every pod of the (single) replicated job; fails fast like the JobSet."""
    _, job, pod = _pods(manifest)
    base = {k: v for k, v in os.environ.items()
            if not re.match(r"(SLURM_|OMPI_|JOB_|JAXLEARN_|JAX_COORD)", k)}
    procs = []
    for i in range(job["parallelism"]):
        env = _pod_env(manifest, i, base)
        env["JAXLEARN_COORDINATOR_ADDRESS"] = coordinator  # The DNS name is not served here.
        procs.append(subprocess.Popen(pod["containers"][0]["command"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=400)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], logs


@pytest.fixture(scope="module")
def k8s_run(tmp_path_factory, env_for_children, reference):
    """Steps 1-2 in one process (8 devices), then `jaxlearn launch k8s` pods resume 3-4 in
    two processes (4 devices each)."""
    work = tmp_path_factory.mktemp("k8s")
    out, manifest_path = str(work / "run"), str(work / "jobset.yaml")
    assert main(["train", *COMMON, "--output_dir", out, "--max_step", "2"]) == 0
    assert main(["launch", "k8s", "--name", "tiny", "--image", "example.com/jaxlearn:test",
                 "--num_processes", "2", "--entrypoint", ENTRYPOINT, *TIMEOUTS,
                 "--output", manifest_path, "--", "train", *COMMON, "--output_dir", out,
                 "--max_step", "4"]) == 0
    manifest = check_jobset(check_yaml(Path(manifest_path).read_text()))
    t0 = time.monotonic()
    codes, logs = _run_pods(manifest, f"127.0.0.1:{free_port()}")
    seconds = time.monotonic() - t0
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    print(f"k8s pods (2 processes x 4 devices, resume + 2 steps): {seconds:.1f}s")
    return {"out": out, "manifest": manifest, "logs": logs}


def test_k8s_pods_resume_one_process_checkpoint_in_two(k8s_run, reference):
    env = {e["name"]: e for e in _pods(k8s_run["manifest"])[2]["containers"][0]["env"]}
    assert env["JAXLEARN_COORDINATOR_ADDRESS"]["value"] == "tiny-workers-0-0.tiny:8476"
    for i, log in enumerate(k8s_run["logs"]):
        assert f"jaxlearn: process {i} of 2 joined (jobset" in log
        assert "resumed from step 2" in log
    _assert_same_losses(_losses(k8s_run["out"]), reference, [3, 4])


# ---- the generated files --------------------------------------------------------------------


def _sbatch(capsys, *launch_args, selector="gpu-h100-8x4"):
    rc = main(["launch", "slurm", *launch_args, "--", "train", "--experiment", "tiny-llama",
               "--mesh_selector", selector, "--output_dir", "/shared/runs/x",
               "--set", "max_step=100"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    script = captured.out
    options = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", script, re.M))
    srun = shlex.split(script[script.index("\nsrun "):].replace("\\\n", " "))
    return script, options, srun


def test_sbatch_script_for_a_gpu_cluster(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLEARN_CHECKOUT", str(CHECKOUT))  # What tools/jaxlearn sets.
    script, options, srun = _sbatch(
        capsys, "--partition", "a3", "--time", "2:00:00", "--env", "NCCL_DEBUG=WARN",
        "--setup", "source /opt/venv/bin/activate", "--initialization_timeout", "600")
    assert options == {"job-name": "jaxlearn-tiny-llama", "nodes": "4", "ntasks-per-node": "1",
                       "gpus-per-node": "8", "partition": "a3", "time": "2:00:00",
                       "output": "slurm-%x-%j.out", "exclusive": ""}
    assert "\nsource /opt/venv/bin/activate\n" in script
    assert "\nexport NCCL_DEBUG=WARN\n" in script
    assert "\nexport JAXLEARN_INITIALIZATION_TIMEOUT=600\n" in script
    assert srun[:4] == ["srun", "--label", "--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    # The jaxlearn this test runs (the checkout's), by absolute path.
    assert srun[4:] == [str(CHECKOUT / "tools" / "jaxlearn"), "train", "--experiment",
                        "tiny-llama", "--mesh_selector", "gpu-h100-8x4", "--output_dir",
                        "/shared/runs/x", "--set", "max_step=100"]
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    # What each task then sees (rank 13 of 4 nodes x 8 tasks, if one process per GPU).
    _, options, srun = _sbatch(capsys, "--processes_per_node", "8")
    assert options["ntasks-per-node"] == "8" and "--gpus-per-task=1" in srun
    spec = _detect({"SLURM_JOB_ID": "77", "SLURM_PROCID": "13", "SLURM_LOCALID": "5",
                           "SLURM_STEP_NUM_TASKS": "32", "SLURM_STEP_NODELIST": "a3-[0012-0015]"})
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == \
        (f"a3-0012:{77 + 61440}", 32, 13)


def test_sbatch_submit(capsys, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv"
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\necho \"$@\" > {record}\necho 'Submitted batch job 99'\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "slurm", "--submit", "--name", "exp1", "--", "train", "--experiment",
                 "tiny-llama", "--mesh_selector", "gpu-h100-8x2", "--output_dir", "o"]) == 0
    assert "Submitted batch job 99" in capsys.readouterr().out
    assert record.read_text().strip() == "exp1.sbatch"
    assert "#SBATCH --nodes=2" in (tmp_path / "exp1.sbatch").read_text()
    # --log's directory exists before sbatch runs (sbatch does not create it); --wait.
    assert main(["launch", "slurm", "--submit", "--wait", "--name", "exp2", "--log",
                 "logs/a/%x-%j.out", "--", "train", "--experiment", "tiny-llama",
                 "--mesh_selector", "gpu-h100-8x2", "--output_dir", "o"]) == 0
    assert (tmp_path / "logs" / "a").is_dir()
    assert record.read_text().strip() == "--wait exp2.sbatch"
    assert "#SBATCH --output=logs/a/%x-%j.out" in (tmp_path / "exp2.sbatch").read_text()
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert main(["launch", "slurm", "--submit", "--", "train", "--experiment", "tiny-llama",
                 "--mesh_selector", "gpu-h100-8x2", "--output_dir", "o"]) == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err


def _manifest(capsys, *launch_args, selector):
    rc = main(["launch", "k8s", "--name", "llama", "--image", "us-docker.pkg.dev/p/jaxlearn:1",
               *launch_args, "--", "train", "--experiment", "tiny-llama", "--mesh_selector",
               selector, "--output_dir", "/gcs/runs/x"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return check_jobset(check_yaml(captured.out))


def test_jobset_manifest_for_a_tpu_slice(capsys):
    m = _manifest(capsys, "--namespace", "ml", "--env", "LIBTPU_INIT_ARGS=--xla_tpu_foo=1",
                  selector="tpu-v5p-64")  # 64 TensorCores = 32 chips = 8 hosts x 4 chips.
    assert (m["apiVersion"], m["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert m["metadata"]["name"] == "llama" and m["metadata"]["namespace"] == "ml"
    assert m["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    assert m["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "llama",
                                    "publishNotReadyAddresses": True}
    rjob, job, pod = _pods(m)
    assert (rjob["name"], rjob["replicas"]) == ("workers", 1)
    assert (job["parallelism"], job["completions"], job["completionMode"],
            job["backoffLimit"]) == (8, 8, "Indexed", 0)
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "2x4x4"}
    (c,) = pod["containers"]
    assert c["image"] == "us-docker.pkg.dev/p/jaxlearn:1"
    assert c["resources"] == {"limits": {"google.com/tpu": 4}}
    assert c["command"] == ["python3", "-m", "jaxlearn.cli", "train", "--experiment",
                            "tiny-llama", "--mesh_selector", "tpu-v5p-64", "--output_dir",
                            "/gcs/runs/x"]
    assert c["ports"] == [{"name": "coordinator", "containerPort": 8476}]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["JAXLEARN_COORDINATOR_ADDRESS"] == "llama-workers-0-0.llama:8476"
    assert env["JAXLEARN_NUM_PROCESSES"] == "8" and env["LIBTPU_INIT_ARGS"] == "--xla_tpu_foo=1"
    assert env["JOB_INDEX"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}
    # Pod 5 of that JobSet finds its place and process 0's DNS name.
    spec = _detect(_pod_env(m, 5, {}))
    assert (spec.source, spec.coordinator_address, spec.num_processes, spec.process_id) == \
        ("jobset", "llama-workers-0-0.llama:8476", 8, 5)


def test_jobset_manifest_for_a_gpu_node_pool(capsys):
    m = _manifest(capsys, "--cpu", "200", "--memory", "1800Gi", "--node_selector", "pool=a3",
                  selector="gpu-h100-8x2")
    _, job, pod = _pods(m)
    assert job["parallelism"] == 2
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb",
                                   "pool": "a3"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert pod["containers"][0]["resources"] == {
        "limits": {"nvidia.com/gpu": 8}, "requests": {"cpu": "200", "memory": "1800Gi"}}
    assert "annotations" not in m["metadata"]


def test_readme_k8s_example_runs_as_written(tmp_path):
    """The top-level README's `launch k8s` line, word for word (plus --output)."""
    line = next(line for line in (CHECKOUT / "README.md").read_text().splitlines()
                if line.startswith("tools/jaxlearn launch k8s"))
    argv = shlex.split(line.split("#")[0])[1:]
    out = tmp_path / "jobset.yaml"
    assert main([*argv[:2], "--output", str(out), *argv[2:]]) == 0
    m = check_jobset(check_yaml(out.read_text()))
    _, job, pod = _pods(m)
    assert job["parallelism"] == 32  # tpu-v5p-256: 128 chips, 4 per host.
    assert pod["containers"][0]["command"][-2:] == ["--output_dir", "gs://..."]
    assert m["spec"]["failurePolicy"]["maxRestarts"] == 3


def test_jobset_mounts_shared_storage(capsys):
    m = _manifest(capsys, "--pvc", "runs:/runs", "--volume",
                  "gcsfuse.csi.storage.gke.io:/gcs:bucketName=b,mountOptions=implicit-dirs",
                  selector="gpu-h100-8x2")
    _, _, pod = _pods(m)
    assert pod["volumes"][:2] == [
        {"name": "shared-0", "persistentVolumeClaim": {"claimName": "runs"}},
        {"name": "shared-1", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes":
                                     {"bucketName": "b", "mountOptions": "implicit-dirs"}}}]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]


@pytest.mark.parametrize("argv,message", [
    (["slurm", "--", "train", "--experiment", "tiny-llama", "--output_dir", "o"],
     "needs the target's --mesh_selector"),
    (["slurm", "--nodes", "3", "--", "train", "--experiment", "tiny-llama", "--mesh_selector",
      "gpu-h100-8x4", "--output_dir", "o"], "is 32 GPUs, but 3 node(s) x 8 GPU(s) = 24"),
    (["slurm", "--", "train", "--experiment", "tiny-lama", "--mesh_selector", "cpu-8",
      "--output_dir", "o"], "did you mean: tiny-llama"),
    (["k8s", "--image", "i", "--tpu_topology", "2x2x2", "--", "train", "--experiment",
      "tiny-llama", "--mesh_selector", "tpu-v5p-64", "--output_dir", "o"], "is 8 chips"),
    (["k8s", "--image", "i", "--name", "x" * 41, "--", "train", "--experiment", "tiny-llama",
      "--mesh_selector", "cpu-8", "--output_dir", "o"], "1-40 characters"),
    (["k8s", "--image", "i", "--", "serve"], "runs `train`"),
    (["k8s", "--image", "i", "--pvc", "runs", "--", "train", "--experiment", "tiny-llama",
      "--mesh_selector", "cpu-8", "--output_dir", "o"], "expected CLAIM:MOUNT"),
    (["k8s", "--image", "i", "--volume", "gcsfuse.csi.storage.gke.io:/gcs:bucketName", "--",
      "train", "--experiment", "tiny-llama", "--mesh_selector", "cpu-8", "--output_dir", "o"],
     "expected KEY=VALUE"),
    (["local", "--num_processes", "2"], "give the command after --"),
])
def test_launch_usage_errors_are_one_line(capsys, argv, message):
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxlearn: error:") and message in err[0], err


# ---- does the recipe fit its target? --------------------------------------------------------


def test_launch_checks_that_a_tiny_recipe_fits(capsys, fit_cache):
    assert main(["launch", "k8s", "--image", "i", "--", "train", "--experiment", "tiny-llama",
                 "--mesh_selector", "cpu-8", "--output_dir", "o"]) == 0
    err = capsys.readouterr().err
    m = re.search(r"tiny-llama on cpu-8 fits: at least (\S+) (\S+) per device \(state .*"
                  r"gradients .*activations kept for the backward pass .*\) of 15.20 GiB "
                  r"usable \(0.95 x 16.00 GiB HBM\)", err)
    assert m and m.group(2) in ("KiB", "MiB"), err
    assert len(list(fit_cache.glob("*.json"))) >= 1


def test_launch_aot_check_uses_the_compiled_step(capsys):
    """--aot_check: `jaxlearn aot`'s compiled requirement instead of the floor."""
    assert main(["launch", "k8s", "--image", "i", "--aot_check", "--", "train", "--experiment",
                 "tiny-llama", "--mesh_selector", "cpu-8", "--output_dir", "o"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"tiny-llama on cpu-8 fits: the compiled step needs \S+ \S+ per device "
                     r"\(temporaries .*, arguments .*\) of 15.20 GiB usable", err), err


# tiny-llama with 131072 x 128 tokens per step: 2M tokens per CPU device, whose saved
# activations (no remat) exceed the 16 GiB the catalogue gives a CPU device.
TOO_BIG = ["--set", "input.global_batch_size=131072"]


def test_launch_refuses_a_recipe_that_does_not_fit(capsys, tmp_path):
    """Over the floor: refused in one line, --force warns and writes, --no_fit_check does
    not look."""
    train = ["--", "train", "--experiment", "tiny-llama", "--mesh_selector", "cpu-8",
             "--output_dir", "/shared/runs/tiny", *TOO_BIG]
    script = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", "--script", str(script), *train]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxlearn: error: tiny-llama on cpu-8 "
                                                "does not fit: at least "), err
    required = float(re.search(r"at least ([\d.]+) GiB per device", err[0]).group(1))
    assert required > 16 and "of 15.20 GiB usable (0.95 x 16.00 GiB HBM)" in err[0]
    assert "--force" in err[0] and "jaxlearn plan" in err[0] and not script.exists()
    t0 = time.monotonic()
    assert main(["launch", "slurm", "--force", "--script", str(script), *train]) == 0
    assert time.monotonic() - t0 < 20  # Cached.
    err = capsys.readouterr().err
    assert "WARNING (--force): tiny-llama on cpu-8 does not fit" in err
    assert script.is_file()
    assert main(["launch", "slurm", "--no_fit_check", *train]) == 0
    assert "fit" not in capsys.readouterr().err


def test_launch_uses_the_recorded_aot_matrix(capsys, tmp_path, monkeypatch, env_for_children):
    """A pair recorded by `jaxlearn aot-matrix run` (a real `jaxlearn aot` compile) answers
    the fit check with the compiled figure: refused without --force; a config changed since
    the compile makes the entry stale and the floor answers again."""
    from jaxlearn.experiments import aot_matrix, recipes

    matrix = tmp_path / "aot_matrix.json"
    sets = TOO_BIG[1::2]
    assert main(["aot-matrix", "run", "--matrix", str(matrix), "--experiment", "tiny-llama",
                 "--mesh_selector", "cpu-8", *TOO_BIG]) == 1
    assert capsys.readouterr().out.startswith("NO        tiny-llama@cpu-8 --set input.")
    entry = aot_matrix.lookup(str(matrix), "tiny-llama", "cpu-8", sets)
    assert entry is not None and entry["fits"] is False, entry
    assert entry["required_bytes"] > 16 * 2**30
    assert entry["mesh"]["data"] == 8 and entry["params_bytes"] > 0
    train = ["--", "train", "--experiment", "tiny-llama", "--mesh_selector", "cpu-8",
             "--output_dir", "o", *TOO_BIG]
    # The file comes from --aot_matrix (the default, $JAXLEARN_AOT_MATRIX, holds none).
    assert main(["launch", "k8s", "--image", "i", "--aot_matrix", str(matrix), *train]) == 2
    err = capsys.readouterr().err
    need = entry["required_bytes"] / 2**30
    assert f"tiny-llama on cpu-8 does not fit: the compiled step (AOT matrix) " \
           f"needs {need:.2f} GiB per device (params " in err, err
    monkeypatch.setenv("JAXLEARN_AOT_MATRIX", str(matrix))  # The default flag value.
    assert main(["launch", "k8s", "--image", "i", "--force", *train]) == 0
    assert "WARNING (--force): tiny-llama on cpu-8 does not fit: the compiled step (AOT " \
           "matrix)" in capsys.readouterr().err
    assert main(["aot-matrix", "render", "--output", str(tmp_path / "m.md")]) == 0
    table = (tmp_path / "m.md").read_text()
    assert "| tiny-llama@cpu-8 --set input.global_batch_size=131072 | data8 | 1 |" in table
    assert "(stale)" not in table
    original = recipes.EXPERIMENTS["tiny-llama"]

    def edited():
        cfg = original()
        cfg.learner.learning_rate = 1e-4
        return cfg

    monkeypatch.setitem(recipes.EXPERIMENTS, "tiny-llama", edited)
    assert aot_matrix.lookup(str(matrix), "tiny-llama", "cpu-8", sets) is None
    assert "(stale)" in aot_matrix.render(str(matrix))
    assert main(["launch", "k8s", "--image", "i", *train]) == 2
    assert "does not fit: at least " in capsys.readouterr().err


# ---- failures -------------------------------------------------------------------------------


def test_launch_local_fails_fast_and_names_the_process(capsys, env_for_children, tmp_path):
    # Process 1 fails only once process 0 has printed (a marker file), so both lines are
    # there to check whatever order the processes start in.
    marker = tmp_path / "zero_printed"
    code = ("import os, pathlib, sys, time\n"
            f"marker = pathlib.Path({str(marker)!r})\n"
            "i = int(os.environ['JAXLEARN_PROCESS_ID'])\n"
            "print('hello from', i, flush=True)\n"
            "if i == 0:\n"
            "    marker.touch(); time.sleep(300)\n"
            "deadline = time.monotonic() + 20\n"
            "while not marker.exists() and time.monotonic() < deadline:\n"
            "    time.sleep(0.05)\n"
            "sys.exit(5)\n")
    t0 = time.monotonic()
    assert main(["launch", "local", "--num_processes", "2", "--", sys.executable, "-c",
                 code]) == 5
    elapsed = time.monotonic() - t0
    captured = capsys.readouterr()
    assert "[0] hello from 0" in captured.out and "[1] hello from 1" in captured.out
    assert "process 1 failed (exit status 5, before joining)" in captured.err
    assert "stopped: 0" in captured.err
    assert elapsed < 30, elapsed


def _train_alone(tmp_path, *flags):
    out = tmp_path / "never"
    return out, subprocess.Popen(
        [sys.executable, "-m", "jaxlearn.cli", "train", *COMMON, "--output_dir", str(out),
         "--initialization_timeout", "5", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_missing_peer_is_reported_in_one_line_within_the_timeout(tmp_path, env_for_children):
    """Process 0 of 2 without its peer, and process 1 of 2 without the coordinator: both
    give up after the 5 s initialization timeout, naming who is missing; nothing written."""
    with socket.socket() as s:  # A port nobody listens on, for the lonely process 1.
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    t0 = time.monotonic()
    out0, p0 = _train_alone(tmp_path / "a", "--num_processes", "2", "--process_id", "0",
                            "--coordinator_address", f"127.0.0.1:{free_port()}")
    out1, p1 = _train_alone(tmp_path / "b", "--num_processes", "2", "--process_id", "1",
                            "--coordinator_address", f"127.0.0.1:{dead}")
    (_, err0), (_, err1) = p0.communicate(timeout=180), p1.communicate(timeout=180)
    elapsed = time.monotonic() - t0
    for p, err, want in (
        (p0, err0, "process 0 of 2: distributed initialization failed: process(es) 1 of 2 "
                   "did not join within 5s (joined: 0)"),
        (p1, err1, "process 1 of 2: distributed initialization failed: the coordinator "
                   f"(process 0) at 127.0.0.1:{dead} did not answer within 5s"),
    ):
        errors = [line for line in err.splitlines() if line.startswith("jaxlearn: error:")]
        assert p.returncode == 3 and len(errors) == 1 and want in errors[0], err[-3000:]
    assert not out0.exists() and not out1.exists()
    assert elapsed < 5 + 60, elapsed  # Timeout + start-up of two interpreters under load.


def test_half_described_cluster_is_a_usage_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")  # An Indexed Job pod, but how many?
    assert main(["train", *COMMON, "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "set JAXLEARN_NUM_PROCESSES" in err[0], err
