"""Per-call cost of the penalty / logit-bias and logprobs paths on an engine decode step.

    tools/jaxlearn python tools/bench/jl_sampling_overhead.py [--vocab 49152] [--rows 8]

A SmolLM2-135M-shaped model (random weights; dim 576, 30 layers, 9 heads / 3 kv heads,
ffn 1536) serves `rows` decoding requests; one decode step (and a fused burst of 8) is
timed (median of --repeats calls, interleaved across cases, after warm-up) for: no
request using any feature (the baseline every such batch runs), one row with presence /
frequency penalties and a logit bias, one row with logprobs=1, one row with logprobs=20.
Prints one JSON line per case with the milliseconds per token step and what it adds to
the baseline. The added time does not depend on the layers (`--layers 2` isolates it
from a noisy machine).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

import jax
import numpy as np

from jaxlearn.decoding.penalties import pack
from jaxlearn.inference import Engine, SamplingParams
from jaxlearn.layers import llama_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    cfg = llama_config(args.vocab, 576, args.layers, 9, 3, 1536, rope_theta=1e4,
                       tie_embeddings=True)
    params = cfg.clone(name="model").instantiate().initialize_parameters_recursively(
        jax.random.PRNGKey(0))
    eng = Engine.default_config().set(max_seq_len=256, max_batch=args.rows).instantiate(
        model_cfg=cfg, params=params, tokenizer=None)
    runner, rows = eng.runner, args.rows
    tables = np.arange(1, rows * 16 + 1, dtype=np.int32).reshape(rows, 16)
    plain = SamplingParams()
    cases = {
        "baseline": [plain] * rows,
        "penalties+bias (1 row)": [SamplingParams(presence_penalty=0.5, frequency_penalty=0.5,
                                                  logit_bias=((5, 3.0), (9, -100.0)))]
        + [plain] * (rows - 1),
        "logprobs=1 (1 row)": [SamplingParams(logprobs=1)] + [plain] * (rows - 1),
        "logprobs=20 (1 row)": [SamplingParams(logprobs=20)] + [plain] * (rows - 1),
    }
    samp = {"temperature": [0.0] * rows, "top_k": [0] * rows, "top_p": [1.0] * rows,
            "penalty": [1.0] * rows, "seeds": [0] * rows, "index": [0] * rows}
    for steps in (1, 8):
        calls = {name: _call(runner, rows, tables, samp, ps, steps) for name, ps in cases.items()}
        for fn in calls.values():  # Compile and warm up.
            fn()
            fn()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeats):  # Interleaved, so load changes hit every case alike.
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        base = 1e3 * float(np.median(times["baseline"])) / steps
        for name, ts in times.items():
            ms = 1e3 * float(np.median(ts)) / steps
            print(json.dumps({"case": name, "rows": rows, "vocab": args.vocab,
                              "layers": args.layers, "steps": steps,
                              "ms_per_step": round(ms, 3), "added_ms": round(ms - base, 3),
                              "overhead_pct": round(100 * (ms / base - 1), 1)}), flush=True)


def _call(runner: Any, rows: int, tables: np.ndarray, samp: dict[str, list[Any]],
          ps: list[SamplingParams], steps: int) -> Callable[[], None]:
    pen = pack(ps, rows, runner.vocab_size)
    samp = dict(samp, logprobs=[p.logprobs is not None for p in ps])

    def call() -> None:
        runner.decode(steps=steps, slots=list(range(rows)), tables=tables,
                      ids=[3] * rows, time_step=[100] * rows, sampling=samp, penalties=pen)

    return call


if __name__ == "__main__":
    main()
