"""Anthropic `/v1/messages` on the chat request path (no I/O here).

    parsed = parse_messages_request(body, vocab_size=..., max_seq_len=...)
    message_object(...)                   # the whole reply
    MessagesStream(...).open() / .on(events) / .close(...)   # (event, data) SSE pairs

A request is rewritten into a chat completions body: `system` (text or text blocks) is the
system message; each message's content blocks become chat messages: `text` joins into the
turn's content, an assistant's `tool_use` blocks become its `tool_calls` (`input` as the
arguments), its `thinking` blocks its `reasoning_content`, a user's `tool_result` blocks
become `tool` messages ahead of the turn's text. `tools` (`{"name", "description",
"input_schema"}`), `tool_choice` (`auto` / `any` / `tool` + name / `none`, and
`disable_parallel_tool_use`), `stop_sequences`, `max_tokens` (required), `temperature`,
`top_p`, `top_k` map to their chat fields; `thinking: {"type": "enabled" | "disabled"}`
sets the template variable `enable_thinking`. Images and documents are refused naming the
block.

The reply's content blocks are in the order written: `thinking` (signature ""), `text`,
`tool_use` (`id` "toolu_...", `input` the parsed arguments). `stop_reason`: `end_turn`,
`max_tokens`, `stop_sequence` (with `stop_sequence`), `tool_use`. Streaming sends
`message_start`, `content_block_start` / `_delta` (`text_delta`, `thinking_delta`,
`input_json_delta`) / `_stop`, `message_delta` and `message_stop`. Errors have the API's
shape: {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from jaxlearn.serve.api_common import Block, Blocks, api_error, new_id, parse_as_chat
from jaxlearn.serve.assistant_output import Event
from jaxlearn.serve.protocol import ParsedRequest

FIELDS = {"model", "messages", "system", "max_tokens", "stop_sequences", "stream",
          "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata", "thinking",
          "service_tier"}
_NAMES = {
    r"tools\[(\d+)\]\.function\.parameters": r"tools[\1].input_schema",
    r"tools\[(\d+)\]\.function": r"tools[\1]",
    r"stop": "stop_sequences",
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def error_shape(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def _text(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise api_error(where, "must be a string or a list of content blocks")
    out = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise api_error(f"{where}[{i}]", "must be a text block {\"type\": \"text\", \"text\"}")
        out.append(b["text"])
    return "".join(out)


def _turn(m: Any, i: int) -> list[dict[str, Any]]:
    """One Messages API message -> chat messages."""
    at = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise api_error(f"{at}.role", "must be user or assistant")
    extra = sorted(set(m) - {"role", "content"})
    if extra:
        raise api_error(f"{at}.{extra[0]}", "unknown field")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise api_error(f"{at}.content", "must be a string or a list of content blocks")
    text, thinking, calls, results = [], [], [], []
    for j, b in enumerate(content):
        where = f"{at}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str)
                    and isinstance(b.get("input"), dict)):
                raise api_error(where, "a tool_use block needs id, name and an input object")
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b["input"])}})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            thinking.append(str(b.get("thinking", "")))
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise api_error(f"{where}.tool_use_id", "must be a string")
            body = _text(b.get("content", ""), f"{where}.content")
            if b.get("is_error"):
                body = f"Error: {body}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": body})
        else:
            raise api_error(where, f"{kind!r} blocks are not supported in a {role} message "
                                   "(text, tool_use / thinking from the assistant, "
                                   "tool_result from the user)")
    out = list(results)
    if role == "assistant":
        msg: dict[str, Any] = {"role": role, "content": "".join(text) or (None if calls else "")}
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        out.append(msg)
    elif text or not results:
        out.append({"role": role, "content": "".join(text)})
    return out


def _tool_choice(value: Any) -> tuple[Any, Optional[bool]]:
    """(the chat tool_choice, parallel_tool_calls)."""
    if value is None:
        return None, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise api_error("tool_choice", "must be {\"type\": \"auto\" | \"any\" | \"tool\" | "
                                       "\"none\"}")
    parallel = value.get("disable_parallel_tool_use")
    parallel = None if parallel is None else not parallel
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise api_error("tool_choice.name", "names the tool to use")
        return {"type": "function", "function": {"name": value["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def parse_messages_request(body: Any, *, vocab_size: int, max_seq_len: int
                           ) -> ParsedRequest:
    """A Messages API body -> ParsedRequest (RequestError naming the Messages field)."""
    if not isinstance(body, dict):
        raise api_error("body", "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise api_error(unknown[0], f"unknown field (supported: {', '.join(sorted(FIELDS))})")
    if not isinstance(body.get("max_tokens"), int) or isinstance(body["max_tokens"], bool):
        raise api_error("max_tokens", "is required: an integer >= 1")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise api_error("messages", "must be a non-empty list of {role, content}")
    messages = [chat for i, m in enumerate(msgs) for chat in _turn(m, i)]
    if body.get("system") is not None:
        messages.insert(0, {"role": "system", "content": _text(body["system"], "system")})
    chat: dict[str, Any] = {"messages": messages, "max_tokens": body["max_tokens"]}
    for key in ("temperature", "top_p", "top_k", "stream", "model"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise api_error("tools", "must be a list of {name, description, input_schema}")
        chat["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or set(t) - {"name", "description", "input_schema",
                                                   "type", "cache_control"}:
                raise api_error(f"tools[{i}]", "a tool is {name, description, input_schema}")
            if t.get("type") not in (None, "custom"):
                raise api_error(f"tools[{i}].type", "only custom (client) tools are supported")
            fn = {"name": t.get("name"), "parameters": t.get("input_schema")}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            chat["tools"].append({"type": "function", "function": fn})
    choice, parallel = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled"):
            raise api_error("thinking.type", "must be \"enabled\" or \"disabled\"")
        chat["chat_template_kwargs"] = {"enable_thinking": kind == "enabled"}
    return parse_as_chat(chat, _NAMES, vocab_size=vocab_size, max_seq_len=max_seq_len)


# ---- output -------------------------------------------------------------------------------


def _block(b: Block, tool_id: str) -> dict[str, Any]:
    if b.kind == "call":
        try:
            args = json.loads(b.text) if b.text else {}
        except ValueError:
            args = {}
        return {"type": "tool_use", "id": tool_id, "name": b.name, "input": args}
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text, "signature": ""}
    return {"type": "text", "text": b.text}


def stop_reason(finish: Optional[str], stop: Any, has_calls: bool
                ) -> tuple[Optional[str], Optional[str]]:
    """(stop_reason, stop_sequence) of an engine finish and the request's stop reason."""
    if finish == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("end_turn" if finish is not None else None), None


