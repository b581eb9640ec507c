"""PyTorch side of the peaks: matmul FLOP/s (f32, bf16) at n x n and memory read bandwidth
(torch.sum over `--gib` GiB of f32)."""

from __future__ import annotations

import argparse

from common import emit, med, rnd, time_calls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--gib", type=float, default=1.0)
    args = p.parse_args()
    import torch

    torch.manual_seed(0)
    n = args.n
    a32, b32 = torch.randn(n, n), torch.randn(n, n)
    out = {}
    for name, (a, b) in {"f32": (a32, b32),
                         "bf16": (a32.bfloat16(), b32.bfloat16())}.items():
        with torch.no_grad():
            torch.mm(a, b)
            times, util = time_calls(lambda: torch.mm(a, b), args.repeats)
        out[f"matmul_{name}_gflops"] = rnd(2 * n**3 / med(times) / 1e9)
        out[f"matmul_{name}_cpu_util"] = rnd(util, 3)
    elems = int(args.gib * 2**30) // 4
    x = torch.ones(elems)
    x.sum()
    times, util = time_calls(lambda: x.sum(), max(5, args.repeats // 2))
    out["read_bw_gbs"] = rnd(elems * 4 / med(times) / 1e9)
    out["read_bw_best_gbs"] = rnd(elems * 4 / min(times) / 1e9)  # The limit: best repeat.
    out["read_bw_cpu_util"] = rnd(util, 3)
    emit(bench="peak", framework="torch", version=torch.__version__,
         threads=torch.get_num_threads(), n=n, gib=args.gib, **out)


if __name__ == "__main__":
    main()
