"""The layouts worth considering for a model, batch and target (`jaxlearn.aot.plan`):
mesh shapes whose axes each shard some parameter and split the batch evenly."""

from __future__ import annotations

import math
from typing import Any, Optional

from jaxlearn.aot.target import Target
from jaxlearn.config import ConfigBase
from jaxlearn.mesh import logical_to_partition_spec


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Space:
    """Which layouts are worth compiling for this model, batch and target."""

    def __init__(self, cfg: ConfigBase, target: Target, global_batch: int,
                 max_model_parallel: int, *, num_devices: Optional[int] = None,
                 param_specs: Optional[list[Any]] = None):
        """`num_devices`: the devices of one pipeline stage (default: the target's)."""
        self.cfg = cfg
        self.n = num_devices or target.num_devices
        self.per_granule = min(self.n, target.num_devices // target.num_granules)
        self.global_batch = global_batch
        self.max_model = max_model_parallel
        self.rules = cfg.mesh_axis_rules
        from jaxlearn.module import flatten_specs

        if param_specs is None:
            model = cfg.model.clone(name="model").instantiate()
            param_specs = [s for _, s in flatten_specs(
                model.create_parameter_specs_recursively())]
        self.param_specs = param_specs
        self.pruned: dict[str, int] = {}

    def _prune(self, why: str) -> bool:
        self.pruned[why] = self.pruned.get(why, 0) + 1
        return False

    def sharded_axes(self, sizes: dict[str, int]) -> set[str]:
        used: set[str] = set()
        for spec in self.param_specs:
            ps = logical_to_partition_spec(spec.mesh_axes, self.rules, sizes, shape=spec.shape)
            for entry in ps:
                if entry is None:
                    continue
                used.update((entry,) if isinstance(entry, str) else entry)
        return used

    def batch_shards(self, sizes: dict[str, int]) -> int:
        ps = logical_to_partition_spec(("batch", None), self.rules, sizes)
        entry = ps[0] if len(ps) else None
        if entry is None:
            return 1
        axes = (entry,) if isinstance(entry, str) else entry
        return math.prod(sizes.get(a, 1) for a in axes)

    def batch_ok(self, sizes: dict[str, int], microbatches: int) -> bool:
        if self.global_batch % microbatches:
            return False
        return (self.global_batch // microbatches) % self.batch_shards(sizes) == 0

    def valid(self, sizes: dict[str, int]) -> bool:
        m = sizes["model"]
        if m > 1 and (m > self.max_model or self.per_granule % m):
            return self._prune("model axis beyond the fast link or max_model_parallel")
        used = self.sharded_axes(sizes)
        for axis in ("model", "expert", "fsdp"):
            if sizes[axis] > 1 and axis not in used:
                return self._prune(f"{axis} axis shards no parameter")
        if not self.batch_ok(sizes, 1):
            return self._prune("batch does not split over the batch axes")
        return True

    def groups(self) -> dict[tuple[int, int], list[dict[str, int]]]:
        """(model, expert) -> valid sizes, most `fsdp` first."""
        out: dict[tuple[int, int], list[dict[str, int]]] = {}
        for m in _divisors(self.n):
            for e in _divisors(self.n // m):
                rest = self.n // (m * e)
                options = []
                for f in sorted(_divisors(rest), reverse=True):
                    sizes = {"data": rest // f, "fsdp": f, "model": m, "expert": e}
                    if self.valid(sizes):
                        options.append(sizes)
                if options:
                    out[(m, e)] = options
        return dict(sorted(out.items()))


__all__ = ["Space"]
