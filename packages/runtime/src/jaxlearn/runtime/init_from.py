"""Where a run's first params come from when it has no checkpoint yet: `Trainer.Config.
init_from`, a config of any class with the `ParamSource` methods.

    cfg.init_from = CheckpointParams.default_config().set(path="runs/base")  # jaxlearn run
    cfg.init_from = PretrainedParams.default_config().set(path="model_dir")  # HF / GGUF
                    # (jaxlearn.interop.sharded; the CLI's --init_from sets either)

`load(model, shardings)` returns the model's params as jax.Arrays already placed per
`shardings` (the train state's parameter shardings), so no host ever holds the whole
model: HF/GGUF files are read shard by shard (`jax.make_array_from_callback`), a jaxlearn
checkpoint is restored by orbax straight into the target shardings. The trainer builds
the optimizer state, PRNG key and step around them; a run with checkpoints resumes those
and never calls `load`.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import jax
import numpy as np

from jaxlearn.config import REQUIRED, Configurable

log = logging.getLogger("jaxlearn.trainer")


class InitFromError(ValueError):
    """`init_from` params that do not fit the model (the message names the source)."""


class ParamSource(Protocol):
    """What `Trainer.Config.init_from` instantiates to."""

    def describe(self) -> str:
        """The base model, as the run record names it (`RunRecord.base_model`)."""
        ...

    def load(self, model: Any, shardings: Any) -> Any:
        """The params of `model` (a tree like its parameter specs), placed per `shardings`."""
        ...


class CheckpointParams(Configurable):
    """The params of a jaxlearn checkpoint (a run directory: its newest good step; or one
    step directory), restored into the target shardings. Optimizer state, step and data
    position are not taken: the run starts at step 0 from these weights. LoRA adapters
    the checkpoint lacks (a LoRA recipe on a full run) are left to `load_params`, which
    initialises them; any other missing param is an InitFromError."""

    class Config(Configurable.Config):
        path: str = REQUIRED

    def describe(self) -> str:
        return str(self.config.path)

    def load(self, model: Any, shardings: Any) -> Any:
        from jaxlearn.checkpoint import locate, restore_subtree
        from jaxlearn.module import is_spec

        root, step = locate(self.config.path)
        abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(tuple(s.shape), s.dtype),
                                model.create_parameter_specs_recursively(), is_leaf=is_spec)
        # A model may name where older checkpoints stored a renamed param (a CausalLM:
        # the flat projection layout, `jaxlearn.layers.legacy`).
        params, step = restore_subtree(root, "params", abstract, shardings=shardings,
                                       step=step, skip_missing=True,
                                       aliases=getattr(model, "older_param_path", None))
        absent = [".".join(p) for p in _paths(abstract) if p not in _paths(params)
                  and p[-2:-1] != ("adapter",)]
        if absent:
            raise InitFromError(f"init_from {self.config.path}: step {step} has no "
                                f"params.{absent[0]} ({len(absent)} model params missing)")
        log.info("init_from %s: params of step %d", self.config.path, step)
        return params


def load_params(init_from: Any, model: Any, specs: Any, shardings: Any, init_key: Any) -> Any:
    """`init_from` (a ParamSource config) instantiated and loaded for `model`, checked
    against its parameter specs `specs` (paths, shapes, dtypes). Params the source leaves
    out (LoRA adapters a base model lacks) get `model`'s own initialisation from
    `init_key`, computed sharded (only those leaves are kept)."""
    from jaxlearn.module import is_spec

    source: ParamSource = init_from.instantiate()
    log.info("init_from %s", source.describe())
    params = _fill_missing(source.load(model, shardings), model, shardings, init_key)
    want = jax.tree.map(lambda s: (tuple(s.shape), np.dtype(s.dtype)), specs, is_leaf=is_spec)
    got = jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), params)
    if want != got:
        raise InitFromError(f"init_from {source.describe()}: its params do not match the "
                            "model's parameter specs (paths, shapes, dtypes)")
    return params


def _paths(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[tuple[str, ...], Any] = {}
    for k, v in tree.items():
        out.update(_paths(v, prefix + (k,)))
    return out


def _fill_missing(params: Any, model: Any, shardings: Any, init_key: Any) -> Any:
    have = _paths(params)
    want = _paths(shardings)
    missing = [p for p in want if p not in have]
    if not missing:
        return params
    log.info("init_from: %d params initialised from the seed (not in the source): %s",
             len(missing), ", ".join(".".join(p) for p in missing[:4]))

    def pick(key: Any) -> list[Any]:
        full = _paths(model.initialize_parameters_recursively(key))
        return [full[p] for p in missing]

    values = jax.jit(pick, out_shardings=[want[p] for p in missing])(init_key)
    out: dict[str, Any] = {}
    for p, v in [*have.items(), *zip(missing, values)]:
        node = out
        for part in p[:-1]:
            node = node.setdefault(part, {})
        node[p[-1]] = v
    return out


__all__ = ["CheckpointParams", "InitFromError", "ParamSource", "load_params"]
