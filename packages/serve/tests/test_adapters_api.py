"""LoRA adapters through HTTP: `model` names an adapter, concurrent requests for different
adapters and the base share the engine's batch and each gets what a server of that
adapter's merged weights gives alone (greedy tokens equal), streamed or not; `/v1/models`
lists them; the runtime load / unload routes (with an adapter loader) and their errors."""

import json
import threading

import pytest
from conftest import call, make_engine, sse_events
from engine_testing import lora_model

from jaxlearn.layers import merge_lora
from jaxlearn.serve.server import InferenceServer

SETTINGS = dict(max_seq_len=64, max_batch=4, prefill_chunk=16, decode_burst=4)
RANKS = {"sql": 2, "poem": 4}


@pytest.fixture(scope="module")
def adapters(cfg, params):
    return {name: lora_model(cfg, params, rank, seed)
            for seed, (name, rank) in enumerate(RANKS.items(), start=1)}


@pytest.fixture(scope="module")
def server(cfg, params, tok, adapters):
    engine = make_engine(cfg, params, tok, max_loras=3, max_lora_rank=4, **SETTINGS)
    for name, (_, p) in adapters.items():
        engine.load_adapter(name, RANKS[name], 3.0 * RANKS[name], p)
    loaded = {"/runs/extra": (2, 6.0, adapters["sql"][1])}

    def loader(path):
        if path not in loaded:
            raise ValueError(f"{path}: not a LoRA adapter")
        return loaded[path]

    srv = InferenceServer(engine, port=0, adapter_loader=loader).start()
    yield srv
    srv.shutdown()


def completion(srv, model, prompt, stream=False):
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": stream}
    if model is not None:
        body["model"] = model
    status, out, _ = call(srv, "POST", "/v1/completions", body)
    assert status == 200, out
    if stream:
        return "".join(e["choices"][0]["text"] for e in sse_events(out)[:-1] if e["choices"])
    return json.loads(out)["choices"][0]["text"]


def merged_text(cfg, params, tok, adapters, model, prompt):
    """The same request on an engine of the adapter's merged weights (or the base)."""
    if model is None:
        ecfg, eparams = cfg, params
    else:
        ecfg, eparams = merge_lora(*adapters[model])
    srv = InferenceServer(make_engine(ecfg, eparams, tok, **SETTINGS), port=0).start()
    try:
        return completion(srv, None, prompt)
    finally:
        srv.shutdown()


def test_adapters_mixed_in_one_batch_equal_their_merged_servers(server, cfg, params, tok,
                                                                 adapters):
    prompts = ["the cat sat on", "a quick brown fox", "hello world, said"]
    jobs = [(m, p, s) for p in prompts for m in (None, "sql", "poem") for s in (False, True)]
    got = {}

    def go(job):
        got[job] = completion(server, *job)

    threads = [threading.Thread(target=go, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in prompts:
        want = {m: merged_text(cfg, params, tok, adapters, m, p) for m in (None, "sql", "poem")}
        assert len(set(want.values())) == 3, "the adapters change the output"
        for m in (None, "sql", "poem"):
            assert got[(m, p, False)] == got[(m, p, True)] == want[m], (m, p)


def test_models_lists_the_adapters_and_unknown_models_are_404(server):
    status, out, _ = call(server, "GET", "/v1/models")
    data = json.loads(out)["data"]
    base = data[0]["id"]
    assert {d["id"]: d["parent"] for d in data} == {base: None, "poem": base, "sql": base}
    status, out, _ = call(server, "POST", "/v1/chat/completions", {
        "model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 404 and json.loads(out)["error"]["param"] == "model"


def test_load_and_unload_at_run_time(server):
    def post(path, body):
        status, out, _ = call(server, "POST", path, body)
        return status, json.loads(out)

    assert post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nope"})[0] == 400
    assert post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/runs/extra"}
                )[0] == 400, "a taken name"
    assert post("/v1/load_lora_adapter", {"lora_name": "x"})[0] == 400
    status, out = post("/v1/load_lora_adapter", {"lora_name": "extra",
                                                 "lora_path": "/runs/extra"})
    assert status == 200 and out["loaded"] == ["extra", "poem", "sql"]
    assert completion(server, "extra", "the cat sat on") != completion(server, None,
                                                                        "the cat sat on")
    status, out = post("/v1/unload_lora_adapter", {"lora_name": "extra"})
    assert status == 200 and out["loaded"] == ["poem", "sql"]
    assert post("/v1/unload_lora_adapter", {"lora_name": "extra"})[0] == 404
    status, out, _ = call(server, "POST", "/v1/completions", {"model": "extra", "prompt": "a"})
    assert status == 404


def test_runtime_routes_are_off_without_a_loader(cfg, params, tok):
    srv = InferenceServer(make_engine(cfg, params, tok, **SETTINGS), port=0).start()
    try:
        status, out, _ = call(srv, "POST", "/v1/load_lora_adapter",
                              {"lora_name": "a", "lora_path": "/x"})
    finally:
        srv.shutdown()
    assert status == 404 and "--allow_runtime_lora" in json.loads(out)["error"]["message"]
