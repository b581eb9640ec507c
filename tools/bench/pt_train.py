"""The peer: PyTorch + HF transformers training step on the identical config.

`LlamaForCausalLM` / `MixtralForCausalLM` (random init, untied head, no dropout), AdamW
(lr 3e-4, betas 0.9/0.95, weight decay 0.1) and gradient clipping at 1.0, like the jaxlearn
learner. f32, or bf16 compute under `torch.autocast("cpu", dtype=torch.bfloat16)` with
f32 master weights.

    python pt_train.py --model llama --dtype bf16 --steps 6
"""

from __future__ import annotations

import argparse
import time

from common import Timer, emit, log, med, model_cfg, rnd, train_flops_per_token


def build(c: dict, name: str):
    import transformers as tf

    common = dict(
        vocab_size=c["vocab"], hidden_size=c["dim"], intermediate_size=c["ffn"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"], max_position_embeddings=max(2048, c["seq"]),
        rms_norm_eps=c["norm_eps"], rope_theta=c["rope_theta"], tie_word_embeddings=False,
        attention_dropout=0.0, use_cache=False,
    )
    if name == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=c["experts"],
                               num_experts_per_tok=c["top_k"], router_aux_loss_coef=0.01,
                               output_router_logits=True, sliding_window=None, **common)
        return tf.MixtralForCausalLM(cfg)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**common))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama", choices=["llama", "mixtral"])
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    import contextlib

    import torch
    import transformers

    torch.manual_seed(0)
    c = model_cfg(args.model, layers=args.layers)
    model = build(c, args.model)
    model.train()
    nparams = sum(x.numel() for x in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), generator=g)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def ctx():
        if args.dtype == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with ctx():
            out = model(input_ids=inputs)
            logits = out.logits.float()
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                     labels.view(-1))
            if args.model == "mixtral" and out.aux_loss is not None:
                loss = loss + 0.01 * out.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    losses = []
    with Timer() as t_warm:
        for _ in range(args.warmup):
            losses.append(step())
    times, cpus, cpu_s = [], [], []
    for _ in range(args.steps):
        with Timer() as t:
            losses.append(step())
        times.append(t.wall)
        cpus.append(t.util())
        cpu_s.append(t.cpu)
    dt = med(times)
    tokens = c["batch"] * c["seq"]
    flops = train_flops_per_token(c) * tokens
    log(f"torch {args.model} {args.dtype}: {dt:.3f} s/step, {tokens / dt:.0f} tok/s, "
        f"losses {losses[0]:.3f}..{losses[-1]:.3f}")
    emit(bench="train", framework="torch", version=torch.__version__,
         transformers=transformers.__version__, threads=torch.get_num_threads(),
         model=args.model, dtype=args.dtype, layers=c["layers"], params=nparams,
         batch=c["batch"], seq=c["seq"], warmup_s=rnd(t_warm.wall), step_s=rnd(dt),
         step_times=[rnd(x) for x in times], tokens_per_s=rnd(tokens / dt),
         model_flops_per_step=flops, model_gflops=rnd(flops / dt / 1e9),
         cpu_util=rnd(med(cpus), 3), step_cpu_s=rnd(med(cpu_s)),
         loss_first=rnd(losses[0]), loss_last=rnd(losses[-1]),
         attn_implementation=getattr(model.config, "_attn_implementation", None),
         wall_time=time.time(), tag=args.tag)


if __name__ == "__main__":
    main()
