"""Gemma 2 / Gemma 3 (text): `Architecture` <-> `gemma_config` and HF config.json fields.
Local layers are those with a sliding window (Gemma 3: RoPE theta `local_rope_theta`).
HF model types `gemma2` and `gemma3_text`; the multimodal `gemma3`
(`Gemma3ForConditionalGeneration`) is read as its text model (`multimodal_text_config`)."""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.families.checks import flag, number, optional_integer
from jaxlearn.families.errors import MalformedFileError, UnsupportedModelError
from jaxlearn.layers import (
    Attention,
    FeedForward,
    LinearFrequencyScaling,
    RMSNorm,
    TransformerLayer,
    gemma_config,
)

GEMMA_FAMILIES = ("gemma2", "gemma3_text")
# HF class defaults of fields a config.json may leave out: query_pre_attn_scalar,
# attn_logit_softcapping, final_logit_softcapping, sliding_window, sliding_window_pattern.
_DEFAULTS = {"gemma2": (256, 50.0, 30.0, 4096, 2), "gemma3_text": (256, None, None, 4096, 6)}
_TYPES = ("sliding_attention", "full_attention")
# Gemma3TextConfig's defaults, which a multimodal config's `text_config` may leave out.
_GEMMA3_TEXT = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    rope_theta=1e6, max_position_embeddings=131072, tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh",
)  # fmt: skip


