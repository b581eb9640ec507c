"""Sampling: greedy, temperature, top-k, top-p, repetition / presence / frequency
penalties, logit bias, grammar masks, per-request seeds.

`SamplingParams` is the validated per-request setting. `sample_tokens` is the batched,
jit-able sampler the engine runs on device after every forward pass; `filtered_logits`
exposes the distribution it samples from (for tests and for logprobs).

Order of operations (the HF `generate` order):
  1. repetition penalty on every token seen so far (prompt + generated; HF CTRL rule:
     logit > 0 -> logit / p, else logit * p);
  2. presence / frequency penalties over the generated tokens and logit bias
     (`penalties.py`);
  3. ids >= `vocab_limit` (model vocabulary padded past the tokenizer's) get -inf, and
     so do ids the request's grammar refuses (`response_format`, `grammar.py`);
  4. temperature == 0 -> argmax (greedy); else logits / temperature;
  5. top-k (k <= 0: off), then top-p over what top-k kept (top_p >= 1: off; the most
     likely token is always kept);
  6. one categorical draw with key `fold_in(PRNGKey(seed), generated_index)`, so a
     request's tokens depend only on its seed and its own history, never on which other
     requests share the batch.

Every feature is a run-time choice, not a compile-time one: the per-row settings are
arrays of fixed width (logit bias `MAX_LOGIT_BIAS` pairs, grammar bit rows of the whole
vocabulary), and a step no row of the call uses (penalties, the grammar mask, the Gumbel
draw, the top-k/top-p sort) is skipped by `lax.cond` at run time. So one compiled program
serves every combination of sampling features: no request can make the engine compile,
and a batch pays only for what its rows use.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxlearn.decoding.errors import RequestError
from jaxlearn.decoding.grammar import allowed_logits
from jaxlearn.decoding.logprobs import MAX_LOGPROBS
from jaxlearn.decoding.penalties import (
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_PRESENCE_FREQUENCY,
    any_penalty,
    apply_penalties,
)

Array = jax.Array

MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0


def _seed32(seed: int) -> int:
    """Any Python int -> a uint32 seed (64-bit seeds fold their high half in)."""
    seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    return (seed ^ (seed >> 32)) & 0xFFFF_FFFF


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (validated in `__post_init__`).

    max_new_tokens: tokens to generate at most (>= 0; 0: prefill only, e.g. to score a
        prompt with `prompt_logprobs`).
    temperature: 0 = greedy; else in (0, 100].
    top_k: keep the k most likely tokens (<= 0: off).
    top_p: nucleus mass in (0, 1] (1: off).
    repetition_penalty: > 0 (1: off; HF semantics over prompt + generated tokens).
    seed: request seed (None: drawn from os.urandom, so runs differ).
    stop: stop strings; the text ends before the first occurrence of any of them.
    stop_token_ids: extra ids that end generation (the tokenizer's EOS always does unless
        `ignore_eos`).
    presence_penalty, frequency_penalty: in [-2, 2] (OpenAI definitions over the
        generated tokens, `penalties.py`).
    logit_bias: ((token id, bias in [-100, 100]), ...), at most 300, added to the logits
        before sampling.
    logprobs: None, or k in [0, 20]: record each generated token's logprob and its k best
        alternatives (`logprobs.py`: raw model distribution, f32).
    prompt_logprobs: None, or k in [0, 20]: the same for every prompt token after the
        first (the prefill then computes logits at every prompt position).
    grammar: None, or llguidance grammar text (`grammar.response_format_grammar`): every
        generated token is masked to what the grammar allows next (structured output).
    adapter: None (the base model), or the name of a LoRA adapter loaded into the engine
        (`Engine.load_adapter`; an unknown name is a RequestError on `model`).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    grammar: Optional[str] = None
    adapter: Optional[str] = None

    def __post_init__(self) -> None:
        def bad(param: str, why: str) -> RequestError:
            value = getattr(self, param)
            return RequestError(f"{param}={value!r}: {why}", param=param)

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise bad("max_new_tokens", "must be an integer")
        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be >= 0")
        for name, lo, hi in (
            ("temperature", 0.0, MAX_TEMPERATURE),
            ("top_p", 0.0, 1.0),
            ("repetition_penalty", 0.0, MAX_REPETITION_PENALTY),
            ("presence_penalty", -MAX_PRESENCE_FREQUENCY, MAX_PRESENCE_FREQUENCY),
            ("frequency_penalty", -MAX_PRESENCE_FREQUENCY, MAX_PRESENCE_FREQUENCY),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, "must be a number")
            if not (lo <= float(value) <= hi):  # NaN fails too.
                raise bad(name, f"must be in [{lo:g}, {hi:g}]")
        if self.top_p <= 0.0:
            raise bad("top_p", "must be > 0")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise bad("top_k", "must be an integer")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise bad("seed", "must be an integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be integers")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise RequestError(f"model={self.adapter!r}: an adapter name is a non-empty "
                               f"string", param="model")
        if self.grammar is not None and self.ignore_eos:
            raise RequestError("'ignore_eos': cannot be combined with response_format (the "
                               "output ends where the grammar does)", param="ignore_eos")
        self._check_bias_and_logprobs(bad)

    def _check_bias_and_logprobs(self, bad: Callable[[str, str], RequestError]) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
        for entry in self.logit_bias:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], int)
                    and not isinstance(entry[0], bool) and entry[0] >= 0
                    and isinstance(entry[1], (int, float)) and not isinstance(entry[1], bool)
                    and -MAX_BIAS <= float(entry[1]) <= MAX_BIAS):
                raise bad("logit_bias", f"entries are (token id >= 0, bias in "
                                        f"[-{MAX_BIAS:g}, {MAX_BIAS:g}]), got {entry!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                                  or not 0 <= k <= MAX_LOGPROBS):
                raise bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """Whether top-k or top-p cut the distribution (the sampler then sorts)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    def resolved_seed(self) -> int:
        """The uint32 seed of this request (a fresh random one when `seed` is None)."""
        if self.seed is None:
            return int.from_bytes(os.urandom(4), "little")
        return _seed32(self.seed)


