"""Small-M matmul (decode GEMV) weight-streaming bandwidth of the formulations JAX has on
XLA:CPU, against the machine's measured stream bandwidth in the same process.

    python jl_gemv.py                          # M 1/4/16, every model's shapes, all forms
    python jl_gemv.py --models smollm2-135m --forms f32_nn,i8_f32_nn --ms 1

Each case multiplies x [M, K] by `copies` distinct weights of one shape (enough copies that
the weight bytes are >= --min-mb, several times the 32 MiB last-level cache, so every call
streams them from DRAM) in one jitted program, as a chain (each matmul takes the previous
one's result, like a decoder's layers; an optimization barrier keeps each weight's convert
in its turn); GB/s = weight bytes (in the storage dtype, scales included) / call time. All
formulations of one (shape, M) are compiled first and then timed round-robin, one call each
per round, with a read-bandwidth sample (jitted `jnp.sum` over --probe-mib MiB) in every
round: `share_of_read` is the median over rounds of GB/s / that round's read GB/s, so load
from other processes cancels out of the ratios. The limit reported at the start and end is
the best of 7 jitted sums over --stream-gib GiB (read only) and numpy's `copyto` (read +
write bytes). Formulations (w: [K, N] "nn", or its transpose [N, K] "nt"; x is f32):

  f32_nn / f32_nt         f32 dot
  f32_hi_nn               f32 dot, precision=HIGHEST
  f32_pad_nn / _nt        f32 dot with M=1 padded to 2 rows (a GEMM, not XLA's GEMV)
  bf16_nn / bf16_nt       bf16 x bf16 dot, preferred_element_type f32
  bf16_pad_nn / _nt       the same with M=1 padded to 2 rows (dense.py's bf16 GEMV path;
                          _nt: the serving engine's bf16 layout, `TransposedWeight`)
  bf16up_nn / bf16up_nt   bf16 weights converted to f32 inside the program, f32 dot
  i8_f32_nn / i8_f32_nt   int8 weights converted to f32, f32 dot, per-column scale after
  i8_bf16_nn / _nt        int8 -> bf16 weights, bf16 x bf16 -> f32 dot, scale after
  i8i8_nn / i8i8_nt       dynamic per-row int8 activations, int8 x int8 -> int32 dot
  red_f32_nt / _nn        broadcast-multiply + reduce (a fusion, not a dot), f32 weights
  red_bf16_nt / _nn       the same on bf16 weights (converted in the fusion)
  red_i8_nt / _nn         the same on int8 weights, scale after
  packed_f32_nn           the packed f32 GEMM (`jaxlearn.kernels.packed_gemm`; its backend
                          `kernels.mkl.backend_for`: oneMKL on Intel, the library's
                          AVX-512 f32 panels on other AVX512F CPUs)
  packed_bf16_nn          the packed bf16 x bf16 -> f32 GEMM (the same choice: oneMKL,
                          AMX tiles or AVX512_BF16 panels)
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from common import emit, log, med, rnd

# (K, N) of the decode matmuls of each model (fused qkv and gate/up, as the Linear layers).
MODELS: dict[str, dict[str, tuple[int, int]]] = {
    "llama-60m": {"qkv": (512, 1536), "o": (512, 512), "gate_up": (512, 2752),
                  "down": (1376, 512), "lm_head": (512, 32000)},
    "smollm2-135m": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072),
                     "down": (1536, 576), "lm_head": (576, 49152)},
    "1b": {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384),
           "down": (8192, 2048), "lm_head": (2048, 49152)},
}
FORMS = ("f32_nn", "f32_nt", "f32_hi_nn", "f32_pad_nn", "f32_pad_nt", "bf16_nn", "bf16_nt",
         "bf16_pad_nn", "bf16_pad_nt",
         "bf16up_nn", "bf16up_nt", "i8_f32_nn", "i8_f32_nt",
         "i8_bf16_nn", "i8_bf16_nt", "i8i8_nn", "i8i8_nt", "red_f32_nt", "red_f32_nn",
         "red_bf16_nt", "red_bf16_nn", "red_i8_nt", "red_i8_nn", "packed_f32_nn",
         "packed_bf16_nn")
# The reduce forms over the non-minor axis are 10-50x slower than any dot: not by default.
DEFAULT_FORMS = tuple(f for f in FORMS if f not in ("red_f32_nn", "red_bf16_nn", "red_i8_nn"))


def _one(form: str) -> tuple[str, Callable[..., Any]]:
    """(weight storage dtype, fn(x [M, K], w, scale [N]) -> [M, N] f32) of a formulation."""
    import jax.numpy as jnp
    from jax import lax

    from jaxlearn.kernels import packed_matmul

    f32, bf16 = jnp.float32, jnp.bfloat16
    nt = form.endswith("_nt")

    def dot(a: Any, w: Any, **kw: Any) -> Any:
        dims = (((1,), (1,)), ((), ())) if nt else (((1,), (0,)), ((), ()))
        return lax.dot_general(a, w, dims, **kw)

    def red(a: Any, w: Any) -> Any:
        return (jnp.sum(a[:, None, :] * w[None], axis=-1) if nt
                else jnp.sum(a[:, :, None] * w[None], axis=1))

    def i8i8(x: Any, w: Any, s: Any) -> Any:
        sx = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127.0
        xq = jnp.round(x / jnp.maximum(sx, 1e-30)).astype(jnp.int8)
        return dot(xq, w, preferred_element_type=jnp.int32).astype(f32) * sx * s

    def pad(x: Any, w: Any, s: Any) -> Any:
        xp = x.astype(w.dtype)
        if xp.shape[0] == 1:
            xp = jnp.concatenate([xp, jnp.zeros_like(xp)], axis=0)
        return dot(xp, w, preferred_element_type=f32)[: x.shape[0]]

    table: dict[str, tuple[str, Callable[..., Any]]] = {
        "f32": ("float32", lambda x, w, s: dot(x, w, preferred_element_type=f32)),
        "f32_hi": ("float32", lambda x, w, s: dot(x, w, precision=lax.Precision.HIGHEST,
                                                   preferred_element_type=f32)),
        "bf16": ("bfloat16", lambda x, w, s: dot(x.astype(bf16), w, preferred_element_type=f32)),
        "f32_pad": ("float32", pad),
        "bf16_pad": ("bfloat16", pad),
        "bf16up": ("bfloat16", lambda x, w, s: dot(x, w.astype(f32))),
        "i8_f32": ("int8", lambda x, w, s: dot(x, w.astype(f32)) * s),
        "i8_bf16": ("int8", lambda x, w, s: dot(x.astype(bf16), w.astype(bf16),
                                               preferred_element_type=f32) * s),
        "i8i8": ("int8", i8i8),
        "red_f32": ("float32", lambda x, w, s: red(x, w)),
        "red_bf16": ("bfloat16", lambda x, w, s: red(x, w.astype(f32))),
        "red_i8": ("int8", lambda x, w, s: red(x, w.astype(f32)) * s),
        # w is the id of a oneMKL packed copy (`kernels.packed_gemm`; build() packs).
        "packed_f32": ("float32", lambda x, w, s: packed_matmul(x, w, s.shape[0])),
        "packed_bf16": ("bfloat16", lambda x, w, s: packed_matmul(x.astype(bf16), w,
                                                                  s.shape[0])),
    }
    return table[form.rsplit("_", 1)[0]]


def stream_limit(gib: float, repeats: int) -> dict[str, float]:
    """Best read (jitted sum) and copy (numpy copyto, read + write bytes) GB/s."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = int(gib * 2**30) // 4
    x = jnp.ones((n,), jnp.float32)
    s = jax.jit(jnp.sum)
    s(x).block_until_ready()
    reads = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        s(x).block_until_ready()
        reads.append(time.perf_counter() - t0)
    a, b = np.ones(n, np.float32), np.zeros(n, np.float32)
    np.copyto(b, a)
    copies = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        copies.append(time.perf_counter() - t0)
    return {"read_gbs": rnd(n * 4 / min(reads) / 1e9),
            "read_median_gbs": rnd(n * 4 / med(reads) / 1e9),
            "copy_gbs": rnd(2 * n * 4 / min(copies) / 1e9)}


