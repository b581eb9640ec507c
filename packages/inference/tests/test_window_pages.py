"""Sliding-window page release (`PageTable.trim`, `Engine.Config.window_page_release`):
the same tokens and logprobs as an engine keeping every page and as the dense forward,
for concurrent requests generating past the window, under preemption and with shared
prefixes; the pages a request holds follow its window exactly; models with a global
layer keep every page."""

import numpy as np
import pytest
from conftest import (
    assert_same,
    make_engine,
    prompt_pool,
    reference_greedy,
    run,
    tiny_config,
    tiny_params,
)

from jaxlearn.inference import PageTable
from jaxlearn.inference.runner import kv_window
from jaxlearn.layers import gemma_config

WINDOW, PS = 24, 8
SETTINGS = dict(max_seq_len=96, max_batch=4, prefill_chunk=16, decode_burst=4, page_size=PS)
PROMPTS = prompt_pool(n=6, length=40, seed=21)
GREEDY = dict(max_new_tokens=56, logprobs=2)
SAMPLED = dict(max_new_tokens=50, temperature=0.9, top_k=8, seed=3, logprobs=2)
PENALIZED = dict(max_new_tokens=48, repetition_penalty=1.4, frequency_penalty=0.3, logprobs=1)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    cfg.decoder.transformer.layer.self_attention.sliding_window = WINDOW
    return cfg, tiny_params(cfg, seed=2)


@pytest.fixture(scope="module")
def keep(model, tok):
    """Every page kept (no release), no prefix caching: the reference."""
    return make_engine(*model, tok, window_page_release=False, prefix_caching=False,
                       **SETTINGS)


@pytest.fixture(scope="module")
def release(model, tok):
    return make_engine(*model, tok, prefix_caching=False, **SETTINGS)


