"""HTTP server: OpenAI endpoints, SSE streaming, concurrent clients, disconnect frees the
slot, 429 under overload, one request's bounded share of the engine, and a hypothesis
fuzz over request bodies with zero 5xx."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ALPHABET, call, sse_events
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxlearn.serve.httpd import Limits
from jaxlearn.serve.server import InferenceServer


@pytest.fixture(scope="module")
def server(engine):
    srv = InferenceServer(engine, port=0).start()
    yield srv
    srv.shutdown()


def wait_until(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_models_health_metrics(server):
    status, body, _ = call(server, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"
    status, body, _ = call(server, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body, resp = call(server, "GET", "/metrics")
    assert status == 200 and resp.getheader("Content-Type").startswith("text/plain")
    text = body.decode()
    assert "# TYPE jaxlearn_requests_running gauge" in text
    assert "jaxlearn_http_requests_total" in text
    assert call(server, "GET", "/nope")[0] == 404
    assert call(server, "DELETE", "/v1/models")[0] == 405


def test_completion_matches_engine_greedy(server, engine):
    prompt = "hello there"
    want = engine.generate(prompt, max_new_tokens=8, ignore_eos=True)
    status, body, _ = call(server, "POST", "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert status == 200, body
    out = json.loads(body)
    assert out["object"] == "text_completion"
    assert out["choices"][0]["text"] == want.text
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(want.prompt_ids), "completion_tokens": 8,
                            "total_tokens": len(want.prompt_ids) + 8}


def test_chat_streaming_sse(server, engine):
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    status, payload, resp = call(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = sse_events(payload)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    status, plain, _ = call(server, "POST", "/v1/chat/completions", {**body, "stream": False,
                                                                   "stream_options": None})
    assert json.loads(plain)["choices"][0]["message"]["content"] == text


def test_concurrent_clients(server, engine):
    prompts = ["".join(ALPHABET[(i * 7 + j) % 26] for j in range(3 + 5 * i)) for i in range(8)]
    want = {p: engine.generate(p, max_new_tokens=10, ignore_eos=True).text for p in prompts}

    def one(i):
        p = prompts[i]
        body = {"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "stream": i % 2 == 1}
        status, payload, _ = call(server, "POST", "/v1/completions", body)
        assert status == 200
        if i % 2:
            evs = sse_events(payload)[:-1]
            return p, "".join(e["choices"][0]["text"] for e in evs)
        return p, json.loads(payload)["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for p, text in results:
        assert text == want[p]


@pytest.fixture()
def slow_decode(engine):
    """Makes every decode call take >= 250 ms, so a request of 60 tokens (15 bursts of 4)
    runs for seconds: long enough to notice its client leaving on a loaded machine."""
    runner = engine.runner
    orig = runner.decode

    def slow(**kw):
        time.sleep(0.25)
        return orig(**kw)

    runner.decode = slow
    yield
    del runner.decode


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_slot(server, engine, slow_decode, stream):
    before = engine.metrics.counter_value("requests_total", reason="cancelled")
    host, port = server.address
    sock = socket.create_connection((host, port))
    body = json.dumps({"prompt": "abc", "max_tokens": 60, "ignore_eos": True,
                       "stream": stream}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert wait_until(lambda: engine.scheduler.num_running == 1)
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    assert wait_until(lambda: engine.scheduler.num_running == 0)
    after = engine.metrics.counter_value("requests_total", reason="cancelled")
    assert after == before + 1


def test_overload_gets_429(server, engine):
    sched = engine.scheduler
    old = sched.max_queue
    results = []
    with sched.step_lock:  # The engine thread cannot admit anything meanwhile.
        sched.max_queue = 2

        def one():
            results.append(call(server, "POST", "/v1/completions",
                                {"prompt": "abc", "max_tokens": 2})[0])

        waiting = [threading.Thread(target=one) for _ in range(2)]
        for t in waiting:
            t.start()
        assert wait_until(lambda: sched.num_waiting == 2)
        status, body, resp = call(server, "POST", "/v1/completions",
                                  {"prompt": "abc", "max_tokens": 2})
        assert status == 429 and resp.getheader("Retry-After") == "1"
        assert json.loads(body)["error"]["type"] == "rate_limit_error"
        sched.max_queue = old
    for t in waiting:
        t.join(60)
    assert results == [200, 200]


def test_one_request_takes_a_bounded_share(server, engine, monkeypatch):
    """A request of 16 prompts keeps at most max_active_per_request (max_batch // 2 = 2)
    of its engine requests queued or running, so a small request sent meanwhile gets a
    slot at once (no 429) and completes first, submitted between the big one's."""
    share = server.limits.max_active_per_request
    assert share == engine.max_batch // 2 == 2
    sched, runner = engine.scheduler, engine.runner
    submitted, big_live, events = [], [], []
    orig_submit, orig_decode = sched.submit, runner.decode

    def submit(req):
        big = req.params.max_new_tokens == 24
        out = orig_submit(req)
        submitted.append("big" if big else "small")
        if big:
            big_live.append(req)
            events.append(sum(not r.done for r in big_live))
        return out

    def decode(**kw):  # Keeps the big request running for many steps.
        time.sleep(0.01)
        return orig_decode(**kw)

    monkeypatch.setattr(sched, "submit", submit)
    monkeypatch.setattr(runner, "decode", decode)
    finished, results = [], {}
    prompts = ["".join(ALPHABET[(i + j) % 26] for j in range(4)) for i in range(16)]

    def big():
        results["big"] = call(server, "POST", "/v1/completions", {
            "prompt": prompts, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        finished.append("big")

    t = threading.Thread(target=big)
    t.start()
    assert wait_until(lambda: len(submitted) >= share)
    status, body, _ = call(server, "POST", "/v1/completions", {
        "prompt": "xyz", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    finished.append("small")
    t.join(120)
    assert status == 200, body
    assert results["big"][0] == 200 and finished == ["small", "big"]
    assert len(json.loads(results["big"][1])["choices"]) == 16
    assert max(events) <= share and len(events) == 16
    assert "big" in submitted[submitted.index("small"):]  # Interleaved, not after all.


def test_share_does_not_change_results(server, engine):
    """The same sampled request (seeded, best_of > n, logprobs) through a server that
    submits one engine request at a time and through one that submits them all."""
    body = {"prompt": ["abc", "hello", "zz"], "max_tokens": 6, "temperature": 1.0,
            "seed": 11, "n": 2, "best_of": 3, "logprobs": 1, "ignore_eos": True}
    outs = []
    for share in (1, 9):
        srv = InferenceServer(engine, port=0, limits=Limits(max_active_per_request=share))
        threading.Thread(target=srv.httpd.serve_forever, daemon=True).start()
        try:
            status, out, _ = call(srv, "POST", "/v1/completions", body)
        finally:
            srv.httpd.shutdown()
            srv.httpd.server_close()
        assert status == 200, out
        outs.append(json.loads(out)["choices"])
    assert [c["text"] for c in outs[0]] == [c["text"] for c in outs[1]]
    assert [c["logprobs"]["tokens"] for c in outs[0]] == [c["logprobs"]["tokens"] for c in outs[1]]
    for a, b in zip(outs[0], outs[1]):
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"],
                                                                abs=1e-5)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "temperature": 1e308}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_k": 10**9}, "top_k"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 64}, "max_tokens"),
    ({"prompt": "a" * 80}, "prompt"),
    ({"prompt": [3, 4, 999]}, "prompt"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 17}, "n"),
    ({"prompt": "a", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "a", "best_of": 3, "stream": True}, "best_of"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "logit_bias": {"64": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": [1]}, "logit_bias"),
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [3, "a"]}, "prompt"),
    ({"prompt": ["a", "b" * 80]}, "prompt"),
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({}, "prompt"),
])
def test_bad_requests_are_400(server, body, param):
    status, out, _ = call(server, "POST", "/v1/completions", body)
    assert status == 400, out
    err = json.loads(out)["error"]
    assert err["param"] == param and err["message"]


_HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,param", [
    ({"messages": _HI, "echo": True}, "echo"),
    ({"messages": _HI, "logprobs": 2}, "logprobs"),
    ({"messages": _HI, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": _HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": _HI, "max_tokens": 0}, "max_tokens"),
    ({"messages": _HI, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": _HI, "prompt": "a"}, "prompt"),
])
def test_bad_chat_requests_are_400(server, body, param):
    status, out, _ = call(server, "POST", "/v1/chat/completions", body)
    assert status == 400, out
    err = json.loads(out)["error"]
    assert err["param"] == param and err["message"]


def test_malformed_bodies(server):
    assert call(server, "POST", "/v1/completions", raw=b"{nope")[0] == 400
    assert call(server, "POST", "/v1/completions", raw=b"[1, 2]")[0] == 400
    assert call(server, "POST", "/v1/completions", raw=b'{"prompt": NaN}')[0] == 400
    assert call(server, "POST", "/v1/completions", raw=b"\xff\xfe")[0] == 400
    assert call(server, "POST", "/v1/completions", raw=b"[" * 5000 + b"]" * 5000)[0] == 400
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    assert call(server, "POST", "/v1/completions", raw=big)[0] == 413
    # A huge declared length is refused before any body is sent.
    with socket.create_connection(server.address) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 413")
    with socket.create_connection(server.address) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 411")
    assert call(server, "POST", "/v1/completions", {"model": "other", "prompt": "a"})[0] == 404
    status, out, _ = call(server, "POST", "/v1/chat/completions",
                          {"messages": [{"role": "wizard", "content": "x"}]})
    assert status == 400 and "role" in json.loads(out)["error"]["message"]