def multimodal_text_config(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The `gemma3_text` config.json of a multimodal `gemma3` one: its `text_config` over
    Gemma3TextConfig's defaults, with the top level's special ids where the text config
    has none. The vision tower is not part of the result (nor of the loaded model)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise MalformedFileError(f"{where}: model_type 'gemma3' without a text_config object")
    out = {**_GEMMA3_TEXT, **text, "model_type": "gemma3_text"}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if k in hf and k not in text:
            out[k] = hf[k]
    return out


def gemma_hf_fields(hf: dict[str, Any], where: str, family: str, layers: int) -> dict[str, Any]:
    """The Gemma `Architecture` fields of an HF config.json (checked)."""
    if flag(hf.get("use_bidirectional_attention"), where, "use_bidirectional_attention"):
        raise UnsupportedModelError(f"{where}: use_bidirectional_attention is not supported")
    keys = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
    q, attn, final = (hf.get(k, d) for k, d in zip(keys, _DEFAULTS[family]))
    q, attn, final = (None if v is None else number(v, where, k)
                      for k, v in zip(keys, (q, attn, final)))  # fmt: skip
    window = optional_integer(hf.get("sliding_window", _DEFAULTS[family][3]), where,
                              "sliding_window", high=2**40)  # fmt: skip
    every = hf.get("sliding_window_pattern", _DEFAULTS[family][4])
    every = optional_integer(every, where, "sliding_window_pattern", high=2**20) or 1
    types = hf.get("layer_types") or [_TYPES[(i + 1) % every == 0] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(_TYPES):
        raise MalformedFileError(f"{where}: layer_types is not a list of num_hidden_layers = "
                                 f"{layers} entries from {_TYPES}")  # fmt: skip
    local = hf.get("rope_local_base_freq", 10000.0 if family == "gemma3_text" else None)
    params = (hf.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(params, dict):
        if params.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"{where}: RoPE scaling of sliding_attention layers")
        local = params.get("rope_theta", local)
    return dict(
        sliding_windows=tuple(window if t == _TYPES[0] else None for t in types),
        query_pre_attn_scalar=q, final_logit_soft_cap=final,
        # transformers' Gemma 3 attention ignores attn_logit_softcapping.
        attn_logit_soft_cap=attn if family == "gemma2" else None,
        local_rope_theta=None if local is None else number(local, where, "rope_local_base_freq"),
    )  # fmt: skip


def gemma_hf_dict(arch: Any) -> dict[str, Any]:
    """The Gemma fields of an HF config.json for `arch` (classic RoPE keys)."""
    windows = arch.sliding_windows or (None,) * arch.num_layers
    q = arch.query_pre_attn_scalar or arch.head_dim
    out = dict(
        hidden_activation="gelu_pytorch_tanh", attention_bias=arch.qkv_bias,
        query_pre_attn_scalar=int(q) if float(q).is_integer() else q,  # HF: an int
        attn_logit_softcapping=arch.attn_logit_soft_cap,
        final_logit_softcapping=arch.final_logit_soft_cap,
        sliding_window=next((w for w in windows if w), None),
        layer_types=[_TYPES[w is None] for w in windows], use_bidirectional_attention=False,
    )  # fmt: skip
    if arch.family == "gemma3_text":
        out["rope_local_base_freq"] = arch.local_rope_theta or arch.rope_theta
    return out


def build_gemma(arch: Any, *, stack: str, **kwargs: Any) -> Any:
    """`gemma_config` for a Gemma `arch` (kwargs: dtype, attention_implementation, name);
    linear RoPE scaling applies to the global layers (Gemma 3 4B+)."""
    s = arch.rope_scaling
    if s is not None and s.get("rope_type") != "linear":
        raise UnsupportedModelError(f"{arch.family}: RoPE scaling {s.get('rope_type')!r}")
    windows = arch.sliding_windows or (None,) * arch.num_layers
    return gemma_config(
        arch.vocab_size, arch.dim, arch.num_layers, arch.num_heads, arch.num_kv_heads,
        arch.ffn_dim, head_dim=arch.head_dim, stack=stack,
        layer_pattern=["local" if w else "global" for w in windows],
        sliding_window=next((w for w in windows if w), None),
        query_pre_attn_scalar=arch.query_pre_attn_scalar, rope_theta=arch.rope_theta,
        rope_local_theta=arch.local_rope_theta,
        global_rope_scaling=s and LinearFrequencyScaling.default_config().set(factor=s["factor"]),
        attn_logit_soft_cap=arch.attn_logit_soft_cap,
        final_logit_soft_cap=arch.final_logit_soft_cap, qk_norm=arch.qk_norm,
        norm_eps=arch.norm_eps, attention_bias=arch.qkv_bias,
        tie_embeddings=arch.tie_embeddings, **kwargs,
    )  # fmt: skip


def _bad(path: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"cannot export {path}: {why}")


def _eps(path: str, norm: Any) -> float:
    if getattr(norm, "klass", None) is not RMSNorm or norm.scale_offset != 1.0:
        raise _bad(path, "Gemma norms are RMSNorm * (1 + scale)")
    return float(norm.eps)


def _layer(where: str, lc: Any, dim: int, eps: float) -> dict[str, Any]:
    """The `Architecture` fields every layer of a Gemma model shares, checked."""
    if lc.klass is not TransformerLayer or lc.post_norm is None:
        raise _bad(where, "Gemma layers are TransformerLayers with post_norm")
    a, f = lc.self_attention, lc.feed_forward
    norms = [(name, getattr(lc, name)) for name in ("norm", "post_norm")]
    for name, norm in norms + ([("self_attention.qk_norm", a.qk_norm)] if a.qk_norm else []):
        if _eps(f"{where}.{name}", norm) != eps:
            raise _bad(f"{where}.{name}.eps", "HF Gemma has one rms_norm_eps")
    if a.klass is not Attention or not a.causal or a.rope is None or a.qkv_bias != a.output_bias:
        raise _bad(f"{where}.self_attention", "causal, RoPE, q/k/v and o biases together")
    if f.klass is not FeedForward or tuple(f.activation) != ("gelu_tanh", "linear") or f.use_bias:
        raise _bad(f"{where}.feed_forward", "Gemma MLPs are GeGLU (gelu_tanh) without bias")
    if a.rope.rotary_fraction != 1.0:
        raise _bad(f"{where}.self_attention.rope.rotary_fraction", "Gemma has full RoPE")
    head_dim = a.head_dim if a.head_dim is not None else dim // a.num_heads
    scale = a.query_scale if a.query_scale is not None else head_dim**-0.5
    return dict(
        num_heads=a.num_heads, num_kv_heads=a.num_kv_heads or a.num_heads, head_dim=head_dim,
        ffn_dim=f.hidden_dim, qkv_bias=bool(a.qkv_bias), output_bias=bool(a.output_bias),
        qk_norm=a.qk_norm is not None, query_pre_attn_scalar=round(scale**-2, 6),
        attn_logit_soft_cap=a.logit_soft_cap,
    )  # fmt: skip


def _rope(where: str, rope: Any, local: bool) -> tuple[float, Optional[float]]:
    fs = rope.frequency_scaling
    if fs is not None and (fs.klass is not LinearFrequencyScaling or local):
        raise _bad(f"{where}.self_attention.rope", "linear scaling of global layers only")
    return float(rope.theta), None if fs is None else float(fs.factor)


def gemma_architecture(cfg: Any, layers: list[Any]) -> dict[str, Any]:
    """`Architecture` fields of a Gemma `CausalLM.Config` (embeddings scaled by sqrt(dim))
    whose per-layer configs are `layers`; `UnsupportedModelError` naming the config path
    of anything HF Gemma2 / Gemma3 cannot express."""
    dec, first = cfg.decoder, None
    ropes: dict[bool, tuple[float, Optional[float]]] = {}
    eps = _eps("model.decoder.output_norm", dec.output_norm)
    windows = [lc.self_attention.sliding_window for lc in layers]
    for i, lc in enumerate(layers):
        where = f"model.decoder.transformer.layers[{i}]"
        this = _layer(where, lc, dec.dim, eps)
        if first is not None and this != first:
            raise _bad(where, f"differs from layer 0 in {[k for k in this if this[k] != first[k]]}")
        first, local = first or this, windows[i] is not None
        rope = _rope(where, lc.self_attention.rope, local)
        if ropes.setdefault(local, rope) != rope:
            raise _bad(f"{where}.self_attention.rope", "one RoPE per layer kind")
    assert first is not None
    if len({w for w in windows if w is not None}) > 1:
        raise _bad("model.decoder.transformer", "one sliding window for every local layer")
    theta, factor = ropes.get(False) or ropes[True]
    local_theta = ropes[True][0] if True in ropes else None
    family = "gemma3_text" if first.pop("qk_norm") else "gemma2"
    if family == "gemma3_text" and first["attn_logit_soft_cap"] is not None:
        raise _bad("model.decoder.transformer", "HF Gemma 3 has no attention soft cap")
    if family == "gemma2" and local_theta not in (None, theta):
        raise _bad("model.decoder.transformer", "Gemma 2 has one RoPE theta (q/k norms: Gemma 3)")
    return dict(
        first, family=family, vocab_size=dec.vocab_size, dim=dec.dim, num_layers=len(layers),
        norm_eps=eps, rope_theta=theta,
        local_rope_theta=(local_theta or theta) if family == "gemma3_text" else None,
        rope_scaling=None if factor is None else {"rope_type": "linear", "factor": factor},
        tie_embeddings=dec.lm_head is None, sliding_windows=tuple(windows),
        final_logit_soft_cap=dec.logits_soft_cap,
    )  # fmt: skip