def penalize(logits: Array, seen: Array, penalty: Array, vocab_limit: Optional[int],
             counts: Optional[Array] = None, pen: Optional[dict[str, Array]] = None,
             allow: Optional[Array] = None) -> Array:
    """Steps 1-3: logits [b, v] f32, seen [b, v] bool, penalty [b] -> [b, v]; with `pen`
    (`penalties.pack` arrays) and counts [b, v] also presence / frequency penalties and
    logit bias; with `allow` (grammar bit rows [b, ceil(v / 32)] int32,
    `grammar.allowed_logits`; -1: every id allowed) -inf for the ids a row's grammar
    refuses. Penalties and masks run only when some row uses them (`lax.cond`)."""
    p = penalty[:, None].astype(logits.dtype)
    rep = jnp.where(logits > 0, logits / p, logits * p)
    logits = jnp.where(seen & (p != 1.0), rep, logits)
    if pen is not None:
        assert counts is not None, "penalties need the generated-token counts"
        logits = lax.cond(any_penalty(pen, logits.shape[-1]),
                          lambda x: apply_penalties(x, counts, pen), lambda x: x, logits)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        ids = jnp.arange(logits.shape[-1])
        logits = jnp.where(ids[None, :] < vocab_limit, logits, -jnp.inf)
    if allow is not None:
        logits = lax.cond(jnp.any(allow != -1), lambda x: allowed_logits(x, allow),
                          lambda x: x, logits)
    return logits


def filtered_logits(logits: Array, temperature: Array, top_k: Array, top_p: Array) -> Array:
    """Steps 3-4 for sampled rows: logits [b, v] -> logits / temperature [b, v] with -inf
    outside top-k / top-p, in vocabulary order; softmax of it is the sampling
    distribution. Unfiltered rows (top_k <= 0, top_p >= 1) come back unmasked, so they
    draw exactly what mode "sample" draws."""
    b, v = logits.shape
    t = jnp.where(temperature > 0, temperature, 1.0).astype(logits.dtype)
    scaled = logits / t[:, None]
    vals, idx = jax.lax.top_k(scaled, v)  # Descending.
    ranks = jnp.arange(v)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    keep = ranks < k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, vals, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # Mass strictly above each token.
    keep = keep & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0) | (ranks == 0))
    keep_by_id = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], idx].set(keep)
    return jnp.where(keep_by_id, scaled, -jnp.inf)


