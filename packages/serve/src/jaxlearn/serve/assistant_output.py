"""An assistant's text, as it streams, split into reasoning, content and tool calls.

    out = AssistantOutput(reasoning=True, in_reasoning=False, tools=HERMES)
    for piece in text_deltas:
        for event in out.feed(piece): ...      # Reasoning / Content / CallStart / CallArgs
    out.finish()                               # the held-back tail
    out.reasoning, out.content, out.calls      # the whole reply, split

Reasoning is the text inside `<think>...</think>` at the start of the reply (or, when the
prompt already opened the block, `in_reasoning`, everything up to `</think>`); the blank
lines after `</think>` are dropped. Tool calls are read in a `ToolFormat` (`tools.py`):
after the call's opening, `{"name": "...", "<args key>": ` gives the name (one `CallStart`
event), then the arguments value is read character by character with its JSON nesting
tracked, so each fragment streams as a `CallArgs` event the moment it is written, and the
value ends exactly at its closing bracket (the wrapper's `}` is not part of it). Text that
may still turn into a tag (`<thi`, `<tool_ca`) is held back until it cannot.

A call that does not parse (no grammar constrained it, or the reply was cut off) leaves
`broken` set; `finish` then moves what was read of it to `content` unless it parses as a
whole JSON call object.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Optional, Union

from jaxlearn.serve.tools import ToolFormat

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclasses.dataclass
class Reasoning:
    text: str


@dataclasses.dataclass
class Content:
    text: str


@dataclasses.dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclasses.dataclass
class CallArgs:
    index: int
    text: str


Event = Union[Reasoning, Content, CallStart, CallArgs]


@dataclasses.dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as written.

    def openai(self) -> dict[str, object]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class AssistantOutput:
    """See the module doc. `tools`: the format calls are read in (None: no calls)."""

    def __init__(self, *, reasoning: bool = False, in_reasoning: bool = False,
                 tools: Optional[ToolFormat] = None):
        self.fmt = tools
        self.state = "reasoning" if in_reasoning else ("start" if reasoning else "content")
        self.buf = ""
        self.reasoning, self.content = "", ""
        self.calls: list[ToolCall] = []
        self.broken = False
        self._raw = ""  # The current call's text, for `finish` when it does not parse.
        self._depth = 0
        self._in_string = self._escaped = False

    # ---- events ---------------------------------------------------------------------------

    def _reason(self, text: str, out: list[Event]) -> None:
        if text:
            self.reasoning += text
            out.append(Reasoning(text))

    def _say(self, text: str, out: list[Event]) -> None:
        if text:
            self.content += text
            out.append(Content(text))

    def feed(self, text: str) -> list[Event]:
        """The events `text` (the next piece of the reply) completes."""
        self.buf += text
        out: list[Event] = []
        while self.buf and self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        """The events of what was held back, at the end of the reply."""
        out: list[Event] = []
        if self.state in ("reasoning", "reasoning_open"):
            self._reason(self.buf, out)
        elif self.state in ("call", "args", "tail"):
            self._raw += self.buf
            self._salvage(out)
        elif self.state not in ("done", "between") or self.buf.strip():
            self._say(self.buf, out)
        self.buf = ""
        return out

    def _salvage(self, out: list[Event]) -> None:
        """A call that ended early: kept if its text is a whole call object, else content."""
        assert self.fmt is not None
        body = self._raw[len(self.fmt.open):] if self._raw.startswith(self.fmt.open) else ""
        body = body[: -len(self.fmt.close)] if self.fmt.close and body.endswith(
            self.fmt.close) else body
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                and isinstance(obj.get(self.fmt.args_key), dict) and self.state == "call"):
            index = len(self.calls)
            call = ToolCall(call_id(), obj["name"], json.dumps(obj[self.fmt.args_key]))
            self.calls.append(call)
            out += [CallStart(index, call.id, call.name), CallArgs(index, call.arguments)]
            return
        if self.state != "call":  # Its start (and arguments) streamed; it is not a call.
            self.calls.pop()
        self.broken = True
        self._say(self._raw, out)

    # ---- the state machine ----------------------------------------------------------------

    def _step(self, out: list[Event]) -> bool:
        """Consumes what it can of `buf`; False when it must wait for more text."""
        if self.state == "start":
            lead = self.buf.lstrip()
            if lead.startswith(THINK_OPEN):
                self.buf = lead[len(THINK_OPEN):]
                self.state = "reasoning_open"
                return True
            if THINK_OPEN.startswith(lead):
                return False
            self.state = "content"
            return True
        if self.state == "reasoning_open":  # The newline that opens the block is not text.
            if self.buf.startswith("\n"):
                self.buf = self.buf[1:]
            self.state = "reasoning"
            return True
        if self.state == "reasoning":
            end = self.buf.find(THINK_CLOSE)
            if end < 0:
                keep = _held(self.buf, THINK_CLOSE)
                self._reason(self.buf[: len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
                return False
            self._reason(self.buf[:end], out)
            self.buf = self.buf[end + len(THINK_CLOSE):]
            self.state = "after_reasoning"
            return True
        if self.state == "after_reasoning":
            self.buf = self.buf.lstrip("\n")
            if self.buf:
                self.state = "content"
            return bool(self.buf)
        if self.state == "content":
            return self._content(out)
        if self.state == "call":
            return self._call_head(out)
        if self.state == "args":
            return self._args(out)
        if self.state == "tail":
            return self._tail(out)
        if self.state == "between":
            return self._between()
        self.buf = ""  # "done": after a format's only call nothing is read.
        return False

    def _content(self, out: list[Event]) -> bool:
        fmt = self.fmt
        if fmt is None:
            self._say(self.buf, out)
            self.buf = ""
            return False
        if fmt.at_start:  # The reply is a call only if it opens with one.
            if self.content.strip():
                self._say(self.buf, out)
                self.buf = ""
                return False
            lead = self.buf.lstrip()
            if not lead:
                return False
            if lead.startswith("{"):
                self.state, self.buf, self._raw = "call", lead, ""
                return True
            self.fmt = None
            return True
        start = self.buf.find(fmt.open)
        if start < 0:
            keep = _held(self.buf, fmt.open)
            self._say(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self._say(self.buf[:start], out)
        self._raw = fmt.open
        self.buf = self.buf[start + len(fmt.open):]
        self.state = "call"
        return True

    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(\w+)"\s*:\s*')

    def _call_head(self, out: list[Event]) -> bool:
        assert self.fmt is not None
        m = self._HEAD.match(self.buf)
        if m is None or m.end() == len(self.buf):  # Wait: the value's first character.
            return False
        if m.group(2) != self.fmt.args_key:
            return False  # Not this format's call: `finish` decides.
        name = json.loads(f'"{m.group(1)}"')
        index = len(self.calls)
        self.calls.append(ToolCall(call_id(), name, ""))
        out.append(CallStart(index, self.calls[-1].id, name))
        self._raw += self.buf[: m.end()]
        self.buf = self.buf[m.end():]
        self._depth, self._in_string, self._escaped = 0, False, False
        self.state = "args"
        return True

    def _args(self, out: list[Event]) -> bool:
        """Reads the arguments value up to its closing bracket."""
        n = 0
        done = False
        for ch in self.buf:
            n += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    done = True
                    break
        piece, self.buf = self.buf[:n], self.buf[n:]
        self._raw += piece
        call = self.calls[-1]
        call.arguments += piece
        out.append(CallArgs(len(self.calls) - 1, piece))
        if done:
            self.state = "tail"
        return done

    def _tail(self, out: list[Event]) -> bool:
        """The wrapper's `}` and the close tag; then the next call, or the end."""
        assert self.fmt is not None
        wanted = "}" + self.fmt.close
        lead = self.buf.lstrip(" ")
        if len(lead) < len(wanted):
            if not wanted.startswith(lead):
                self._bad_tail(out)
            return False
        if not lead.startswith(wanted):
            self._bad_tail(out)
            return True
        self.buf = lead[len(wanted):]
        if self.fmt.sep is None:
            self.state = "done"
            return True
        self.state = "between"
        return True

    def _between(self) -> bool:
        """After a call: newlines, then the next call or more content."""
        assert self.fmt is not None
        lead = self.buf.lstrip("\n")
        if self.fmt.open.startswith(lead):
            return False  # Wait: the next call may be opening.
        self.state = "content"
        if lead.startswith(self.fmt.open):
            self.buf = lead
        return True

    def _bad_tail(self, out: list[Event]) -> None:
        self.broken = True
        self._say(self.buf, out)
        self.buf = ""
        self.state = "content"
