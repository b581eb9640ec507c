"""Fault injection for resilience tests: a plan read from the config field
`resilience.faults` (a comma-separated spec; empty: no faults).

    jaxlearn train ... --set resilience.faults=kill@7:save+30,hang@5,nan@3,flip@6:2

Transient faults (all but nan/inf) fire at most once per output directory (a marker file
under `<output_dir>/faults_fired/` is written, durably, just before one fires), so a run
restarted by a supervisor does not hit the same fault again. A bad batch (nan/inf) is bad
each time its step runs, as real bad data would be on a replay:

    kill@N:PHASE[+MS]  SIGKILL this process MS milliseconds (default 0) after entering
                       PHASE of step N: `step` (the step is dispatched, computing), `save`
                       (the async save of step N returned, writes in flight), `eval` or
                       `rollout` (an RL step's batch is being sampled)
    hang@N             block the training thread forever before step N (for the watchdog)
    crash@N            raise RuntimeError before step N
    nan@N / inf@N      put a NaN / Inf into step N's batch (`target_weights`), so the
                       loss and every gradient become non-finite
    flip@N:DEV[:PATH]  after step N, flip one bit of the state leaf PATH (default: the
                       first parameter) in the shard on device DEV (an SDC on one replica)
    sdcstep@N:DEV      in the recompute SDC check of step N, flip a bit of the first
                       result on device DEV (a device that computes wrongly)
    enospc@N           the checkpoint save of step N finds the disk full (its durable
                       writes raise OSError(ENOSPC))
    sigterm@N:PHASE[:COUNT][+MS] / sigint@...
                       send this process SIGTERM / SIGINT MS milliseconds after entering
                       PHASE of step N (a preemption); COUNT times (default 1), 1.5 s
                       apart (a repeat within 1 s is the same notice: preemption.py)
    stall@N+MS         the checkpoint save of step N first sleeps MS milliseconds (a slow
                       filesystem)

Empty, the plan is empty and every hook is a dictionary lookup. Not for production use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import signal
import threading
import time
from typing import Any, Iterator, Optional

import numpy as np

log = logging.getLogger("jaxlearn.faults")

FIELD = "resilience.faults"
_SPEC = re.compile(r"^(?P<kind>[a-z]+)@(?P<step>\d+)(?::(?P<arg>[^+:]+))?(?::(?P<path>[^+]+))?"
                   r"(?:\+(?P<ms>\d+(?:\.\d*)?))?$")
KINDS = {"kill", "hang", "crash", "nan", "inf", "flip", "sdcstep", "enospc", "sigterm",
         "sigint", "stall"}
SIGNAL_KINDS = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT}
PHASES = {"step", "save", "eval", "rollout"}
PERSISTENT = {"nan", "inf"}  # Bad data: bad again when the step is replayed.


class FaultSpecError(ValueError):
    """A malformed `resilience.faults` entry."""


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    arg: Optional[str] = None
    path: Optional[str] = None
    delay_ms: float = 0.0
    token: str = ""

    @property
    def marker_name(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", self.token)


def parse(spec: str) -> list[Fault]:
    out = []
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        m = _SPEC.match(token)
        if not m or m["kind"] not in KINDS:
            raise FaultSpecError(f"{FIELD}: cannot parse {token!r} (kinds: {sorted(KINDS)}, "
                                 "form KIND@STEP[:ARG[:PATH]][+MS])")
        fault = Fault(m["kind"], int(m["step"]), m["arg"], m["path"],
                      float(m["ms"] or 0.0), token)
        if fault.kind in ("kill", *SIGNAL_KINDS) and fault.arg not in PHASES:
            raise FaultSpecError(f"{FIELD}: {token!r}: {fault.kind} needs a phase, one of "
                                 f"{sorted(PHASES)}")
        if fault.kind in SIGNAL_KINDS and fault.path is not None and not fault.path.isdigit():
            raise FaultSpecError(f"{FIELD}: {token!r}: the signal count must be a number")
        if fault.kind in ("flip", "sdcstep") and (fault.arg is None or not fault.arg.isdigit()):
            raise FaultSpecError(f"{FIELD}: {token!r}: {fault.kind} needs a device id")
        out.append(fault)
    return out


class FaultPlan:
    """The faults of one run, each fired at most once per `output_dir`."""

    def __init__(self, faults: list[Fault], output_dir: Optional[str] = None):
        self.faults = faults
        self._dir = os.path.join(output_dir, "faults_fired") if output_dir else None
        self.fired: list[str] = []
        self._kill_pending = False

    @classmethod
    def from_spec(cls, spec: str, output_dir: Optional[str]) -> "FaultPlan":
        """The plan of a `resilience.faults` spec (raises FaultSpecError if malformed)."""
        return cls(parse(spec), output_dir)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _take(self, kind: str, step: int, arg: Optional[str] = None) -> Optional[Fault]:
        for f in self.faults:
            if f.kind == kind and f.step == step and (arg is None or f.arg == arg):
                if f.kind in PERSISTENT:
                    log.warning("fault injection: %s (fires on every run of step %d)",
                                f.token, step)
                    self.fired.append(f.token)
                    return f
                if self._dir is not None and os.path.exists(os.path.join(self._dir, f.marker_name)):
                    continue
                self._mark(f)
                return f
        return None

    def _mark(self, fault: Fault) -> None:
        self.fired.append(fault.token)
        log.warning("fault injection: firing %s", fault.token)
        if self._dir is None:
            return
        os.makedirs(self._dir, exist_ok=True)
        path = os.path.join(self._dir, fault.marker_name)
        with open(path, "w") as f:
            f.write(f"{time.time()}\n")
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- hooks called by the trainer's guard -----------------------------------------------

    def before_step(self, step: int, local_batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.faults:
            return local_batch
        if self._take("crash", step):
            raise RuntimeError(f"fault injection: crash before step {step}")
        if self._take("hang", step):
            log.warning("fault injection: hanging before step %d", step)
            while True:
                time.sleep(3600)
        for kind, value in (("nan", np.nan), ("inf", np.inf)):
            if self._take(kind, step):
                if "target_weights" not in local_batch:
                    raise RuntimeError("fault injection: the batch has no target_weights")
                local_batch = dict(local_batch)
                weights = np.array(local_batch["target_weights"], dtype=np.float32)
                weights.reshape(-1)[0] = value
                local_batch["target_weights"] = weights
        return local_batch

    def enter_phase(self, phase: str, step: int) -> None:
        """Kill and signal faults for `phase` of `step` (delayed ones on a timer thread)."""
        if not self.faults:
            return
        for kind, signum in SIGNAL_KINDS.items():
            sent = self._take(kind, step, phase)
            if sent is not None:
                count = int(sent.path or 1)
                _after(sent.delay_ms, lambda s=signum, n=count: _signal_self(s, n))
        if self._kill_pending:  # One kill per process.
            return
        fault = self._take("kill", step, phase)
        if fault is None:
            return
        self._kill_pending = True
        if fault.delay_ms <= 0:
            _kill_self()
        timer = threading.Timer(fault.delay_ms / 1000.0, _kill_self)
        timer.daemon = True
        timer.start()

    def flip_after_step(self, step: int, state: Any) -> Any:
        if not self.faults:
            return state
        fault = self._take("flip", step)
        if fault is None:
            return state
        from jaxlearn.resilience.nonfinite import leaf_paths
        from jaxlearn.resilience.sdc import flip_bit_in_tree

        path = fault.path or "params/" + leaf_paths(state["params"])[0]
        log.warning("fault injection: flipping a bit of %s on device %s after step %d",
                    path, fault.arg, step)
        return flip_bit_in_tree(state, path, int(fault.arg or 0), bit=_HIGH_BIT)

    @contextlib.contextmanager
    def disk_full(self, step: int) -> Iterator[None]:
        """Inside: durable checkpoint writes fail with ENOSPC (for an `enospc@step`)."""
        if not self.faults or self._take("enospc", step) is None:
            yield
            return
        from jaxlearn.checkpoint import layout

        real = layout.write_durable
        name = layout.step_name(step)  # Only this step's files: earlier commits finish.

        def full(path: Any, data: bytes) -> None:
            if name not in str(path):
                return real(path, data)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        layout.write_durable = full
        try:
            yield
        finally:
            layout.write_durable = real

    def stall_save(self, step: int) -> None:
        """A `stall@step+MS`: sleeps MS milliseconds (inside the save of `step`)."""
        if not self.faults:
            return
        fault = self._take("stall", step)
        if fault is not None:
            time.sleep(fault.delay_ms / 1000.0)

    def corrupt_recompute(self, step: int) -> Optional[Any]:
        """A function corrupting the first result of step `step`'s recompute check."""
        if not self.faults:
            return None
        fault = self._take("sdcstep", step)
        if fault is None:
            return None
        from jaxlearn.resilience.nonfinite import leaf_paths
        from jaxlearn.resilience.sdc import flip_bit_in_tree

        device = int(fault.arg or 0)

        def corrupt(state: Any) -> Any:
            path = fault.path or "params/" + leaf_paths(state["params"])[0]
            return flip_bit_in_tree(state, path, device, bit=_HIGH_BIT)

        return corrupt


# The top mantissa bit of a float32: the value changes by up to 50% and stays finite, so
# the damage survives the next update (a low bit could be rounded away).
_HIGH_BIT = 22


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _signal_self(signum: int, count: int) -> None:
    """`count` signals: one now, the repeats 1.5 s apart on a timer thread."""
    os.kill(os.getpid(), signum)
    if count > 1:
        _after(1500.0, lambda: _signal_self(signum, count - 1))


def _after(delay_ms: float, fn: Any) -> None:
    """`fn()` now (delay 0) or on a daemon timer thread after `delay_ms`."""
    if delay_ms <= 0:
        fn()
        return
    timer = threading.Timer(delay_ms / 1000.0, fn)
    timer.daemon = True
    timer.start()


__all__ = ["FIELD", "Fault", "FaultPlan", "FaultSpecError", "parse"]
