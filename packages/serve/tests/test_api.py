"""OpenAI API completeness on a tiny model: logprobs (sampled and prompt tokens, equal to
an independent numpy log-softmax of the layers' forward), echo with max_tokens 0 / 1 the
way lm-eval's `local-completions` scores multiple-choice items, lists of prompts, n /
best_of, seeds, presence / frequency penalties and logit bias (against a numpy greedy
reference), stop ids, streaming with logprobs and usage, max_completion_tokens."""

import json
import threading

import numpy as np
import pytest
from conftest import call, make_engine, prompt_pool, sse_events

from jaxlearn.module import functional
from jaxlearn.serve.server import InferenceServer

POOL = prompt_pool(seed=3)


@pytest.fixture(scope="module")
def server(engine):
    srv = InferenceServer(engine, port=0).start()
    yield srv
    srv.shutdown()


def ref_logprobs(engine, ids):
    """log_softmax (numpy, f64) of the model's plain full-sequence forward: [len, vocab]."""
    logits, _ = functional(engine.model, None, engine.runner.params,
                           ({"input_ids": np.asarray([ids], np.int32)},), method="logits",
                           is_training=False)
    x = np.asarray(logits[0], np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def post(srv, body, path="/v1/completions"):
    status, out, _ = call(srv, "POST", path, body)
    assert status == 200, out
    return json.loads(out)


# ---- engine ---------------------------------------------------------------------------


def test_prompt_logprobs_equal_reference_over_chunks(engine):
    """A 40-token prompt (prefill chunks of 16), max_new_tokens=0: every prompt token's
    logprob and its top-5 equal the reference within 1e-5."""
    ids = POOL[0][:40]
    res = engine.generate(ids, max_new_tokens=0, prompt_logprobs=5)
    ref = ref_logprobs(engine, ids)
    assert res.tokens == [] and res.finish_reason == "length"
    assert [e.token for e in res.prompt_logprobs] == ids[1:]
    got = np.array([e.logprob for e in res.prompt_logprobs])
    np.testing.assert_allclose(got, ref[np.arange(39), ids[1:]], atol=1e-5)
    for pos, e in enumerate(res.prompt_logprobs):
        want = np.argsort(-ref[pos], kind="stable")[:5]
        assert [i for i, _ in e.top] == want.tolist()
        np.testing.assert_allclose([v for _, v in e.top], ref[pos, want], atol=1e-5)


def test_generated_logprobs_equal_reference(engine):
    ids = POOL[1][:21]
    res = engine.generate(ids, max_new_tokens=10, logprobs=3, ignore_eos=True)
    ref = ref_logprobs(engine, ids + res.tokens)
    for j, e in enumerate(res.logprobs):
        row = ref[len(ids) - 1 + j]
        assert e.token == res.tokens[j] == int(np.argmax(row))  # Greedy: the top one.
        assert abs(e.logprob - row[e.token]) < 1e-5 and e.top[0] == (e.token, e.logprob)
        np.testing.assert_allclose([v for _, v in e.top], np.sort(row)[::-1][:3], atol=1e-5)


def penalized_greedy(engine, ids, n, presence, frequency, bias):
    """Greedy with OpenAI presence / frequency penalties over generated tokens and a logit
    bias, by re-running the full forward (numpy)."""
    seq, out = list(ids), []
    for _ in range(n):
        logits = np.asarray(engine.logits([seq])[0, -1], np.float64)
        counts = np.bincount(out, minlength=logits.shape[0]) if out else 0 * logits
        logits = logits - frequency * counts - presence * (counts > 0)
        for t, b in bias.items():
            logits[t] += b
        out.append(int(np.argmax(logits)))
        seq.append(out[-1])
    return out


def test_penalties_and_bias_equal_numpy_reference(engine):
    ids = POOL[2][:12]
    plain = engine.generate(ids, max_new_tokens=10, ignore_eos=True).tokens
    kw = dict(presence=0.7, frequency=1.5, bias={plain[0]: -5.0, 9: 2.0})
    want = penalized_greedy(engine, ids, 10, **kw)
    got = engine.generate(ids, max_new_tokens=10, ignore_eos=True, presence_penalty=0.7,
                          frequency_penalty=1.5, logit_bias=kw["bias"])
    assert got.tokens == want and got.tokens != plain
    # Batched with requests that use none of it, everybody keeps their own tokens.
    mixed = [engine.request(ids, engine.sampling_params(max_new_tokens=10, ignore_eos=True))
             for _ in range(2)]
    mixed.insert(1, engine.request(ids, engine.sampling_params(
        max_new_tokens=10, ignore_eos=True, presence_penalty=0.7, frequency_penalty=1.5,
        logit_bias=kw["bias"])))
    for r in mixed:
        engine.scheduler.submit(r)
    while not all(r.done for r in mixed):
        engine.scheduler.step()
    assert [r.output.tokens for r in mixed] == [plain, want, plain]


def test_penalties_and_logprobs_survive_preemption(cfg, params, tok, engine):
    """A pool of 80 tokens for 4 requests: preempted requests are recomputed with their
    generated-token counts rebuilt, so they get the tokens (and logprobs) they get alone."""
    small = make_engine(cfg, params, tok, max_seq_len=64, max_batch=4, prefill_chunk=16,
                        decode_burst=4, kv_cache_tokens=80)
    kw = dict(ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5, logprobs=1)
    jobs = [(POOL[i][:n], dict(kw, max_new_tokens=m, temperature=t, seed=i))
            for i, (n, m, t) in enumerate([(20, 30, 0.0), (10, 25, 0.9), (30, 20, 0.0),
                                           (5, 12, 1.0)])]
    alone = [engine.generate(p, **k) for p, k in jobs]
    reqs = [small.request(p, small.sampling_params(**k)) for p, k in jobs]
    for r in reqs:
        small.scheduler.submit(r)
    while not all(r.done for r in reqs):
        small.scheduler.step()
    assert sum(r.preemptions for r in reqs) > 0
    assert [r.output.tokens for r in reqs] == [a.tokens for a in alone]
    for a, r in zip(alone, reqs):
        np.testing.assert_allclose([e.logprob for e in r.logprobs],
                                   [e.logprob for e in a.logprobs], atol=1e-5)


# ---- server ---------------------------------------------------------------------------


def lm_eval_loglikelihood(out, ctxlens, max_tokens):
    """What lm-eval's `local-completions` computes from a response (its parse_logprobs):
    per choice, the sum of the continuation tokens' logprobs and whether each is greedy."""
    res = []
    end = None if max_tokens == 0 else -1
    for c, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        lps = c["logprobs"]["token_logprobs"][ctxlen:end]
        tops = c["logprobs"]["top_logprobs"][ctxlen:end]
        greedy = all(lp == max(top.values()) for lp, top in zip(lps, tops))
        res.append((sum(lps), greedy))
    return res


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_multiple_choice_loglikelihood_like_lm_eval(server, engine, max_tokens):
    """Two items in one request, prompt = context + continuation ids, echo, logprobs 1,
    temperature 0 (lm-eval's request): the continuation's summed logprob equals the
    reference log-softmax and is_greedy is True exactly for the greedy continuation."""
    ctx = POOL[4][:25]
    greedy = engine.generate(ctx, max_new_tokens=4, ignore_eos=True).tokens
    other = [t + 1 if t < 62 else 3 for t in greedy]
    out = post(server, {"model": "tiny", "prompt": [ctx + greedy, ctx + other], "echo": True,
                        "max_tokens": max_tokens, "logprobs": 1, "temperature": 0, "seed": 1234})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    got = lm_eval_loglikelihood(out, [len(ctx), len(ctx)], max_tokens)
    for (total, is_greedy), cont in zip(got, [greedy, other]):
        ref = ref_logprobs(engine, ctx + cont)
        want = sum(ref[len(ctx) - 1 + j, t] for j, t in enumerate(cont))
        assert abs(total - want) < 1e-5
        ref_greedy = all(int(np.argmax(ref[len(ctx) - 1 + j])) == t for j, t in enumerate(cont))
        assert is_greedy == ref_greedy == (cont == greedy)
    for c in out["choices"]:
        lp = c["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["tokens"]) == len(ctx) + 4 + max_tokens
    assert out["usage"] == {"prompt_tokens": 2 * (len(ctx) + 4), "completion_tokens":
                            2 * max_tokens, "total_tokens": 2 * (len(ctx) + 4 + max_tokens)}


def test_echo_text_and_offsets(server, engine):
    out = post(server, {"prompt": "hello world", "echo": True, "max_tokens": 3,
                        "temperature": 0, "ignore_eos": True, "logprobs": 0})
    c = out["choices"][0]
    gen = engine.generate("hello world", max_new_tokens=3, ignore_eos=True)
    assert c["text"] == "hello world" + gen.text
    lp = c["logprobs"]
    assert "".join(lp["tokens"]) == c["text"]  # One character per token (and BOS "").
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])  # logprobs 0: the token only.


