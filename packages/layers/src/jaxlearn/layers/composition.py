"""Composition by config: rewrite a model config without touching layer code.

Each helper is a short traversal of the config tree (jaxlearn.config.replace_config /
visit) and returns a new config; the input is not modified.

    cfg = llama_config(32000, 4096, 32, 32, 32, 11008)
    cfg = use_moe(cfg, num_experts=8, top_k=2, every=2)      # MoE in every 2nd layer
    cfg = use_gqa(cfg, num_kv_heads=8)                       # MHA -> GQA
    cfg = set_rope(cfg, RotaryEmbedding.default_config().set(theta=1e6))
    cfg = set_norm(cfg, LayerNorm.default_config())           # every norm
    cfg = set_unroll(cfg, 1)                                  # every layer scan rolled
    cfg = use_dot(cfg, Int8Dot.default_config())              # int8 dots everywhere
    cfg, params = fuse_projections(cfg, params)              # serving: fused QKV / gate
    cfg = use_lora(cfg, rank=8, alpha=16)                    # LoraLinear q/k/v/o, wi/wo
    cfg, params = merge_lora(cfg, params)                    # fold them in: a plain model
    cfg, params = first_layers(cfg, params, 8)               # early-exit draft: 8 layers
"""

from __future__ import annotations

import re
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxlearn.config import ConfigBase, replace_config, visit
from jaxlearn.layers.attention import Attention
from jaxlearn.layers.dense import Linear
from jaxlearn.layers.ffn import FeedForward
from jaxlearn.layers.lora import DEFAULT_TARGETS, LoraLinear, check_lora_settings
from jaxlearn.layers.moe import MixtureOfExperts
from jaxlearn.layers.norm import LayerNorm, RMSNorm
from jaxlearn.layers.transformer import BaseStack, LoopStack, ScanStack


def use_moe(cfg: Any, *, num_experts: int, top_k: int = 2, every: int = 1, **moe: Any) -> Any:
    """Dense FFN -> mixture of experts in every layer (every=1) or every `every`-th layer
    (the stack becomes a LoopStack of explicit layers). `hidden_dim`/`activation` carry over."""
    experts = MixtureOfExperts.default_config().set(
        num_experts=num_experts, num_experts_per_token=top_k, **moe
    )
    if every == 1:
        return replace_config(cfg, FeedForward, experts)

    def interleave(stack: Any, path: str) -> Any:
        layers = [stack.layer.clone() for _ in range(stack.num_layers)]
        for i in range(every - 1, len(layers), every):
            layers[i] = replace_config(layers[i], FeedForward, experts)
        return LoopStack.default_config().set(
            num_layers=len(layers), layer=stack.layer, layers=layers, remat_spec=stack.remat_spec
        )

    return replace_config(cfg, BaseStack, interleave, carry_over=False)


def use_gqa(cfg: Any, num_kv_heads: int) -> Any:
    """Every attention gets `num_kv_heads` key/value heads (1 = MQA, num_heads = MHA)."""
    return replace_config(cfg, Attention, lambda old, path: old.clone(num_kv_heads=num_kv_heads))


def set_rope(cfg: Any, rope: Optional[ConfigBase]) -> Any:
    """Every attention uses `rope` (a RotaryEmbedding config), or no position encoding."""
    return replace_config(cfg, Attention, lambda old, path: old.clone(rope=rope))


def set_unroll(cfg: Any, unroll: int) -> Any:
    """Every `ScanStack` unrolls its `lax.scan` `unroll` layers at a time (1: rolled)."""
    return replace_config(cfg, ScanStack, lambda old, path: old.clone(unroll=unroll),
                          carry_over=False, allow_no_match=True)


def set_norm(cfg: Any, norm: ConfigBase) -> Any:
    """Every RMSNorm/LayerNorm becomes `norm` (input_dim and eps carried over)."""
    return replace_config(
        cfg, lambda path, c: "klass" in c and c.klass in (RMSNorm, LayerNorm), norm
    )


