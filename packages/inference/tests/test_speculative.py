"""Speculative decoding with prompt-lookup drafts: tokens identical to plain decoding
(greedy and seeded sampling, one and several rows), drafts accepted, rows that cannot be
verified decode as usual, and warm-up covers the verification programs."""

import numpy as np
import pytest
from engine_testing import make_engine, prompt_pool
from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.decoding.speculative import ngram_draft
from jaxlearn.kernels.packed_gemm import unavailable_reason

POOL = prompt_pool(n=4, length=30, seed=11)
# A prompt that repeats itself, so its continuation has n-grams to look up.
LOOP = (POOL[0][:10] * 4)[:36]


def test_ngram_draft_takes_what_followed_the_latest_match():
    assert ngram_draft([5, 6, 7, 9, 5, 6, 7, 8, 5, 6, 7], 2) == [8, 5]
    assert ngram_draft([1, 2, 3, 4], 3) == []  # Nothing repeats.
    assert ngram_draft([4, 1, 4], 3) == [1, 4]  # A 1-gram when no longer one matches.
    assert ngram_draft([1, 2, 1, 2], 5, max_n=2) == [1, 2]  # Shorter than k near the end.


@given(st.lists(st.integers(0, 3), min_size=2, max_size=40), st.integers(1, 6))
def test_ngram_draft_continues_an_earlier_occurrence(tokens, k):
    d = ngram_draft(tokens, k, max_n=3)
    assert len(d) <= k
    if d:  # Some earlier window ending before the last token is followed by d.
        assert any(tokens[i : i + len(d)] == d and tokens[i - 1] == tokens[-1]
                   for i in range(1, len(tokens)))


@pytest.fixture(scope="module")
def engines(cfg, params, tok):
    kw = dict(max_seq_len=128, max_batch=4, prefill_chunk=32, decode_burst=4)
    return (make_engine(cfg, params, tok, **kw),
            make_engine(cfg, params, tok, speculative_tokens=4, **kw))


@pytest.mark.parametrize("sampling", [
    dict(),
    dict(temperature=0.9, top_k=20, top_p=0.9, seed=5),
    dict(temperature=1.3, seed=9),
])
def test_tokens_identical_to_plain_decoding(engines, sampling):
    plain, spec = engines
    prompts = [LOOP, POOL[1], POOL[2]]
    before = spec.metrics.counter_value("decode_calls_total", steps="verify")
    for batch in ([LOOP], prompts):  # One row, then three at once.
        want = plain.generate(batch, max_new_tokens=40, ignore_eos=True, **sampling)
        got = spec.generate(batch, max_new_tokens=40, ignore_eos=True, **sampling)
        assert [r.tokens for r in got] == [r.tokens for r in want]
    assert spec.metrics.counter_value("decode_calls_total", steps="verify") > before


def test_drafts_are_accepted_on_a_repeating_continuation(engines):
    _, spec = engines
    m = spec.metrics
    acc0 = m.counter_value("speculative_accepted_tokens_total")
    calls0 = m.counter_value("decode_calls_total", steps="verify")
    spec.generate(LOOP, max_new_tokens=60, ignore_eos=True)
    accepted = m.counter_value("speculative_accepted_tokens_total") - acc0
    calls = m.counter_value("decode_calls_total", steps="verify") - calls0
    # The tiny random model's greedy continuation falls into a cycle of 3 tokens, so
    # drafts match (30 of 56 drafted when written) and verify calls emit several tokens.
    assert accepted >= 20 and calls + accepted <= 59, (accepted, calls)


def test_penalized_or_logprob_rows_decode_as_usual(engines):
    plain, spec = engines
    for kw in (dict(repetition_penalty=1.3), dict(presence_penalty=0.5), dict(logprobs=2)):
        before = spec.metrics.counter_value("decode_calls_total", steps="verify")
        got = spec.generate(LOOP, max_new_tokens=12, ignore_eos=True, **kw)
        want = plain.generate(LOOP, max_new_tokens=12, ignore_eos=True, **kw)
        assert got.tokens == want.tokens
        assert spec.metrics.counter_value("decode_calls_total", steps="verify") == before


@pytest.mark.skipif(unavailable_reason() is not None, reason="no packed GEMM here")
def test_packed_int8_weights_verify_to_the_same_tokens(cfg, params, tok):
    """Packed int8 weights (oneMKL's int8 GEMM: exact int32 sums per row) give a forward of
    k + 1 tokens equal to k + 1 single steps, so drafts leave the tokens as they are."""
    kw = dict(max_seq_len=128, max_batch=4, prefill_chunk=32, decode_burst=4,
              quantize="int8", weight_layout="packed")
    plain = make_engine(cfg, params, tok, **kw)
    spec = make_engine(cfg, params, tok, speculative_tokens=4, **kw)
    for batch in ([LOOP], [LOOP, POOL[1], POOL[2]]):
        for sampling in (dict(), dict(temperature=0.9, top_k=20, seed=5)):
            want = plain.generate(batch, max_new_tokens=40, ignore_eos=True, **sampling)
            got = spec.generate(batch, max_new_tokens=40, ignore_eos=True, **sampling)
            assert [r.tokens for r in got] == [r.tokens for r in want]
    assert spec.metrics.counter_value("speculative_accepted_tokens_total") > 0


def test_warmup_covers_verification(cfg, params, tok):
    eng = make_engine(cfg, params, tok, max_seq_len=96, max_batch=2, prefill_chunk=32,
                      decode_burst=4, speculative_tokens=3)
    eng.warmup("auto", threads=2)
    eng.generate([LOOP, POOL[3]], max_new_tokens=20, ignore_eos=True, temperature=0.7,
                 seed=1)
    assert eng.runner.compiled_late == 0
    assert eng.metrics.counter_value("decode_calls_total", steps="verify") > 0


def test_bad_speculative_settings(cfg, params, tok):
    with pytest.raises(ValueError, match="speculative_tokens=-1"):
        make_engine(cfg, params, tok, max_seq_len=64, speculative_tokens=-1)
    with pytest.raises(ValueError, match="speculative_tokens=4 with quantize='int8' needs the "
                                         "int8 weights packed .* got weight_layout='in_out'"):
        make_engine(cfg, params, tok, max_seq_len=64, speculative_tokens=4, quantize="int8",
                    weight_layout="in_out")
    assert np.all(np.asarray(ngram_draft([3], 4)) == [])
