"""`AssistantOutput`: however the reply is cut into pieces, the split into reasoning,
content and tool calls is the same, and the streamed events add up to it."""

import json

from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.serve.assistant_output import (
    AssistantOutput,
    CallArgs,
    CallStart,
    Content,
    Reasoning,
)
from jaxlearn.serve.tools import HERMES, LLAMA3_JSON

_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-9, 99),
              st.text("ab{}[]\"\\<>/ \n,:", max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text("xyz}\"", max_size=3), inner, max_size=3)),
    max_leaves=6)
_args = st.dictionaries(st.text("abc", min_size=1, max_size=3), _json, max_size=3)
_text = st.text("ab <>/think_cl\n{}", max_size=12)


def feed(out, text, cuts):
    events, at = [], 0
    for c in sorted(set(cuts)):
        events += out.feed(text[at:c])
        at = c
    return events + out.feed(text[at:]) + out.finish()


@given(reasoning=st.one_of(st.none(), _text.filter(lambda t: "</think>" not in t)),
       content=_text.filter(lambda t: "<tool_call>" not in t and "<think>" not in t),
       calls=st.lists(st.tuples(st.sampled_from(["f", "g.h"]), _args), max_size=3),
       cuts=st.lists(st.integers(0, 400), max_size=12))
def test_split_is_the_same_however_the_text_is_cut(reasoning, content, calls, cuts):
    text = "" if reasoning is None else f"<think>\n{reasoning}</think>\n\n"
    text += content
    for name, args in calls:
        text += f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>\n"
    out = AssistantOutput(reasoning=True, tools=HERMES)
    events = feed(out, text, cuts)
    lead = not content.strip() and reasoning is None  # Whitespace before <think> is dropped.
    assert out.reasoning == (reasoning or "")
    assert out.content == (content.lstrip("\n") if reasoning is not None else content) or lead
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == list(calls)
    assert not out.broken
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == out.reasoning
    assert "".join(e.text for e in events if isinstance(e, Content)) == out.content
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [e.name for e in starts] == [n for n, _ in calls]
    for i, c in enumerate(out.calls):
        assert "".join(e.text for e in events if isinstance(e, CallArgs) and e.index == i) \
            == c.arguments


@given(args=_args, cuts=st.lists(st.integers(0, 200), max_size=8))
def test_llama_json_call(args, cuts):
    out = AssistantOutput(tools=LLAMA3_JSON)
    feed(out, json.dumps({"name": "f", "parameters": args}), cuts)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("f", args)]
    assert out.content == ""


def test_a_cut_off_call_is_content():
    out = AssistantOutput(tools=HERMES)
    text = 'Sure <tool_call>\n{"name": "f", "arguments": {"a": [1, 2'
    feed(out, text, [7, 20, 30])
    assert out.broken and out.calls == [] and out.content == text
    out = AssistantOutput(tools=HERMES)  # Keys in another order: read whole at the end.
    feed(out, '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', [3])
    assert [(c.name, c.arguments) for c in out.calls] == [("f", '{"a": 1}')]
