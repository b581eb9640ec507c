"""Sliding-window page release (`Engine.Config.window_page_release`): peak KV pages in
use and decode tok/s of a long generation, with and without release.

    tools/jaxlearn python tools/bench/jl_window_pages.py [--new_tokens 768] [--requests 4]

A random Mistral-style Llama (every layer windowed; vocab 2048, dim 256, 4 layers, 4 heads
/ 2 KV heads, f32, window 128, pages of 16), no tokenizer. `--requests` requests of 32
prompt ids each generate `--new_tokens` greedy tokens together; peak pages in use is
the most `PageTable.num_used` seen after any scheduler step. Two pools: `full` (max_batch
x max_seq_len tokens, nobody is preempted) and `small` (one max_seq_len request's
tokens: without release the requests preempt each other). Each engine runs the workload
once to compile its programs, then the engines alternate, `--repeats` times; tok/s is the
median. One JSON line per (pool, release) and one with the ratios; the tokens of both
engines of a pool are checked equal.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np


def build(release: bool, pool_tokens: int, max_seq_len: int, max_batch: int, window: int) -> Any:
    import jax

    from jaxlearn.inference import Engine
    from jaxlearn.layers import llama_config

    cfg = llama_config(2048, 256, 4, 4, 2, 512, rope_theta=1e4, stack="scan")
    cfg.decoder.transformer.layer.self_attention.sliding_window = window
    params = cfg.clone(name="model").instantiate().initialize_parameters_recursively(
        jax.random.PRNGKey(0))
    settings = Engine.default_config().set(
        max_seq_len=max_seq_len, max_batch=max_batch, prefill_chunk=128, decode_burst=8,
        page_size=16, kv_cache_tokens=pool_tokens, prefix_caching=False,
        window_page_release=release)
    return settings.instantiate(model_cfg=cfg, params=params, tokenizer=None)


def workload(engine: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Runs the requests to the end: wall seconds, peak pages in use, preemptions, tokens."""
    from jaxlearn.inference import SamplingParams

    sched = engine.scheduler
    pre0 = engine.metrics.counter_value("preemptions_total")
    reqs = [sched.make_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            for p in prompts]
    peak = 0
    t0 = time.perf_counter()
    for r in reqs:
        sched.submit(r)
    while not all(r.done for r in reqs):
        sched.step()
        peak = max(peak, sched.pages.num_used)
    dt = time.perf_counter() - t0
    assert sched.pages.num_used == 0
    return {"seconds": dt, "peak_pages": peak, "tokens": [r.output.tokens for r in reqs],
            "preemptions": engine.metrics.counter_value("preemptions_total") - pre0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new_tokens", type=int, default=768)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    max_seq_len = 32 + args.new_tokens
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 2048, 32).tolist() for _ in range(args.requests)]
    pools = {"full": args.requests * max_seq_len, "small": max_seq_len}
    for pool, tokens in pools.items():
        engines = {rel: build(rel, tokens, max_seq_len, args.requests, args.window)
                   for rel in (False, True)}
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for rel, eng in engines.items():  # Compiles every program of the workload.
            workload(eng, prompts, args.new_tokens)
        for _ in range(args.repeats):
            for rel, eng in engines.items():
                runs[rel].append(workload(eng, prompts, args.new_tokens))
        same = runs[False][0]["tokens"] == runs[True][0]["tokens"]
        out = {}
        for rel, rs in runs.items():
            out[rel] = {
                "bench": "window_pages", "pool": pool, "pool_pages": tokens // 16,
                "release": rel, "requests": args.requests, "new_tokens": args.new_tokens,
                "window": args.window, "peak_pages": max(r["peak_pages"] for r in rs),
                "preemptions": rs[0]["preemptions"],
                "decode_tok_s": float(np.median([args.requests * args.new_tokens / r["seconds"]
                                                 for r in rs])),
                "seconds": [round(r["seconds"], 3) for r in rs],
            }
            print(json.dumps(out[rel]), flush=True)
        print(json.dumps({
            "bench": "window_pages", "pool": pool, "same_tokens": same,
            "peak_pages_ratio": out[False]["peak_pages"] / out[True]["peak_pages"],
            "tok_s_ratio": out[True]["decode_tok_s"] / out[False]["decode_tok_s"],
        }), flush=True)


if __name__ == "__main__":
    main()