def use_dot(cfg: Any, dot: Optional[ConfigBase], *, of: Optional[type] = None) -> Any:
    """Every dense layer (attention projections, FFN/expert matmuls, LM head) uses `dot`,
    e.g. Int8Dot / Fp8Dot configs, and so does every attention core (its f32 products take
    an exact one: `SgemmDot`); None restores the default bf16-friendly matmul. `of`: only
    the layers whose dot is of that class (serving: `use_dot(cfg, None, of=SgemmDot)`,
    since `SgemmDot` only chooses where a training step's f32 dots run)."""
    new = cfg.clone()

    def enter(path: str, value: Any) -> None:
        if isinstance(value, ConfigBase) and "dot" in value and "klass" in value and (
                of is None or (value.dot is not None and value.dot.klass is of)):
            value.dot = dot

    visit(new, enter)
    return new


def fuse_projections(cfg: Any, params: Any) -> tuple[Any, Any]:
    """(config, params) with every attention's q/k/v projections swapped for one
    `qkv_proj` child and every gated FFN's two input projections for one `wi_fused` child
    (same function, fewer and larger matmuls: on CPU a decode GEMV has a fixed cost). For
    single-device serving: the fused axes carry no sharding. Params may be stacked
    ([layers, ...] under ScanStack)."""

    def fuse_cfg(old: Any, path: str) -> Any:
        if issubclass(old.klass, Attention):
            if old.qkv_proj is not None:
                return old
            return old.clone(qkv_proj=old.q_proj, q_proj=None, k_proj=None, v_proj=None)
        if len(old.activation) == 2 and old.wi_fused is None:
            return old.clone(wi_fused=old.wi)
        return old

    new_cfg = replace_config(
        cfg,
        lambda path, c: "klass" in c and issubclass(c.klass, (Attention, FeedForward)),
        fuse_cfg,
    )
    return new_cfg, fuse_projection_params(params)


def _concat(parts: list[Any], axis: int) -> dict[str, Any]:
    """Linear params {weight, bias?} concatenated on `axis` (counted from the end)."""
    out = {"weight": jnp.concatenate([p["weight"] for p in parts], axis=axis)}
    if "bias" in parts[0]:
        out["bias"] = jnp.concatenate([p["bias"] for p in parts], axis=axis)
    return out


def fuse_projection_params(params: Any) -> Any:
    """The params of `fuse_projections`: q/k/v_proj (weight, bias) concatenated on the
    heads axis into qkv_proj; gated FFN wi_0/wi_1 on the mlp axis into wi_fused;
    mixture-of-experts weights (raw arrays next to a `router`) are left alone, like the
    MoE configs. Other leaves are returned as they are."""
    if not isinstance(params, dict):
        return params
    out = {k: fuse_projection_params(v) for k, v in params.items()}

    def linear(name: str) -> bool:
        return isinstance(out.get(name), dict) and "weight" in out[name]

    if all(linear(f"{n}_proj") for n in "qkv"):
        out["qkv_proj"] = _concat([out.pop(f"{n}_proj") for n in "qkv"], -2)
    if linear("wi_0") and linear("wi_1"):
        out["wi_fused"] = _concat([out.pop("wi_0"), out.pop("wi_1")], -1)
    return out


def use_lora(
    cfg: Any,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: str = DEFAULT_TARGETS,
    dropout: float = 0.0,
) -> Any:
    """Every plain `Linear` config whose config path fully matches `targets` (e.g.
    'decoder.transformer.layer.self_attention.q_proj') becomes a `LoraLinear` (fields carry
    over). Mixture-of-experts weights are not Linear children and are never touched.
    Raises if nothing matches."""
    check_lora_settings("use_lora", rank, alpha, dropout)
    pattern = re.compile(targets)
    matched = []

    def match(path: str, c: Any) -> bool:
        hit = "klass" in c and c.klass is Linear and bool(pattern.fullmatch(path))
        if hit:
            matched.append(path)
        return hit

    def swap(old: Any, path: str) -> Any:
        return LoraLinear.default_config().set(
            lora_rank=rank, lora_alpha=float(alpha), lora_dropout=float(dropout))

    new = replace_config(cfg, match, swap, allow_no_match=True)
    if not matched:
        raise ValueError(
            f"use_lora: targets {targets!r} match no Linear projection config (they are "
            f"matched against its config path, e.g. "
            f"'decoder.transformer.layer.self_attention.q_proj')"
        )
    return new


