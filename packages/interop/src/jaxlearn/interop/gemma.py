"""Gemma 2 / Gemma 3 (text): `Architecture` <-> `gemma_config` and HF config.json fields.

Layers are local (a sliding window, Gemma 3: RoPE theta `local_rope_theta`) or global;
`Architecture.sliding_windows` says which. HF model types `gemma2` and `gemma3_text`
(`Gemma3ForCausalLM`; the multimodal `gemma3` checkpoints nest it under `text_config`
and are not read here).
"""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.interop.checks import flag, number, optional_integer
from jaxlearn.interop.errors import MalformedFileError, UnsupportedModelError
from jaxlearn.layers import (
    Attention,
    FeedForward,
    LinearFrequencyScaling,
    RMSNorm,
    TransformerLayer,
    gemma_config,
)

GEMMA_FAMILIES = ("gemma2", "gemma3_text")
# HF class defaults of the fields a config.json may leave out.
_DEFAULTS = {
    "gemma2": dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, sliding_window=4096, pattern=2),
    "gemma3_text": dict(query_pre_attn_scalar=256, attn_logit_softcapping=None,
                        final_logit_softcapping=None, sliding_window=4096, pattern=6),
}  # fmt: skip


def _cap(hf: dict[str, Any], where: str, field: str, family: str) -> Optional[float]:
    value = hf.get(field, _DEFAULTS[family][field])
    return None if value is None else number(value, where, field)


def gemma_hf_fields(hf: dict[str, Any], where: str, family: str, layers: int) -> dict[str, Any]:
    """The Gemma-only `Architecture` fields of an HF config.json (checked)."""
    if flag(hf.get("use_bidirectional_attention"), where, "use_bidirectional_attention"):
        raise UnsupportedModelError(f"{where}: use_bidirectional_attention is not supported")
    d = _DEFAULTS[family]
    window = optional_integer(hf.get("sliding_window", d["sliding_window"]), where,
                              "sliding_window", high=2**40)  # fmt: skip
    types = hf.get("layer_types")
    if types is None:
        pattern = optional_integer(hf.get("sliding_window_pattern", d["pattern"]), where,
                                   "sliding_window_pattern", high=2**20) or 1  # fmt: skip
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]  # fmt: skip
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {
        "sliding_attention", "full_attention"
    }:
        raise MalformedFileError(f"{where}: layer_types is not a list of num_hidden_layers = "
                                 f"{layers} sliding_attention / full_attention entries")  # fmt: skip
    local = hf.get("rope_local_base_freq")
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        local = params["sliding_attention"].get("rope_theta", local)
        if params["sliding_attention"].get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"{where}: RoPE scaling of local layers")
    if family == "gemma3_text" and local is None:
        local = 10000.0
    return dict(
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
        query_pre_attn_scalar=number(hf.get("query_pre_attn_scalar",
                                            d["query_pre_attn_scalar"]),
                                     where, "query_pre_attn_scalar"),
        # transformers' Gemma 3 attention ignores attn_logit_softcapping.
        attn_logit_soft_cap=_cap(hf, where, "attn_logit_softcapping", family)
        if family == "gemma2" else None,
        final_logit_soft_cap=_cap(hf, where, "final_logit_softcapping", family),
        local_rope_theta=None if local is None else number(local, where, "rope_local_base_freq"),
    )  # fmt: skip


def gemma_hf_dict(arch: Any) -> dict[str, Any]:
    """The Gemma fields of an HF config.json for `arch` (classic RoPE keys)."""
    windows = arch.sliding_windows or (None,) * arch.num_layers
    local = [w for w in windows if w is not None]
    out = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": arch.query_pre_attn_scalar,
        "attn_logit_softcapping": arch.attn_logit_soft_cap,
        "final_logit_softcapping": arch.final_logit_soft_cap,
        "sliding_window": local[0] if local else None,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windows],
        "attention_bias": arch.qkv_bias,
        "use_bidirectional_attention": False,
    }
    if arch.family == "gemma3_text":
        out["rope_local_base_freq"] = arch.local_rope_theta or arch.rope_theta
    return out


def build_gemma(arch: Any, *, stack: str, **kwargs: Any) -> Any:
    """`gemma_config` for a Gemma `arch` (kwargs: dtype, attention_implementation, name)."""
    if arch.qkv_bias != arch.output_bias or arch.mlp_bias or arch.is_moe:
        raise UnsupportedModelError(f"{arch.family}: attention bias on q/k/v and o together, "
                                    "no MLP bias, no experts")  # fmt: skip
    scaling = arch.rope_scaling
    if scaling is not None and scaling.get("rope_type") != "linear":
        raise UnsupportedModelError(f"{arch.family}: RoPE scaling {scaling.get('rope_type')!r}")
    windows = arch.sliding_windows or (None,) * arch.num_layers
    local = sorted({w for w in windows if w is not None})
    if len(local) > 1:
        raise UnsupportedModelError(f"{arch.family}: one sliding window for local layers")
    cfg = gemma_config(
        arch.vocab_size, arch.dim, arch.num_layers, arch.num_heads, arch.num_kv_heads,
        arch.ffn_dim, head_dim=arch.head_dim,
        layer_pattern=["local" if w else "global" for w in windows],
        sliding_window=local[0] if local else None,
        query_pre_attn_scalar=arch.query_pre_attn_scalar, rope_theta=arch.rope_theta,
        rope_local_theta=arch.local_rope_theta,
        global_rope_scaling=None if scaling is None else
        LinearFrequencyScaling.default_config().set(factor=float(scaling["factor"])),
        attn_logit_soft_cap=arch.attn_logit_soft_cap,
        final_logit_soft_cap=arch.final_logit_soft_cap, qk_norm=arch.qk_norm,
        norm_eps=arch.norm_eps, attention_bias=arch.qkv_bias,
        tie_embeddings=arch.tie_embeddings, stack=stack, **kwargs,
    )  # fmt: skip
    return cfg


