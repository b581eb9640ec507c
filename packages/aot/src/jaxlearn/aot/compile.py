"""Ahead-of-time compilation of the real train step for a hardware target you do not have.

    ensure_cpu_devices(selector_num_devices("gpu-h100-8x4"))   # before JAX initialises
    target = resolve_target("gpu-h100-8x4")
    report = aot_compile(trainer_cfg, target)                 # AOTReport
    print(format_report(report)); report.to_dict()            # human table / JSON

The three steps live in three modules: `jaxlearn.aot.target` (which devices stand in for
the target: a mock TPU topology or a fake CPU mesh), this module (build the trainer on
them and compile its step) and `jaxlearn.aot.report` (memory, FLOPs, collectives and the
time model of a compiled step; the printed report). This module re-exports the names of
the sequence above.

What a fake CPU mesh tells you: the partitioning (shardings, collectives, per-device state)
is that of the target; per-device memory and FLOPs come from the CPU compiler, whose fusion,
layout and buffer reuse differ from the TPU/GPU compilers (temp memory in particular is an
estimate, usually on the high side). The report says which backend produced it.

Inference: `aot_compile(..., inference_steps=fn)` also analyses what `fn(trainer)` returns
(`{"prefill": compiled, "decode": compiled}`); the aot package cannot import
`jaxlearn.inference`, so the caller (the CLI) supplies the hook once an engine exists.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np

from jaxlearn.aot.report import (
    DEFAULT_HBM_UTILIZATION,
    DEFAULT_MFU,
    AOTReport,
    StepReport,
    analyze_compiled,
    format_report,
)
from jaxlearn.aot.target import (
    AOTError,
    Target,
    ensure_cpu_devices,
    resolve_target,
    target_mesh_shape,
)
from jaxlearn.config import ConfigBase

InferenceSteps = Callable[[Any], Mapping[str, Any]]


def batch_shapes(cfg: ConfigBase) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{feature: (global shape, dtype)} of a trainer config's input: from the input's
    `batch_shapes()` when it has one (no data is read), else from one batch."""
    inp = cfg.input.instantiate()
    if hasattr(inp, "batch_shapes"):
        return {k: (tuple(s), np.dtype(d)) for k, (s, d) in inp.batch_shapes(1).items()}
    first = next(inp.iterator(0, 1))
    return {k: (tuple(np.shape(v)), np.asarray(v).dtype) for k, v in first.items()}


