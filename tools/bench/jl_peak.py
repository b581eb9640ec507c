"""jaxlearn side of the peaks: jitted matmul FLOP/s (f32, bf16 x bf16 -> f32, bf16 -> bf16)
at n x n, and memory read bandwidth (jitted sum over `--gib` GiB of f32)."""

from __future__ import annotations

import argparse

from common import emit, med, rnd, time_calls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--gib", type=float, default=1.0)
    args = p.parse_args()
    import jax
    import jax.numpy as jnp

    n = args.n
    k1, k2 = jax.random.split(jax.random.key(0))
    a32 = jax.random.normal(k1, (n, n), jnp.float32)
    b32 = jax.random.normal(k2, (n, n), jnp.float32)
    a16, b16 = a32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16)
    cases = {
        "f32": (jax.jit(lambda a, b: a @ b), a32, b32),
        "bf16_f32acc": (jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)),
                        a16, b16),
        "bf16": (jax.jit(lambda a, b: a @ b), a16, b16),
    }
    out = {}
    for name, (f, a, b) in cases.items():
        f(a, b).block_until_ready()
        times, util = time_calls(lambda: f(a, b).block_until_ready(), args.repeats)
        out[f"matmul_{name}_gflops"] = rnd(2 * n**3 / med(times) / 1e9)
        out[f"matmul_{name}_cpu_util"] = rnd(util, 3)
    elems = int(args.gib * 2**30) // 4
    x = jnp.ones((elems,), jnp.float32)
    s = jax.jit(jnp.sum)
    s(x).block_until_ready()
    times, util = time_calls(lambda: s(x).block_until_ready(), max(5, args.repeats // 2))
    out["read_bw_gbs"] = rnd(elems * 4 / med(times) / 1e9)
    out["read_bw_best_gbs"] = rnd(elems * 4 / min(times) / 1e9)  # The limit: best repeat.
    out["read_bw_cpu_util"] = rnd(util, 3)
    emit(bench="peak", framework="jaxlearn", version=jax.__version__, n=n, gib=args.gib, **out)


if __name__ == "__main__":
    main()
