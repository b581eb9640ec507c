"""Presence / frequency penalties and logit bias (the OpenAI definitions), batched.

For row b and token j, with c[b, j] the times j occurs among the row's *generated*
tokens (the prompt does not count):

    logits[b, j] += bias[b, j] - frequency[b] * c[b, j] - presence[b] * (c[b, j] > 0)

`bias` is sparse: each row carries `MAX_LOGIT_BIAS` (token id, bias) pairs, padding pairs
use id = vocab (dropped by the scatter). The arrays have this one shape whatever the
requests use, so they never change the compiled program; a call in which no row uses
any of the three skips them at run time (`any_penalty`, `sampling.penalize`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

MAX_LOGIT_BIAS = 300  # Entries of one request's logit_bias.
MAX_BIAS = 100.0  # |bias| limit; +100 forces a token, -100 bans it.
MAX_PRESENCE_FREQUENCY = 2.0  # |presence_penalty|, |frequency_penalty| limit.


def apply_penalties(logits: Array, counts: Array, pen: dict[str, Array]) -> Array:
    """logits [b, v] f32; counts [b, v] int (generated-token counts); pen: presence [b],
    frequency [b] f32, bias_ids [b, width] int32, bias [b, width] f32 -> [b, v] f32."""
    c = counts.astype(jnp.float32)
    logits = logits - pen["frequency"][:, None] * c - pen["presence"][:, None] * (c > 0)
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, pen["bias_ids"]].add(pen["bias"], mode="drop")


def any_penalty(pen: dict[str, Array], vocab: int) -> Array:
    """Device-side: whether some row of the `pack` arrays uses a penalty or a bias."""
    return (jnp.any(pen["presence"] != 0) | jnp.any(pen["frequency"] != 0)
            | jnp.any(pen["bias_ids"] < vocab))


def pack(params: Sequence[Any], rows: int, vocab: int) -> dict[str, np.ndarray]:
    """Per-row penalty arrays of `params` (SamplingParams) padded to `rows`: presence,
    frequency [rows] and bias_ids / bias [rows, MAX_LOGIT_BIAS] (one shape always)."""
    out = {
        "presence": np.zeros(rows, np.float32),
        "frequency": np.zeros(rows, np.float32),
        "bias_ids": np.full((rows, MAX_LOGIT_BIAS), vocab, np.int32),
        "bias": np.zeros((rows, MAX_LOGIT_BIAS), np.float32),
    }
    for i, p in enumerate(params):
        out["presence"][i] = p.presence_penalty
        out["frequency"][i] = p.frequency_penalty
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            out["bias_ids"][i, : len(ids)] = ids
            out["bias"][i, : len(ids)] = bias
    return out