def jobs(n: int = 6, prompt_len: int = 40):
    kws = [GREEDY, SAMPLED, PENALIZED]
    return [(PROMPTS[i][: prompt_len - 3 * i], kws[i % 3], i // 2) for i in range(n)]


def test_kv_window():
    cfg = tiny_config()
    assert kv_window(cfg.clone(name="m").instantiate()) is None
    cfg.decoder.transformer.layer.self_attention.sliding_window = 12
    assert kv_window(cfg.clone(name="m").instantiate()) == 12
    kw = dict(head_dim=8, sliding_window=6)
    hybrid = gemma_config(64, 32, 4, 4, 2, 64, layer_pattern=["local", "global"], **kw)
    assert kv_window(hybrid.clone(name="m").instantiate()) is None
    local = gemma_config(64, 32, 2, 4, 2, 64, layer_pattern=["local"], **kw)
    assert kv_window(local.clone(name="m").instantiate()) == 6


def test_hybrid_model_keeps_every_page(tok):
    cfg = gemma_config(64, 32, 2, 4, 2, 64, head_dim=8, sliding_window=6,
                       layer_pattern=["local", "global"])
    eng = make_engine(cfg, tiny_params(cfg), tok, **SETTINGS)
    assert eng.scheduler.pages.window is None


def test_same_outputs_as_keeping_every_page(keep, release):
    """6 concurrent requests (greedy, sampled, penalized) of 40..25 prompt tokens
    generating ~50 tokens, window 24: tokens and logprobs equal the engine keeping every
    page; the greedy ones equal the dense forward over the whole sequence."""
    js = jobs()
    want = run(keep, js)
    got = run(release, js)
    assert_same(got, want)
    for (prompt, kw, _), (toks, _) in zip(js, got):
        if kw is GREEDY:
            assert toks == reference_greedy(release, prompt, len(toks))


def test_pages_held_follow_the_window(release):
    """One request, one token per call: after every step it holds exactly the pages of
    [q - window + 1, q] (q: the position the last call wrote), the released columns read
    page 0, every other page is free, and pages come back to the pool while it runs."""
    sched, pages = release.scheduler, release.scheduler.pages
    req = release.request(PROMPTS[0][:20], release.sampling_params(max_new_tokens=70,
                                                                   ignore_eos=True))
    sched.submit(req)
    total, frees, held = pages.num_pages - 1, [], []
    burst, sched.decode_burst = sched.decode_burst, 1
    try:
        while not req.done:
            sched.step()
            if req.state != "decode":
                continue
            q = len(req.prompt_ids) + req.num_generated - 2  # First query of the last call.
            first = max(0, (q - WINDOW + 1) // PS)
            assert pages.held(req.slot) == pages.table[req.slot, first:pages.owned(req.slot)
                                                       ].tolist()
            assert not pages.table[req.slot, :first].any()  # Released columns read page 0.
            assert len(pages.held(req.slot)) == pages.pages_for(q + 1) - first
            assert len(pages.held(req.slot)) <= WINDOW // PS + 1
            assert pages.num_free == total - len(pages.held(req.slot))
            frees.append(pages.num_free)
            held.append(len(pages.held(req.slot)))
    finally:
        sched.decode_burst = burst
    assert pages.num_free == total
    assert max(held) == WINDOW // PS + 1  # Of the 12 pages its 90 positions span.
    assert any(b > a for a, b in zip(frees, frees[1:]))  # Pages came back mid-request.


def test_long_prompt_prefill_holds_the_window(keep, release):
    """An 80-token prompt prefilled in chunks of 16 with window 24: admission reserves the
    first chunk's pages only, each chunk gets its pages once the window has moved, so
    the prompt never holds more than the pages of window + chunk positions (5 of its
    10); the tokens equal the engine keeping every page and the dense forward."""
    prompt = PROMPTS[0] + PROMPTS[1][:40]
    sched, pages = release.scheduler, release.scheduler.pages
    req = release.request(prompt, release.sampling_params(max_new_tokens=8, ignore_eos=True))
    sched.submit(req)
    most = 0
    while not req.done:
        sched.step()
        if req.slot is not None:
            most = max(most, len(pages.held(req.slot)))
    assert most == pages.pages_for(WINDOW + 16) < pages.pages_for(len(prompt))  # 5 < 10
    want = run(keep, [(prompt, {"max_new_tokens": 8}, 0)])[0][0]
    assert req.output.tokens == want == reference_greedy(release, prompt, 8)


def test_preemption_same_outputs(model, keep, tok):
    """A 12-page pool (one max_seq_len request) for 4 requests of 16-token prompts
    growing to ~70 tokens: the windows (4 pages each) overflow it, requests are
    preempted and recomputed; the tokens equal the engine keeping every page with a
    pool for all."""
    tight = make_engine(*model, tok, kv_cache_tokens=96, prefix_caching=False, **SETTINGS)
    js = jobs(4, prompt_len=16 + 9)
    got = run(tight, js)
    assert_same(got, run(keep, js))
    assert tight.metrics.counter_value("preemptions_total") > 0
    assert tight.scheduler.pages.num_free == 12


def test_prefix_sharing_same_outputs(model, keep, tok):
    """Prefix caching with release: requests sharing a 33-token prefix reuse its cached
    pages (a page one request left behind stays cached and shared for the others) and
    get the tokens of the engine without caching or release."""
    cached = make_engine(*model, tok, **SETTINGS)
    sys = PROMPTS[5][:33]
    js = [(sys + PROMPTS[i][:5 + i], [GREEDY, SAMPLED, PENALIZED][i % 3], 0 if i == 0 else 5)
          for i in range(5)]
    js.append((sys, GREEDY, 6))
    assert_same(run(cached, js), run(keep, js))
    assert cached.metrics.counter_value("prefix_cache_hit_tokens_total") >= 32 * 5


def test_trim_keeps_shared_pages():
    """Trimming a slot drops only its references: a page another slot shares stays held,
    a registered page nobody holds goes idle-cached (counts as free, still found)."""
    pt = PageTable(12, 4, 2, 8, prefix_caching=True, window=6)
    ids = list(range(3, 20))  # 17 ids: 4 full pages + 1.
    assert pt.admit(0, ids) == 0
    pt.commit(0, ids, len(ids))
    assert pt.admit(1, ids) == 16  # Shares 4 pages.
    assert pt.trim(0, 16) == 2  # Pages ending before 16 - 6 + 1 = 11: columns 0, 1.
    assert pt.table[0, :2].tolist() == [0, 0] and pt.num_used == 6  # Slot 1 holds them.
    assert pt.trim(0, 16) == 0  # Nothing more behind the window.
    assert pt.trim(1, 16) == 2  # Nobody holds them now: cached and idle.
    assert pt.num_used == 4 and pt.num_free == 7 and pt.num_cached == 4
    pt.release(0)
    pt.release(1)
    assert pt.num_free == 11 and pt.admit(0, ids) == 16  # Every page still cached.
    with pytest.raises(ValueError, match="window=0"):
        PageTable(4, 4, 1, 1, window=0)
    assert np.all(pt.table[1] == 0)
