"""What an `Engine` needs before it serves: its settings checked (`check_settings`), the
model as served (`serving_model`: the config swaps its settings ask for), its mesh
(`build_mesh`), parameter placement from logical axes (`param_shardings`, `SpecFn`), the
draft model of speculative decoding (`build_draft`) and the params of a jaxlearn
checkpoint (`restore_params`)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxlearn import layers
from jaxlearn.config import REQUIRED, replace_config
from jaxlearn.inference.adapters import check_adapter_settings
from jaxlearn.inference.draft import DraftModel
from jaxlearn.inference.quantize import check_quantize, plain_linears
from jaxlearn.inference.runner import ModelRunner
from jaxlearn.inference.weight_layout import (
    check_weight_layout,
    packed_layout_chosen,
    store_weights,
)
from jaxlearn.kernels import PackedWeights, paged_native
from jaxlearn.layers import older_param_path, swapped_stack
from jaxlearn.mesh import (
    DEFAULT_AXIS_RULES,
    logical_to_partition_spec,
    make_mesh,
    merge_axis_rules,
)
from jaxlearn.module import Module, functional, is_spec

log = logging.getLogger(__name__)

# Serving shards parameters like training, but never the batch: slots come and go.
INFERENCE_AXIS_RULES = merge_axis_rules(DEFAULT_AXIS_RULES, (("batch", None), ("seq", None)))


def check_settings(cfg: Any) -> int:
    """Validates an `Engine.Config`; returns the KV pool size in tokens. Each error names
    the field and its value."""
    for name, low in (("max_seq_len", 2), ("max_batch", 1), ("prefill_chunk", 1),
                      ("decode_burst", 1), ("max_queue", 1), ("speculative_tokens", 0),
                      ("speculative_max_rows", 1), ("speculative_ngram", 1)):
        if getattr(cfg, name) < low:
            raise ValueError(f"Engine.Config.{name}={getattr(cfg, name)}: must be >= {low}")
    if cfg.pool_spin_us is not None and cfg.pool_spin_us < 0:
        raise ValueError(f"Engine.Config.pool_spin_us={cfg.pool_spin_us}: must be None or an "
                         f"int >= 0 (microseconds)")
    ps = cfg.page_size
    if ps < 1 or ps & (ps - 1) or ps > 64:
        raise ValueError(f"Engine.Config.page_size={ps}: must be a power of two <= 64")
    if cfg.fuse_projections and cfg.mesh_shape is not None:
        raise ValueError(f"Engine.Config.fuse_projections=True needs mesh_shape=None (one "
                         f"device), got mesh_shape={cfg.mesh_shape}")
    check_quantize(cfg.quantize)
    check_adapter_settings(cfg)
    check_weight_layout(cfg.weight_layout, cfg.mesh_shape)
    if cfg.attention_kernel == "native" and cfg.mesh_shape is not None:
        raise ValueError(f"Engine.Config.attention_kernel='native' needs mesh_shape=None (one "
                         f"device), got mesh_shape={cfg.mesh_shape}")
    paged_native.check_kernel(cfg.attention_kernel, one_device=cfg.mesh_shape is None,
                              where="Engine.Config.attention_kernel")
    if cfg.quantize is not None and cfg.mesh_shape is not None:
        raise ValueError(f"Engine.Config.quantize={cfg.quantize!r} needs mesh_shape=None (one "
                         f"device), got mesh_shape={cfg.mesh_shape}")
    max_len = -(-cfg.max_seq_len // ps) * ps
    tokens = cfg.max_batch * max_len if cfg.kv_cache_tokens is None else cfg.kv_cache_tokens
    if tokens < max_len:
        raise ValueError(f"Engine.Config.kv_cache_tokens={tokens}: cannot hold one request of "
                         f"max_seq_len={cfg.max_seq_len} tokens")
    return int(tokens)


@dataclasses.dataclass
class ServingModel:
    """The model an `Engine` serves and how it got there (`serving_model`)."""

    base_model_cfg: Any  # The model as given (unrolled, named): what adapter files fit.
    model_cfg: Any  # After adapter banks, fusion, int8, weight layout, attention kernel.
    params: Any
    packed_weights: Optional[PackedWeights]  # Owner of packed copies (weight_layout).
    attention_kernel: str  # "xla" | "native"


def fuse_chosen(cfg: Any, packed: bool, float32: bool = False, lora: bool = False) -> bool:
    """`Engine.Config.fuse_projections`, None resolved: on one device, without adapter
    banks or LoRA Linears, fused where the weights will be `packed` (float or int8) or
    stay `float32` on XLA's dot (not quantized). True with LoRA Linears is an error."""
    if cfg.fuse_projections is not None:
        if cfg.fuse_projections and lora:
            raise ValueError("Engine.Config.fuse_projections=True: the model has LoRA "
                             "Linears, which are served unfused (merge the adapters first)")
        return bool(cfg.fuse_projections)
    if cfg.mesh_shape is not None or cfg.max_loras or lora:
        return False
    return packed or (float32 and cfg.quantize is None)


