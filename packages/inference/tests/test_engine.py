"""Engine: greedy == cache-free argmax loop, chunked prefill == full prefill, stops,
seeds, streaming, checkpoint restore (also onto a mesh)."""

import jax
import numpy as np
import pytest
from conftest import prompt_pool, reference_greedy

from jaxlearn.inference import Engine, RequestError
from jaxlearn.module import functional

POOL = prompt_pool()


@pytest.mark.parametrize("length", [1, 5, 16, 17, 40])
def test_greedy_equals_cache_free_argmax(engine, length):
    prompt = POOL[0][:length]
    res = engine.generate(prompt, max_new_tokens=12, ignore_eos=True)
    assert res.tokens == reference_greedy(engine, prompt, 12)
    assert res.finish_reason == "length" and res.prompt_ids == prompt


def test_chunked_prefill_equals_full_prefill(engine, cfg, params):
    prompt = POOL[1][:40]  # 16 + 16 + 8 (bucket 16)
    runner = engine.runner
    slot, start, tok = 2, 0, None
    while start < len(prompt):
        chunk = np.asarray(prompt[start : start + 16], np.int32)
        tok = runner.prefill_chunk(slot, chunk, start, 16, temperature=0.0, top_k=0,
                                   top_p=1.0, penalty=1.0, seed=0)
        start += len(chunk)
    model = engine.model
    states, _ = functional(model, None, params, (1, 64), method="init_states",
                           is_training=False)
    (full, logits), _ = functional(model, None, params, (states, np.asarray([prompt])),
                                   method="prefill", is_training=False)
    assert tok == int(np.argmax(logits[0, -1]))
    for name in ("key", "value"):
        got = np.asarray(runner.cache["self_attention"][name])[:, slot, :40]
        want = np.asarray(full["decoder"]["self_attention"][name])[:, 0, :40]
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_prefill_chunk_size_does_not_change_greedy(cfg, params, tok, engine):
    other = Engine(cfg, params, tok, max_seq_len=64, max_batch=1, prefill_chunk=64,
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
    eos = type("T", (), {"vocab_size": 64, "bos_id": 1, "eos_id": cont[2],
                         "encode": engine.tokenizer.encode,
                         "decode": engine.tokenizer.decode})()
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
    reqs = [engine.request(q, engine.sampling_params(**k)) for q, k in [
        (POOL[6][:30], dict(max_new_tokens=10, temperature=1.0, top_k=5, seed=1)),
        (p, kw),
        (POOL[7][:3], dict(max_new_tokens=4)),
    ]]
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
    from jaxlearn.mesh import make_mesh

    ckpt = Checkpointer.default_config().set(directory=str(tmp_path / "checkpoints"))
    with ckpt.instantiate() as c:
        c.save(7, {"params": params, "step": np.int32(7)})
        c.wait_until_finished()
    kw = dict(max_seq_len=64, max_batch=2, prefill_chunk=16, decode_burst=1)
    restored = Engine.from_checkpoint(tmp_path, cfg, tok, **kw)
    ids = np.asarray([POOL[0][:16]])
    want = engine.logits(ids)
    np.testing.assert_array_equal(restored.logits(ids), want)
    mesh = make_mesh((1, 2, 4), ("data", "fsdp", "model"), jax.devices()[:8])
    sharded = Engine.from_checkpoint(tmp_path / "checkpoints", cfg, tok, mesh=mesh, step=7, **kw)
    q = sharded.runner.params["decoder"]["transformer"]["layer"]["self_attention"]["q_proj"]
    assert len(q.sharding.device_set) == 8
    np.testing.assert_allclose(sharded.logits(ids), want, atol=1e-5)
    res = sharded.generate(POOL[0][:16], max_new_tokens=6, ignore_eos=True)
    assert res.tokens == reference_greedy(engine, POOL[0][:16], 6)


def test_bf16_engine(tok):
    from conftest import tiny_config, tiny_params

    cfg16 = tiny_config(dtype="bfloat16")
    eng = Engine(cfg16, tiny_params(cfg16), tok, max_seq_len=64, max_batch=1,
                 prefill_chunk=16, decode_burst=1)
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
    bundle = type("Loaded", (), {"tokenizer": raw, "eos_token_ids": (2,), "bos_token_id": 1,
                                 "chat_template": None, "encode_chat": None})()
    eng = Engine(cfg, params, bundle, max_seq_len=64, max_batch=1, prefill_chunk=16,
                 decode_burst=4)
    tok = eng.tokenizer
    assert tok.encode("w5 w6 w7") == [5, 6, 7] and tok.eos_token_ids == (2,) and not eng.add_bos
    res = eng.generate("w5 w6 w7", max_new_tokens=6, ignore_eos=True)
    assert res.prompt_ids == [5, 6, 7]
    assert res.tokens == engine.generate([5, 6, 7], max_new_tokens=6, ignore_eos=True).tokens
    # Decoded in context: the separator after the prompt belongs to the continuation.
    assert res.text == " " + raw.decode(res.tokens, skip_special_tokens=True)
