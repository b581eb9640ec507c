"""The stored layout of the weights an `Engine` serves (`Engine.Config.weight_layout`).

A trained dense weight is `[*in, *out]`. On XLA:CPU a bf16 dot with few rows (decode)
reads the same weight 1.0-1.5x faster stored `[out, in]`; f32 dots are faster `[in, out]`
(`jaxlearn.kernels.weight_layout`). So:

- "auto" (default): on one CPU device, when every plain `Linear` weight is a 16-bit
  float, they are all stored `[out, in]`; f32 weights, int8 weights (`quantize`) and any
  other backend or a mesh keep the trained layout;
- "out_in": every plain float Linear weight stored `[out, in]` (one device only);
- "in_out": the trained layout;
- "packed": every plain float Linear weight packed once for oneMKL's GEMM
  (`kernels.packed_gemm`: bf16 on AMX / AVX512_BF16, f32 on any x86-64), one CPU device;
  a `LoraLinear`'s base weight too (a `PackedLoraLinear`, its adapter unpacked).
  Activations are cast to the weights' dtype. "auto" chooses it first when every plain
  Linear weight and compute dtype is bfloat16, the host has native bf16 dot
  instructions and the kernel builds here (`unavailable_reason`): a decode step's
  matmuls then run 1.1-1.9x faster than XLA's bf16 dot at 8-32 rows and 3-19x at one
  row (XLA repacks the weight on every call).

Stored `[out, in]` means a config swap: every plain Linear (`quantize.is_plain_linear`:
the LM head and the attention / FFN projections) becomes a `layers.TransposedLinear`
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
from jaxlearn.inference.quantize import plain_linears, swap_linears, tied_head
from jaxlearn.kernels import PackedTable, PackedWeights, transpose_weight
from jaxlearn.kernels.packed_gemm import host_has_bf16, unavailable_reason
from jaxlearn.layers import LoraAdapter, PackedLinear, TransposedLinear
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
                         mesh_shape: Any = None) -> bool:
    """Whether `layout` means packed weights here (module docstring). "packed" where the
    kernel cannot run, or on weights it cannot pack, is a ValueError saying why."""
    check_weight_layout(layout, mesh_shape)
    if layout not in ("auto", "packed"):
        return False
    if layout == "auto" and (mesh_shape is not None or jax.default_backend() != "cpu"
                             or not host_has_bf16()):
        return False
    linears = plain_linears(model_cfg.instantiate(), params, lora=True)
    dtypes = {jnp.dtype(p["weight"].dtype) for _, p in linears}
    if layout == "auto":  # bf16 weights and compute (x is cast to the weights' dtype).
        bf16 = {jnp.dtype(jnp.bfloat16)}
        if not (linears and dtypes == bf16 and {m.dtype for m, _ in linears} == bf16):
            return False
        if (why := unavailable_reason()) is not None:
            log.warning("weight_layout='auto': not packing the bf16 weights (XLA's slower "
                        "bf16 dot instead): %s", why)
            return False
        return True
    if (why := unavailable_reason()) is not None:
        raise ValueError(f"Engine.Config.weight_layout='packed': the packed GEMM cannot run "
                         f"here: {why}")
    if len(dtypes) != 1 or not dtypes <= {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}:
        raise ValueError(f"Engine.Config.weight_layout='packed' needs float32 or bfloat16 "
                         f"Linear weights (one dtype), got "
                         f"{sorted(str(d) for d in dtypes) or 'none'}")
    return True


def pack_weights(model_cfg: Any, params: Any) -> tuple[Any, Any, PackedWeights]:
    """(config with every plain Linear a `PackedLinear`, params with each weight replaced
    by its packed copy's id, the owner of the copies)."""
    owner = PackedWeights()

    def fn(w: Any, in_dims: int, lead: int) -> dict[str, Any]:
        shape = w.shape
        k = int(np.prod(shape[lead:lead + in_dims]))
        n = int(np.prod(shape[lead + in_dims:]))
        mats = np.asarray(jax.device_get(w)).reshape(*shape[:lead], k, n)
        return {"weight_id": owner.pack_stack(mats, lead)}

    dtype = {str(jnp.dtype(p["weight"].dtype)) for _, p in
             plain_linears(model_cfg.instantiate(), params, lora=True)}.pop()
    new_cfg, new_params = swap_linears(model_cfg, params, PackedLinear, fn,
                                       lora_variant=PackedLoraLinear)
    new_cfg = replace_config(
        new_cfg, lambda path, c: "klass" in c and c.klass in (PackedLinear, PackedLoraLinear),
        lambda old, path: old.clone(weight_dtype=dtype))
    if tied_head(model_cfg):  # Its transpose packed too.
        table = new_params["decoder"]["emb"]["weight"]
        if jnp.dtype(table.dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            head_id = owner.pack(np.asarray(jax.device_get(table)).T)
            new_params = dict(new_params, decoder=dict(new_params["decoder"], emb=dict(
                new_params["decoder"]["emb"],
                weight=PackedTable(table, np.asarray(head_id, np.int32)))))
    return new_cfg, new_params, owner


def store_weights(model_cfg: Any, params: Any, layout: str, *, mesh_shape: Any = None
                  ) -> tuple[Any, Any, Optional[PackedWeights]]:
    """(config, params, owner of packed copies or None) stored as `layout` says here."""
    if packed_layout_chosen(model_cfg, params, layout, mesh_shape=mesh_shape):
        cfg, packed, owner = pack_weights(model_cfg, params)
        log.info("weights packed for oneMKL's GEMM: %.1f MB (%.1f MB of address space "
                 "reserved)", owner.nbytes / 2**20, owner.reserved_bytes / 2**20)
        return cfg, packed, owner
    return (*apply_weight_layout(model_cfg, params, layout, mesh_shape=mesh_shape), None)


def serving_stack(layout: str, *, dtype: Optional[str], param_dtype: Optional[str],
                  mesh_shape: Any = None) -> str:
    """The layer stack ("scan" or "loop") to load an HF / GGUF model as, for an engine
    storing its weights as `layout` with these compute / weight dtypes. A scanned stack
    compiles one layer body (2-3x faster warm-up) but slices every layer's weights out of
    the stacked arrays on each decode step, which XLA:CPU copies before a dot: "loop",
    unless the weights will be packed (`packed_layout_chosen`), whose ids are what the
    scan slices: then "scan" (SmolLM2-135M bf16, 8 requests in flight: 140 tok/s in
    process either way, first pass 39 s vs 89 s)."""
    if layout == "packed":
        return "scan"
    if (layout != "auto" or mesh_shape is not None or jax.default_backend() != "cpu"
            or not host_has_bf16()):
        return "loop"
    bf16 = "bfloat16"
    if param_dtype != bf16 or (dtype or param_dtype) != bf16:
        return "loop"
    return "scan" if unavailable_reason() is None else "loop"
