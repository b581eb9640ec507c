"""A minimal greedy decoding loop (prefill + extend_step through `functional`) for checking
converted checkpoints. It is a reference, not the serving engine (`jaxlearn.inference`):
one batch of equal-length prompts, no sampling, no paging.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.module import functional


def greedy_generate(
    model: Any,
    params: Any,
    prompt_ids: Any,
    max_new_tokens: int,
    *,
    eos_token_ids: Iterable[int] = (),
    max_len: Optional[int] = None,
) -> np.ndarray:
    """Greedy continuation of prompt_ids [batch, prompt] (int, all rows the same length).

    Returns new tokens [batch, n] (n <= max_new_tokens; stops early once every row has
    produced an EOS; rows that finished earlier are padded with their EOS token).
    """
    prompt = jnp.asarray(prompt_ids, jnp.int32)
    if prompt.ndim != 2:
        raise ValueError(f"prompt_ids must be [batch, seq], got shape {prompt.shape}")
    b, s = prompt.shape
    max_len = max_len or s + max_new_tokens
    if max_len < s + max_new_tokens:
        raise ValueError(f"max_len={max_len} < prompt {s} + max_new_tokens {max_new_tokens}")
    params = jax.tree.map(jnp.asarray, params)
    eos = np.asarray(sorted(set(int(i) for i in eos_token_ids)), np.int32)

    def call(p: Any, method: str, *args: Any) -> Any:
        out, _ = functional(model, None, p, args, method=method, is_training=False)
        return out

    # Params are arguments (not closure constants, which XLA would embed in the program).
    @jax.jit
    def prefill(p: Any, ids: jax.Array) -> tuple[Any, jax.Array]:
        states = call(p, "init_states", b, max_len)
        states, logits = call(p, "prefill", states, ids)
        return states, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(p: Any, states: Any, token: jax.Array) -> tuple[Any, jax.Array]:
        states, logits = call(p, "extend_step", states, token[:, None])
        return states, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    states, token = prefill(params, prompt)
    out = [np.asarray(token)]
    done = np.isin(out[-1], eos)
    finished_with = np.where(done, out[-1], 0)
    for _ in range(max_new_tokens - 1):
        if done.all():
            break
        states, token = step(params, states, token)
        t = np.asarray(token)
        t = np.where(done, finished_with, t)
        newly = ~done & np.isin(t, eos)
        finished_with = np.where(newly, t, finished_with)
        done |= newly
        out.append(t)
    return np.stack(out, axis=1)
