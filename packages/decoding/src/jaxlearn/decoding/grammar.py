"""Structured output: OpenAI `response_format` -> an llguidance grammar -> token masks.

`response_format_grammar(value)` turns `{"type": "json_object"}` or `{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}` into llguidance grammar
text (validated; RequestError naming the field otherwise). The text is the request's
`SamplingParams.grammar`. `GrammarVocab(tokenizer, vocab_size)` holds the llguidance
view of the engine's tokenizer (every id's bytes, built once, ~0.5 s for 49k ids) and
makes one `Matcher` per request: `fill(bits, row)` writes the ids allowed next as bits
of an int32 row [ceil(vocab / 32)], `advance(token)` moves the grammar past a sampled
id. EOS is allowed only where the grammar accepts (llguidance's rule), and once the
grammar can take nothing more only EOS is. `allowed_logits` applies the bit rows to the
logits on device. JSON is compact (no whitespace between tokens): a model cannot pad
the output with endless whitespace.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.decoding.errors import MissingDependencyError, RequestError
from jaxlearn.text.tokenizers import ByteTokenizer

Array = jax.Array
MAX_SCHEMA_CHARS = 65536
_JSON_OPTIONS = {"whitespace_flexible": False}


def _llg() -> Any:
    try:
        import llguidance
    except ImportError:
        raise MissingDependencyError(
            "response_format needs the llguidance package (pip install llguidance)") from None
    return llguidance


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _schema_of(value: dict[str, Any]) -> Any:
    """The JSON schema of a `response_format` object (RequestError naming the field)."""
    kind = value.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if not isinstance(kind, str) or kind not in allowed:
        raise RequestError("'response_format.type': must be \"text\", \"json_object\" or "
                           f"\"json_schema\", got {kind!r}", param="response_format.type")
    extra = sorted(set(value) - allowed[kind])
    if extra:
        raise RequestError(f"'response_format.{extra[0]}': unknown field for type {kind!r}",
                           param=f"response_format.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise RequestError(f"'{where}': must be an object with name and schema", param=where)
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise RequestError(f"'{where}.{extra[0]}': unknown field", param=f"{where}.{extra[0]}")
    name = spec.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise RequestError(f"'{where}.name': must be a string of 1..64 characters",
                           param=f"{where}.name")
    for field, types in (("strict", (bool,)), ("description", (str,))):
        if spec.get(field) is not None and not isinstance(spec[field], types):
            raise RequestError(f"'{where}.{field}': must be a {types[0].__name__}",
                               param=f"{where}.{field}")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise RequestError(f"'{where}.schema': must be a JSON schema object",
                           param=f"{where}.schema")
    return _closed(schema) if spec.get("strict") else schema


# Keywords whose value is a schema, a list of schemas, or a name -> schema map.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "additionalProperties", "propertyNames", "unevaluatedProperties")
_SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _closed(schema: Any) -> Any:
    """`strict: true` (OpenAI's structured outputs): a copy of `schema` where every object
    schema that does not say otherwise has `additionalProperties: false`."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = _closed(out[key])
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(x) for x in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v) for k, v in out[key].items()}
    return out


