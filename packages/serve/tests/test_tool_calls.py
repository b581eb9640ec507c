"""Tool calls through `/v1/chat/completions` on a tiny random model: under the tool grammar
every call parses and validates (random schemas, streamed and not), the same check fails
with the grammar off, streamed deltas reassemble to the non-streamed message, tool turns
and reasoning render through the model's template, and bad requests are 400s naming the
field."""

import json

import pytest
from conftest import call, sse_events
from hypothesis import given, settings
from tool_testing import (
    ADD,
    QWEN_STYLE,
    WEATHER,
    check_call,
    random_parameters,
    tool,
    tool_engine,
)

from jaxlearn.serve import chat_reply
from jaxlearn.serve.server import InferenceServer

pytest.importorskip("llguidance", reason="tool calls need llguidance")


@pytest.fixture(scope="module")
def server():
    srv = InferenceServer(tool_engine(), port=0).start()
    yield srv
    srv.shutdown()


def post(srv, body):
    status, out, _ = call(srv, "POST", "/v1/chat/completions", body)
    assert status == 200, out
    return json.loads(out)


def chat(tools, **fields):
    return {"messages": [{"role": "user", "content": "call a tool"}], "tools": tools,
            "max_tokens": 160, "temperature": 1.0, "seed": 1, **fields}


def streamed(srv, body):
    """(message reassembled from the deltas as the openai SDK does, finish reasons)."""
    status, raw, _ = call(srv, "POST", "/v1/chat/completions", {**body, "stream": True})
    assert status == 200, raw
    content, reasoning, calls, finish = "", "", {}, []
    for ev in sse_events(raw)[:-1]:
        for ch in ev["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            reasoning += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls", []):
                slot = calls.setdefault(tc["index"], {"function": {"arguments": ""}})
                if "id" in tc:
                    assert "name" in tc["function"], "a call's first delta carries its name"
                    slot.update(id=tc["id"], type=tc["type"])
                    slot["function"]["name"] = tc["function"]["name"]
                slot["function"]["arguments"] += tc["function"].get("arguments", "")
            if ch["finish_reason"] is not None:
                finish.append(ch["finish_reason"])
    msg = {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg, finish


def check_reply(choice, tools):
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls", choice
    assert msg["tool_calls"], msg
    return [check_call(c, tools) for c in msg["tool_calls"]]


@settings(max_examples=12)
@given(params=random_parameters)
def test_required_calls_always_validate(server, params):
    tools = [tool("f", params), WEATHER]
    body = chat(tools, tool_choice="required", parallel_tool_calls=False, n=2)
    out = post(server, body)
    for choice in out["choices"]:
        check_reply(choice, tools)
        assert len(choice["message"]["tool_calls"]) == 1 and not choice["message"]["content"]
    msg, finish = streamed(server, {**body, "n": 1})
    assert finish == ["tool_calls"]
    check_call(msg["tool_calls"][0], tools)
    first = out["choices"][0]["message"]["tool_calls"][0]
    assert msg["tool_calls"][0]["function"] == first["function"], "stream == non-stream"


def test_the_check_fails_without_the_grammar(server, monkeypatch):
    monkeypatch.setattr(chat_reply, "tool_grammar", lambda *a, **k: None)
    out = post(server, chat([WEATHER, ADD], tool_choice="required", n=4))
    for choice in out["choices"]:
        with pytest.raises((AssertionError, KeyError, TypeError, ValueError)):
            check_reply(choice, [WEATHER, ADD])


def test_named_choice_and_parallel_calls(server):
    out = post(server, chat([WEATHER, ADD], tool_choice={
        "type": "function", "function": {"name": "add"}}, n=3, max_tokens=300))
    for choice in out["choices"]:
        if choice["finish_reason"] == "length":  # Parallel calls may run past max_tokens.
            continue
        calls = choice["message"]["tool_calls"]
        assert {c["function"]["name"] for c in calls} == {"add"}
        check_reply(choice, [ADD])
        assert len({c["id"] for c in calls}) == len(calls)


def test_auto_gives_text_or_valid_calls(server):
    out = post(server, chat([WEATHER, ADD], n=6, max_tokens=120))
    for choice in out["choices"]:
        msg = choice["message"]
        for c in msg.get("tool_calls") or []:
            check_call(c, [WEATHER, ADD])
        assert "<tool_call>" not in (msg["content"] or "") or choice["finish_reason"] == "length"
    none = post(server, chat([WEATHER], tool_choice="none", max_tokens=20))
    assert "tool_calls" not in none["choices"][0]["message"]


def test_fallback_prompt_describes_the_tools_and_history():
    engine = tool_engine()
    from jaxlearn.serve.completions import Group
    from jaxlearn.serve.protocol import parse_chat

    body = {"messages": [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}], "tools": [ADD]}
    parsed = parse_chat(body, vocab_size=320, max_seq_len=2048)
    text = engine.tokenizer.decode(Group(engine, parsed).prompt_ids[0])
    assert text.startswith("<|system|>\n# Tools") and '"name": "add"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<|user|>\n<tool_response>\n5\n</tool_response>" in text


