"""How the fine-tuning recipes' CPU rule runs the layer stack: as a Python loop over
per-layer parameters (`LoopLayersModifier`), rematerialised only where it is needed
(`RematToFitModifier`).

A scanned stack keeps each parameter stacked [layers, ...]. Unrolled on XLA:CPU, every
layer then copies its weights out of the stack (XLA slices are copies; a dot or an FFI call
reads a whole buffer): SmolLM2-135M LoRA, 633 slices per step, ~0.2 s of op time; the
stacked residuals are zero-filled and copied too. A `LoopStack` of the same layer holds
each layer's parameters as their own arrays (`layer0` .. `layer{n-1}`): no slices, 16 %
less temporary memory; on an Emerald Rapids Xeon, same batches, in process: LoRA 1.07x
per step (1.08x CPU-s), full fine-tune 0.99x (its gradients are written per layer either
way).
The rule converts whatever the host's memory, so a run's parameter layout does not
depend on the host that started it; serving rolls such a stack back into a scan where it
packs the weights (`inference.Engine.Config.roll_layers`).

Rematerialising every layer buys memory with about a third more compute. On an
accelerator the memory is scarce; on a host with tens of GiB a laptop-size fine-tune fits
without it, and there the step is faster without remat (SmolLM2-135M full fine-tune,
8 x 128 tokens, f32 on a 2-core EPYC: 1.29x). `RematToFitModifier` estimates the step's
memory without remat and applies the remat policy only when that estimate does not fit
the host's budget.

The estimate (bytes, all on one host): the parameters, their gradients and AdamW's two
moments (4 x the parameter bytes, as if every parameter trained: an over-count for LoRA),
the activations the backward keeps with no remat (`jaxlearn.aot.estimate.
activation_bytes`, einsum attention's [heads, seq] weights included) and three f32
[tokens, vocab] buffers of the loss (the tokens of one chunk under `loss_chunk_tokens`),
times `safety` (1.5: the compiler's temporaries; the SmolLM2 step above needs 4.4 GB by
XLA's buffer assignment, estimated 3.6 GB).
The budget is `memory_fraction` of the host's memory (`host_memory_bytes`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from typing import Any, Iterator, Optional

from jaxlearn.aot.estimate import activation_bytes, find_int_field, model_shape
from jaxlearn.config import REQUIRED, ConfigBase
from jaxlearn.layers import ScanStack, swapped_stack
from jaxlearn.mesh import ConfigModifier, MeshRuleError, matching_config_paths
from jaxlearn.module import RematSpec, flatten_specs
from jaxlearn.runtime.input_pipeline import batch_rows

# Plan for this much host memory instead of the machine's own (bytes): what `jaxlearn
# config` prints for another machine, and what the golden configs are written with.
HOST_MEMORY_ENV = "JAXLEARN_HOST_MEMORY_BYTES"
_PLANNED: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar(
    "planned_host_memory", default=None)


@contextlib.contextmanager
def planned_host_memory(num_bytes: int) -> Iterator[None]:
    """Inside: `host_memory_bytes()` is `num_bytes` (configs planned for another host)."""
    token = _PLANNED.set(num_bytes)
    try:
        yield
    finally:
        _PLANNED.reset(token)


def host_memory_bytes() -> int:
    """`planned_host_memory`'s figure, else $JAXLEARN_HOST_MEMORY_BYTES, else the smaller
    of physical memory and the cgroup's memory limit."""
    if _PLANNED.get() is not None:
        return int(_PLANNED.get())  # type: ignore[arg-type]
    if os.environ.get(HOST_MEMORY_ENV):
        try:
            return int(os.environ[HOST_MEMORY_ENV])
        except ValueError:
            raise ValueError(f"${HOST_MEMORY_ENV}={os.environ[HOST_MEMORY_ENV]!r}: not a "
                             f"number of bytes") from None
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return int(total)


def step_bytes_without_remat(cfg: ConfigBase) -> int:
    """Estimated host bytes of trainer config `cfg`'s step with no remat (module doc)."""
    model = cfg.model.clone(name="model").instantiate()
    specs = [s for _, s in flatten_specs(model.create_parameter_specs_recursively())]
    batch = int(batch_rows(cfg.input) or 0)  # Rows, as the step sees them.
    shape = model_shape(cfg, specs, batch)
    tokens = batch * shape.seq_len
    state = 4 * sum(math.prod(s.shape) for s in specs) * shape.param_bytes
    acts = activation_bytes(shape, tokens, 1, "none", "einsum")
    # The decoder's vocab_size (its embedding's num_embeddings is filled from it).
    owner = find_int_field(cfg.model, "vocab_size") or find_int_field(cfg.model, "num_embeddings")
    vocab = int(getattr(owner, "vocab_size", 0) or getattr(owner, "num_embeddings", 0) or 0)
    loss_tokens = min(tokens, getattr(cfg.model, "loss_chunk_tokens", None) or tokens)
    return state + acts + 3 * loss_tokens * vocab * 4


class RematToFitModifier(ConfigModifier):
    """Sets `remat_spec = RematSpec(policy)` on the layers matching `target` when the step
    without remat would not fit `memory_fraction` of the host's memory; otherwise leaves
    them without remat and unrolls the stacks matching `stack` (`ScanStack.unroll` =
    its layer count)."""

    class Config(ConfigModifier.Config):
        target: str = REQUIRED  # regex of the repeated layer's path
        stack: str = REQUIRED  # regex of the stack's path
        policy: str = "nothing_saveable"
        memory_fraction: float = 0.5
        safety: float = 1.5
        memory_bytes: Optional[int] = None  # None: host_memory_bytes()

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self.config
        who = type(self).__name__
        budget = c.memory_fraction * (c.memory_bytes or host_memory_bytes())
        need = c.safety * step_bytes_without_remat(cfg)
        if need > budget:
            paths = matching_config_paths(cfg, c.target, "remat_spec")
            if not paths:
                raise MeshRuleError(f"{who}: no config path fully matches {c.target!r} "
                                    f"and has a field 'remat_spec'")
            for path in paths:
                cfg.set_recursively(f"{path}.remat_spec", RematSpec(policy=c.policy))
            return cfg
        for path in matching_config_paths(cfg, c.stack, "unroll"):
            stack: Any = cfg.get_recursively(path)
            stack.unroll = int(stack.num_layers)
        return cfg


class LoopLayersModifier(ConfigModifier):
    """Replaces each `ScanStack` matching `stack` whose layer is one repeated layer (not a
    group) by a `LoopStack` of that layer: the same model, its parameters held per layer
    (module doc). Other stacks are left as they are; MeshRuleError when no stack matches."""

    class Config(ConfigModifier.Config):
        stack: str = REQUIRED  # regex of the stack's path

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self.config
        paths = matching_config_paths(cfg, c.stack, "num_layers")
        if not paths:
            raise MeshRuleError(f"{type(self).__name__}: no config path fully matches "
                                f"{c.stack!r} and has a field 'num_layers'")
        for path in paths:
            stack: Any = cfg.get_recursively(path)
            if stack.klass is ScanStack:  # Not a loop already.
                loop, _ = swapped_stack(stack)
                if loop is not None:  # None: a repeating group of different layers.
                    cfg.set_recursively(path, loop)
        return cfg
