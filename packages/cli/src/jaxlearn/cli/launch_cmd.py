"""`jaxlearn launch`: run `jaxlearn train` as a multi-process job, and its start-up flags.

    jaxlearn launch local --num_processes 2 --devices_per_process 4 -- train --experiment ...
    jaxlearn launch slurm [--partition P --time 4:00:00 ...] [--script F] [--submit] -- train ...
    jaxlearn launch k8s --name NAME --image IMAGE [--output F] -- train ...

`local` starts the processes on this machine (CPU devices, gloo collectives), prefixes their
output with `[i]`, and fails fast: when one process fails the others are stopped at once and
the report names the failed process and those that never joined. `--emulate slurm|k8s|ompi`
describes the processes with those schedulers' real variables instead of JAXLEARN_* ones.
Anything after `--` that is not a jaxlearn command runs as given (`-- python script.py`).

`slurm` writes an sbatch script and `k8s` a JobSet manifest (YAML) for the hardware named by
the train command's `--mesh_selector` (e.g. `gpu-h100-8x4`: 4 nodes x 8 GPUs, one process per
node; `tpu-v5p-64`: 8 TPU VMs x 4 chips). Both validate the train command (experiment, mesh
rules, --set) first, then check that the recipe fits the target's memory
(`jaxlearn.experiments.aot_matrix.check_fit`: a fresh entry of the AOT matrix file
`--aot_matrix`, else `jaxlearn.aot.fit`'s floor, cached): over the floor is a usage error
(exit 2, one line) unless `--force` (a loud warning) or `--no_fit_check`. The Slurm
script runs the jaxlearn this command runs, by absolute path
(`jaxlearn.launch.job.same_jaxlearn`). On Slurm `srun --kill-on-bad-exit=1` and on
Kubernetes the JobSet's failure policy stop the other processes when one fails; `jaxlearn
train` in each process finds its place from the scheduler's variables (jaxlearn.launch.cluster).

This module parses the flags, builds the option dataclasses and writes the files; the
scripts and manifests come from `jaxlearn.launch.slurm` and `jaxlearn.launch.k8s`. The
train command's own multi-process flags are train's (`train_cmd.add_distributed_args`).
A jaxlearn command after `--` is parsed with the `jaxlearn` parser that `main` hands to
`add_parsers` (this module imports no other subcommand's module).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from typing import Any, Callable, Optional, Sequence

from jaxlearn.cli.common import UsageError, checkout_root, default_matrix, final_config
from jaxlearn.experiments import BuildError, aot_matrix
from jaxlearn.launch import k8s, slurm
from jaxlearn.launch import local as local_launch
from jaxlearn.launch.job import (
    DEFAULT_ENTRYPOINT,
    JobSpecError,
    JobTarget,
    job_name,
    same_jaxlearn,
)
from jaxlearn.launch.k8s import Volume
from jaxlearn.mesh import MeshError, get_hardware, parse_selector

# ---- the `launch` parsers ------------------------------------------------------------------


def add_parsers(sub: Any, jaxlearn_parser: Callable[[], argparse.ArgumentParser]) -> None:
    """Adds `launch local|slurm|k8s`; `jaxlearn_parser()` parses the command after `--`."""
    p = sub.add_parser("launch", help="run `jaxlearn train` as a multi-process job: here, "
                                      "on Slurm or on Kubernetes (JobSet)")
    p.set_defaults(jaxlearn_parser=jaxlearn_parser)
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
                   help="the job's output, every line labelled with its rank (sbatch "
                        "--output; relative to the directory sbatch runs in; %%x job name, "
                        "%%j job id; default: slurm-%%x-%%j.out)")
    q.add_argument("--script", default=None,
                   help="write the script here (default: stdout; with --submit, NAME.sbatch)")
    q.add_argument("--submit", action="store_true", help="submit it with sbatch")
    q.add_argument("--wait", action="store_true",
                   help="with --submit: return when the job ends, with its exit status")
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
    q.add_argument("--max_restarts", type=int, default=3,
                   help="JobSet restarts of the whole set after a failure, each resuming "
                        "from the last checkpoint (preemptions do not count; default 3)")
    q.add_argument("--pvc", action="append", default=[], metavar="CLAIM:MOUNT",
                   help="mount PersistentVolumeClaim CLAIM at MOUNT in every pod, e.g. "
                        "shared-runs:/runs (repeatable)")
    q.add_argument("--volume", action="append", default=[],
                   metavar="DRIVER:MOUNT[:KEY=VALUE,...]",
                   help="mount a CSI volume at MOUNT in every pod, e.g. "
                        "gcsfuse.csi.storage.gke.io:/gcs:bucketName=my-bucket (repeatable)")
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
    g = q.add_argument_group(
        "fit check", "Before writing the job: does the recipe fit the target's accelerator "
        "memory? Default: a floor (exact sharded state + gradients + the activations the "
        "backward pass keeps, no compile; cached); refuses (exit 2) when it does not fit.")
    g.add_argument("--aot_check", action="store_true",
                   help="check the compiled train step instead (jaxlearn aot; minutes for "
                        "a 7B model on a CPU; cached)")
    g.add_argument("--force", action="store_true",
                   help="write (and submit) the job even when it does not fit, warning")
    g.add_argument("--no_fit_check", action="store_true", help="skip the check")
    g.add_argument("--aot_matrix", default=None, metavar="FILE",
                   help="recorded compiled verdicts to use when fresh (default: "
                        "$JAXLEARN_AOT_MATRIX, else docs/aot_matrix.json of the checkout: "
                        "$JAXLEARN_CHECKOUT, else the directory with pants.toml from the "
                        "current one upwards; none outside a checkout)")
    q.add_argument("--entrypoint", default=None,
                   help="how the cluster runs jaxlearn (default: Slurm, whose nodes share "
                        "this filesystem: the jaxlearn you ran, by absolute path - an "
                        "installed `jaxlearn` script or the checkout's tools/jaxlearn; "
                        f"Kubernetes: `{DEFAULT_ENTRYPOINT}` in the image)")


def _add_command(q: argparse.ArgumentParser) -> None:
    q.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="`train ...` (a jaxlearn command) or any program")


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError(f"launch {args.launcher}: give the command after --, e.g. "
                         "`-- train --experiment tiny-llama --output_dir runs/x`")
    return cmd


def _is_jaxlearn_command(parser: argparse.ArgumentParser, name: str) -> bool:
    """Whether `name` is a `jaxlearn` subcommand other than `launch`."""
    names = {n for a in parser._actions if isinstance(a, argparse._SubParsersAction)
             for n in a.choices}
    return name in names and name != "launch"


# ---- launch local --------------------------------------------------------------------------


def cmd_launch(args: argparse.Namespace) -> int:
    return {"local": _local, "slurm": _slurm, "k8s": _k8s}[args.launcher](args)


def _local(args: argparse.Namespace) -> int:
    cmd = _command(args)
    parser = args.jaxlearn_parser()
    if _is_jaxlearn_command(parser, cmd[0]):
        parser.parse_args(cmd)  # Usage errors once, here, not N times.
        cmd = [sys.executable, "-m", "jaxlearn.cli", *cmd]
    if args.num_processes < 1:
        raise UsageError(f"--num_processes must be >= 1, got {args.num_processes}")
    print(f"jaxlearn launch: {args.num_processes} process(es)"
          + (f" x {args.devices_per_process} CPU device(s)" if args.devices_per_process else "")
          + f" on this machine ({args.emulate} variables): {shlex.join(cmd)}",
          file=sys.stderr, flush=True)
    result = local_launch.launch_local(
        cmd, args.num_processes, devices_per_process=args.devices_per_process,
        style=args.emulate, port=args.port, kill_grace=args.kill_grace)
    return result.returncode


# ---- the train command of a cluster job ----------------------------------------------------


def _target(args: argparse.Namespace) -> tuple[JobTarget, argparse.Namespace]:
    """The validated train command of a cluster job and its hardware; the parsed train
    command."""
    cmd = _command(args)
    if cmd[0] != "train":
        raise UsageError(f"launch {args.launcher} runs `train`, got {cmd[0]!r}")
    train = args.jaxlearn_parser().parse_args(cmd)
    if not train.mesh_selector:
        raise UsageError(f"launch {args.launcher}: the train command needs the target's "
                         "--mesh_selector (e.g. gpu-h100-8x4, tpu-v5p-64, cpu-8)")
    try:
        kind, devices = parse_selector(train.mesh_selector)
    except MeshError as e:
        raise UsageError(str(e)) from None
    final_config(train.experiment, train.mesh_selector, train.overrides)  # Validates.
    spec = get_hardware(kind)
    try:
        name = job_name(args.name or f"jaxlearn-{train.experiment}")
    except JobSpecError as e:
        raise UsageError(str(e)) from None
    return JobTarget(name=name, experiment=train.experiment, selector=train.mesh_selector,
                     kind=kind, platform=spec.platform, devices=devices,
                     devices_per_host=spec.devices_per_host, argv=tuple(cmd)), train


def _fit_check(args: argparse.Namespace, train: argparse.Namespace) -> None:
    """Refuses a recipe that does not fit its target (a usage error), or with --force
    warns; a check that cannot run is a warning."""
    if args.no_fit_check:
        return
    where = f"{train.experiment} on {train.mesh_selector}"
    try:
        verdict = aot_matrix.check_fit(
            train.experiment, train.mesh_selector, train.overrides, aot=args.aot_check,
            cache_dir=_fit_cache(), matrix_path=args.aot_matrix or default_matrix())
    except BuildError as e:
        raise UsageError(str(e)) from None
    if verdict.fits:
        print(f"jaxlearn launch: {where} fits: {verdict.describe()}", file=sys.stderr)
        return
    if verdict.fits is None:
        print(f"jaxlearn launch: warning: {where}: {verdict.describe()}", file=sys.stderr)
        return
    message = (f"{where} does not fit: {verdict.describe()}; find a layout that fits with "
               f"`jaxlearn plan --experiment {train.experiment} --mesh_selector "
               f"{train.mesh_selector}`, or pass --force (warn and go on) or --no_fit_check")
    if not args.force:
        raise UsageError(message)
    bar = "!" * 78
    print(f"{bar}\njaxlearn launch: WARNING (--force): {message}\n{bar}", file=sys.stderr)


def _pairs(items: Sequence[str], flag: str, key_pattern: str = r".*"
           ) -> tuple[tuple[str, str], ...]:
    """Repeated `flag KEY=VALUE` values as (KEY, VALUE) pairs."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(key_pattern, key):
            raise UsageError(f"{flag} {item!r}: expected KEY=VALUE")
        pairs.append((key, value))
    return tuple(pairs)


