"""What the Responses and Messages APIs share: their requests are rewritten into a chat
completions body and parsed by `protocol.parse_chat` (one request path: tools, grammar,
reasoning, sampling checks), with the parameter names of a refusal mapped back to the
API's own; one candidate's reply is read back as ordered output blocks.

    body, names = ..., {"max_tokens": "max_output_tokens"}
    parsed = parse_as_chat(body, names, vocab_size=..., max_seq_len=...)
    blocks = Blocks(); blocks.add(events)   # reasoning / text / call blocks, in order
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from typing import Any, Mapping, Optional

from jaxlearn.inference.errors import RequestError
from jaxlearn.serve.assistant_output import CallArgs, CallStart, Event, Reasoning
from jaxlearn.serve.protocol import ParsedRequest, parse_chat


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def api_error(param: str, message: str) -> RequestError:
    return RequestError(f"'{param}': {message}", param=param)


def rename_param(param: Optional[str], names: Mapping[str, str]) -> Optional[str]:
    """A chat completions parameter path in the API's names: the longest prefix of `param`
    found in `names` (as a regex, e.g. r"tools\\[(\\d+)\\]\\.function") is replaced."""
    if param is None:
        return None
    for pattern, repl in names.items():
        m = re.match(pattern, param)
        if m:
            return m.expand(repl) + param[m.end():]
    return param


def parse_as_chat(body: dict[str, Any], names: Mapping[str, str], *, vocab_size: int,
                  max_seq_len: int) -> ParsedRequest:
    """`parse_chat(body)`, a refusal naming the API's parameter (`rename_param`)."""
    try:
        return parse_chat(body, vocab_size=vocab_size, max_seq_len=max_seq_len)
    except RequestError as e:
        param = rename_param(e.param, names)
        message = str(e)
        if e.param and param != e.param:
            message = message.replace(f"'{e.param}'", f"'{param}'", 1)
        raise RequestError(message, param=param) from None


@dataclasses.dataclass
class Block:
    """One output block: kind "reasoning" | "text" | "call"; for calls, id / name."""

    kind: str
    text: str = ""
    id: str = ""
    name: str = ""


class Blocks:
    """A reply's output blocks in order; `add` returns (block index, block, piece, is_new)
    for each event, a block opening when the kind of output changes or a call starts."""

    def __init__(self) -> None:
        self.items: list[Block] = []

    def add(self, events: list[Event]) -> list[tuple[int, Block, str, bool]]:
        out = []
        for e in events:
            if isinstance(e, CallStart):
                self.items.append(Block("call", id=e.id, name=e.name))
                out.append((len(self.items) - 1, self.items[-1], "", True))
                continue
            if isinstance(e, CallArgs):
                new = False
            else:
                kind = "reasoning" if isinstance(e, Reasoning) else "text"
                new = not self.items or self.items[-1].kind != kind
                if new:
                    self.items.append(Block(kind))
            block = self.items[-1]
            block.text += e.text
            out.append((len(self.items) - 1, block, e.text, new))
        return out


def reply_blocks(events: list[Event], call_ids: set[str]) -> list[Block]:
    """The output blocks of a whole reply; a call block whose call was cut off (not in
    `call_ids`: its text came back as content) is left out."""
    blocks = Blocks()
    blocks.add(events)
    return [b for b in blocks.items if b.kind != "call" or b.id in call_ids]


__all__ = ["Block", "Blocks", "api_error", "new_id", "parse_as_chat", "rename_param",
           "reply_blocks"]
