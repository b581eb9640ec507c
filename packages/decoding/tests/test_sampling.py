"""Sampling: masks against a NumPy reference, chi-square on the drawn distribution, seeds,
repetition penalty, validation."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlearn.decoding import RequestError, SamplingParams
from jaxlearn.decoding.sampling import filtered_logits, penalize, sample_tokens

V = 16


def ref_kept(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """NumPy reference of the top-k / top-p support (bool [v]) of one row."""
    scaled = logits / temperature
    order = np.argsort(-scaled, kind="stable")
    k = len(logits) if top_k <= 0 else min(top_k, len(logits))
    keep = np.zeros(len(logits), bool)
    keep[order[:k]] = True
    vals = np.where(keep, scaled, -np.inf)
    p = np.exp(vals - vals.max())
    p /= p.sum()
    before = np.cumsum(p[order]) - p[order]
    kept = np.zeros(len(logits), bool)
    for rank, i in enumerate(order[:k]):
        if rank == 0 or top_p >= 1.0 or before[rank] < top_p:
            kept[i] = True
    return kept


def ref_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    kept = ref_kept(logits, temperature, top_k, top_p)
    z = np.where(kept, logits / temperature, -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


def _row(**kw):
    return {k: jnp.asarray([v]) for k, v in kw.items()}


@given(
    st.lists(st.integers(-40, 40), min_size=V, max_size=V, unique=True),
    st.sampled_from([0.5, 1.0, 2.0]),
    st.integers(0, V + 2),
    st.sampled_from([0.05, 0.3, 0.7, 0.95, 1.0]),
)
def test_filter_masks_match_numpy(logits, temperature, top_k, top_p):
    # Distinct logits (tenths) so the order is unambiguous.
    x = np.asarray(logits, np.float32) / 10
    got = filtered_logits(jnp.asarray(x[None]), *_row(
        temperature=np.float32(temperature), top_k=np.int32(top_k), top_p=np.float32(top_p)
    ).values())
    kept = np.isfinite(np.asarray(got[0]))
    np.testing.assert_array_equal(kept, ref_kept(x, temperature, top_k, top_p))
    np.testing.assert_allclose(np.asarray(got[0])[kept], (x / temperature)[kept], rtol=1e-6)


@functools.lru_cache(maxsize=None)
def _draw_many(n: int):
    """A jit'ed sampler drawing n tokens of one distribution with seeds 0..n-1."""

    def draw(logits, temperature, top_k, top_p):
        b = jnp.broadcast_to
        return sample_tokens(
            b(logits, (n, V)),
            jnp.zeros((n, V), bool),
            temperature=b(temperature, (n,)),
            top_k=b(top_k, (n,)),
            top_p=b(top_p, (n,)),
            penalty=jnp.ones((n,)),
            seeds=jnp.arange(n, dtype=jnp.uint32),
            index=jnp.zeros((n,), jnp.int32),
        )

    return jax.jit(draw)