def response_format_grammar(value: Any, *, whitespace_flexible: bool = False) -> Optional[str]:
    """OpenAI `response_format` -> llguidance grammar text; None for absent / "text".
    An invalid or unsatisfiable schema is a RequestError naming the field. Generation
    wants compact JSON; `whitespace_flexible` accepts any JSON whitespace (checking text
    someone else wrote)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("'response_format': must be an object with a type",
                           param="response_format")
    where = "response_format.json_schema.schema"
    try:
        schema = _schema_of(value)
        if value["type"] == "text":
            return None
        text = json.dumps(schema, allow_nan=False)
    except RequestError:
        raise
    except RecursionError:
        raise RequestError(f"'{where}': nested too deeply", param=where) from None
    except (TypeError, ValueError) as e:
        raise RequestError(f"'{where}': not a JSON schema: {_one_line(str(e))[:200]}",
                           param=where) from None
    llg = _llg()
    try:
        if len(text) > MAX_SCHEMA_CHARS:
            raise ValueError(f"over {MAX_SCHEMA_CHARS} characters")
        grammar = llg.LLMatcher.grammar_from_json_schema(
            text, defaults=dict(_JSON_OPTIONS, whitespace_flexible=whitespace_flexible))
    except (TypeError, ValueError) as e:
        raise RequestError(f"'{where}': not a JSON schema: {_one_line(str(e))[:200]}",
                           param=where) from None
    return _validated(grammar, "response_format" if value["type"] == "json_object" else where)


def _validated(grammar: Any, param: str) -> str:
    """`grammar` as text once llguidance accepts it (RequestError naming `param`)."""
    error = _llg().LLMatcher.validate_grammar(grammar, None)
    if error and not error.startswith("WARNING"):
        raise RequestError(f"'{param}': {_one_line(error)[:300]}", param=param)
    return str(grammar)


def check_grammar(lark: str, *, param: str) -> str:
    """An llguidance Lark grammar (`%json` schemas inside allowed) as the grammar text of
    `SamplingParams.grammar`, validated: RequestError naming `param` when llguidance refuses
    it."""
    try:
        grammar = _llg().LLMatcher.grammar_from_lark(lark)
    except (TypeError, ValueError) as e:
        raise RequestError(f"'{param}': {_one_line(str(e))[:300]}", param=param) from None
    return _validated(grammar, param)


class _ByteTokens:
    """The llguidance tokenizer view of `ByteTokenizer` (pad 0, bos 1, eos 2, byte b ->
    b + 3) for a model vocabulary of `vocab_size` (ids past 259 carry no text)."""

    def __init__(self, vocab_size: int):
        self.eos_token_id, self.bos_token_id = 2, 1
        self.tokens = [b"<pad>", b"<s>", b"</s>", *(bytes([b]) for b in range(256))]
        self.tokens += [b""] * (vocab_size - len(self.tokens))
        self.special_token_ids = [0, 1, 2, *range(259, vocab_size)]

    def __call__(self, text: Any) -> list[int]:
        raw = text if isinstance(text, bytes) else str(text).encode("utf-8")
        return [b + 3 for b in raw]


class Matcher:
    """One request's grammar state (an llguidance `LLMatcher` over `words` mask words)."""

    def __init__(self, matcher: Any, words: int):
        self._m = matcher
        self.words = words

    def fill(self, bits: np.ndarray, row: int) -> None:
        """Writes the ids allowed next into bits[row] (int32, bit i of word w = id
        32 w + i; words past the grammar's vocabulary allow nothing, a row shorter than
        it keeps the ids it has room for)."""
        if bits.shape[1] == self.words:
            target = bits[row]
            self._m.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
            return
        target = np.zeros(self.words, np.int32)
        self._m.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
        n = min(self.words, bits.shape[1])
        bits[row, :n] = target[:n]
        bits[row, n:] = 0

    def advance(self, token: int) -> bool:
        """Consumes a sampled id; False when the grammar refuses it."""
        return bool(self._m.consume_token(int(token)))

    def accepting(self) -> bool:
        """Whether what was consumed is a complete output of the grammar."""
        return bool(self._m.is_accepting())

    def error(self) -> str:
        return _one_line(self._m.get_error())


class GrammarVocab:
    """The engine tokenizer's ids as llguidance sees them (HF tokenizers, GGUF ones
    included, via their `tokenizer.json` text; the byte tokenizer via its 256 bytes)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        llg = _llg()
        eos = sorted({int(t) for t in getattr(tokenizer, "eos_token_ids", ()) or ()}
                     | ({int(tokenizer.eos_id)} if tokenizer.eos_id is not None else set()))
        if not eos:
            raise RequestError("response_format needs a tokenizer with an EOS id",
                               param="response_format")
        hf = getattr(tokenizer, "tokenizer", None)
        n = max(int(vocab_size), int(tokenizer.vocab_size))
        if hf is not None and hasattr(hf, "to_str"):
            try:
                self.tokenizer = llg.LLTokenizer(hf.to_str(), n_vocab=n, eos_token=eos)
            except ValueError as e:  # A decoder llguidance does not read (e.g. Metaspace).
                raise RequestError(f"response_format: llguidance cannot read this "
                                   f"tokenizer ({_one_line(str(e))})",
                                   param="response_format") from e
        elif isinstance(tokenizer, ByteTokenizer):
            wrapper = llg.TokenizerWrapper(_ByteTokens(n))
            self.tokenizer = llg.LLTokenizer(wrapper, n_vocab=n, eos_token=eos)
        else:
            raise RequestError(
                f"response_format needs an HF or byte tokenizer; this engine has "
                f"{type(tokenizer).__name__}", param="response_format")
        self.words = (n + 31) // 32

    def matcher(self, grammar: str) -> Matcher:
        llg = _llg()
        m = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if not m.is_error():  # Some grammars (a $ref loop) fail at their first mask.
            first = np.zeros(self.words, np.int32)
            m.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
        if m.is_error():
            raise RequestError(f"'response_format': the schema admits no output: "
                               f"{_one_line(m.get_error())[:300]}", param="response_format")
        return Matcher(m, self.words)


def fill_masks(matchers: list[Optional[Matcher]], rows: int, words: int
               ) -> Optional[np.ndarray]:
    """Bit rows [rows, words] int32 for a call (all ones for rows without a grammar), or
    None when no row has one (the runner then passes all ones: the same program, whose
    mask step is skipped at run time)."""
    if not any(m is not None for m in matchers):
        return None
    bits = np.full((rows, words), -1, np.int32)
    for i, m in enumerate(matchers):
        if m is not None:
            m.fill(bits, i)
    return bits


def allowed_logits(logits: Array, bits: Array) -> Array:
    """logits [b, v] f32 with -inf where bits [b, words] int32 has a 0 bit."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    on = (bits.astype(jnp.uint32)[:, :, None] >> shifts) & 1  # [b, words, 32]
    allowed = on.reshape(bits.shape[0], -1)[:, : logits.shape[-1]].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


__all__ = ["GrammarVocab", "Matcher", "allowed_logits", "check_grammar", "fill_masks",
           "response_format_grammar"]
