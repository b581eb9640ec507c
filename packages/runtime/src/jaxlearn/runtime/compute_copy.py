"""The compute copy: f32 master weights for the optimizer, a narrower copy for the model.

With `learner.compute_param_copy=True` and a model whose compute dtype (`model.dtype`,
e.g. bfloat16) is narrower than its parameters' dtype (float32), the train state carries,
next to `params`, a copy of every matmul weight in the compute dtype under
`COPY_KEY` ("compute_params"). The matmul weights are the float parameters whose spec has
`fan_axes`: dense, attention and expert projections, embeddings, LoRA adapters; the
layers read each of them only cast to the compute dtype, so reading the copy instead gives
the same forward bits. Norm scales, biases and routers (read in f32) stay the master's.

One jitted step then (1) runs the forward and backward on the copy, (2) updates the f32
masters and (3) writes the next copy from the new masters, a convert that XLA fuses into
the optimizer's elementwise pass, instead of converting each f32 weight at its uses
(forward, and again under remat or per microbatch). Frozen weights (outside
`learner.trainable`, e.g. a LoRA base) keep their copy from step to step: converted once
per run, where without the copy every step converts all of them. Gradients flow to the
masters through `ComputeCopy.forward`: a weight's gradient arrives in the compute dtype
(the backward matmul's output is rounded once, as torch autocast's is) and is widened to
the master's dtype before clipping and Adam; microbatches accumulate in the master's dtype.

The copy is derived state: the checkpointer never sees it (`checkpointed(state)`), a
restore rebuilds it from the restored masters (`attach`), bit for bit what the
uninterrupted run held, so checkpoints are the same with the copy on or off.

Memory: the copy takes compute-dtype bytes per matmul weight for the whole run (2 B per
parameter for bf16) and saves part of the step's temp (the per-use converts of the same
weights, kept as backward residuals, and f32 dW buffers). Measured on the 2-layer bench
Llama (`tools/bench/jl_train_ab.py`, 32000 vocab, 39.1M matmul weights): arguments
+78.2 MB, temp 462.3 -> 416.9 MB, so +32.8 MB per step in all.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxlearn.module import flatten_specs

COPY_KEY = "compute_params"


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        tree = tree[name]
    return tree


def _set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


class ComputeCopy:
    """The matmul weights of `param_specs` kept in `dtype` between steps (None: off)."""

    def __init__(self, dtype: Optional[Any], param_specs: Any):
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.paths: tuple[tuple[str, ...], ...] = ()
        if self.dtype is None or not jnp.issubdtype(self.dtype, jnp.floating):
            return
        narrow = self.dtype.itemsize
        self.paths = tuple(
            tuple(path.split("/")) for path, spec in flatten_specs(param_specs)
            if spec.fan_axes is not None and jnp.issubdtype(spec.dtype, jnp.floating)
            and jnp.dtype(spec.dtype).itemsize > narrow
        )

    @property
    def enabled(self) -> bool:
        return bool(self.paths)

    def make(self, params: Any, previous: Optional[dict] = None,
             trainable: Optional[Any] = None) -> dict:
        """The copy of `params`: a nested dict holding only the copied leaves. With the
        last copy (`previous`) and the learner's `trainable` mask, a frozen leaf (e.g. a
        LoRA base weight) keeps its previous copy: its master never changes, so the step
        converts only what it trains."""
        out: dict = {}
        for path in self.paths:
            if previous is not None and trainable is not None and not _get(trainable, path):
                _set_path(out, path, _get(previous, path))
            else:
                _set_path(out, path, _get(params, path).astype(self.dtype))
        return out

    def state(self, params: Any, previous: Optional[dict] = None,
              trainable: Optional[Any] = None) -> dict:
        """The state entries to add next to `params` ({} when off); `previous` and
        `trainable` as for `make`."""
        return {COPY_KEY: self.make(params, previous, trainable)} if self.enabled else {}

    def forward(self, params: Any, state: Any) -> Any:
        """`params` with the copied leaves taken from `state[COPY_KEY]`; the gradient with
        respect to `params` is the copy's, widened to each master's dtype."""
        if not self.enabled or COPY_KEY not in state:
            return params
        return _substitute(params, state[COPY_KEY])

    def checkpointed(self, state: Any) -> Any:
        """`state` without the copy (what is saved, and the restore target)."""
        return {k: v for k, v in state.items() if k != COPY_KEY}

    def attach(self, state: Any, shardings: Any, previous: Any = None) -> Any:
        """`state` (a checkpointed one) with its copy: `previous`'s when that state holds
        the same master params (after a save), else rebuilt from `state["params"]` in one
        jitted call placed per `shardings[COPY_KEY]`."""
        if not self.enabled:
            return state
        if previous is not None and COPY_KEY in previous and all(
            a is b for a, b in zip(jax.tree.leaves(state["params"]),
                                   jax.tree.leaves(previous["params"]))
        ):
            return dict(state, **{COPY_KEY: previous[COPY_KEY]})
        copy = jax.jit(self.make, out_shardings=shardings[COPY_KEY])(state["params"])
        return dict(state, **{COPY_KEY: copy})


def _merge(params: Any, copy: Any) -> Any:
    if not isinstance(copy, dict):
        return copy
    return {k: _merge(v, copy[k]) if k in copy else v for k, v in params.items()}


@jax.custom_vjp
def _substitute(params: Any, copy: Any) -> Any:
    return _merge(params, copy)


def _substitute_fwd(params: Any, copy: Any) -> tuple[Any, Any]:
    dtypes = jax.tree.map(lambda p: jnp.zeros((0,), p.dtype), params)
    return _merge(params, copy), (dtypes, copy)


def _substitute_bwd(res: Any, g: Any) -> tuple[Any, Any]:
    dtypes, copy = res
    return (jax.tree.map(lambda d, x: x.astype(d.dtype), dtypes, g),
            jax.tree.map(jnp.zeros_like, copy))


_substitute.defvjp(_substitute_fwd, _substitute_bwd)
