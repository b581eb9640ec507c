"""`launch_local`: N processes of a command on this machine, each with the environment
of one process of a multi-process job (`local_process_env`), watched until they all join
(the `jaxlearn: process I of N joined` line `distributed.initialize` prints) and finish;
when one fails the others are stopped promptly (process groups, SIGTERM then SIGKILL).
Used by `jaxlearn launch local` and the multi-process tests.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Mapping, Optional, Sequence

from jaxlearn.launch.cluster import SCHEDULER_VARS, ClusterConfigError
from jaxlearn.launch.distributed import JOINED_RE
from jaxlearn.launch.rollcall import format_ids, listen

ENV_STYLES = ("jaxlearn", "slurm", "k8s", "ompi")


def free_port() -> int:
    """A TCP port that is free now on all interfaces (the coordinator listens on all)."""
    with listen(0) as s:
        return int(s.getsockname()[1])


def local_process_env(
    process_id: int,
    num_processes: int,
    port: int,
    *,
    devices_per_process: Optional[int] = None,
    style: str = "jaxlearn",
    base: Optional[Mapping[str, str]] = None,
) -> dict[str, str]:
    """The environment of process `process_id` of a group on this machine, described the
    way `style` does it: "jaxlearn" (JAXLEARN_* variables), or emulated "slurm", "k8s"
    (JobSet) or "ompi" with the schedulers' real variable names, so that
    `detect_cluster` is exercised exactly as on a cluster."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not SCHEDULER_VARS.fullmatch(k)}
    n, i = str(num_processes), str(process_id)
    if style == "jaxlearn":
        env.update(JAXLEARN_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAXLEARN_NUM_PROCESSES=n,
                   JAXLEARN_PROCESS_ID=i, JAXLEARN_LAUNCHER="local")
    elif style == "slurm":
        env.update(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID=i, SLURM_LOCALID=i,
                   SLURM_NODEID="0", SLURM_NTASKS=n, SLURM_STEP_NUM_TASKS=n, SLURM_NNODES="1",
                   SLURM_STEP_NUM_NODES="1", SLURM_JOB_NODELIST="localhost",
                   SLURM_STEP_NODELIST="localhost", SLURM_TASKS_PER_NODE=n,
                   SLURM_STEP_TASKS_PER_NODE=n, JAXLEARN_COORDINATOR_PORT=str(port))
    elif style == "k8s":
        # What `jaxlearn launch k8s` puts in a JobSet pod, except that the coordinator's
        # DNS name (<jobset>-workers-0-0.<jobset>) does not resolve here.
        env.update(JOB_COMPLETION_INDEX=i, JOBSET_NAME="local", REPLICATED_JOB_NAME="workers",
                   JOB_INDEX="0", JOB_GLOBAL_INDEX="0", REPLICATED_JOB_REPLICAS="1",
                   JAXLEARN_NUM_PROCESSES=n, JAXLEARN_PROCESSES_PER_JOB=n,
                   JAXLEARN_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   HOSTNAME=f"local-workers-0-{i}")
    elif style == "ompi":
        env.update(OMPI_COMM_WORLD_RANK=i, OMPI_COMM_WORLD_SIZE=n, OMPI_COMM_WORLD_LOCAL_RANK=i,
                   OMPI_COMM_WORLD_LOCAL_SIZE=n, OMPI_COMM_WORLD_NODE_RANK="0",
                   OMPI_MCA_orte_hnp_uri="1531576320.0;tcp://127.0.0.1:34911",
                   JAXLEARN_COORDINATOR_PORT=str(port))
    else:
        raise ClusterConfigError(f"unknown environment style {style!r}; one of {ENV_STYLES}")
    if devices_per_process is not None:
        env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices_per_process))
    return env


@dataclasses.dataclass
class ProcessOutcome:
    """How one launched process ended: `returncode` (negative: killed by that signal; None:
    never reaped), whether it `joined` the group, whether the launcher `stopped` it."""

    process_id: int
    returncode: Optional[int]
    joined: bool
    stopped: bool


@dataclasses.dataclass
class LaunchResult:
    """`returncode`: 0 if every process succeeded, else the first failure's status (128 +
    signal for a signal); `failed`: that process; `message`: the one-line report."""

    returncode: int
    processes: list[ProcessOutcome]
    failed: Optional[int]
    message: str
    seconds: float


