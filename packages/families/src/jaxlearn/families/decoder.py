"""The Llama-like decoder that most families share: building a `CausalLM.Config` from an
`Architecture` with a `jaxlearn.layers` recipe (`llama_config`, `qwen3_config`,
`phi3_config`; a dense-FFN -> MoE replacement for experts, per-attention biases,
per-layer sliding windows and any `jaxlearn.layers.SCALINGS` RoPE scaling), and reading
those settings back from a config (`read_decoder`), naming the config path of anything
that is not a Llama-like decoder. Which of the settings a family's HF class can express
is the family's own check (`Family.check_config`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from jaxlearn.config import replace_config
from jaxlearn.families.arch import STACKS, Architecture, is_a, layer_configs
from jaxlearn.families.errors import UnsupportedModelError
from jaxlearn.layers import (
    Attention,
    FeedForward,
    LoopStack,
    RMSNorm,
    ScanStack,
    TransformerLayer,
    scaling_dict,
)
from jaxlearn.layers.moe import MixtureOfExperts


def build_decoder(
    arch: Architecture,
    recipe: Callable[..., Any],
    *,
    stack: str = "scan",
    dtype: Optional[str] = None,
    attention_implementation: str = "auto",
    moe_dropless_method: str = "ragged_dot",
    name: str = "model",
) -> Any:
    """A `CausalLM.Config` for `arch` built with `recipe` (a `jaxlearn.layers` recipe
    taking `llama_config`'s arguments). Layers with different sliding windows or FFNs
    (dense layers of an MoE model) need per-layer configs, so they always get a `LoopStack`
    (whatever `stack` says)."""
    if stack not in STACKS:
        raise ValueError(f"stack must be one of {STACKS}, got {stack!r}")
    uniform, window = arch.uniform_sliding_window()
    if not uniform or arch.dense_layers:
        stack = "loop"
    if arch.is_moe and arch.mlp_bias:
        raise UnsupportedModelError("MoE experts with MLP biases are not supported")
    cfg = recipe(
        vocab_size=arch.vocab_size,
        dim=arch.dim,
        num_layers=arch.num_layers,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        ffn_dim=arch.ffn_dim,
        head_dim=arch.head_dim,
        rope_theta=arch.rope_theta,
        rope_scaling=arch.rope_scaling,
        norm_eps=arch.norm_eps,
        mlp_bias=arch.mlp_bias,
        tie_embeddings=arch.tie_embeddings,
        stack=stack,
        attention_implementation=attention_implementation,
        dtype=dtype,
        name=name,
    )
    layer = cfg.decoder.transformer.layer
    attention = layer.self_attention
    attention.qkv_bias = arch.qkv_bias
    attention.output_bias = arch.output_bias
    attention.rope.rotary_fraction = arch.rotary_fraction
    if arch.is_moe:
        cfg = replace_config(cfg, FeedForward, _experts_config(arch, moe_dropless_method))
    if uniform and not arch.dense_layers:
        cfg.decoder.transformer.layer.self_attention.sliding_window = window
    else:
        layer = cfg.decoder.transformer.layer
        cfg.decoder.transformer.layers = [
            _layer_config(arch, layer, i) for i in range(arch.num_layers)
        ]
    return cfg


def _layer_config(arch: Architecture, layer: Any, i: int) -> Any:
    """Layer i of a stack whose layers differ: its window, and a dense SwiGLU FFN if it is
    one of the `dense_layers` of an MoE model."""
    one = layer.clone()
    window = arch.sliding_windows[i] if arch.sliding_windows else None
    one.self_attention = one.self_attention.clone(sliding_window=window)
    if i in arch.dense_layers:
        one.feed_forward = FeedForward.default_config().set(
            hidden_dim=arch.dense_ffn_dim, activation=("silu", "linear"), use_bias=False
        )
    return one


def _experts_config(arch: Architecture, dropless_method: str) -> Any:
    """The Mixtral / Qwen3-MoE MoE (top-k softmax, renormalised if `normalize_top_k`,
    dropless) that replaces every FFN."""
    return MixtureOfExperts.default_config().set(
        num_experts=arch.num_experts,
        num_experts_per_token=arch.num_experts_per_token,
        router_scores="softmax",
        normalize_top_k_weights=arch.normalize_top_k,
        capacity_factor=None,
        dropless_method=dropless_method,
        # HF's load_balancing_loss_func is num_experts_per_token times ours.
        load_balance_loss_weight=arch.router_aux_loss_coef * arch.num_experts_per_token,
    )


# ---- reading the settings back from a CausalLM config ----------------------------------------


def bad(path: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"cannot export {path}: {why}")


def read_decoder(cfg: Any) -> tuple[dict[str, Any], list[Optional[int]]]:
    """(`Architecture` fields, per-layer windows) of a Llama-like `CausalLM.Config` (as
    built by `build_decoder`, possibly with MoE / bias / sliding-window / fused-projection
    changes). The fields hold `qk_norm` (whether q/k are normalised per head), which the
    family implies, and no `family`. Raises `UnsupportedModelError` naming the config
    path of anything that is not a Llama-like decoder with uniform layers."""
    dec = cfg.decoder
    if dec.emb.scale_by_sqrt_dim:
        raise bad("model.decoder.emb.scale_by_sqrt_dim", "Llama-like embeddings are unscaled")
    if dec.logits_soft_cap is not None:
        raise bad("model.decoder.logits_soft_cap", "no final-logit soft cap in HF Llama")
    t = dec.transformer
    if not (is_a(t, ScanStack) or is_a(t, LoopStack)):
        raise bad("model.decoder.transformer", f"unknown stack {t.klass}")
    eps = _norm_eps("model.decoder.output_norm", dec.output_norm)
    windows: list[Optional[int]] = []
    first: Optional[dict[str, Any]] = None
    ffns = []
    for i, lc in enumerate(layer_configs(t)):
        where = f"model.decoder.transformer.layers[{i}]"
        this = _layer_settings(where, lc, dec.dim, eps)
        ffns.append(_ffn_settings(f"{where}.feed_forward", lc.feed_forward))
        if first is None:
            first = this
        elif this != first:
            diff = sorted(k for k in this if this[k] != first[k])
            raise bad(where, f"layers differ from layer 0 in {diff}; HF needs uniform layers")
        windows.append(lc.self_attention.sliding_window)
    assert first is not None
    first.update(_ffn_pattern(ffns))
    first.update(
        vocab_size=dec.vocab_size,
        dim=dec.dim,
        num_layers=len(windows),
        norm_eps=eps,
        tie_embeddings=dec.lm_head is None,
        sliding_windows=tuple(windows),
    )
    return first, windows


def _norm_eps(path: str, norm: Any) -> float:
    if not is_a(norm, RMSNorm) or norm.scale_offset:
        raise bad(path, "only RMSNorm without scale offset maps to HF Llama")
    return float(norm.eps)


def _layer_settings(where: str, lc: Any, dim: int, eps: float) -> dict[str, Any]:
    """The `Architecture` fields one TransformerLayer config sets (all but the window and
    the FFN)."""
    if not is_a(lc, TransformerLayer):
        raise bad(where, f"unknown layer {lc.klass}")
    if _norm_eps(f"{where}.norm", lc.norm) != eps:
        raise bad(f"{where}.norm.eps", "HF Llama has one rms_norm_eps for every norm")
    a = lc.self_attention
    if not is_a(a, Attention):
        raise bad(f"{where}.self_attention", f"unknown attention {a.klass}")
    qk_norm = a.qk_norm is not None
    if qk_norm and _norm_eps(f"{where}.self_attention.qk_norm", a.qk_norm) != eps:
        raise bad(f"{where}.self_attention.qk_norm.eps", "HF Qwen3 uses rms_norm_eps")
    for field, ok in (
        ("logit_soft_cap", a.logit_soft_cap is None),
        ("causal", a.causal),
        ("rope", a.rope is not None),
    ):
        if not ok:
            value = getattr(a, field)
            raise bad(f"{where}.self_attention.{field}", f"unsupported value {value!r}")
    head_dim = a.head_dim if a.head_dim is not None else dim // a.num_heads
    if a.query_scale is not None and not math.isclose(a.query_scale, head_dim**-0.5):
        raise bad(f"{where}.self_attention.query_scale", "HF uses head_dim ** -0.5")
    return dict(
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads if a.num_kv_heads is not None else a.num_heads,
        head_dim=head_dim,
        rope_theta=float(a.rope.theta),
        rope_scaling=_rope_scaling(f"{where}.self_attention.rope", a.rope.frequency_scaling),
        rotary_fraction=float(a.rope.rotary_fraction),
        qkv_bias=bool(a.qkv_bias),
        output_bias=bool(a.output_bias),
        qk_norm=qk_norm,
    )


def _rope_scaling(where: str, fs: Any) -> Optional[dict[str, Any]]:
    """HF `rope_scaling` dict of a frequency-scaling config (None: no scaling)."""
    if fs is None:
        return None
    if not getattr(getattr(fs, "klass", None), "rope_type", ""):
        raise bad(f"{where}.frequency_scaling", f"{fs.klass} has no HF rope_type")
    return scaling_dict(fs)


def _ffn_settings(where: str, f: Any) -> dict[str, Any]:
    """The FFN fields of `Architecture` for a FeedForward / MixtureOfExperts config."""
    if is_a(f, MixtureOfExperts):
        if tuple(f.activation) != ("silu", "linear"):
            raise bad(f"{where}.activation", "Mixtral experts are SwiGLU")
        if f.router_scores != "softmax":
            raise bad(f"{where}.router_scores", "HF MoE routers are softmax + top-k")
        return dict(
            ffn_dim=f.hidden_dim,
            num_experts=f.num_experts,
            num_experts_per_token=f.num_experts_per_token,
            router_aux_loss_coef=f.load_balance_loss_weight / f.num_experts_per_token,
            normalize_top_k=bool(f.normalize_top_k_weights),
            mlp_bias=False,
        )
    if is_a(f, FeedForward):
        if tuple(f.activation) != ("silu", "linear"):
            raise bad(f"{where}.activation", "HF Llama MLP is SwiGLU")
        return dict(ffn_dim=f.hidden_dim, num_experts=0, mlp_bias=bool(f.use_bias))
    raise bad(where, f"unknown feed-forward {f.klass}")


def _ffn_pattern(ffns: list[dict[str, Any]]) -> dict[str, Any]:
    """The FFN fields of `Architecture` from each layer's `_ffn_settings`: one FFN for all
    layers, or experts in some and one dense FFN in the others (`dense_layers`)."""
    groups: dict[bool, dict[str, Any]] = {}
    for i, f in enumerate(ffns):
        first = groups.setdefault(bool(f["num_experts"]), f)
        if f != first:
            diff = sorted(k for k in f if f[k] != first[k])
            kind = "MoE" if f["num_experts"] else "dense"
            raise bad(
                f"model.decoder.transformer.layers[{i}].feed_forward",
                f"differs from the first {kind} FFN in {diff}; HF needs one of each",
            )
    if not (True in groups and False in groups):
        return dict(next(iter(groups.values())))
    dense = groups[False]
    if dense["mlp_bias"]:
        raise UnsupportedModelError("cannot export: the dense layers of an MoE have no biases")
    dense_layers = tuple(i for i, f in enumerate(ffns) if not f["num_experts"])
    return dict(groups[True], dense_layers=dense_layers, dense_ffn_dim=dense["ffn_dim"])


def uniform_windows(windows: list[Optional[int]]) -> bool:
    return all(w == windows[0] for w in windows)
