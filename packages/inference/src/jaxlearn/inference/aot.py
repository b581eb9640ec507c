"""AOT compilation of the inference steps (prefill and one decode step) for `jaxlearn aot`.

The same `CausalLM.prefill` / `extend_step` layer code the engine runs (here with a
contiguous batch-sharded cache rather than the engine's replicated page pool), lowered
for the trainer's mesh with abstract (sharded) parameters, so the AOT report covers
serving memory too.
The KV cache is sharded over the batch axes (whichever of its dims is the batch).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxlearn.module import functional


def _call(model: Any, method: str) -> Any:
    def fn(params: Any, states: Any, ids: jax.Array) -> Any:
        return functional(model, None, params, (states, ids), method=method,
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

    def init(p: Any) -> Any:
        return functional(model, None, p, (b, cache_len), method="init_states",
                          is_training=False)[0]

    states = jax.eval_shape(init, params)

    def shard(leaf: Any) -> Any:
        axes: list = [None] * leaf.ndim
        if b in leaf.shape:
            axes[list(leaf.shape).index(b)] = "batch"
        sharding = trainer._sharding(tuple(axes), leaf.shape)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    states = jax.tree.map(shard, states)
    out: dict[str, Any] = {}
    with jax.set_mesh(trainer.mesh):
        for name, method, steps in (("prefill", "prefill", s), ("decode_step", "extend_step", 1)):
            ids = jax.ShapeDtypeStruct((b, steps), jnp.int32,
                                       sharding=trainer._sharding(("batch", None), (b, steps)))
            fn = jax.jit(_call(model, method), donate_argnums=(1,))
            out[name] = fn.lower(params, states, ids).compile()
    return out
