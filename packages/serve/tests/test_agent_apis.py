"""`/v1/responses` and `/v1/messages` on a tiny random model: tool calls under the grammar,
streamed events that add up to the non-streamed reply, conversations with past calls and
their results, each API's own error shape, and the request bodies the real clients sent
(recorded by `tools/bench/agent_clients_check.py`) replayed."""

import json
import pathlib

import pytest
from conftest import call
from tool_testing import ADD, WEATHER, check_call, tool_engine

from jaxlearn.serve.server import InferenceServer

pytest.importorskip("llguidance", reason="tool calls need llguidance")
RECORDED = pathlib.Path(__file__).parent / "fixtures" / "clients"


@pytest.fixture(scope="module")
def server():
    srv = InferenceServer(tool_engine(), port=0).start()
    yield srv
    srv.shutdown()


def post(srv, path, body, status=200):
    code, out, _ = call(srv, "POST", path, body)
    assert code == status, out
    return json.loads(out) if not body.get("stream") or status != 200 else out.decode()


def events(raw):
    """[(event name, data)] of a named-event SSE body."""
    out = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def flat(tool):
    return {"type": "function", **tool["function"]}


# ---- Responses ----------------------------------------------------------------------------


def test_responses_function_call_streamed_and_not(server):
    body = {"input": "add two numbers", "instructions": "use tools", "tools": [flat(ADD)],
            "tool_choice": "required", "max_output_tokens": 120, "temperature": 0}
    out = post(server, "/v1/responses", body)
    assert out["object"] == "response" and out["status"] == "completed"
    (item,) = [o for o in out["output"] if o["type"] == "function_call"]
    check_call({"type": "function", "id": item["call_id"],
                "function": {"name": item["name"], "arguments": item["arguments"]}}, [ADD])
    assert out["usage"]["output_tokens"] > 0 and out["tool_choice"] == "required"
    evs = events(post(server, "/v1/responses", {**body, "stream": True}))
    kinds = [k for k, _ in evs]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    args = "".join(d["delta"] for k, d in evs if k == "response.function_call_arguments.delta")
    done = [d for k, d in evs if k == "response.output_item.done"]
    assert done[-1]["item"]["arguments"] == args == item["arguments"], "greedy: same call"
    assert evs[-1][1]["response"]["output"][-1]["arguments"] == args


def test_responses_conversation_with_a_call_and_its_output(server):
    body = {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "add 2 and 3"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\":2,\"b\":3}"},
        {"type": "function_call_output", "call_id": "c1", "output": "5"}],
        "tools": [flat(ADD)], "max_output_tokens": 8, "store": False}
    out = post(server, "/v1/responses", body)
    assert out["status"] in ("completed", "incomplete")
    if out["status"] == "incomplete":
        assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    text = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 4,
                                           "text": {"format": {"type": "json_schema",
                                                               "name": "x", "schema": {
                                                                   "type": "object"}}}})
    assert text["output"][0]["type"] == "message"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "nope"}}}}, "text.format.schema"),
    ({"input": "x", "frequency": 1}, "frequency"),
])
def test_responses_errors_name_the_field(server, body, param):
    out = post(server, "/v1/responses", body, status=400)
    assert out["error"]["param"] == param, out


# ---- Messages -----------------------------------------------------------------------------


def anthropic_tool(t):
    return {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}


def test_messages_tool_use_streamed_and_not(server):
    body = {"model": "tiny", "max_tokens": 120, "system": "use tools", "temperature": 0,
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [anthropic_tool(WEATHER), anthropic_tool(ADD)],
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    out = post(server, "/v1/messages", body)
    assert out["type"] == "message" and out["stop_reason"] == "tool_use"
    (use,) = [b for b in out["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather" and use["id"].startswith("toolu_")
    check_call({"type": "function", "id": "call_x", "function": {
        "name": use["name"], "arguments": json.dumps(use["input"])}}, [WEATHER])
    evs = events(post(server, "/v1/messages", {**body, "stream": True}))
    kinds = [k for k, _ in evs]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    start = [d for k, d in evs if k == "content_block_start"]
    assert start[0]["content_block"]["type"] == "tool_use"
    partial = "".join(d["delta"]["partial_json"] for k, d in evs
                      if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == use["input"], "greedy: same call"
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_messages_round_trip_and_stop_sequences(server):
    body = {"model": "tiny", "max_tokens": 40, "tools": [anthropic_tool(ADD)],
            "messages": [
                {"role": "user", "content": "add 2 and 3"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Adding."},
                    {"type": "tool_use", "id": "toolu_1", "name": "add",
                     "input": {"a": 2, "b": 3}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}]}]}
    out = post(server, "/v1/messages", body)
    assert out["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    text = "".join(b["text"] for b in out["content"] if b["type"] == "text")
    stop = text[3:5] if len(text) > 6 else None
    if stop:  # The same greedy reply, ended at a string it writes.
        again = post(server, "/v1/messages", {**body, "temperature": 0, "stop_sequences": [stop]})
        if again["stop_reason"] == "stop_sequence":
            assert again["stop_sequence"] == stop
            assert stop not in "".join(b.get("text", "") for b in again["content"])


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "f", "input_schema": {"type": "nope"}}],
      "tool_choice": {"type": "any"}}, "tools"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
])
def test_messages_errors_have_the_anthropic_shape(server, body, message):
    out = post(server, "/v1/messages", {"model": "tiny", **body}, status=400)
    assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
    assert out["error"]["message"].startswith(f"'{message}'"), out


# ---- what the real clients sent -------------------------------------------------------------


def _recorded():
    return sorted(RECORDED.glob("*.json")) if RECORDED.is_dir() else []


@pytest.mark.skipif(not _recorded(), reason="no recorded client exchanges")
@pytest.mark.parametrize("path", _recorded(), ids=lambda p: p.stem)
def test_recorded_client_requests_are_served(server, path):
    ex = json.loads(path.read_text())
    if ex["method"] != "POST":
        return
    body = dict(ex["request"], model="tiny")
    code, out, resp = call(server, "POST", ex["path"], body)
    assert code == ex["status"] == 200, out
    if body.get("stream"):
        assert resp.getheader("Content-Type").startswith("text/event-stream")
        return
    got, want = json.loads(out), ex["response"]
    assert set(want) <= set(got), f"fields the client saw: {sorted(set(want) - set(got))}"
