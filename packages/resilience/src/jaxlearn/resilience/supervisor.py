"""The supervisor: runs training as a child process and restarts it when it fails.

    sup = Supervisor(["python", "-m", "jaxlearn.cli", "train", ...], output_dir=out,
                     max_restarts=3, backoff_s=5)
    exit_code = sup.run()

Each attempt is a fresh process, so it resumes from the newest good checkpoint (the
trainer does that on its own; a damaged newest step is skipped with a log line). An
attempt that ends with a non-zero status is restarted after an exponential backoff
(`backoff_s * backoff_factor**k`, at most `max_backoff_s`) while the restart budget lasts;
each restart is logged with its cause (exit status, signal, watchdog; see failures.py).
Usage errors (status 2) are not retried. SIGTERM/SIGINT to the supervisor are passed on
to the child and end supervision.

Elastic restarts: `devices_for_attempt(k)` says how many devices attempt k gets (on CPU
this is simulated through JAX_NUM_CPU_DEVICES in the child's environment; a cluster
launcher would ask its scheduler). The child adapts its mesh and microbatching (elastic.py).

The supervisor writes `<output_dir>/supervisor.json` (every attempt: spawn and end time,
status, cause, devices) once the child has created `output_dir`, and at the end the job's
`goodput.json`, which bills the time between attempts to `restart` and the unrecorded
part of killed attempts to `lost`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence, Union

from jaxlearn.resilience import goodput as goodput_lib
from jaxlearn.resilience.failures import EXIT_OK, NOT_RETRYABLE, describe_exit

log = logging.getLogger("jaxlearn.supervisor")

Command = Union[Sequence[str], Callable[[int], Sequence[str]]]


@dataclasses.dataclass
class AttemptRecord:
    attempt: int
    spawn_time: float
    end_time: float
    returncode: int
    cause: str
    devices: Optional[int]
    backoff_s: float = 0.0


class Supervisor:
    """Restarts a training command until it succeeds or the budget is spent."""

    def __init__(
        self,
        command: Command,
        *,
        output_dir: str,
        max_restarts: int = 3,
        backoff_s: float = 1.0,
        backoff_factor: float = 2.0,
        max_backoff_s: float = 300.0,
        env: Optional[dict[str, str]] = None,
        devices_for_attempt: Optional[Callable[[int], Optional[int]]] = None,
        attempt_timeout_s: Optional[float] = None,
        log_path: Optional[str] = None,
        sleep: Callable[[float], Any] = time.sleep,
    ):
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if backoff_s < 0 or backoff_factor < 1 or max_backoff_s < 0:
            raise ValueError("backoff_s and max_backoff_s must be >= 0 and backoff_factor >= 1")
        self.command = command
        self.output_dir = output_dir
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.backoff_factor = backoff_factor
        self.max_backoff_s = max_backoff_s
        self.env = dict(os.environ if env is None else env)
        self.devices_for_attempt = devices_for_attempt
        self.attempt_timeout_s = attempt_timeout_s
        self.log_path = log_path
        self._sleep = sleep
        self.attempts: list[AttemptRecord] = []
        self._prior: list[dict[str, Any]] = []  # Earlier supervisors' attempts on this dir.
        self._child: Optional[subprocess.Popen] = None
        self._stopping = False

    # ---- running ------------------------------------------------------------------------------

    def run(self) -> int:
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        for s in previous:
            try:
                signal.signal(s, self._forward)
            except ValueError:  # Not the main thread: no forwarding.
                previous = {}
                break
        try:
            return self._run()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._write_summary()

    def _run(self) -> int:
        self._prior = self._load_prior()
        first = len(self._prior)  # A relaunched supervisor continues the numbering.
        attempt = 0
        while True:
            record = self._attempt(first + attempt)
            self.attempts.append(record)
            self._write_records()
            if record.returncode == EXIT_OK:
                log.info("supervisor: attempt %d finished the run (%d restart(s))",
                         record.attempt, attempt)
                return EXIT_OK
            if self._stopping:
                log.warning("supervisor: stopped by a signal; not restarting")
                return record.returncode
            if record.returncode in NOT_RETRYABLE:
                log.error("supervisor: attempt %d: %s; not restarting", record.attempt,
                          record.cause)
                return record.returncode
            if attempt >= self.max_restarts:
                log.error("supervisor: attempt %d: %s; restart budget (%d) spent, giving up",
                          record.attempt, record.cause, self.max_restarts)
                return record.returncode
            delay = min(self.backoff_s * self.backoff_factor ** attempt, self.max_backoff_s)
            record.backoff_s = delay
            self._write_records()
            log.warning("supervisor: attempt %d ended after %.1fs: %s; restart %d/%d in %.1fs "
                        "from the newest good checkpoint", record.attempt,
                        record.end_time - record.spawn_time, record.cause, attempt + 1,
                        self.max_restarts, delay)
            self._sleep(delay)
            attempt += 1

    def _command(self, attempt: int) -> list[str]:
        return list(self.command(attempt) if callable(self.command) else self.command)

    def _attempt(self, attempt: int) -> AttemptRecord:
        env = dict(self.env)
        devices = self.devices_for_attempt(attempt) if self.devices_for_attempt else None
        if devices is not None:
            env["JAX_NUM_CPU_DEVICES"] = str(devices)
            previous = self.attempts[-1].devices if self.attempts else None
            if previous is not None and previous != devices:
                log.warning("supervisor: attempt %d gets %d device(s) (attempt %d had %d): "
                            "elastic restart", attempt, devices, attempt - 1, previous)
        spawn = time.time()
        env[goodput_lib.ENV_SPAWN_TIME] = repr(spawn)
        env[goodput_lib.ENV_ATTEMPT] = str(attempt)
        cmd = self._command(attempt)
        log.info("supervisor: attempt %d: %s", attempt, " ".join(cmd))
        out: Any = None
        if self.log_path:
            out = open(self.log_path, "ab")
        try:
            self._child = subprocess.Popen(cmd, env=env, stdout=out,
                                           stderr=subprocess.STDOUT if out else None)
            try:
                rc = self._child.wait(timeout=self.attempt_timeout_s)
                cause = describe_exit(rc)
            except subprocess.TimeoutExpired:
                self._child.kill()
                rc = self._child.wait()
                cause = f"supervisor: attempt exceeded attempt_timeout_s={self.attempt_timeout_s}"
        finally:
            self._child = None
            if out is not None:
                out.close()
        return AttemptRecord(attempt, spawn, time.time(), rc, cause, devices)

    def _forward(self, signum: int, frame: Any) -> None:
        self._stopping = True
        child = self._child
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    # ---- records ------------------------------------------------------------------------------

    def _nothing_ran(self) -> bool:
        """No attempt got past argument checking: nothing to record."""
        return all(a.returncode in NOT_RETRYABLE for a in self.attempts)

    def _load_prior(self) -> list[dict[str, Any]]:
        path = os.path.join(self.output_dir, goodput_lib.SUPERVISOR_FILE)
        try:
            with open(path) as f:
                return list(json.load(f).get("attempts", []))
        except (OSError, ValueError):
            return []

    def _write_records(self) -> None:
        if not os.path.isdir(self.output_dir) or self._nothing_ran():
            return
        data = {"max_restarts": self.max_restarts,
                "attempts": self._prior + [dataclasses.asdict(a) for a in self.attempts]}
        path = os.path.join(self.output_dir, goodput_lib.SUPERVISOR_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)

    def _write_summary(self) -> None:
        if not os.path.isdir(self.output_dir) or self._nothing_ran():
            return
        summary = goodput_lib.summarize(self.output_dir)
        path = os.path.join(self.output_dir, goodput_lib.SUMMARY_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)
        log.info("supervisor: %s", goodput_lib.format_summary(summary))


def child_argv(argv: Sequence[str], drop: dict[str, bool]) -> list[str]:
    """`argv` without the options in `drop` (name -> takes a value), in `--x v` or `--x=v`
    form."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = drop[name] and "=" not in arg
            continue
        out.append(arg)
    return out


def python_module_command(module: str, args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


__all__ = ["AttemptRecord", "Supervisor", "child_argv", "python_module_command"]
