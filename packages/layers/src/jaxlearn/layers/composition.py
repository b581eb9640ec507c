"""Composition by config: rewrite a model config without touching layer code.

Each helper is a short traversal of the config tree (jaxlearn.config.replace_config /
visit) and returns a new config; the input is not modified.

    cfg = llama_config(32000, 4096, 32, 32, 32, 11008)
    cfg = use_moe(cfg, num_experts=8, top_k=2, every=2)      # MoE in every 2nd layer
    cfg = use_gqa(cfg, num_kv_heads=8)                       # MHA -> GQA
    cfg = set_rope(cfg, RotaryEmbedding.default_config().set(theta=1e6))
    cfg = set_norm(cfg, LayerNorm.default_config())           # every norm
    cfg = use_dot(cfg, Int8Dot.default_config())              # int8 dots everywhere
"""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.config import ConfigBase, replace_config, visit
from jaxlearn.layers.attention import Attention
from jaxlearn.layers.ffn import FeedForward
from jaxlearn.layers.moe import MixtureOfExperts
from jaxlearn.layers.norm import LayerNorm, RMSNorm
from jaxlearn.layers.transformer import BaseStack, LoopStack


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
        return LoopStack.default_config().set(num_layers=len(layers), layer=stack.layer,
                                              layers=layers, remat_spec=stack.remat_spec)

    return replace_config(cfg, BaseStack, interleave, carry_over=False)


def use_gqa(cfg: Any, num_kv_heads: int) -> Any:
    """Every attention gets `num_kv_heads` key/value heads (1 = MQA, num_heads = MHA)."""
    return replace_config(cfg, Attention, lambda old, path: old.clone(num_kv_heads=num_kv_heads))


def set_rope(cfg: Any, rope: Optional[ConfigBase]) -> Any:
    """Every attention uses `rope` (a RotaryEmbedding config), or no position encoding."""
    return replace_config(cfg, Attention, lambda old, path: old.clone(rope=rope))


def set_norm(cfg: Any, norm: ConfigBase) -> Any:
    """Every RMSNorm/LayerNorm becomes `norm` (input_dim and eps carried over)."""
    return replace_config(
        cfg, lambda path, c: "klass" in c and c.klass in (RMSNorm, LayerNorm), norm
    )


def use_dot(cfg: Any, dot: Optional[ConfigBase]) -> Any:
    """Every dense layer (attention projections, FFN/expert matmuls, LM head) uses `dot`,
    e.g. Int8Dot / Fp8Dot configs; None restores the default bf16-friendly matmul."""
    new = cfg.clone()

    def enter(path: str, value: Any) -> None:
        if isinstance(value, ConfigBase) and "dot" in value and "klass" in value:
            value.dot = dot

    visit(new, enter)
    return new
