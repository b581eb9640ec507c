"""The stored layout of the weights an `Engine` serves (`Engine.Config.weight_layout`).

A trained dense weight is `[*in, *out]`. On XLA:CPU a bf16 dot with few rows (decode)
reads the same weight 1.0-1.5x faster stored `[out, in]`; f32 dots are faster `[in, out]`
(`jaxlearn.kernels.weight_layout`). So:

- "auto" (default): on one CPU device, packed where the host packs the weights' dtype
  (below); otherwise, when every plain `Linear` weight is a 16-bit float, they are all
  stored `[out, in]`; f32 weights, int8 weights (`quantize`) and any other backend or a
  mesh keep the trained layout;
- "out_in": every plain float Linear weight stored `[out, in]` (one device only);
- "in_out": the trained layout;
- "packed": every plain float Linear weight packed once for the packed GEMM
  (`kernels.packed_gemm`, its backend `kernels.mkl.backend_for`), one CPU device;
  a `LoraLinear`'s base weight too (a `PackedLoraLinear`, its adapter unpacked).
  Activations are cast to the weights' dtype. "auto" chooses it first when every plain
  Linear weight and compute dtype is bfloat16, the host has native bf16 dot
  instructions and the kernel builds here (`unavailable_reason`): a decode step's
  matmuls then run 1.1-1.9x faster than XLA's bf16 dot at 8-32 rows and 3-19x at one
  row (XLA repacks the weight on every call). It chooses it too when every weight and
  compute dtype is float32 and the f32 weights go to the library's AVX-512 panels
  (`host_packs_float32`: x86 CPUs with AVX512F other than Intel's), where a decode step
  ran 1.4-1.7x faster than on XLA's f32 dot.
  With `quantize="int8"` the plain Linears and a tied head are quantized as
  `inference.quantize` does and packed as int8 (the packed int8 GEMM; `PackedLinear`
  with `weight_dtype="int8"`): the same products as `Int8Linear`'s XLA int8 dot, at
  half the bytes of bf16. "auto" chooses it on one CPU device of a host with int8 dot
  instructions (AVX512_VNNI, AVX_VNNI or AMX-INT8 on Intel, AVX512_VNNI elsewhere)
  where the kernel builds; LoRA
  projections stay as `quantize` leaves them (float, XLA's dot).

Stored `[out, in]` means a config swap: every plain Linear (`quantize.is_plain_linear`:
the LM head and the attention / FFN projections) becomes a `serving_layers.TransposedLinear`
whose `weight_t [*lead, prod(out), prod(in)]` is contracted on its stored layout
(`kernels.matmul_nt`). A tied embedding table is `[vocab, dim]` already and stays. The
copy is made once, when the engine is built; the engine's params then hold the
transposed arrays only.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.config import replace_config
from jaxlearn.inference.quantize import (
    check_quantize,
    int8_weight,
    plain_linears,
    quantize,
    swap_linears,
    tied_head,
)
from jaxlearn.inference.serving_layers import PackedLinear, TransposedLinear
from jaxlearn.kernels import PackedTable, PackedWeights, quantize_int8, transpose_weight
from jaxlearn.kernels.mkl import backend_for
from jaxlearn.kernels.packed_gemm import host_has_bf16, host_has_int8, unavailable_reason
from jaxlearn.layers import LoraAdapter
from jaxlearn.layers.lora import LoraFields
from jaxlearn.module import Module

WEIGHT_LAYOUTS = ("auto", "in_out", "out_in", "packed")
log = logging.getLogger(__name__)


class PackedLoraLinear(PackedLinear):
    """A `LoraLinear` served with its base weight packed (`PackedLinear`) and its
    `adapter` child as it is; the adapter's f32 output joins the f32 accumulator before
    the one rounding to the output dtype (a bf16 sum drops a young adapter's updates)."""

    class Config(LoraFields, PackedLinear.Config):
        pass

    def __init__(self, cfg: "PackedLoraLinear.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config  # The adapter `LoraLinear` adds.
        self._add_child("adapter", LoraAdapter.default_config().set(
            input_dim=c.input_dim, output_dim=c.output_dim, weight_axes=tuple(c.weight_axes),
            rank=c.lora_rank, alpha=c.lora_alpha, dropout=c.lora_dropout))

    def forward(self, x: Any, *, out_dtype: Any = None) -> Any:
        y = super().forward(x, out_dtype=jnp.float32)
        return (y + self.adapter(x.astype(self.dtype))).astype(out_dtype or self.dtype)


def check_weight_layout(layout: str, mesh_shape: Optional[tuple[int, ...]]) -> None:
    """ValueError (one line, naming the field) for an unknown layout, or "out_in" on a mesh."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"Engine.Config.weight_layout={layout!r}: must be one of "
                         f"{', '.join(WEIGHT_LAYOUTS)}")
    if layout in ("out_in", "packed") and mesh_shape is not None:
        raise ValueError(f"Engine.Config.weight_layout={layout!r} needs mesh_shape=None (one "
                         f"device), got mesh_shape={mesh_shape}")


def _transposable(w: Any, only_16bit: bool) -> bool:
    if not jnp.issubdtype(w.dtype, jnp.floating):
        return False
    return not only_16bit or jnp.dtype(w.dtype).itemsize == 2


def apply_weight_layout(model_cfg: Any, params: Any, layout: str, *,
                        mesh_shape: Any = None) -> tuple[Any, Any]:
    """(config, params) with the plain Linear weights stored as `layout` says (see module
    docstring); `Int8Linear`s (`quantize`) are left as they are."""
    check_weight_layout(layout, mesh_shape)
    if layout == "packed":
        raise ValueError("apply_weight_layout: 'packed' weights are stored by store_weights")
    if layout == "in_out":
        return model_cfg, params
    if layout == "auto" and (mesh_shape is not None or jax.default_backend() != "cpu"):
        return model_cfg, params
    linears = plain_linears(model_cfg.instantiate(), params)
    if not linears or not all(_transposable(p["weight"], layout == "auto") for _, p in linears):
        return model_cfg, params

    def fn(w: Any, in_dims: int, lead: int) -> dict[str, Any]:
        return {"weight_t": transpose_weight(w, in_dims, lead=lead).t}

    return swap_linears(model_cfg, params, TransposedLinear, fn)


def packed_layout_chosen(model_cfg: Any, params: Any, layout: str, *,
                         mesh_shape: Any = None, quantize: Optional[str] = None) -> bool:
    """Whether `layout` means packed weights here (module docstring), for weights served
    as `quantize` says. "packed" where the kernel cannot run, or on weights it cannot
    pack, is a ValueError saying why."""
    check_weight_layout(layout, mesh_shape)
    check_quantize(quantize)
    if layout not in ("auto", "packed"):
        return False
    cpu = mesh_shape is None and jax.default_backend() == "cpu"
    if quantize == "int8":  # Float Linears quantized and packed as int8.
        if layout == "auto" and not (cpu and host_has_int8()):
            return False
        if not plain_linears(model_cfg.instantiate(), params):
            return False
        if (why := unavailable_reason()) is not None:
            if layout == "packed":
                raise ValueError(f"Engine.Config.weight_layout='packed': the packed GEMM "
                                 f"cannot run here: {why}")
            log.warning("weight_layout='auto': int8 weights on XLA's int8 dot (slower): %s", why)
            return False
        return True
    if layout == "auto" and not cpu:
        return False
    linears = plain_linears(model_cfg.instantiate(), params, lora=True)
    dtypes = {jnp.dtype(p["weight"].dtype) for _, p in linears}
    if layout == "auto":  # Weights and compute of one dtype (x is cast to the weights').
        bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
        computes = {f32 if m.dtype is None else jnp.dtype(m.dtype) for m, _ in linears}
        if not linears or len(dtypes) != 1 or computes != dtypes:
            return False
        if dtypes == {bf16}:
            if not host_has_bf16():
                return False
            if (why := unavailable_reason()) is not None:
                log.warning("weight_layout='auto': not packing the bf16 weights (XLA's "
                            "slower bf16 dot instead): %s", why)
                return False
            return True
        return dtypes == {f32} and host_packs_float32()
    if (why := unavailable_reason()) is not None:
        raise ValueError(f"Engine.Config.weight_layout='packed': the packed GEMM cannot run "
                         f"here: {why}")
    if len(dtypes) != 1 or not dtypes <= {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}:
        raise ValueError(f"Engine.Config.weight_layout='packed' needs float32 or bfloat16 "
                         f"Linear weights (one dtype), got "
                         f"{sorted(str(d) for d in dtypes) or 'none'}")
    return True


def _matrices(w: Any, in_dims: int, lead: int) -> np.ndarray:
    """w [*lead, *in, *out] on the host as [*lead, K, N]."""
    shape = w.shape
    k = int(np.prod(shape[lead:lead + in_dims]))
    n = int(np.prod(shape[lead + in_dims:]))
    return np.asarray(jax.device_get(w)).reshape(*shape[:lead], k, n)


def pack_weights(model_cfg: Any, params: Any, *, int8: bool = False
                 ) -> tuple[Any, Any, PackedWeights]:
    """(config with every plain Linear a `PackedLinear`, params with each weight replaced
    by its packed copy's id, the owner of the copies). `int8`: the float weights are
    quantized (`kernels.quantize_int8`, per output channel) and packed as int8, the
    plain Linears only (LoRA projections are left as they are)."""
    owner = PackedWeights()

    def fn(w: Any, in_dims: int, lead: int) -> dict[str, Any]:
        if not int8:
            return {"weight_id": owner.pack_stack(_matrices(w, in_dims, lead), lead)}
        q = int8_weight(w, in_dims, lead)
        scale = np.asarray(q.scale).reshape(*w.shape[:lead], -1)  # [*lead, N]
        return {"weight_id": owner.pack_stack(_matrices(q.q, in_dims, lead), lead, scale)}

    linears = plain_linears(model_cfg.instantiate(), params, lora=not int8)
    dtype = "int8" if int8 else {str(jnp.dtype(p["weight"].dtype)) for _, p in linears}.pop()
    new_cfg, new_params = swap_linears(model_cfg, params, PackedLinear, fn,
                                       lora_variant=None if int8 else PackedLoraLinear)
    new_cfg = replace_config(
        new_cfg, lambda path, c: "klass" in c and c.klass in (PackedLinear, PackedLoraLinear),
        lambda old, path: old.clone(weight_dtype=dtype))
    if tied_head(model_cfg):  # Its transpose packed too.
        table = new_params["decoder"]["emb"]["weight"]
        if int8:  # Per-row scales: the lookup's and, on the transpose, the head's columns.
            t8 = quantize_int8(table, (1,))
            head_id = owner.pack(np.asarray(t8.q).T, scale=np.asarray(t8.scale)[:, 0])
            table = t8
        elif jnp.dtype(table.dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            head_id = owner.pack(np.asarray(jax.device_get(table)).T)
        else:
            return new_cfg, new_params, owner
        new_params = dict(new_params, decoder=dict(new_params["decoder"], emb=dict(
            new_params["decoder"]["emb"],
            weight=PackedTable(table, np.asarray(head_id, np.int32)))))
    return new_cfg, new_params, owner


def store_weights(model_cfg: Any, params: Any, layout: str, *, mesh_shape: Any = None,
                  quantize_mode: Optional[str] = None, chosen: Optional[bool] = None
                  ) -> tuple[Any, Any, Optional[PackedWeights]]:
    """(config, params, owner of packed copies or None) served as `quantize_mode`
    (`Engine.Config.quantize`) and stored as `layout` say here. `chosen`: what
    `packed_layout_chosen` answered for these arguments, if the caller asked already."""
    if chosen is None:
        chosen = packed_layout_chosen(model_cfg, params, layout, mesh_shape=mesh_shape,
                                      quantize=quantize_mode)
    if chosen:
        cfg, packed, owner = pack_weights(model_cfg, params, int8=quantize_mode == "int8")
        log.info("weights packed for the %s GEMM (%s): %.1f MB (%.1f MB of address space "
                 "reserved)", "/".join(sorted(owner.backends)), quantize_mode or "float",
                 owner.nbytes / 2**20, owner.reserved_bytes / 2**20)
        return cfg, packed, owner
    if quantize_mode is not None:  # Int8Linear configs, int8 params.
        model_cfg, params = quantize(model_cfg, params, quantize_mode)
    return (*apply_weight_layout(model_cfg, params, layout, mesh_shape=mesh_shape), None)


def host_packs_float32() -> bool:
    """Whether "auto" packs float32 weights here: where the packed GEMM builds and takes
    them on the library's AVX-512 f32 panels (`kernels.mkl.backend_for`: non-Intel x86
    CPUs with AVX512F; 1.4-1.7x a 60M Llama's f32 decode step on Zen 4, module doc)."""
    return unavailable_reason() is None and backend_for("float32") == "avx512"


def serving_stack(layout: str, *, dtype: Optional[str], param_dtype: Optional[str],
                  mesh_shape: Any = None, quantize: Optional[str] = None) -> str:
    """The layer stack ("scan" or "loop") to load an HF / GGUF model as, for an engine
    storing its weights as `layout` with these compute / weight dtypes. A scanned stack
    compiles one layer body (2-3x faster warm-up) but slices every layer's weights out of
    the stacked arrays on each decode step, which XLA:CPU copies before a dot: "loop",
    unless the weights will be packed (`packed_layout_chosen`), whose ids are what the
    scan slices: then "scan" (SmolLM2-135M bf16, 8 requests in flight: 140 tok/s in
    process either way, first pass 39 s vs 89 s). With `quantize="int8"` the same on a
    host where "auto" packs int8 weights."""
    if layout == "packed":
        return "scan"
    if layout != "auto" or mesh_shape is not None or jax.default_backend() != "cpu":
        return "loop"
    if quantize == "int8":
        return "scan" if host_has_int8() and unavailable_reason() is None else "loop"
    weights = param_dtype or "float32"
    if (dtype or weights) != weights:
        return "loop"
    if weights == "bfloat16":
        return "scan" if host_has_bf16() and unavailable_reason() is None else "loop"
    return "scan" if weights == "float32" and host_packs_float32() else "loop"
