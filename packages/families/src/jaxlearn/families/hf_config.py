"""HF `config.json` dicts <-> `Architecture`; every value read is checked before a config
is built.

    arch = architecture_from_hf(hf, where=".../config.json")   # hf: the parsed dict
    hf = hf_config_dict(arch)                                   # what export writes

Sizes are integers in the ranges of `checks.LIMITS` (hidden_size 0, vocab_size 10**12,
"4096" as a string, NaN are refused naming config.json and the field);
num_attention_heads must divide hidden_size unless `head_dim` is given, and
num_key_value_heads must divide num_attention_heads. Whether the weights hold the layers
that `num_hidden_layers` declares is checked by `hf.load_hf` against the safetensors
headers (`checks.check_layers_present`).
"""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.families.arch import Architecture
from jaxlearn.families.checks import (
    LIMITS,
    check_heads,
    flag,
    integer,
    number,
    optional_integer,
)
from jaxlearn.families.errors import MalformedFileError, UnsupportedModelError
from jaxlearn.families.gemma import (
    GEMMA_FAMILIES,
    gemma_hf_dict,
    gemma_hf_fields,
    multimodal_text_config,
)
from jaxlearn.families.names import FAMILIES
from jaxlearn.layers import scaling_config, scaling_dict

HF_CLASSES = {name: fam.hf_class for name, fam in FAMILIES.items()}


def _ids(value: Any, where: str, field: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(integer(v, where, field, low=0, high=2**63 - 1) for v in values)


# Optional fields per RoPE type (numbers; truncate a flag), besides factor and the
# original maximum, which every type but linear has.
_SCALING_FIELDS = {
    "linear": (),
    "llama3": ("low_freq_factor", "high_freq_factor"),
    "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"),
    "dynamic": (),
    "longrope": ("attention_factor",),
}


