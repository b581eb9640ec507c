"""Which committed steps to keep: a pure function, so it can be property-tested.

A step is kept if ANY rule keeps it:
  * it is the newest committed step (always, whatever the policy);
  * it is among the `keep_last_n` newest (`keep_last_n=None` keeps every step, and then
    nothing is ever deleted);
  * `keep_every_k_steps` divides it;
  * it is among the `keep_best_n` best by `metrics[best_metric]` (`best_mode` 'min' or
    'max'; steps without a finite value for that metric are not candidates; on ties the
    newer step ranks higher).
Because "best" is a total order over (value, step), a step among the best n of every step
ever saved stays among the best n of any subset, so it is never deleted later.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Mapping


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    keep_last_n: int | None = None
    keep_every_k_steps: int | None = None
    keep_best_n: int = 0
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if self.keep_last_n is not None and self.keep_last_n < 1:
            raise ValueError(f"keep_last_n must be >= 1 or None, got {self.keep_last_n}")
        if self.keep_every_k_steps is not None and self.keep_every_k_steps < 1:
            raise ValueError(f"keep_every_k_steps must be >= 1, got {self.keep_every_k_steps}")
        if self.keep_best_n < 0:
            raise ValueError(f"keep_best_n must be >= 0, got {self.keep_best_n}")
        if self.keep_best_n and not self.best_metric:
            raise ValueError("keep_best_n > 0 needs best_metric (the metrics key to rank by)")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")

    def best_steps(self, metrics: Mapping[int, Mapping[str, float]]) -> set[int]:
        if not self.keep_best_n or self.best_metric is None:
            return set()
        sign = 1.0 if self.best_mode == "min" else -1.0
        ranked = sorted(
            (sign * v, -step)
            for step, m in metrics.items()
            if (v := m.get(self.best_metric)) is not None and math.isfinite(v)
        )
        return {-neg_step for _, neg_step in ranked[: self.keep_best_n]}

    def steps_to_keep(self, metrics: Mapping[int, Mapping[str, float]]) -> set[int]:
        """`metrics` maps every committed step to its metrics; returns the steps to keep."""
        steps = sorted(metrics)
        if not steps:
            return set()
        if self.keep_last_n is None:
            return set(steps)
        keep = set(steps[-self.keep_last_n :])
        if self.keep_every_k_steps:
            keep |= {s for s in steps if s % self.keep_every_k_steps == 0}
        keep |= self.best_steps(metrics)
        keep.add(steps[-1])
        return keep
