"""Non-finite loss/gradient handling: detected inside the jitted step, reported on the host.

Inside the step (`step_flags`, `keep_if`): one bool per gradient leaf (all elements finite)
plus one for the loss, packed into a small vector output; when any is false the update is
not applied (params, optimizer state and EMA stay as they were; the step counter and the
PRNG key advance, so the trajectory stays deterministic). This costs one reduction per
gradient leaf and no host synchronisation.

On the host (`NonFiniteMonitor`): the flags of step N are read after step N+1 has been
dispatched, so reading them never stalls the device queue. Policy `skip` logs the step and
the offending parameter paths and continues (up to `max_consecutive` skipped steps in a
row); `stop` raises NonFiniteError naming them.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.resilience.failures import NonFiniteError

log = logging.getLogger("jaxlearn.nonfinite")

FLAGS_KEY = "nonfinite_flags"
Policy = Literal["skip", "stop", "off"]


def leaf_paths(tree: Any, is_leaf: Any = None) -> list[str]:
    """'/'-joined key paths of the leaves of `tree`, in flattening order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return ["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp) for kp, _ in flat]


def step_flags(loss: jax.Array, grads: Any) -> jax.Array:
    """bool[1 + num_leaves]: [loss finite, grad leaf 0 finite, ...] (traced).

    A leaf is finite iff `sum(g - g)` is: finite - itself is 0, Inf - Inf and NaN are NaN,
    and XLA does not fold a float difference with itself. One vectorized sum per leaf
    reading g once; `all(isfinite)` lowers on CPU to a single-threaded predicate
    reduce-window (3x slower on 26M-element leaves), and `sum(g * 0)` makes XLA:CPU
    write a zero array of g's size for the product."""
    flags = [jnp.all(jnp.isfinite(loss))]
    flags += [jnp.isfinite(jnp.sum(g - g)) for g in jax.tree.leaves(grads)]
    return jnp.stack(flags)


def keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
    """`new` where `ok`, else `old`, leaf by leaf (traced)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


class NonFiniteMonitor:
    """Reads the flags of each step one step late and applies the policy."""

    def __init__(self, policy: Policy, param_paths: list[str], *, max_consecutive: int = 10):
        self.policy = policy
        self.paths = param_paths
        self.max_consecutive = max_consecutive
        self._pending: Optional[tuple[int, jax.Array]] = None
        self._consecutive = 0
        self.skipped_steps: list[int] = []
        self.reports: list[str] = []

    def observe(self, step: int, summaries: dict[str, Any]) -> dict[str, Any]:
        """Takes the flags out of `summaries`; checks the previous step's."""
        flags = summaries.pop(FLAGS_KEY, None)
        if flags is None:
            return summaries
        previous, self._pending = self._pending, (step, flags)
        if previous is not None:
            self._check(*previous)
        return summaries

    def drain(self) -> None:
        """Checks the last step's flags (call at the end of training)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._check(*pending)

    def _check(self, step: int, flags: jax.Array) -> None:
        values = np.asarray(jax.device_get(flags))
        if values.all():
            self._consecutive = 0
            return
        bad = [p for p, ok in zip(self.paths, values[1:]) if not ok]
        what = []
        if not values[0]:
            what.append("the loss")
        if bad:
            shown = ", ".join(bad[:20]) + (f" (+{len(bad) - 20} more)" if len(bad) > 20 else "")
            what.append(f"the gradients of {shown}")
        message = f"step {step}: non-finite values (NaN/Inf) in {' and '.join(what)}"
        self.reports.append(message)
        if self.policy == "stop":
            raise NonFiniteError(message + "; the update was not applied; stopping (policy "
                                 "nonfinite='stop')")
        self._consecutive += 1
        self.skipped_steps.append(step)
        log.warning("%s; update skipped (params and optimizer state unchanged)", message)
        if self._consecutive > self.max_consecutive:
            raise NonFiniteError(f"{self._consecutive} consecutive steps with non-finite values "
                                 f"(limit resilience.max_consecutive_nonfinite="
                                 f"{self.max_consecutive}); last: {message}")


__all__ = ["FLAGS_KEY", "NonFiniteMonitor", "keep_if", "leaf_paths", "step_flags"]
