"""Process coordination: barriers and agreement. All are no-ops with one process.

Two kinds of barrier, because of where they run:
  * `foreground_barrier` runs on the training thread, in the same program order on every
    process, so it may use a device collective (`multihost_utils.sync_global_devices`).
  * `background_barrier` runs on the commit thread, concurrently with training steps. A
    device collective there could interleave with the step's own collectives and
    deadlock, so it uses the distributed runtime's key-value barrier (what orbax's own
    background thread uses), which never touches the devices.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
from jax.experimental import multihost_utils

_counter = itertools.count()


def process_index() -> int:
    return int(jax.process_index())


def process_count() -> int:
    return int(jax.process_count())


def unique_name(prefix: str) -> str:
    """Same on every process as long as every process calls it in the same order."""
    return f"jaxlearn_ckpt_{prefix}_{next(_counter)}"


def foreground_barrier(name: str) -> None:
    if process_count() > 1:
        multihost_utils.sync_global_devices(name)


def background_barrier(name: str, timeout_s: float) -> None:
    if process_count() > 1:
        from orbax.checkpoint import multihost as ocp_multihost

        ocp_multihost.get_barrier_sync_fn()(key=name, timeout_ms=int(timeout_s * 1000))


def all_processes_ok(ok: bool) -> bool:
    """True iff `ok` on every process (foreground only: it is a device collective)."""
    if process_count() == 1:
        return ok
    flags = multihost_utils.process_allgather(np.array([1 if ok else 0], np.int32))
    return bool(np.min(flags) == 1)
