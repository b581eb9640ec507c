"""The name table: every tensor of each supported architecture family listed once, with its
jaxlearn parameter path, HF name, GGUF name and the transform between the layouts.
Import (HF safetensors, GGUF) and export (HF, GGUF tensor dicts) all iterate these rows.

A `Row` is one jaxlearn parameter. Its `path` is a template over the model's params
(`decoder.transformer.layer{i}.self_attention.q_proj.weight`; a scanned stack holds the
same tensor at `decoder.transformer.layer.self_attention.q_proj.weight[i]`), `shape` its jaxlearn
shape, and `hf` / `gguf` the file tensors that hold it, each a `Name`:

    Name("model.layers.{i}.self_attn.q_proj.weight", "H*D E", transpose=True)

reads: the file tensor has shape [H*D, E] (HF `nn.Linear` [out, in]); swap the last two
axes and reshape to the jaxlearn shape [E, H, D]. Export runs the same steps backwards.
Shapes use the symbols of `dims` (E embed, H heads, K kv heads, D head dim, F ffn hidden
(of each expert in MoE models), G ffn hidden of the dense layers of an MoE model, X
experts, V vocab); `{j}` in a template is one tensor per expert, stacked on a leading
axis in jaxlearn; `permute` ("H"/"K") marks q/k rows that llama.cpp permutes per head for
its interleaved RoPE (undone for families whose GGUF layout permutes); `part=(p, n)`
means the file tensor holds n equal row blocks (axis -2) and this parameter is block p,
`part=(p, ("H*D", "K*D", "K*D"))` blocks of those sizes (Phi-3's fused q/k/v);
`shift` is added on export and subtracted on import (llama.cpp's Gemma norms hold the
`1 + scale` that Gemma's RMSNorm multiplies by, not `scale`).
A row may list several names for a format: export writes the first, import reads
whichever the file holds. `when` names the architecture feature the row needs (per layer
for `sparse` / `dense_ffn`: the MoE and dense FFN layers of a Qwen3-MoE model).

`FUSIONS` are jaxlearn-side fused parameters (layer configs whose attention has a
`qkv_proj` child, feature `fused_qkv`, or whose FFN has a `wi_fused` one, `fused_gate`):
import concatenates the unfused rows into them, export splits them back.

The row groups here are shared; each family module (`llama.py`, `qwen.py`, ...: a
`family.Family`) lists its rows built from them, and `registry.family(arch)` gives the
family of an `Architecture`. `jaxlearn.interop.convert` (and `jaxlearn.interop.sharded`)
applies the table to files and parameter trees.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from jaxlearn.families.arch import Architecture

FORMATS = ("hf", "gguf")
# File tensors that carry no parameters (buffers some exporters write), by name suffix.
IGNORED = {
    "hf": (".rotary_emb.inv_freq",),
    "gguf": ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"),
}
_LAYER = "decoder.transformer.layer{i}."


@dataclasses.dataclass(frozen=True)
class Name:
    """One tensor in a file format and the transform to the jaxlearn array (see module)."""

    template: str
    shape: str
    transpose: bool = False
    permute: Optional[str] = None
    part: Optional[tuple[int, Any]] = None
    shift: float = 0.0

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.template


@dataclasses.dataclass(frozen=True)
class Row:
    """One jaxlearn parameter and the file tensors that hold it.

    when: "" (always) or a feature of `features(arch)`. spare: with the feature off, a
    file may still hold the tensor and it is ignored (HF writes `lm_head.weight` for tied
    models)."""

    path: str
    shape: str
    hf: tuple[Name, ...]
    gguf: tuple[Name, ...] = ()
    when: str = ""
    spare: bool = False

    @property
    def per_layer(self) -> bool:
        return self.path.startswith(_LAYER)

    @property
    def key(self) -> str:
        """The path inside the canonical `top` dict or one `layers[i]` dict."""
        return key_of(self.path)

    def names(self, fmt: str) -> tuple[Name, ...]:
        return self.hf if fmt == "hf" else self.gguf


@dataclasses.dataclass(frozen=True)
class Fusion:
    """`path` holds the `parts` (unfused row paths) concatenated on `axis`, in models whose
    layer config has feature `when` (`fused_qkv` / `fused_gate`, `tree.layer_layouts`)."""

    path: str
    parts: tuple[str, ...]
    axis: int
    when: str


def key_of(path: str) -> str:
    """A row path inside the canonical `top` dict or one `layers[i]` dict."""
    return path[len(_LAYER) :] if path.startswith(_LAYER) else path.removeprefix("decoder.")


def _hf(name: str, shape: str, *transform: Any, **kw: Any) -> Name:
    return Name("model.layers.{i}." + name, shape, *transform, **kw)


def _gg(name: str, shape: str, *transform: Any, **kw: Any) -> Name:
    return Name("blk.{i}." + name, shape, *transform, **kw)


def _layer(path: str, shape: str, hf: Name, gguf: Name, when: str = "") -> Row:
    return Row(_LAYER + path, shape, (hf,), (gguf,), when)


T = True  # transpose: file [..., out, in] <-> jaxlearn [..., in, out]
TOP_ROWS = (
    Row("decoder.emb.weight", "V E",
        (Name("model.embed_tokens.weight", "V E"),), (Name("token_embd.weight", "V E"),)),
    Row("decoder.output_norm.scale", "E",
        (Name("model.norm.weight", "E"),), (Name("output_norm.weight", "E"),)),
    Row("decoder.lm_head.weight", "E V",
        (Name("lm_head.weight", "V E", T),), (Name("output.weight", "V E", T),),
        when="untied", spare=True),
)  # fmt: skip
ATTENTION_ROWS = (
    _layer("attention_norm.scale", "E",
           _hf("input_layernorm.weight", "E"),
           _gg("attn_norm.weight", "E")),
    _layer("self_attention.q_proj.weight", "E H D",
           _hf("self_attn.q_proj.weight", "H*D E", T),
           _gg("attn_q.weight", "H*D E", T, "H")),
    _layer("self_attention.k_proj.weight", "E K D",
           _hf("self_attn.k_proj.weight", "K*D E", T),
           _gg("attn_k.weight", "K*D E", T, "K")),
    _layer("self_attention.v_proj.weight", "E K D",
           _hf("self_attn.v_proj.weight", "K*D E", T),
           _gg("attn_v.weight", "K*D E", T)),
    _layer("self_attention.o_proj.weight", "H D E",
           _hf("self_attn.o_proj.weight", "E H*D", T),
           _gg("attn_output.weight", "E H*D", T)),
    _layer("self_attention.q_proj.bias", "H D",
           _hf("self_attn.q_proj.bias", "H*D"),
           _gg("attn_q.bias", "H*D", permute="H"), "qkv_bias"),
    _layer("self_attention.k_proj.bias", "K D",
           _hf("self_attn.k_proj.bias", "K*D"),
           _gg("attn_k.bias", "K*D", permute="K"), "qkv_bias"),
    _layer("self_attention.v_proj.bias", "K D",
           _hf("self_attn.v_proj.bias", "K*D"),
           _gg("attn_v.bias", "K*D"), "qkv_bias"),
    _layer("self_attention.o_proj.bias", "E",
           _hf("self_attn.o_proj.bias", "E"),
           _gg("attn_output.bias", "E"), "output_bias"),
    _layer("ffn_norm.scale", "E",
           _hf("post_attention_layernorm.weight", "E"),
           _gg("ffn_norm.weight", "E")),
)  # fmt: skip
# Qwen3: per-head RMSNorm scales of q and k (applied before RoPE).
QK_NORM_ROWS = (
    _layer("self_attention.q_norm.scale", "D",
           _hf("self_attn.q_norm.weight", "D"),
           _gg("attn_q_norm.weight", "D")),
    _layer("self_attention.k_norm.scale", "D",
           _hf("self_attn.k_norm.weight", "D"),
           _gg("attn_k_norm.weight", "D")),
)  # fmt: skip
DENSE_FFN_ROWS = (
    _layer("feed_forward.wi_0.weight", "E F", _hf("mlp.gate_proj.weight", "F E", T),
           _gg("ffn_gate.weight", "F E", T)),
    _layer("feed_forward.wi_1.weight", "E F", _hf("mlp.up_proj.weight", "F E", T),
           _gg("ffn_up.weight", "F E", T)),
    _layer("feed_forward.wo.weight", "F E", _hf("mlp.down_proj.weight", "E F", T),
           _gg("ffn_down.weight", "E F", T)),
    _layer("feed_forward.wi_0.bias", "F", _hf("mlp.gate_proj.bias", "F"),
           _gg("ffn_gate.bias", "F"), "mlp_bias"),
    _layer("feed_forward.wi_1.bias", "F", _hf("mlp.up_proj.bias", "F"),
           _gg("ffn_up.bias", "F"), "mlp_bias"),
    _layer("feed_forward.wo.bias", "E", _hf("mlp.down_proj.bias", "E"),
           _gg("ffn_down.bias", "E"), "mlp_bias"),
)  # fmt: skip
# Mixtral: the hub layout (one tensor per expert) is written; transformers 5's fused
# `mlp.experts.gate_up_proj` / `down_proj` and llama.cpp's older per-expert tensors are read.
MOE_FFN_ROWS = (
    Row(_LAYER + "feed_forward.router", "E X",
        (_hf("block_sparse_moe.gate.weight", "X E", T),
         _hf("mlp.gate.weight", "X E", T)),
        (_gg("ffn_gate_inp.weight", "X E", T),)),
    Row(_LAYER + "feed_forward.wi_0", "X E F",
        (_hf("block_sparse_moe.experts.{j}.w1.weight", "F E", T),
         _hf("mlp.experts.gate_up_proj", "X 2*F E", T, part=(0, 2))),
        (_gg("ffn_gate_exps.weight", "X F E", T),
         _gg("ffn_gate.{j}.weight", "F E", T))),
    Row(_LAYER + "feed_forward.wi_1", "X E F",
        (_hf("block_sparse_moe.experts.{j}.w3.weight", "F E", T),
         _hf("mlp.experts.gate_up_proj", "X 2*F E", T, part=(1, 2))),
        (_gg("ffn_up_exps.weight", "X F E", T),
         _gg("ffn_up.{j}.weight", "F E", T))),
    Row(_LAYER + "feed_forward.wo", "X F E",
        (_hf("block_sparse_moe.experts.{j}.w2.weight", "E F", T),
         _hf("mlp.experts.down_proj", "X E F", T)),
        (_gg("ffn_down_exps.weight", "X E F", T),
         _gg("ffn_down.{j}.weight", "E F", T))),
)  # fmt: skip


# Qwen3-MoE: per-expert SwiGLU tensors named like the dense MLP (hub layout, written), the
# fused transformers-5 layout (read); llama.cpp's `qwen3moe` names are Mixtral's.
_QWEN3_MOE_ROWS = (
    Row(_LAYER + "feed_forward.router", "E X",
        (_hf("mlp.gate.weight", "X E", T),),
        (_gg("ffn_gate_inp.weight", "X E", T),), "sparse"),
    Row(_LAYER + "feed_forward.wi_0", "X E F",
        (_hf("mlp.experts.{j}.gate_proj.weight", "F E", T),
         _hf("mlp.experts.gate_up_proj", "X 2*F E", T, part=(0, 2))),
        (_gg("ffn_gate_exps.weight", "X F E", T),), "sparse"),
    Row(_LAYER + "feed_forward.wi_1", "X E F",
        (_hf("mlp.experts.{j}.up_proj.weight", "F E", T),
         _hf("mlp.experts.gate_up_proj", "X 2*F E", T, part=(1, 2))),
        (_gg("ffn_up_exps.weight", "X F E", T),), "sparse"),
    Row(_LAYER + "feed_forward.wo", "X F E",
        (_hf("mlp.experts.{j}.down_proj.weight", "E F", T),
         _hf("mlp.experts.down_proj", "X E F", T)),
        (_gg("ffn_down_exps.weight", "X E F", T),), "sparse"),
)  # fmt: skip


# Phi-3: q/k/v in one `qkv_proj` (llama.cpp `attn_qkv`), gate and up in one `gate_up_proj`
# (llama.cpp `ffn_up`); llama.cpp's `phi3` does not permute q/k rows.
_QKV = ("H*D", "K*D", "K*D")
PHI3_ROWS = tuple(
    _layer(f"self_attention.{n}_proj.weight", "E H D" if n == "q" else "E K D",
           _hf("self_attn.qkv_proj.weight", "H*D+2*K*D E", T, part=(p, _QKV)),
           _gg("attn_qkv.weight", "H*D+2*K*D E", T, part=(p, _QKV)))
    for p, n in enumerate("qkv")
) + tuple(
    _layer(f"feed_forward.wi_{p}.weight", "E F",
           _hf("mlp.gate_up_proj.weight", "2*F E", T, part=(p, 2)),
           _gg("ffn_up.weight", "2*F E", T, part=(p, 2)))
    for p in range(2)
)  # fmt: skip


def _dense_rows_of_moe_model(rows: Sequence[Row]) -> tuple[Row, ...]:
    """The bias-free dense FFN rows for the dense layers of an MoE model: width G, feature
    `dense_ffn`."""

    def g(name: Name) -> Name:
        return dataclasses.replace(name, shape=name.shape.replace("F", "G"))

    return tuple(
        dataclasses.replace(
            r, shape=r.shape.replace("F", "G"), hf=tuple(map(g, r.hf)),
            gguf=tuple(map(g, r.gguf)), when="dense_ffn",
        )
        for r in rows
        if not r.when
    )  # fmt: skip


QWEN3_MOE_FFN_ROWS = _QWEN3_MOE_ROWS + _dense_rows_of_moe_model(DENSE_FFN_ROWS)


def _fusion(fused: str, parts: Sequence[str], axis: int, when: str) -> Fusion:
    return Fusion(_LAYER + fused, tuple(_LAYER + p for p in parts), axis, when)


FUSIONS = (
    _fusion("self_attention.qkv_proj.weight",
            [f"self_attention.{n}_proj.weight" for n in "qkv"], -2, "fused_qkv"),
    _fusion("self_attention.qkv_proj.bias",
            [f"self_attention.{n}_proj.bias" for n in "qkv"], -2, "fused_qkv"),
    _fusion("feed_forward.wi_fused.weight",
            ["feed_forward.wi_0.weight", "feed_forward.wi_1.weight"], -1, "fused_gate"),
    _fusion("feed_forward.wi_fused.bias",
            ["feed_forward.wi_0.bias", "feed_forward.wi_1.bias"], -1, "fused_gate"),
)  # fmt: skip
# Gemma 2/3: four norms per layer (`post_norm`); HF's `post_attention_layernorm` is the
# norm of the attention output, not of the FFN input as in Llama. llama.cpp stores every
# Gemma norm with the 1 of `1 + scale` added (shift 1), and its gemma2 has no `output`.
_GEMMA_NORMS = {
    "ffn_norm.scale": ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    "post_attention_norm.scale": ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    "post_ffn_norm.scale": ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
}


def _gemma(rows: Sequence[Row], *, untied_gguf: bool = True) -> tuple[Row, ...]:
    """`rows` with every norm's GGUF name shifted by 1 (and no GGUF `output` unless
    `untied_gguf`)."""
    out = []
    for r in rows:
        if r.path.endswith("norm.scale"):
            r = dataclasses.replace(r, gguf=tuple(dataclasses.replace(n, shift=1.0)
                                                  for n in r.gguf))  # fmt: skip
        if r.when == "untied" and not untied_gguf:
            r = dataclasses.replace(r, gguf=())
        out.append(r)
    return tuple(out)


_GEMMA_BASE = tuple(
    r for r in TOP_ROWS + ATTENTION_ROWS + DENSE_FFN_ROWS if key_of(r.path) != "ffn_norm.scale"
) + tuple(
    Row(_LAYER + k, "E", (_hf(h, "E"),), (_gg(g, "E"),)) for k, (h, g) in _GEMMA_NORMS.items()
)
GEMMA2_ROWS = _gemma(_GEMMA_BASE, untied_gguf=False)
GEMMA3_ROWS = _gemma(_GEMMA_BASE + QK_NORM_ROWS)
_PHI3 = TOP_ROWS + PHI3_ROWS + tuple(
    r for r in ATTENTION_ROWS + DENSE_FFN_ROWS
    if not r.when and not r.path.endswith(
        ("q_proj.weight", "k_proj.weight", "v_proj.weight", "wi_0.weight", "wi_1.weight"))
)  # fmt: skip
# Phi-3's whole name table (`phi3.py`); the other families compose theirs from the row
# groups above in their own modules.
PHI3_MODEL_ROWS = _PHI3


# ---- shapes and features --------------------------------------------------------------------


def dims(arch: Architecture) -> dict[str, int]:
    """The shape symbols of `arch`."""
    return {
        "E": arch.dim,
        "H": arch.num_heads,
        "K": arch.num_kv_heads,
        "D": arch.head_dim,
        "F": arch.ffn_dim,
        "G": arch.dense_ffn_dim,
        "X": arch.num_experts,
        "V": arch.vocab_size,
    }


def shape_of(spec: str, d: dict[str, int]) -> tuple[int, ...]:
    """"H*D E" -> (heads * head_dim, embed) with the symbols of `d` ("+" adds products)."""
    out = []
    for term in spec.split():
        total = 0
        for product in term.split("+"):
            n = 1
            for factor in product.split("*"):
                n *= int(factor) if factor.isdigit() else d[factor]
            total += n
        out.append(total)
    return tuple(out)


def block(name: Name, rows: int, d: dict[str, int]) -> tuple[int, int]:
    """(first row, row count) on axis -2 of the `part` block of `name` in a file tensor
    of `rows` rows."""
    assert name.part is not None
    p, n = name.part
    if isinstance(n, int):
        return p * (rows // n), rows // n
    sizes = [shape_of(spec, d)[0] for spec in n]
    return sum(sizes[:p]), sizes[p]


def features(arch: Architecture, layer: Optional[int] = None) -> frozenset[str]:
    """The `Row.when` features that `arch` has (at `layer`: also `sparse` for an MoE
    layer, `dense_ffn` for a dense layer of an MoE model)."""
    dense = layer in arch.dense_layers
    on = {
        "untied": not arch.tie_embeddings,
        "qkv_bias": arch.qkv_bias,
        "output_bias": arch.output_bias,
        "mlp_bias": arch.mlp_bias,
        "sparse": arch.is_moe and layer is not None and not dense,
        "dense_ffn": arch.is_moe and dense,
    }
    return frozenset(k for k, v in on.items() if v)