def test_native_template_renders_tools_turns_and_reasoning():
    engine = tool_engine(QWEN_STYLE)
    from jaxlearn.serve.completions import Group
    from jaxlearn.serve.protocol import parse_chat

    def prompt(body):
        parsed = parse_chat(body, vocab_size=320, max_seq_len=2048)
        return engine.tokenizer.decode(Group(engine, parsed).prompt_ids[0])

    turns = [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": "", "reasoning_content": "easy",
         "tool_calls": [{"id": "c", "type": "function",
                         "function": {"name": "add", "arguments": "{\"a\":2,\"b\":3}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "5"},
    ]
    text = prompt({"messages": turns, "tools": [ADD]})
    assert "# Tools\n<tools>\n" in text and json.dumps(ADD["function"]["name"]) in text
    assert '{"name": "add", "arguments": {"a": 2, "b": 3}}' in text
    assert "<think>\neasy\n</think>" in text, "reasoning after the last user turn is kept"
    later = prompt({"messages": [*turns, {"role": "assistant", "content": "5"},
                                 {"role": "user", "content": "thanks"}]})
    assert "easy" not in later, "the template drops reasoning before the last user turn"
    off = prompt({"messages": turns[:1], "chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_is_separated_when_the_prompt_opens_it():
    from jaxlearn.serve.completions import Group
    from jaxlearn.serve.protocol import parse_chat

    engine = tool_engine(QWEN_STYLE)
    body = {"messages": [{"role": "user", "content": "think"}], "max_tokens": 24, "seed": 2,
            "temperature": 1.0, "chat_template_kwargs": {"open_thinking": True}}
    ids = Group(engine, parse_chat(body, vocab_size=320, max_seq_len=2048)).prompt_ids[0]
    srv = InferenceServer(engine, port=0).start()
    try:
        out = post(srv, body)["choices"][0]["message"]
        msg, _ = streamed(srv, body)
        status, raw, _ = call(srv, "POST", "/v1/completions", {
            "prompt": ids, "max_tokens": 24, "seed": 2, "temperature": 1.0})
    finally:
        srv.shutdown()
    text = json.loads(raw)["choices"][0]["text"]
    assert out["reasoning_content"], "the prompt opened <think>: the reply starts in it"
    assert text in (out["reasoning_content"] + "</think>" + (out["content"] or ""),
                    out["reasoning_content"] + (out["content"] or "")), "same tokens, split"
    assert msg["reasoning_content"] == out["reasoning_content"]
    assert (msg["content"] or "") == (out["content"] or "")


@pytest.mark.parametrize("body, param", [
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [ADD, ADD]}, "tools"),
    ({"tools": [ADD], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}},
     "tool_choice"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [tool("f", {"type": "nonsense"})], "tool_choice": "required"}, "tools"),
    ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, body, param):
    full = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    status, out, _ = call(server, "POST", "/v1/chat/completions", full)
    assert status == 400, out
    assert json.loads(out)["error"]["param"] == param
