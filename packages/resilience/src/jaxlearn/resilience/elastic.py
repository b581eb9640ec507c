"""Elastic restart: train on the devices that came back, with the same global batch.

    decision = adapt_to_devices(cfg, jax.devices())   # before cfg.instantiate()
    trainer = cfg.instantiate()
    decision.record()                                 # first run: remember the reference

The first run records `<output_dir>/elastic.json`: its device count, batch shards,
`learner.num_microbatches` and so the per-device microbatch. A restart on a different
device count keeps `input.global_batch_size` (the data order and the optimizer's view of
a step do not change), lets the mesh's `-1` axis absorb the new device count, and sets
`learner.num_microbatches` to the smallest value for which the batch still divides the
batch shards and the per-device microbatch is no larger than the reference one (so it
still fits in memory). When the devices come back, the reference microbatching returns.
The trainer restores the newest checkpoint with resharding onto the new mesh, and the
input pipeline merges the per-process iterator states if the process count changed.

The batch is split in rows: an input config with `batch_rows()` (GRPO's and DPO's,
whose rows each hold a prompt and its completions) has that many rows per global batch,
any other `global_batch_size` (the rule of `jaxlearn.runtime.input_pipeline.batch_rows`,
restated here: this package does not depend on the runtime).

Results after an elastic restart equal the uninterrupted run up to floating-point
reassociation (reductions over a different device count), not bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Optional, Sequence

import jax
import numpy as np

from jaxlearn.checkpoint import storage
from jaxlearn.config import ConfigError
from jaxlearn.mesh import logical_to_partition_spec, mesh_from_config

log = logging.getLogger("jaxlearn.elastic")

REFERENCE_FILE = "elastic.json"


class ElasticError(ConfigError):
    """The job cannot run on the devices available while keeping its global batch."""


def batch_shards(cfg: Any, devices: Sequence[Any]) -> int:
    """How many ways the batch axis is split on the mesh `cfg` builds from `devices`."""
    try:
        mesh = mesh_from_config(cfg, devices)
    except Exception as e:
        raise ElasticError(f"cannot build the mesh {cfg.mesh_shape} on {len(devices)} "
                           f"device(s): {e} (elastic restarts need a -1 axis)") from e
    spec = logical_to_partition_spec(("batch",), cfg.mesh_axis_rules, mesh)
    axes = spec[0] if spec and spec[0] is not None else ()
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def fit_microbatches(global_batch: int, shards: int, max_per_device: int,
                     at_least: int = 1, what: str = "input.global_batch_size") -> int:
    """Smallest k >= at_least with global_batch % (shards * k) == 0 and
    global_batch / (shards * k) <= max_per_device (`what` names the batch in errors)."""
    for k in range(max(1, at_least), global_batch + 1):
        if global_batch % (shards * k) == 0 and global_batch // (shards * k) <= max_per_device:
            return k
    raise ElasticError(
        f"{what}={global_batch} cannot be split over {shards} batch shard(s) "
        f"with at most {max_per_device} row(s) per device and microbatch")


def _rows(input_cfg: Any) -> tuple[int, str]:
    """(rows of a global batch, how errors name them): see the module doc."""
    if hasattr(input_cfg, "batch_rows"):
        return int(input_cfg.batch_rows()), "input.batch_rows()"
    return int(input_cfg.global_batch_size), "input.global_batch_size"


@dataclasses.dataclass
class ElasticDecision:
    output_dir: str
    num_devices: int
    batch_shards: int
    num_microbatches: int
    global_batch_size: int
    reference: Optional[dict[str, Any]]
    changed: bool
    batch_rows: int = 0  # 0: global_batch_size.

    @property
    def per_device_microbatch(self) -> int:
        rows = self.batch_rows or self.global_batch_size
        return rows // (self.batch_shards * self.num_microbatches)

    def record(self) -> None:
        """Writes the reference on the first run (process 0 only)."""
        if self.reference is not None or jax.process_index() != 0:
            return
        directory = storage.local_dir(self.output_dir)  # An object store's: a local mirror.
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, REFERENCE_FILE)
        data = {"num_devices": self.num_devices, "batch_shards": self.batch_shards,
                "num_microbatches": self.num_microbatches,
                "global_batch_size": self.global_batch_size,
                "batch_rows": self.batch_rows or self.global_batch_size,
                "per_device_microbatch": self.per_device_microbatch}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def read_reference(output_dir: str) -> Optional[dict[str, Any]]:
    path = os.path.join(storage.local_dir(output_dir), REFERENCE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return dict(json.load(f))


def adapt_to_devices(cfg: Any, devices: Optional[Sequence[Any]] = None) -> ElasticDecision:
    """Sets `cfg.learner.num_microbatches` for `devices` (default: all devices) against the
    run's recorded reference; see the module doc."""
    devices = list(jax.devices() if devices is None else devices)
    batch = int(cfg.input.global_batch_size)
    rows, what = _rows(cfg.input)
    shards = batch_shards(cfg, devices)
    ref = read_reference(cfg.output_dir)
    micro = int(cfg.learner.num_microbatches)
    changed = False
    if ref is not None:
        if int(ref["global_batch_size"]) != batch:
            raise ElasticError(f"input.global_batch_size={batch} but this run started with "
                               f"{ref['global_batch_size']} ({REFERENCE_FILE} in "
                               f"{cfg.output_dir}); an elastic restart keeps the global batch")
        if int(ref["num_devices"]) == len(devices):
            new_micro = int(ref["num_microbatches"])
        else:
            new_micro = fit_microbatches(rows, shards, int(ref["per_device_microbatch"]),
                                         what=what)
        if new_micro != micro or int(ref["num_devices"]) != len(devices):
            changed = True
            log.warning(
                "elastic restart: %d device(s) (the run started on %d), batch split %d ways; "
                "learner.num_microbatches %d -> %d keeps the global batch %d (%d rows) with "
                "%d row(s) per device and microbatch", len(devices), ref["num_devices"], shards,
                micro, new_micro, batch, rows, rows // (shards * new_micro))
        micro = new_micro
        cfg.learner.num_microbatches = micro
    return ElasticDecision(cfg.output_dir, len(devices), shards, micro, batch, ref, changed,
                           rows)


__all__ = ["ElasticDecision", "ElasticError", "adapt_to_devices", "batch_shards",
           "fit_microbatches", "read_reference"]
