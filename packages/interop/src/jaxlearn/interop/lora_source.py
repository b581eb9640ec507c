"""LoRA adapters from a path, for serving one base model with several adapters and for
training on from an adapter.

    weights = load_lora_adapter("adapter_or_run/", base_cfg)   # rank, alpha, params, paths
    rank, alpha, params, target_paths = weights
    cfg.init_from = AdaptedModelSource.default_config().set(path="base/", adapter="adapter/")

The path is a PEFT adapter directory (`adapter_config.json`, read by `interop.peft`) or a
jaxlearn LoRA run (its output dir, `checkpoints/` or a step dir: only the adapter params
of its newest good step, or the step given, are restored). Either way the adapter is
carried through the PEFT tensors (HF module names) onto the base model config, so a run
trained with a scanned stack serves on a looped one, and the shapes are checked against
the base model, not just the run's.
"""

from __future__ import annotations

import pathlib
from typing import Any, NamedTuple, Optional, Union

import numpy as np

from jaxlearn.config import REQUIRED, Configurable
from jaxlearn.interop.errors import InteropError, ParameterMismatchError
from jaxlearn.interop.model_source import open_model
from jaxlearn.interop.peft import (
    PeftAdapter,
    Tensors,
    adapter_from_tensors,
    is_peft_adapter,
    lora_layers,
    peft_state,
    plain_config,
    read_peft,
)


class LoraAdapterWeights(NamedTuple):
    """An adapter in jaxlearn's layout for a base model config (see `load_lora_adapter`)."""

    rank: int
    alpha: float
    params: dict[str, Any]
    target_paths: tuple[str, ...]


def open_lora_adapter(path: Union[str, pathlib.Path], base_config: Any, *,
                      step: Optional[int] = None) -> PeftAdapter:
    """The adapter at `path` (a PEFT adapter directory or a jaxlearn LoRA run; `step`: a
    run's checkpoint step, default its newest good one) read for `base_config` as a
    `peft.PeftAdapter`: rank, alpha, dropout, targets, the base config made LoRA with
    them (`model_config`) and the adapter params alone. One-line InteropError naming the
    path for anything else."""
    if is_peft_adapter(path):
        return read_peft(path, base_config)
    source = open_model(path)
    if source.kind != "jaxlearn":
        raise InteropError(f"{path}: a {source.kind} model, not a LoRA adapter (a PEFT "
                           "adapter directory with adapter_config.json, or a jaxlearn LoRA run)")
    run_cfg = source.model_config()
    run_cfg = run_cfg.clone(name="model") if run_cfg.name is REQUIRED else run_cfg
    if not lora_layers(run_cfg):
        raise InteropError(f"{path}: a jaxlearn run without LoRA adapters (its model has no "
                           "LoraLinear layers)")
    params = _run_adapter_params(source, run_cfg, step)
    tensors, adapter_config = peft_state(run_cfg, params, where=str(path))
    return adapter_from_tensors(Tensors(f"{path} (adapters)", tensors), adapter_config,
                                base_config, config_file=str(path), source=str(path))


def load_lora_adapter(path: Union[str, pathlib.Path], base_config: Any, *,
                      step: Optional[int] = None) -> LoraAdapterWeights:
    """A LoRA adapter for serving on `base_config` (a `CausalLM.Config`; any LoRA layers
    it has are ignored).

    Args:
        path: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
            or a jaxlearn LoRA run (output dir, `checkpoints/` or a step dir).
        base_config: the served base model's config.
        step: a run's checkpoint step (default: the step dir given, else the newest that
            verifies); unused for a PEFT directory.

    Returns:
        `LoraAdapterWeights(rank, alpha, params, target_paths)`, a tuple: the adapter
        computes `(alpha / rank) * x @ lora_a @ lora_b`; `params` holds only the adapter
        params (numpy float32) in the layout of `layers.use_lora(base_config, rank=rank,
        alpha=alpha, targets=...)`, e.g. `{"decoder": {"transformer": {"layer":
        {"self_attention": {"q_proj": {"adapter": {"lora_a": [L, E, r], "lora_b":
        [L, r, H, D]}}}}}}}` under a scanned stack; `target_paths` are the config paths of
        the adapted projections ("decoder.transformer.layer.self_attention.q_proj", ...).

    Raises:
        InteropError (one line naming the path, file and tensor): a path that is neither,
        a run without adapters, an adapter that does not fit `base_config` (unknown
        target modules, wrong shapes, missing tensors), unsupported PEFT options.
    """
    adapter = open_lora_adapter(path, base_config, step=step)
    return LoraAdapterWeights(adapter.rank, adapter.alpha, adapter.params, adapter.target_paths)