# ---- fuzzing ---------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
)
_values = st.recursive(_scalars, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)), max_leaves=8)
_good = {
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-2, 70), max_size=8),
                        st.lists(st.one_of(st.text(max_size=8),
                                           st.lists(st.integers(-2, 70), max_size=4)),
                                 max_size=3)),
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "bot"]),
         "content": st.one_of(st.text(max_size=20), _values)}), max_size=3),
    "max_tokens": st.one_of(st.integers(-3, 70), _values),
    "temperature": st.one_of(st.floats(-1, 3), _values),
    "top_p": st.one_of(st.floats(-0.5, 1.5), _values),
    "top_k": st.one_of(st.integers(-2, 100), _values),
    "seed": st.one_of(st.integers(-(2**65), 2**65), _values),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), _values),
    "stream": st.one_of(st.booleans(), _values),
    "repetition_penalty": st.one_of(st.floats(-1, 12), _values),
    "n": st.one_of(st.integers(-1, 3), _values), "best_of": st.one_of(st.integers(0, 4), _values),
    "logprobs": st.one_of(st.integers(-1, 22), st.booleans(), _values),
    "top_logprobs": st.one_of(st.integers(-1, 22), _values),
    "echo": st.one_of(st.booleans(), _values),
    "logit_bias": st.one_of(st.dictionaries(st.integers(-1, 70).map(str),
                                            st.floats(-120, 120), max_size=3), _values),
    "presence_penalty": st.one_of(st.floats(-3, 3), _values),
    "frequency_penalty": st.one_of(st.floats(-3, 3), _values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}),
                                _values),
    "max_completion_tokens": st.one_of(st.integers(-1, 70), _values),
    "stop_token_ids": _values, "ignore_eos": _values,
    "model": st.one_of(st.just("tiny"), _values),
}
_bodies = st.one_of(
    st.fixed_dictionaries({}, optional={**_good, "zzz": _values}),
    _values,
)


@settings(max_examples=60, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       st.one_of(_bodies.map(lambda b: json.dumps(b).encode()), st.binary(max_size=40)))
def test_fuzz_request_bodies_never_5xx(server, engine, path, raw):
    status, out, _ = call(server, "POST", path, raw=raw)
    assert status < 500, (status, out[:300])
    if status == 200 and not out.startswith(b"data: "):
        assert json.loads(out)["choices"]
    assert wait_until(lambda: engine.scheduler.num_running == 0)


def test_engine_without_tokenizer_refuses_text_and_chat(cfg, params):
    """Token ids only: a text prompt or a chat is a 400 naming the missing tokenizer."""
    from conftest import make_engine

    engine = make_engine(cfg, params, None, max_seq_len=32, max_batch=1, prefill_chunk=16)
    srv = InferenceServer(engine, port=0).start()
    try:
        for path, body, param in [
            ("/v1/completions", {"prompt": "hello", "max_tokens": 2}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
             "messages"),
        ]:
            status, out, _ = call(srv, "POST", path, body)
            err = json.loads(out)["error"]
            assert status == 400 and err["param"] == param and "no" in err["message"]
            assert "tokenizer" in err["message"], err
    finally:
        srv.shutdown()
