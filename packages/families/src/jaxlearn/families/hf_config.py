"""HF `config.json` dicts <-> `Architecture`; every value read is checked before a config
is built.

    arch = architecture_from_hf(hf, where=".../config.json")   # hf: the parsed dict
    hf = hf_config_dict(arch)                                   # what export writes

The fields every family has are read here; each family (`Family.hf_fields` /
`Family.hf_dict`, in its own module) reads and writes the fields only it has with the
helpers below (`size`, `sliding_window`, `layer_type_windows`).

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
from jaxlearn.layers import scaling_config, scaling_dict


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


def _scaling(
    hf: dict[str, Any], scaling: dict[str, Any], where: str, rotary: int, aliases: dict[str, str]
) -> Any:
    """A checked HF-style scaling dict (`jaxlearn.layers.SCALINGS` types) or None, with
    HF's defaults filled in: factor = max / original positions where absent (yarn,
    longrope), dynamic's original maximum = `max_position_embeddings`, Phi-3's
    top-level `original_max_position_embeddings`; `aliases`: the family's other names of
    RoPE types (Phi-3's "su" / "yarn" = longrope)."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = aliases.get(rope_type, rope_type)
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


def _rope(hf: dict[str, Any], where: str, head_dim: int, fam: Any) -> tuple[float, float, Any]:
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
    if partial != 1.0 and not fam.partial_rotary:
        raise UnsupportedModelError(f"{where}: partial_rotary_factor != 1 needs phi3")
    rotary = int(head_dim * partial)
    out = _scaling(hf, scaling, where, rotary, fam.rope_aliases) if scaling else None
    return number(theta, where, "rope_theta"), partial, out


def size(hf: dict[str, Any], where: str, field: str, limit: str, default: Any = None,
         low: int = 1) -> int:
    """config.json `field` as an int in [low, LIMITS[limit]] (`default` when absent)."""
    value = hf.get(field, default)
    if value is None:
        raise MalformedFileError(f"{where}: missing field {field!r}")
    return integer(value, where, field, low=low, high=LIMITS[limit])


def sliding_window(hf: dict[str, Any], where: str) -> Optional[int]:
    return optional_integer(hf.get("sliding_window"), where, "sliding_window", high=2**40)


def layer_type_windows(
    layer_types: Any, window: Optional[int], where: str, layers: int
) -> tuple[Optional[int], ...]:
    """Per-layer windows of a config.json `layer_types` list ("sliding_attention" layers
    get `window`, the others None)."""
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        raise MalformedFileError(
            f"{where}: layer_types is not a list of num_hidden_layers = {layers} entries"
        )
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def one_window_fields(hf: dict[str, Any], where: str, layers: int) -> dict[str, Any]:
    """The window and bias fields of a config.json with one `sliding_window` for every
    layer and `attention_bias` on q/k/v only (Mistral, Mixtral, Phi-3)."""
    window = sliding_window(hf, where)
    return dict(qkv_bias=flag(hf.get("attention_bias"), where, "attention_bias"),
                output_bias=False, mlp_bias=False,
                sliding_windows=(window,) * layers if window else ())  # fmt: skip


def architecture_from_hf(hf: Any, *, where: str = "config.json") -> Architecture:
    """Reads an HF `config.json` dict of a registered family (`registry.family_of_hf`: by
    `model_type`, else `architectures`; a multimodal `gemma3`: its text model); every value
    checked (MalformedFileError naming `where` and the field)."""
    from jaxlearn.families.registry import family_of_hf  # (the families import this module)

    if not isinstance(hf, dict):
        raise MalformedFileError(f"{where}: the top level is not a JSON object")
    fam = family_of_hf(hf, where)
    hf = fam.hf_text_config(hf, where)
    act, want = fam.hf_act(hf), fam.hf_activation
    if (act or want) != want:
        raise UnsupportedModelError(f"{where}: hidden_act {act!r} ({fam.name}: only {want})")
    dim = size(hf, where, "hidden_size", "dim")
    heads = size(hf, where, "num_attention_heads", "num_heads")
    kv = size(hf, where, "num_key_value_heads", "num_heads", hf.get("num_key_value_heads") or heads)
    head_dim = check_heads(
        where,
        dim=dim,
        heads=heads,
        kv_heads=kv,
        head_dim=optional_integer(hf.get("head_dim"), where, "head_dim", high=LIMITS["head_dim"]),
        fields=("hidden_size", "num_attention_heads", "num_key_value_heads"),
    )
    layers = size(hf, where, "num_hidden_layers", "num_layers")
    theta, rotary_fraction, scaling = _rope(hf, where, head_dim, fam)
    fields = fam.hf_fields(hf, where, layers)
    experts = fields.get("num_experts", 0)
    per_token = size(hf, where, "num_experts_per_tok", "num_experts", 2)
    if experts and per_token > experts:
        raise MalformedFileError(
            f"{where}: num_experts_per_tok = {per_token} > num_local_experts = {experts}"
        )
    return Architecture(
        family=fam.name,
        vocab_size=size(hf, where, "vocab_size", "vocab_size"),
        dim=dim,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_dim=size(hf, where, fam.hf_ffn_field, "ffn_dim"),
        norm_eps=number(hf.get("rms_norm_eps", 1e-6), where, "rms_norm_eps"),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_fraction=rotary_fraction,
        tie_embeddings=flag(hf.get("tie_word_embeddings"), where, "tie_word_embeddings"),
        num_experts_per_token=per_token,
        router_aux_loss_coef=number(
            hf.get("router_aux_loss_coef", 0.0), where, "router_aux_loss_coef", positive=False
        ),
        max_position_embeddings=optional_integer(
            hf.get("max_position_embeddings"), where, "max_position_embeddings", high=2**40
        ),
        bos_token_id=(_ids(hf.get("bos_token_id"), where, "bos_token_id") or (None,))[0],
        eos_token_ids=_ids(hf.get("eos_token_id"), where, "eos_token_id"),
        **fields,
    )


# ---- Architecture -> config.json ---------------------------------------------------------


def hf_config_dict(arch: Architecture, *, dtype: str = "float32") -> dict[str, Any]:
    """An HF `config.json` dict for `arch` (the classic `rope_theta`/`rope_scaling` keys,
    which transformers 4 and 5 both read): the fields every family has, then the family's
    own (`Family.hf_dict`)."""
    from jaxlearn.families.registry import FAMILIES

    scaling = None
    max_positions = arch.max_position_embeddings or 4096
    if arch.rope_scaling is not None:
        scaling = {k: v for k, v in arch.rope_scaling.items()}
        if scaling["rope_type"] == "dynamic":  # HF's original maximum for dynamic NTK
            max_positions = scaling.pop("original_max_position_embeddings")
    out: dict[str, Any] = {
        "architectures": [FAMILIES[arch.family].hf_class],
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
    FAMILIES[arch.family].hf_dict(arch, out)
    return out

