"""One Attention layer's train step (forward + backward w.r.t. params and input), with
`implementation="blockwise"` (jaxlearn.kernels) against `"einsum"`, measured in the same
process, interleaved call by call, at several sequence lengths. Reports the median step
time of each, their ratio (einsum / blockwise: > 1 means blockwise is faster) and the
compiled temp bytes of each.

    python jl_attention.py --seqs 256,1024,4096 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from common import emit, log

from jaxlearn.layers import Attention
from jaxlearn.module import functional


def step_fn(impl: str, seq: int, args: argparse.Namespace):
    cfg = Attention.default_config().set(
        name="attn", input_dim=args.heads * args.head_dim, num_heads=args.heads,
        num_kv_heads=args.kv_heads, implementation=impl, block_q=args.block, block_k=args.block,
        dtype=args.dtype)
    layer = cfg.instantiate()
    params = layer.initialize_parameters_recursively(jax.random.key(0))

    def loss(p, x):
        y = functional(layer, None, p, (x,), method="forward", is_training=True)[0]
        return jnp.mean(y.astype(jnp.float32) ** 2)

    x = jax.random.normal(jax.random.key(1), (args.batch, seq, cfg.input_dim), args.dtype)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    return (lambda: jax.block_until_ready(compiled(params, x))), temp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="256,1024,4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv_heads", type=int, default=2)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    for seq in (int(s) for s in args.seqs.split(",")):
        fns, temps = {}, {}
        for impl in ("einsum", "blockwise"):
            fns[impl], temps[impl] = step_fn(impl, seq, args)
            fns[impl]()  # Warm-up.
        times: dict[str, list[float]] = {"einsum": [], "blockwise": []}
        for r in range(args.repeats):  # Interleaved, order flipping each repeat.
            for impl in ("einsum", "blockwise") if r % 2 == 0 else ("blockwise", "einsum"):
                t0 = time.perf_counter()
                fns[impl]()
                times[impl].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        log(f"seq {seq}: einsum {med['einsum'] * 1e3:.1f} ms, blockwise "
            f"{med['blockwise'] * 1e3:.1f} ms, ratio {med['einsum'] / med['blockwise']:.2f}; "
            f"temp {temps['einsum'] / 2**20:.1f} vs {temps['blockwise'] / 2**20:.1f} MiB")
        emit(group="attention", seq=seq, dtype=args.dtype, batch=args.batch, heads=args.heads,
             kv_heads=args.kv_heads, head_dim=args.head_dim, block=args.block,
             einsum_s=med["einsum"], blockwise_s=med["blockwise"],
             einsum_over_blockwise=med["einsum"] / med["blockwise"],
             einsum_temp_bytes=temps["einsum"], blockwise_temp_bytes=temps["blockwise"])


if __name__ == "__main__":
    main()
