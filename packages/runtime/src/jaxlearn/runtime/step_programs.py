"""The compiled train steps, one per batch shape, and the trimming that picks the shape.

    programs = StepPrograms(trainer.compile_train_step)
    local = trim_to_longest(local, multiple=32)      # [rows, 128] -> [rows, 64]
    fn, flops = programs.get(batch) or programs.compile(batch, keep_later=True)

A batch whose rows are mostly padding (short preference pairs, sampled completions) need
not be computed at its input's full `seq_len`: `trim_to_longest` cuts the sequence axis
to the longest row's real tokens rounded up to `multiple` (the same length on every
process), so a step costs what its rows hold, as pad-to-longest batching does in
transformers. Each distinct length compiles the step once (at most `seq_len / multiple`
programs, each also in a non-donating variant for the step after a save, compiled on a
thread when the first one is).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxlearn.runtime.trainer_support import BackgroundCompile, abstract_like

log = logging.getLogger("jaxlearn.trainer")


def trim_to_longest(local: dict[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """`local` with every feature's last (sequence) axis cut to L: the longest row's real
    tokens (`segment_ids` > 0, else `target_labels` >= 0) over all processes, rounded up to
    a multiple of `multiple`, at most the input's length."""
    real = local["segment_ids"] > 0 if "segment_ids" in local else local["target_labels"] >= 0
    seq = real.shape[-1]
    on = np.flatnonzero(real.reshape(-1, seq).any(axis=0))
    longest = int(on[-1]) + 1 if len(on) else 1
    if jax.process_count() > 1:  # Every process must compile the same shape.
        longest = int(np.max(multihost_utils.process_allgather(np.int32(longest))))
    length = min(seq, -(-longest // multiple) * multiple)
    if length == seq:
        return local
    return {k: v[..., :length] if v.shape[-1] == seq else v for k, v in local.items()}


def shape_key(batch: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in batch.items()))


class StepPrograms:
    """`compile(abstract_batch, donate=)` results per batch shape (module doc)."""

    def __init__(self, compile: Callable[..., Any]):
        self._compile = compile
        self._steps: dict[Any, Any] = {}
        self._keep: dict[Any, BackgroundCompile] = {}
        self.flops: dict[Any, Optional[float]] = {}

    def __len__(self) -> int:
        return len(self._steps)

    def get(self, batch: dict[str, Any]) -> Optional[tuple[Any, Optional[float]]]:
        """(the donating step for `batch`'s shape, its FLOPs per device), or None when
        that shape has not been compiled."""
        key = shape_key(batch)
        return (self._steps[key], self.flops[key]) if key in self._steps else None

    def compile(self, batch: dict[str, Any], *,
                keep_later: bool) -> tuple[Any, Optional[float]]:
        """Compiles the step for `batch`'s shape: (step, FLOPs per device); with
        `keep_later`, its non-donating variant starts compiling on a thread."""
        key = shape_key(batch)
        abstract = abstract_like(batch)
        t0 = time.monotonic()
        compiled = self._compile(abstract)
        shape = "x".join(map(str, batch["input_ids"].shape))
        log.info("compiled the train step in %.1fs%s", time.monotonic() - t0,
                 f" (batch {shape})" if self._steps else "")
        cost = compiled.cost_analysis()
        if isinstance(cost, list):
            cost = cost[0] if cost else {}
        self.flops[key] = float(cost.get("flops", 0.0)) if cost else None
        self._steps[key] = compiled
        self._keep[key] = BackgroundCompile(lambda a: self._compile(a, donate=False))
        if keep_later:
            self._keep[key].start(abstract)
        return compiled, self.flops[key]

    def keep(self, batch: dict[str, Any]) -> Any:
        """The non-donating step for `batch`'s shape (waits for its compilation)."""
        return self._keep[shape_key(batch)].get(abstract_like(batch))

    def join(self) -> None:
        """Waits for every background compilation (none outlives the run)."""
        for k in self._keep.values():
            k.join()