def build(form: str, m: int, k: int, n: int, min_mb: float) -> dict[str, Any]:
    """The compiled chain of `copies` matmuls of one formulation and its inputs."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    dtype, fn = _one(form)
    item = jnp.dtype(dtype).itemsize
    copies = max(1, min(256, int(np.ceil(min_mb * 2**20 / (k * n * item)))))
    rng = np.random.default_rng(0)
    base = rng.standard_normal((n, k) if form.endswith("_nt") else (k, n), np.float32)
    if dtype == "int8":
        w0 = np.clip(np.round(base * 40), -127, 127).astype(np.int8)
    else:
        w0 = base.astype(jnp.dtype(dtype))
    # Distinct buffers (the same values: only the bytes streamed matter here).
    owner = None
    if form.startswith("packed"):  # Packed copies, named by their int32 ids.
        from jaxlearn.kernels import PackedWeights

        owner = PackedWeights()
        ws = [jnp.int32(owner.pack(w0)) for _ in range(copies)]
    else:
        ws = [jax.device_put(w0) + jnp.zeros((), w0.dtype) for _ in range(copies)]
    scale = jnp.full((n,), 0.01, jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))

    @jax.jit
    def run(x: Any, ws: Any, s: Any) -> Any:
        # A chain, as a decoder's layers: each matmul waits for the previous one's result,
        # and the barrier keeps XLA from hoisting a weight's convert out of its turn.
        for w in ws:
            x, w = lax.optimization_barrier((x, w))
            x = x + 1e-6 * jnp.sum(fn(x, w, s))
        return x

    t0 = time.perf_counter()
    jax.block_until_ready(run(x, ws, scale))
    nbytes = copies * (k * n * item + (n * 4 if dtype == "int8" else 0))
    return dict(call=lambda: jax.block_until_ready(run(x, ws, scale)), nbytes=nbytes,
                owner=owner,
                info=dict(form=form, m=m, k=k, n=n, dtype=dtype, copies=copies,
                          weight_mb=rnd(nbytes / 2**20),
                          compile_s=rnd(time.perf_counter() - t0, 3)))


def measure_round_robin(cases: list[dict[str, Any]], repeats: int,
                        read: Callable[[], float]) -> list[dict[str, Any]]:
    """Every case timed once per round, with a read-bandwidth sample in each round; GB/s
    medians and each case's median share of the same round's read bandwidth."""
    times: list[list[float]] = [[] for _ in cases]
    reads = []
    for _ in range(repeats):
        reads.append(read())
        for i, c in enumerate(cases):
            t0 = time.perf_counter()
            c["call"]()
            times[i].append(time.perf_counter() - t0)
    rows = []
    for c, ts in zip(cases, times):
        gbs = [c["nbytes"] / t / 1e9 for t in ts]
        rows.append(dict(**c["info"], us_per_matmul=rnd(1e6 * med(ts) / c["info"]["copies"]),
                         gbs=rnd(med(gbs)), best_gbs=rnd(max(gbs)),
                         share_of_read=rnd(med([g / r for g, r in zip(gbs, reads)]), 3),
                         read_gbs=rnd(med(reads))))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    p.add_argument("--forms", default=",".join(DEFAULT_FORMS))
    p.add_argument("--ms", default="1,4,16")
    p.add_argument("--min-mb", type=float, default=128.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--stream-gib", type=float, default=1.0)
    p.add_argument("--probe-mib", type=float, default=256.0,
                   help="size of the read-bandwidth sample taken in every round")
    args = p.parse_args()
    import jax

    forms = args.forms.split(",")
    bad = [f for f in forms if f not in FORMS]
    if bad:
        raise SystemExit(f"jl_gemv.py: --forms: unknown {bad}; choose from {list(FORMS)}")
    limit = stream_limit(args.stream_gib, 7)
    log(f"stream limit: {limit}")
    import jax.numpy as jnp

    probe = jnp.ones((int(args.probe_mib * 2**20) // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(probe).block_until_ready()

    def read() -> float:
        t0 = time.perf_counter()
        total(probe).block_until_ready()
        return probe.nbytes / (time.perf_counter() - t0) / 1e9

    rows = []
    for model in args.models.split(","):
        for shape_name, (k, n) in MODELS[model].items():
            if args.shapes and shape_name not in args.shapes.split(","):
                continue
            for m in (int(v) for v in args.ms.split(",")):
                cases = [build(f, m, k, n, args.min_mb) for f in forms
                         if not (f.startswith("bf16_pad_") and m != 1)]
                for row in measure_round_robin(cases, args.repeats, read):
                    row = dict(model=model, shape=shape_name, **row)
                    log(f"{model:13s} {shape_name:8s} M={m:<3d} {row['form']:12s} "
                        f"{row['gbs']:7.2f} GB/s  {row['us_per_matmul']:9.1f} us  "
                        f"({row['share_of_read']:.0%} of read)")
                    rows.append(row)
    limit_after = stream_limit(args.stream_gib, 7)
    emit(bench="gemv", framework="jaxlearn", version=jax.__version__, limit=limit,
         limit_after=limit_after, rows=rows)


if __name__ == "__main__":
    main()
