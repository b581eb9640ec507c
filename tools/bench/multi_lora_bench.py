"""Many LoRA adapters in one batch (`Engine.Config.max_loras`): decode throughput of a batch
mixing 4 adapters against the base model alone at the same concurrency, the memory of one
more adapter slot, and the time `Engine.load_adapter` takes.

    tools/jaxlearn python tools/bench/multi_lora_bench.py [--dim 256] [--layers 4]
        [--concurrency 8] [--new_tokens 64] [--rank 16] [--repeats 3]

A random Llama (vocab 2048, `--dim`, `--layers`, 4 heads / 2 KV heads, FFN 2 x dim, f32,
scan stack), no tokenizer, greedy, EOS ignored. Three engines of the same settings:
`base` (max_loras=0), `banks_base` (max_loras=4, every request on the base model: the cost
of the banks when no row uses them) and `mixed` (max_loras=4, requests assigned round
robin to 4 adapters of rank `--rank` on every attention and dense FFN projection).
`--concurrency` requests of 32 prompt ids each generate `--new_tokens` tokens together;
each engine runs the workload once to compile, then the engines alternate `--repeats`
times and tok/s is the median. Memory: the bytes of the params of `mixed` minus those of
`base`, per adapter slot (max_loras + 1 slots, slot 0 empty). Load time: the median of
`--repeats` unload + load cycles of one adapter (the host-to-bank conversion and the
device writes; nothing compiles). One JSON line per measurement, then a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import host_cpu  # noqa: E402


def model(dim: int, layers: int) -> tuple[Any, Any]:
    import jax

    from jaxlearn.layers import llama_config

    cfg = llama_config(2048, dim, layers, 4, 2, 2 * dim, rope_theta=1e4, stack="scan")
    params = cfg.clone(name="model").instantiate().initialize_parameters_recursively(
        jax.random.PRNGKey(0))
    return cfg, params


def adapter(cfg: Any, rank: int, seed: int) -> Any:
    """The params of a LoRA model on `cfg` with random, non-zero adapters (alpha 2 x rank)."""
    import jax

    from jaxlearn.layers import use_lora

    lcfg = use_lora(cfg.clone(name="model"), rank=rank, alpha=2.0 * rank)
    p = lcfg.instantiate().initialize_parameters_recursively(jax.random.PRNGKey(seed))
    key = jax.random.PRNGKey(seed + 1)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (0.02 * jax.random.normal(key, x.shape, x.dtype)
                         if "lora_b" in jax.tree_util.keystr(path) else x), p)


def nbytes(tree: Any) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def workload(engine: Any, prompts: list[list[int]], new_tokens: int,
             adapters: list[Any]) -> float:
    """Seconds to run every prompt to `new_tokens` tokens, prompt i on adapters[i % n]."""
    from jaxlearn.inference import SamplingParams

    sched = engine.scheduler
    reqs = [sched.make_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True,
                                                 adapter=adapters[i % len(adapters)]))
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for r in reqs:
        sched.submit(r)
    while not all(r.done for r in reqs):
        sched.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import jax

    from jaxlearn.inference import Engine

    cfg, params = model(args.dim, args.layers)
    settings = dict(max_seq_len=32 + args.new_tokens + 16, max_batch=args.concurrency,
                    prefill_chunk=128, decode_burst=8, prefix_caching=False)

    def build(loras: int) -> Any:
        c = Engine.default_config().set(max_loras=loras, max_lora_rank=args.rank, **settings)
        return c.instantiate(model_cfg=cfg, params=params, tokenizer=None)

    engines = {"base": build(0), "banks_base": build(args.adapters),
               "mixed": build(args.adapters)}
    names = [f"a{i}" for i in range(args.adapters)]
    lora = [adapter(cfg, args.rank, seed) for seed in range(1, args.adapters + 1)]
    for name, p in zip(names, lora):
        engines["mixed"].load_adapter(name, args.rank, 2.0 * args.rank, p)
    which: dict[str, list[Any]] = {"base": [None], "banks_base": [None], "mixed": names}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 2048, 32).tolist() for _ in range(args.concurrency)]
    for key, eng in engines.items():  # Compiles every program of the workload.
        workload(eng, prompts, args.new_tokens, which[key])
    secs: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.repeats):
        for key, eng in engines.items():
            secs[key].append(workload(eng, prompts, args.new_tokens, which[key]))
    tokens = args.concurrency * args.new_tokens
    tok_s = {k: float(np.median([tokens / s for s in v])) for k, v in secs.items()}
    for key in engines:
        print(json.dumps({"bench": "multi_lora", "engine": key, "adapters": which[key],
                          "concurrency": args.concurrency, "new_tokens": args.new_tokens,
                          "tok_s": round(tok_s[key], 1),
                          "seconds": [round(s, 3) for s in secs[key]]}), flush=True)

    mixed = engines["mixed"]
    extra = nbytes(mixed.runner.params) - nbytes(engines["base"].runner.params)
    per_slot = extra / (args.adapters + 1)
    loads = []
    for _ in range(args.repeats):
        mixed.unload_adapter(names[0])
        t0 = time.perf_counter()
        mixed.load_adapter(names[0], args.rank, 2.0 * args.rank, lora[0])
        jax.block_until_ready(mixed.runner.params)
        loads.append(time.perf_counter() - t0)
    print(json.dumps({
        "bench": "multi_lora", "summary": True, "host": host_cpu(), "dim": args.dim,
        "layers": args.layers, "rank": args.rank, "adapters": args.adapters,
        "mixed_over_base_tok_s": round(tok_s["mixed"] / tok_s["base"], 3),
        "banks_base_over_base_tok_s": round(tok_s["banks_base"] / tok_s["base"], 3),
        "base_params_mib": round(nbytes(engines["base"].runner.params) / 2**20, 2),
        "bytes_per_adapter_slot": int(per_slot),
        "adapter_params_mib": round(per_slot / 2**20, 3),
        "load_adapter_s_median": round(float(np.median(loads)), 4),
        "compiled_late": mixed.runner.compiled_late,
    }), flush=True)


if __name__ == "__main__":
    main()
