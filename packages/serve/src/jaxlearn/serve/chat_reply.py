"""A chat request rendered for the engine, and each candidate's reply read back.

`ChatPlan.build(engine, parsed)` decides, from the model's chat template, how tools are
written (`tools.tool_format`), renders the conversation (`chat_messages.template_inputs`,
`jaxlearn.text.protocol.chat_prompt`), builds the tool-call grammar (`tools.tool_grammar`)
and whether the reply may open with reasoning: a template that writes `<think>` does, and
when the rendered prompt ends inside an open `<think>` block (templates that start the
reasoning themselves) the reply starts in it.

`ChatReply(plan)` wraps one candidate's `AssistantOutput`: `delta(text)` is the streamed
chat delta of a piece of text ({"reasoning_content"} / {"content"} / {"tool_calls":
[{"index", "id", "type", "function": {"name", "arguments": ""}}]}, then argument
fragments {"tool_calls": [{"index", "function": {"arguments"}}]}), `message()` the whole
assistant message, and `finish_reason` turns "stop" into "tool_calls" when calls were made.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from jaxlearn.inference.errors import RequestError
from jaxlearn.serve.assistant_output import (
    THINK_CLOSE,
    THINK_OPEN,
    AssistantOutput,
    CallArgs,
    CallStart,
    Content,
    Event,
    Reasoning,
)
from jaxlearn.serve.chat_messages import template_inputs
from jaxlearn.serve.protocol import ParsedRequest
from jaxlearn.serve.tools import ToolFormat, tool_format, tool_grammar
from jaxlearn.text.detokenize import token_texts
from jaxlearn.text.protocol import chat_prompt


@dataclasses.dataclass(frozen=True)
class ChatPlan:
    prompt: Union[str, list[int]]
    grammar: Optional[str]  # The tool-call grammar, else the request's response_format one.
    tools: Optional[ToolFormat]  # The format calls are read in (None: no calls).
    reasoning: bool
    in_reasoning: bool

    @staticmethod
    def build(engine: Any, parsed: ParsedRequest) -> "ChatPlan":
        tok = engine.tokenizer
        if tok is None:
            raise RequestError("chat needs a tokenizer and this engine has none: use "
                               "/v1/completions with a prompt of token ids", param="messages")
        template = getattr(tok, "chat_template", None)
        source = getattr(template, "source", None)
        fmt, native = tool_format(source)
        messages, context = template_inputs(parsed.messages or [], parsed.tools,
                                            parsed.template_kwargs, fmt=fmt, native=native)
        try:
            allow = bool(getattr(engine.config, "parse_special_in_content", False))
            prompt = chat_prompt(tok, messages, parse_special_in_content=allow, context=context)
        except Exception as e:  # Templates reject some conversations (roles...).
            raise RequestError(f"the chat template refused the messages: {e}",
                               param="messages") from None
        choice = parsed.tool_choice
        grammar = parsed.grammar
        if choice.mode != "none":
            grammar = tool_grammar(parsed.tools, choice, parallel=parsed.parallel_tool_calls,
                                   fmt=fmt)
        reasoning = isinstance(source, str) and THINK_OPEN in source and THINK_CLOSE in source
        return ChatPlan(prompt, grammar, fmt if choice.mode != "none" else None, reasoning,
                        reasoning and _opens_reasoning(engine, prompt))


def _opens_reasoning(engine: Any, prompt: Union[str, list[int]]) -> bool:
    """Whether the prompt ends inside an open <think> block."""
    if isinstance(prompt, str):
        tail = prompt[-256:]
    else:
        tail = "".join(token_texts(engine.tokenizer, prompt[-16:]))
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


class ChatReply:
    """One candidate's reply (module doc)."""

    def __init__(self, plan: ChatPlan):
        self.out = AssistantOutput(reasoning=plan.reasoning, in_reasoning=plan.in_reasoning,
                                   tools=plan.tools)

    @staticmethod
    def _delta(events: list[Event]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        calls: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Reasoning):
                delta["reasoning_content"] = delta.get("reasoning_content", "") + e.text
            elif isinstance(e, Content):
                delta["content"] = delta.get("content", "") + e.text
            elif isinstance(e, CallStart):
                calls.append({"index": e.index, "id": e.id, "type": "function",
                              "function": {"name": e.name, "arguments": ""}})
            elif isinstance(e, CallArgs):
                if calls and calls[-1]["index"] == e.index:
                    calls[-1]["function"]["arguments"] += e.text
                else:
                    calls.append({"index": e.index, "function": {"arguments": e.text}})
        if calls:
            delta["tool_calls"] = calls
        return delta

    def events(self, text: str, last: bool = False) -> list[Event]:
        """What the next piece of text adds (`last`: the reply ends with it)."""
        events = self.out.feed(text)
        if last:
            events += self.out.finish()
        return events

    def delta(self, text: str, last: bool = False) -> dict[str, Any]:
        """The chat delta of the next piece of text (`last`: the reply ends with it)."""
        return self._delta(self.events(text, last))

    def message(self) -> dict[str, Any]:
        """The assistant message of the whole reply (after `delta(..., last=True)`)."""
        out = self.out
        msg: dict[str, Any] = {"role": "assistant", "content": out.content or None}
        if out.reasoning:
            msg["reasoning_content"] = out.reasoning
        if out.calls:
            msg["tool_calls"] = [c.openai() for c in out.calls]
        elif msg["content"] is None:
            msg["content"] = ""
        return msg

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if reason == "stop" and self.out.calls else reason


__all__ = ["ChatPlan", "ChatReply"]
