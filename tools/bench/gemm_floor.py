"""The GEMM floor of an f32 train step: every matrix product of one SmolLM2-135M step
(8 x 128 tokens), each timed alone, summed with its count per step.

    python gemm_floor.py jl                        # jaxlearn's oneMKL calls (kernels.sgemm)
    python gemm_floor.py xla                       # XLA's own dots (YNNPACK on CPU)
    /tmp/tvenv/bin/python gemm_floor.py pt         # torch.mm / torch.bmm on the same shapes

The products: per layer the seven projections (forward, dx, dW), attention's q.k and p.v
per (batch, kv head) (forward and both operands' gradients), the tied head (forward, dx,
dW), and for LoRA (rank 8 on the seven projections) the adapters' six small products per
projection. A full fine-tune runs all of them; LoRA no dW of a frozen weight. Each is the
best of `--repeats` calls on warm operands, so the sum is a floor the step cannot beat
with these kernels (its other work only adds). Emits the floor per mode in seconds.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from common import emit, rnd

T, D, LAYERS, HEADS, KV, HD, FFN, VOCAB, RANK = 1024, 576, 30, 9, 3, 64, 1536, 49152, 8
BATCH, SEQ = 8, 128
PROJ = [(D, HEADS * HD), (D, KV * HD), (D, KV * HD), (HEADS * HD, D), (D, FFN), (D, FFN),
        (FFN, D)]


def products() -> list[tuple[str, tuple[int, ...], tuple[int, ...], bool, bool, int]]:
    """(kind, a shape, b shape, trans_a, trans_b, count per step); kind says which modes
    run it: "fwd" / "dx" both, "dw" full only, "lora" LoRA only."""
    out = []
    for k, n in PROJ:
        out += [("fwd", (T, k), (k, n), False, False, LAYERS),
                ("dx", (T, n), (k, n), False, True, LAYERS),
                ("dw", (T, k), (T, n), True, False, LAYERS)]
        out += [("lora", (T, k), (k, RANK), False, False, LAYERS),  # h = x A
                ("lora", (T, RANK), (RANK, n), False, False, LAYERS),  # h B
                ("lora", (T, RANK), (T, n), True, False, LAYERS),  # dB = hᵀ g
                ("lora", (T, n), (RANK, n), False, True, LAYERS),  # dh = g Bᵀ
                ("lora", (T, k), (T, RANK), True, False, LAYERS),  # dA = xᵀ dh
                ("lora", (T, RANK), (k, RANK), False, True, LAYERS)]  # dx += dh Aᵀ
    bk, gs = BATCH * KV, (HEADS // KV) * SEQ
    # scores = q kᵀ, o = p v, and their gradients (dq = ds k, dk = dsᵀ q, dp = do vᵀ,
    # dv = pᵀ do): all modes backpropagate through attention.
    out += [("fwd", (bk, gs, HD), (bk, SEQ, HD), False, True, LAYERS),
            ("fwd", (bk, gs, SEQ), (bk, SEQ, HD), False, False, LAYERS),
            ("dx", (bk, gs, SEQ), (bk, SEQ, HD), False, False, LAYERS),
            ("dx", (bk, gs, SEQ), (bk, gs, HD), True, False, LAYERS),
            ("dx", (bk, gs, HD), (bk, SEQ, HD), False, True, LAYERS),
            ("dx", (bk, gs, SEQ), (bk, gs, HD), True, False, LAYERS)]
    out += [("fwd", (T, D), (VOCAB, D), False, True, 1), ("dx", (T, VOCAB), (VOCAB, D),
                                                          False, False, 1),
            ("dw", (T, VOCAB), (T, D), True, False, 1)]
    return out


def timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _jitted(product: Callable[[Any, Any], Any], a_shape: tuple[int, ...],
            b_shape: tuple[int, ...]) -> Callable[[], Any]:
    """A call of jit(product) on seeded f32 operands already on the device."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    a = jax.device_put(rng.standard_normal(a_shape, np.float32))
    b = jax.device_put(rng.standard_normal(b_shape, np.float32))
    f = jax.jit(product)
    return lambda: f(a, b).block_until_ready()


def jl_call(a_shape: tuple[int, ...], b_shape: tuple[int, ...], ta: bool, tb: bool
            ) -> Callable[[], Any]:
    from jaxlearn.kernels.sgemm import sgemm

    return _jitted(lambda a, b: sgemm(a, b, trans_a=ta, trans_b=tb), a_shape, b_shape)


def xla_call(a_shape: tuple[int, ...], b_shape: tuple[int, ...], ta: bool, tb: bool
             ) -> Callable[[], Any]:
    import jax.numpy as jnp

    return _jitted(lambda a, b: jnp.matmul(jnp.swapaxes(a, -1, -2) if ta else a,
                                           jnp.swapaxes(b, -1, -2) if tb else b),
                   a_shape, b_shape)


def pt_call(a_shape: tuple[int, ...], b_shape: tuple[int, ...], ta: bool, tb: bool
            ) -> Callable[[], Any]:
    import torch

    a, b = torch.randn(a_shape), torch.randn(b_shape)
    a, b = (a.transpose(-1, -2) if ta else a), (b.transpose(-1, -2) if tb else b)
    mm = torch.bmm if a.dim() == 3 else torch.mm
    return lambda: mm(a, b)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=["jl", "xla", "pt"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    make = {"jl": jl_call, "xla": xla_call, "pt": pt_call}[args.side]
    by_kind: dict[str, float] = {}
    for kind, a_shape, b_shape, ta, tb, count in products():
        by_kind[kind] = by_kind.get(kind, 0.0) + count * timed(
            make(a_shape, b_shape, ta, tb), args.repeats)
    floors = {"full": by_kind["fwd"] + by_kind["dx"] + by_kind["dw"],
              "lora": by_kind["fwd"] + by_kind["dx"] + by_kind["lora"]}
    if args.side != "pt":
        import jax
        version = jax.__version__
    else:
        import torch
        version = f"{torch.__version__} ({torch.get_num_threads()} threads)"
    framework = {"jl": "jaxlearn", "xla": "jax-xla", "pt": "torch"}[args.side]
    emit(bench="gemm_floor", framework=framework,
         version=version, shape=dict(tokens=T, layers=LAYERS, dim=D, ffn=FFN, vocab=VOCAB,
                                     rank=RANK), seconds_by_kind={k: rnd(v) for k, v in
                                                                  by_kind.items()},
         floor_s={k: rnd(v) for k, v in floors.items()}, tag=args.tag)


if __name__ == "__main__":
    main()
