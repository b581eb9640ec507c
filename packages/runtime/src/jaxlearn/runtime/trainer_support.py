"""Pieces of the trainer that need no `Trainer` instance: what one run carries between
its phases, pytree key paths, device choice for small meshes, state-update merging, and
merged input states for an elastic resume."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

import jax
import numpy as np

log = logging.getLogger("jaxlearn.trainer")


@dataclasses.dataclass
class Run:
    """What one `Trainer.run` carries between its phases."""

    is_main: bool
    guard: Any  # jaxlearn.resilience.manager.Resilience
    data: Any = None
    checkpointer: Any = None
    writer: Any = None
    state: Any = None
    step: int = 0
    summaries: Any = None
    last: dict[str, float] = dataclasses.field(default_factory=dict)
    profiling: bool = False
    keep_input: bool = False  # The state of the last step is being saved: do not donate.
    tokens_per_step: int = 0
    t_last: float = dataclasses.field(default_factory=time.monotonic)
    steps_since: int = 0


def merged_iterator_state(checkpointer: Any, step: int, saved_processes: int) -> Any:
    """The input states of all `saved_processes` of `step`, merged so that this process
    count can resume them (elastic restart with fewer or more hosts)."""
    from jaxlearn.runtime.input_pipeline import merge_states

    states = [checkpointer.read_metadata(step, process_index=i).data_iterator_state
              for i in range(saved_processes)]
    if any(s is None for s in states):
        return None
    log.warning("step %d was saved by %d process(es), resuming on %d: merging their input "
                "states", step, saved_processes, jax.process_count())
    return merge_states(states)


def dict_keys(keypath: Any) -> tuple[str, ...]:
    """The dict-key names along a pytree key path (attribute/index entries dropped)."""
    return tuple(str(k.key) for k in keypath if isinstance(k, jax.tree_util.DictKey))


def devices_for(mesh_shape: Any) -> Optional[list]:
    """A fully specified flat shape smaller than the device count uses the first devices
    (e.g. a single-device reference run on a multi-device host)."""
    if isinstance(mesh_shape, tuple) and all(d > 0 for d in mesh_shape):
        n = int(np.prod(mesh_shape))
        if n < jax.device_count() and jax.process_count() == 1:
            return jax.devices()[:n]
    return None


def merge_updates(params: Any, updates: Any) -> Any:
    """Overwrites params with non-empty state updates of the same path (e.g. batch stats)."""
    if not isinstance(updates, dict) or not updates:
        return params
    out = dict(params)
    for k, v in updates.items():
        if isinstance(v, dict):
            if v and k in out and isinstance(out[k], dict):
                out[k] = merge_updates(out[k], v)
        elif k in out:
            out[k] = v
    return out
