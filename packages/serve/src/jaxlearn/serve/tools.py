"""Tool calling: the request's `tools` and `tool_choice`, how a call is written, and the
grammar that makes every call parse and validate (no I/O here).

    functions = parse_tools(body["tools"])              # RequestError naming tools[i]...
    choice = parse_tool_choice(body.get("tool_choice"), functions)
    fmt, native = tool_format(template_source)           # how this model writes a call
    grammar = tool_grammar(functions, choice, parallel=True, fmt=fmt)

A call is written in one of two formats, chosen from the chat template:

- `HERMES` (Qwen2.5 / Qwen3, Hermes, SmolLM3 and any template that writes `<tool_call>`;
  also the fallback): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  several in a row when parallel calls are allowed;
- `LLAMA3_JSON` (Llama 3.x templates, which write `<|python_tag|>` or ask for
  `"parameters"`): the whole reply is `{"name": ..., "parameters": {...}}`, one call.

The template renders the tools itself when its source reads a `tools` variable (`native`);
otherwise `fallback_system_prompt` describes them in the system message, in the HERMES
format. `tool_grammar` is an llguidance Lark grammar whose calls are `%json` schemas: one
object per function, `{"name": {"const": NAME}, "arguments": PARAMETERS}`, name first, so
the name is known before the arguments stream. JSON is compact, as for `response_format`.

    tool_choice "none"      no grammar: the model may write anything (it is content)
    "auto"                  text, or text followed by calls (nothing after them)
    "required" / a function only calls (of that function)
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Optional, Sequence

from jaxlearn.decoding.grammar import MAX_SCHEMA_CHARS, check_grammar
from jaxlearn.inference.errors import RequestError

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """How a model writes a call: `open` + {"name", args_key} + `close`, calls separated
    by `sep` (None: one call per reply). `at_start`: a call can only open the reply."""

    name: str
    open: str
    close: str
    sep: Optional[str]
    args_key: str
    at_start: bool = False


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", "", "", None, "parameters", at_start=True)


@dataclasses.dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: Mapping[str, Any]
    strict: bool = False

    def tool(self) -> dict[str, Any]:
        """The OpenAI tool object (what templates read as `tools[i]`)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "function"
    name: Optional[str] = None  # The function, for mode "function".


def _err(param: str, message: str) -> RequestError:
    return RequestError(f"'{param}': {message}", param=param)


def parse_function(fn: Any, where: str) -> Function:
    """{"name", "description"?, "parameters"?, "strict"?} -> Function."""
    if not isinstance(fn, dict):
        raise _err(where, "must be an object with a name")
    extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if extra:
        raise _err(f"{where}.{extra[0]}", "unknown field")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _err(f"{where}.name", "must be 1..64 characters of a-z, A-Z, 0-9, _, . or -")
    desc = fn.get("description", "")
    if not isinstance(desc, str):
        raise _err(f"{where}.description", "must be a string")
    params = fn.get("parameters")
    params = {"type": "object", "properties": {}} if params is None else params
    if not isinstance(params, dict):
        raise _err(f"{where}.parameters", "must be a JSON schema object")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _err(f"{where}.strict", "must be true or false")
    return Function(name, desc, params, bool(strict))


