"""OpenAI-compatible request parsing and response bodies (no I/O here).

`parse_completion(body)` / `parse_chat(body)` turn a decoded JSON object into a
`ParsedRequest`, or raise `RequestError` (HTTP 400) naming the field. Unknown fields are
errors, as are values outside these ranges:

    temperature [0, 2]; top_p (0, 1]; top_k -1 or 0 (off) or 1..vocab;
    repetition_penalty (0, 10]; presence_penalty / frequency_penalty [-2, 2];
    max_tokens >= 0 for completions, >= 1 for chat (and prompt + max_tokens <=
    max_seq_len, checked by the server); seed any 64-bit integer; n 1..16; best_of
    n..16 (not with stream unless equal to n); logprobs 0..20 (completions; chat:
    true/false with top_logprobs 0..20); logit_bias up to 300 {"token id": bias in
    [-100, 100]}; stop: a string or up to 16 strings of 1..256 characters;
    stop_token_ids: up to 16 ids; response_format {"type": "text" | "json_object" |
    "json_schema", "json_schema": {name, schema, strict, description}} (`decoding.grammar`;
    not with ignore_eos); prompt (completions): a string, a list of token ids,
    or a list of up to 64 strings / id lists (prompts x best_of <= 256 choices).

`suffix` is accepted only as "" (not implemented).
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any, Mapping, Optional, Union

from jaxlearn.decoding.grammar import response_format_grammar
from jaxlearn.decoding.logprobs import MAX_LOGPROBS
from jaxlearn.decoding.penalties import MAX_BIAS, MAX_LOGIT_BIAS, MAX_PRESENCE_FREQUENCY
from jaxlearn.inference.errors import RequestError
from jaxlearn.serve.chat_messages import Message, parse_messages, parse_template_kwargs
from jaxlearn.serve.tools import Function, ToolChoice, parse_tool_choice, parse_tools

MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_N = 16  # n and best_of.
MAX_PROMPTS = 64
MAX_CHOICES = 256  # prompts x best_of in one request.

_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
    "stop", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
    "user", "ignore_eos", "stop_token_ids", "logit_bias", "best_of", "response_format",
}  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                         "tool_choice", "parallel_tool_calls", "chat_template_kwargs"}


Prompt = Union[str, list[int]]


@dataclasses.dataclass
class ParsedRequest:
    """A validated request. prompts: texts or token id lists (completions, one choice
    group each); messages (chat). logprobs: None (off) or the top alternatives per token
    (chat: top_logprobs when logprobs is true)."""

    kind: str  # "completion" | "chat"
    model: Optional[str]
    prompts: list[Prompt]
    messages: Optional[list[Message]]
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
    n: int
    best_of: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    logprobs: Optional[int]
    echo: bool = False
    grammar: Optional[str] = None  # From response_format (`decoding.grammar`).
    # Chat: the tools offered, how they may be called, extra chat template variables.
    tools: tuple[Function, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The LoRA adapter the request's `model` names (None: the base model); the server sets it.
    adapter: Optional[str] = None


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


def _logit_bias(body: Mapping[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise _err("logit_bias", "must be an object mapping token ids to biases")
    if len(v) > MAX_LOGIT_BIAS:
        raise _err("logit_bias", f"has {len(v)} entries; at most {MAX_LOGIT_BIAS}")
    out = []
    for key, bias in v.items():
        try:
            tid = int(key)
        except ValueError:
            raise _err("logit_bias", f"key {key!r} is not a token id") from None
        if not 0 <= tid < vocab_size:
            raise _err("logit_bias", f"token id {tid} is outside [0, {vocab_size})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not (
                -MAX_BIAS <= float(bias) <= MAX_BIAS):
            raise _err("logit_bias", f"bias of token {tid} must be a number in "
                                     f"[-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias!r}")
        out.append((tid, float(bias)))
    return tuple(sorted(out))


def _n_best_of(body: Mapping[str, Any], stream: bool) -> tuple[int, int]:
    n = _integer(body, "n", 1, MAX_N) or 1
    best_of = _integer(body, "best_of", 1, MAX_N)
    if best_of is None:
        return n, n
    if best_of < n:
        raise _err("best_of", f"{best_of} is less than n={n}")
    if stream and best_of != n:
        raise _err("best_of", "best_of > n cannot be streamed (the best are known at the end)")
    return n, best_of


def _logprobs(body: Mapping[str, Any], kind: str) -> Optional[int]:
    if kind == "completion":
        v = body.get("logprobs")
        if v is False:
            return None
        if v is True:
            raise _err("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] for completions")
        return _integer(body, "logprobs", 0, MAX_LOGPROBS)
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not _flag(body, "logprobs"):
        if top is not None:
            raise _err("top_logprobs", "needs \"logprobs\": true")
        return None
    return top or 0


def _grammar(body: Mapping[str, Any]) -> Optional[str]:
    grammar = response_format_grammar(body.get("response_format"))
    if grammar is not None and _flag(body, "ignore_eos"):
        raise _err("ignore_eos", "cannot be combined with response_format (the output ends "
                                 "where the grammar does)")
    return grammar


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
    _neutral(body, "suffix", ("",))
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
    stream = _flag(body, "stream")
    n, best_of = _n_best_of(body, stream)
    pf = MAX_PRESENCE_FREQUENCY
    return dict(
        kind=kind,
        model=model,
        max_tokens=_integer(body, "max_tokens", 0 if kind == "completion" else 1, max_seq_len),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k is None or top_k < 0 else top_k,
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        seed=_integer(body, "seed", -(2**63), 2**64 - 1),
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=_flag(body, "ignore_eos"),
        stream=stream,
        include_usage=include_usage,
        n=n,
        best_of=best_of,
        presence_penalty=_number(body, "presence_penalty", 0.0, -pf, pf),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -pf, pf),
        logit_bias=_logit_bias(body, vocab_size),
        logprobs=_logprobs(body, kind),
        grammar=_grammar(body),
    )


def _prompts(body: Mapping[str, Any], vocab_size: int, max_seq_len: int) -> list[Prompt]:
    """One string, one id list, or a list of strings / id lists."""
    p = body.get("prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)):
        items: list[Any] = [p]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        items = p
    else:
        raise _err("prompt", "must be a string, a list of token ids, or a non-empty list of "
                             "strings / token id lists")
    if len(items) > MAX_PROMPTS:
        raise _err("prompt", f"has {len(items)} prompts; at most {MAX_PROMPTS}")
    out: list[Prompt] = []
    for i, x in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(x, list):
            x = _token_ids(x, "prompt", vocab_size, max_seq_len)
        if not x:
            raise RequestError(f"'{where}': is empty", param="prompt")
        out.append(x)
    return out


def parse_completion(body: Any, *, vocab_size: int, max_seq_len: int) -> ParsedRequest:
    """`/v1/completions` body -> ParsedRequest (prompts: one or more strings / id lists)."""
    f = _parse(body, "completion", COMPLETION_FIELDS, vocab_size, max_seq_len)
    prompts = _prompts(body, vocab_size, max_seq_len)
    if len(prompts) * f["best_of"] > MAX_CHOICES:
        raise _err("prompt", f"{len(prompts)} prompts x best_of {f['best_of']} is more than "
                             f"{MAX_CHOICES} completions")
    if f["max_tokens"] is None:
        f["max_tokens"] = 16
    return ParsedRequest(prompts=prompts, messages=None, echo=_flag(body, "echo"), **f)


def parse_chat(body: Any, *, vocab_size: int, max_seq_len: int) -> ParsedRequest:
    """`/v1/chat/completions` body -> ParsedRequest (messages; max_tokens may be None)."""
    f = _parse(body, "chat", CHAT_FIELDS, vocab_size, max_seq_len)
    messages = parse_messages(body.get("messages"))
    mct = _integer(body, "max_completion_tokens", 1, max_seq_len)
    if mct is not None:
        f["max_tokens"] = mct if f["max_tokens"] is None else min(mct, f["max_tokens"])
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    check_tools_with(f, choice, "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _err("parallel_tool_calls", "must be true or false")
    return ParsedRequest(prompts=[], messages=messages, tools=tools, tool_choice=choice,
                         parallel_tool_calls=parallel,
                         template_kwargs=parse_template_kwargs(body.get("chat_template_kwargs")),
                         **f)


def check_tools_with(fields: Mapping[str, Any], choice: ToolChoice, param: str) -> None:
    """Tool calls have their own grammar: not with a response_format or ignore_eos."""
    if choice.mode == "none":
        return
    if fields["grammar"] is not None:
        raise _err(param, f"{choice.mode!r} cannot be combined with a JSON response format; "
                          "set it to \"none\" or drop the format")
    if fields["ignore_eos"]:
        raise _err("ignore_eos", "cannot be combined with tool calls")


# ---- response bodies ----------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(reason: Optional[str]) -> Optional[str]:
    """OpenAI reasons are "stop" / "length" / "tool_calls"; a cancelled / failed request
    reports "abort"."""
    return reason if reason in (None, "stop", "length", "tool_calls") else "abort"


def choice(kind: str, index: int, text: Optional[str], finish: Optional[str], *,
           logprobs: Optional[dict[str, Any]] = None, stream: bool = False,
           role: bool = False, message: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One entry of `choices`: completions {"text"}; chat {"message"}, or streamed
    {"delta"} (with the role on a choice's first chunk). `message`: the chat message, or
    the streamed delta's fields (`chat_reply.ChatReply`), instead of plain `text`."""
    out: dict[str, Any] = {"index": index}
    if kind != "chat":
        out["text"] = text or ""
    elif stream:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if message is not None:
            delta.update(message)
        elif text:
            delta["content"] = text
        out["delta"] = delta
    else:
        out["message"] = message or {"role": "assistant", "content": text or ""}
    out["logprobs"] = logprobs
    out["finish_reason"] = finish_reason(finish)
    return out


def response(kind: str, rid: str, model: str, choices: list[dict[str, Any]],
             use: dict[str, int]) -> dict[str, Any]:
    """The non-streaming response object."""
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": use}


def chunk(kind: str, rid: str, model: str, choices: list[dict[str, Any]],
          use: Optional[dict[str, int]] = None) -> dict[str, Any]:
    """One streaming chunk (choices [] and use set: the final usage-only chunk)."""
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        out["usage"] = use
    return out


def error_body(status: int, message: str, param: Optional[str] = None) -> dict[str, Any]:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 408: "timeout_error", 429: "rate_limit_error",
             501: "invalid_request_error", 503: "service_unavailable",
             505: "invalid_request_error"}
    kinds.update(dict.fromkeys((405, 409, 411, 413, 414, 415, 431), "invalid_request_error"))
    return {"error": {"message": message, "type": kinds.get(status, "server_error"),
                      "param": param, "code": status}}