def request_keys(seeds: Array, index: Array) -> Array:
    """seeds [b] uint32, index [b] int32 (tokens generated so far) -> keys [b] (raw)."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, index)


def argmax(x: Array) -> Array:
    """jnp.argmax(x, -1) (the first index of the row maximum) for x [b, v], as int32,
    through plain reductions: XLA:CPU runs argmax's variadic (value, index) reduce
    unvectorised (1.2 ms of a 21 ms B16 decode step over a 32000-word vocabulary). A wide
    row is read once: the maximum of each block of ids (`_argmax_block`), then the first
    block holding the row maximum and the first id in that block. On [32, 49152] f32
    behind the sampler's penalty select: 1012 -> 324 us a call against the mask-and-min
    form, which built an [b, v] index array (2-core AVX-512 host). A NaN id is either
    skipped by the maximum (XLA:CPU's vectorised reductions skip it) or makes it NaN, and
    then the row gives v - 1: an id in range either way."""
    b, v = x.shape
    blk = _argmax_block(v)
    if blk is None:
        top = jnp.max(x, axis=-1, keepdims=True)
        first = jnp.min(jnp.where(x == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
        return jnp.minimum(first, v - 1).astype(jnp.int32)
    nb = v // blk
    xb = x.reshape(b, nb, blk)
    block_max = jnp.max(xb, axis=-1)  # [b, nb]
    top = jnp.max(block_max, axis=-1, keepdims=True)  # [b, 1]; NaN if any id is NaN.
    first_block = jnp.min(jnp.where(block_max == top, jnp.arange(nb, dtype=jnp.int32), nb),
                          axis=-1)  # [b]; nb: no block holds the maximum (NaN).
    block = jnp.minimum(first_block, nb - 1)
    ids = jnp.take_along_axis(xb, block[:, None, None], axis=1)[:, 0]  # [b, blk]
    first = jnp.min(jnp.where(ids == top, jnp.arange(blk, dtype=jnp.int32), blk), axis=-1)
    return jnp.where(first_block < nb, block * blk + first, v - 1).astype(jnp.int32)


def _argmax_block(v: int) -> Optional[int]:
    """The block width `argmax` reduces a row of v ids in: the largest of 256 .. 32 that
    divides v, for rows of at least 2048 ids; None (one pass with an index mask) else."""
    if v < 2048:
        return None
    return next((blk for blk in (256, 128, 64, 32) if v % blk == 0), None)


def sample_tokens(
    logits: Array,
    seen: Array,
    *,
    temperature: Array,
    top_k: Array,
    top_p: Array,
    penalty: Array,
    seeds: Array,
    index: Array,
    vocab_limit: Optional[int] = None,
    counts: Optional[Array] = None,
    pen: Optional[dict[str, Array]] = None,
    allow: Optional[Array] = None,
) -> Array:
    """One token per row. logits [b, v] (any float), seen [b, v] bool, per-row settings
    [b] (temperature f32, top_k i32, top_p f32, penalty f32, seeds u32, index i32);
    optional counts [b, v] and `pen` arrays (presence / frequency / logit bias), `allow`
    grammar bit rows [b, ceil(v / 32)]. The draw runs only when some row samples
    (temperature > 0) and the top-k/top-p sort only when some sampled row filters, so an
    all-greedy call costs an argmax. Returns [b] int32."""
    logits = penalize(logits.astype(jnp.float32), seen, penalty, vocab_limit, counts, pen,
                      allow)
    greedy = argmax(logits)
    sampled = temperature > 0
    t = jnp.where(sampled, temperature, 1.0)[:, None]

    def draw(logits: Array) -> Array:
        filters = sampled & ((top_k > 0) | (top_p < 1.0))
        scaled = lax.cond(jnp.any(filters),
                          lambda x: filtered_logits(x, temperature, top_k, top_p),
                          lambda x: x / t, logits)
        # jax.random.categorical's own draw (Gumbel-max with the same noise), on `argmax`.
        keys = request_keys(seeds, index)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, scaled.shape[-1:], scaled.dtype))(keys)
        return jnp.where(sampled, argmax(scaled + noise), greedy)

    return lax.cond(jnp.any(sampled), draw, lambda _: greedy, logits)