def _status(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code == -signal.SIGABRT or code == 134:
        return "aborted by SIGABRT (JAX's distributed runtime gave up: a peer failed or timed out)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class _Child:
    def __init__(self, process_id: int, proc: subprocess.Popen, prefix: str):
        self.process_id = process_id
        self.proc = proc
        self.prefix = prefix
        self.joined = False
        self.stopped = False
        self.threads: list[threading.Thread] = []


def launch_local(
    command: Sequence[str] | Callable[[int], Sequence[str]],
    num_processes: int,
    *,
    devices_per_process: Optional[int] = None,
    style: str = "jaxlearn",
    port: Optional[int] = None,
    env: Optional[Mapping[str, str]] = None,
    stdout: Optional[IO[str]] = None,
    stderr: Optional[IO[str]] = None,
    kill_grace: float = 2.0,
    poll_interval: float = 0.05,
) -> LaunchResult:
    """Runs `command` (or `command(process_id)`) as `num_processes` processes on this
    machine, each told its place via `local_process_env(style=...)`, with their stdout and
    stderr lines prefixed `[i] `. Fails fast: when one process exits non-zero (or by a
    signal), the others are terminated (SIGTERM, then SIGKILL after `kill_grace` seconds)
    and the report names the failed process and those that never joined. Ctrl-C stops all.
    """
    if num_processes < 1:
        raise ClusterConfigError(f"num_processes must be >= 1, got {num_processes}")
    err = stderr or sys.stderr
    port = port or free_port()
    children: list[_Child] = []
    t0 = time.monotonic()
    try:
        for i in range(num_processes):
            argv = list(command(i) if callable(command) else command)
            child_env = local_process_env(i, num_processes, port,
                                          devices_per_process=devices_per_process,
                                          style=style, base=env)
            children.append(_start(i, num_processes, argv, child_env, stdout or sys.stdout,
                                   err))
        failed = _first_failure(children, poll_interval)
    except KeyboardInterrupt:
        _stop(children, kill_grace)
        _drain(children)
        msg = "jaxlearn launch: interrupted; stopped all processes"
        err.write(msg + "\n")
        return LaunchResult(130, _outcomes(children), None, msg, time.monotonic() - t0)
    except BaseException:
        _stop(children, kill_grace)
        raise
    if failed is not None:
        _stop([c for c in children if c is not failed], kill_grace)
    _drain(children)
    return _report(children, failed, time.monotonic() - t0, err)


_output_lock = threading.Lock()  # One line at a time from all the pumps.


def _start(process_id: int, num_processes: int, argv: list[str], env: dict[str, str],
           out: IO[str], err: IO[str]) -> _Child:
    """Process `process_id` in its own session, its stdout and stderr pumped line by line
    into `out` and `err` with its `[i] ` prefix; its stderr is watched for the join line."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    width = len(str(num_processes - 1))
    child = _Child(process_id, proc, f"[{process_id:>{width}}] ")
    assert proc.stdout is not None and proc.stderr is not None
    for stream, sink, watch in ((proc.stdout, out, False), (proc.stderr, err, True)):
        t = threading.Thread(target=_pump, args=(child, stream, sink, watch), daemon=True)
        t.start()
        child.threads.append(t)
    return child


def _pump(child: _Child, stream: IO[bytes], sink: IO[str], watch: bool) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if watch and not child.joined and JOINED_RE.search(line):
            child.joined = True
        with _output_lock:
            sink.write(f"{child.prefix}{line}\n")
            sink.flush()
    stream.close()


def _first_failure(children: Sequence[_Child], poll_interval: float) -> Optional[_Child]:
    """Waits until one child fails (returned at once) or all have exited (the first that
    failed, or None)."""
    while any(c.proc.poll() is None for c in children):
        for c in children:
            code = c.proc.poll()
            if code is not None and code != 0:
                return c
        time.sleep(poll_interval)
    bad = [c for c in children if c.proc.returncode]
    return bad[0] if bad else None


def _report(children: Sequence[_Child], failed: Optional[_Child], seconds: float,
            err: IO[str]) -> LaunchResult:
    """The one-line verdict, written to `err`, and the result it summarises."""
    outcomes = _outcomes(children)
    if failed is None:
        msg = f"jaxlearn launch: all {len(children)} processes finished ({seconds:.1f}s)"
        err.write(msg + "\n")
        return LaunchResult(0, outcomes, None, msg, seconds)
    code = failed.proc.returncode
    assert code is not None
    parts = [f"process {failed.process_id} failed ({_status(code)}"
             f"{'' if failed.joined else ', before joining'}) after {seconds:.1f}s"]
    never = [c.process_id for c in children if not c.joined and c is not failed]
    if never and len(children) > 1:
        parts.append(f"never joined: {format_ids(never)}")
    stopped = [c.process_id for c in children if c.stopped]
    if stopped:
        parts.append(f"stopped: {format_ids(stopped)}")
    msg = "jaxlearn launch: " + "; ".join(parts)
    err.write(msg + "\n")
    err.flush()
    rc = 128 - code if code < 0 else code
    return LaunchResult(rc, outcomes, failed.process_id, msg, seconds)


def _stop(children: Sequence[_Child], grace: float) -> None:
    live = [c for c in children if c.proc.poll() is None]
    for c in live:
        c.stopped = True
        _signal_group(c.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(c.proc.poll() is None for c in live):
        time.sleep(0.05)
    for c in live:
        if c.proc.poll() is None:
            _signal_group(c.proc, signal.SIGKILL)
    for c in live:
        c.proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # Its own session (start_new_session): the process group.
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _drain(children: Sequence[_Child]) -> None:
    for c in children:
        c.proc.wait()
        for t in c.threads:
            t.join(timeout=5.0)


def _outcomes(children: Sequence[_Child]) -> list[ProcessOutcome]:
    return [ProcessOutcome(c.process_id, c.proc.returncode, c.joined, c.stopped)
            for c in children]


__all__ = [
    "ENV_STYLES",
    "LaunchResult",
    "ProcessOutcome",
    "free_port",
    "launch_local",
    "local_process_env",
]
