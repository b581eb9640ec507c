"""`jaxlearn launch`: run `jaxlearn train` as a multi-process job, and its start-up flags.

    jaxlearn launch local --num_processes 2 --devices_per_process 4 -- train --experiment ...
    jaxlearn launch slurm [--partition P --time 4:00:00 ...] [--script F] [--submit] -- train ...
    jaxlearn launch k8s --name NAME --image IMAGE [--output F] -- train ...
    jaxlearn train ... [--coordinator_address H:P --num_processes N --process_id I]

`local` starts the processes on this machine (CPU devices, gloo collectives), prefixes their
output with `[i]`, and fails fast: when one process fails the others are stopped at once and
the report names the failed process and those that never joined. `--emulate slurm|k8s|ompi`
describes the processes with those schedulers' real variables instead of JAXLEARN_* ones.
Anything after `--` that is not a jaxlearn command runs as given (`-- python script.py`).

`slurm` writes an sbatch script and `k8s` a JobSet manifest (YAML) for the hardware named by
the train command's `--mesh_selector` (e.g. `gpu-h100-8x4`: 4 nodes x 8 GPUs, one process per
node; `tpu-v5p-64`: 8 TPU VMs x 4 chips). Both validate the train command (experiment, mesh
rules, --set) first. On Slurm `srun --kill-on-bad-exit=1` and on Kubernetes the JobSet's
failure policy stop the other processes when one fails; `jaxlearn train` in each process
finds its place from the scheduler's variables (jaxlearn.launch.distributed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
from typing import Any, Optional, Sequence

EXIT_DISTRIBUTED = 3
DEFAULT_ENTRYPOINT = "python3 -m jaxlearn.cli"
REPLICATED_JOB = "workers"

# GKE node labels per catalogue kind.
_TPU_ACCELERATOR = {"tpu-v4": "tpu-v4-podslice", "tpu-v5p": "tpu-v5p-slice",
                    "tpu-v5e": "tpu-v5-lite-podslice", "tpu-v6e": "tpu-v6e-slice"}
_TPU_3D = ("tpu-v4", "tpu-v5p")
_GPU_ACCELERATOR = {"gpu-h100": "nvidia-h100-80gb", "gpu-h200": "nvidia-h200-141gb",
                    "gpu-b200": "nvidia-b200"}


def _usage(message: str) -> Exception:
    from jaxlearn.cli.main import UsageError  # main imports this module: import late.

    return UsageError(message)


# ---- `jaxlearn train` start-up flags -------------------------------------------------------


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """Multi-process flags of `jaxlearn train` (each also readable from the environment)."""
    g = p.add_argument_group(
        "multi-process", "Default: detected from Slurm, Open MPI, Kubernetes/JobSet or "
        "JAXLEARN_* variables (see `jaxlearn launch`); one process if none are set.")
    g.add_argument("--coordinator_address", default=None, metavar="HOST:PORT",
                   help="process 0's address, the same for every process")
    g.add_argument("--num_processes", type=int, default=None)
    g.add_argument("--process_id", type=int, default=None)
    g.add_argument("--local_device_ids", default=None, metavar="I,J,...",
                   help="accelerators this process uses (default: all local ones)")
    g.add_argument("--initialization_timeout", type=float, default=None, metavar="SECONDS",
                   help="give up (naming the missing processes) if not all have joined "
                        "(default: $JAXLEARN_INITIALIZATION_TIMEOUT or 300)")
    g.add_argument("--heartbeat_timeout", type=float, default=None, metavar="SECONDS",
                   help="a process silent this long is dead (default: "
                        "$JAXLEARN_HEARTBEAT_TIMEOUT or 100)")
    g.add_argument("--num_cpu_devices", type=int, default=None,
                   help="CPU devices per process (CPU runs and tests)")


def start_distributed(args: argparse.Namespace) -> Any:
    """Joins the process group `args` and the environment describe (before any JAX use)."""
    from jaxlearn.launch import distributed

    ids = None
    if args.local_device_ids:
        try:
            ids = [int(x) for x in args.local_device_ids.split(",")]
        except ValueError:
            raise _usage(f"--local_device_ids {args.local_device_ids!r}: expected I,J,...") \
                from None
    try:
        return distributed.initialize(
            args.coordinator_address, args.num_processes, args.process_id, ids,
            initialization_timeout=args.initialization_timeout,
            heartbeat_timeout=args.heartbeat_timeout,
            num_cpu_devices=args.num_cpu_devices,
        )
    except distributed.ClusterConfigError as e:
        raise _usage(str(e)) from None
    except distributed.DistributedError as e:
        print(f"jaxlearn: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_DISTRIBUTED) from None


# ---- the `launch` parsers ------------------------------------------------------------------


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("launch", help="run `jaxlearn train` as a multi-process job: here, "
                                      "on Slurm or on Kubernetes (JobSet)")
    where = p.add_subparsers(dest="launcher", required=True, metavar="WHERE")

    q = where.add_parser("local", help="N processes on this machine (CPU devices, gloo)")
    q.add_argument("--num_processes", type=int, required=True)
    q.add_argument("--devices_per_process", type=int, default=None,
                   help="CPU devices per process (sets JAX_PLATFORMS=cpu)")
    q.add_argument("--emulate", choices=("jaxlearn", "slurm", "k8s", "ompi"),
                   default="jaxlearn", help="describe the processes with these variables")
    q.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    q.add_argument("--kill_grace", type=float, default=2.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the others")
    _add_command(q)

    q = where.add_parser("slurm", help="write (and --submit) an sbatch script")
    _add_cluster_args(q)
    q.add_argument("--nodes", type=int, default=None, help="default: from --mesh_selector")
    q.add_argument("--processes_per_node", type=int, default=None,
                   help="default 1 (one process drives all the accelerators of its node)")
    q.add_argument("--gpus_per_node", type=int, default=None)
    q.add_argument("--partition", default=None)
    q.add_argument("--account", default=None)
    q.add_argument("--time", default=None, help="time limit, e.g. 4:00:00")
    q.add_argument("--cpus_per_task", type=int, default=None)
    q.add_argument("--no_exclusive", action="store_true", help="share nodes with other jobs")
    q.add_argument("--setup", action="append", default=[], metavar="SHELL",
                   help="a line run before srun, e.g. 'source ~/venv/bin/activate'")
    q.add_argument("--log", default=None,
                   help="sbatch --output (default: slurm-%%x-%%j.out in the submit directory)")
    q.add_argument("--script", default=None,
                   help="write the script here (default: stdout; with --submit, NAME.sbatch)")
    q.add_argument("--submit", action="store_true", help="submit it with sbatch")
    _add_command(q)

    q = where.add_parser("k8s", help="write a Kubernetes JobSet manifest (YAML)")
    _add_cluster_args(q)
    q.add_argument("--image", required=True, help="container image with jaxlearn installed")
    q.add_argument("--namespace", default=None)
    q.add_argument("--num_processes", type=int, default=None,
                   help="pods (default: from --mesh_selector; CPU targets: 1)")
    q.add_argument("--tpu_topology", default=None,
                   help="GKE TPU topology, e.g. 2x2x2 (default: derived from the chip count)")
    q.add_argument("--node_selector", action="append", default=[], metavar="KEY=VALUE",
                   help="extra/overriding pod nodeSelector entries (repeatable)")
    q.add_argument("--cpu", default=None, help="CPU request per pod, e.g. 8")
    q.add_argument("--memory", default=None, help="memory request per pod, e.g. 64Gi")
    q.add_argument("--max_restarts", type=int, default=0,
                   help="JobSet restarts of the whole set after a failure")
    q.add_argument("--service_account", default=None)
    q.add_argument("--output", default=None, help="write the manifest here (default: stdout)")
    _add_command(q)


def _add_cluster_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--name", default=None, help="job name (default: jaxlearn-EXPERIMENT)")
    q.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for every process (repeatable)")
    q.add_argument("--coordinator_port", type=int, default=None,
                   help="default: derived from the Slurm job id; 8476 on Kubernetes")
    q.add_argument("--initialization_timeout", type=float, default=None,
                   help="seconds for all processes to join (default 300)")
    q.add_argument("--heartbeat_timeout", type=float, default=None,
                   help="seconds of silence after which a process is dead (default 100)")
    q.add_argument("--entrypoint", default=DEFAULT_ENTRYPOINT,
                   help="how the cluster runs jaxlearn (default: %(default)s)")


def _add_command(q: argparse.ArgumentParser) -> None:
    q.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="`train ...` (a jaxlearn command) or any program")


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise _usage(f"launch {args.launcher}: give the command after --, e.g. "
                     "`-- train --experiment tiny-llama --output_dir runs/x`")
    return cmd


def _is_jaxlearn_command(name: str) -> bool:
    from jaxlearn.cli.main import COMMANDS

    return name in COMMANDS and name != "launch"


# ---- launch local --------------------------------------------------------------------------


def cmd_launch(args: argparse.Namespace) -> int:
    return {"local": _local, "slurm": _slurm, "k8s": _k8s}[args.launcher](args)


def _local(args: argparse.Namespace) -> int:
    from jaxlearn.launch import local as local_launch

    cmd = _command(args)
    if _is_jaxlearn_command(cmd[0]):
        from jaxlearn.cli.main import build_parser

        build_parser().parse_args(cmd)  # Usage errors once, here, not N times.
        cmd = [sys.executable, "-m", "jaxlearn.cli", *cmd]
    if args.num_processes < 1:
        raise _usage(f"--num_processes must be >= 1, got {args.num_processes}")
    print(f"jaxlearn launch: {args.num_processes} process(es)"
          + (f" x {args.devices_per_process} CPU device(s)" if args.devices_per_process else "")
          + f" on this machine ({args.emulate} variables): {shlex.join(cmd)}",
          file=sys.stderr, flush=True)
    result = local_launch.launch_local(
        cmd, args.num_processes, devices_per_process=args.devices_per_process,
        style=args.emulate, port=args.port, kill_grace=args.kill_grace)
    return result.returncode


# ---- the train command of a cluster job ----------------------------------------------------


class _Target:
    """What a cluster job runs: the validated train argv and its hardware."""

    def __init__(self, args: argparse.Namespace):
        from jaxlearn.cli.main import build_parser, final_config
        from jaxlearn.mesh import get_hardware, parse_selector
        from jaxlearn.mesh.errors import MeshError

        cmd = _command(args)
        if cmd[0] != "train":
            raise _usage(f"launch {args.launcher} runs `train`, got {cmd[0]!r}")
        train = build_parser().parse_args(cmd)
        if not train.mesh_selector:
            raise _usage(f"launch {args.launcher}: the train command needs the target's "
                         "--mesh_selector (e.g. gpu-h100-8x4, tpu-v5p-64, cpu-8)")
        try:
            kind, devices = parse_selector(train.mesh_selector)
        except MeshError as e:
            raise _usage(str(e)) from None
        final_config(train.experiment, train.mesh_selector, train.overrides)  # Validates.
        self.argv = cmd
        self.experiment: str = train.experiment
        self.selector: str = train.mesh_selector
        self.kind = kind
        self.devices = devices
        self.spec = get_hardware(kind)
        self.name = _job_name(args.name or f"jaxlearn-{train.experiment}")

    def command(self, entrypoint: str, cpu_devices: Optional[int]) -> list[str]:
        argv = list(self.argv)
        if cpu_devices is not None and "--num_cpu_devices" not in argv:
            argv += ["--num_cpu_devices", str(cpu_devices)]
        return [*shlex.split(entrypoint), *argv]


def _job_name(name: str) -> str:
    clean = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not clean or len(clean) > 40:
        raise _usage(f"--name {name!r}: need 1-40 characters of a-z, 0-9 and '-' (pod host "
                     "names <name>-workers-J-P must stay within 63)")
    return clean


def _env_pairs(items: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise _usage(f"--env {item!r}: expected KEY=VALUE")
        pairs.append((key, value))
    return pairs


def _timeouts(args: argparse.Namespace) -> list[tuple[str, str]]:
    out = []
    if args.initialization_timeout is not None:
        out.append(("JAXLEARN_INITIALIZATION_TIMEOUT", f"{args.initialization_timeout:g}"))
    if args.heartbeat_timeout is not None:
        out.append(("JAXLEARN_HEARTBEAT_TIMEOUT", f"{args.heartbeat_timeout:g}"))
    return out


def _write(text: str, path: Optional[str], what: str) -> None:
    if path is None:
        sys.stdout.write(text)
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise _usage(f"{path}: cannot write the {what} ({e.strerror})") from None
    print(f"jaxlearn launch: wrote {path}", file=sys.stderr)


# ---- launch slurm --------------------------------------------------------------------------


def slurm_script(args: argparse.Namespace, target: _Target) -> str:
    """The sbatch script for `target` (see `jaxlearn launch slurm --help`)."""
    spec = target.spec
    ppn = args.processes_per_node or 1
    gpus = args.gpus_per_node
    cpu_devices: Optional[int] = None
    if spec.platform == "gpu":
        per_host = spec.devices_per_host or target.devices
        gpus = gpus or min(per_host, target.devices)
        nodes = args.nodes or math.ceil(target.devices / gpus)
        if nodes * gpus != target.devices:
            raise _usage(f"{target.selector} is {target.devices} GPUs, but {nodes} node(s) x "
                         f"{gpus} GPU(s) = {nodes * gpus}")
        if gpus % ppn:
            raise _usage(f"--processes_per_node {ppn} does not divide {gpus} GPUs per node")
    elif spec.platform == "cpu":
        nodes = args.nodes or 1
        if target.devices % (nodes * ppn):
            raise _usage(f"{target.selector}: {target.devices} CPU devices do not split over "
                         f"{nodes * ppn} process(es)")
        cpu_devices = target.devices // (nodes * ppn)
    else:  # TPU VMs or Trainium hosts scheduled by Slurm: whole hosts.
        per_host = spec.devices_per_host or target.devices
        nodes = args.nodes or max(1, math.ceil(target.devices / per_host))
    lines = [
        "#!/bin/bash",
        f"# Generated by `jaxlearn launch slurm` on {datetime.date.today().isoformat()}: "
        f"{target.experiment} on {target.selector} ({nodes * ppn} process(es)).",
        f"#SBATCH --job-name={target.name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={ppn}",
    ]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    for flag, value in (("--cpus-per-task", args.cpus_per_task), ("--partition", args.partition),
                        ("--account", args.account), ("--time", args.time),
                        ("--output", args.log)):
        if value is not None:
            lines.append(f"#SBATCH {flag}={value}")
    if not args.no_exclusive:
        lines.append("#SBATCH --exclusive")
    lines += ["", "set -euo pipefail", *args.setup]
    env = _env_pairs(args.env) + _timeouts(args)
    if args.coordinator_port is not None:
        env.append(("JAXLEARN_COORDINATOR_PORT", str(args.coordinator_port)))
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env]
    srun = ["srun", "--kill-on-bad-exit=1", f"--ntasks-per-node={ppn}"]
    if gpus and ppn > 1:
        srun.append(f"--gpus-per-task={gpus // ppn}")
    command = target.command(args.entrypoint, cpu_devices)
    lines += [
        "",
        "# Every task finds its rank and the coordinator (first node) from SLURM_PROCID,",
        "# SLURM_STEP_NUM_TASKS and SLURM_STEP_NODELIST; one failed task ends the step.",
        shlex.join(srun) + " \\",
        "    " + shlex.join(command),
        "",
    ]
    return "\n".join(lines)


def _slurm(args: argparse.Namespace) -> int:
    target = _Target(args)
    text = slurm_script(args, target)
    path = args.script or (f"{target.name}.sbatch" if args.submit else None)
    _write(text, path, "sbatch script")
    if not args.submit:
        return 0
    assert path is not None
    try:
        done = subprocess.run(["sbatch", path], capture_output=True, text=True)
    except FileNotFoundError:
        raise _usage("--submit: sbatch is not on PATH (run this on a Slurm login node, or "
                     f"copy {path} there)") from None
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.returncode:
        print(f"jaxlearn: error: sbatch {path} failed (exit status {done.returncode})",
              file=sys.stderr)
        return 1
    return 0


# ---- launch k8s ----------------------------------------------------------------------------


def tpu_topology(kind: str, chips: int) -> str:
    """GKE's name for a slice of `chips` (a power of two): 3-D for v4/v5p (2x2x1, 2x2x2,
    2x2x4, 2x4x4, 4x4x4, ...), 2-D for v5e/v6e (1x1, 2x2, 2x4, 4x4, 4x8, ...)."""
    k = chips.bit_length() - 1
    if chips < 1 or 2**k != chips:
        raise _usage(f"{chips} TPU chips is not a power of two: give --tpu_topology")
    if kind in _TPU_3D:
        dims = sorted(2 ** ((k + i) // 3) for i in range(3))
        dims = [d for d in dims if d > 1] + [d for d in dims if d == 1]
    else:
        dims = [2 ** (k // 2), 2 ** (k - k // 2)]
    return "x".join(str(d) for d in dims)


def jobset_manifest(args: argparse.Namespace, target: _Target) -> dict[str, Any]:
    """The JobSet for `target` as a dict (see `jaxlearn launch k8s --help`)."""
    spec = target.spec
    limits: dict[str, Any] = {}
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, str]] = []
    annotations: dict[str, str] = {}
    cpu_devices: Optional[int] = None
    if spec.platform == "tpu":
        per_host = min(spec.devices_per_host or target.devices, target.devices)
        processes = target.devices // per_host
        topology = args.tpu_topology or tpu_topology(target.kind, target.devices)
        product = math.prod(int(d) for d in topology.split("x"))
        if product != target.devices:
            raise _usage(f"--tpu_topology {topology} is {product} chips; {target.selector} "
                         f"is {target.devices}")
        limits["google.com/tpu"] = per_host
        node_selector["cloud.google.com/gke-tpu-accelerator"] = _TPU_ACCELERATOR[target.kind]
        node_selector["cloud.google.com/gke-tpu-topology"] = topology
        tolerations.append({"key": "google.com/tpu", "operator": "Exists",
                            "effect": "NoSchedule"})
        # One slice per node pool: no other job's pods on this slice's hosts.
        annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] = \
            "cloud.google.com/gke-nodepool"
    elif spec.platform == "gpu":
        per_host = min(spec.devices_per_host or target.devices, target.devices)
        processes = math.ceil(target.devices / per_host)
        limits["nvidia.com/gpu"] = per_host
        if target.kind in _GPU_ACCELERATOR:
            node_selector["cloud.google.com/gke-accelerator"] = _GPU_ACCELERATOR[target.kind]
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists",
                            "effect": "NoSchedule"})
    elif spec.platform == "neuron":
        per_host = min(spec.devices_per_host or target.devices, target.devices)
        processes = math.ceil(target.devices / per_host)
        limits["aws.amazon.com/neuron"] = max(1, per_host // 4)  # 4 logical cores per chip.
    else:
        processes = args.num_processes or 1
        if target.devices % processes:
            raise _usage(f"{target.selector}: {target.devices} CPU devices do not split over "
                         f"{processes} pod(s)")
        cpu_devices = target.devices // processes
    if args.num_processes is not None and args.num_processes != processes:
        raise _usage(f"--num_processes {args.num_processes}: {target.selector} needs "
                     f"{processes} pod(s)")
    for item in args.node_selector:
        key, sep, value = item.partition("=")
        if not sep:
            raise _usage(f"--node_selector {item!r}: expected KEY=VALUE")
        node_selector[key] = value
    name = target.name
    port = args.coordinator_port or 8476
    env: list[dict[str, Any]] = [
        {"name": "JAXLEARN_COORDINATOR_ADDRESS",
         "value": f"{name}-{REPLICATED_JOB}-0-0.{name}:{port}"},
        {"name": "JAXLEARN_NUM_PROCESSES", "value": str(processes)},
        {"name": "JAXLEARN_PROCESSES_PER_JOB", "value": str(processes)},
    ]
    for var, key in (("JOBSET_NAME", "jobset-name"),
                     ("REPLICATED_JOB_NAME", "replicatedjob-name"),
                     ("JOB_INDEX", "job-index"), ("JOB_GLOBAL_INDEX", "job-global-index")):
        env.append({"name": var, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['jobset.sigs.k8s.io/{key}']"}}})
    env += [{"name": k, "value": v} for k, v in _timeouts(args) + _env_pairs(args.env)]
    requests = {k: v for k, v in (("cpu", args.cpu), ("memory", args.memory)) if v}
    resources: dict[str, Any] = {}
    if limits:
        resources["limits"] = dict(limits)
    if requests:
        resources["requests"] = requests
    container: dict[str, Any] = {
        "name": "jaxlearn",
        "image": args.image,
        "command": target.command(args.entrypoint, cpu_devices),
        "ports": [{"name": "coordinator", "containerPort": port}],
        "env": env,
    }
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {"restartPolicy": "Never"}
    if args.service_account:
        pod["serviceAccountName"] = args.service_account
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    pod["containers"] = [container]
    metadata: dict[str, Any] = {"name": name, "labels": {
        "app.kubernetes.io/name": "jaxlearn", "jaxlearn/experiment": _label(target.experiment),
        "jaxlearn/mesh-selector": _label(target.selector)}}
    if args.namespace:
        metadata["namespace"] = args.namespace
    if annotations:
        metadata["annotations"] = annotations
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            # A headless Service named <subdomain> gives every pod the DNS name
            # <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>, published before the
            # pods are ready so that process 0's address resolves during start-up.
            "network": {"enableDNSHostnames": True, "subdomain": name,
                        "publishNotReadyAddresses": True},
            # Any failed pod fails its Job (backoffLimit 0) and so the JobSet, which stops
            # every other pod (and restarts them all, up to maxRestarts times).
            "failurePolicy": {"maxRestarts": args.max_restarts},
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {"spec": {
                    "parallelism": processes,
                    "completions": processes,
                    "completionMode": "Indexed",
                    "backoffLimit": 0,
                    "template": {"spec": pod},
                }},
            }],
        },
    }


def _label(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", value)[:63].strip("-_.")


def _k8s(args: argparse.Namespace) -> int:
    target = _Target(args)
    manifest = jobset_manifest(args, target)
    header = (f"# Generated by `jaxlearn launch k8s` on {datetime.date.today().isoformat()}: "
              f"{target.experiment} on {target.selector}.\n# kubectl apply -f <this file>  "
              "(needs the JobSet controller: https://jobset.sigs.k8s.io)\n")
    _write(header + to_yaml(manifest), args.output, "JobSet manifest")
    return 0


# ---- a small YAML emitter (block style; strings quoted unless plainly safe) ----------------

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./:@-]*")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in _RESERVED and not text.endswith(":"):
        return text
    return json.dumps(text)  # A JSON string is a valid YAML double-quoted scalar.


def to_yaml(obj: Any, indent: int = 0) -> str:
    """Block-style YAML of dicts, lists and scalars; parses back (PyYAML or any YAML 1.2
    reader) to `obj`."""
    pad = " " * indent
    if isinstance(obj, dict):
        if not obj:
            return pad + "{}\n"
        out = []
        for key, value in obj.items():
            k = _scalar(str(key))
            if isinstance(value, (dict, list)) and value:
                out.append(f"{pad}{k}:\n")
                out.append(to_yaml(value, indent + (2 if isinstance(value, dict) else 0)))
            else:
                out.append(f"{pad}{k}: {_inline(value)}\n")
        return "".join(out)
    if isinstance(obj, list):
        if not obj:
            return pad + "[]\n"
        out = []
        for item in obj:
            if isinstance(item, (dict, list)) and item:
                body = to_yaml(item, indent + 2)
                out.append(f"{pad}- {body[indent + 2:]}")
            else:
                out.append(f"{pad}- {_inline(item)}\n")
        return "".join(out)
    return pad + _scalar(obj) + "\n"


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


COMMANDS = {"launch": cmd_launch}

__all__ = ["COMMANDS", "add_distributed_args", "add_parsers", "jobset_manifest",
           "slurm_script", "start_distributed", "to_yaml", "tpu_topology"]
