"""`response_format` through the HTTP API: chat and completions endpoints, streamed
and not, outputs that conform to their schema; 400s naming the field."""

import json

import pytest
from conftest import call, make_engine, sse_events
from schema_testing import SCHEMAS, check, rf

from jaxlearn.inference.errors import RequestError
from jaxlearn.serve.server import InferenceServer

pytest.importorskip("llguidance", reason="structured output needs llguidance")


@pytest.fixture(scope="module")
def server(byte_engine):
    srv = InferenceServer(byte_engine, port=0).start()
    yield srv
    srv.shutdown()


def post(srv, body, path):
    status, out, _ = call(srv, "POST", path, body)
    assert status == 200, out
    return json.loads(out)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_server_response_format(server, path):
    schema = SCHEMAS["required fields"]
    body = {"max_tokens": 200, "temperature": 1.0, "seed": 3, "n": 2,
            "response_format": rf(schema)}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "json please"}]
    else:
        body["prompt"] = "json please"
    out = post(server, body, path)
    texts = [c["message"]["content"] if "message" in c else c["text"] for c in out["choices"]]
    assert len(texts) == 2 and all(c["finish_reason"] == "stop" for c in out["choices"])
    for t in texts:
        check(t, schema)
    status, raw, _ = call(server, "POST", path, {**body, "n": 1, "stream": True})
    assert status == 200
    parts = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content", "")
             for c in sse_events(raw)[:-1] if c["choices"]]
    check("".join(p or "" for p in parts), schema)


@pytest.mark.parametrize("response_format, param", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_object", "schema": {}}, "response_format.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "minLength": 5, "maxLength": 2}}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {}}},
     "response_format.json_schema.strict"),
])
def test_bad_response_format_is_400_naming_the_field(server, response_format, param):
    body = {"prompt": "x", "max_tokens": 4, "response_format": response_format}
    status, out, _ = call(server, "POST", "/v1/completions", body)
    assert status == 400, out
    err = json.loads(out)["error"]
    assert err["param"] == param and "\n" not in err["message"], err


def test_unsupported_combinations(server, cfg, params):
    body = {"prompt": "x", "max_tokens": 4, "ignore_eos": True,
            "response_format": {"type": "json_object"}}
    status, out, _ = call(server, "POST", "/v1/completions", body)
    assert status == 400 and json.loads(out)["error"]["param"] == "ignore_eos"
    ids_only = make_engine(cfg, params, None, max_seq_len=64, max_batch=2)
    with pytest.raises(RequestError, match="no tokenizer|none") as e:
        ids_only.generate([5, 6], max_new_tokens=4, response_format={"type": "json_object"})
    assert e.value.param == "response_format"


def _nested(objects):
    schema = {"type": "integer"}
    for _ in range(objects):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_json_schema_may_nest_as_deep_as_llguidance_takes(server):
    """40 nested objects (the body 85 levels deep, past the general cap of 64) are
    served; past llguidance's own limit it names the schema, past the server's cap on
    `response_format` the 400 names response_format; elsewhere the general cap holds."""
    body = {"prompt": "x", "max_tokens": 11, "temperature": 0}
    status, out, _ = call(server, "POST", "/v1/completions",
                          {**body, "response_format": rf(_nested(40))})
    assert status == 200, out
    assert json.loads(out)["choices"][0]["text"] == '{"a":{"a":{'
    for objects, param in ((62, "response_format.json_schema.schema"),
                           (70, "response_format"), (300, "response_format")):
        status, out, _ = call(server, "POST", "/v1/completions",
                              {**body, "response_format": rf(_nested(objects))})
        err = json.loads(out)["error"]
        assert status == 400 and err["param"] == param, (objects, err)
        assert "response_format" in err["message"], err
    deep: list = []
    for _ in range(70):
        deep = [deep]
    status, out, _ = call(server, "POST", "/v1/completions", {**body, "stop": deep})
    err = json.loads(out)["error"]
    assert status == 400 and "nested deeper than 64" in err["message"] and err["param"] is None


def test_feature_mix_after_warmup_compiles_nothing(byte_engine):
    """Through the HTTP API (echo + logprobs, best_of, n, logit bias, penalties, top-k/p,
    JSON schemas, chat, streaming) after the "auto" warm-up: the server compiles no
    program (`programs_compiled_late` stays 0 on /metrics)."""
    byte_engine.warmup("auto", threads=2)
    srv = InferenceServer(byte_engine, port=0).start()
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    bodies = [
        {"prompt": "ab", "max_tokens": 3, "echo": True, "logprobs": 5},
        {"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 0},
        {"prompt": ["a", "b", "c"], "max_tokens": 4, "n": 1, "temperature": 0.9, "seed": 1},
        {"prompt": "x", "max_tokens": 5, "best_of": 3, "n": 2, "temperature": 1.0,
         "seed": 2, "logprobs": 20},
        {"prompt": "q", "max_tokens": 6, "logit_bias": {str(i): 1.0 for i in range(300)}},
        {"prompt": "q", "max_tokens": 6, "presence_penalty": 1.0, "frequency_penalty": 0.5,
         "top_p": 0.5, "temperature": 1.0, "seed": 4},
        {"prompt": "s", "max_tokens": 20, "response_format": rf(schema)},
        {"prompt": "s", "max_tokens": 9, "top_k": 3, "temperature": 0.7, "stream": True},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
         "response_format": rf(schema), "logprobs": True, "top_logprobs": 3},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 4,
         "temperature": 1.0, "seed": 5, "stream": True},
    ]
    try:
        for body in bodies:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            status, out, _ = call(srv, "POST", path, body)
            assert status == 200, (body, out)
        status, metrics, _ = call(srv, "GET", "/metrics")
        assert status == 200
        late = [line for line in metrics.decode().splitlines()
                if line.startswith("jaxlearn_programs_compiled_late ")]
        assert late == ["jaxlearn_programs_compiled_late 0"], late
    finally:
        srv.shutdown()