def test_prompt_list_n_and_usage(server, engine):
    prompts = ["abc", POOL[5][:7], "hello"]
    out = post(server, {"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 0,
                        "ignore_eos": True})
    texts = [engine.generate(p, max_new_tokens=4, ignore_eos=True).text for p in prompts]
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["text"] for c in out["choices"]] == [t for t in texts for _ in range(2)]
    n_prompt = sum(len(engine.encode(p)) for p in prompts)
    assert out["usage"]["prompt_tokens"] == n_prompt
    assert out["usage"]["completion_tokens"] == 6 * 4


def test_best_of_returns_the_n_most_likely(server, engine):
    """best_of 4, n 2, seed 5: the candidates use seeds 5..8; the two returned are those of
    highest cumulative logprob (computed here by the engine), best first."""
    body = {"prompt": "abc", "n": 2, "best_of": 4, "max_tokens": 6, "temperature": 1.0,
            "seed": 5, "ignore_eos": True}
    out = post(server, body)
    cands = [engine.generate("abc", max_new_tokens=6, temperature=1.0, seed=5 + k,
                             ignore_eos=True, logprobs=0) for k in range(4)]
    ranked = sorted(cands, key=lambda r: -sum(e.logprob for e in r.logprobs))
    assert [c["text"] for c in out["choices"]] == [r.text for r in ranked[:2]]
    assert all(c["logprobs"] is None for c in out["choices"])  # Not asked for.
    greedy = post(server, {**body, "temperature": 0})
    assert len({c["text"] for c in greedy["choices"]}) == 1


