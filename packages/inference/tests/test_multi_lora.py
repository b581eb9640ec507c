"""Many LoRA adapters on one base model (`Engine.Config.max_loras`, `inference.adapters`):
rows of different adapters and of the base model in one batch each get exactly what an
engine on that adapter's merged weights (`merge_lora`) gets alone."""

import numpy as np
import pytest
from engine_testing import lora_model, make_engine, prompt_pool, run

from jaxlearn.inference import InferenceError, RequestError
from jaxlearn.layers import merge_lora

SETTINGS = dict(max_seq_len=64, max_batch=4, prefill_chunk=16, decode_burst=4)
RANKS = {"r2": 2, "r4": 4, "r8": 8}


@pytest.fixture(scope="module")
def adapters(cfg, params):
    return {name: lora_model(cfg, params, rank, seed)
            for seed, (name, rank) in enumerate(RANKS.items(), start=1)}


@pytest.fixture(scope="module")
def refs(cfg, params, tok, adapters):
    """One engine per adapter on its merged weights, and one on the base (key None)."""
    out = {None: make_engine(cfg, params, tok, **SETTINGS)}
    for name, (lcfg, lparams) in adapters.items():
        mcfg, mparams = merge_lora(lcfg, lparams)
        out[name] = make_engine(mcfg, mparams, tok, **SETTINGS)
    return out


def multi_engine(cfg, params, tok, adapters, names=tuple(RANKS), **settings):
    engine = make_engine(cfg, params, tok, max_loras=3, max_lora_rank=8,
                         **{**SETTINGS, **settings})
    for name in names:
        engine.load_adapter(name, RANKS[name], 3.0 * RANKS[name], adapters[name][1])
    return engine


def reference(refs, jobs):
    """Each job run alone, one after another, on the engine of its adapter."""
    out = []
    for prompt, kw, _ in jobs:
        kw = dict(kw)
        out += run(refs[kw.pop("adapter", None)], [(prompt, kw, 0)])
    return out


def assert_close(got, want, atol=1e-4):
    """Same tokens and top alternatives; logprobs within `atol` (the merged weights round
    differently from the adapter matmuls)."""
    for (toks, lps), (ref_toks, ref_lps) in zip(got, want, strict=True):
        assert toks == ref_toks
        np.testing.assert_allclose([lp for _, lp, _ in lps], [lp for _, lp, _ in ref_lps],
                                   atol=atol)
        for (_, _, top), (_, _, ref_top) in zip(lps, ref_lps):
            assert [i for i, _ in top] == [i for i, _ in ref_top]


def mixed_jobs(n_prompts=2, length=20, new=12):
    prompts = prompt_pool(n_prompts, length, seed=3)
    return [(p, {"max_new_tokens": new, "logprobs": 2, **({"adapter": a} if a else {})}, i)
            for i, (p, a) in enumerate((p, a) for p in prompts for a in (None, *RANKS))]


def test_adapters_and_base_in_one_batch_equal_merged_engines(cfg, params, tok, adapters, refs):
    engine = multi_engine(cfg, params, tok, adapters)
    assert engine.adapter_names() == sorted(RANKS)
    jobs = [(p, kw, 0) for p, kw, _ in mixed_jobs()]  # 8 requests in 4 slots, all at once.
    got = run(engine, jobs)
    want = reference(refs, jobs)
    assert_close(got, want)
    # The adapters change the output: the same prompt differs between them.
    assert len({tuple(t) for t, _ in got[:4]}) == 4
    # Sampled rows too: a request's draws depend on its seed and its own logits only.
    sampled = [(p, {**kw, "temperature": 0.8, "seed": 7}, 0) for p, kw, _ in jobs[:4]]
    assert_close(run(engine, sampled), reference(refs, sampled))


def test_preemption_and_streaming(cfg, params, tok, adapters, refs):
    engine = multi_engine(cfg, params, tok, adapters, kv_cache_tokens=80, prefix_caching=False)
    jobs = [(p, {**kw, "max_new_tokens": 40}, at)
            for p, kw, at in mixed_jobs(n_prompts=1, length=24)]
    got = run(engine, jobs)
    assert engine.metrics.counter_value("preemptions_total") > 0
    assert_close(got, reference(refs, jobs))
    stream = [d for d in engine.stream(jobs[2][0], max_new_tokens=40, ignore_eos=True,
                                       adapter="r4")]
    assert [t for d in stream for t in d.tokens] == refs["r4"].generate(
        jobs[2][0], max_new_tokens=40, ignore_eos=True).tokens


def test_prefix_cache_is_keyed_by_adapter(cfg, params, tok, adapters, refs):
    engine = multi_engine(cfg, params, tok, adapters)
    prompt = prompt_pool(1, 40, seed=5)[0]  # Two full pages of 16 before its last token.

    def hits(adapter):
        before = engine.metrics.counter_value("prefix_cache_hit_tokens_total")
        [(toks, _)] = run(engine, [(prompt, {"max_new_tokens": 6, "adapter": adapter}, 0)])
        [(want, _)] = run(refs[adapter], [(prompt, {"max_new_tokens": 6}, 0)])
        assert toks == want
        return engine.metrics.counter_value("prefix_cache_hit_tokens_total") - before

    assert hits("r2") == 0
    assert hits("r4") == 0  # The pages of r2 hold r2's keys and values: not shared.
    assert hits(None) == 0
    assert hits("r4") == 32  # Its own cached prefix is.
    assert hits(None) == 32


