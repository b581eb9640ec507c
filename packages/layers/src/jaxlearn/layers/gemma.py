"""Gemma 2 and Gemma 3 (text) recipes: `llama_config` with Gemma's settings.

Both: embeddings scaled by sqrt(dim), every RMSNorm `* (1 + scale)`, norms before and
after attention and FFN (`TransformerLayer.post_norm`: 4 per layer), GeGLU FFN
(`gelu_tanh`), tied head, explicit head_dim, attention logits scaled by
`query_pre_attn_scalar ** -0.5`, local (sliding-window) and global layers in a repeating
`layer_pattern`. Gemma 2: local / global alternate, attention and final logits
soft-capped. Gemma 3: 5 local : 1 global, per-head q/k RMSNorm, no soft caps, local
layers with their own RoPE theta (10k vs 1M).

Layers differ only in their attention's `sliding_window` and `rope.theta`, so each layer
is its own config and `stack_config` scans the repeating group (or loops).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from jaxlearn.config import InstantiableConfig
from jaxlearn.layers.norm import RMSNorm
from jaxlearn.layers.recipes import llama_config
from jaxlearn.layers.transformer import stack_config

LOCAL, GLOBAL = "local", "global"


def gemma_config(
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: Optional[int],
    ffn_dim: int,
    *,
    head_dim: int,
    layer_pattern: Sequence[str],
    sliding_window: Optional[int],
    query_pre_attn_scalar: Optional[float] = None,
    rope_theta: float = 10000.0,
    rope_local_theta: Optional[float] = None,
    global_rope_scaling: Optional[InstantiableConfig] = None,
    attn_logit_soft_cap: Optional[float] = None,
    final_logit_soft_cap: Optional[float] = None,
    qk_norm: bool = False,
    norm_eps: float = 1e-6,
    tie_embeddings: bool = True,
    stack: str = "scan",
    family: Optional[str] = None,
    **llama_kwargs: Any,
) -> Any:
    """A Gemma-family CausalLM config (see the module docstring).

    layer_pattern: "local" / "global" for layers 0, 1, ... repeated over the stack (layer i
    is `layer_pattern[i % len]`), or one entry per layer. Local layers attend within
    `sliding_window` tokens with RoPE theta `rope_local_theta` (None: `rope_theta`);
    `global_rope_scaling` (e.g. `LinearFrequencyScaling`, Gemma 3 4B+) scales the RoPE of
    global layers only.
    query_pre_attn_scalar: None = head_dim. family: recorded in the config (`gemma2_config`
    and `gemma3_config` record theirs). Remaining keyword arguments (dtype,
    attention_implementation, remat_policy, ...) go to `llama_config`.
    """
    bad = sorted(set(layer_pattern) - {LOCAL, GLOBAL})
    if not layer_pattern or bad:
        raise ValueError(f"gemma_config: layer_pattern entries must be 'local' / 'global', "
                         f"got {list(layer_pattern)!r}")  # fmt: skip
    if LOCAL in layer_pattern and not sliding_window:
        raise ValueError("gemma_config: local layers need a sliding_window > 0")
    cfg = llama_config(
        vocab_size, dim, num_layers, num_heads, num_kv_heads, ffn_dim,
        head_dim=head_dim, rope_theta=rope_theta, norm_eps=norm_eps,
        tie_embeddings=tie_embeddings, stack=stack, family=family, **llama_kwargs,
    )  # fmt: skip
    norm = RMSNorm.default_config().set(eps=norm_eps, scale_offset=1.0)
    dec = cfg.decoder
    dec.emb.scale_by_sqrt_dim = True
    dec.output_norm = norm.clone()
    dec.logits_soft_cap = final_logit_soft_cap
    layer = dec.transformer.layer
    layer.set(norm=norm.clone(), post_norm=norm.clone())
    layer.feed_forward.activation = ("gelu_tanh", "linear")
    attention = layer.self_attention
    attention.query_scale = float(query_pre_attn_scalar or head_dim) ** -0.5
    attention.logit_soft_cap = attn_logit_soft_cap
    if qk_norm:
        attention.qk_norm = norm.clone(axis_name=None)
    local = layer.clone()
    layer.self_attention.rope.frequency_scaling = global_rope_scaling
    local.self_attention.sliding_window = sliding_window
    if rope_local_theta is not None:
        local.self_attention.rope.theta = rope_local_theta
    kinds = [layer_pattern[i % len(layer_pattern)] for i in range(num_layers)]
    layers = [local.clone() if k == LOCAL else layer.clone() for k in kinds]
    dec.transformer = stack_config(layers, stack)
    return cfg


def gemma2_config(
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: Optional[int],
    ffn_dim: int,
    *,
    head_dim: int = 256,
    sliding_window: int = 4096,
    query_pre_attn_scalar: Optional[float] = 256,
    attn_logit_soft_cap: Optional[float] = 50.0,
    final_logit_soft_cap: Optional[float] = 30.0,
    **gemma_kwargs: Any,
) -> Any:
    """Gemma 2: local / global layers alternating (layer 0 local), window 4096, one RoPE
    theta (10k), attention logits capped at 50 and final logits at 30. Maps to HF
    `Gemma2ForCausalLM`."""
    gemma_kwargs.setdefault("layer_pattern", (LOCAL, GLOBAL))
    gemma_kwargs.setdefault("family", "gemma2")
    return gemma_config(
        vocab_size, dim, num_layers, num_heads, num_kv_heads, ffn_dim,
        head_dim=head_dim, sliding_window=sliding_window,
        query_pre_attn_scalar=query_pre_attn_scalar, attn_logit_soft_cap=attn_logit_soft_cap,
        final_logit_soft_cap=final_logit_soft_cap, **gemma_kwargs,
    )  # fmt: skip


def gemma3_config(
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: Optional[int],
    ffn_dim: int,
    *,
    head_dim: int = 256,
    sliding_window: int = 1024,
    query_pre_attn_scalar: Optional[float] = 256,
    rope_theta: float = 1e6,
    rope_local_theta: float = 10000.0,
    **gemma_kwargs: Any,
) -> Any:
    """Gemma 3 (text): 5 local layers then 1 global, window 1024, RoPE theta 10k (local)
    and 1M (global), per-head q/k RMSNorm `(1 + scale)`, no soft caps. Maps to HF
    `Gemma3ForCausalLM`."""
    gemma_kwargs.setdefault("layer_pattern", (LOCAL,) * 5 + (GLOBAL,))
    gemma_kwargs.setdefault("family", "gemma3_text")
    return gemma_config(
        vocab_size, dim, num_layers, num_heads, num_kv_heads, ffn_dim,
        head_dim=head_dim, sliding_window=sliding_window,
        query_pre_attn_scalar=query_pre_attn_scalar, rope_theta=rope_theta,
        rope_local_theta=rope_local_theta, qk_norm=True, **gemma_kwargs,
    )  # fmt: skip
