"""Slurm batch scripts for a `jaxlearn train` job (what `jaxlearn launch slurm` writes).

    text = slurm_script(SlurmOptions(partition="a3", time="4:00:00"), target)
    submit("job.sbatch")        # sbatch it; returns sbatch's exit status

One `srun --label` step with `--kill-on-bad-exit=1`: every output line starts with its
task's rank (`0: `, `1: `, ...), and one failed task ends the step. The batch script, on
the allocation's first node, names the coordinator (process 0, on that node) by the
address Slurm reaches that node at: `scontrol show hostnames "$SLURM_JOB_NODELIST"` gives
its name, `scontrol show node` its NodeAddr (the name itself where none is set); the port
is `JobOptions.coordinator_port`, else derived from the job id as JAX does. Every task then
finds its rank from SLURM_PROCID and SLURM_STEP_NUM_TASKS (`jaxlearn.launch.cluster`). GPU
targets get whole nodes of `devices_per_host` GPUs; CPU targets split their devices over
the tasks (`--num_cpu_devices`); TPU VMs and Trainium hosts are whole hosts. The job's
output goes to `SlurmOptions.log` (default `slurm-%x-%j.out`: job name and id, relative to
the directory sbatch runs in).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import shlex
import subprocess
import sys
from typing import Optional

from jaxlearn.launch.job import JobOptions, JobSpecError, JobTarget

DEFAULT_LOG = "slurm-%x-%j.out"

# The coordinator, resolved in the batch script on the allocation's first node (where
# process 0 runs). `sed -n 1p` reads all of scontrol's output (no SIGPIPE under pipefail).
_COORDINATOR_LINES = r"""
# Process 0 runs on the first node: every task reaches it at the address Slurm uses
# for that node (its NodeAddr, else its name), resolved here at run time.
coordinator_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
coordinator_host="$(scontrol show node -o "$coordinator_node" | tr ' ' '\n' \
    | sed -n 's/^NodeAddr=//p' || true)"