def abstract_batch(trainer: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch as ShapeDtypeStructs with the trainer's batch sharding."""
    return {k: jax.ShapeDtypeStruct(s, d, sharding=trainer.batch_sharding)
            for k, (s, d) in batch_shapes(trainer.config).items()}


def remat_settings(cfg: ConfigBase) -> dict[str, str]:
    """{config path: remat policy} of every module config with a `remat_spec` set."""
    from jaxlearn.config import visit

    found: dict[str, str] = {}

    def enter(path: str, value: Any) -> bool:
        if isinstance(value, ConfigBase) and "remat_spec" in value:
            spec = value.remat_spec
            if spec is not None:
                found[path] = str(getattr(spec, "policy", spec))
        return False

    visit(cfg, enter)
    return found


def build_trainer(cfg: ConfigBase, target: Target) -> Any:
    """The trainer of `cfg` with its mesh on the target's devices."""
    cfg = cfg.clone()
    cfg.mesh_shape = target_mesh_shape(cfg.mesh_shape, target)
    try:
        return cfg.instantiate(devices=list(target.devices))
    except (ValueError, RuntimeError, TypeError) as e:  # ConfigError, TrainerError, ...
        raise AOTError(f"{target.selector}: cannot build the trainer on mesh "
                       f"{cfg.mesh_shape}: {type(e).__name__}: {e}") from e


def aot_compile(
    cfg: ConfigBase,
    target: Target,
    *,
    mfu: float = DEFAULT_MFU,
    hbm_utilization: float = DEFAULT_HBM_UTILIZATION,
    batch: Optional[Mapping[str, jax.ShapeDtypeStruct]] = None,
    inference_steps: Optional[InferenceSteps] = None,
) -> AOTReport:
    """Compiles the train step of trainer config `cfg` for `target` and reports on it.

    Args:
        cfg: a trainer config with its mesh rule and overrides applied.
        target: from `resolve_target`.
        mfu: model FLOPs utilisation assumed for the predicted step time.
        hbm_utilization: the share of HBM a step may use.
        batch: the global batch as ShapeDtypeStructs (default: from the input config);
            its shardings are replaced by the trainer's batch sharding.
        inference_steps: fn(trainer) -> {name: compiled} for inference steps (a hook for
            the inference engine; None: not compiled, said in the report).
    Raises:
        AOTError: the mesh does not fit the target or the step does not compile.
    """
    trainer = build_trainer(cfg, target)
    abstract = _sharded_batch(trainer, target, batch)
    mesh_devices = list(trainer.mesh.devices.flat)
    t0 = time.monotonic()
    try:
        compiled = trainer.compile_train_step(abstract)
    except Exception as e:
        raise AOTError(f"{target.selector}: the train step does not compile on mesh "
                       f"{dict(trainer.mesh.shape)}: {type(e).__name__}: {e}") from e
    steps = {
        "train_step": analyze_compiled(
            "train_step", compiled, target, mesh_devices, mfu=mfu,
            hbm_utilization=hbm_utilization, compile_seconds=time.monotonic() - t0,
            abstract_state=trainer.abstract_state(derived=True),
        )
    }
    if inference_steps is None:
        inference = ("not compiled: no inference engine is registered (hook: "
                     "aot_compile(inference_steps=fn), fn(trainer) -> {name: compiled})")
    else:
        steps.update(_inference_reports(trainer, target, inference_steps, mesh_devices,
                                        mfu, hbm_utilization))
        inference = "compiled: " + ", ".join(k for k in steps if k != "train_step")
    return _report(trainer, target, abstract, steps, inference, mfu, hbm_utilization)


def _sharded_batch(trainer: Any, target: Target,
                   batch: Optional[Mapping[str, jax.ShapeDtypeStruct]]
                   ) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch with the trainer's batch sharding; AOTError when a feature does
    not split over the batch axes."""
    if batch is None:
        abstract = abstract_batch(trainer)
    else:
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
                    for k, v in batch.items()}
    for k, v in abstract.items():
        try:
            trainer.batch_sharding.shard_shape(v.shape)
        except ValueError:
            raise AOTError(
                f"{target.selector}: batch feature {k!r} of shape {tuple(v.shape)} cannot be "
                f"split over the batch axes {trainer.batch_sharding.spec[0]} of mesh "
                f"{dict(trainer.mesh.shape)}; change the global batch size or the mesh"
            ) from None
    return abstract


def _inference_reports(trainer: Any, target: Target, inference_steps: InferenceSteps,
                       mesh_devices: list[Any], mfu: float, hbm_utilization: float
                       ) -> dict[str, StepReport]:
    """A StepReport per step `inference_steps(trainer)` compiles, timed one by one."""
    out = {}
    t0 = time.monotonic()
    for name, comp in inference_steps(trainer).items():
        out[name] = analyze_compiled(name, comp, target, mesh_devices, mfu=mfu,
                                     hbm_utilization=hbm_utilization,
                                     compile_seconds=time.monotonic() - t0)
        t0 = time.monotonic()
    return out


def _report(trainer: Any, target: Target, abstract: Mapping[str, jax.ShapeDtypeStruct],
            steps: dict[str, StepReport], inference: str, mfu: float,
            hbm_utilization: float) -> AOTReport:
    c = trainer.config
    return AOTReport(
        selector=target.selector,
        hardware=target.hardware.kind,
        backend=target.backend,
        topology=target.topology,
        num_devices=target.num_devices,
        num_granules=target.num_granules,
        hbm_bytes=target.hbm_bytes,
        peak_flops_per_device=target.hardware.peak_bf16_flops,
        fast_link_bytes_per_s=target.hardware.fast_link_bytes_per_s,
        dcn_bytes_per_s=target.hardware.dcn_bytes_per_s,
        mfu=mfu,
        hbm_utilization=hbm_utilization,
        mesh_axis_names=tuple(c.mesh_axis_names),
        mesh_shape=c.mesh_shape,
        mesh={k: int(v) for k, v in trainer.mesh.shape.items()},
        num_microbatches=int(c.learner.num_microbatches),
        remat=remat_settings(c),
        batch={k: (list(v.shape), str(v.dtype)) for k, v in abstract.items()},
        steps=steps,
        inference=inference,
        notes=list(target.notes),
    )


__all__ = [
    "DEFAULT_HBM_UTILIZATION",
    "DEFAULT_MFU",
    "AOTError",
    "AOTReport",
    "InferenceSteps",
    "Target",
    "abstract_batch",
    "aot_compile",
    "batch_shapes",
    "build_trainer",
    "ensure_cpu_devices",
    "format_report",
    "remat_settings",
    "resolve_target",
]