def merge_lora(cfg: Any, params: Any) -> tuple[Any, Any]:
    """(plain config, params) with every adapter folded in, W += (alpha / rank) * A @ B
    (in f32, stored in W's dtype), and the adapter params removed. `cfg` is the model
    config `params` belong to; stacked params ([layers, ...]) are merged per layer."""
    model = cfg.instantiate()
    merged = _merge_tree(model, params)
    plain = replace_config(
        cfg,
        lambda path, c: "klass" in c and c.klass is LoraLinear,
        lambda old, path: Linear.default_config(),
        allow_no_match=True,
    )
    return plain, merged


def _merge_tree(module: Any, params: dict[str, Any]) -> dict[str, Any]:
    out = dict(params)
    if isinstance(module, LoraLinear):
        adapter = out.pop("adapter", None)
        if adapter is None or "weight" not in out:
            raise ValueError(f"merge_lora: {module.path()}: params lack weight / adapter")
        out["weight"] = _folded(out["weight"], adapter["lora_a"], adapter["lora_b"],
                                module.adapter.scale)
        return out
    for child_name, child in module.children.items():
        if child_name in out and isinstance(out[child_name], dict):
            out[child_name] = _merge_tree(child, out[child_name])
    return out


def _folded(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """w [*lead, *in, *out] + scale * a [*lead, *in, r] @ b [*lead, r, *out], in f32."""
    n_lead = a.ndim + b.ndim - 2 - w.ndim  # Stacked layers: [layers, ...].
    lead, rank = w.shape[:n_lead], a.shape[-1]
    a2 = a.reshape(*lead, -1, rank).astype(jnp.float32)
    b2 = b.reshape(*lead, rank, -1).astype(jnp.float32)
    delta = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST).reshape(w.shape)
    return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


def first_layers(cfg: Any, params: Any, n: int) -> tuple[Any, Any]:
    """(config, params) of the model cut after its first `n` layers, then its output norm
    and head (weights shared): an early-exit draft for speculative decoding, as
    LayerSkip's. One `ScanStack` or `LoopStack` in the model; ValueError names the stack
    when it is neither or n is not in [1, layers]."""
    found: list[tuple[str, bool]] = []

    def cut(old: Any, path: str) -> Any:
        total = old.num_layers if old.num_layers is not None else len(old.layers)
        if not issubclass(old.klass, (ScanStack, LoopStack)) or not 0 < n <= total:
            raise ValueError(f"first_layers: {path} is a {old.klass.__name__} of {total} "
                             f"layers; n={n} must be in [1, {total}] of a ScanStack or LoopStack")
        found.append((path, issubclass(old.klass, ScanStack)))
        return old.clone(num_layers=n, **({} if found[-1][1] else
                                           {"layers": old.layers and old.layers[:n]}))

    new_cfg = replace_config(cfg, BaseStack, cut, carry_over=False)
    if len(found) != 1:
        raise ValueError(f"first_layers: {len(found)} layer stacks in the model; one is needed")
    (path, scan), = found
    *outer, last = path.split(".")
    new_params = node = dict(params)
    for key in outer:
        node[key] = node = dict(node[key])
    stack = node[last]
    node[last] = ({**stack, "layer": jax.tree.map(lambda x: x[:n], stack["layer"])} if scan
                  else {k: v for k, v in stack.items() if int(k[5:]) < n})
    return new_cfg, new_params