coordinator_port="${JAXLEARN_COORDINATOR_PORT:-$((SLURM_JOB_ID % 4096 + 61440))}"
export JAXLEARN_COORDINATOR_ADDRESS="${coordinator_host:-$coordinator_node}:$coordinator_port"
""".strip("\n").splitlines()


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmOptions(JobOptions):
    """sbatch settings (each None: Slurm's or the target's default).

    Attributes:
        nodes: nodes to allocate (default: from the target's devices).
        processes_per_node: tasks per node (default 1: one process drives the whole node).
        gpus_per_node: GPUs per node (default: the target's devices per host).
        partition, account, time: sbatch --partition/--account/--time.
        cpus_per_task: sbatch --cpus-per-task.
        exclusive: whole nodes (sbatch --exclusive).
        setup: shell lines run before srun (e.g. activating a virtual environment).
        log: sbatch --output: the job's output, every line labelled with its task's rank
            (relative paths: to the directory sbatch runs in; %x job name, %j job id).
    """

    nodes: Optional[int] = None
    processes_per_node: Optional[int] = None
    gpus_per_node: Optional[int] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    time: Optional[str] = None
    cpus_per_task: Optional[int] = None
    exclusive: bool = True
    setup: tuple[str, ...] = ()
    log: str = DEFAULT_LOG


@dataclasses.dataclass(frozen=True)
class _Layout:
    nodes: int
    processes_per_node: int
    gpus_per_node: Optional[int]
    cpu_devices: Optional[int]  # CPU devices per process (CPU targets).


def _layout(options: SlurmOptions, target: JobTarget) -> _Layout:
    """Nodes, tasks per node and GPUs per node for `target`; raises JobSpecError when the
    options do not add up to the target's devices."""
    ppn = options.processes_per_node or 1
    if target.platform == "gpu":
        per_host = target.devices_per_host or target.devices
        gpus = options.gpus_per_node or min(per_host, target.devices)
        nodes = options.nodes or math.ceil(target.devices / gpus)
        if nodes * gpus != target.devices:
            raise JobSpecError(f"{target.selector} is {target.devices} GPUs, but {nodes} "
                               f"node(s) x {gpus} GPU(s) = {nodes * gpus}")
        if gpus % ppn:
            raise JobSpecError(f"--processes_per_node {ppn} does not divide {gpus} GPUs "
                               "per node")
        return _Layout(nodes, ppn, gpus, None)
    if target.platform == "cpu":
        nodes = options.nodes or 1
        if target.devices % (nodes * ppn):
            raise JobSpecError(f"{target.selector}: {target.devices} CPU devices do not split "
                               f"over {nodes * ppn} process(es)")
        return _Layout(nodes, ppn, options.gpus_per_node, target.devices // (nodes * ppn))
    # TPU VMs or Trainium hosts scheduled by Slurm: whole hosts.
    per_host = target.devices_per_host or target.devices
    nodes = options.nodes or max(1, math.ceil(target.devices / per_host))
    return _Layout(nodes, ppn, options.gpus_per_node, None)


def _sbatch_lines(options: SlurmOptions, target: JobTarget, layout: _Layout) -> list[str]:
    """The `#!` line, the comment naming the job and the #SBATCH directives."""
    lines = [
        "#!/bin/bash",
        f"# Generated by `jaxlearn launch slurm` on {datetime.date.today().isoformat()}: "
        f"{target.experiment} on {target.selector} "
        f"({layout.nodes * layout.processes_per_node} process(es)).",
        f"#SBATCH --job-name={target.name}",
        f"#SBATCH --nodes={layout.nodes}",
        f"#SBATCH --ntasks-per-node={layout.processes_per_node}",
    ]
    if layout.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={layout.gpus_per_node}")
    for flag, value in (("--cpus-per-task", options.cpus_per_task),
                        ("--partition", options.partition), ("--account", options.account),
                        ("--time", options.time), ("--output", options.log or DEFAULT_LOG)):
        if value is not None:
            lines.append(f"#SBATCH {flag}={value}")
    if options.exclusive:
        lines.append("#SBATCH --exclusive")
    return lines


def slurm_script(options: SlurmOptions, target: JobTarget) -> str:
    """The sbatch script that runs `target` with `options` (see the module doc)."""
    layout = _layout(options, target)
    lines = _sbatch_lines(options, target, layout)
    lines += ["", "set -euo pipefail", *options.setup]
    env = list(options.env) + options.timeout_env()
    if options.coordinator_port is not None:
        env.append(("JAXLEARN_COORDINATOR_PORT", str(options.coordinator_port)))
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env]
    lines += ["", *_COORDINATOR_LINES]
    ppn = layout.processes_per_node
    srun = ["srun", "--label", "--kill-on-bad-exit=1", f"--ntasks-per-node={ppn}"]
    if layout.gpus_per_node and ppn > 1:
        srun.append(f"--gpus-per-task={layout.gpus_per_node // ppn}")
    command = target.command(options.entrypoint, layout.cpu_devices)
    lines += [
        "",
        "# Every task finds its rank from SLURM_PROCID and SLURM_STEP_NUM_TASKS; every output",
        "# line starts with it (--label); one failed task ends the step.",
        shlex.join(srun) + " \\",
        "    " + shlex.join(command),
        "",
    ]
    return "\n".join(lines)


def submit(path: str, wait: bool = False) -> int:
    """Submits the script at `path` with sbatch, passing on its output; sbatch's exit status
    (`wait`: sbatch --wait, which returns when the job ends, with the job's status). Raises
    JobSpecError when sbatch is not on PATH."""
    argv = ["sbatch", "--wait", path] if wait else ["sbatch", path]
    try:
        done = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        raise JobSpecError("--submit: sbatch is not on PATH (run this on a Slurm login node, "
                           f"or copy {path} there)") from None
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.returncode:
        what = "the job" if wait else f"sbatch {path}"
        print(f"jaxlearn: error: {what} failed (exit status {done.returncode})",
              file=sys.stderr)
    return done.returncode


__all__ = ["DEFAULT_LOG", "SlurmOptions", "slurm_script", "submit"]