def _job_options(args: argparse.Namespace, entrypoint: str) -> dict[str, Any]:
    """The JobOptions fields every cluster launcher shares (`entrypoint`: the default)."""
    return dict(env=_pairs(args.env, "--env", r"[A-Za-z_][A-Za-z0-9_]*"),
                coordinator_port=args.coordinator_port,
                initialization_timeout=args.initialization_timeout,
                heartbeat_timeout=args.heartbeat_timeout,
                entrypoint=args.entrypoint or entrypoint)


def _fit_cache() -> str:
    """Where fit check figures are cached: $JAXLEARN_FIT_CACHE, else ~/.cache/jaxlearn/fit."""
    return os.environ.get("JAXLEARN_FIT_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxlearn", "fit")


def _this_jaxlearn() -> str:
    """The jaxlearn this process runs, as a node on the same filesystem runs it (the
    checkout's tools/jaxlearn: `common.checkout_root`)."""
    return same_jaxlearn(sys.argv[0] if sys.argv else "", os.environ, sys.executable,
                         checkout_root())


def _generate(make: Callable[[Any, JobTarget], str], options: Any, target: JobTarget) -> str:
    """`make(options, target)`, its JobSpecError a usage error."""
    try:
        return make(options, target)
    except JobSpecError as e:
        raise UsageError(str(e)) from None


