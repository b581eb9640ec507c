"""A/B of two decode engines in one process, generate calls interleaved.

    python jl_decode_ab.py --dtype bf16 --batches 1,4,16 \
        [--compare attention|fuse|layout|packed|spin]

Two engines on the ~60M Llama (as `jl_decode.py --case latency`). `--compare attention`:
the block of `paged.attend_pages`' loop, `block64` (64 positions) vs `block256`
(`paged.BLOCK_POSITIONS`, read when the programs are traced). `--compare fuse`:
`Engine.Config.fuse_projections=False` (`base`) vs True (`fused`: one q/k/v
and one gate/up matmul per layer). (A third A/B, bf16 decode matmuls on oneDNN through a
custom call, measured 0.85-0.90x of XLA's own dots in the whole step, results/
decode_ab.jsonl; it was removed with the kernel.)
`--compare packed`: `xla`, dense weights on XLA's dot in their trained layout, vs `packed`
(`weight_layout="packed"`: the packed GEMM, `kernels.mkl.backend_for`'s backend).
`--compare spin`: the same default engine twice, the kernels' pool spin
(`kernels.set_pool_spin_us`) 0 vs `--spin_us`, set before each variant's calls.
`--compare layout`: `in_out`, dense weights in their trained [in, out] layout, vs
`out_in`, stored [out, in] (`Engine.Config.weight_layout`; "auto", the default, picks
`out_in` for bf16 weights on one CPU device). Per
batch and round, each engine runs a 1-token and a (1 + --new)-token generate call;
ms/token is the differential of the medians, as in jl_decode.py; `speedup` is the first
variant's ms/token over the second's. (That the variants give the same logits is
tested: packages/layers/tests/test_paged.py and test_composition_helpers.py,
packages/kernels/tests/test_paged.py.)
"""

from __future__ import annotations

import argparse
from typing import Any

from common import emit, log, med, model_cfg, rnd
from jl_decode import build_engine, generate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compare", default="attention",
                   choices=["attention", "fuse", "layout", "packed", "spin"])
    p.add_argument("--spin_us", type=int, default=300,
                   help="--compare spin: the spin of the 'spin' variant")
    args = p.parse_args()
    import jax
    import numpy as np

    from jaxlearn import kernels
    from jaxlearn.kernels import paged

    c = model_cfg("llama")
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    prompts = {b: [rng.integers(0, c["vocab"], args.prompt).tolist() for _ in range(b)]
               for b in batches}
    engines: dict[str, Any] = {}
    block = paged.BLOCK_POSITIONS
    # (name, attention block, fused projections, weight layout) of each variant.
    variants = {"attention": [("block64", 64, False, "auto"), ("block256", 256, False, "auto")],
                "fuse": [("base", block, False, "auto"), ("fused", block, True, "auto")],
                "layout": [("in_out", block, False, "in_out"),
                           ("out_in", block, False, "out_in")],
                "packed": [("xla", block, None, "in_out"), ("packed", block, None, "packed")],
                "spin": [("nospin", block, None, "auto"), ("spin", block, None, "auto")],
                }[args.compare]
    # --compare spin: the kernels' pool spin (a process setting) set before each variant's
    # calls: 0 against --spin_us.
    spins = {"nospin": 0, "spin": args.spin_us} if args.compare == "spin" else {}
    for name, positions, fuse, layout in variants:
        paged.BLOCK_POSITIONS = positions  # Read when the engine's programs are traced.
        eng = build_engine(c, args.dtype, max_batch=max(batches),
                           max_seq_len=args.prompt + args.new + 1, decode_burst=8,
                           fuse_projections=fuse, weight_layout=layout)
        for b in batches:  # Compile every program this engine runs below.
            generate(eng, prompts[b], [1] * b)
            generate(eng, prompts[b], [1 + args.new] * b)
        engines[name] = eng
    paged.BLOCK_POSITIONS = block
    rows_out = []
    for b in batches:
        t1: dict[str, list[float]] = {n: [] for n in engines}
        tn: dict[str, list[float]] = {n: [] for n in engines}
        for _ in range(args.rounds):
            for n, eng in engines.items():
                if n in spins:
                    kernels.set_pool_spin_us(spins[n], over_env=True)
                t1[n].append(generate(eng, prompts[b], [1] * b))
                tn[n].append(generate(eng, prompts[b], [1 + args.new] * b))
        ms = {n: 1e3 * (med(tn[n]) - med(t1[n])) / args.new for n in engines}
        first, second = (v[0] for v in variants)
        row = {"batch": b, f"{first}_ms_per_token": rnd(ms[first]),
               f"{second}_ms_per_token": rnd(ms[second]),
               "speedup": rnd(ms[first] / ms[second])}
        log(f"decode A/B {args.dtype} B{b}: {row}")
        rows_out.append(row)
    emit(bench="decode_ab", compare=args.compare, dtype=args.dtype, prompt=args.prompt,
         new_tokens=args.new, rounds=args.rounds, version=jax.__version__, rows=rows_out)


if __name__ == "__main__":
    main()