def float32_linears(linears: list[tuple[Any, Any]]) -> bool:
    """Whether there are plain Linears (`plain_linears`) and all hold and compute float32."""
    f32 = jnp.dtype(jnp.float32)
    return bool(linears) and all(
        jnp.dtype(p["weight"].dtype) == f32 and (m.dtype is None or jnp.dtype(m.dtype) == f32)
        for m, p in linears)


def serving_model(cfg: Any, model_cfg: Any, params: Any) -> ServingModel:
    """The config swaps an `Engine.Config` asks for, in order: layer scans rolled (every
    program compiles one layer body; a loop of one repeated layer too where the weights
    will be packed: `roll_layers`) and training-only `SgemmDot`s dropped, LoRA adapter
    banks (`max_loras`), fused projections, int8 (`quantize`), the weights' stored layout
    (`weight_layout`) and the paged attention kernel (`attention_kernel`)."""
    if getattr(model_cfg, "name", None) is REQUIRED:
        model_cfg = model_cfg.clone(name="model")
    # A training run's config may name SgemmDot (where its f32 dots ran); serving's own
    # layouts below take layers with the default dot.
    model_cfg = layers.use_dot(layers.set_unroll(model_cfg, 1), None, of=layers.SgemmDot)
    # Decided on the model as given: rolling and fusing keep its Linears plain.
    packed_chosen = packed_layout_chosen(model_cfg, params, cfg.weight_layout,
                                         mesh_shape=cfg.mesh_shape, quantize=cfg.quantize)
    if cfg.roll_layers and packed_chosen:
        model_cfg, params = rolled_layers(model_cfg, params)
    base = model_cfg
    if cfg.max_loras:  # Adapter banks: max_loras slots + slot 0 (no adapter).
        model_cfg, params = layers.use_multi_lora(
            model_cfg, params, slots=cfg.max_loras + 1, max_rank=cfg.max_lora_rank,
            targets=cfg.lora_targets)
    model = model_cfg.instantiate()
    plain = plain_linears(model, params)
    lora = len(plain_linears(model, params, lora=True)) != len(plain)  # Unmerged adapters.
    if fuse_chosen(cfg, packed_chosen, not packed_chosen and float32_linears(plain), lora):
        model_cfg, params = layers.fuse_projections(model_cfg, params)
    # Adapter banks take Linears out of the plain ones the packing counts: asked again.
    model_cfg, params, packed = store_weights(
        model_cfg, params, cfg.weight_layout, mesh_shape=cfg.mesh_shape,
        quantize_mode=cfg.quantize, chosen=None if cfg.max_loras else packed_chosen)
    if cfg.speculative_tokens and cfg.quantize is not None and packed is None:
        # XLA's int8 forward of k + 1 tokens is not bit-identical to k + 1 one-token steps
        # (SmolLM2-135M: greedy outputs part after 25-61 tokens), so drafts would change
        # what a request generates; the packed int8 kernel's rows are exact int32 sums.
        raise ValueError(f"Engine.Config.speculative_tokens={cfg.speculative_tokens} with "
                         f"quantize={cfg.quantize!r} needs the int8 weights packed "
                         f"(weight_layout 'packed', or 'auto' on one CPU device of a host with "
                         f"VNNI / AMX-INT8): XLA's int8 forward of several tokens differs from "
                         f"single steps, got weight_layout={cfg.weight_layout!r}")
    kernel = paged_native.choose_kernel(cfg.attention_kernel, one_device=cfg.mesh_shape is None,
                                        where="Engine.Config.attention_kernel")
    model_cfg = replace_config(model_cfg, layers.Attention.Config,
                               lambda old, path: old.clone(paged_kernel=kernel),
                               allow_no_match=True)
    return ServingModel(base, model_cfg, params, packed, kernel)


