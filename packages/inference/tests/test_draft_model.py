"""Speculative decoding with a draft model (`inference.draft`): tokens identical to plain
decoding whatever the draft proposes (greedy and seeded sampling, one and several rows),
the draft's KV bookkeeping right (a draft equal to the served model has its greedy drafts
accepted), warm-up covering the draft's programs, and bad drafts refused."""

import pytest
from engine_testing import make_engine, prompt_pool, tiny_params

from jaxlearn.layers import llama_config

POOL = prompt_pool(n=4, length=30, seed=23)
KW = dict(max_seq_len=128, max_batch=4, prefill_chunk=32, decode_burst=4,
          speculative_tokens=3)


def draft_config(vocab: int = 64, layers: int = 1):
    """A smaller model than the served one (`tiny_config`: 2 layers)."""
    return llama_config(vocab, 32, layers, 4, 2, 64, rope_theta=10000.0, stack="scan")


def drafted(cfg, params, tok, draft_cfg, draft_params, **kw):
    from jaxlearn.inference import Engine

    return Engine.default_config().set(**{**KW, **kw}).instantiate(
        model_cfg=cfg, params=params, tokenizer=tok, draft_model_cfg=draft_cfg,
        draft_params=draft_params)


@pytest.fixture(scope="module")
def plain(cfg, params, tok):
    return make_engine(cfg, params, tok, **{**KW, "speculative_tokens": 0})


@pytest.fixture(scope="module")
def other_draft():
    """A different model on the same vocabulary: one layer, other weights."""
    dcfg = draft_config()
    return dcfg, tiny_params(dcfg, seed=7)


def counts(engine):
    m = engine.metrics
    return (m.counter_value("speculative_accepted_tokens_total"),
            m.counter_value("speculative_draft_tokens_total"),
            m.counter_value("decode_calls_total", steps="verify"))


def test_a_draft_equal_to_the_model_is_accepted(cfg, params, tok, plain):
    """The served model as its own draft: its greedy drafts are the target's greedy
    tokens, so nearly all are accepted, which holds only if the draft's KV follows each
    row's context exactly across catch-ups (a stale or shifted position breaks it)."""
    eng = drafted(cfg, params, tok, cfg, params)
    for batch in ([POOL[0]], POOL[1:4]):
        want = plain.generate(batch, max_new_tokens=40, ignore_eos=True)
        got = eng.generate(batch, max_new_tokens=40, ignore_eos=True)
        assert [r.tokens for r in got] == [r.tokens for r in want]
    accepted, drafts, calls = counts(eng)
    assert calls > 0 and accepted >= 0.95 * drafts, (accepted, drafts, calls)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_k=20, seed=5)])
def test_another_draft_leaves_the_tokens_as_plain_decoding(cfg, params, tok, plain,
                                                            other_draft, sampling):
    eng = drafted(cfg, params, tok, *other_draft)
    for batch in ([POOL[0]], POOL[1:4]):
        want = plain.generate(batch, max_new_tokens=40, ignore_eos=True, **sampling)
        got = eng.generate(batch, max_new_tokens=40, ignore_eos=True, **sampling)
        assert [r.tokens for r in got] == [r.tokens for r in want]
    accepted, drafts, calls = counts(eng)
    assert calls > 0 and drafts >= 3 * calls and accepted < drafts, (accepted, drafts, calls)


def test_warmup_covers_the_draft_programs(cfg, params, tok, other_draft):
    eng = drafted(cfg, params, tok, *other_draft, max_seq_len=96, max_batch=2)
    eng.warmup("auto", threads=2)
    eng.generate([POOL[0], POOL[1][:5]], max_new_tokens=24, ignore_eos=True)
    eng.generate(POOL[2], max_new_tokens=8, ignore_eos=True)
    assert eng.runner.compiled_late == 0
    assert eng.scheduler.draft.runner.compiled_late == 0
    assert counts(eng)[2] > 0


def test_bad_drafts_are_refused(cfg, params, tok):
    small = draft_config(vocab=32)
    with pytest.raises(ValueError, match="the draft model has 32 ids and the served model "
                                         "samples 64"):
        drafted(cfg, params, tok, small, tiny_params(small))
    with pytest.raises(ValueError, match="a draft model needs Engine.Config.speculative_tokens "
                                         "> 0 .* got speculative_tokens=0"):
        drafted(cfg, params, tok, cfg, params, speculative_tokens=0)
