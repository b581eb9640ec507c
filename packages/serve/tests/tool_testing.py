"""Shared by the tool-calling tests: a tiny random model with the byte tokenizer and room for
the tools' description, a Qwen3-style chat template written for the tests (tools, tool
turns, reasoning, `enable_thinking`), random JSON-schema strategies, and a check of a call
against its schema by `schema_testing.conforms` (written from the JSON Schema spec,
independent of the grammar library)."""

import json

import jax
from engine_testing import make_engine
from hypothesis import strategies as st
from schema_testing import conforms

from jaxlearn.layers import llama_config
from jaxlearn.text.chat import ChatTemplate
from jaxlearn.text.tokenizers import ByteTokenizer

# Qwen3-like: tools in the system turn, calls as <tool_call> JSON, tool results as user
# turns, reasoning kept only for turns after the last user message, and a closed empty
# <think> block when enable_thinking is false.
QWEN_STYLE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}\
{%- endif -%}{%- endfor -%}
{%- if tools -%}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Reply with <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' -%}<|im_start|>assistant
{% if m.reasoning_content and loop.index0 > ns.last_user %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}{% for tc in m.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' -%}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif open_thinking is defined and open_thinking %}<think>
{% endif %}{%- endif -%}"""


def tool_engine(template=None):
    """A tiny random llama over bytes, 2048 tokens of context."""
    cfg = llama_config(320, 32, 2, 4, 2, 64, rope_theta=1e4, tie_embeddings=True)
    params = cfg.instantiate().initialize_parameters_recursively(jax.random.PRNGKey(1))
    tok = ByteTokenizer()
    if template is not None:
        tok.set_chat_template(ChatTemplate(template))
    return make_engine(cfg, params, tok, max_seq_len=2048, max_batch=4, prefill_chunk=128,
                       decode_burst=4, kv_cache_tokens=8192, model_name="tiny")


def tool(name, parameters, description=""):
    fn = {"name": name, "parameters": parameters}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


WEATHER = tool("get_weather", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}, "Weather in a city")
ADD = tool("add", {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "b": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False})


def check_call(call, tools):
    """A tool call of a response: its function is offered and its arguments parse and
    validate against that function's schema. Returns the arguments."""
    assert call["type"] == "function" and call["id"].startswith("call_")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    name = call["function"]["name"]
    assert name in schemas, name
    args = json.loads(call["function"]["arguments"])
    assert conforms(args, schemas[name]), (args, schemas[name])
    return args


# ---- random schemas ----------------------------------------------------------------------

_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.integers(-50, 0).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 60}),
    st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.sampled_from(["red", "green", 1, 2, True, None]), min_size=1, max_size=3,
             unique_by=json.dumps).map(lambda xs: {"enum": xs}),
    st.just({"type": "null"}),
)


def _obj(children):
    names = st.text("abcdefghij_", min_size=1, max_size=6)
    return st.dictionaries(names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req,
                         "additionalProperties": False}))


_value = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        _obj(inner),
        inner.map(lambda s: {"type": "array", "items": s, "maxItems": 2})),
    max_leaves=5)

random_parameters = _obj(_value)
