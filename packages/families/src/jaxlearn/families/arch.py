"""`Architecture`: the hyperparameters of a Llama-family decoder, independent of the file
format they come from (HF config.json, GGUF metadata) or go to (HF export).

`build_config(arch)` turns one into a `CausalLM.Config` with `llama_config` (`qwen3_config`
for Qwen3: per-head q/k RMSNorm; `phi3_config` for Phi-3: partial RoPE; plus a dense-FFN
-> MoE replacement for Mixtral, per-attention biases for Qwen2, per-layer sliding windows
and any `jaxlearn.layers.SCALINGS` RoPE scaling); `architecture_from_config(cfg)` reads
one back from a `CausalLM.Config` and raises `UnsupportedModelError` for anything the HF
Llama/Mistral/Qwen2/Qwen3/Mixtral/Phi-3 classes cannot express.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from jaxlearn.config import replace_config
from jaxlearn.families.errors import UnsupportedModelError
from jaxlearn.layers import (
    Attention,
    FeedForward,
    LoopStack,
    RMSNorm,
    ScanStack,
    TransformerLayer,
    llama_config,
    phi3_config,
    qwen3_config,
    scaling_dict,
)
from jaxlearn.layers.moe import MixtureOfExperts

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3", "gemma2",
            "gemma3_text")
# Families whose attention normalises q and k per head (RMSNorm over head_dim, eps norm_eps).
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text")
STACKS = ("scan", "loop")


@dataclasses.dataclass
class Architecture:
    """Format-neutral hyperparameters of a Llama-family causal LM.

    rope_scaling: None, or an HF-style dict with "rope_type" one of
    `jaxlearn.layers.SCALINGS` (linear, llama3, yarn, dynamic, longrope) and the fields of
    that scaling's config (`scaling_dict`). rotary_fraction: HF `partial_rotary_factor`
    (Phi-3 only). sliding_windows: one entry per layer (None = full attention), or () when no
    layer has a window. num_experts > 0 makes every FFN a top-k softmax MoE of experts
    with hidden size ffn_dim (Mixtral, Qwen3-MoE), except the `dense_layers`, which have
    a dense SwiGLU FFN of hidden size `dense_ffn_dim` (Qwen3-MoE `mlp_only_layers` /
    `decoder_sparse_step`). normalize_top_k: divide the k routing weights by their sum
    (Qwen3-MoE `norm_topk_prob`; Mixtral always does). Gemma (`jaxlearn.families.gemma`):
    attention scale query_pre_attn_scalar ** -0.5, soft caps, local layers' RoPE theta.
    """

    family: str
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]] = None
    rotary_fraction: float = 1.0
    tie_embeddings: bool = False
    qkv_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: tuple[Optional[int], ...] = ()
    num_experts: int = 0
    num_experts_per_token: int = 2
    router_aux_loss_coef: float = 0.0
    normalize_top_k: bool = True
    dense_layers: tuple[int, ...] = ()
    dense_ffn_dim: int = 0
    query_pre_attn_scalar: Optional[float] = None
    attn_logit_soft_cap: Optional[float] = None
    final_logit_soft_cap: Optional[float] = None
    local_rope_theta: Optional[float] = None
    max_position_embeddings: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise UnsupportedModelError(f"architecture family {self.family!r} not in {FAMILIES}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise UnsupportedModelError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"{self.num_layers} layers"
            )
        if self.sliding_windows and all(w is None for w in self.sliding_windows):
            self.sliding_windows = ()
        if self.dense_layers and not (self.is_moe and self.dense_ffn_dim > 0):
            raise UnsupportedModelError(
                f"dense_layers {self.dense_layers} need num_experts > 0 and dense_ffn_dim > 0"
            )
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise UnsupportedModelError(
                f"dense_layers {self.dense_layers} outside [0, {self.num_layers})"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
        return self.family in QK_NORM_FAMILIES

    def uniform_sliding_window(self) -> tuple[bool, Optional[int]]:
        """(True, window) when every layer has the same window (None = none)."""
        if not self.sliding_windows:
            return True, None
        first = self.sliding_windows[0]
        return all(w == first for w in self.sliding_windows), first


def build_config(
    arch: Architecture,
    *,
    stack: str = "scan",
    dtype: Optional[str] = None,
    param_dtype: Optional[str] = None,
    attention_implementation: str = "auto",
    moe_dropless_method: str = "ragged_dot",
    name: str = "model",
) -> Any:
    """A `CausalLM.Config` for `arch` (built with `llama_config`, or `qwen3_config` for
    families with q/k norms).

    stack: "scan" or "loop"; layers with different sliding windows or FFNs (dense layers of
    an MoE model) need per-layer configs, so they always get a `LoopStack` (whatever
    `stack` says).
    dtype: compute dtype (e.g. "bfloat16"); param_dtype: storage dtype of the params
    (default float32).
    """
    if stack not in STACKS:
        raise ValueError(f"stack must be one of {STACKS}, got {stack!r}")
    if arch.family.startswith("gemma"):
        from jaxlearn.families.gemma import build_gemma  # (gemma imports checks -> arch)

        cfg = build_gemma(arch, stack=stack, dtype=dtype, name=name,
                          attention_implementation=attention_implementation)  # fmt: skip
        if param_dtype is not None:
            cfg.param_dtype = param_dtype
        return cfg
    uniform, window = arch.uniform_sliding_window()
    if not uniform or arch.dense_layers:
        stack = "loop"
    scaling = arch.rope_scaling
    if arch.is_moe and arch.mlp_bias:
        raise UnsupportedModelError("MoE experts with MLP biases are not supported")
    recipe = qwen3_config if arch.qk_norm else llama_config
    recipe = phi3_config if arch.family == "phi3" else recipe
    cfg = recipe(
        vocab_size=arch.vocab_size,
        dim=arch.dim,
        num_layers=arch.num_layers,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        ffn_dim=arch.ffn_dim,
        head_dim=arch.head_dim,
        rope_theta=arch.rope_theta,
        rope_scaling=scaling,
        norm_eps=arch.norm_eps,
        mlp_bias=arch.mlp_bias,
        tie_embeddings=arch.tie_embeddings,
        stack=stack,
        attention_implementation=attention_implementation,
        dtype=dtype,
        name=name,
    )
    if param_dtype is not None:
        cfg.param_dtype = param_dtype
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


# ---- reading an Architecture back from a CausalLM config -------------------------------------


def _is(cfg: Any, klass: type) -> bool:
    k = getattr(cfg, "klass", None)
    return isinstance(k, type) and issubclass(k, klass)


def _bad(path: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"cannot export {path}: {why}")


def layer_configs(stack: Any) -> list[Any]:
    """The per-layer configs of a ScanStack / LoopStack config (a scanned `LoopStack`
    group of p layers repeated: layer i is the group's i % p)."""
    layers = list(getattr(stack, "layers", None) or [stack.layer] * stack.num_layers)
    if _is(stack, ScanStack) and _is(stack.layer, LoopStack):
        return [lc for group in layers for lc in layer_configs(group)]
    return layers


def architecture_from_config(cfg: Any, *, max_position_embeddings: Optional[int] = None) -> Any:
    """Reads an `Architecture` from a `CausalLM.Config` (as built by `llama_config`, possibly
    with MoE / bias / sliding-window / fused-projection changes). Raises
    `UnsupportedModelError` naming the config path of anything an HF
    Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen3-MoE checkpoint cannot express."""
    dec = cfg.decoder
    if dec.emb.scale_by_sqrt_dim:  # Gemma
        from jaxlearn.families.gemma import gemma_architecture

        fields = gemma_architecture(cfg, layer_configs(dec.transformer))
        return Architecture(**fields, max_position_embeddings=max_position_embeddings)
    if dec.logits_soft_cap is not None:
        raise _bad("model.decoder.logits_soft_cap", "no final-logit soft cap in HF Llama")
    t = dec.transformer
    if not (_is(t, ScanStack) or _is(t, LoopStack)):
        raise _bad("model.decoder.transformer", f"unknown stack {t.klass}")
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
            raise _bad(where, f"layers differ from layer 0 in {diff}; HF needs uniform layers")
        windows.append(lc.self_attention.sliding_window)
    assert first is not None
    first.update(_ffn_pattern(ffns))
    family = _family(first, windows)
    del first["qk_norm"]  # implied by the family
    return Architecture(
        family=family,
        vocab_size=dec.vocab_size,
        dim=dec.dim,
        num_layers=len(windows),
        norm_eps=eps,
        tie_embeddings=dec.lm_head is None,
        sliding_windows=tuple(windows),
        max_position_embeddings=max_position_embeddings,
        **first,
    )


def _norm_eps(path: str, norm: Any) -> float:
    if not _is(norm, RMSNorm) or norm.scale_offset:
        raise _bad(path, "only RMSNorm without scale offset maps to HF Llama")
    return float(norm.eps)


def _layer_settings(where: str, lc: Any, dim: int, eps: float) -> dict[str, Any]:
    """The `Architecture` fields one TransformerLayer config sets (all but the window and
    the FFN)."""
    if not _is(lc, TransformerLayer):
        raise _bad(where, f"unknown layer {lc.klass}")
    if _norm_eps(f"{where}.norm", lc.norm) != eps:
        raise _bad(f"{where}.norm.eps", "HF Llama has one rms_norm_eps for every norm")
    a = lc.self_attention
    if not _is(a, Attention):
        raise _bad(f"{where}.self_attention", f"unknown attention {a.klass}")
    qk_norm = a.qk_norm is not None
    if qk_norm and _norm_eps(f"{where}.self_attention.qk_norm", a.qk_norm) != eps:
        raise _bad(f"{where}.self_attention.qk_norm.eps", "HF Qwen3 uses rms_norm_eps")
    for field, ok in (
        ("logit_soft_cap", a.logit_soft_cap is None),
        ("causal", a.causal),
        ("rope", a.rope is not None),
    ):
        if not ok:
            value = getattr(a, field)
            raise _bad(f"{where}.self_attention.{field}", f"unsupported value {value!r}")
    head_dim = a.head_dim if a.head_dim is not None else dim // a.num_heads
    if a.query_scale is not None and not math.isclose(a.query_scale, head_dim**-0.5):
        raise _bad(f"{where}.self_attention.query_scale", "HF uses head_dim ** -0.5")
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
        raise _bad(f"{where}.frequency_scaling", f"{fs.klass} has no HF rope_type")
    return scaling_dict(fs)


def _ffn_settings(where: str, f: Any) -> dict[str, Any]:
    """The FFN fields of `Architecture` for a FeedForward / MixtureOfExperts config."""
    if _is(f, MixtureOfExperts):
        if tuple(f.activation) != ("silu", "linear"):
            raise _bad(f"{where}.activation", "Mixtral experts are SwiGLU")
        if f.router_scores != "softmax":
            raise _bad(f"{where}.router_scores", "HF MoE routers are softmax + top-k")
        return dict(
            ffn_dim=f.hidden_dim,
            num_experts=f.num_experts,
            num_experts_per_token=f.num_experts_per_token,
            router_aux_loss_coef=f.load_balance_loss_weight / f.num_experts_per_token,
            normalize_top_k=bool(f.normalize_top_k_weights),
            mlp_bias=False,
        )
    if _is(f, FeedForward):
        if tuple(f.activation) != ("silu", "linear"):
            raise _bad(f"{where}.activation", "HF Llama MLP is SwiGLU")
        return dict(ffn_dim=f.hidden_dim, num_experts=0, mlp_bias=bool(f.use_bias))
    raise _bad(where, f"unknown feed-forward {f.klass}")


def _ffn_pattern(ffns: list[dict[str, Any]]) -> dict[str, Any]:
    """The FFN fields of `Architecture` from each layer's `_ffn_settings`: one FFN for all
    layers, or experts in some and one dense FFN in the others (`dense_layers`)."""
    groups: dict[bool, dict[str, Any]] = {}
    for i, f in enumerate(ffns):
        first = groups.setdefault(bool(f["num_experts"]), f)
        if f != first:
            diff = sorted(k for k in f if f[k] != first[k])
            kind = "MoE" if f["num_experts"] else "dense"
            raise _bad(
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


def _family(layer: dict[str, Any], windows: list[Optional[int]]) -> str:
    """The HF model class that can express these settings."""
    sliding = any(w is not None for w in windows)
    uniform = all(w == windows[0] for w in windows)
    if layer["qk_norm"]:
        return _qwen3_family(layer, windows)
    longrope = (layer["rope_scaling"] or {}).get("rope_type") == "longrope"
    if layer["rotary_fraction"] != 1.0 or longrope:
        return _phi3_family(layer, uniform)
    if layer["num_experts"]:
        if layer.get("dense_layers") or not layer["normalize_top_k"]:
            raise UnsupportedModelError(
                "cannot export: Mixtral has no dense layers and renormalises its top-k "
                "weights (both need q/k norms: Qwen3-MoE)"
            )
        if layer["qkv_bias"] or layer["output_bias"]:
            raise UnsupportedModelError("cannot export: Mixtral has no attention biases")
        if not uniform:
            raise UnsupportedModelError("cannot export: Mixtral needs one sliding window")
        return "mixtral"
    if layer["qkv_bias"] and not layer["output_bias"]:
        if layer["mlp_bias"]:
            raise UnsupportedModelError("cannot export: Qwen2 has no MLP biases")
        _check_qwen_windows("Qwen2", windows)
        return "qwen2"
    if layer["qkv_bias"] != layer["output_bias"]:
        raise UnsupportedModelError("cannot export: output bias without q/k/v biases")
    if sliding:
        if not uniform:
            raise UnsupportedModelError("cannot export: per-layer windows need q/k/v biases")
        if layer["qkv_bias"] or layer["mlp_bias"]:
            raise UnsupportedModelError("cannot export: Mistral has no biases")
        return "mistral"
    return "llama"


def _check_qwen_windows(name: str, windows: list[Optional[int]]) -> None:
    """Qwen2/Qwen3: full attention for layers < max_window_layers, one window after."""
    if all(w is None for w in windows):
        return
    k = next(i for i, w in enumerate(windows) if w is not None)
    if any(w is not None for w in windows[:k]) or any(w != windows[k] for w in windows[k:]):
        raise UnsupportedModelError(
            f"cannot export: {name} windows must be full attention then one window"
        )


def _qwen3_family(layer: dict[str, Any], windows: list[Optional[int]]) -> str:
    """The Qwen3 / Qwen3-MoE class for a layer with q/k norms (attention biases on q/k/v
    and o, or none)."""
    if layer["qkv_bias"] != layer["output_bias"]:
        raise UnsupportedModelError("cannot export: Qwen3 biases are on q/k/v and o together")
    if layer["mlp_bias"]:
        raise UnsupportedModelError("cannot export: Qwen3 has no MLP biases")
    if layer["num_experts"]:
        if any(w != windows[0] for w in windows):
            raise UnsupportedModelError("cannot export: Qwen3-MoE needs one sliding window")
        return "qwen3_moe"
    _check_qwen_windows("Qwen3", windows)
    return "qwen3"


def _phi3_family(layer: dict[str, Any], uniform_windows: bool) -> str:
    """Phi-3: partial RoPE or LongRoPE; no biases, no experts, one window."""
    why = [k for k in ("qkv_bias", "output_bias", "mlp_bias", "num_experts") if layer[k]]
    scaling = (layer["rope_scaling"] or {}).get("rope_type", "longrope")
    if why or not uniform_windows or scaling != "longrope":
        raise UnsupportedModelError(
            "cannot export: partial RoPE / LongRoPE need HF Phi-3, which has no biases, "
            f"experts or per-layer windows and only LongRoPE scaling (got {why}, {scaling})"
        )
    return "phi3"
