"""AOT compilation of the inference steps (prefill and one decode step) for `jaxlearn aot`.

The same `CausalLM.extend_step` layer code the engine runs (here with a contiguous
batch-sharded cache rather than the engine's replicated page pool), lowered for the
trainer's mesh with abstract (sharded) parameters, so the AOT report covers serving memory
too. Prefill computes the logits of each prompt's last position only, as the engine's
prefill does (`logits_index`): a [batch, prompt, vocab] logits tensor would dominate the
memory of a long prompt with a large vocabulary and is never made when serving.
The KV cache is sharded over the batch axes (whichever of its dims is the batch).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxlearn.module import functional


def _step(model: Any, *, last_only: bool) -> Any:
    """(params, states, ids [batch, steps]) -> (states, logits): `extend_step`; with
    `last_only`, logits [batch, 1, vocab] of the last step only."""
    def fn(params: Any, states: Any, ids: jax.Array) -> Any:
        last = jnp.full((ids.shape[0], 1), ids.shape[1] - 1, jnp.int32) if last_only else None
        return functional(model, None, params, (states, ids, last), method="extend_step",
                          is_training=False)[0]

    return fn


def _replicas(trainer: Any) -> int:
    """How many devices hold the same batch shard (mesh axes the batch is not split on)."""
    spec = trainer._sharding(("batch",)).spec
    used = spec[0] if spec and spec[0] is not None else ()
    used = (used,) if isinstance(used, str) else tuple(used)
    total = 1
    for name, size in trainer.mesh.shape.items():
        if name not in used:
            total *= size
    return total


def compile_inference_steps(
    trainer: Any,
    *,
    batch_size: Optional[int] = None,
    prompt_len: Optional[int] = None,
    max_len: Optional[int] = None,
) -> dict[str, Any]:
    """{"prefill": compiled, "decode_step": compiled} for `trainer.model` on its mesh.

    Defaults, a serving shape rather than the training batch: one sequence per batch shard
    (the devices the `batch` axis spans), prompts of half the training sequence length, and
    a KV cache of the full training sequence length.
    """
    inputs = trainer.config.input
    seq = int(getattr(inputs, "seq_len", 128))
    shards = trainer._sharding(("batch",)).num_devices // _replicas(trainer)
    b: int = batch_size if batch_size is not None else max(shards, 1)
    s: int = prompt_len if prompt_len is not None else max(seq // 2, 1)
    cache_len = max_len or seq
    model = trainer.model
    params = trainer.abstract_state()["params"]

    def init(p: Any, rows: int) -> Any:
        return functional(model, None, p, (rows, cache_len), method="init_states",
                          is_training=False)[0]

    def batch_sharded(tree: Any, other: Any) -> Any:
        """`tree`'s leaves with their batch axis (the one that differs in `other`, traced
        with another batch size) sharded like the batch: a layer-stacked cache whose
        layer count equals the batch size is not mistaken for the batch."""
        def shard(leaf: Any, alt: Any) -> Any:
            axes = tuple("batch" if n != m else None for n, m in zip(leaf.shape, alt.shape))
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                        sharding=trainer._sharding(axes, leaf.shape))
        return jax.tree.map(shard, tree, other)

    states = batch_sharded(*(jax.eval_shape(functools.partial(init, rows=r), params)
                             for r in (b, b + 1)))
    out: dict[str, Any] = {}
    with jax.set_mesh(trainer.mesh):
        for name, steps in (("prefill", s), ("decode_step", 1)):
            fn = _step(model, last_only=name == "prefill")
            ids, results = [], []
            for rows in (b, b + 1):
                ids.append(jax.ShapeDtypeStruct((rows, steps), jnp.int32))
                st = states if rows == b else jax.eval_shape(
                    functools.partial(init, rows=rows), params)
                results.append(jax.eval_shape(fn, params, st, ids[-1]))
            outs = batch_sharded(*results)
            ids_b = jax.ShapeDtypeStruct((b, steps), jnp.int32,
                                         sharding=trainer._sharding(("batch", None), (b, steps)))
            # Outputs sharded as the inputs (the donated cache is updated in place), not
            # left to the compiler, which may replicate a whole cache on every device.
            jitted = jax.jit(fn, donate_argnums=(1,),
                             out_shardings=jax.tree.map(lambda x: x.sharding, outs))
            out[name] = jitted.lower(params, states, ids_b).compile()
    return out
