"""jaxlearn decode through the inference `Engine` (continuous-batching scheduler, paged KV
cache, batched prefill, fused decode bursts) on the ~60M Llama, greedy.

    python jl_decode.py --case latency --dtype f32      # prefill, per-token at B 1/4/16
    python jl_decode.py --case continuous --dtype bf16  # mixed prompt/output lengths

Per-token latency is differential, like the peer's: (time to generate 1 + N tokens - time
to generate 1 token) / N, with B identical-length prompts submitted together. bf16 means
bf16 weights and compute (the peer: `model.to(torch.bfloat16)`); `--quantize int8` serves
int8 weights (`Engine.Config.quantize`). `--trace` adds, per batch, where one generate
call's XLA op time goes (`ops`; the suite's latency runs use it).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional, Sequence

from common import emit, log, med, model_cfg, rnd
from decode_common import continuous_workload


def build_engine(c: dict[str, Any], dtype: str, *, max_batch: int, max_seq_len: int,
                 decode_burst: int, quantize: Any = None,
                 fuse_projections: Optional[bool] = None,
                 weight_layout: str = "auto") -> Any:
    import jax
    import jax.numpy as jnp

    from jaxlearn.inference import Engine
    from jaxlearn.layers import llama_config

    cfg = llama_config(c["vocab"], c["dim"], c["layers"], c["heads"], c["kv_heads"], c["ffn"],
                       rope_theta=c["rope_theta"], norm_eps=c["norm_eps"], stack="loop",
                       dtype="bfloat16" if dtype == "bf16" else None)
    params = cfg.clone(name="model").instantiate().initialize_parameters_recursively(
        jax.random.PRNGKey(0))
    if dtype == "bf16":
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    # No tokenizer: token ids in and out over the model's whole vocabulary, no BOS/EOS.
    settings = Engine.default_config().set(max_seq_len=max_seq_len, max_batch=max_batch,
                                           prefill_chunk=256, decode_burst=decode_burst,
                                           max_queue=4096, quantize=quantize,
                                           fuse_projections=fuse_projections,
                                           weight_layout=weight_layout)
    return settings.instantiate(model_cfg=cfg, params=params, tokenizer=None)


def generate(engine: Any, prompts: list[list[int]], new_tokens: Sequence[int]) -> float:
    """Wall seconds to finish all prompts (submitted together) with these output lengths."""
    from jaxlearn.inference import SamplingParams

    sched = engine.scheduler
    reqs = [sched.make_request(p, SamplingParams(max_new_tokens=int(n), ignore_eos=True))
            for p, n in zip(prompts, new_tokens)]
    t0 = time.perf_counter()
    for r in reqs:
        sched.submit(r)
    while not all(r.done for r in reqs):
        sched.step()
    dt = time.perf_counter() - t0
    got = [r.num_generated for r in reqs]
    assert got == [int(n) for n in new_tokens], (got, new_tokens)
    return dt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="latency", choices=["latency", "continuous"])
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-burst", type=int, default=8)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--trace", action="store_true",
                   help="latency case: also profile one generate call per batch (XLA op ms by "
                        "category, `jl_profile.trace_op_ms`), emitted as `ops` per row")
    p.add_argument("--quantize", default=None, choices=["int8"],
                   help="Engine.Config.quantize: int8 weights (dynamic int8 activations)")
    args = p.parse_args()
    import jax
    import numpy as np

    c = model_cfg("llama")
    rng = np.random.default_rng(0)
    base = dict(bench="decode", framework="jaxlearn", version=jax.__version__, case=args.case,
                dtype=args.dtype, decode_burst=args.decode_burst, quantize=args.quantize)
    if args.quick:
        args.repeats, args.new = 2, 32
    if args.case == "latency":
        batches = [int(b) for b in args.batches.split(",")]
        eng = build_engine(c, args.dtype, max_batch=max(batches),
                           max_seq_len=args.prompt + args.new + 1,
                           decode_burst=args.decode_burst, quantize=args.quantize)
        rows = []
        for b in batches:
            prompts = [rng.integers(0, c["vocab"], args.prompt).tolist() for _ in range(b)]
            t0 = time.perf_counter()
            generate(eng, prompts, [1] * b)  # Compiles prefill (and a decode program).
            generate(eng, prompts, [1 + args.new] * b)
            first = time.perf_counter() - t0
            t1 = [generate(eng, prompts, [1] * b) for _ in range(args.repeats)]
            tn = [generate(eng, prompts, [1 + args.new] * b) for _ in range(args.repeats)]
            per_tok = (med(tn) - med(t1)) / args.new
            row = dict(batch=b, prompt=args.prompt, new_tokens=args.new,
                       prefill_ms=rnd(1e3 * med(t1)), ms_per_token=rnd(1e3 * per_tok),
                       tokens_per_s=rnd(b / per_tok), e2e_s=rnd(med(tn)),
                       e2e_new_tokens_per_s=rnd(b * (1 + args.new) / med(tn)),
                       first_call_s=rnd(first))
            if args.trace:
                from jl_profile import trace_op_ms

                row["ops"] = trace_op_ms(lambda: generate(eng, prompts, [1 + args.new] * b))
            log(f"jaxlearn decode {args.dtype} B{b}: {row}")
            rows.append(row)
        r = eng.runner
        emit(**base, rows=rows, cache_bytes=r.cache_bytes(), cache_len=r.max_len,
             kv_pool_tokens=(r.num_pages - 1) * r.page_size, page_size=r.page_size)
    else:
        prompts, outs, slots = continuous_workload(c["vocab"], quick=args.quick)
        eng = build_engine(c, args.dtype, max_batch=slots,
                           max_seq_len=max(map(len, prompts)) + max(outs) + 1,
                           decode_burst=args.decode_burst, quantize=args.quantize)
        t0 = time.perf_counter()
        generate(eng, prompts, outs)  # Warm-up: compiles every program the workload needs.
        warm = time.perf_counter() - t0
        times = [generate(eng, prompts, outs) for _ in range(max(1, args.repeats - 1))]
        dt = med(times)
        emit(**base, requests=len(prompts), slots=slots, prompt_tokens=sum(map(len, prompts)),
             generated_tokens=int(sum(outs)), wall_s=rnd(dt),
             generated_tokens_per_s=rnd(sum(outs) / dt), first_pass_s=rnd(warm),
             times=[rnd(t) for t in times])


if __name__ == "__main__":
    main()
