"""JSON Schema helpers shared by the structured-output tests of inference and serve:
`conforms` (a small validator written from the JSON Schema spec, independent of the
grammar library), `SCHEMAS`, `rf` (a response_format), `check`, and the `byte_engine`
fixture (a tiny random model with the byte tokenizer)."""

import json

import jax
import numpy as np
import pytest
from engine_testing import make_engine

from jaxlearn.layers import llama_config
from jaxlearn.text.tokenizers import ByteTokenizer

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool,
          "null": type(None)}


def conforms(value, schema) -> bool:
    """Whether `value` is valid under `schema` (the JSON Schema keywords used here)."""
    if "enum" in schema and json.dumps(value) not in map(json.dumps, schema["enum"]):
        return False
    kind = schema.get("type")
    if kind in ("integer", "number"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if kind == "integer" and not float(value).is_integer():
            return False
        if not schema.get("minimum", -np.inf) <= value <= schema.get("maximum", np.inf):
            return False
    elif kind is not None and not isinstance(value, _TYPES[kind]):
        return False
    if isinstance(value, str) and not (schema.get("minLength", 0) <= len(value)
                                       <= schema.get("maxLength", 1 << 30)):
        return False
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30):
            return False
        return all(conforms(v, schema.get("items", {})) for v in value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(conforms(v, props.get(k, {})) for k, v in value.items())
    return True


def obj(props, required=None):
    return {"type": "object", "properties": props, "required": list(required or props),
            "additionalProperties": False}


NAME = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "required fields": obj({"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                  "maximum": 120}, "ok": {"type": "boolean"}}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}}),
    "array of numbers": obj({"xs": {"type": "array", "items": {"type": "number"},
                                    "minItems": 1, "maxItems": 4}}),
    "nested, optional": obj({"id": {"type": "integer", "minimum": -99, "maximum": 99},
                             "tags": {"type": "array", "items": NAME, "maxItems": 3},
                             "owner": obj({"name": NAME, "admin": {"type": "boolean"}}),
                             "note": {"type": "null"}}, required=["id", "owner"]),
}


def rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                   "strict": True}}


def check(text, schema):
    value = json.loads(text)
    assert conforms(value, schema), (text, schema)
    return value



@pytest.fixture(scope="module")
def byte_engine():
    cfg = llama_config(320, 32, 2, 4, 2, 64, rope_theta=1e4, tie_embeddings=True)
    params = cfg.instantiate().initialize_parameters_recursively(jax.random.PRNGKey(1))
    return make_engine(cfg, params, ByteTokenizer(), max_seq_len=256, max_batch=4,
                       prefill_chunk=16, decode_burst=4, kv_cache_tokens=1024,
                       model_name="tiny")
