"""Model recipes: functions returning a `CausalLM.Config` for a named architecture."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from jaxlearn.layers.attention import Attention
from jaxlearn.layers.causal_lm import CausalLM
from jaxlearn.layers.decoder import Decoder
from jaxlearn.layers.ffn import FeedForward
from jaxlearn.layers.norm import RMSNorm
from jaxlearn.layers.rope import RotaryEmbedding, scaling_config
from jaxlearn.layers.transformer import BaseStack, LoopStack, ScanStack, TransformerLayer
from jaxlearn.module import RematSpec


def llama_config(
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: Optional[int],
    ffn_dim: int,
    *,
    head_dim: Optional[int] = None,
    rope_theta: float = 500000.0,
    rope_scaling: Optional[dict[str, Any]] = None,
    norm_eps: float = 1e-5,
    attention_bias: bool = False,
    mlp_bias: bool = False,
    tie_embeddings: bool = False,
    stack: str = "scan",
    attention_implementation: str = "auto",
    dtype: Optional[str] = None,
    remat_policy: Optional[str] = None,
    z_loss_weight: float = 0.0,
    name: str = "model",
    family: Optional[str] = "llama",
) -> Any:
    """A Llama-style CausalLM config (RMSNorm pre-norm, GQA + RoPE, SwiGLU, untied or tied
    head). Param layout maps to HF `LlamaForCausalLM` (see README "HF Llama mapping").

    rope_scaling: HF-style dict, e.g. Llama 3.1's {"factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192} (no "rope_type":
    llama3) or {"rope_type": "yarn", "factor": 4.0, ...} (`rope.scaling_config`); None:
    plain RoPE.
    attention_bias / mlp_bias: biases on q/k/v/o and on the MLP (HF `attention_bias`,
    `mlp_bias`).
    stack: "scan" (ScanStack, fast compile) or "loop" (LoopStack, faster CPU steps).
    dtype: compute dtype (e.g. "bfloat16"); params stay float32.
    remat_policy: e.g. "nothing_saveable" to rematerialise each layer in training.
    family: the model family recorded in the config (`CausalLM.Config.family`); the
    recipes built on this one record theirs.
    """
    scaling = scaling_config(rope_scaling) if rope_scaling is not None else None
    rope = RotaryEmbedding.default_config().set(theta=rope_theta, frequency_scaling=scaling)
    attention = Attention.default_config().set(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope=rope,
        qkv_bias=attention_bias,
        output_bias=attention_bias,
        implementation=attention_implementation,
    )
    norm = RMSNorm.default_config().set(eps=norm_eps)
    layer = TransformerLayer.default_config().set(
        norm=norm,
        self_attention=attention,
        feed_forward=FeedForward.default_config().set(
            hidden_dim=ffn_dim, activation=("silu", "linear"), use_bias=mlp_bias
        ),
    )
    if remat_policy is not None:
        layer.remat_spec = RematSpec(policy=remat_policy)
    stacks: dict[str, type[BaseStack]] = {"scan": ScanStack, "loop": LoopStack}
    if stack not in stacks:
        raise ValueError(f"llama_config: stack must be one of {sorted(stacks)}, got {stack!r}")
    decoder = Decoder.default_config().set(
        vocab_size=vocab_size,
        dim=dim,
        transformer=stacks[stack].default_config().set(num_layers=num_layers, layer=layer),
        output_norm=norm,
    )
    if tie_embeddings:
        decoder.lm_head = None
    return CausalLM.default_config().set(
        name=name, decoder=decoder, z_loss_weight=z_loss_weight, dtype=dtype, family=family
    )


def qwen3_config(
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: Optional[int],
    ffn_dim: int,
    *,
    head_dim: int = 128,
    rope_theta: float = 1e6,
    norm_eps: float = 1e-6,
    attention_bias: bool = False,
    **llama_kwargs: Any,
) -> Any:
    """A Qwen3-style CausalLM config: `llama_config` plus a per-head RMSNorm of q and k
    over head_dim (weights [head_dim], before RoPE, eps `norm_eps`) and an explicit
    `head_dim` (Qwen3 uses 128 whatever dim / num_heads is). Maps to HF
    `Qwen3ForCausalLM` (see the README's Qwen3 rows).

    attention_bias: biases on q/k/v and o (HF `attention_bias`). Remaining keyword
    arguments (rope_scaling, tie_embeddings, stack, dtype, ...) go to `llama_config`.
    """
    cfg = llama_config(
        vocab_size,
        dim,
        num_layers,
        num_heads,
        num_kv_heads,
        ffn_dim,
        head_dim=head_dim,
        rope_theta=rope_theta,
        norm_eps=norm_eps,
        attention_bias=attention_bias,
        **{"family": "qwen3", **llama_kwargs},
    )
    layer = cfg.decoder.transformer.layer
    layer.self_attention.qk_norm = RMSNorm.default_config().set(eps=norm_eps, axis_name=None)
    return cfg


def phi3_config(
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: Optional[int],
    ffn_dim: int,
    *,
    rope_theta: float = 10000.0,
    rotary_fraction: float = 1.0,
    sliding_window: Optional[int] = None,
    norm_eps: float = 1e-5,
    **llama_kwargs: Any,
) -> Any:
    """A Phi-3 / Phi-3.5 CausalLM config: `llama_config` (no biases) with RoPE on the first
    `rotary_fraction` of each head (HF `partial_rotary_factor`), usually LongRoPE scaling
    (`rope_scaling={"rope_type": "longrope", ...}`), and one `sliding_window` for every
    layer. HF `Phi3ForCausalLM`'s fused `qkv_proj` / `gate_up_proj` are split into
    q/k/v and wi_0/wi_1 by `jaxlearn.interop` (`fuse_projections` fuses them back for
    serving). Remaining keyword arguments go to `llama_config`."""
    cfg = llama_config(vocab_size, dim, num_layers, num_heads, num_kv_heads, ffn_dim,
                       rope_theta=rope_theta, norm_eps=norm_eps,
                       **{"family": "phi3", **llama_kwargs})  # fmt: skip
    attention = cfg.decoder.transformer.layer.self_attention
    attention.rope.rotary_fraction = rotary_fraction
    attention.sliding_window = sliding_window
    return cfg


def mixtral_config(
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: Optional[int],
    ffn_dim: int,
    num_experts: int,
    num_experts_per_token: int = 2,
    *,
    capacity_factor: Optional[float] = None,
    load_balance_loss_weight: float = 0.01,
    router_z_loss_weight: float = 0.0,
    sliding_window: Optional[int] = None,
    rope_theta: float = 1e6,
    **llama_kwargs: Any,
) -> Any:
    """A Mixtral-style CausalLM config: `llama_config` with every feed-forward replaced by
    a top-k `MixtureOfExperts` (dropless unless `capacity_factor` is set). Remaining
    keyword arguments go to `llama_config`. Maps to HF `MixtralForCausalLM` (README)."""
    from jaxlearn.layers.moe import MixtureOfExperts  # Imported lazily (own file, own owner).

    cfg = llama_config(
        vocab_size,
        dim,
        num_layers,
        num_heads,
        num_kv_heads,
        ffn_dim,
        rope_theta=rope_theta,
        **{"family": "mixtral", **llama_kwargs},
    )
    layer = cfg.decoder.transformer.layer
    layer.self_attention.sliding_window = sliding_window
    layer.feed_forward = MixtureOfExperts.default_config().set(
        hidden_dim=ffn_dim,
        activation=("silu", "linear"),
        num_experts=num_experts,
        num_experts_per_token=num_experts_per_token,
        capacity_factor=capacity_factor,
        load_balance_loss_weight=load_balance_loss_weight,
        router_z_loss_weight=router_z_loss_weight,
    )
    return cfg


def qwen3_moe_config(
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: Optional[int],
    ffn_dim: int,
    num_experts: int,
    num_experts_per_token: int = 8,
    *,
    normalize_top_k_weights: bool = True,
    dense_layers: Sequence[int] = (),
    dense_ffn_dim: Optional[int] = None,
    capacity_factor: Optional[float] = None,
    load_balance_loss_weight: float = 0.001,
    **qwen3_kwargs: Any,
) -> Any:
    """A Qwen3-MoE CausalLM config: `qwen3_config` with each FFN a top-k softmax
    `MixtureOfExperts` of `num_experts` experts of hidden size `ffn_dim`, except
    `dense_layers` (HF `mlp_only_layers`), which keep a dense SwiGLU FFN of hidden size
    `dense_ffn_dim` (then the stack is a `LoopStack` of per-layer configs).
    normalize_top_k_weights: HF `norm_topk_prob`. Remaining keyword arguments go to
    `qwen3_config`. Maps to HF `Qwen3MoeForCausalLM`."""
    from jaxlearn.layers.moe import MixtureOfExperts  # Imported lazily (own file, own owner).

    dense = sorted(set(int(i) for i in dense_layers))
    if any(not 0 <= i < num_layers for i in dense):
        raise ValueError(f"qwen3_moe_config: dense_layers {dense} outside [0, {num_layers})")
    if dense and not dense_ffn_dim:
        raise ValueError("qwen3_moe_config: dense_layers need dense_ffn_dim")
    if dense:
        qwen3_kwargs["stack"] = "loop"
    cfg = qwen3_config(vocab_size, dim, num_layers, num_heads, num_kv_heads, ffn_dim,
                       **{"family": "qwen3_moe", **qwen3_kwargs})  # fmt: skip
    layer = cfg.decoder.transformer.layer
    dense_ffn = layer.feed_forward
    layer.feed_forward = MixtureOfExperts.default_config().set(
        hidden_dim=ffn_dim,
        activation=("silu", "linear"),
        num_experts=num_experts,
        num_experts_per_token=num_experts_per_token,
        normalize_top_k_weights=normalize_top_k_weights,
        capacity_factor=capacity_factor,
        load_balance_loss_weight=load_balance_loss_weight,
    )
    if dense:
        layers = [layer.clone() for _ in range(num_layers)]
        for i in dense:
            layers[i].feed_forward = dense_ffn.clone(hidden_dim=dense_ffn_dim)
        cfg.decoder.transformer.layers = layers
    return cfg