def test_load_unload_at_runtime(cfg, params, tok, adapters, refs):
    engine = multi_engine(cfg, params, tok, adapters, names=("r2",))
    prompt = prompt_pool(1, 40, seed=6)[0]
    first = run(engine, [(prompt, {"max_new_tokens": 6, "adapter": "r2"}, 0)])
    assert first == run(refs["r2"], [(prompt, {"max_new_tokens": 6}, 0)])
    run(engine, [(prompt_pool(1, 40, seed=7)[0], {"max_new_tokens": 6}, 0)])  # Base rows'
    engine.runner.sealed = True  # programs (mixed steps) too; from here on a new program
    # would be counted.
    programs = len(engine.runner.programs)

    queued = engine.request(prompt, engine.sampling_params(max_new_tokens=2, adapter="r2"))
    engine.scheduler.submit(queued)
    with pytest.raises(InferenceError, match="in use by 1 queued or running"):
        engine.unload_adapter("r2")
    while not queued.done:
        engine.scheduler.step()
    stale = engine.request(prompt, engine.sampling_params(adapter="r2"))
    engine.unload_adapter("r2")
    assert engine.adapter_names() == []
    with pytest.raises(RequestError, match="unloaded") as e:
        engine.scheduler.submit(stale)
    assert e.value.param == "model"
    with pytest.raises(RequestError, match="no such LoRA adapter"):
        engine.generate(prompt, adapter="r2")

    # r8 takes r2's slot; r2's cached pages of the same prompt are not served to it.
    engine.load_adapter("r8", 8, 24.0, adapters["r8"][1])
    before = engine.metrics.counter_value("prefix_cache_hit_tokens_total")
    got = run(engine, [(prompt, {"max_new_tokens": 6, "adapter": "r8"}, 0)])
    assert got == run(refs["r8"], [(prompt, {"max_new_tokens": 6}, 0)])
    assert engine.metrics.counter_value("prefix_cache_hit_tokens_total") == before
    # The base model's rows are unchanged by whatever the banks hold.
    assert run(engine, [(prompt, {"max_new_tokens": 6}, 0)]) == run(
        refs[None], [(prompt, {"max_new_tokens": 6}, 0)])
    assert len(engine.runner.programs) == programs and engine.runner.compiled_late == 0


def test_errors(cfg, params, tok, adapters):
    engine = multi_engine(cfg, params, tok, adapters, names=("r2", "r4"))
    with pytest.raises(RequestError, match="'nope': no such LoRA adapter") as e:
        engine.generate([5, 6], adapter="nope")
    assert e.value.param == "model"
    big = lora_model(cfg, params, 16, 9)[1]
    with pytest.raises(ValueError, match="rank 16 exceeds Engine.Config.max_lora_rank=8"):
        engine.load_adapter("big", 16, 16.0, big)
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_adapter("r2", 2, 6.0, adapters["r2"][1])
    with pytest.raises(ValueError, match=r"lora_a .* expected"):  # Rank 4 params as rank 8.
        engine.load_adapter("r8", 8, 6.0, adapters["r4"][1])
    engine.load_adapter("r8", 8, 24.0, adapters["r8"][1])
    with pytest.raises(ValueError, match="all Engine.Config.max_loras=3 adapter slots"):
        engine.load_adapter("more", 2, 6.0, adapters["r2"][1])
    with pytest.raises(ValueError, match="is not loaded"):
        engine.unload_adapter("nope")

    plain = make_engine(cfg, params, tok, **SETTINGS)
    with pytest.raises(RequestError, match="serves no LoRA adapters") as e:
        plain.generate([5, 6], adapter="r2")
    assert e.value.param == "model"
    with pytest.raises(ValueError, match="Engine.Config.max_loras=-1"):
        make_engine(cfg, params, tok, max_loras=-1)
    with pytest.raises(ValueError, match="max_loras=2 needs fuse_projections=False"):
        make_engine(cfg, params, tok, max_loras=2, fuse_projections=True)
    with pytest.raises(ValueError, match="match no Linear"):
        make_engine(cfg, params, tok, max_loras=2, lora_targets=r".*\.nothing")


def test_speculative_decoding_and_a_mesh(cfg, params, tok, adapters, refs):
    jobs = [([5, 6, 7, 8] * 6, {"max_new_tokens": 16, **({"adapter": a} if a else {})}, 0)
            for a in (None, "r2", "r8")]
    want = reference(refs, jobs)
    spec = multi_engine(cfg, params, tok, adapters, speculative_tokens=3)
    assert [t for t, _ in run(spec, jobs)] == [t for t, _ in want]
    assert spec.metrics.counter_value("speculative_draft_tokens_total") > 0

    sharded = multi_engine(cfg, params, tok, adapters, mesh_shape=(1, 2, 4))
    q = sharded.runner.params["decoder"]["transformer"]["layer"]["self_attention"]["q_proj"]
    assert len(q["lora_a"].sharding.device_set) == 8  # Written into, sharding kept.
    assert [t for t, _ in run(sharded, jobs)] == [t for t, _ in want]