def _run_adapter_params(source: Any, run_cfg: Any, step: Optional[int]) -> dict[str, Any]:
    """The adapter params alone of a jaxlearn run's step (numpy)."""
    import jax

    from jaxlearn.checkpoint import restore_subtree
    from jaxlearn.module import is_spec

    model = run_cfg.instantiate()
    specs = model.create_parameter_specs_recursively()
    abstract = _adapters_only(jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(tuple(s.shape), s.dtype), specs, is_leaf=is_spec))
    if source.root is None:
        raise InteropError(f"{source.path}: a jaxlearn run without checkpoint steps")
    params, _ = restore_subtree(source.root, "params", abstract,
                                step=source.step if step is None else step)
    return jax.tree.map(np.asarray, jax.device_get(params))


def _adapters_only(tree: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if k == "adapter":
            out[k] = v
        elif isinstance(v, dict) and (sub := _adapters_only(v)):
            out[k] = sub
    return out


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with the leaves of `extra` (same nesting) added or replaced."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merged(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


class AdaptedModelSource(Configurable):
    """A base model (`Config.path`, what `open_model` opens) with a LoRA adapter
    (`Config.adapter`: a PEFT directory or a jaxlearn LoRA run) on it: the trainer's
    `init_from` for training on from an adapter (`--init_from BASE --init_adapter PATH`).
    The model config must be the base made LoRA with the adapter's settings
    (`open_lora_adapter(...).model_config`)."""

    class Config(Configurable.Config):
        path: str = REQUIRED
        adapter: str = REQUIRED

    def describe(self) -> str:
        return f"{self.config.path} with the LoRA adapter {self.config.adapter}"

    def load(self, model: Any, shardings: Any) -> Any:
        """The base model's params (`ModelSource.load`) with the adapter's, every leaf
        placed per `shardings`."""
        import jax

        from jaxlearn.families.tree import flatten
        from jaxlearn.module import is_spec

        params = open_model(self.config.path).load(model, shardings)
        adapter = open_lora_adapter(self.config.adapter, plain_config(model.config)).params
        spec_tree = _adapters_only(model.create_parameter_specs_recursively())
        specs, got = flatten(spec_tree), flatten(adapter)
        where = f"{self.config.adapter} on {self.config.path}"
        mismatched = [f"{p}: got {got[p].shape}, expected {tuple(s.shape)}"
                      for p, s in specs.items() if p in got and got[p].shape != tuple(s.shape)]
        if set(specs) != set(got) or mismatched:
            raise ParameterMismatchError(
                where, missing=[p for p in specs if p not in got],
                unexpected=[p for p in got if p not in specs], mismatched=mismatched)
        cast = jax.tree.map(lambda a, s: np.asarray(a).astype(s.dtype), adapter, spec_tree,
                            is_leaf=is_spec)
        # Each adapter leaf placed as the model's shardings say (a tree, or one for all).
        placed = jax.device_put(cast, _adapters_only(shardings) if isinstance(
            shardings, dict) else shardings)
        return _merged(params, placed)


__all__ = ["AdaptedModelSource", "LoraAdapterWeights", "load_lora_adapter", "open_lora_adapter"]
