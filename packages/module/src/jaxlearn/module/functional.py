"""`functional`: the pure entry point into a module tree.

    outputs, collection = functional(model, prng_key, state, inputs, method="forward")
    state = merge_state_updates(state, collection.state_updates)

`inputs` is a tuple/list of positional arguments, or a dict of keyword arguments. It is a
pure function of its array arguments, so it works under jit, grad, vmap, scan and remat.
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from jaxlearn.module.context import InvocationContext, Nested, OutputCollection
from jaxlearn.module.module import Module


def functional(
    module: Module,
    prng_key: Optional[jax.Array],
    state: Nested,
    inputs: Any,
    *,
    method: str = "forward",
    is_training: bool = True,
    side_inputs: Optional[Nested] = None,
) -> tuple[Any, OutputCollection]:
    """Calls `module.<method>(*inputs)` (or `**inputs`) with `state` as its parameters.

    side_inputs: values any module of the call reads with `side_input(name)` (per-call
    inputs that are not arguments of every method between the root and the reader).

    The root's own `remat_spec` applies in training, as it would if the root were a child.
    """
    args: tuple[Any, ...]
    if isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        args, kwargs = (inputs,), {}
    collection = OutputCollection()
    ctx = InvocationContext(
        name=module.name,
        parent=None,
        module=module,
        state=state,
        output_collection=collection,
        is_training=is_training,
        prng_key=prng_key,
        side_inputs=dict(side_inputs or {}),
    )
    fn = getattr(type(module), method)
    outputs = module._run(ctx, getattr(fn, "__wrapped__", fn), args, kwargs)
    return outputs, collection


def merge_state_updates(state: Nested, updates: Nested) -> Nested:
    """`state` with every leaf of `updates` (e.g. batch statistics) written at its path.

    Empty sub-dicts (children that recorded nothing) are skipped, as are paths that `state`
    does not have (updates that are not state, e.g. caches the caller keeps elsewhere).
    Returns new dicts; the inputs are not modified.
    """
    out = dict(state)
    for key, value in updates.items():
        if key not in out:
            continue
        if isinstance(value, dict):
            if value and isinstance(out[key], dict):
                out[key] = merge_state_updates(out[key], value)
        else:
            out[key] = value
    return out
