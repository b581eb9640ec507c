"""`functional`: the pure entry point into a module tree.

    outputs, collection = functional(model, prng_key, state, inputs, method="forward")

`inputs` is a tuple/list of positional arguments, or a dict of keyword arguments. It is a
pure function of its array arguments, so it works under jit, grad, vmap, scan and remat.
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from jaxlearn.module.context import InvocationContext, Nested, OutputCollection, push_context
from jaxlearn.module.module import Module


def functional(
    module: Module,
    prng_key: Optional[jax.Array],
    state: Nested,
    inputs: Any,
    *,
    method: str = "forward",
    is_training: bool = True,
) -> tuple[Any, OutputCollection]:
    """Calls `module.<method>(*inputs)` (or `**inputs`) with `state` as its parameters."""
    if isinstance(inputs, dict):
        args, kwargs = (), inputs
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
    )
    with push_context(ctx):
        outputs = getattr(module, method)(*args, **kwargs)
    return outputs, collection