# How long lingering pool helpers wait (`kernels.set_pool_spin_us`), by the packed weights'
# dtype, measured serving SmolLM2-135M on a 2-vCPU Zen 4 (kernels and inference READMEs):
# bf16 300 us (share 0.89-0.92 -> 0.94-0.97, per cell -5 % to +17 % against 100 us); int8
# 30 us (100 and 300 us lost 11-30 % at 32 in flight, 30 us -2 % to +32 %); f32 300 us
# (one stream +17 / +31 %, 8 and 32 in flight -7 % to +11 %, share 0.91 -> 0.96-0.97).
POOL_SPIN_US = {"float32": 300, "bfloat16": 300, "int8": 30}


def pool_spin_for(asked: Optional[int], packed: Optional[PackedWeights]) -> int:
    """`Engine.Config.pool_spin_us` for an engine whose weights `packed` owns: `asked`, or
    `POOL_SPIN_US` of the packed weights' one dtype (0 for mixed or unpacked)."""
    if asked is not None:
        return asked
    if packed is None or len(packed.dtypes) != 1:
        return 0
    return POOL_SPIN_US.get(next(iter(packed.dtypes)), 0)


def rolled_layers(model_cfg: Any, params: Any) -> tuple[Any, Any]:
    """(config, params) of a model whose decoder stack is a `LoopStack` of one repeated
    layer (what the fine-tuning recipes' CPU rule trains) as the `ScanStack` of that layer,
    its per-layer params `layer0` .. `layer{n-1}` stacked into `layer` [n, ...]: the same
    model (`layers.swapped_stack`). Any other model comes back as it is."""
    stack: Any = getattr(getattr(model_cfg, "decoder", None), "transformer", None)
    if getattr(stack, "klass", None) is not layers.LoopStack:
        return model_cfg, params
    scan, stacked = swapped_stack(stack, params["decoder"]["transformer"])
    if scan is None:
        return model_cfg, params
    model_cfg = model_cfg.clone()
    model_cfg.decoder.transformer = scan
    return model_cfg, dict(params, decoder=dict(params["decoder"], transformer=stacked))


