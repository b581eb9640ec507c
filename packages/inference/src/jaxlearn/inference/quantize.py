"""Weight-only quantization of a model's params for serving (`Engine.Config.quantize`).

`quantize_params(model, params, "int8")` returns the params with every dense weight
replaced by a `jaxlearn.kernels.Int8Weight` (int8 values + float32 per-output-channel
scales, computed once here): the `weight` of every `Linear` (the LM head, and the
attention and feed-forward projections, which are Linear children) and the embedding table
when it is tied as the output head (its per-row scales serve the lookup too). The layers'
`dense()` then runs `kernels.int8_matmul` on them. Left in their dtype: norms, biases,
an untied embedding table (a lookup reads a few rows per step), mixture-of-experts
weights (einsum, not `dense()`), `LoraLinear` projections and every layer with an
injected dot (int8/fp8 training dots), which `dense()` would otherwise bypass.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from jaxlearn.kernels import Int8Weight, quantize_int8
from jaxlearn.layers import Decoder, Embedding, Linear
from jaxlearn.module import Module

QUANTIZE_MODES = ("int8",)


def check_quantize(mode: Optional[str]) -> None:
    """ValueError (one line, naming the field) unless `mode` is None or a known mode."""
    if mode is not None and mode not in QUANTIZE_MODES:
        raise ValueError(f"Engine.Config.quantize={mode!r}: must be None or one of "
                         f"{', '.join(QUANTIZE_MODES)}")


def dense_weights(module: Module) -> dict[str, tuple[int, ...]]:
    """{param name: contracted axes} of the weights `module` multiplies through `dense()`
    with the default dot (see module docstring)."""
    if getattr(module, "_dot", None) is not None:
        return {}
    if type(module) is Linear:  # Not a LoraLinear: its adapter reads the input too.
        return {"weight": tuple(range(len(module.in_shape)))}
    parent = module.parent
    if isinstance(module, Embedding) and isinstance(parent, Decoder):
        return {"weight": (1,)} if parent.config.lm_head is None else {}
    return {}


def map_dense_weights(model: Module, params: Any, fn: Callable[[Any, tuple[int, ...]], Any]
                      ) -> Any:
    """`params` (a tree like `model`'s) with each dense weight `w` (see `dense_weights`)
    replaced by `fn(w, contracted axes)`. A scanned stack's weights keep their leading
    layer axis; the axes passed to `fn` count it."""

    def walk(module: Module, p: Any) -> Any:
        out = dict(p)
        own = module._create_layer_parameter_specs()  # The unstacked shapes.
        for name, axes in dense_weights(module).items():
            w = p.get(name)
            if w is not None and name in own:
                lead = len(w.shape) - len(own[name].shape)  # Stacked layers: [layers, ...].
                out[name] = fn(w, tuple(a + lead for a in axes))
        for name, child in module.children.items():
            if isinstance(p.get(name), dict):
                out[name] = walk(child, p[name])
        return out

    return walk(model, params)


def quantize_params(model: Module, params: Any, mode: str = "int8") -> Any:
    """`params` (a tree like `model`'s) with its dense weights as `Int8Weight`s (see
    module docstring). A scanned stack's weights keep their leading layer axis: scales are
    per layer and output channel."""
    check_quantize(mode)
    return map_dense_weights(
        model, params,
        lambda w, axes: w if isinstance(w, Int8Weight) else quantize_int8(w, axes))


def params_nbytes(params: Any) -> int:
    """Bytes of a params tree (an `Int8Weight` counts its int8 values and f32 scales)."""
    import jax

    return sum(int(x.nbytes) for x in jax.tree.leaves(params))
