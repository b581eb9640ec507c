"""OpenAI `/v1/responses`, stateless, on the chat request path (no I/O here).

    parsed = parse_responses(body, vocab_size=..., max_seq_len=...)   # -> ParsedRequest
    ResponsesStream(parsed, model).open() / .on(events) / .close(...)  # SSE frames
    response_object(...)                                              # the whole response

A request is rewritten into a chat completions body: `instructions` becomes the system
message; `input` (a string, or items: messages with `input_text` / `output_text` parts,
`function_call`, `function_call_output`, `reasoning`) becomes the conversation, calls and
their outputs as assistant `tool_calls` and `tool` messages; `tools` (`{"type":
"function", "name", "parameters", ...}`), `tool_choice` (`{"type": "function", "name"}`),
`text.format` (the json_schema fields inline) and `max_output_tokens` map to their chat
fields. Nothing is stored: `previous_response_id`, a non-empty `include` and built-in
tools are refused with a 400 naming the field; `store` is accepted and answered false.
`reasoning`, `metadata`, `service_tier`, `prompt_cache_key`, `safety_identifier` and
`user` are accepted and do not change the output (a template's reasoning is switched by
its own variables, which this API has no field for).

The output is a list of items in the order they were written: `reasoning` (its text as
`reasoning_text` content), `message` (one `output_text` part), `function_call` (`call_id`,
`name`, `arguments`). Streaming sends the API's typed events (`response.created`,
`response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`), each with a
`sequence_number`.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from jaxlearn.serve.api_common import Block, Blocks, api_error, new_id, parse_as_chat
from jaxlearn.serve.assistant_output import Event
from jaxlearn.serve.chat_messages import text_content
from jaxlearn.serve.protocol import ParsedRequest

FIELDS = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "max_output_tokens", "temperature", "top_p", "stream", "store", "metadata", "user",
    "truncation", "include", "reasoning", "previous_response_id", "service_tier",
    "prompt_cache_key", "safety_identifier",
}  # fmt: skip
_NAMES = {
    r"max_tokens": "max_output_tokens",
    r"response_format\.json_schema\.schema": "text.format.schema",
    r"response_format\.json_schema": "text.format",
    r"response_format": "text.format",
    r"tools\[(\d+)\]\.function": r"tools[\1]",
    r"messages": "input",
}


def _input_items(value: Any) -> list[dict[str, Any]]:
    """`input` -> chat messages (calls grouped into the assistant turn they follow)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise api_error("input", "must be a string or a non-empty list of items")
    out: list[dict[str, Any]] = []
    reasoning = ""
    for i, item in enumerate(value):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise api_error(at, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise api_error(f"{at}.role", "must be user, system, developer or assistant")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = text_content(item.get("content"), f"{at}.content",
                                part_types=(*kinds, "text"))
            msg: dict[str, Any] = {"role": role, "content": text}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, ""
            out.append(msg)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise api_error(f"{at}.{key}", "must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    msg["reasoning_content"], reasoning = reasoning, ""
                out.append(msg)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise api_error(f"{at}.call_id", "must be a string")
            text = output if isinstance(output, str) else text_content(
                output, f"{at}.output", part_types=("input_text", "output_text", "text"))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            pieces = [*(item.get("content") or []), *(item.get("summary") or [])]
            reasoning += "".join(str(p.get("text", "")) for p in pieces if isinstance(p, dict))
        else:
            raise api_error(f"{at}.type", f"{kind!r} items are not supported (message, "
                                          "function_call, function_call_output, reasoning)")
    return out


def _tools(value: Any) -> Optional[list[dict[str, Any]]]:
    if value is None:
        return None
    if not isinstance(value, list):
        raise api_error("tools", "must be a list of function tools")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise api_error(f"tools[{i}].type", f"only function tools are supported, got {kind!r}")
        fn = {k: v for k, v in t.items() if k != "type"}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function" and "name" in value:
        return {"type": "function", "function": {"name": value["name"]}}
    if isinstance(value, dict):
        raise api_error("tool_choice", "must be none, auto, required or "
                                       "{\"type\": \"function\", \"name\"}")
    return value


def _format(text: Any) -> Optional[dict[str, Any]]:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise api_error("text", "only {\"format\": {...}} is supported")
    fmt = text.get("format")
    if fmt is None or not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    spec = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}


def parse_responses(body: Any, *, vocab_size: int, max_seq_len: int) -> ParsedRequest:
    """A Responses API body -> ParsedRequest (RequestError naming the Responses field)."""
    if not isinstance(body, dict):
        raise api_error("body", "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise api_error(unknown[0], f"unknown field (supported: {', '.join(sorted(FIELDS))})")
    if body.get("previous_response_id") is not None:
        raise api_error("previous_response_id", "this server stores no responses: send the "
                                                "whole conversation in input")
    if body.get("truncation") not in (None, "disabled"):
        raise api_error("truncation", "only \"disabled\" is supported")
    if body.get("include"):
        raise api_error("include", "no extra output data is available (send [] or omit it)")
    if body.get("store") not in (None, True, False):
        raise api_error("store", "must be true or false")
    messages = _input_items(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise api_error("instructions", "must be a string")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {"messages": messages}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("stream", "stream"), ("user", "user"),
                     ("model", "model"), ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return parse_as_chat(chat, _NAMES, vocab_size=vocab_size, max_seq_len=max_seq_len)


# ---- output -------------------------------------------------------------------------------


def _item(block: Block, item_id: str, status: str) -> dict[str, Any]:
    if block.kind == "call":
        return {"type": "function_call", "id": item_id, "call_id": block.id,
                "name": block.name, "arguments": block.text, "status": status}
    if block.kind == "reasoning":
        return {"type": "reasoning", "id": item_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": block.text}]}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": block.text, "annotations": [],
                         "logprobs": []}]}


def response_object(rid: str, body_echo: dict[str, Any], blocks: list[Block],
                    ids: list[str], status: str, finish: Optional[str],
                    use: Optional[dict[str, int]]) -> dict[str, Any]:
    """The Response (status "in_progress" while streaming, then "completed" or
    "incomplete" when cut at max_output_tokens)."""
    usage = None if use is None else {
        "input_tokens": use["prompt_tokens"], "output_tokens": use["completion_tokens"],
        "total_tokens": use["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0}}
    incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status,
            "error": None, "incomplete_details": incomplete,
            "output": [_item(b, i, "completed" if status != "in_progress" else "in_progress")
                       for b, i in zip(blocks, ids)],
            "usage": usage, "store": False, "previous_response_id": None, "metadata": {},
            "truncation": "disabled", **body_echo}


def body_echo(parsed: ParsedRequest, body: dict[str, Any], model: str) -> dict[str, Any]:
    """The request settings a Response repeats."""
    return {"model": model, "instructions": body.get("instructions"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": parsed.parallel_tool_calls,
            "temperature": parsed.temperature, "top_p": parsed.top_p,
            "max_output_tokens": body.get("max_output_tokens"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None}}


class ResponsesStream:
    """The streamed events of one reply (module doc), as (event name, data) pairs."""

    def __init__(self, rid: str, echo: dict[str, Any]):
        self.rid, self.echo = rid, echo
        self.blocks = Blocks()
        self.ids: list[str] = []
        self.seq = 0

    def _ev(self, kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq - 1, **data}

    def open(self) -> list[tuple[str, dict[str, Any]]]:
        snap = response_object(self.rid, self.echo, [], [], "in_progress", None, None)
        return [self._ev("response.created", response=snap),
                self._ev("response.in_progress", response=snap)]

    def _close_block(self, n: int) -> list[tuple[str, dict[str, Any]]]:
        b, item_id = self.blocks.items[n], self.ids[n]
        item = _item(b, item_id, "completed")
        ref = dict(item_id=item_id, output_index=n)
        if b.kind == "call":
            evs = [self._ev("response.function_call_arguments.done", **ref, arguments=b.text)]
        elif b.kind == "reasoning":
            evs = [self._ev("response.reasoning_text.done", **ref, content_index=0, text=b.text)]
        else:
            part = item["content"][0]
            evs = [self._ev("response.output_text.done", **ref, content_index=0, text=b.text,
                            logprobs=[]),
                   self._ev("response.content_part.done", **ref, content_index=0, part=part)]
        return evs + [self._ev("response.output_item.done", output_index=n, item=item)]

    def on(self, events: list[Event]) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for n, block, piece, new in self.blocks.add(events):
            if new:
                if n > 0:
                    out += self._close_block(n - 1)
                self.ids += item_ids([block])
                fresh = Block(block.kind, id=block.id, name=block.name)
                item = _item(fresh, self.ids[n], "in_progress")
                out.append(self._ev("response.output_item.added", output_index=n, item=item))
                if block.kind == "text":
                    out.append(self._ev("response.content_part.added", item_id=self.ids[n],
                                        output_index=n, content_index=0,
                                        part=item["content"][0]))
            if not piece:
                continue
            ref = dict(item_id=self.ids[n], output_index=n)
            if block.kind == "call":
                out.append(self._ev("response.function_call_arguments.delta", **ref,
                                    delta=piece))
            elif block.kind == "reasoning":
                out.append(self._ev("response.reasoning_text.delta", **ref, content_index=0,
                                    delta=piece))
            else:
                out.append(self._ev("response.output_text.delta", **ref, content_index=0,
                                    delta=piece, logprobs=[]))
        return out

    def close(self, finish: Optional[str], use: dict[str, int]
              ) -> list[tuple[str, dict[str, Any]]]:
        out = self._close_block(len(self.ids) - 1) if self.ids else []
        status = "incomplete" if finish == "length" else "completed"
        final = response_object(self.rid, self.echo, self.blocks.items, self.ids, status,
                                finish, use)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + [self._ev(kind, response=final)]


def item_ids(blocks: list[Block]) -> list[str]:
    """Fresh output item ids for a whole reply's blocks."""
    return [new_id({"call": "fc", "reasoning": "rs"}.get(b.kind, "msg")) for b in blocks]


__all__ = ["FIELDS", "ResponsesStream", "body_echo", "item_ids", "parse_responses",
           "response_object"]

