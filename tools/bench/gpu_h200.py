"""MFU of a ~1B Llama training step on one GPU (H200), bf16: jaxlearn vs PyTorch + HF.

    python gpu_h200.py --framework jax   [--steps 10]
    python gpu_h200.py --framework torch [--steps 10]

Config (Llama-3.2-1B-like, untied head, vocab 32000): 16 layers, hidden 2048, 16 heads
(8 KV heads, head_dim 128), FFN 8192; batch 8 x seq 2048; 1.17B params. jaxlearn: the real
`Trainer` step (f32 master params, compute dtype bfloat16, AdamW, clip 1.0,
`jax.nn.dot_product_attention`, scan stack). torch: `LlamaForCausalLM` (sdpa), AdamW
(fused), clip 1.0, `torch.autocast("cuda", bfloat16)`. MFU = model FLOPs (common.py) /
step time / 989 TFLOP/s (H200 dense bf16, the jaxlearn catalogue); also vs a measured
8192^3 bf16 matmul. One JSON line (BENCH_RESULT) per run.
"""

from __future__ import annotations

import argparse
import time

from common import emit, log, med, rnd, train_flops_per_token

CFG = dict(vocab=32000, dim=2048, layers=16, heads=16, kv_heads=8, ffn=8192, seq=2048,
           batch=8, rope_theta=500000.0, norm_eps=1e-5)
H200_BF16 = 989e12


def run_jax(args: argparse.Namespace, c: dict) -> None:
    import jax
    import jax.numpy as jnp
    from jl_train import build_trainer, random_batch

    n = 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    mm(a, a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        out = mm(a, a)
    out.block_until_ready()
    peak = 2 * n**3 * 10 / (time.perf_counter() - t0)

    trainer = build_trainer(c, dtype="bf16", stack="scan", remat=args.remat,
                            nonfinite="skip", moe_method="ragged_dot",
                            attention="dot_product_attention")
    batch = trainer.global_batch(random_batch(c))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
    t0 = time.perf_counter()
    step = trainer.compile_train_step(abstract)
    compile_s = time.perf_counter() - t0
    state = trainer.init_state()
    times = []
    with jax.set_mesh(trainer.mesh):
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            state, summ = step(state, batch)
            loss = float(summ["loss"])
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    report(args, c, "jaxlearn", jax.__version__, times, peak, compile_s=compile_s,
           loss=loss, device=str(jax.devices()[0].device_kind))


def run_torch(args: argparse.Namespace, c: dict) -> None:
    import torch
    from pt_train import build

    dev = torch.device("cuda")
    n = 8192
    a = torch.ones((n, n), dtype=torch.bfloat16, device=dev)
    torch.mm(a, a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        torch.mm(a, a)
    torch.cuda.synchronize()
    peak = 2 * n**3 * 10 / (time.perf_counter() - t0)
    del a
    torch.manual_seed(0)
    model = build(c, "llama").to(dev)
    if args.remat:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), device=dev)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    fwd = torch.compile(model) if args.torch_compile else model
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                     y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = float(loss.detach())
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    report(args, c, "torch", torch.__version__, times, peak, loss=lv,
           device=torch.cuda.get_device_name(0), torch_compile=args.torch_compile,
           max_mem_gb=rnd(torch.cuda.max_memory_allocated() / 1e9))


def report(args: argparse.Namespace, c: dict, fw: str, version: str, times: list,
           peak: float, **extra: object) -> None:
    dt = med(times)
    tokens = c["batch"] * c["seq"]
    flops = train_flops_per_token(c) * tokens
    log(f"{fw}: {dt * 1e3:.1f} ms/step, {tokens / dt:.0f} tok/s, "
        f"MFU {flops / dt / H200_BF16:.1%} (catalogue), {flops / dt / peak:.1%} (measured)")
    emit(bench="gpu_train", framework=fw, version=version, step_s=rnd(dt),
         step_times=[rnd(t) for t in times], tokens_per_s=rnd(tokens / dt),
         model_tflops=rnd(flops / dt / 1e12), mfu_catalogue=rnd(flops / dt / H200_BF16),
         matmul_peak_tflops=rnd(peak / 1e12), mfu_measured_peak=rnd(flops / dt / peak),
         remat=args.remat or "none", **{k: CFG[k] for k in ("layers", "dim", "batch", "seq")},
         **extra)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", required=True, choices=["jax", "torch"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=CFG["batch"])
    p.add_argument("--remat", default=None, help="jax policy name / torch: any value")
    p.add_argument("--torch-compile", action="store_true")
    args = p.parse_args()
    c = dict(CFG, batch=args.batch)
    (run_jax if args.framework == "jax" else run_torch)(args, c)


if __name__ == "__main__":
    main()
