"""The peer of jl_decode.py: HF `generate` (greedy, KV cache) on the same ~60M Llama.

    python pt_decode.py --case latency --dtype f32
    python pt_decode.py --case continuous --dtype bf16

latency: prefill = generate(max_new_tokens=1); per token = (generate(1 + N) - generate(1))
/ N for B identical-length prompts (no padding). continuous: what HF offers without a
serving engine, static batching: the requests in arrival order, `slots` at a time,
left-padded, each batch generating until its longest request is done (min_new_tokens =
max_new_tokens so no row stops early); throughput counts only the requested tokens.
"""

from __future__ import annotations

import argparse
import time

from common import emit, log, med, model_cfg, rnd
from decode_common import continuous_workload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="latency", choices=["latency", "continuous"])
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    import torch
    import transformers as tf
    from pt_train import build

    torch.manual_seed(0)
    c = model_cfg("llama")
    model = build(c, "llama").eval()
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(0)
    base = dict(bench="decode", framework="torch", version=torch.__version__,
                transformers=tf.__version__, case=args.case, dtype=args.dtype,
                threads=torch.get_num_threads())
    if args.quick:
        args.repeats, args.new = 2, 32

    def gen(ids: torch.Tensor, n: int, mask: torch.Tensor | None = None) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, use_cache=True)
        dt = time.perf_counter() - t0
        assert out.shape[1] == ids.shape[1] + n, out.shape
        return dt

    if args.case == "latency":
        rows = []
        for b in [int(x) for x in args.batches.split(",")]:
            ids = torch.randint(0, c["vocab"], (b, args.prompt), generator=g)
            t0 = time.perf_counter()
            gen(ids, 1)
            gen(ids, 1 + args.new)
            first = time.perf_counter() - t0
            t1 = [gen(ids, 1) for _ in range(args.repeats)]
            tn = [gen(ids, 1 + args.new) for _ in range(args.repeats)]
            per_tok = (med(tn) - med(t1)) / args.new
            row = dict(batch=b, prompt=args.prompt, new_tokens=args.new,
                       prefill_ms=rnd(1e3 * med(t1)), ms_per_token=rnd(1e3 * per_tok),
                       tokens_per_s=rnd(b / per_tok), e2e_s=rnd(med(tn)),
                       e2e_new_tokens_per_s=rnd(b * (1 + args.new) / med(tn)),
                       first_call_s=rnd(first))
            log(f"torch decode {args.dtype} B{b}: {row}")
            rows.append(row)
        emit(**base, rows=rows)
    else:
        prompts, outs, slots = continuous_workload(c["vocab"], quick=args.quick)

        def serve() -> float:
            total = 0.0
            for i in range(0, len(prompts), slots):
                group = prompts[i:i + slots]
                longest = max(map(len, group))
                ids = torch.zeros((len(group), longest), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for r, pr in enumerate(group):  # Left padding.
                    ids[r, longest - len(pr):] = torch.tensor(pr)
                    mask[r, longest - len(pr):] = 1
                total += gen(ids, max(outs[i:i + slots]), mask)
            return total

        t0 = time.perf_counter()
        serve()
        warm = time.perf_counter() - t0
        times = [serve() for _ in range(max(1, args.repeats - 1))]
        dt = med(times)
        emit(**base, requests=len(prompts), slots=slots, prompt_tokens=sum(map(len, prompts)),
             generated_tokens=int(sum(outs)), wall_s=rnd(dt),
             generated_tokens_per_s=rnd(sum(outs) / dt), first_pass_s=rnd(warm),
             times=[rnd(t) for t in times], batching="static")


if __name__ == "__main__":
    main()
