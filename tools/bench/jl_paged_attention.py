"""Paged attention over a KV page pool: XLA's loop (`kernels.paged.attend_pages`) against
the native FFI kernel (`kernels.paged_native`), same pool, same pages, same run.

    python jl_paged_attention.py                       # SmolLM2-135M shapes, bf16 pool
    python jl_paged_attention.py --rows 8,32 --context 900,1000 --dtype f32

Each case runs one jitted program that attends `layers` times over a stacked pool
[layers, pages, kv, ...] (a `fori_loop`, each layer's query depending on the previous
output, as a decoder's do), like one decode step (1 query per row) or one prefill chunk.
Pages are handed out like the engine's allocator hands them out to rows that grew at
the same time (interleaved, --table interleaved) or shuffled (--table random). Both
kernels of a case are compiled first, then timed round-robin (A B A B), one call each per
round; the record holds the median ms per program and the ratio xla / native.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from common import emit, log, med, rnd

SHAPES = {"smollm2-135m": dict(layers=30, heads=9, kv_heads=3, head_dim=64)}


def build(kernel: str, rows: int, queries: int, shape: dict[str, int]) -> Any:
    import jax
    import jax.numpy as jnp

    from jaxlearn.kernels import paged

    @jax.jit
    def step(q: Any, kp: Any, vp: Any, table: Any, q_index: Any, kv_end: Any) -> Any:
        def body(i: Any, acc: Any) -> Any:
            return acc + paged.attend_pages(q + acc, kp, vp, table, q_index, kv_end,
                                            scale=shape["head_dim"] ** -0.5, layer=i,
                                            kernel=kernel)
        return jax.lax.fori_loop(0, shape["layers"], body, jnp.zeros_like(q))

    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m", choices=list(SHAPES))
    p.add_argument("--rows", default="1,8,16,32")
    p.add_argument("--context", default="200,250", help="low,high positions per row")
    p.add_argument("--prefill", default="256", help="prefill chunk lengths (one row)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pool-tokens", type=int, default=65536)
    p.add_argument("--table", default="interleaved", choices=["interleaved", "random"])
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxlearn.kernels import paged
    from jaxlearn.kernels.paged_native import unavailable_reason

    if (why := unavailable_reason()) is not None:
        raise SystemExit(f"jl_paged_attention.py: the native kernel cannot run here: {why}")
    shape = SHAPES[args.model]
    ps, kv, d, h = args.page_size, shape["kv_heads"], shape["head_dim"], shape["heads"]
    pages = args.pool_tokens // ps + 1
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32

    def pool(layout: str) -> Any:
        x = paged.init_pool(pages, ps, kv, d, dtype, layout)
        x = jnp.broadcast_to(x, (shape["layers"], *x.shape))
        vals = jnp.asarray(rng.standard_normal(x.shape, np.float32), dtype)
        return (jax.lax.bitcast_convert_type(vals, jnp.uint16) if dtype == jnp.bfloat16
                else vals)

    kp, vp = pool("kdt"), pool("ktd")
    lo, hi = (int(v) for v in args.context.split(","))
    cases = [(r, 1, lo, hi) for r in (int(v) for v in args.rows.split(","))]
    cases += [(1, int(s), 0, 0) for s in args.prefill.split(",") if s]
    rows_out = []
    for rows, queries, lo_c, hi_c in cases:
        n = -(-max(hi_c, queries) // ps)
        order = rng.permutation(pages - 1) + 1 if args.table == "random" else (
            np.arange(pages - 1) + 1)
        # Interleaved: page j of row b is the j-th allocation round's b-th page.
        table = order[: rows * n].reshape(n, rows).T if args.table == "interleaved" else (
            order[: rows * n].reshape(rows, n))
        if queries == 1:
            kv_end = rng.integers(lo_c, hi_c + 1, (rows,)).astype(np.int32)
            q_index = kv_end[:, None] - 1
        else:
            kv_end = np.full((rows,), queries, np.int32)
            q_index = np.arange(queries, dtype=np.int32)[None].repeat(rows, 0)
        q = jnp.asarray(rng.standard_normal((rows, queries, h, d), np.float32), dtype)
        inputs = (q, kp, vp, jnp.asarray(table, jnp.int32), jnp.asarray(q_index),
                  jnp.asarray(kv_end))
        fns = {k: build(k, rows, queries, shape) for k in paged.KERNELS}
        for fn in fns.values():
            fn(*inputs).block_until_ready()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn(*inputs).block_until_ready()
                times[k].append(time.perf_counter() - t0)
        row = dict(rows=rows, queries=queries, context=[lo_c, hi_c] if queries == 1 else None,
                   **{f"{k}_ms": rnd(1e3 * med(v)) for k, v in times.items()})
        row["xla_over_native"] = rnd(row["xla_ms"] / row["native_ms"], 3)
        log(f"rows={rows:<3d} queries={queries:<4d} xla {row['xla_ms']:8.2f} ms  native "
            f"{row['native_ms']:8.2f} ms  x{row['xla_over_native']}")
        rows_out.append(row)
    emit(bench="paged_attention", framework="jaxlearn", version=jax.__version__,
         model=args.model, dtype=args.dtype, page_size=ps, pool_tokens=args.pool_tokens,
         table=args.table, layers=shape["layers"], rows=rows_out)


if __name__ == "__main__":
    main()