def _write(text: str, path: Optional[str], what: str) -> None:
    if path is None:
        sys.stdout.write(text)
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"{path}: cannot write the {what} ({e.strerror})") from None
    print(f"jaxlearn launch: wrote {path}", file=sys.stderr)


# ---- launch slurm / k8s --------------------------------------------------------------------


def _slurm(args: argparse.Namespace) -> int:
    target, train = _target(args)
    options = slurm.SlurmOptions(
        **_job_options(args, _this_jaxlearn()), nodes=args.nodes,
        processes_per_node=args.processes_per_node,
        gpus_per_node=args.gpus_per_node, partition=args.partition, account=args.account,
        time=args.time, cpus_per_task=args.cpus_per_task, exclusive=not args.no_exclusive,
        setup=tuple(args.setup), log=args.log or slurm.DEFAULT_LOG)
    text = _generate(slurm.slurm_script, options, target)
    _fit_check(args, train)
    path = args.script or (f"{target.name}.sbatch" if args.submit else None)
    _write(text, path, "sbatch script")
    if not args.submit:
        return 0
    assert path is not None
    _log_directory(options.log)
    try:
        return 1 if slurm.submit(path, wait=args.wait) else 0
    except JobSpecError as e:
        raise UsageError(str(e)) from None


def _volumes(args: argparse.Namespace) -> tuple[Any, ...]:
    """--pvc CLAIM:MOUNT and --volume DRIVER:MOUNT[:KEY=VALUE,...] as k8s.Volume values."""
    volumes = []
    for item in args.pvc:
        claim, sep, mount = item.partition(":")
        if not (claim and sep and mount):
            raise UsageError(f"--pvc {item!r}: expected CLAIM:MOUNT, e.g. shared-runs:/runs")
        volumes.append(Volume(mount=mount, claim=claim))
    for item in args.volume:
        driver, _, rest = item.partition(":")
        mount, _, attrs = rest.partition(":")
        if not (driver and mount):
            raise UsageError(f"--volume {item!r}: expected DRIVER:MOUNT[:KEY=VALUE,...], "
                             "e.g. gcsfuse.csi.storage.gke.io:/gcs:bucketName=my-bucket")
        pairs = _pairs([a for a in attrs.split(",") if a], f"--volume {item}")
        volumes.append(Volume(mount=mount, driver=driver, attributes=pairs))
    return tuple(volumes)


def _log_directory(log: str) -> None:
    """Creates the directory of the job's log (sbatch does not, and the job then fails
    with no output at all); left alone when it depends on the job (%j, ...)."""
    parent = os.path.dirname(log)
    if parent and "%" not in parent:
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--log {log}: cannot create {parent} ({e.strerror})") from None


def _k8s(args: argparse.Namespace) -> int:
    target, train = _target(args)
    options = k8s.K8sOptions(
        **_job_options(args, DEFAULT_ENTRYPOINT), image=args.image, namespace=args.namespace,
        num_processes=args.num_processes, tpu_topology=args.tpu_topology,
        node_selector=_pairs(args.node_selector, "--node_selector"), cpu=args.cpu,
        memory=args.memory, max_restarts=args.max_restarts,
        service_account=args.service_account, volumes=_volumes(args))
    text = _generate(k8s.jobset_file, options, target)
    _fit_check(args, train)
    _write(text, args.output, "JobSet manifest")
    return 0


COMMANDS = {"launch": cmd_launch}

__all__ = ["COMMANDS", "add_parsers", "cmd_launch"]
