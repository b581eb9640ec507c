"""Fine-tuning rows: one JSONL line parsed and checked into an `SFTRow`.

    row = parse_row('{"prompt": "2+2=", "completion": "4"}', "data.jsonl:3")
    row.kind == "prompt_completion"

A row's kind is found from its keys (`KINDS`); other keys are ignored. Every problem raises
`DataError` with a one-line message starting with where the row is (`file:line`): besides
wrong kinds and types, JSON nested deeper than Python's parser can follow, a number of more
than `MAX_DIGITS` digits, and text holding a lone surrogate (a `\\ud800` escape with no
pair: not a character, so no tokenizer can encode it).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from typing import Any, Sequence

from jaxlearn.runtime.data import DataError

# kind -> the keys that make a row of that kind (all of them, and no other kind's).
KINDS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
DEFAULT_ROLES: tuple[str, ...] = ("system", "user", "assistant")
TRAINED_ROLE = "assistant"
MAX_DIGITS = 4300  # Python's own limit on converting digit strings to int.
_SURROGATE = re.compile("[\ud800-\udfff]")


class _TooManyDigits(ValueError):
    pass


def _parse_int(digits: str) -> int:
    if len(digits) - digits.startswith("-") > MAX_DIGITS:
        raise _TooManyDigits(len(digits) - digits.startswith("-"))
    return int(digits)


def _check_text(value: str, what: str) -> str:
    found = _SURROGATE.search(value)
    if found:
        raise DataError(
            f"{what} has an invalid character at index {found.start()}: a lone surrogate "
            f"(U+{ord(found.group()):04X}), which is not text; fix the escape in the file"
        )
    return value


@dataclasses.dataclass(frozen=True)
class SFTRow:
    """A checked row. `messages` holds (role, content) pairs for "messages" rows; `prompt`,
    `completion` and `text` are "" where the kind has no such field."""

    kind: str
    origin: str
    messages: tuple[tuple[str, str], ...] = ()
    prompt: str = ""
    completion: str = ""
    text: str = ""

    def message_dicts(self) -> list[dict[str, str]]:
        """The conversation as chat-template messages [{"role", "content"}, ...]."""
        return [{"role": role, "content": content} for role, content in self.messages]


def _kind(record: dict[str, Any], where: str) -> str:
    found = [kind for kind, keys in KINDS.items() if any(k in record for k in keys)]
    if not found:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise DataError(
            f"{where}: no known row kind (keys: {keys}); expected 'messages', "
            "'prompt' + 'completion', or 'text'"
        )
    if len(found) > 1:
        keys = ", ".join(k for kind in found for k in KINDS[kind] if k in record)
        raise DataError(f"{where}: keys of several row kinds ({keys}); use one kind per row")
    kind = found[0]
    missing = [k for k in KINDS[kind] if k not in record]
    if missing:
        raise DataError(f"{where}: a {kind!r} row needs {', '.join(map(repr, missing))} too")
    return kind


def _string(record: dict[str, Any], key: str, where: str, *, blank_ok: bool) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} is a {type(value).__name__}, not a string")
    if not blank_ok and not value.strip():
        raise DataError(f"{where}: {key!r} is empty")
    return _check_text(value, f"{where}: {key!r}")


def _messages(value: Any, where: str, roles: Sequence[str]) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list):
        raise DataError(f"{where}: 'messages' is a {type(value).__name__}, not a list")
    if not value:
        raise DataError(f"{where}: 'messages' is empty")
    out = []
    for i, message in enumerate(value):
        at = f"{where}: messages[{i}]"
        if not isinstance(message, dict):
            raise DataError(f"{at} is a {type(message).__name__}, not an object")
        for key in ("role", "content"):
            if key not in message:
                raise DataError(f"{at} has no {key!r}")
            if not isinstance(message[key], str):
                kind = type(message[key]).__name__
                raise DataError(f"{at}.{key} is a {kind}, not a string")
        if message["role"] not in roles:
            raise DataError(
                f"{at}.role {message['role']!r} is not one of {', '.join(map(repr, roles))}"
            )
        out.append((message["role"], _check_text(message["content"], f"{at}.content")))
    if not any(role == TRAINED_ROLE for role, _ in out):
        raise DataError(f"{where}: no {TRAINED_ROLE!r} message, so nothing to train on")
    return tuple(out)


def parse_row(line: str, where: str, roles: Sequence[str] = DEFAULT_ROLES) -> SFTRow:
    """The checked row of one JSONL line found at `where` (`file:line`)."""
    try:
        record = json.loads(line, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except _TooManyDigits as e:
        raise DataError(
            f"{where}: a number with {e.args[0]} digits (at most {MAX_DIGITS} are read)"
        ) from None
    except RecursionError:
        raise DataError(
            f"{where}: JSON nested too deeply to parse (Python's recursion limit is "
            f"{sys.getrecursionlimit()})"
        ) from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    kind = _kind(record, where)
    if kind == "messages":
        return SFTRow(kind, where, messages=_messages(record["messages"], where, roles))
    if kind == "prompt_completion":
        return SFTRow(
            kind,
            where,
            prompt=_string(record, "prompt", where, blank_ok=False),
            completion=_string(record, "completion", where, blank_ok=False),
        )
    return SFTRow(kind, where, text=_string(record, "text", where, blank_ok=False))


__all__ = ["DEFAULT_ROLES", "KINDS", "MAX_DIGITS", "TRAINED_ROLE", "SFTRow", "parse_row"]