def _scaling(hf: dict[str, Any], scaling: dict[str, Any], where: str, rotary: int) -> Any:
    """A checked HF-style scaling dict (`jaxlearn.layers.SCALINGS` types) or None, with
    HF's defaults filled in: factor = max / original positions where absent (yarn,
    longrope), dynamic's original maximum = `max_position_embeddings`, Phi-3's
    top-level `original_max_position_embeddings` and "su"/"yarn" = longrope."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if hf.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type == "default":
        return None
    if rope_type not in _SCALING_FIELDS:
        raise UnsupportedModelError(
            f"{where}: RoPE scaling {rope_type!r} is not supported ({sorted(_SCALING_FIELDS)})"
        )
    out: dict[str, Any] = {"rope_type": rope_type}
    key = "rope_scaling.original_max_position_embeddings"
    if rope_type != "linear":
        orig = hf.get("max_position_embeddings") if rope_type == "dynamic" else None
        orig = orig or hf.get("original_max_position_embeddings")
        orig = orig or scaling.get("original_max_position_embeddings")
        orig = orig or hf.get("max_position_embeddings")
        out[key.split(".")[1]] = integer(orig, where, key, high=LIMITS["positions"])
    factor = scaling.get("factor")
    if factor is None and rope_type in ("yarn", "longrope"):
        factor = integer(hf.get("max_position_embeddings"), where, "max_position_embeddings",
                         high=2**40) / out["original_max_position_embeddings"]  # fmt: skip
    out["factor"] = number(factor, where, "rope_scaling.factor")
    for k in _SCALING_FIELDS[rope_type]:
        if scaling.get(k) is not None or rope_type == "llama3":
            out[k] = number(scaling.get(k), where, f"rope_scaling.{k}")
    if rope_type == "yarn":
        out["truncate"] = flag(scaling.get("truncate"), where, "rope_scaling.truncate", True)
    for k in ("short_factor", "long_factor") if rope_type == "longrope" else ():
        values = scaling.get(k)
        if not isinstance(values, list) or len(values) != rotary // 2:
            raise MalformedFileError(
                f"{where}: rope_scaling.{k} is not a list of {rotary // 2} numbers"
            )
        out[k] = [number(v, where, f"rope_scaling.{k}") for v in values]
    return scaling_dict(scaling_config(out))  # canonical: every field, defaults filled


def _rope(hf: dict[str, Any], where: str, head_dim: int) -> tuple[float, float, Any]:
    """(theta, rotary fraction, scaling dict or None) from transformers 5
    `rope_parameters` or the older top-level `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    scaling: Any = params if isinstance(params, dict) else hf.get("rope_scaling")
    theta = hf.get("rope_theta", 10000.0)
    partial = hf.get("partial_rotary_factor", 1.0)
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        partial = params.get("partial_rotary_factor", partial)
    if scaling is not None and not isinstance(scaling, dict):
        raise MalformedFileError(f"{where}: rope_scaling = {scaling!r} is not an object")
    partial = number(partial, where, "partial_rotary_factor")
    if partial > 1.0 or int(head_dim * partial) < 2:
        raise MalformedFileError(f"{where}: partial_rotary_factor = {partial} is not in (0, 1]")
    if partial != 1.0 and hf.get("model_type") != "phi3":
        raise UnsupportedModelError(f"{where}: partial_rotary_factor != 1 needs phi3")
    rotary = int(head_dim * partial)
    out = _scaling(hf, scaling, where, rotary) if scaling else None
    return number(theta, where, "rope_theta"), partial, out


def _windows(
    hf: dict[str, Any], where: str, model_type: str, layers: int
) -> tuple[Optional[int], ...]:
    """Per-layer sliding windows (None: full attention), or () when no layer has one."""
    window = optional_integer(hf.get("sliding_window"), where, "sliding_window", high=2**40)
    layer_types = hf.get("layer_types")
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if not flag(hf.get("use_sliding_window"), where, "use_sliding_window"):
            window = None
    if model_type in ("qwen2", "qwen3"):
        if layer_types is None:
            k = integer(
                hf.get("max_window_layers", layers), where, "max_window_layers", low=0, high=layers
            )
            layer_types = ["full_attention"] * k + ["sliding_attention"] * (layers - k)
    if layer_types is not None and model_type in ("qwen2", "qwen3", "llama"):
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise MalformedFileError(
                f"{where}: layer_types is not a list of num_hidden_layers = {layers} entries"
            )
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if model_type in ("mistral", "mixtral", "qwen3_moe", "phi3") and window is not None:
        return (window,) * layers  # Qwen3-MoE: every layer (no max_window_layers)
    return ()


def architecture_from_hf(hf: Any, *, where: str = "config.json") -> Architecture:
    """Reads an HF `config.json` dict of a `HF_CLASSES` family (or a multimodal `gemma3`: its
    text model); every value checked (MalformedFileError naming `where` and the field)."""
    if not isinstance(hf, dict):
        raise MalformedFileError(f"{where}: the top level is not a JSON object")
    hf = multimodal_text_config(hf, where) if hf.get("model_type") == "gemma3" else hf
    model_type = hf.get("model_type")
    if model_type not in HF_CLASSES:
        archs = hf.get("architectures") or []
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} ({archs}) is not supported; "
            f"supported: {sorted(HF_CLASSES)}"
        )
    gemma = model_type in GEMMA_FAMILIES
    act = hf.get("hidden_activation", hf.get("hidden_act")) if gemma else hf.get("hidden_act")
    want = "gelu_pytorch_tanh" if gemma else "silu"
    if (act or want) != want:
        raise UnsupportedModelError(f"{where}: hidden_act {act!r} ({model_type}: only {want})")

    def size(field: str, limit: str, default: Any = None, low: int = 1) -> int:
        value = hf.get(field, default)
        if value is None:
            raise MalformedFileError(f"{where}: missing field {field!r}")
        return integer(value, where, field, low=low, high=LIMITS[limit])

    dim = size("hidden_size", "dim")
    heads = size("num_attention_heads", "num_heads")
    kv = size("num_key_value_heads", "num_heads", hf.get("num_key_value_heads") or heads)
    head_dim = check_heads(
        where,
        dim=dim,
        heads=heads,
        kv_heads=kv,
        head_dim=optional_integer(hf.get("head_dim"), where, "head_dim", high=LIMITS["head_dim"]),
        fields=("hidden_size", "num_attention_heads", "num_key_value_heads"),
    )
    layers = size("num_hidden_layers", "num_layers")
    theta, rotary_fraction, scaling = _rope(hf, where, head_dim)
    qwen_moe = model_type == "qwen3_moe"
    experts = 0
    if model_type == "mixtral" or qwen_moe:
        name = "num_experts" if qwen_moe and "num_local_experts" not in hf else "num_local_experts"
        experts = size(name, "num_experts")
    per_token = size("num_experts_per_tok", "num_experts", 2)
    if experts and per_token > experts:
        raise MalformedFileError(
            f"{where}: num_experts_per_tok = {per_token} > num_local_experts = {experts}"
        )
    bias = flag(hf.get("attention_bias"), where, "attention_bias")
    return Architecture(
        family=model_type,
        vocab_size=size("vocab_size", "vocab_size"),
        dim=dim,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_dim=size("moe_intermediate_size" if qwen_moe else "intermediate_size", "ffn_dim"),
        norm_eps=number(hf.get("rms_norm_eps", 1e-6), where, "rms_norm_eps"),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_fraction=rotary_fraction,
        tie_embeddings=flag(hf.get("tie_word_embeddings"), where, "tie_word_embeddings"),
        qkv_bias=True if model_type == "qwen2" else bias,
        output_bias=bias and model_type in ("llama", "qwen3", "qwen3_moe", *GEMMA_FAMILIES),
        mlp_bias=flag(hf.get("mlp_bias"), where, "mlp_bias") if model_type == "llama" else False,
        **(gemma_hf_fields(hf, where, model_type, layers) if gemma
           else dict(sliding_windows=_windows(hf, where, model_type, layers))),
        num_experts=experts,
        num_experts_per_token=per_token,
        router_aux_loss_coef=number(
            hf.get("router_aux_loss_coef", 0.0), where, "router_aux_loss_coef", positive=False
        ),
        max_position_embeddings=optional_integer(
            hf.get("max_position_embeddings"), where, "max_position_embeddings", high=2**40
        ),
        bos_token_id=(_ids(hf.get("bos_token_id"), where, "bos_token_id") or (None,))[0],
        eos_token_ids=_ids(hf.get("eos_token_id"), where, "eos_token_id"),
        **(_qwen3_moe_layers(hf, where, layers) if qwen_moe else {}),
    )


def _qwen3_moe_layers(hf: dict[str, Any], where: str, layers: int) -> dict[str, Any]:
    """The dense-layer and routing fields of a Qwen3-MoE config.json: dense FFNs
    (`intermediate_size`) in `mlp_only_layers` and in the layers `decoder_sparse_step`
    skips (experts have `moe_intermediate_size`), `norm_topk_prob`."""
    step = integer(hf.get("decoder_sparse_step", 1), where, "decoder_sparse_step", high=layers)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list):
        raise MalformedFileError(f"{where}: mlp_only_layers = {only!r} is not a list")
    only_set = {integer(i, where, "mlp_only_layers", low=0, high=layers - 1) for i in only}
    dense = tuple(i for i in range(layers) if i in only_set or (i + 1) % step)
    ffn = 0
    if dense:
        ffn = integer(
            hf.get("intermediate_size"), where, "intermediate_size", high=LIMITS["ffn_dim"]
        )
    return dict(
        dense_layers=dense,
        dense_ffn_dim=ffn,
        normalize_top_k=flag(hf.get("norm_topk_prob"), where, "norm_topk_prob"),
    )


# ---- Architecture -> config.json ---------------------------------------------------------


def hf_config_dict(arch: Architecture, *, dtype: str = "float32") -> dict[str, Any]:
    """An HF `config.json` dict for `arch` (the classic `rope_theta`/`rope_scaling` keys,
    which transformers 4 and 5 both read)."""
    scaling = None
    max_positions = arch.max_position_embeddings or 4096
    if arch.rope_scaling is not None:
        scaling = {k: v for k, v in arch.rope_scaling.items()}
        if scaling["rope_type"] == "dynamic":  # HF's original maximum for dynamic NTK
            max_positions = scaling.pop("original_max_position_embeddings")
    out: dict[str, Any] = {
        "architectures": [HF_CLASSES[arch.family]],
        "model_type": arch.family,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.dim,
        "intermediate_size": arch.ffn_dim,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": arch.norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": arch.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if arch.bos_token_id is not None:
        out["bos_token_id"] = arch.bos_token_id
    if arch.eos_token_ids:
        eos = list(arch.eos_token_ids)
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    windows = arch.sliding_windows
    if arch.family == "llama":
        out["attention_bias"] = arch.qkv_bias
        out["mlp_bias"] = arch.mlp_bias
    elif arch.family == "mistral":
        out["sliding_window"] = windows[0] if windows else None
    elif arch.family == "phi3":
        out.update(_phi3_fields(arch, scaling))
    elif arch.family in ("qwen2", "qwen3"):
        sliding = [i for i, w in enumerate(windows) if w is not None]
        out["use_sliding_window"] = bool(sliding)
        out["sliding_window"] = windows[sliding[0]] if sliding else None
        out["max_window_layers"] = sliding[0] if sliding else arch.num_layers
        if sliding:
            out["layer_types"] = [
                "sliding_attention" if w is not None else "full_attention" for w in windows
            ]
        if arch.family == "qwen3":
            out["attention_bias"] = arch.qkv_bias
    elif arch.family == "qwen3_moe":  # one window for every layer, or none
        out.update(
            use_sliding_window=bool(windows),
            sliding_window=windows[0] if windows else None,
            attention_bias=arch.qkv_bias,
            intermediate_size=arch.dense_ffn_dim or arch.ffn_dim,
            moe_intermediate_size=arch.ffn_dim,
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.num_experts_per_token,
            norm_topk_prob=arch.normalize_top_k,
            decoder_sparse_step=1,
            mlp_only_layers=list(arch.dense_layers),
            router_aux_loss_coef=arch.router_aux_loss_coef,
            output_router_logits=False,
        )
    elif arch.family in GEMMA_FAMILIES:
        del out["hidden_act"]
        out.update(gemma_hf_dict(arch))
    elif arch.family == "mixtral":
        out["sliding_window"] = windows[0] if windows else None
        out["num_local_experts"] = arch.num_experts
        out["num_experts_per_tok"] = arch.num_experts_per_token
        out["router_aux_loss_coef"] = arch.router_aux_loss_coef
        out["output_router_logits"] = False
        out["router_jitter_noise"] = 0.0
    return out


def _phi3_fields(arch: Architecture, scaling: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Phi-3's config.json fields: one window, partial RoPE, the original maximum at the
    top level (where Phi3Config reads it), no pad/bos/eos defaults (1, 32000)."""
    out = dict(
        sliding_window=arch.sliding_windows[0] if arch.sliding_windows else None,
        partial_rotary_factor=arch.rotary_fraction,
        attention_bias=False, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=None,
        bos_token_id=arch.bos_token_id,
        eos_token_id=arch.eos_token_ids[0] if len(arch.eos_token_ids) == 1
        else list(arch.eos_token_ids) or None,
    )  # fmt: skip
    if scaling is not None:
        out["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    return out
