"""Failure kinds of a training run and the process exit codes that carry them.

A run that stops on a detected fault exits with a distinctive status so that a supervisor
(`jaxlearn train --supervise`, a cluster launcher) knows why without parsing logs:

    0   finished                     2   usage error: bad config, flags, data, checkpoint
    42  hang (watchdog)              43  silent data corruption (SDC check)
    44  non-finite loss/gradients    45  failed pre-training health check
    46  preempted (SIGTERM/SIGINT): the current step was saved and committed; rerun resumes
    47  preempted, but the grace period ran out before the save committed (the previous
        committed step is intact)
    143 / 130  a second SIGTERM / SIGINT during the preemption save: exited at once
    <0  killed by a signal (subprocess convention), 134 = SIGABRT (e.g. JAX distributed)

Usage errors are not retried: a restart would fail the same way. Every other status,
preemptions included, is retried by the supervisor (a restart resumes from the newest
committed step).
"""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_HANG = 42
EXIT_SDC = 43
EXIT_NONFINITE = 44
EXIT_HEALTH = 45
EXIT_PREEMPTED = 46
EXIT_PREEMPTED_UNSAVED = 47

NOT_RETRYABLE = frozenset({EXIT_USAGE})


class ResilienceError(RuntimeError):
    """A detected fault that stops the run; `exit_code` is the status to exit with."""

    exit_code = 1


class SdcError(ResilienceError):
    """Results that must be bitwise equal (replicas, a recomputed step) are not."""

    exit_code = EXIT_SDC


class NonFiniteError(ResilienceError):
    """NaN/Inf in the loss or gradients, with policy `stop` (or too many skipped steps)."""

    exit_code = EXIT_NONFINITE


class HealthCheckError(ResilienceError):
    """A pre-training health check failed (devices, collectives, output directory)."""

    exit_code = EXIT_HEALTH


class Preempted(ResilienceError):
    """SIGTERM/SIGINT ended the run at `step`: saved and committed (status 46), or with
    `saved=False` nothing new was saved (status 47)."""

    exit_code = EXIT_PREEMPTED

    def __init__(self, message: str, step: int, *, saved: bool = True):
        super().__init__(message)
        self.step = step
        self.saved = saved
        self.exit_code = EXIT_PREEMPTED if saved else EXIT_PREEMPTED_UNSAVED


def describe_exit(returncode: int) -> str:
    """A short cause for a child's exit status, e.g. 'signal SIGKILL', 'watchdog: hang'."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}"
    known = {
        EXIT_OK: "finished",
        EXIT_USAGE: "usage error (not retried)",
        EXIT_HANG: "watchdog: no step progress (hang)",
        EXIT_SDC: "silent data corruption detected",
        EXIT_NONFINITE: "non-finite loss/gradients",
        EXIT_HEALTH: "health check failed",
        EXIT_PREEMPTED: "preempted: checkpoint of the current step saved",
        EXIT_PREEMPTED_UNSAVED: "preempted: grace period ran out before the save committed",
        128 + signal.SIGABRT: "aborted (SIGABRT; e.g. a JAX distributed runtime fatal error)",
    }
    if returncode in known:
        return known[returncode]
    if returncode > 128:
        try:
            return f"killed by signal {signal.Signals(returncode - 128).name} (shell status)"
        except ValueError:
            pass
    return f"exit status {returncode}"


__all__ = [
    "EXIT_HANG",
    "EXIT_HEALTH",
    "EXIT_NONFINITE",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_PREEMPTED_UNSAVED",
    "EXIT_SDC",
    "EXIT_USAGE",
    "HealthCheckError",
    "NOT_RETRYABLE",
    "NonFiniteError",
    "Preempted",
    "ResilienceError",
    "SdcError",
    "describe_exit",
]
