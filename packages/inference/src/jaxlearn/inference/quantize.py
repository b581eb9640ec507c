"""int8 quantization of a model for serving (`Engine.Config.quantize`): int8 weights with
per-output-channel scales, and activations quantized per row by the matmul
(`kernels.int8_matmul`).

`quantize(model_cfg, params, "int8")` returns (config, params) with every plain `Linear`
(the LM head and the attention / feed-forward projections, which are Linear children)
swapped for an `Int8Linear` (`serving_layers`) and its `weight` converted to
int8 values + float32 per-output-channel scales (`weight`, `scale`; computed once here),
and the embedding table, when it is tied as the output head, held as a
`jaxlearn.kernels.Int8Weight` (its per-row scales serve the lookup too). Left as they
are: norms, biases, an untied embedding table (a lookup reads a few rows per step),
mixture-of-experts weights (raw params of the MoE layer, not Linear children),
`LoraLinear` projections and every Linear with an injected dot (int8/fp8 training dots).

`swap_linears` is the conversion both this and `weight_layout` run: a config rewrite of
the plain Linear configs and the matching conversion of their params.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from jaxlearn.config import replace_config
from jaxlearn.inference.serving_layers import Int8Linear
from jaxlearn.kernels import Int8Weight, quantize_int8
from jaxlearn.layers import Decoder, Embedding, Linear, LoraLinear
from jaxlearn.module import Module

QUANTIZE_MODES = ("int8",)
# fn(weight [*lead, *in, *out], in_dims, lead) -> the variant's params (bias aside).
Convert = Callable[[Any, int, int], dict[str, Any]]


def check_quantize(mode: Optional[str]) -> None:
    """ValueError (one line, naming the field) unless `mode` is None or a known mode."""
    if mode is not None and mode not in QUANTIZE_MODES:
        raise ValueError(f"Engine.Config.quantize={mode!r}: must be None or one of "
                         f"{', '.join(QUANTIZE_MODES)}")


def is_plain_linear(c: Any, *, lora: bool = False) -> bool:
    """A `Linear` config (not a subclass: LoRA, int8, transposed; with `lora`, a
    `LoraLinear` too) with the default dot."""
    return "klass" in c and (c.klass is Linear or (lora and c.klass is LoraLinear)) \
        and c.dot is None


def plain_linears(model: Module, params: Any, *,
                  lora: bool = False) -> list[tuple[Module, dict[str, Any]]]:
    """(module, its params) of every plain Linear of `model` (see `is_plain_linear`)."""
    out: list[tuple[Module, dict[str, Any]]] = []

    def walk(module: Module, p: Any) -> None:
        if is_plain_linear(module.config, lora=lora):
            out.append((module, p))
            return
        for name, child in module.children.items():
            if isinstance(p, dict) and isinstance(p.get(name), dict):
                walk(child, p[name])

    walk(model, params)
    return out


def swap_linears(model_cfg: Any, params: Any, variant: type[Linear], fn: Convert, *,
                 lora_variant: Optional[type[Linear]] = None) -> tuple[Any, Any]:
    """(config with every plain Linear config replaced by `variant`'s (fields carried
    over), params with each plain Linear's `weight` replaced by `fn(weight, in dims,
    lead dims)`). A scanned stack's weights keep their leading layer axis (`lead`). With
    `lora_variant`, every `LoraLinear` becomes one too, its weight converted alike and its
    `adapter` params kept."""
    model = model_cfg.instantiate()
    lora = lora_variant is not None

    def walk(module: Module, p: Any) -> Any:
        if is_plain_linear(module.config, lora=lora):
            own = module._create_layer_parameter_specs()["weight"]
            lead = len(p["weight"].shape) - len(own.shape)
            rest = {k: v for k, v in p.items() if k != "weight"}
            return {**rest, **fn(p["weight"], len(module.in_shape), lead)}
        out = dict(p)
        for name, child in module.children.items():
            if isinstance(p.get(name), dict):
                out[name] = walk(child, p[name])
        return out

    new_cfg = replace_config(
        model_cfg, lambda path, c: is_plain_linear(c, lora=lora),
        lambda old, path: (lora_variant if old.klass is LoraLinear else variant)
        .default_config(), allow_no_match=True)  # type: ignore[union-attr]
    return new_cfg, walk(model, params)


def tied_head(model_cfg: Any) -> bool:
    """Whether the model's embedding table doubles as its output head (default dot): the
    table `quantize` and `weight_layout.pack_weights` convert besides the Linears."""
    decoder = model_cfg.instantiate().children.get("decoder")
    emb = decoder.children.get("emb") if isinstance(decoder, Decoder) else None
    return (isinstance(emb, Embedding) and emb.config.dot is None
            and decoder.config.lm_head is None)


def int8_weight(w: Any, in_dims: int, lead: int) -> Int8Weight:
    """A Linear weight [*lead, *in, *out] as int8 with per-output-channel scales (one
    scale per lead index and output channel): what `quantize` stores and what
    `weight_layout` packs as int8."""
    return quantize_int8(w, tuple(range(lead, lead + in_dims)))


def _int8(w: Any, in_dims: int, lead: int) -> dict[str, Any]:
    q = int8_weight(w, in_dims, lead)
    return {"weight": q.q, "scale": q.scale}


def quantize(model_cfg: Any, params: Any, mode: str = "int8") -> tuple[Any, Any]:
    """(config, params) of `model_cfg` / `params` served with int8 weights (see module
    docstring). A scanned stack's scales are per layer and output channel."""
    check_quantize(mode)
    cfg, params = swap_linears(model_cfg, params, Int8Linear, _int8)
    if tied_head(model_cfg):  # Per-row scales.
        table = params["decoder"]["emb"]["weight"]
        if not isinstance(table, Int8Weight):
            params = dict(params, decoder=dict(params["decoder"], emb=dict(
                params["decoder"]["emb"], weight=quantize_int8(table, (1,)))))
    return cfg, params


def params_nbytes(params: Any) -> int:
    """Bytes of a params tree (an `Int8Weight` counts its int8 values and f32 scales)."""
    import jax

    return sum(int(x.nbytes) for x in jax.tree.leaves(params))
