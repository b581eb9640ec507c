"""Shared pieces of recipes: the trainer skeleton and per-hardware mesh rules."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from jaxlearn.checkpoint import Checkpointer
from jaxlearn.layers.dense import SgemmDot
from jaxlearn.mesh import (
    AxisRulesModifier,
    ChainModifier,
    GradAccumulationModifier,
    MeshShapeModifier,
    RematPolicyModifier,
    SetFieldsModifier,
    SetMatchingModifier,
    hybrid_mesh_shape_from_axes,
    mesh_shape_from_axes,
)
from jaxlearn.module import RematSpec
from jaxlearn.runtime.trainer import Trainer

# Path of the repeated transformer layer in every CausalLM recipe.
LAYER_PATH = r"model\.decoder\.transformer\.layer"
# Path of its layer stack.
STACK_PATH = r"model\.decoder\.transformer"


def remat(policy: str = "nothing_saveable") -> Any:
    """A modifier that rematerialises every transformer layer with `policy`."""
    return RematPolicyModifier.default_config().set(
        target=LAYER_PATH, field="remat_spec", remat_policy=RematSpec(policy=policy)
    )


def blockwise_attention() -> Any:
    """A modifier that runs every layer's self-attention through the flash-style kernel
    (`jaxlearn.kernels.blockwise_attention`): no [seq, seq] scores held for the backward."""
    return SetMatchingModifier.default_config().set(
        target=r"model\.decoder\.transformer\..*self_attention", field="implementation",
        value="blockwise")


def ring_attention() -> Any:
    """A modifier that runs every layer's self-attention as ring attention
    (`jaxlearn.kernels.ring_attention`, context parallelism): exact attention with the
    sequence sharded over the mesh axes the logical `seq` axis maps to (`seq` under
    `DEFAULT_AXIS_RULES`); blockwise attention where that axis is 1."""
    return SetMatchingModifier.default_config().set(
        target=r"model\.decoder\.transformer\..*self_attention", field="implementation",
        value="ring")


def context_parallel_mesh_rules() -> tuple[tuple[str, Any], ...]:
    """Mesh rules for long rows: the sequence split over every device (`seq` axis, ring
    attention) on every target. The layers keep [batch, seq] around every matmul, so
    the sequence stays sharded with any number of rows per device (with the default
    dot; an injected int8/fp8/LoRA dot flattens to tokens and needs one row per data
    replica)."""
    return ((r".*", chain(mesh(mesh_shape_from_axes(seq=-1)), ring_attention())),)


def mesh(shape: Any) -> Any:
    return MeshShapeModifier.default_config().set(mesh_shape=shape)


def chain(*modifiers: Any) -> Any:
    return ChainModifier.default_config().set(modifiers=tuple(modifiers))


def grad_accumulation(n: int) -> Any:
    return GradAccumulationModifier.default_config().set(num_microbatches=n)


# Hardware families of `large_model_mesh_rules`, each its own rule (selector regex).
FAMILIES = {
    "tpu-v5e": r"tpu-v5e-.*",
    "tpu-v5p": r"tpu-v(5p|4)-.*",
    "tpu-v6e": r"tpu-v6e-.*",
    "gpu-h100": r"gpu-h100-.*",
    "gpu-h200": r"gpu-h200-.*",
    "gpu-b200": r"gpu-b200-.*",
    "trn2": r"trn2-.*",
}
# Global tokens per chunk of the fused LM head + cross entropy: about 1,024 tokens per
# device on a 256-device TPU slice or Trainium2 node group, 2,048 on 32 GPUs.
_LOSS_CHUNK_TOKENS = {"tpu": 2**18, "gpu": 2**16, "trn2": 2**18}


def chunked_loss(tokens: int, *, compact: bool = False) -> Any:
    """A modifier that computes the LM head and cross entropy `tokens` (global) tokens at a
    time (`jaxlearn.kernels.chunked_loss`): the f32 logits of the whole batch never exist.
    `compact`: each row's weighted tokens first and the chunks of weight-0 tokens skipped
    (SFT's prompts and padding cost no head FLOPs); not for sequence-sharded batches."""
    fields: dict[str, Any] = {"model.loss_chunk_tokens": tokens}
    if compact:
        fields["model.loss_compact"] = True
    return SetFieldsModifier.default_config().set(fields=fields)


def onemkl_dots() -> Any:
    """A modifier that runs every dense layer's f32 dots on oneMKL's sgemm (`SgemmDot`,
    backend "auto": where `kernels.sgemm.sgemm_runs()`, XLA's dots elsewhere), the LM head's
    in the chunked loss too. For CPU rules; on an accelerator it would fall back."""
    return SetMatchingModifier.default_config().set(
        target=r"model\..*", field="dot", value=SgemmDot.default_config())


def moe_capacity(factor: float) -> Any:
    """A modifier that routes every MoE layer through the GShard capacity dispatch
    (`capacity_factor`: slots per expert per sequence = factor x S x k / E; assignments
    beyond them are dropped): per-sequence groups that stay batch-sharded, where the
    dropless path sorts the assignments of the whole global batch."""
    return SetMatchingModifier.default_config().set(
        target=r"model\.decoder\.transformer\..*feed_forward", field="capacity_factor",
        value=factor)


def sequence_sharded_fsdp() -> Any:
    """A modifier that shards the parameters' `embed` axis over `fsdp` and `seq` together:
    with a `seq` axis in the mesh, the state stays split over every device (as under plain
    FSDP) while the activations split their sequence over `seq`."""
    return AxisRulesModifier.default_config().set(rules=(("embed", ("fsdp", "seq")),))


def large_model_mesh_rules(
    microbatches: Optional[Mapping[str, int]] = None,
    *,
    seq_shards: Optional[Mapping[str, int]] = None,
    model_shards: Optional[Mapping[str, int]] = None,
    moe_capacity_factor: Optional[float] = None,
) -> tuple[tuple[str, Any], ...]:
    """Mesh rules for real-size models on every supported target.

    Every accelerator: parameters, gradients and optimizer state FSDP-sharded over every
    device (TPU: over the slice's ICI, data parallel across slices; GPU: across hosts too,
    so a 70B model's state fits 32 GPUs), every transformer layer rematerialised
    (`nothing_saveable`: the backward keeps one [tokens, dim] input per layer), attention
    blockwise (no [seq, seq] scores) and the LM head + loss chunked (no [tokens, vocab]
    f32 logits). Trainium2 adds 4-way tensor
    parallelism inside a chip group.
    `moe_capacity_factor`: MoE layers use the capacity dispatch on accelerators (see
    `moe_capacity`).
    `microbatches` ({family: n}, families as in `FAMILIES`): gradient accumulation where
    the per-device activations of the whole batch do not fit; sized for the golden
    selectors (`SELECTORS`), so that `jaxlearn aot` reports a fit there
    (`docs/aot_matrix.md`).
    `seq_shards` ({family: n}, TPU families): where one sequence per chip still does not
    fit, context parallelism inside the slice: an ICI `seq` axis of n devices (FSDP over
    the rest), ring attention, and the parameters sharded over `fsdp` x `seq`
    (`sequence_sharded_fsdp`), so each device holds 1/n of a sequence's activations at
    the same state per device. Each FSDP shard must hold one row per microbatch (see
    `context_parallel_mesh_rules`): n x the microbatches of the plain FSDP layout.
    `model_shards` ({family: n}, TPU families): tensor parallelism inside the slice, an
    ICI `model` axis of n devices (FSDP over the rest): heads, MLP hidden (of every
    expert too) and vocabulary split n ways, so each device gathers 1/n of a layer's
    weights; n x the microbatches of plain FSDP, for one row per FSDP shard.
    CPU: FSDP over every device (for AOT checks and smoke runs), einsum attention.
    """
    microbatches, seq_shards = dict(microbatches or {}), dict(seq_shards or {})
    model_shards = dict(model_shards or {})
    unknown = (set(microbatches) | set(seq_shards) | set(model_shards)) - set(FAMILIES)
    if unknown:
        raise ValueError(f"large_model_mesh_rules: unknown families {sorted(unknown)}; "
                         f"known: {sorted(FAMILIES)}")
    for name, shards in (("seq_shards", seq_shards), ("model_shards", model_shards)):
        not_tpu = sorted(f for f, n in shards.items() if n > 1 and not f.startswith("tpu"))
        if not_tpu:
            raise ValueError(f"large_model_mesh_rules: {name} is for TPU families; got "
                             f"{not_tpu}")
    fsdp_all = mesh(mesh_shape_from_axes(fsdp=-1))
    # TPU: FSDP over the slice (ICI), data parallel across slices (DCN) of a multi-slice job.
    layouts = {"tpu": mesh(hybrid_mesh_shape_from_axes(ici={"fsdp": -1}, dcn={"data": -1})),
               "gpu": fsdp_all,
               "trn2": mesh(mesh_shape_from_axes(fsdp=-1, model=4))}
    rules = []
    for family, pattern in FAMILIES.items():
        platform = family.split("-")[0]
        seq, tp = seq_shards.get(family, 1), model_shards.get(family, 1)
        if seq > 1:
            mods = [mesh(hybrid_mesh_shape_from_axes(ici={"fsdp": -1, "seq": seq},
                                                     dcn={"data": -1})),
                    sequence_sharded_fsdp(), remat("nothing_saveable"), ring_attention()]
        elif tp > 1:
            mods = [mesh(hybrid_mesh_shape_from_axes(ici={"fsdp": -1, "model": tp},
                                                     dcn={"data": -1})),
                    remat("nothing_saveable"), blockwise_attention()]
        else:
            mods = [layouts[platform], remat("nothing_saveable"), blockwise_attention()]
        mods.append(chunked_loss(_LOSS_CHUNK_TOKENS[platform]))
        if moe_capacity_factor is not None:
            mods.append(moe_capacity(moe_capacity_factor))
        if microbatches.get(family, 1) > 1:
            mods.append(grad_accumulation(microbatches[family]))
        rules.append((pattern, chain(*mods)))
    rules.append((r"cpu-.*", mesh(mesh_shape_from_axes(fsdp=-1))))
    return tuple(rules)


def small_model_mesh_rules() -> tuple[tuple[str, Any], ...]:
    """Mesh rules for laptop-size models: data parallel everywhere, FSDP on accelerators."""
    return (
        (r"cpu-.*", mesh(mesh_shape_from_axes(data=-1))),
        (r"tpu-.*", mesh(mesh_shape_from_axes(fsdp=-1))),
        (r"gpu-.*", mesh(hybrid_mesh_shape_from_axes(ici={"fsdp": -1}, dcn={"data": -1}))),
        (r"trn2-.*", mesh(mesh_shape_from_axes(fsdp=-1))),
    )


def trainer_config(
    model: Any,
    input_cfg: Any,
    *,
    max_step: int,
    learning_rate: float,
    warmup_steps: int,
    mesh_rules: tuple,
    eval_input: Optional[Any] = None,
    eval_every_n_steps: int = 0,
    save_every_n_steps: int = 1000,
    log_every_n_steps: int = 10,
    weight_decay: float = 0.1,
) -> Trainer.Config:
    cfg = Trainer.default_config().set(
        model=model,
        input=input_cfg,
        eval_input=eval_input,
        eval_every_n_steps=eval_every_n_steps,
        checkpointer=Checkpointer.default_config().set(directory="", keep_last_n=3),
        max_step=max_step,
        save_every_n_steps=save_every_n_steps,
        log_every_n_steps=log_every_n_steps,
        mesh_rules=mesh_rules,
        output_dir="",  # Set by `jaxlearn train --output_dir`.
    )
    cfg.learner.set(
        learning_rate=learning_rate,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        schedule="cosine",
        max_grad_norm=1.0,
    )
    return cfg