def test_same_seed_same_output_even_when_batched(server):
    body = {"prompt": "seeded", "max_tokens": 12, "temperature": 1.0, "seed": 42,
            "ignore_eos": True}
    alone = post(server, body)["choices"][0]["text"]
    results = {}

    def one(key, b):
        results[key] = post(server, b)["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=("seeded", body))] + [
        threading.Thread(target=one, args=(i, {**body, "prompt": f"other {i}", "seed": i}))
        for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["seeded"] == alone
    assert post(server, {**body, "seed": 43})["choices"][0]["text"] != alone


def test_logit_bias_forces_and_bans(server, engine):
    out = post(server, {"prompt": "abc", "max_tokens": 5, "temperature": 1.0, "seed": 0,
                        "ignore_eos": True, "logit_bias": {"7": 100}})
    assert out["choices"][0]["text"] == "e" * 5  # id 7 is "e".
    first = engine.generate("abc", max_new_tokens=1, ignore_eos=True).tokens[0]
    banned = post(server, {"prompt": "abc", "max_tokens": 1, "temperature": 0,
                           "logit_bias": {str(first): -100}, "logprobs": 1})
    lp = banned["choices"][0]["logprobs"]
    assert engine.generate("abc", max_new_tokens=1, logit_bias={first: -100}).tokens != [first]
    # Logprobs are the raw model distribution: the banned token stays the top alternative.
    assert list(lp["top_logprobs"][0])[0] == engine.tokenizer.decode([first])


def test_stop_token_ids(server, engine):
    gen = engine.generate("abc", max_new_tokens=8, ignore_eos=True).tokens
    out = post(server, {"prompt": "abc", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                        "stop_token_ids": [gen[2]]})
    c = out["choices"][0]
    assert c["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == gen.index(gen[2]) + 1


def test_stream_with_logprobs_n_and_usage(server):
    body = {"prompt": "stream me", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "n": 2, "echo": True}
    whole = post(server, body)
    status, raw, _ = call(server, "POST", "/v1/completions",
                          {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    for c in whole["choices"]:
        parts = [ch for e in events[:-2] for ch in e["choices"] if ch["index"] == c["index"]]
        assert "".join(p["text"] for p in parts) == c["text"]
        assert parts[-1]["finish_reason"] == "length"
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for p in parts for x in p["logprobs"][key]] == c["logprobs"][key]


def test_chat_logprobs_and_max_completion_tokens(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    out = post(server, body, "/v1/chat/completions")
    c = out["choices"][0]
    content = c["logprobs"]["content"]
    assert out["usage"]["completion_tokens"] == 5 == len(content)
    assert "".join(e["token"] for e in content) == c["message"]["content"]
    for e in content:
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] == e["logprob"]
        assert e["bytes"] == list(e["token"].encode())
    status, raw, _ = call(server, "POST", "/v1/chat/completions", {**body, "stream": True})
    events = [e for e in sse_events(raw) if e != "[DONE]"]
    streamed = [x for e in events for ch in e["choices"] if ch["logprobs"]
                for x in ch["logprobs"]["content"]]
    assert streamed == content and events[0]["choices"][0]["delta"]["role"] == "assistant"
    plain = post(server, {k: v for k, v in body.items() if "logprobs" not in k},
                 "/v1/chat/completions")
    assert plain["choices"][0]["logprobs"] is None


def test_chat_n_streams_every_choice(server):
    body = {"messages": [{"role": "user", "content": "hey"}], "max_tokens": 4, "n": 2,
            "temperature": 0.8, "seed": 9, "ignore_eos": True}
    whole = post(server, body, "/v1/chat/completions")
    status, raw, _ = call(server, "POST", "/v1/chat/completions", {**body, "stream": True})
    events = [e for e in sse_events(raw) if e != "[DONE]"]
    assert status == 200 and len(whole["choices"]) == 2
    for c in whole["choices"]:
        parts = [ch for e in events for ch in e["choices"] if ch["index"] == c["index"]]
        assert parts[0]["delta"]["role"] == "assistant"
        assert "".join(p["delta"].get("content", "") for p in parts) == c["message"]["content"]
        assert parts[-1]["finish_reason"] == "length"