def chi_square_ok(counts: np.ndarray, probs: np.ndarray, n: int) -> tuple[bool, float, float]:
    """Pearson chi-square against a p ~ 1e-4 critical value (Wilson-Hilferty)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token outside the top-k/top-p support"
    exp = probs[support] * n
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    df = max(int(support.sum()) - 1, 1)
    z = 3.72  # one-sided 1e-4
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat <= crit, stat, crit


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.6), (2.0, 3, 0.9)],
)
def test_chi_square_of_draws(temperature, top_k, top_p):
    rng = np.random.default_rng(7)
    x = rng.normal(size=V).astype(np.float32)
    n = 20000
    toks = _draw_many(n)(x, np.float32(temperature), np.int32(top_k), np.float32(top_p))
    counts = np.bincount(np.asarray(toks), minlength=V)
    ok, stat, crit = chi_square_ok(counts, ref_probs(x, temperature, top_k, top_p), n)
    assert ok, f"chi2={stat:.1f} > {crit:.1f}"


def test_each_row_draws_the_same_whatever_the_other_rows_use():
    """The sampler's steps run only when some row of the call uses them (lax.cond): a
    row's token must not depend on whether another row samples, filters, is penalised,
    has a grammar mask or a logit bias."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, V)), jnp.float32)
    kw = dict(
        temperature=jnp.asarray([0.0, 1.0, 0.8, 0.0]),
        top_k=jnp.asarray([0, 0, 0, 3]),
        top_p=jnp.ones((4,)),
        penalty=jnp.ones((4,)),
        seeds=jnp.asarray([1, 2, 3, 4], jnp.uint32),
        index=jnp.asarray([0, 5, 9, 2], jnp.int32),
    )
    seen = jnp.zeros((4, V), bool)
    mixed = np.asarray(sample_tokens(logits, seen, **kw))
    argmax = np.asarray(jnp.argmax(logits, -1))
    assert mixed[0] == argmax[0] and mixed[3] == argmax[3]  # temperature 0 wins over top_k.
    for row in range(4):
        alone = {k: v[row : row + 1] for k, v in kw.items()}
        got = sample_tokens(logits[row : row + 1], seen[row : row + 1], **alone)
        assert int(got[0]) == mixed[row]
    # Another row filtering (top-p) or penalised / biased / masked leaves row 1 alone.
    filt = dict(kw, temperature=kw["temperature"].at[3].set(1.0),
                top_p=kw["top_p"].at[3].set(0.5))
    assert int(sample_tokens(logits, seen, **filt)[1]) == mixed[1]
    pen = {"presence": jnp.asarray([0.0, 0.0, 0.0, 1.5]), "frequency": jnp.zeros(4),
           "bias_ids": jnp.asarray([[V], [V], [V], [7]], jnp.int32),
           "bias": jnp.asarray([[0.0], [0.0], [0.0], [100.0]])}
    allow = jnp.full((4, -(-V // 32)), -1, jnp.int32).at[3].set(0).at[3, 0].set(1)
    out = np.asarray(sample_tokens(logits, seen, counts=jnp.zeros((4, V), jnp.int32),
                                   pen=pen, allow=allow, **kw))
    np.testing.assert_array_equal(out[:3], mixed[:3])
    assert out[3] == 0  # The grammar allows id 0 only (over the +100 bias of id 7).


def test_seeds_are_per_request_and_deterministic():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(1, V)), jnp.float32)

    def one(seed, index, batch_with=()):
        rows = [seed, *batch_with]
        n = len(rows)
        return int(sample_tokens(
            jnp.broadcast_to(logits, (n, V)), jnp.zeros((n, V), bool),
            temperature=jnp.ones((n,)), top_k=jnp.zeros((n,), jnp.int32),
            top_p=jnp.full((n,), 0.9), penalty=jnp.ones((n,)),
            seeds=jnp.asarray(rows, jnp.uint32), index=jnp.full((n,), index, jnp.int32))[0])

    draws = [one(11, i) for i in range(12)]
    assert draws == [one(11, i) for i in range(12)]
    assert draws == [one(11, i, batch_with=(5, 6, 7)) for i in range(12)]
    assert len(set(draws)) > 1
    assert [one(12, i) for i in range(12)] != draws


def test_repetition_penalty_hf_rule():
    logits = jnp.asarray([[2.0, -2.0, 1.0, -1.0]])
    seen = jnp.asarray([[True, True, False, False]])
    out = np.asarray(penalize(logits, seen, jnp.asarray([2.0]), None))
    np.testing.assert_allclose(out, [[1.0, -4.0, 1.0, -1.0]])
    out = np.asarray(penalize(logits, seen, jnp.asarray([2.0]), 3))
    assert out[0, 3] == -np.inf and out[0, 2] == 1.0


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.1), ("temperature", float("nan")), ("temperature", 1e9),
     ("top_p", 0.0), ("top_p", 1.5), ("repetition_penalty", 0.0), ("max_new_tokens", -1),
     ("max_new_tokens", 1.5), ("top_k", 2.0), ("seed", "x"), ("temperature", True),
     ("stop", ("",))],
)
def test_invalid_sampling_params(field, value):
    with pytest.raises(RequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


@given(st.integers(0, 2**16), st.integers(1, 5))
def test_argmax_and_draws_equal_jax_reference(seed, levels):
    """`argmax` is jnp.argmax (first index on ties; few distinct levels force ties), and
    the sampler's Gumbel-max draw is jax.random.categorical's, key for key."""
    from jaxlearn.decoding.sampling import argmax

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(0, levels, size=(8, 50)).astype(np.float32))
    np.testing.assert_array_equal(argmax(x), jnp.argmax(x, axis=-1))
    keys = jax.random.split(jax.random.key(seed), 8)
    logits = jnp.asarray(rng.normal(size=(8, 50)).astype(np.float32))
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (50,), jnp.float32))(keys)
    want = jax.vmap(jax.random.categorical)(keys, logits)
    np.testing.assert_array_equal(argmax(logits + noise), want)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 4), st.sampled_from([2048, 4128, 49152, 2050]))
