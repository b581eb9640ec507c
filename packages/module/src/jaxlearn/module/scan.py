"""Scan over stacked layers inside an invocation context.

A parent holding one child whose parameters are stacked `[num_layers, ...]` calls

    carry, ys = scan_child(self, self.layer, fn, carry, xs)

where `fn(child, carry, xs_i) -> (carry, ys_i)` runs inside the child's context for one
layer. The loop body is traced once, so an N-layer model compiles like one layer. The
child's output collections come back stacked `[num_layers, ...]` under the child's name.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax

from jaxlearn.module.context import (
    InvocationContext,
    OutputCollection,
    child_key,
    current_context,
    labelled_name,
    push_context,
)
from jaxlearn.module.module import Module, ModuleError
from jaxlearn.module.remat import remat

ScanFn = Callable[[Module, Any, Any], tuple[Any, Any]]


def scan_child(
    parent: Module,
    child: Module,
    fn: ScanFn,
    carry: Any,
    xs: Any = None,
    *,
    num_iterations: Optional[int] = None,
    unroll: int | bool = 1,
    label: str = "",
) -> tuple[Any, Any]:
    """Runs `fn` over the leading axis of `child`'s stacked state (and of `xs`).

    Layer i's key is `split(child_key(parent_key, child.name, "scan", label), n)[i]`. A
    second scan over the same child in one call raises unless it has a distinct `label`.
    """
    ctx = current_context()
    if ctx is None or ctx.module is not parent or child.parent is not parent:
        raise ModuleError(f"scan_child({child.path()}) must be called from its parent's call")
    call = (child.name, "scan", label)
    if call in ctx._calls:
        raise ModuleError(
            f"{ctx.path()}: scan_child over '{child.name}' was already run in this call; "
            f"pass a distinct label=... for a second scan"
        )
    state = ctx.state.get(child.name, {})
    leaves = jax.tree.leaves(state)
    n = num_iterations if num_iterations is not None else (leaves[0].shape[0] if leaves else None)
    if n is None:
        raise ModuleError(f"{child.path()}: stateless child needs num_iterations")
    bad = sorted({leaf.shape[:1] for leaf in leaves if leaf.shape[:1] != (n,)})
    if bad:
        raise ModuleError(
            f"{child.path()}: scan_child needs state stacked [{n}, ...] (declare the child "
            f"with _add_stacked_child); found leading dims {bad}"
        )
    ctx._calls.add(call)
    base_key = child_key(ctx.prng_key, child.name, "scan", label)
    keys = jax.random.split(base_key, n) if base_key is not None else None
    is_training = ctx.is_training

    def step(layer_state: Any, key: Any, carry: Any, x: Any) -> tuple[Any, OutputCollection]:
        oc = OutputCollection()
        sub = InvocationContext(
            labelled_name(child.name, label), ctx, child, layer_state, oc, is_training, key
        )
        with push_context(sub):
            out = fn(child, carry, x)
        return out, oc

    spec = child.config.remat_spec
    if is_training and spec is not None:
        step = remat(step, spec)

    def body(carry: Any, inp: Any) -> tuple[Any, Any]:
        layer_state, key, x = inp
        (carry, ys), oc = step(layer_state, key, carry, x)
        return carry, (ys, oc)

    carry, (ys, oc) = jax.lax.scan(body, carry, (state, keys, xs), length=n, unroll=unroll)
    child_oc = ctx.child_collection(labelled_name(child.name, label))
    child_oc.summaries.update(oc.summaries)
    child_oc.state_updates.update(oc.state_updates)
    child_oc.module_outputs.update(oc.module_outputs)
    return carry, ys
