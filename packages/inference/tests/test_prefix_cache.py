"""Prefix caching: the same tokens and logprobs with and without it (shared, partial-page
and whole-prompt prefixes, concurrent requests, penalties, preemption under page
pressure, eviction, sliding windows); a hypothesis test of the allocator's invariants;
prefill tokens computed drop by the cached full pages."""

import numpy as np
import pytest
from conftest import assert_same, make_engine, prompt_pool, run, tiny_config, tiny_params
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlearn.inference import PageTable

SETTINGS = dict(max_seq_len=96, max_batch=4, prefill_chunk=16, decode_burst=4, page_size=8)
SYS = prompt_pool(n=1, length=45, seed=11)[0]  # 5 full pages of 8 + 5 tokens.
OTHER = prompt_pool(n=8, length=40, seed=12)


@pytest.fixture(scope="module")
def plain(cfg, params, tok):
    return make_engine(cfg, params, tok, prefix_caching=False, **SETTINGS)


@pytest.fixture(scope="module")
def cached(cfg, params, tok):
    return make_engine(cfg, params, tok, **SETTINGS)


@pytest.fixture(scope="module")
def tight(cfg, params, tok):
    """A pool of 16 pages of 8 for 4 requests of up to 96 tokens: preemption, eviction."""
    return make_engine(cfg, params, tok, kv_cache_tokens=128, **SETTINGS)


GREEDY = dict(max_new_tokens=10, logprobs=3)
SAMPLED = dict(max_new_tokens=10, temperature=0.9, top_k=8, seed=5, logprobs=2)
PENALIZED = dict(max_new_tokens=12, repetition_penalty=1.5, presence_penalty=0.7,
                 frequency_penalty=0.4, logprobs=1)


def shared_jobs():
    """A first request fills the cache; then concurrent ones share its full pages: longer
    prompts, a prefix ending mid-page (37 tokens), an exact 40-token (5-page) prefix, the
    whole prompt again, and one continuing the first request's own output."""
    first = (SYS, GREEDY, 0)
    later = [
        (SYS + OTHER[0][:7], GREEDY, 6),
        (SYS[:37] + OTHER[1][:20], SAMPLED, 6),
        (SYS[:40], PENALIZED, 6),
        (SYS, SAMPLED, 7),
        (SYS + OTHER[2][:30], PENALIZED, 7),
    ]
    return [first] + later


def test_shared_prefixes_same_outputs(plain, cached):
    jobs = shared_jobs()
    want = run(plain, jobs)
    hits0 = cached.metrics.counter_value("prefix_cache_hit_tokens_total")
    got = run(cached, jobs)
    assert_same(got, want)
    # 5 pages (40 tokens) for every later job but the 37- and 40-token prefixes (4 pages).
    hits = cached.metrics.counter_value("prefix_cache_hit_tokens_total") - hits0
    assert hits == 40 * 3 + 32 * 2
    # A conversation: the next prompt is the first one + its output + a new turn; the
    # pages written while decoding are shared too.
    turn = SYS + got[0][0] + OTHER[3][:6]
    assert_same(run(cached, [(turn, PENALIZED, 0)]), run(plain, [(turn, PENALIZED, 0)]))
    assert cached.metrics.counter_value("prefix_cache_hit_tokens_total") - hits0 - hits == 48


