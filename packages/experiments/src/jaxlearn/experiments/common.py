"""Shared pieces of recipes: the trainer skeleton and per-hardware mesh rules."""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.checkpoint import Checkpointer
from jaxlearn.mesh import (
    ChainModifier,
    GradAccumulationModifier,
    MeshShapeModifier,
    RematPolicyModifier,
    SetMatchingModifier,
    hybrid_mesh_shape_from_axes,
    mesh_shape_from_axes,
)
from jaxlearn.module import RematSpec
from jaxlearn.runtime.trainer import Trainer

# Path of the repeated transformer layer in every CausalLM recipe.
LAYER_PATH = r"model\.decoder\.transformer\.layer"


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
    """Mesh rules for one long row per step: the sequence split over every device (`seq`
    axis, ring attention) on every target. The layers flatten [batch, seq] to tokens
    around each matmul, which keeps the sequence sharded only while each data replica
    holds one row: so the batch is 1 here, and data parallelism means global batch =
    data-axis size."""
    return ((r".*", chain(mesh(mesh_shape_from_axes(seq=-1)), ring_attention())),)


def mesh(shape: Any) -> Any:
    return MeshShapeModifier.default_config().set(mesh_shape=shape)


def chain(*modifiers: Any) -> Any:
    return ChainModifier.default_config().set(modifiers=tuple(modifiers))


def grad_accumulation(n: int) -> Any:
    return GradAccumulationModifier.default_config().set(num_microbatches=n)


def large_model_mesh_rules(*, gpu_microbatches: int = 1) -> tuple[tuple[str, Any], ...]:
    """Mesh rules for real-size models on every supported target.

    TPU: FSDP over the slice (ICI), data parallel across slices (DCN), remat per layer.
    GPU (8 per host, NVLink): FSDP within a host, data parallel across hosts.
    Trainium2: FSDP with 4-way tensor parallelism inside a chip group.
    CPU: FSDP over every device (for AOT checks and smoke runs).
    Accelerators run attention blockwise; CPU keeps the einsum path.
    """
    tpu = chain(mesh(hybrid_mesh_shape_from_axes(ici={"fsdp": -1}, dcn={"data": -1})),
                remat("nothing_saveable"), blockwise_attention())
    gpu_mods = [mesh(hybrid_mesh_shape_from_axes(ici={"fsdp": -1}, dcn={"data": -1})),
                remat("dots_with_no_batch_dims_saveable"), blockwise_attention()]
    if gpu_microbatches > 1:
        gpu_mods.append(grad_accumulation(gpu_microbatches))
    return (
        (r"tpu-v5e-.*", tpu),
        (r"tpu-v(5p|6e|4)-.*", tpu),
        (r"gpu-(h100|h200|b200)-.*", chain(*gpu_mods)),
        (r"trn2-.*", chain(mesh(mesh_shape_from_axes(fsdp=-1, model=4)), remat(),
                           blockwise_attention())),
        (r"cpu-.*", mesh(mesh_shape_from_axes(fsdp=-1))),
    )


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
