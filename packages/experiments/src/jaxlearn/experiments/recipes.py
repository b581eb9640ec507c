"""Named experiments: one function per recipe returning a complete `Trainer.Config`.

Model shapes follow the published architectures (Llama 2: arXiv:2307.09288; Llama 3:
arXiv:2407.21783; Mixtral: arXiv:2401.04088; Qwen3: arXiv:2505.09388; Phi-3:
arXiv:2404.14219). Every recipe carries mesh rules for CPU, TPU (v4/v5e/v5p/v6e), GPU
(H100/H200/B200) and Trainium2; `--mesh_selector` picks one.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from jaxlearn.experiments.common import (
    LAYER_PATH,
    STACK_PATH,
    chain,
    chunked_loss,
    context_parallel_mesh_rules,
    large_model_mesh_rules,
    onemkl_dots,
    small_model_mesh_rules,
    trainer_config,
)
from jaxlearn.experiments.remat_fit import LoopLayersModifier, RematToFitModifier
from jaxlearn.layers import (
    ADAPTERS,
    gemma2_config,
    llama_config,
    phi3_config,
    qwen3_config,
    qwen3_moe_config,
    use_lora,
    use_moe,
)
from jaxlearn.mesh import SetFieldsModifier
from jaxlearn.posttrain import (
    DPOObjective,
    GRPOObjective,
    GRPORollout,
    PreferenceInput,
    PreferenceSource,
    PromptInput,
    PromptSource,
)
from jaxlearn.runtime.bundled import BundledSource
from jaxlearn.runtime.input_pipeline import Input
from jaxlearn.runtime.sft import (
    ARITHMETIC_PROMPTS,
    CHAT_EXAMPLE,
    PREFERENCE_EXAMPLE,
    SFTInput,
    SFTSource,
)
from jaxlearn.runtime.trainer import Trainer
from jaxlearn.text.tokenizers import ByteTokenizer


def _input(seq_len: int, global_batch_size: int, split: str = "train") -> Any:
    return Input.default_config().set(
        source=BundledSource.default_config(),
        tokenizer=ByteTokenizer.default_config(),
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        split=split,
        shuffle=split == "train",
    )


def _tiny_model() -> Any:
    # Byte-level vocabulary (259 ids) padded to 320 so it shards evenly.
    return llama_config(vocab_size=320, dim=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        ffn_dim=352, rope_theta=10000.0, tie_embeddings=True)


def tiny_llama() -> Trainer.Config:
    """Default: a 0.9M-parameter Llama on the bundled text; a few minutes on a laptop CPU."""
    return trainer_config(
        _tiny_model(),
        _input(seq_len=128, global_batch_size=16),
        eval_input=_input(seq_len=128, global_batch_size=16, split="eval"),
        eval_every_n_steps=100,
        max_step=300,
        learning_rate=3e-3,
        warmup_steps=30,
        save_every_n_steps=100,
        mesh_rules=small_model_mesh_rules(),
    )


def tiny_llama_long() -> Trainer.Config:
    """tiny-llama on one 8192-token row per step, the sequence split over the devices
    (ring attention, `context_parallel_mesh_rules`): context parallelism at laptop size."""
    return trainer_config(
        _tiny_model(),
        _input(seq_len=8192, global_batch_size=1),
        max_step=300,
        learning_rate=3e-3,
        warmup_steps=30,
        save_every_n_steps=100,
        mesh_rules=context_parallel_mesh_rules(),
    )


def tiny_moe() -> Trainer.Config:
    """tiny-llama with every FFN replaced by 4 experts, top-2 (Mixtral-style)."""
    cfg = tiny_llama()
    cfg.model = use_moe(cfg.model, num_experts=4, top_k=2, capacity_factor=2.0)
    cfg.model.family = "mixtral"  # the family its checkpoints are exported as
    return cfg


def _large(model: Any, *, seq_len: int, global_batch: int, max_step: int, lr: float,
           microbatches: Optional[dict[str, int]] = None,
           seq_shards: Optional[dict[str, int]] = None,
           model_shards: Optional[dict[str, int]] = None,
           moe_capacity_factor: Optional[float] = None) -> Trainer.Config:
    """A real-size pretraining recipe; `microbatches`, `seq_shards` and `model_shards`
    ({hardware family: n}) size the gradient accumulation, context and tensor parallelism
    that make the golden selector of each family fit (`large_model_mesh_rules`);
    `moe_capacity_factor` the MoE dispatch on accelerators."""
    return trainer_config(
        model,
        _input(seq_len=seq_len, global_batch_size=global_batch),
        max_step=max_step,
        learning_rate=lr,
        warmup_steps=2000,
        save_every_n_steps=1000,
        mesh_rules=large_model_mesh_rules(microbatches, seq_shards=seq_shards,
                                          model_shards=model_shards,
                                          moe_capacity_factor=moe_capacity_factor),
    )


def llama2_7b() -> Trainer.Config:
    """Llama 2 7B: 32 layers, d=4096, 32 heads (MHA), FFN 11008, vocab 32000, seq 4096."""
    model = llama_config(32000, 4096, 32, 32, 32, 11008, rope_theta=10000.0, dtype="bfloat16")
    return _large(model, seq_len=4096, global_batch=1024, max_step=500_000, lr=3e-4,
                  microbatches={"gpu-h100": 4, "trn2": 4})


def llama2_70b() -> Trainer.Config:
    """Llama 2 70B: 80 layers, d=8192, 64 heads / 8 KV heads, FFN 28672, vocab 32000."""
    model = llama_config(32000, 8192, 80, 64, 8, 28672, rope_theta=10000.0, dtype="bfloat16")
    return _large(model, seq_len=4096, global_batch=1024, max_step=500_000, lr=1.5e-4,
                  microbatches={"tpu-v5e": 16, "tpu-v6e": 4, "gpu-h100": 16,
                                "gpu-h200": 2, "gpu-b200": 2, "trn2": 16},
                  seq_shards={"tpu-v5e": 4})


def llama3_8b() -> Trainer.Config:
    """Llama 3 8B: 32 layers, d=4096, 32 heads / 8 KV heads, FFN 14336, vocab 128256,
    RoPE theta 500000, seq 8192."""
    model = llama_config(128256, 4096, 32, 32, 8, 14336, rope_theta=500000.0,
                         dtype="bfloat16")
    return _large(model, seq_len=8192, global_batch=512, max_step=500_000, lr=3e-4,
                  microbatches={"tpu-v5e": 2, "gpu-h100": 4, "trn2": 4})


def mixtral_8x7b() -> Trainer.Config:
    """Mixtral 8x7B: 32 layers, d=4096, 32/8 heads, 8 experts top-2 with FFN 14336,
    vocab 32000, RoPE theta 1e6."""
    model = llama_config(32000, 4096, 32, 32, 8, 14336, rope_theta=1e6, dtype="bfloat16")
    model = use_moe(model, num_experts=8, top_k=2)
    model.family = "mixtral"
    return _large(model, seq_len=4096, global_batch=1024, max_step=500_000, lr=3e-4,
                  microbatches={"tpu-v5e": 16, "tpu-v6e": 2, "gpu-h100": 8, "gpu-h200": 2,
                                "gpu-b200": 2, "trn2": 8},
                  model_shards={"tpu-v5e": 4}, moe_capacity_factor=1.25)


def qwen3_8b() -> Trainer.Config:
    """Qwen3 8B: 36 layers, d=4096, 32 heads / 8 KV heads of head_dim 128 with q/k RMSNorm,
    FFN 12288, vocab 151936, RoPE theta 1e6, untied head, seq 4096."""
    model = qwen3_config(151936, 4096, 36, 32, 8, 12288, head_dim=128, rope_theta=1e6,
                         dtype="bfloat16")
    return _large(model, seq_len=4096, global_batch=1024, max_step=500_000, lr=3e-4,
                  microbatches={"tpu-v5e": 2, "gpu-h100": 4, "trn2": 4})


def qwen3_30b_a3b() -> Trainer.Config:
    """Qwen3-30B-A3B: 48 layers, d=2048, 32 heads / 4 KV heads of head_dim 128 with q/k
    RMSNorm, 128 experts of FFN 768, top-8 renormalised, vocab 151936, RoPE theta 1e6."""
    model = qwen3_moe_config(151936, 2048, 48, 32, 4, 768, 128, 8, head_dim=128,
                             rope_theta=1e6, dtype="bfloat16")
    return _large(model, seq_len=4096, global_batch=1024, max_step=500_000, lr=3e-4,
                  microbatches={"tpu-v5e": 4, "tpu-v6e": 2, "gpu-h100": 16, "gpu-h200": 2,
                                "gpu-b200": 4, "trn2": 8}, moe_capacity_factor=1.25)


def _float32s(text: str) -> list[float]:
    """Space-separated float32 decimals -> their exact float32 values (as config.json)."""
    return [float(np.float32(v)) for v in text.split()]


# Phi-3.5-mini-instruct's LongRoPE factors (config.json "rope_scaling"), one per rotary
# frequency (head_dim 96 / 2).
PHI35_MINI_LONG_FACTOR = _float32s("""
    1.08 1.11 1.14 1.34 1.5899999 1.6 1.62 2.6200001 3.23 3.23 4.79 7.4 7.7000003 9.09 12.2
    17.67 24.460001 28.570002 30.420002 30.840002 32.590004 32.930004 42.320004 44.960003
    50.340004 50.450005 57.550003 57.930004 58.210003 60.140003 62.610004 62.620003 62.710003
    63.140003 63.140003 63.770004 63.930004 63.960003 63.97 64.03 64.07 64.08 64.12 64.41
    64.48 64.51 64.53 64.84""")
PHI35_MINI_SHORT_FACTOR = _float32s("""
    1 1.02 1.03 1.03 1.05 1.05 1.05 1.05 1.05 1.0699999 1.0999999 1.1099999 1.1599998
    1.1599998 1.1699998 1.2899998 1.3399998 1.6799998 1.7899998 1.8199998 1.8499998 1.8799998
    1.9099997 1.9399997 1.9899997 2.0199997 2.0199997 2.0199997 2.0199997 2.0199997 2.0199997
    2.0299997 2.0299997 2.0299997 2.0299997 2.0299997 2.0299997 2.0299997 2.0299997 2.0299997
    2.0799997 2.0899997 2.1899996 2.2199996 2.5899994 2.7299995 2.7499995 2.8399994""")


def phi3_5_mini() -> Trainer.Config:
    """Phi-3.5-mini-instruct: 32 layers, d=3072, 32 heads (MHA) of head_dim 96, FFN 8192,
    vocab 32064, RoPE theta 1e4 with LongRoPE (4096 original positions, 131072 in all:
    factor 32), window 262144, untied head, seq 4096."""
    scaling = {"rope_type": "longrope", "short_factor": PHI35_MINI_SHORT_FACTOR,
               "long_factor": PHI35_MINI_LONG_FACTOR, "factor": 32.0,
               "original_max_position_embeddings": 4096}  # fmt: skip
    model = phi3_config(32064, 3072, 32, 32, 32, 8192, rope_theta=10000.0, rope_scaling=scaling,
                        sliding_window=262144, norm_eps=1e-5, dtype="bfloat16")  # fmt: skip
    return _large(model, seq_len=4096, global_batch=1024, max_step=500_000, lr=3e-4,
                  microbatches={"gpu-h100": 2, "trn2": 4})


def gemma2_9b() -> Trainer.Config:
    """Gemma 2 9B: 42 layers (local window 4096 / global alternating), d=3584, 16 heads /
    8 KV heads of head_dim 256, GeGLU FFN 14336, vocab 256000, tied, attention and final
    logits soft-capped at 50 / 30, query_pre_attn_scalar 256, seq 8192."""
    model = gemma2_config(256000, 3584, 42, 16, 8, 14336, head_dim=256, dtype="bfloat16")
    return _large(model, seq_len=8192, global_batch=512, max_step=500_000, lr=3e-4,
                  microbatches={"tpu-v5e": 8, "tpu-v6e": 2, "gpu-h100": 4, "trn2": 4},
                  model_shards={"tpu-v5e": 4})


def _smollm2_135m() -> Any:
    """SmolLM2-135M's shape (30 layers, d=576, 9/3 heads, FFN 1536, vocab 49152, tied):
    what `finetune` trains without --init_from, which replaces it by the pretrained one."""
    return llama_config(49152, 576, 30, 9, 3, 1536, rope_theta=100000.0, norm_eps=1e-5,
                        tie_embeddings=True)


def _sft_input(seq_len: int, global_batch_size: int) -> Any:
    return SFTInput.default_config().set(
        source=SFTSource.default_config().set(paths=[CHAT_EXAMPLE]),
        tokenizer=ByteTokenizer.default_config(),
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        eval_fraction=0.0,
        truncate=True,
    )


def finetune_mesh_rules(cpu_seq_len: Optional[int] = 128,
                        loop_layers: bool = True) -> tuple[tuple[str, Any], ...]:
    """The large-model rules (FSDP, remat per layer on accelerators) with bf16 compute on
    accelerators. On CPU (a laptop or a server): float32 (XLA:CPU's bf16 matmuls are
    slower), 128-token rows, and remat per layer only where the step would not fit half the
    host's memory without it (`RematToFitModifier`; SmolLM2-135M, 8 x 128 tokens: ~3.0 GB
    estimated, 1.29x faster steps without); the layers as a Python loop over per-layer
    parameters, whatever the host (`LoopLayersModifier`: no stacked weights sliced per step);
    f32 dense dots on oneMKL where that is faster (`onemkl_dots`: Intel CPUs, one device),
    and the head + loss in compacted chunks of 128 tokens, so the prompt tokens and the
    padding (weight 0) cost no head FLOPs (`chunked_loss(compact=True)`). With a BPE
    tokenizer the bundled chat rows are at most 98 tokens. On CPU each batch is cut to its
    longest row in multiples of 32 tokens. `cpu_seq_len` None: the recipe's own seq_len on
    CPU too; `loop_layers` False: the layers stay a scan (the RL sampler compiles its
    programs on the trainer's model, one layer body each)."""
    bf16 = SetFieldsModifier.default_config().set(fields={"model.dtype": "bfloat16"})
    # Batches cut to their longest row (in multiples of 32 tokens) on CPU: short rows cost
    # what they hold (a compiled step per length, at most seq_len / 32 of them).
    cpu = {"pad_to_multiple_of": 32}
    if cpu_seq_len is not None:
        cpu["input.seq_len"] = cpu_seq_len
    laptop = SetFieldsModifier.default_config().set(fields=cpu)
    loop = LoopLayersModifier.default_config().set(stack=STACK_PATH)
    to_fit = RematToFitModifier.default_config().set(target=LAYER_PATH, stack=STACK_PATH)
    cpu_rules = (laptop, chunked_loss(128, compact=True), *([loop] if loop_layers else []),
                 to_fit, onemkl_dots())
    return tuple((pattern, chain(rule, *cpu_rules) if pattern.startswith("cpu")
                  else chain(rule, bf16)) for pattern, rule in large_model_mesh_rules())


def finetune() -> Trainer.Config:
    """Full fine-tune of --init_from (HF dir, GGUF, jaxlearn run) on chat JSONL (--data;
    default: the bundled chat example): AdamW 3e-5 cosine, warmup 5, seq 512 (128 on CPU),
    batch 8, 30 steps (about 6 epochs of the bundled file); bf16 compute and remat on
    accelerators, remat on CPU."""
    return trainer_config(
        _smollm2_135m(),
        _sft_input(seq_len=512, global_batch_size=8),
        max_step=30,
        learning_rate=3e-5,
        warmup_steps=5,
        save_every_n_steps=10,
        log_every_n_steps=5,
        weight_decay=0.0,
        mesh_rules=finetune_mesh_rules(),
    )


def lora() -> Trainer.Config:
    """`finetune` with LoRA adapters (rank 8, alpha 16) on every attention and dense FFN
    projection; only the adapters train (`learner.trainable`), at lr 1e-3 (the few
    dozen steps a laptop runs teach SmolLM2-135M the bundled file's facts)."""
    cfg = finetune()
    cfg.model = use_lora(cfg.model, rank=8, alpha=16.0)
    cfg.learner.set(trainable=ADAPTERS, learning_rate=1e-3)
    return cfg


def dpo() -> Trainer.Config:
    """Full fine-tune DPO of --init_from on preference JSONL: `dpo_lora`'s data, loss and
    schedule on `finetune`'s model, the reference a frozen copy of the initial params (the
    learner's EMA with decay 1.0, `objective.reference="ema"`), lr 1e-5."""
    cfg = dpo_lora()
    base = finetune()
    cfg.model, cfg.mesh_rules = base.model, base.mesh_rules
    cfg.learner.set(trainable=None, learning_rate=1e-5, ema_decay=1.0)
    cfg.objective = DPOObjective.default_config().set(beta=0.1, reference="ema")
    return cfg


def dpo_lora() -> Trainer.Config:
    """LoRA DPO of --init_from on preference JSONL (--data; default: the bundled pairs,
    a correct and a wrong answer about the chat example's facts): `lora`'s model, adapters
    and mesh rules, `posttrain.DPOObjective` (sigmoid, beta 0.1; the reference is the base
    model, adapters off), `PreferenceInput` pairs rendered with the model's chat template
    (batch 8 pairs, seq 512; 128 on CPU), AdamW lr 2e-4, 20 steps."""
    cfg = lora()
    cfg.input = PreferenceInput.default_config().set(
        source=PreferenceSource.default_config().set(paths=[PREFERENCE_EXAMPLE]),
        tokenizer=ByteTokenizer.default_config(), seq_len=512, global_batch_size=8,
        eval_fraction=0.0, truncate=True)
    cfg.eval_input = None
    cfg.objective = DPOObjective.default_config().set(beta=0.1)
    cfg.learner.set(learning_rate=2e-4, warmup_steps=2)
    cfg.set(max_step=20, save_every_n_steps=10, log_every_n_steps=2)
    return cfg


def grpo() -> Trainer.Config:
    """GRPO of --init_from on prompts JSONL (--data; default: the bundled arithmetic
    questions) scored by --reward functions (default: `numeric_match` against each row's
    "answer"). Each step the in-process engine samples 4 completions (temperature 1, at
    most 48 new tokens) of each of 4 prompts from the current params, and
    `posttrain.GRPOObjective` (clip 0.2, no KL, per-sequence mean) trains on them with the
    sampler's log-probabilities as the old policy's: batch 16 completions in 4 rows, a
    row per prompt holding the prompt once and its 4 completions as branches of it
    (`input.shared_prompt`), seq 256 (a prompt of up to 65 tokens and 4 x 48; the CPU rule
    cuts each batch to its longest row), AdamW lr 1e-5, 30 steps; `finetune`'s model and
    mesh rules."""
    cfg = finetune()
    cfg.input = PromptInput.default_config().set(
        source=PromptSource.default_config().set(paths=[ARITHMETIC_PROMPTS]),
        tokenizer=ByteTokenizer.default_config(), seq_len=256, global_batch_size=16,
        num_generations=4, eval_fraction=0.0)
    cfg.mesh_rules = finetune_mesh_rules(cpu_seq_len=None, loop_layers=False)
    cfg.eval_input = None
    cfg.rollout = GRPORollout.default_config().set(rewards=["numeric_match"],
                                                   max_new_tokens=48)
    cfg.objective = GRPOObjective.default_config()
    cfg.learner.set(learning_rate=1e-5, warmup_steps=2)
    cfg.set(max_step=30, save_every_n_steps=10, log_every_n_steps=1)
    return cfg


def grpo_lora() -> Trainer.Config:
    """`grpo` with `lora`'s adapters (rank 8, alpha 16; only they train) at lr 2e-4: the
    base model with adapters off is the reference a KL term would use (`--set
    objective.beta=0.04`), with no second copy of the weights."""
    cfg = grpo()
    cfg.model = use_lora(cfg.model, rank=8, alpha=16.0)
    cfg.learner.set(trainable=ADAPTERS, learning_rate=2e-4)
    return cfg


EXPERIMENTS = {
    "tiny-llama": tiny_llama,
    "tiny-llama-long": tiny_llama_long,
    "tiny-moe": tiny_moe,
    "llama2-7b": llama2_7b,
    "llama2-70b": llama2_70b,
    "llama3-8b": llama3_8b,
    "mixtral-8x7b": mixtral_8x7b,
    "qwen3-8b": qwen3_8b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "phi3.5-mini": phi3_5_mini,
    "gemma2-9b": gemma2_9b,
    "finetune": finetune,
    "lora": lora,
    "dpo": dpo,
    "dpo-lora": dpo_lora,
    "grpo": grpo,
    "grpo-lora": grpo_lora,
}
DEFAULT_EXPERIMENT = "tiny-llama"
# The pretraining recipes at published sizes: the rows of the AOT matrix (docs/aot_matrix.md).
REAL_SIZE = ("llama2-7b", "llama2-70b", "llama3-8b", "mixtral-8x7b", "qwen3-8b",
             "qwen3-30b-a3b", "phi3.5-mini", "gemma2-9b")


def get_experiment(name: str) -> Trainer.Config:
    """The config of experiment `name`; KeyError with the list (and a suggestion) if unknown."""
    if name not in EXPERIMENTS:
        from jaxlearn.config.base import suggest

        raise KeyError(f"unknown experiment {name!r}{suggest(name, list(EXPERIMENTS))}; "
                       f"known: {', '.join(sorted(EXPERIMENTS))}")
    return EXPERIMENTS[name]()
