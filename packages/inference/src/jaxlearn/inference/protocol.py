"""OpenAI-compatible request parsing and response bodies (no I/O here).

`parse_completion(body)` / `parse_chat(body)` turn a decoded JSON object into a
`ParsedRequest`, or raise `RequestError` (HTTP 400) naming the field. Unknown fields are
errors, as are values outside these ranges:

    temperature [0, 2]; top_p (0, 1]; top_k -1 or 0 (off) or 1..vocab;
    repetition_penalty (0, 10]; max_tokens >= 1 (and prompt + max_tokens <= max_seq_len,
    checked by the server); seed any 64-bit integer; n / best_of 1; stop: a string or up
    to 16 strings of 1..256 characters; stop_token_ids: up to 16 ids.

Fields accepted only at their neutral value (the feature is not implemented): n, best_of,
echo, logprobs, top_logprobs, suffix, logit_bias, presence_penalty, frequency_penalty.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any, Mapping, Optional, Union

from jaxlearn.inference.errors import RequestError

MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_MESSAGES = 256

_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
    "stop", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
    "user", "ignore_eos", "stop_token_ids", "logit_bias", "best_of",
}  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclasses.dataclass
class ParsedRequest:
    """A validated request. prompt: text or token ids (completions); messages (chat)."""

    kind: str  # "completion" | "chat"
    model: Optional[str]
    prompt: Union[str, list[int], None]
    messages: Optional[list[dict[str, str]]]
    max_tokens: Optional[int]
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: Optional[int]
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool


def _err(param: str, message: str) -> RequestError:
    return RequestError(f"'{param}': {message}", param=param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float,
            *, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _err(name, f"must be a number, got {type(v).__name__}")
    x = float(v)
    if not math.isfinite(x) or x < lo or x > hi or (lo_open and x <= lo):
        rng = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise _err(name, f"{v!r} is outside {rng}")
    return x


def _integer(body: Mapping[str, Any], name: str, lo: int, hi: int) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
        v = int(v)
    if not _is_int(v):
        raise _err(name, f"must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise _err(name, f"{v} is outside [{lo}, {hi}]")
    return int(v)


def _flag(body: Mapping[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _err(name, f"must be true or false, got {type(v).__name__}")
    return v


def _neutral(body: Mapping[str, Any], name: str, ok: tuple[Any, ...]) -> None:
    v = body.get(name)
    if v is None or any(type(v) is type(o) and v == o for o in ok):
        return
    raise _err(name, f"only {' / '.join(map(repr, ok))} is supported, got {v!r}")


def _token_ids(v: Any, name: str, vocab_size: int, max_len: int) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise _err(name, "must be a list of integer token ids")
    if len(v) > max_len:
        raise _err(name, f"has {len(v)} ids; at most {max_len}")
    bad = [t for t in v if not 0 <= t < vocab_size]
    if bad:
        raise _err(name, f"token id {bad[0]} is outside [0, {vocab_size})")
    return list(v)


def _stop(body: Mapping[str, Any], vocab_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    v = body.get("stop")
    if v is None:
        strings: list[Any] = []
    elif isinstance(v, str):
        strings = [v]
    elif isinstance(v, list):
        strings = v
    else:
        raise _err("stop", "must be a string or a list of strings")
    if len(strings) > MAX_STOP:
        raise _err("stop", f"at most {MAX_STOP} stop strings")
    for s in strings:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LEN:
            raise _err("stop", f"stop strings must be strings of 1..{MAX_STOP_LEN} characters")
    ids = body.get("stop_token_ids")
    stop_ids = [] if ids is None else _token_ids(ids, "stop_token_ids", vocab_size, MAX_STOP)
    return tuple(strings), tuple(stop_ids)


def _content(v: Any, where: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # [{"type": "text", "text": "..."}]
        parts = []
        for part in v:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}):
                raise _err(where, "content parts must be {\"type\": \"text\", \"text\": str}")
            parts.append(part["text"])
        return "".join(parts)
    raise _err(where, "content must be a string or a list of text parts")


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    v = body.get("messages")
    if not isinstance(v, list) or not v:
        raise _err("messages", "must be a non-empty list of {role, content} objects")
    if len(v) > MAX_MESSAGES:
        raise _err("messages", f"at most {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _err(where, "must be an object")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise _err(where, f"unknown field(s) {sorted(extra)}")
        if m.get("role") not in ROLES:
            raise _err(where, f"role must be one of {list(ROLES)}")
        if "name" in m and not isinstance(m["name"], str):
            raise _err(where, "name must be a string")
        out.append({"role": str(m["role"]), "content": _content(m.get("content"), where)})
    return out


def _parse(body: Any, kind: str, fields: set[str], vocab_size: int, max_seq_len: int
           ) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise _err(unknown[0], f"unknown field (supported: {', '.join(sorted(fields))})")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _err("model", "must be a string")
    for name, ok in (("n", (1,)), ("best_of", (1,)), ("echo", (False,)),
                     ("logprobs", (False, 0)), ("top_logprobs", (0,)), ("suffix", ("",)),
                     ("logit_bias", ({},)), ("presence_penalty", (0, 0.0)),
                     ("frequency_penalty", (0, 0.0))):
        _neutral(body, name, ok)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _err("user", "must be a string")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise _err("stream_options", "only {\"include_usage\": bool} is supported")
        include_usage = _flag(opts, "include_usage")
    top_k = _integer(body, "top_k", -1, vocab_size)
    stop, stop_ids = _stop(body, vocab_size)
    return dict(
        kind=kind,
        model=model,
        max_tokens=_integer(body, "max_tokens", 1, max_seq_len),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k is None or top_k < 0 else top_k,
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        seed=_integer(body, "seed", -(2**63), 2**64 - 1),
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=_flag(body, "ignore_eos"),
        stream=_flag(body, "stream"),
        include_usage=include_usage,
    )


def parse_completion(body: Any, *, vocab_size: int, max_seq_len: int) -> ParsedRequest:
    """`/v1/completions` body -> ParsedRequest (prompt: one string or one id list)."""
    f = _parse(body, "completion", COMPLETION_FIELDS, vocab_size, max_seq_len)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # A batch of one.
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise _err("prompt", "batches of prompts are not supported; send one prompt")
    if isinstance(p, str):
        prompt: Union[str, list[int]] = p
    elif isinstance(p, list):
        prompt = _token_ids(p, "prompt", vocab_size, max_seq_len)
    else:
        raise _err("prompt", "must be a string or a list of token ids")
    if not prompt:
        raise _err("prompt", "is empty")
    if f["max_tokens"] is None:
        f["max_tokens"] = 16
    return ParsedRequest(prompt=prompt, messages=None, **f)


def parse_chat(body: Any, *, vocab_size: int, max_seq_len: int) -> ParsedRequest:
    """`/v1/chat/completions` body -> ParsedRequest (messages; max_tokens may be None)."""
    f = _parse(body, "chat", CHAT_FIELDS, vocab_size, max_seq_len)
    messages = _messages(body)
    mct = _integer(body, "max_completion_tokens", 1, max_seq_len)
    if mct is not None:
        f["max_tokens"] = mct if f["max_tokens"] is None else min(mct, f["max_tokens"])
    return ParsedRequest(prompt=None, messages=messages, **f)


# ---- response bodies ----------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _finish(reason: Optional[str]) -> Optional[str]:
    # OpenAI reasons are "stop" / "length"; a cancelled / failed request reports "abort".
    return reason if reason in (None, "stop", "length") else "abort"


def response(kind: str, rid: str, model: str, text: str, finish: Optional[str],
             use: dict[str, int]) -> dict[str, Any]:
    """The non-streaming response object."""
    created = int(time.time())
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": _finish(finish),
            "logprobs": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": _finish(finish), "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model,
            "choices": [choice], "usage": use}


def chunk(kind: str, rid: str, model: str, text: Optional[str], finish: Optional[str],
          *, role: bool = False, use: Optional[dict[str, int]] = None) -> dict[str, Any]:
    """One streaming chunk (text None and use set: the final usage-only chunk)."""
    created = int(time.time())
    choices: list[dict[str, Any]]
    if text is None and use is not None:
        choices = []
    elif kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": _finish(finish),
                    "logprobs": None}]
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": _finish(finish),
                    "logprobs": None}]
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if use is not None:
        out["usage"] = use
    return out


def error_body(status: int, message: str, param: Optional[str] = None) -> dict[str, Any]:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
             408: "timeout_error", 411: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_error", 503: "service_unavailable"}
    return {"error": {"message": message, "type": kinds.get(status, "server_error"),
                      "param": param, "code": status}}
