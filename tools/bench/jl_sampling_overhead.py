"""Per-call cost of the penalty / logit-bias and logprobs paths on an engine decode step.

    tools/jaxlearn python tools/bench/jl_sampling_overhead.py [--vocab 49152] [--rows 8]

A SmolLM2-135M-shaped model (random weights; dim 576, 30 layers, 9 heads / 3 kv heads,
ffn 1536) serves `rows` decoding requests; one decode step (and a fused burst of 8) is
timed (median of --repeats calls, after warm-up) for: no request using any feature
(the baseline every such batch runs), one row with presence / frequency penalties and a
logit bias, one row with logprobs=1, one row with logprobs=20. Prints one JSON line per
case with the milliseconds per token step and the overhead over the baseline.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from jaxlearn.inference import Engine, SamplingParams
from jaxlearn.inference.logprobs import static_k
from jaxlearn.inference.penalties import pack
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
    base: dict[int, float] = {}
    for name, ps in cases.items():
        for steps in (1, 8):
            def call() -> None:
                runner.decode(steps=steps, mode="greedy", slots=list(range(rows)),
                              tables=tables, ids=[3] * rows, time_step=[100] * rows,
                              sampling=samp, penalties=pack(ps, rows, runner.vocab_size),
                              lp_k=static_k([p.logprobs for p in ps]))
            call()
            call()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            ms = 1e3 * float(np.median(times)) / steps
            base.setdefault(steps, ms)
            print(json.dumps({"case": name, "rows": rows, "vocab": args.vocab, "steps": steps,
                              "ms_per_step": round(ms, 3),
                              "overhead_pct": round(100 * (ms / base[steps] - 1), 1)}),
                  flush=True)


if __name__ == "__main__":
    main()
