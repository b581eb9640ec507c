"""A chat request's conversation: its messages, tools and template variables, checked, and
turned into what the chat template renders (no I/O here).

Messages (OpenAI chat; the Responses and Messages APIs convert to these):

    {"role": "system" | "developer" | "user", "content": str | [text parts]}
    {"role": "assistant", "content": str | null, "tool_calls"?: [{"id", "type": "function",
        "function": {"name", "arguments": JSON text}}], "reasoning_content"?: str}
    {"role": "tool", "tool_call_id": str, "content": str | [text parts]}

`template_inputs` gives the template the messages as transformers does: `tool_calls` with
`arguments` parsed into objects, `tools` (and `chat_template_kwargs` such as
`enable_thinking`) as template variables. A template that does not read `tools` gets the
fallback instead (`tools.fallback_system_prompt` in the system message, past calls written
in the HERMES format, tool results as user turns in `<tool_response>` tags). A past
assistant turn's `reasoning_content` reaches the template, which decides what to keep
(Qwen3's keeps it only after the last user turn).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from jaxlearn.inference.errors import RequestError
from jaxlearn.serve.tools import Function, ToolFormat, call_text, fallback_system_prompt

MAX_MESSAGES = 256
ROLES = ("system", "user", "assistant", "developer", "tool")
_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")

Message = dict[str, Any]


def _err(param: str, message: str) -> RequestError:
    return RequestError(f"'{param}': {message}", param=param)


def text_content(v: Any, where: str, *, part_types: tuple[str, ...] = ("text",)) -> str:
    """A string, or a list of text parts [{"type": "text", "text": str}] joined."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for i, part in enumerate(v):
            if not (isinstance(part, dict) and part.get("type") in part_types
                    and isinstance(part.get("text"), str)
                    and set(part) <= {"type", "text", "annotations"}):
                raise _err(f"{where}[{i}]", "content parts must be {\"type\": "
                                            f"\"{part_types[0]}\", \"text\": str}} "
                                            "(no images or files)")
            parts.append(part["text"])
        return "".join(parts)
    raise _err(where, "content must be a string or a list of text parts")


def _tool_calls(v: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(v, list):
        raise _err(where, "must be a list of tool calls")
    out = []
    for j, call in enumerate(v):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and call.get("type", "function") == "function"
                and isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise _err(at, "must be {\"id\", \"type\": \"function\", \"function\": "
                           "{\"name\", \"arguments\"}}")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise _err(f"{at}.function.arguments", "must be a JSON string")
        try:
            json.loads(args)
        except ValueError:
            raise _err(f"{at}.function.arguments", "is not valid JSON") from None
        cid = call.get("id", f"call_{j}")
        if not isinstance(cid, str):
            raise _err(f"{at}.id", "must be a string")
        out.append({"id": cid, "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def parse_messages(v: Any, where: str = "messages") -> list[Message]:
    """The `messages` of a chat request, checked (RequestError naming messages[i].field)."""
    if not isinstance(v, list) or not v:
        raise _err(where, "must be a non-empty list of {role, content} objects")
    if len(v) > MAX_MESSAGES:
        raise _err(where, f"at most {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(v):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise _err(at, "must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise _err(f"{at}.role", f"must be one of {list(ROLES)}")
        allowed = {"role", "content", "name"}
        allowed |= {"tool_calls", "reasoning_content"} if role == "assistant" else set()
        allowed |= {"tool_call_id"} if role == "tool" else set()
        extra = sorted(set(m) - allowed)
        if extra:
            raise _err(f"{at}.{extra[0]}", f"unknown field for role {role!r}")
        msg: Message = {"role": role}
        for key in ("name", "reasoning_content", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise _err(f"{at}.{key}", "must be a string")
                msg[key] = m[key]
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{at}.tool_calls")
        if m.get("content") is None and "tool_calls" in msg:
            msg["content"] = ""
        else:
            msg["content"] = text_content(m.get("content"), f"{at}.content")
        if role == "tool" and "tool_call_id" not in msg:
            raise _err(f"{at}.tool_call_id", "a tool message needs the id of its call")
        out.append(msg)
    return out


def parse_template_kwargs(v: Any, where: str = "chat_template_kwargs") -> dict[str, Any]:
    """Extra chat template variables ({"enable_thinking": false}, ...)."""
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise _err(where, "must be an object of template variables")
    bad = sorted(set(v) & set(_RESERVED))
    if bad:
        raise _err(f"{where}.{bad[0]}", "is set by the server")
    return dict(v)


def _for_template(m: Message) -> Message:
    out = dict(m)
    if "tool_calls" in m:
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
            "name": c["function"]["name"],
            "arguments": json.loads(c["function"]["arguments"])}} for c in m["tool_calls"]]
    return out


def _fallback(messages: Sequence[Message], functions: Sequence[Function],
              fmt: ToolFormat) -> list[Message]:
    """The conversation for a template that does not render tools (module doc)."""
    out: list[Message] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(fmt, c["function"]["name"], c["function"]["arguments"])
                              for c in m["tool_calls"])
            text = f"{m['content']}\n{calls}" if m["content"] else calls
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if functions:
        prompt = fallback_system_prompt(functions)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{prompt}")
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_inputs(messages: Sequence[Message], functions: Sequence[Function],
                    kwargs: Mapping[str, Any], *, fmt: ToolFormat, native: bool,
                    ) -> tuple[list[Message], dict[str, Any]]:
    """(messages, template variables) to render: see the module doc. `native`: the
    template renders `tools` and tool turns itself."""
    context = dict(kwargs)
    if native:
        if functions:
            context["tools"] = [f.tool() for f in functions]
        return [_for_template(m) for m in messages], context
    return _fallback(messages, functions, fmt), context


__all__ = ["MAX_MESSAGES", "Message", "ROLES", "parse_messages", "parse_template_kwargs",
           "template_inputs", "text_content"]