def build_draft(cfg: Any, model_cfg: Any, params: Any, target: ModelRunner,
                prefill_chunk: int) -> DraftModel:
    """The draft model of speculative decoding (`draft.DraftModel`) for the engine of `cfg`
    and its runner `target`: served with cfg's int8, weight layout and attention kernel
    (`serving_model`; never adapter banks), its runner laid out like the target's (slots,
    pages, page size, length) and sampling only ids the target may sample. ValueError
    when cfg does not speculate, serves on a mesh, or the draft's vocabulary is smaller
    than the ids the target samples (a draft shares the target's tokenizer)."""
    if not cfg.speculative_tokens or cfg.mesh_shape is not None:
        raise ValueError(f"a draft model needs Engine.Config.speculative_tokens > 0 and "
                         f"mesh_shape=None, got speculative_tokens={cfg.speculative_tokens}, "
                         f"mesh_shape={cfg.mesh_shape}")
    served = serving_model(cfg.clone(max_loras=0, speculative_tokens=0), model_cfg, params)
    model = served.model_cfg.instantiate()
    params = jax.device_put(served.params)
    logits = jax.eval_shape(lambda p: functional(
        model, None, p, ({"input_ids": jax.numpy.zeros((1, 1), "int32")},), method="logits",
        is_training=False)[0], params)
    vocab, limit = int(logits.shape[-1]), target.vocab_limit or target.vocab_size
    if vocab < limit:
        raise ValueError(f"the draft model has {vocab} ids and the served model samples "
                         f"{limit}: a draft model must share the served model's tokenizer")
    runner = ModelRunner(model, params, num_slots=target.num_slots,
                         num_pages=target.num_pages, page_size=target.page_size,
                         max_len=target.max_len, vocab_size=vocab, vocab_limit=limit)
    return DraftModel(runner, cfg.speculative_tokens, prefill_chunk,
                      owner=served.packed_weights)


def build_mesh(cfg: Any) -> Optional[Mesh]:
    """The mesh of an `Engine.Config` (None: one device)."""
    if cfg.mesh_shape is None:
        return None
    try:
        return make_mesh(cfg.mesh_shape, cfg.mesh_axis_names)
    except ValueError as e:
        raise ValueError(f"Engine.Config.mesh_shape={cfg.mesh_shape} with mesh_axis_names="
                         f"{cfg.mesh_axis_names}: {e}") from None


def param_shardings(model: Module, mesh: Mesh, axis_rules: Any) -> Any:
    """NamedSharding per parameter of `model` from its logical axes and `axis_rules`."""
    specs = model.create_parameter_specs_recursively()
    return jax.tree.map(
        lambda s: NamedSharding(
            mesh, logical_to_partition_spec(s.mesh_axes, axis_rules, mesh, shape=s.shape)
        ),
        specs,
        is_leaf=is_spec,
    )


def engine_axis_rules(cfg: Any) -> Any:
    """An `Engine.Config`'s axis rules (None: INFERENCE_AXIS_RULES)."""
    return tuple(cfg.axis_rules) if cfg.axis_rules is not None else INFERENCE_AXIS_RULES


class SpecFn:
    """Hashable logical-axes -> PartitionSpec function (part of jit's cache key)."""

    def __init__(self, rules: Any, mesh: Mesh):
        self.rules, self.mesh = tuple(rules), mesh

    def __call__(self, axes: Any) -> Any:
        return logical_to_partition_spec(axes, self.rules, self.mesh, strict=False)

    def __hash__(self) -> int:
        return hash((self.rules, id(self.mesh)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SpecFn) and (other.rules, other.mesh) == (self.rules, self.mesh)


def restore_params(root: Union[str, Path], model_cfg: Any, *, step: Optional[int] = None,
                   use_ema: bool = False, shardings: Any = None) -> tuple[Any, int]:
    """(params, step) of a jaxlearn checkpoint: only the params (or, with use_ema, the EMA
    params) of `step` (default: the newest step that verifies) are read, into `shardings`
    (a tree like the params; default: the default device). `root`: the checkpoint root
    (holding `step_*/`) as `checkpoint.locate` or `interop.ModelSource.root` give it; this
    does not probe the layout around it. The engine-facing wrapper of
    `checkpoint.restore_subtree`."""
    from jaxlearn.checkpoint import restore_subtree

    if getattr(model_cfg, "name", None) is REQUIRED:
        model_cfg = model_cfg.clone(name="model")
    model = model_cfg.instantiate()
    shapes = jax.eval_shape(model.initialize_parameters_recursively, jax.random.key(0))
    return restore_subtree(root, "ema" if use_ema else "params", shapes,
                           shardings=shardings, step=step,
                           aliases=older_param_path)