def usage(use: dict[str, int]) -> dict[str, int]:
    return {"input_tokens": use["prompt_tokens"], "output_tokens": use["completion_tokens"]}


def message_object(mid: str, model: str, blocks: list[Block], finish: Optional[str],
                   stop: Any, use: dict[str, int]) -> dict[str, Any]:
    reason, seq = stop_reason(finish, stop, any(b.kind == "call" for b in blocks))
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": [_block(b, tool_id(b)) for b in blocks],
            "stop_reason": reason, "stop_sequence": seq, "usage": usage(use)}


def tool_id(b: Block) -> str:
    """The tool_use id of a call block (its call id, in Anthropic's prefix)."""
    return "toolu_" + b.id.removeprefix("call_")


class MessagesStream:
    """The streamed events of one reply (module doc), as (event name, data) pairs."""

    def __init__(self, mid: str, model: str, prompt_tokens: int):
        self.mid, self.model, self.prompt_tokens = mid, model, prompt_tokens
        self.blocks = Blocks()

    def open(self) -> list[tuple[str, dict[str, Any]]]:
        msg: dict[str, Any] = {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": msg})]

    def on(self, events: list[Event]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for n, block, piece, new in self.blocks.add(events):
            if new:
                if n > 0:
                    out.append(("content_block_stop", {"type": "content_block_stop",
                                                       "index": n - 1}))
                start = _block(Block(block.kind, id=block.id, name=block.name), tool_id(block))
                out.append(("content_block_start", {"type": "content_block_start",
                                                    "index": n, "content_block": start}))
            if not piece:
                continue
            delta = ({"type": "input_json_delta", "partial_json": piece} if block.kind == "call"
                     else {"type": "thinking_delta", "thinking": piece}
                     if block.kind == "reasoning" else {"type": "text_delta", "text": piece})
            out.append(("content_block_delta", {"type": "content_block_delta", "index": n,
                                                "delta": delta}))
        return out

    def close(self, finish: Optional[str], stop: Any, use: dict[str, int]
              ) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if self.blocks.items:
            out.append(("content_block_stop", {"type": "content_block_stop",
                                               "index": len(self.blocks.items) - 1}))
        reason, seq = stop_reason(finish, stop, any(b.kind == "call" for b in self.blocks.items))
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": reason, "stop_sequence": seq},
                                      "usage": {"output_tokens": use["completion_tokens"]}}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out


__all__ = ["FIELDS", "MessagesStream", "error_shape", "message_object", "new_id",
           "parse_messages_request"]