def test_preemption_and_eviction_same_outputs(plain, tight):
    """16 pages for 4 requests of up to 62 tokens sharing prefixes: requests are
    preempted and recomputed from their cached pages, cached pages are evicted for
    other prompts; every request gets the tokens and logprobs it gets without caching."""
    kws = [GREEDY, SAMPLED, PENALIZED]
    jobs = [(SYS[: 24 + 5 * i] + OTHER[i][: 3 + 2 * i], {**kws[i % 3], "max_new_tokens": 30},
             i // 2) for i in range(6)]
    jobs += [(OTHER[6 + i] + OTHER[i][:10], {**kws[i % 3], "max_new_tokens": 20}, 8 + i)
             for i in range(2)]
    jobs += [(SYS[:30] + OTHER[5][:9], {**GREEDY, "max_new_tokens": 30}, 12)]
    want = run(plain, jobs)
    sched = tight.scheduler
    got = run(tight, jobs)
    assert_same(got, want)
    assert sched.metrics.counter_value("preemptions_total") > 0
    assert sched.pages.evictions > 0
    assert sched.metrics.counter_value("prefix_cache_hit_tokens_total") > 0
    assert sched.pages.num_free == 16


def test_prompt_logprobs_with_a_cached_prefix(plain, cached):
    """A request scoring its prompt computes every position (no cached prefix) and gets
    the logprobs of the engine without caching."""
    run(cached, [(SYS, GREEDY, 0)])
    res = cached.generate(SYS + OTHER[4][:5], max_new_tokens=2, prompt_logprobs=2)
    ref = plain.generate(SYS + OTHER[4][:5], max_new_tokens=2, prompt_logprobs=2)
    assert res.tokens == ref.tokens
    np.testing.assert_allclose([e.logprob for e in res.prompt_logprobs],
                               [e.logprob for e in ref.prompt_logprobs], atol=1e-5)


def test_prefill_tokens_computed_drop(cached):
    """Only the tokens after the cached full pages are prefilled (and the last prompt
    token always is)."""
    m = cached.metrics
    cached.scheduler.pages.drop_cached()
    a = OTHER[7] + OTHER[6][:10]  # 50 tokens: 6 full pages + 2.
    cases = [
        (a, 50),  # Nothing cached.
        (a[:40] + OTHER[5][:10], 10),  # 5 cached pages.
        (a, 2),  # 6 cached pages (the whole prompt's full pages).
        (a[:48], 8),  # 48 = 6 pages, but the last token is computed: 5 cached pages.
        (a[:21] + OTHER[4][:4], 9),  # 2 pages (16), the third page differs at 21.
    ]
    for prompt, computed in cases:
        before = m.counter_value("prompt_tokens_total"), m.counter_value(
            "prefix_cache_hit_tokens_total")
        cached.generate(prompt, max_new_tokens=1, ignore_eos=True)
        assert m.counter_value("prompt_tokens_total") - before[0] == computed
        assert m.counter_value("prefix_cache_hit_tokens_total") - before[1] == len(
            prompt) - computed


def test_sliding_window_same_outputs(tok):
    cfg = tiny_config()
    cfg.decoder.transformer.layer.self_attention.sliding_window = 12
    params = tiny_params(cfg, seed=1)
    jobs = shared_jobs()[:4]
    want = run(make_engine(cfg, params, tok, prefix_caching=False, **SETTINGS), jobs)
    eng = make_engine(cfg, params, tok, **SETTINGS)
    assert_same(run(eng, jobs), want)
    assert eng.metrics.counter_value("prefix_cache_hit_tokens_total") > 0


# ---- the allocator ------------------------------------------------------------------------

op_st = st.tuples(st.sampled_from(["admit", "grow", "trim", "release"]), st.integers(0, 3),
                  st.lists(st.integers(0, 2), min_size=1, max_size=30))


@settings(max_examples=300)
@given(st.lists(op_st, max_size=60))
def test_page_table_invariants(ops):
    """Random admissions (prompts over 3 ids, so prefixes repeat), growth, window trims
    (window 5) and releases on 10 pages of 4 for 4 slots. After every op: counts are the
    slots holding each page (trimmed columns read page 0),
    never negative; free, idle-cached and held pages partition pages 1..9; a digest maps
    to its page; an evicted page is not held by anybody when it is taken; and every page
    a request shares holds exactly its ids (the tokens written are simulated)."""
    pt = PageTable(10, 4, 4, 8, prefix_caching=True, window=5)
    content = {}  # page -> ids written at its positions.
    ids_of = {}  # slot -> ids in its positions.
    for op, slot, ids in ops:
        if op == "admit" and slot not in ids_of:
            held_before = {p for s in ids_of for p in pt.held(s)}
            evicted_before = pt.evictions
            cached = pt.admit(slot, ids)
            if cached is None:
                continue
            assert cached % 4 == 0 and cached < len(ids) or cached == 0
            for i in range(cached // 4):  # Shared pages hold this prompt's ids.
                assert content[int(pt.table[slot, i])] == ids[i * 4 : i * 4 + 4]
            new = {int(p) for p in pt.table[slot, cached // 4 : pt.owned(slot)]}
            assert not new & held_before  # Evicted / free pages were held by nobody.
            assert pt.evictions >= evicted_before
            ids_of[slot] = list(ids)
            _write(pt, content, slot, ids, cached)
        elif op == "grow" and slot in ids_of:
            more = ids_of[slot] + ids
            if len(more) <= 32 and pt.ensure(slot, len(more)):
                _write(pt, content, slot, more, len(ids_of[slot]))
                ids_of[slot] = more
        elif op == "trim" and slot in ids_of:  # The next call starts at len(ids).
            pt.trim(slot, len(ids_of[slot]))
        elif op == "release" and slot in ids_of:
            pt.release(slot)
            del ids_of[slot]
        _check(pt, ids_of)


def _write(pt, content, slot, ids, start):
    """Simulates the prefill of positions [start, len(ids)) of `slot`, then commits."""
    for i in range(start // 4, pt.pages_for(len(ids))):
        page = int(pt.table[slot, i])
        content[page] = (content.get(page, [])[: max(0, start - i * 4)] if i == start // 4
                         else []) + ids[max(start, i * 4) : i * 4 + 4]
    pt.commit(slot, ids, len(ids))


def _check(pt, ids_of):
    held = [p for s in ids_of for p in pt.held(s)]
    refs = np.bincount(held, minlength=pt.num_pages)
    assert refs[0] == 0 and list(refs) == pt._ref and min(pt._ref) >= 0
    free, idle = set(pt._free), set(pt._lru)
    assert len(free) == len(pt._free) and not free & idle and not (free | idle) & set(held)
    assert free | idle | set(held) == set(range(1, pt.num_pages))
    assert idle <= set(pt._digest) and not free & set(pt._digest)
    assert all(pt._page_of[d] == p for p, d in pt._digest.items())
    assert len(pt._page_of) == len(pt._digest)
    for s in range(4):
        first = pt.owned(s) - len(pt.held(s))  # Columns before it were trimmed: page 0.
        assert not pt.table[s, :first].any() and not pt.table[s, pt.owned(s) :].any()
        if s not in ids_of:
            assert pt.owned(s) == 0 and not pt.table[s].any()
