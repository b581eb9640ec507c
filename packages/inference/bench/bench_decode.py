"""Decode benchmark of the inference engine (JSON lines on stdout).

    PYTHONPATH=$(printf '%s:' packages/*/src) .venv/bin/python \
        packages/inference/bench/bench_decode.py [--dim 256 --layers 4 --dtype bfloat16]

Cases (a random Llama-style model; numbers are wall time on whatever this host is):
- prefill: latency of one prompt's prefill (+ first token) at several lengths;
- decode: per-token latency and tokens/s with 1, 4, 16 concurrent greedy requests, with
  the fused decode loop (`decode_burst`) and with one step per call;
- continuous: throughput of 32 requests with mixed prompt (8..max_seq_len - 64) and
  output (8..64) lengths arriving over 100 steps, and their mean / p90 time to first token.
Compilation happens in a warm-up pass and is reported separately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from jaxlearn.inference import Engine, SamplingParams
from jaxlearn.layers import llama_config


def emit(**kw):
    print(json.dumps(kw), flush=True)


def build(args, *, max_batch, decode_burst):
    cfg = llama_config(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, args.ffn,
                       rope_theta=10000.0, stack=args.stack, dtype=args.dtype)
    params = cfg.instantiate().initialize_parameters_recursively(jax.random.PRNGKey(0))
    settings = Engine.default_config().set(max_seq_len=args.max_seq_len, max_batch=max_batch,
                                           prefill_chunk=args.prefill_chunk,
                                           decode_burst=decode_burst, max_queue=1024)
    return settings.instantiate(model_cfg=cfg, params=params, tokenizer=None)


def prompt(rng, n, vocab):
    return rng.integers(3, min(vocab, 259), size=n).tolist()


def run_all(engine, reqs):
    for r in reqs:
        engine.scheduler.submit(r)
    while not all(r.done for r in reqs):
        engine.scheduler.step()


def bench_prefill(args, rng):
    eng = build(args, max_batch=1, decode_burst=1)
    p1 = SamplingParams(max_new_tokens=1, ignore_eos=True)
    for n in args.prefill_lengths:
        ids = prompt(rng, n, args.vocab)
        t0 = time.perf_counter()
        run_all(eng, [eng.scheduler.make_request(ids, p1)])
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run_all(eng, [eng.scheduler.make_request(ids, p1)])
            times.append(time.perf_counter() - t0)
        emit(case="prefill", prompt_tokens=n, chunk=eng.scheduler.prefill_chunk,
             median_ms=round(1e3 * statistics.median(times), 2),
             tokens_per_s=round(n / statistics.median(times), 1),
             first_call_s=round(compile_s, 2))


def bench_decode(args, rng):
    for burst in (args.decode_burst, 1):
        eng = build(args, max_batch=max(args.batches), decode_burst=burst)
        for b in args.batches:
            params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)

            def once():
                reqs = [eng.scheduler.make_request(prompt(rng, args.prompt_len, args.vocab),
                                                   params) for _ in range(b)]
                for r in reqs:
                    eng.scheduler.submit(r)
                while not all(r.state == "decode" or r.done for r in reqs):
                    eng.scheduler.step()
                start = [r.num_generated for r in reqs]
                t0 = time.perf_counter()
                while not all(r.done for r in reqs):
                    eng.scheduler.step()
                dt = time.perf_counter() - t0
                steps = max(r.num_generated - s for r, s in zip(reqs, start))
                return dt, steps

            t0 = time.perf_counter()
            once()  # Compiles this batch's programs.
            compile_s = time.perf_counter() - t0
            runs = [once() for _ in range(args.repeats)]
            dt, steps = sorted(runs)[len(runs) // 2]
            emit(case="decode", batch=b, decode_burst=burst, new_tokens=steps,
                 ms_per_token=round(1e3 * dt / steps, 3),
                 tokens_per_s=round(b * steps / dt, 1), first_call_s=round(compile_s, 2))


def bench_continuous(args, rng):
    eng = build(args, max_batch=args.cb_slots, decode_burst=args.decode_burst)
    n = args.cb_requests
    lens = rng.integers(8, args.max_seq_len - 64, size=n)
    outs = rng.integers(8, 65, size=n)
    arrivals = np.sort(rng.integers(0, args.cb_arrival_steps, size=n))

    def once():
        reqs = [eng.scheduler.make_request(prompt(rng, int(ln), args.vocab),
                                           SamplingParams(max_new_tokens=int(o), ignore_eos=True))
                for ln, o in zip(lens, outs)]
        pending = list(zip(arrivals, reqs))
        step = 0
        t0 = time.perf_counter()
        while pending or not all(r.done for r in reqs):
            while pending and pending[0][0] <= step:
                eng.scheduler.submit(pending.pop(0)[1])
            eng.scheduler.step()
            step += 1
        dt = time.perf_counter() - t0
        ttft = [r.first_token_at - r.arrival for r in reqs]
        return dt, ttft, step

    t0 = time.perf_counter()
    once()
    warm = time.perf_counter() - t0
    dt, ttft, steps = once()
    gen = int(outs.sum())
    emit(case="continuous", requests=n, slots=args.cb_slots, prompt_tokens=int(lens.sum()),
         generated_tokens=gen, wall_s=round(dt, 2), generated_tokens_per_s=round(gen / dt, 1),
         total_tokens_per_s=round((gen + int(lens.sum())) / dt, 1), steps=steps,
         ttft_mean_ms=round(1e3 * statistics.mean(ttft), 1),
         ttft_p90_ms=round(1e3 * float(np.percentile(ttft, 90)), 1),
         first_pass_s=round(warm, 2))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--stack", default="scan", choices=["scan", "loop"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--max_seq_len", type=int, default=256)
    p.add_argument("--prefill_chunk", type=int, default=128)
    p.add_argument("--decode_burst", type=int, default=8)
    p.add_argument("--prefill_lengths", type=int, nargs="+", default=[32, 200])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cb_requests", type=int, default=32)
    p.add_argument("--cb_slots", type=int, default=8)
    p.add_argument("--cb_arrival_steps", type=int, default=100)
    p.add_argument("--cases", nargs="+", default=["prefill", "decode", "continuous"])
    args = p.parse_args()
    emit(case="setup", backend=jax.default_backend(), devices=jax.device_count(),
         jax=jax.__version__, **{k: v for k, v in vars(args).items() if k != "cases"})
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for case in args.cases:
        {"prefill": bench_prefill, "decode": bench_decode, "continuous": bench_continuous}[
            case](args, rng)
    emit(case="done", total_s=round(time.perf_counter() - t0, 1))


if __name__ == "__main__":
    main()