def _bad(path: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"cannot export {path}: {why}")


def _eps(path: str, norm: Any) -> float:
    if getattr(norm, "klass", None) is not RMSNorm or norm.scale_offset != 1.0:
        raise _bad(path, "Gemma norms are RMSNorm * (1 + scale)")
    return float(norm.eps)


def _layer(where: str, lc: Any, dim: int, eps: float) -> tuple[dict[str, Any], Any, Any]:
    """(fields shared by every layer, window, RoPE config) of one Gemma layer config."""
    if lc.klass is not TransformerLayer or lc.post_norm is None:
        raise _bad(where, "Gemma layers are TransformerLayers with post_norm")
    for name in ("norm", "post_norm"):
        if _eps(f"{where}.{name}", getattr(lc, name)) != eps:
            raise _bad(f"{where}.{name}.eps", "HF Gemma has one rms_norm_eps")
    a, f = lc.self_attention, lc.feed_forward
    if a.klass is not Attention or not a.causal or a.rope is None:
        raise _bad(f"{where}.self_attention", "causal Attention with RoPE")
    if a.qkv_bias != a.output_bias or a.rope.rotary_fraction != 1.0:
        raise _bad(f"{where}.self_attention", "biases on q/k/v and o together, full RoPE")
    if a.qk_norm is not None and _eps(f"{where}.self_attention.qk_norm", a.qk_norm) != eps:
        raise _bad(f"{where}.self_attention.qk_norm.eps", "HF Gemma 3 uses rms_norm_eps")
    if f.klass is not FeedForward or tuple(f.activation) != ("gelu_tanh", "linear") or f.use_bias:
        raise _bad(f"{where}.feed_forward", "Gemma MLPs are GeGLU (gelu_tanh) without bias")
    head_dim = a.head_dim if a.head_dim is not None else dim // a.num_heads
    scale = a.query_scale if a.query_scale is not None else head_dim**-0.5
    shared = dict(
        num_heads=a.num_heads, num_kv_heads=a.num_kv_heads or a.num_heads, head_dim=head_dim,
        ffn_dim=f.hidden_dim, qkv_bias=bool(a.qkv_bias), output_bias=bool(a.output_bias),
        qk_norm=a.qk_norm is not None, query_pre_attn_scalar=round(scale**-2, 6),
        attn_logit_soft_cap=a.logit_soft_cap,
    )  # fmt: skip
    return shared, a.sliding_window, a.rope


def gemma_architecture(cfg: Any, layers: list[Any]) -> dict[str, Any]:
    """`Architecture` fields of a Gemma `CausalLM.Config` (embeddings scaled by sqrt(dim))
    whose per-layer configs are `layers`; `UnsupportedModelError` naming the config path
    of anything HF Gemma2 / Gemma3 cannot express."""
    dec = cfg.decoder
    eps = _eps("model.decoder.output_norm", dec.output_norm)
    first: Optional[dict[str, Any]] = None
    windows, thetas = [], {}
    for i, lc in enumerate(layers):
        where = f"model.decoder.transformer.layers[{i}]"
        this, window, rope = _layer(where, lc, dec.dim, eps)
        if first is not None and this != first:
            diff = sorted(k for k in this if this[k] != first[k])
            raise _bad(where, f"layers differ from layer 0 in {diff}")
        first = first or this
        fs = rope.frequency_scaling
        scaling = None if fs is None else ("linear", float(fs.factor))
        if fs is not None and (fs.klass is not LinearFrequencyScaling or window is not None):
            raise _bad(f"{where}.self_attention.rope", "linear scaling of global layers only")
        key = (window is not None, scaling if window is None else None)
        if thetas.setdefault(key[0], (float(rope.theta), key[1])) != (float(rope.theta), key[1]):
            raise _bad(f"{where}.self_attention.rope", "one RoPE per layer kind")
        windows.append(window)
    assert first is not None
    if len({w for w in windows if w is not None}) > 1:
        raise _bad("model.decoder.transformer", "one sliding window for every local layer")
    glob = thetas.get(False, thetas.get(True))
    local = thetas.get(True, glob)
    family = "gemma3_text" if first.pop("qk_norm") else "gemma2"
    if family == "gemma3_text" and first["attn_logit_soft_cap"] is not None:
        raise _bad("model.decoder.transformer", "HF Gemma 3 has no attention soft cap")
    if family == "gemma2" and local[0] != glob[0]:
        raise _bad("model.decoder.transformer", "Gemma 2 has one RoPE theta (q/k norms: Gemma 3)")
    return dict(
        first, family=family, vocab_size=dec.vocab_size, dim=dec.dim, num_layers=len(layers),
        norm_eps=eps, rope_theta=glob[0], local_rope_theta=local[0],
        rope_scaling=None if glob[1] is None else {"rope_type": "linear", "factor": glob[1][1]},
        tie_embeddings=dec.lm_head is None, sliding_windows=tuple(windows),
        final_logit_soft_cap=dec.logits_soft_cap,
    )  # fmt: skip