def parse_tools(value: Any, where: str = "tools") -> tuple[Function, ...]:
    """OpenAI chat `tools`: [{"type": "function", "function": {...}}]."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise _err(where, f"must be a list of at most {MAX_TOOLS} tools")
    out = []
    for i, tool in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _err(f"{at}.type", "only \"function\" tools are supported")
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise _err(f"{at}.{extra[0]}", "unknown field")
        out.append(parse_function(tool.get("function"), f"{at}.function"))
    return unique(out, where)


def unique(functions: Sequence[Function], where: str) -> tuple[Function, ...]:
    names = [f.name for f in functions]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise _err(where, f"two tools are named {dup!r}")
    return tuple(functions)


def parse_tool_choice(value: Any, functions: Sequence[Function],
                      where: str = "tool_choice") -> ToolChoice:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name"}} (default:
    "auto" with tools, "none" without)."""
    if value is None:
        return ToolChoice("auto" if functions else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise _err(where, f"must be \"none\", \"auto\", \"required\" or a function, "
                              f"got {value!r}")
        if value != "none" and not functions:
            raise _err(where, f"{value!r} needs tools")
        return ToolChoice(value)
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (isinstance(value, dict) and value.get("type") == "function" and isinstance(name, str)):
        raise _err(where, "a named choice is {\"type\": \"function\", \"function\": {\"name\"}}")
    return named_choice(name, functions, where)


def named_choice(name: str, functions: Sequence[Function], where: str) -> ToolChoice:
    if name not in {f.name for f in functions}:
        raise _err(where, f"no tool is named {name!r}")
    return ToolChoice("function", name)


# ---- formats ------------------------------------------------------------------------------


def tool_format(template: Optional[str]) -> tuple[ToolFormat, bool]:
    """(the format a model with chat template source `template` writes calls in, whether
    that template renders `tools` itself)."""
    source = template or ""
    native = bool(re.search(r"\btools\b", source))
    if "<tool_call>" in source:
        return HERMES, native
    if native and ("<|python_tag|>" in source or '"parameters"' in source):
        return LLAMA3_JSON, True
    return HERMES, False


def fallback_system_prompt(functions: Sequence[Function]) -> str:
    """The tools described for a template that does not render them (HERMES format)."""
    lines = "\n".join(json.dumps(f.tool(), ensure_ascii=False) for f in functions)
    return (
        "# Tools\n\nYou may call functions to help with the user's request. Their "
        "signatures are within <tools></tools>:\n<tools>\n" + lines + "\n</tools>\n\n"
        "To call a function, reply with a JSON object of its name and arguments within "
        "<tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def call_text(fmt: ToolFormat, name: str, arguments: Any) -> str:
    """A past call as the model writes it (fallback rendering of assistant turns)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return f'{fmt.open}{{"name": {json.dumps(name)}, "{fmt.args_key}": {args}}}{fmt.close}'


# ---- grammar ------------------------------------------------------------------------------


def _lark_string(s: str) -> str:
    return json.dumps(s)


def _call_schema(functions: Sequence[Function], fmt: ToolFormat) -> str:
    options = [{
        "type": "object",
        "properties": {"name": {"const": f.name}, fmt.args_key: dict(f.parameters)},
        "required": ["name", fmt.args_key],
        "additionalProperties": False,
    } for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = dict(schema, **{"x-guidance": {"whitespace_flexible": False}})
    text = json.dumps(schema, allow_nan=False, ensure_ascii=False)
    if len(text) > MAX_SCHEMA_CHARS:
        raise _err("tools", f"the tools' schemas are over {MAX_SCHEMA_CHARS} characters")
    return text


def tool_grammar(functions: Sequence[Function], choice: ToolChoice, *, parallel: bool,
                 fmt: ToolFormat) -> Optional[str]:
    """The llguidance grammar of a reply under `choice` (None for "none"): see the module
    doc. A schema llguidance refuses is a RequestError naming `tools`."""
    if choice.mode == "none":
        return None
    chosen = [f for f in functions if choice.mode != "function" or f.name == choice.name]
    one = f"{_lark_string(fmt.open)} fn {_lark_string(fmt.close)}"
    more = f" ({_lark_string(fmt.sep)} {one})*" if parallel and fmt.sep is not None else ""
    rules = [f"fn: %json {_call_schema(chosen, fmt)}", f"calls: {one}{more}"]
    if choice.mode in ("required", "function"):
        rules.insert(0, "start: calls")
    elif fmt.at_start:  # The reply is a call or text that does not open like one.
        rules.insert(0, "start: calls | TEXT")
        rules.append(r"TEXT: /(?s:[^{\s].*)?/")
    else:
        marker = fmt.open.rstrip("\n")
        rest = fmt.open[len(marker):]
        after = f"{_lark_string(rest)} fn {_lark_string(fmt.close)}{more}"
        rules.insert(0, "start: TEXT | lead after_lead")
        rules += [
            f"after_lead: {after}",
            f"lead[lazy]: /(?s:.*)/ {_lark_string(marker)}",
            f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(marker)}(?s:.*)/",
        ]
    return check_grammar("%llguidance {}\n" + "\n".join(rules) + "\n", param="tools")


__all__ = [
    "HERMES", "LLAMA3_JSON", "Function", "ToolChoice", "ToolFormat", "call_text",
    "fallback_system_prompt", "named_choice", "parse_function", "parse_tool_choice",
    "parse_tools", "tool_format", "tool_grammar", "unique",
]
