"""Engine: greedy == cache-free argmax loop, chunked prefill == full prefill, stops,
seeds, streaming, checkpoint restore (also onto a mesh)."""

import jax
import numpy as np
import pytest
from conftest import make_engine, prompt_pool, reference_greedy

from jaxlearn.inference import Engine, RequestError
from jaxlearn.module import functional

POOL = prompt_pool()


@pytest.mark.parametrize("length", [1, 5, 16, 17, 40])
def test_greedy_equals_cache_free_argmax(engine, length):
    prompt = POOL[0][:length]
    res = engine.generate(prompt, max_new_tokens=12, ignore_eos=True)
    assert res.tokens == reference_greedy(engine, prompt, 12)
    assert res.finish_reason == "length" and res.prompt_ids == prompt


def test_chunked_batched_prefill_into_pages_equals_full_prefill(engine, cfg, params):
    """Two prompts prefilled together in 16-token chunks into scattered pages: the pool
    holds the keys/values of a one-shot contiguous prefill, and the sampled tokens are the
    argmax of its last logits."""
    from jaxlearn.kernels import paged

    runner = engine.runner
    prompts = [POOL[1][:40], POOL[2][:23]]  # 16 + 16 + 8 and 16 + 7 tokens.
    tables = np.zeros((2, runner.max_len // runner.page_size), np.int32)
    tables[0, :3] = [9, 3, 14]
    tables[1, :2] = [5, 11]
    starts, toks = [0, 0], [None, None]
    greedy = dict(temperature=[0.0], top_k=[0], top_p=[1.0], penalty=[1.0], seeds=[0], index=[0])
    while any(s < len(p) for s, p in zip(starts, prompts)):
        rows = [i for i in range(2) if starts[i] < len(prompts[i])]
        chunks = [np.asarray(prompts[i][starts[i] : starts[i] + 16], np.int32) for i in rows]
        out = runner.prefill(
            slots=[2 + i for i in rows],
            chunks=chunks,
            starts=[starts[i] for i in rows],
            tables=tables[rows],
            bucket=16,
            sampling={k: v * len(rows) for k, v in greedy.items()},
        )
        for i, c, t in zip(rows, chunks, out["tok"]):
            starts[i] += len(c)
            toks[i] = int(t)
    model, params = engine.model, engine.runner.params
    for i, prompt in enumerate(prompts):
        states, _ = functional(
            model, None, params, (1, 64), method="init_states", is_training=False
        )
        (full, logits), _ = functional(
            model, None, params, (states, np.asarray([prompt])), method="prefill", is_training=False
        )
        assert toks[i] == int(np.argmax(logits[0, -1]))
        for name in ("key", "value"):
            pool = runner.pool["self_attention"][name]  # [layers, pages, *page]
            layout = {"key": "kdt", "value": "ktd"}[name]
            gather = jax.vmap(paged.gather_pages, in_axes=(0, None, None, None, None))
            got = gather(pool, tables[i : i + 1], np.float32, None, layout)
            want = np.asarray(full["decoder"]["self_attention"][name])[:, 0, : len(prompt)]
            np.testing.assert_allclose(
                np.asarray(got)[:, 0, : len(prompt)], want, atol=2e-5, rtol=1e-5
            )


def test_small_pool_preempts_and_recomputes_with_identical_tokens(cfg, params, tok, engine):
    """A pool of 80 tokens (5 pages of 16) for 4 slots of up to 64 tokens: requests hold
    pages by their live length, the youngest is preempted when the pool runs out, and
    every request still gets exactly the tokens it gets alone (greedy and seeded)."""
    small = make_engine(
        cfg,
        params,
        tok,
        max_seq_len=64,
        max_batch=4,
        prefill_chunk=16,
        decode_burst=4,
        page_size=16,
        kv_cache_tokens=80,
    )
    # Pools of 5 + 1 and 16 + 1 pages (page 0 is scratch): memory follows the budget.
    assert (small.runner.num_pages, engine.runner.num_pages) == (6, 17)
    assert small.runner.cache_bytes() * 17 == engine.runner.cache_bytes() * 6
    jobs = [
        (POOL[0][:20], dict(max_new_tokens=30, ignore_eos=True)),
        (POOL[1][:10], dict(max_new_tokens=25, temperature=0.9, seed=7, ignore_eos=True)),
        (POOL[2][:30], dict(max_new_tokens=20, ignore_eos=True)),
        (POOL[3][:5], dict(max_new_tokens=12, top_k=5, temperature=1.0, seed=3, ignore_eos=True)),
    ]
    alone = [engine.generate(p, **kw).tokens for p, kw in jobs]
    reqs = [small.request(p, small.sampling_params(**kw)) for p, kw in jobs]
    peak = 0
    for r in reqs:
        small.scheduler.submit(r)
    while not all(r.done for r in reqs):
        small.scheduler.step()
        peak = max(peak, small.scheduler.pages.num_used)
    assert [r.output.tokens for r in reqs] == alone
    assert sum(r.preemptions for r in reqs) > 0 and peak <= 5
    assert small.scheduler.pages.num_used == 0 and small.scheduler.pages.num_free == 5
    assert small.metrics.counter_value("preemptions_total") == sum(r.preemptions for r in reqs)


def test_pool_must_hold_one_full_request(cfg, params, tok):
    with pytest.raises(ValueError, match="kv_cache_tokens=48: cannot hold one request"):
        make_engine(cfg, params, tok, max_seq_len=64, max_batch=2, kv_cache_tokens=48)


def test_prefill_chunk_size_does_not_change_greedy(cfg, params, tok, engine):
    other = make_engine(cfg, params, tok, max_seq_len=64, max_batch=1, prefill_chunk=64,
                        decode_burst=1)
    prompt = POOL[2][:37]
    a = other.generate(prompt, max_new_tokens=8, ignore_eos=True).tokens
    assert a == engine.generate(prompt, max_new_tokens=8, ignore_eos=True).tokens


def test_stop_token_string_and_length(engine, tok):
    prompt = POOL[3][:10]
    cont = reference_greedy(engine, prompt, 20)
    stop_id = cont[4]
    res = engine.generate(prompt, max_new_tokens=20, stop=stop_id, ignore_eos=True)
    cut = cont.index(stop_id) + 1
    assert res.tokens == cont[:cut] and res.finish_reason == "stop"
    assert res.stop_reason == stop_id and res.text == tok.decode(cont[: cut - 1])
    text = tok.decode(cont)
    s = text[6:8]
    res = engine.generate(prompt, max_new_tokens=20, stop=["zzzz", s], ignore_eos=True)
    assert res.text == text[: text.index(s)] and res.finish_reason == "stop"
    assert res.stop_reason == s
    res = engine.generate(prompt, max_new_tokens=3, ignore_eos=True)
    assert res.tokens == cont[:3] and res.finish_reason == "length"
    # The sequence limit: 60 prompt tokens + 4 generated = max_seq_len.
    res = engine.generate(POOL[3][:60], max_new_tokens=20, ignore_eos=True)
    assert len(res.tokens) == 4 and res.finish_reason == "length"


def test_eos_stops_unless_ignored(engine):
    prompt = POOL[4][:8]
    cont = reference_greedy(engine, prompt, 12)
    res = engine.generate(prompt, max_new_tokens=12, stop=cont[2], ignore_eos=True)
    assert res.tokens[-1] == cont[2]
    # Make the engine's EOS id the third greedy token: generation ends there.
    eos = type(
        "T",
        (),
        {
            "vocab_size": 64,
            "bos_id": 1,
            "eos_id": cont[2],
            "encode": engine.tokenizer.encode,
            "decode": engine.tokenizer.decode,
        },
    )()
    old = engine.scheduler.tokenizer
    engine.scheduler.tokenizer = eos
    try:
        res = engine.generate(prompt, max_new_tokens=12)
    finally:
        engine.scheduler.tokenizer = old
    assert res.tokens == cont[: cont.index(cont[2]) + 1] and res.stop_reason == cont[2]


def test_text_prompts_and_bos(engine, tok):
    res = engine.generate("hello", max_new_tokens=4, ignore_eos=True)
    assert res.prompt_ids == [1] + tok.encode("hello")
    assert res.tokens == reference_greedy(engine, res.prompt_ids, 4)
    many = engine.generate(["hello", POOL[0][:5]], max_new_tokens=4, ignore_eos=True)
    assert [r.tokens for r in many] == [res.tokens, reference_greedy(engine, POOL[0][:5], 4)]


def test_seeded_sampling_is_deterministic_and_batch_independent(engine):
    p = POOL[5][:12]
    kw = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    alone = engine.generate(p, **kw).tokens
    assert alone == engine.generate(p, **kw).tokens
    # Same request in a batch with other (greedy, top-k) requests: the same tokens.
    batch = engine.generate([p, POOL[6][:30], POOL[7][:3]], **kw)  # seeds 123, 124, 125
    assert batch[0].tokens == alone
    reqs = [
        engine.request(q, engine.sampling_params(**k))
        for q, k in [
            (POOL[6][:30], dict(max_new_tokens=10, temperature=1.0, top_k=5, seed=1)),
            (p, kw),
            (POOL[7][:3], dict(max_new_tokens=4)),
        ]
    ]
    for r in reqs:
        engine.scheduler.submit(r)
    while not all(r.done for r in reqs):
        engine.scheduler.step()
    assert reqs[1].output.tokens == alone
    assert engine.generate(p, **{**kw, "seed": 124}).tokens != alone


def test_stream_matches_generate_and_cancels_on_close(engine):
    p = POOL[1][:9]
    full = engine.generate(p, max_new_tokens=10, ignore_eos=True)
    deltas = list(engine.stream(p, max_new_tokens=10, ignore_eos=True))
    assert sum((d.tokens for d in deltas), []) == full.tokens
    assert "".join(d.text for d in deltas) == full.text
    assert deltas[-1].finish_reason == "length"
    it = engine.stream(p, max_new_tokens=30, ignore_eos=True)
    next(it)
    assert engine.scheduler.num_running == 1
    it.close()
    assert engine.scheduler.num_running == 0


def test_bad_requests(engine):
    with pytest.raises(RequestError, match="max_seq_len"):
        engine.generate(POOL[0] + POOL[1][:4], max_new_tokens=1)
    with pytest.raises(RequestError, match="outside"):
        engine.generate([3, 99])
    with pytest.raises(RequestError, match="empty"):
        engine.generate([], max_new_tokens=1)
    with pytest.raises(RequestError, match="temperature"):
        engine.generate([3], temperature=-1.0)


def test_logits_shape_and_padding_invariance(engine):
    ids = np.asarray([POOL[0][:7], POOL[1][:7]])
    out = engine.logits(ids)
    assert out.shape == (2, 7, 64) and out.dtype == np.float32
    np.testing.assert_allclose(out[:, :5], engine.logits(ids[:, :5]), atol=1e-5)


def test_from_checkpoint_restores_params_also_onto_a_mesh(tmp_path, cfg, params, tok, engine):
    from jaxlearn.checkpoint import Checkpointer

    ckpt = Checkpointer.default_config().set(directory=str(tmp_path / "checkpoints"))
    with ckpt.instantiate() as c:
        c.save(7, {"params": params, "step": np.int32(7)})
        c.wait_until_finished()
    kw = dict(max_seq_len=64, max_batch=2, prefill_chunk=16, decode_burst=1)
    restored = Engine.from_checkpoint(tmp_path, cfg, tok,
                                      engine_cfg=Engine.default_config().set(**kw))
    ids = np.asarray([POOL[0][:16]])
    want = engine.logits(ids)
    np.testing.assert_array_equal(restored.logits(ids), want)
    mesh_cfg = Engine.default_config().set(mesh_shape=(1, 2, 4), **kw)
    sharded = Engine.from_checkpoint(tmp_path / "checkpoints", cfg, tok, step=7,
                                     engine_cfg=mesh_cfg)
    assert dict(sharded.mesh.shape) == {"data": 1, "fsdp": 2, "model": 4}
    q = sharded.runner.params["decoder"]["transformer"]["layer"]["self_attention"]["q_proj"]
    q = q["weight"]
    assert len(q.sharding.device_set) == 8
    np.testing.assert_allclose(sharded.logits(ids), want, atol=1e-5)
    res = sharded.generate(POOL[0][:16], max_new_tokens=6, ignore_eos=True)
    assert res.tokens == reference_greedy(engine, POOL[0][:16], 6)


def test_bf16_engine(tok):
    from conftest import tiny_config, tiny_params

    cfg16 = tiny_config(dtype="bfloat16")
    eng = make_engine(
        cfg16,
        tiny_params(cfg16),
        tok,
        max_seq_len=64,
        max_batch=1,
        prefill_chunk=16,
        decode_burst=1,
    )
    assert str(eng.runner.compute_dtype) == "bfloat16"
    a = eng.generate(POOL[0][:9], max_new_tokens=6, ignore_eos=True)
    b = eng.generate(POOL[0][:9], max_new_tokens=6, ignore_eos=True)
    assert a.tokens == b.tokens and len(a.tokens) == 6


def test_hf_tokenizers_object_and_loaded_bundle(cfg, params, engine):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jaxlearn.inference import HFTokenizer, as_tokenizer

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 64)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    assert isinstance(as_tokenizer(raw), HFTokenizer)
    bundle = type(
        "Loaded",
        (),
        {
            "tokenizer": raw,
            "eos_token_ids": (2,),
            "bos_token_id": 1,
            "chat_template": None,
            "encode_chat": None,
        },
    )()
    eng = make_engine(cfg, params, bundle, max_seq_len=64, max_batch=1, prefill_chunk=16,
                      decode_burst=4)
    tok = eng.tokenizer
    assert tok.encode("w5 w6 w7") == [5, 6, 7] and tok.eos_token_ids == (2,) and not eng.add_bos
    res = eng.generate("w5 w6 w7", max_new_tokens=6, ignore_eos=True)
    assert res.prompt_ids == [5, 6, 7]
    assert res.tokens == engine.generate([5, 6, 7], max_new_tokens=6, ignore_eos=True).tokens
    # Decoded in context: the separator after the prompt belongs to the continuation.
    assert res.text == " " + raw.decode(res.tokens, skip_special_tokens=True)


def test_fused_projections_engine_generates_the_same_tokens(cfg, params, tok, engine):
    fused = make_engine(cfg, params, tok, max_seq_len=64, max_batch=2, prefill_chunk=16,
                        decode_burst=4, fuse_projections=True)
    p = fused.runner.params["decoder"]["transformer"]["layer"]
    assert "qkv_proj" in p["self_attention"] and "wi_fused" in p["feed_forward"]
    for prompt in (POOL[0][:9], POOL[1][:30]):
        want = engine.generate(prompt, max_new_tokens=8, ignore_eos=True).tokens
        assert fused.generate(prompt, max_new_tokens=8, ignore_eos=True).tokens == want
