"""Log-probabilities of sampled and prompt tokens, and their OpenAI response forms.

Device side (`token_logprobs`): log_softmax in float32 of the *raw* model logits, the
same logits the sampler receives, before repetition/presence/frequency penalties, logit
bias, the vocabulary mask, temperature and top-k/top-p (vLLM's default "raw logprobs").
So a greedy token is always the top alternative, and the values do not depend on the
request's sampling settings.

Host side: `TokenLogprob` per token, and the completions (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`) and chat (`content: [{token, logprob, bytes,
top_logprobs}]`) forms.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

MAX_LOGPROBS = 20  # Most top alternatives per token (OpenAI's limit).


def token_logprobs(logits: Array, tokens: Array, k: int) -> dict[str, Array]:
    """logits [..., v] (any float), tokens [...] int -> {"lp": [...] f32 (the tokens'
    logprobs), "top_ids": [..., k] int32, "top_lp": [..., k] f32 (best first)}."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    out = {"lp": jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]}
    if k > 0:
        top_lp, top_ids = jax.lax.top_k(lp, min(k, lp.shape[-1]))
        out["top_ids"], out["top_lp"] = top_ids.astype(jnp.int32), top_lp
    return out


def wanted_logprobs(logits: Array, tokens: Array, want: Array) -> dict[str, Array]:
    """`token_logprobs(logits, tokens, MAX_LOGPROBS)` when some row wants logprobs (want
    [b] bool), else zeros of the same shapes (`lax.cond`: a call without logprobs skips
    the log-softmax and the top-k). The host keeps each row's own k of the 20."""
    def compute(x: Array) -> dict[str, Array]:
        return token_logprobs(x, tokens, MAX_LOGPROBS)

    def zeros(x: Array) -> dict[str, Array]:
        shapes = jax.eval_shape(compute, x)
        return {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}

    return jax.lax.cond(jnp.any(want), compute, zeros, logits)


@dataclasses.dataclass
class TokenLogprob:
    """One token's logprob and its best alternatives [(id, logprob)], best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def unpack(out: dict[str, np.ndarray], index: tuple[int, ...], token: int, k: int
           ) -> TokenLogprob:
    """The TokenLogprob at `index` of a call's host outputs (`token_logprobs` arrays),
    keeping k alternatives."""
    top: list[tuple[int, float]] = []
    if k > 0:
        ids, lps = out["top_ids"][index][:k], out["top_lp"][index][:k]
        top = [(int(i), float(v)) for i, v in zip(ids, lps)]
    return TokenLogprob(int(token), float(out["lp"][index]), top)


def cumulative(entries: Sequence[TokenLogprob]) -> float:
    return float(sum(e.logprob for e in entries))


Decode = Callable[[int], str]


def _json_float(x: float) -> Optional[float]:
    """JSON has no -inf: a zero-probability token's logprob is sent as the lowest f32."""
    return x if np.isfinite(x) else float(np.finfo(np.float32).min)


def completion_logprobs(entries: Sequence[Union[int, TokenLogprob]], k: int, decode: Decode,
                        offset: int = 0, texts: Sequence[str] = ()) -> dict[str, Any]:
    """The completions `logprobs` object for `entries` (a bare id: a token without a
    logprob, the first prompt token). top_logprobs dicts hold the k best and the token
    itself (as vLLM does); text_offset counts characters from `offset`. `texts`: the
    strings of the first len(texts) entries (an echoed prompt's, special tokens written
    out), the others are `decode(id)`."""
    tokens: list[str] = []
    token_lps: list[Optional[float]] = []
    tops: list[Optional[dict[str, Optional[float]]]] = []
    offsets: list[int] = []
    for n, e in enumerate(entries):
        if isinstance(e, int):
            text = texts[n] if n < len(texts) else decode(e)
            tokens.append(text)
            token_lps.append(None)
            tops.append(None)
            offsets.append(offset)
            offset += len(text)
            continue
        text = texts[n] if n < len(texts) else decode(e.token)
        top = {decode(i): _json_float(v) for i, v in e.top[:k]}
        top.setdefault(text, _json_float(e.logprob))
        tokens.append(text)
        token_lps.append(_json_float(e.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(entries: Sequence[TokenLogprob], k: int, decode: Decode) -> dict[str, Any]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(tok: int, lp: float) -> dict[str, Any]:
        text = decode(tok)
        return {"token": text, "logprob": _json_float(lp), "bytes": list(text.encode())}

    content = []
    for e in entries:
        d = item(e.token, e.logprob)
        d["top_logprobs"] = [item(i, v) for i, v in e.top[:k]]
        content.append(d)
    return {"content": content}
