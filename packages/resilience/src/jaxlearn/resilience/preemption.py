"""Preemption: SIGTERM/SIGINT end a run with a checkpoint of the step it reached.

Slurm and Kubernetes send SIGTERM (Kubernetes waits `terminationGracePeriodSeconds`, 30 s by
default, before SIGKILL); Ctrl-C sends SIGINT. During `Trainer.run`:

    1st signal   the loop finishes the step in flight, every process agrees on one step
                 (`StopVote`), saves and commits it, logs one line and exits with status
                 46 (`failures.EXIT_PREEMPTED`); a rerun resumes from that step.
    grace_s      if the save has not committed `grace_s` seconds after the signal, the
                 process exits with status 47 (`EXIT_PREEMPTED_UNSAVED`); the unfinished
                 save is a `step_n.tmp/` no reader uses, the previous committed step is intact.
    2nd signal   exits at once with the shell status of the signal (143 SIGTERM, 130
                 SIGINT), leaving the previous committed step intact. A signal within
                 `SAME_NOTICE_S` (1 s) of the first is the same notice delivered twice
                 (a scheduler signals every process of the job, and a supervisor forwards
                 its own copy; Ctrl-C reaches the whole process group) and is ignored.

The Python-level handlers do nothing: CPython's C handler writes each signal's number to a
wakeup pipe (`signal.set_wakeup_fd`), which a watcher thread reads, so a second signal
or the grace deadline ends the process even while the main thread is blocked in XLA.
The watcher only sets an event and arms the deadline; the training loop acts on the event
at step boundaries.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.config import Configurable
from jaxlearn.resilience.failures import EXIT_PREEMPTED_UNSAVED

log = logging.getLogger("jaxlearn.preemption")

SIGNALS = ("SIGTERM", "SIGINT")
SAME_NOTICE_S = 1.0


class Preemption(Configurable):
    """Signal handling for one run; `install()` on the main thread, `uninstall()` at exit."""

    class Config(Configurable.Config):
        # Handle SIGTERM/SIGINT as a preemption (False: the default signal behaviour).
        enabled: bool = True
        # Seconds from the first signal to a committed checkpoint; then exit 47 without one.
        grace_s: float = 20.0

        def _field_problems(self) -> dict[str, str]:
            if not self.grace_s > 0:
                return {"grace_s": f"must be > 0, got {self.grace_s!r}"}
            return {}

    def __init__(self, cfg: "Preemption.Config", *,
                 exit_fn: Callable[[int], Any] = os._exit):
        super().__init__(cfg)
        self.requested = threading.Event()
        self.signal_name: Optional[str] = None
        self.signal_time: Optional[float] = None  # time.monotonic() of the first signal.
        self.saving: str = "before a checkpoint of the current step was started"
        self._exit = exit_fn
        self._count = 0
        self._previous: dict[int, Any] = {}
        self._old_wakeup_fd: Optional[int] = None
        self._pipe: Optional[tuple[int, int]] = None
        self._watcher: Optional[threading.Thread] = None
        self._deadline: Optional[threading.Timer] = None

    @property
    def installed(self) -> bool:
        return self._pipe is not None

    def install(self) -> bool:
        """Handlers for SIGTERM and SIGINT and the watcher thread; False (and nothing
        changed) when disabled or not on the main thread."""
        if not self.config.enabled or self.installed:
            return False
        if threading.current_thread() is not threading.main_thread():
            log.info("preemption: not on the main thread; SIGTERM/SIGINT keep their handlers")
            return False
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        for name in SIGNALS:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, _noop)
        self._old_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="preemption-watcher",
                                         daemon=True)
        self._watcher.start()
        return True

    def uninstall(self) -> None:
        """Restores the previous handlers and wakeup fd; cancels the deadline."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._pipe is None:
            return
        signal.set_wakeup_fd(-1 if self._old_wakeup_fd is None else self._old_wakeup_fd)
        for signum, handler in self._previous.items():
            # None: installed outside Python (e.g. by a C++ runtime): not restorable.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous = {}
        read_fd, write_fd = self._pipe
        self._pipe = None
        os.close(write_fd)  # The watcher's read returns b"" and it ends.
        if self._watcher is not None:
            self._watcher.join(timeout=5.0)
        os.close(read_fd)

    def _watch(self) -> None:
        assert self._pipe is not None
        read_fd = self._pipe[0]
        handled = {getattr(signal, n) for n in SIGNALS}
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in handled:
                    self.notify(signum)

    def notify(self, signum: int) -> None:
        """One received signal (called by the watcher thread; public for tests)."""
        name = signal.Signals(signum).name
        if self.signal_time is not None and \
                time.monotonic() - self.signal_time < SAME_NOTICE_S:
            return  # The first notice again (forwarded or sent to the whole group).
        self._count += 1
        if self._count > 1:
            _write_stderr(f"preemption: second signal ({name}) {self.saving}: exiting at "
                          f"once with status {128 + signum}; the newest committed "
                          "checkpoint is intact")
            self._exit(128 + signum)
            return
        self.signal_name, self.signal_time = name, time.monotonic()
        grace = self.config.grace_s
        self._deadline = threading.Timer(grace, self._expire)
        self._deadline.daemon = True
        self._deadline.start()
        log.warning("preemption: %s received; saving a checkpoint at the next step boundary "
                    "(grace period %.0f s; a second signal exits at once)", name, grace)
        self.requested.set()

    def _expire(self) -> None:
        _write_stderr(f"preemption: the grace period of {self.config.grace_s:g} s after "
                      f"{self.signal_name} ran out {self.saving}: exiting with status "
                      f"{EXIT_PREEMPTED_UNSAVED}; the newest committed checkpoint is intact")
        self._exit(EXIT_PREEMPTED_UNSAVED)

    def elapsed_s(self) -> float:
        """Seconds since the first signal (0 before one)."""
        return 0.0 if self.signal_time is None else time.monotonic() - self.signal_time

    def disarm(self) -> None:
        """The save committed: the deadline no longer applies."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


class StopVote:
    """Agrees across processes on the step boundary at which every process stops.

    Single process: `vote(flag)` returns `flag`. Multi-process: each boundary dispatches a
    max-all-reduce of every process's flag (a [num_devices] int32 array, one tiny
    computation) without waiting for it, and returns the result dispatched at the
    previous boundary: every process reads the same value at the same boundary, so they
    stop at the same step, one step after the first process saw its signal, and the host
    never stalls on the all-reduce of the step in flight."""

    def __init__(self, devices: Sequence[Any]):
        self.multi = jax.process_count() > 1
        self._pending: Any = None
        if not self.multi:
            return
        mesh = Mesh(np.asarray(list(devices)), ("all",))
        self._sharding = NamedSharding(mesh, PartitionSpec("all"))
        self._local = len([d for d in devices if d.process_index == jax.process_index()])
        self._global = len(devices)
        self._reduce = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def vote(self, flag: bool) -> bool:
        if not self.multi:
            return flag
        local = np.full((self._local,), int(flag), np.int32)
        array = jax.make_array_from_process_local_data(self._sharding, local,
                                                       (self._global,))
        previous, self._pending = self._pending, self._reduce(array)
        return previous is not None and bool(np.asarray(previous))


def _noop(signum: int, frame: Any) -> None:
    """The Python-level handler: the wakeup-fd watcher has the signal already."""


def _write_stderr(line: str) -> None:
    """One line straight to fd 2 (no logging locks: another thread may hold them)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


__all__ = ["Preemption", "SIGNALS", "StopVote"]