def test_blocked_argmax_equals_jax_reference_on_wide_rows(seed, levels, v):
    """Wide rows go through block maxima (blocks of 256 .. 32 ids, or one masked pass
    where none divides v): still the first index of the maximum, ties across blocks
    included; an all -inf row gives 0, a row with a NaN an id in range."""
    from jaxlearn.decoding.sampling import _argmax_block, argmax

    assert (_argmax_block(2048), _argmax_block(4128), _argmax_block(2050)) == (256, 32, None)
    rng = np.random.default_rng(seed)
    x = rng.integers(0, levels, size=(4, v)).astype(np.float32)
    x[1, rng.integers(0, v)] = levels  # One maximum somewhere in the row.
    x[2] = -np.inf
    np.testing.assert_array_equal(argmax(jnp.asarray(x)), np.argmax(x, axis=-1))
    x[3, rng.integers(0, v)] = np.nan
    assert 0 <= int(argmax(jnp.asarray(x))[3]) < v


def test_presence_frequency_and_bias_match_openai_formula():
    from jaxlearn.decoding.penalties import MAX_LOGIT_BIAS, any_penalty, apply_penalties, pack

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 10)).astype(np.float32)
    counts = rng.integers(0, 3, size=(3, 10)).astype(np.int32)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25,
                             logit_bias=((1, 3.0), (7, -100.0))),
              SamplingParams(),
              SamplingParams(frequency_penalty=2.0)]
    pen = pack(params, 4, vocab=10)
    assert pen["bias_ids"].shape == (4, MAX_LOGIT_BIAS)  # One shape, one program.
    got = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(counts),
                                     {k: jnp.asarray(v[:3]) for k, v in pen.items()}))
    want = logits.copy()
    for b, p in enumerate(params):
        want[b] -= p.frequency_penalty * counts[b] + p.presence_penalty * (counts[b] > 0)
        for t, v in p.logit_bias:
            want[b, t] += v
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert bool(any_penalty({k: jnp.asarray(v) for k, v in pen.items()}, 10))
    off = pack([SamplingParams(), SamplingParams(repetition_penalty=1.2)], 2, 10)
    assert not bool(any_penalty({k: jnp.asarray(v) for k, v in off.items()}, 10))


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", float("nan")),
    ("logit_bias", ((1, 101.0),)), ("logit_bias", ((-1, 1.0),)), ("logit_bias", ((1,),)),
    ("logprobs", 21), ("logprobs", True), ("prompt_logprobs", -1),
])
def test_invalid_penalty_and_logprob_params(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


def test_a_tokenizer_llguidance_cannot_read_is_a_request_error():
    """A decoder llguidance does not read (SentencePiece's Metaspace) makes structured
    output a RequestError naming response_format, not a crash of the engine's warm-up."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("llguidance")
    from jaxlearn.decoding.errors import RequestError
    from jaxlearn.decoding.grammar import GrammarVocab
    from jaxlearn.text.tokenizers import HFTokenizer

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "▁a": 3, "▁b": 4, "a": 5, "b": 6}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    hf = HFTokenizer.from_tokenizer(tok, bos_id=1, eos_token_ids=[2], pad_id=0)
    with pytest.raises(RequestError, match="llguidance cannot read") as e:
        GrammarVocab(hf, len(vocab))
    assert e.value.param == "response_format"
