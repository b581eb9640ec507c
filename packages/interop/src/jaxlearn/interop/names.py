"""The name table: every tensor of each supported architecture family listed once, with its
jaxlearn parameter path, HF name, GGUF name and the transform between the layouts.
Import (HF safetensors, GGUF) and export (HF, GGUF tensor dicts) all iterate these rows.

A `Row` is one jaxlearn parameter. Its `path` is a template over the model's params
(`decoder.transformer.layer{i}.self_attention.q_proj`; a scanned stack holds the same
tensor at `decoder.transformer.layer.self_attention.q_proj[i]`), `shape` its jaxlearn
shape, and `hf` / `gguf` the file tensors that hold it, each a `Name`:

    Name("model.layers.{i}.self_attn.q_proj.weight", "H*D E", transpose=True)

reads: the file tensor has shape [H*D, E] (HF `nn.Linear` [out, in]); swap the last two
axes and reshape to the jaxlearn shape [E, H, D]. Export runs the same steps backwards.
Shapes use the symbols of `dims` (E embed, H heads, K kv heads, D head dim, F ffn hidden,
X experts, V vocab); `{j}` in a template is one tensor per expert, stacked on a leading
axis in jaxlearn; `permute` ("H"/"K") marks q/k rows that llama.cpp permutes per head for
its interleaved RoPE (undone for families whose GGUF layout permutes); `part=(p, n)`
means the file tensor holds n equal row blocks (axis -2) and this parameter is block p.
A row may list several names for a format: export writes the first, import reads
whichever the file holds. `when` names the architecture feature the row needs.

`FUSIONS` are jaxlearn-side fused parameters (configs with `fused_qkv` / `fused_gate`):
import concatenates the unfused rows into them, export splits them back.

Adding a family = a `Family` entry with its rows (plus reading its hyperparameters).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional, Protocol, Sequence

import numpy as np

from jaxlearn.interop.errors import ParameterMismatchError, UnsupportedModelError

Nested = dict
FORMATS = ("hf", "gguf")
# File tensors that carry no parameters (buffers some exporters write), by name suffix.
IGNORED = {"hf": (".rotary_emb.inv_freq",), "gguf": ("rope_freqs.weight",)}
_LAYER = "decoder.transformer.layer{i}."


@dataclasses.dataclass(frozen=True)
class Name:
    """One tensor in a file format and the transform to the jaxlearn array (see module)."""

    template: str
    shape: str
    transpose: bool = False
    permute: Optional[str] = None
    part: Optional[tuple[int, int]] = None

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
        return _key(self.path)

    def names(self, fmt: str) -> tuple[Name, ...]:
        return self.hf if fmt == "hf" else self.gguf


@dataclasses.dataclass(frozen=True)
class Fusion:
    """`path` holds the `parts` (unfused row paths) concatenated on `axis`, in models whose
    layer config sets `when` (`fused_qkv` / `fused_gate`)."""

    path: str
    parts: tuple[str, ...]
    axis: int
    when: str


@dataclasses.dataclass(frozen=True)
class Family:
    """An architecture family: HF class, GGUF `general.architecture`, whether llama.cpp
    permutes its q/k rows, and its rows."""

    name: str
    hf_class: str
    gguf_arch: str
    gguf_permutes_qk: bool
    rows: tuple[Row, ...]


def _key(path: str) -> str:
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
    _layer("self_attention.q_proj", "E H D",
           _hf("self_attn.q_proj.weight", "H*D E", T),
           _gg("attn_q.weight", "H*D E", T, "H")),
    _layer("self_attention.k_proj", "E K D",
           _hf("self_attn.k_proj.weight", "K*D E", T),
           _gg("attn_k.weight", "K*D E", T, "K")),
    _layer("self_attention.v_proj", "E K D",
           _hf("self_attn.v_proj.weight", "K*D E", T),
           _gg("attn_v.weight", "K*D E", T)),
    _layer("self_attention.o_proj", "H D E",
           _hf("self_attn.o_proj.weight", "E H*D", T),
           _gg("attn_output.weight", "E H*D", T)),
    _layer("self_attention.q_bias", "H D",
           _hf("self_attn.q_proj.bias", "H*D"),
           _gg("attn_q.bias", "H*D", permute="H"), "qkv_bias"),
    _layer("self_attention.k_bias", "K D",
           _hf("self_attn.k_proj.bias", "K*D"),
           _gg("attn_k.bias", "K*D", permute="K"), "qkv_bias"),
    _layer("self_attention.v_bias", "K D",
           _hf("self_attn.v_proj.bias", "K*D"),
           _gg("attn_v.bias", "K*D"), "qkv_bias"),
    _layer("self_attention.o_bias", "E",
           _hf("self_attn.o_proj.bias", "E"),
           _gg("attn_output.bias", "E"), "output_bias"),
    _layer("ffn_norm.scale", "E",
           _hf("post_attention_layernorm.weight", "E"),
           _gg("ffn_norm.weight", "E")),
)  # fmt: skip
DENSE_FFN_ROWS = (
    _layer("feed_forward.wi_0", "E F", _hf("mlp.gate_proj.weight", "F E", T),
           _gg("ffn_gate.weight", "F E", T)),
    _layer("feed_forward.wi_1", "E F", _hf("mlp.up_proj.weight", "F E", T),
           _gg("ffn_up.weight", "F E", T)),
    _layer("feed_forward.wo", "F E", _hf("mlp.down_proj.weight", "E F", T),
           _gg("ffn_down.weight", "E F", T)),
    _layer("feed_forward.wi_0_bias", "F", _hf("mlp.gate_proj.bias", "F"),
           _gg("ffn_gate.bias", "F"), "mlp_bias"),
    _layer("feed_forward.wi_1_bias", "F", _hf("mlp.up_proj.bias", "F"),
           _gg("ffn_up.bias", "F"), "mlp_bias"),
    _layer("feed_forward.wo_bias", "E", _hf("mlp.down_proj.bias", "E"),
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


def _fusion(fused: str, parts: Sequence[str], axis: int, when: str) -> Fusion:
    return Fusion(_LAYER + fused, tuple(_LAYER + p for p in parts), axis, when)


FUSIONS = (
    _fusion("self_attention.qkv_proj",
            [f"self_attention.{n}_proj" for n in "qkv"], -2, "fused_qkv"),
    _fusion("self_attention.qkv_bias",
            [f"self_attention.{n}_bias" for n in "qkv"], -2, "fused_qkv"),
    _fusion("feed_forward.wi_fused",
            ["feed_forward.wi_0", "feed_forward.wi_1"], -1, "fused_gate"),
    _fusion("feed_forward.wi_fused_bias",
            ["feed_forward.wi_0_bias", "feed_forward.wi_1_bias"], -1, "fused_gate"),
)  # fmt: skip
_DENSE = TOP_ROWS + ATTENTION_ROWS + DENSE_FFN_ROWS
_MOE = TOP_ROWS + ATTENTION_ROWS + MOE_FFN_ROWS
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama", True, _DENSE),
        Family("mistral", "MistralForCausalLM", "llama", True, _DENSE),
        Family("qwen2", "Qwen2ForCausalLM", "qwen2", False, _DENSE),
        Family("mixtral", "MixtralForCausalLM", "llama", True, _MOE),
    )
}


# ---- shapes and features --------------------------------------------------------------------


def dims(arch: object) -> dict[str, int]:
    """The shape symbols of `arch` (an `Architecture`)."""
    a: Any = arch
    return {
        "E": a.dim,
        "H": a.num_heads,
        "K": a.num_kv_heads,
        "D": a.head_dim,
        "F": a.ffn_dim,
        "X": a.num_experts,
        "V": a.vocab_size,
    }


def shape_of(spec: str, d: dict[str, int]) -> tuple[int, ...]:
    """"H*D E" -> (heads * head_dim, embed) with the symbols of `d`."""
    out = []
    for term in spec.split():
        n = 1
        for factor in term.split("*"):
            n *= int(factor) if factor.isdigit() else d[factor]
        out.append(n)
    return tuple(out)


def features(arch: object) -> frozenset[str]:
    """The `Row.when` features that `arch` has."""
    a: Any = arch
    on = {
        "untied": not a.tie_embeddings,
        "qkv_bias": a.qkv_bias,
        "output_bias": a.output_bias,
        "mlp_bias": a.mlp_bias,
    }
    return frozenset(k for k, v in on.items() if v)


def family(arch: object) -> Family:
    name = getattr(arch, "family")
    if name not in FAMILIES:
        raise UnsupportedModelError(f"architecture family {name!r} has no name table")
    return FAMILIES[name]


# ---- q/k permutation of llama.cpp -----------------------------------------------------------


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's `permute(w, n_head)` of q/k rows (weights [out, in] or biases
    [out]): per head, rows (0, 2, 4, ..., 1, 3, ...) -> rotate-half order."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (the inverse of `unpermute_qk`) of q/k rows."""
    rest = w.shape[1:]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


# ---- resolving rows against a file ----------------------------------------------------------


class Source(Protocol):
    """Tensors of a checkpoint by name (safetensors directory, GGUF file, a dict)."""

    def names(self) -> Iterable[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class Use:
    """One row at one layer (None: top level), with the `Name` chosen and its tensors."""

    row: Row
    layer: Optional[int]
    name: Name
    files: tuple[str, ...]


def _expand(name: Name, layer: Optional[int], experts: int) -> tuple[str, ...]:
    if name.per_expert:
        return tuple(name.template.format(i=layer, j=j) for j in range(experts))
    return (name.template.format(i=layer),)


def plan(
    arch: object, fmt: str, *, available: Optional[set[str]] = None, alternative: int = 0
) -> list[Use]:
    """The tensors of `arch` in format `fmt`, top rows first, then layer by layer. With
    `available` (the names a file holds), each row takes the first of its names the file
    has (else its first, which is then reported missing); otherwise name `alternative`
    (clipped to the row's last)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    fam, on, a = family(arch), features(arch), getattr(arch, "num_layers")
    experts = int(getattr(arch, "num_experts"))
    rows = [r for r in fam.rows if not r.when or r.when in on]
    out = []
    for layer in [None, *range(a)]:
        for row in rows:
            if row.per_layer != (layer is not None):
                continue
            options = row.names(fmt)
            if not options:
                raise UnsupportedModelError(f"{fam.name}: {row.path} has no {fmt} tensor")
            name = options[min(alternative, len(options) - 1)]
            if available is not None:
                name = next(
                    (n for n in options if _expand(n, layer, experts)[0] in available), options[0]
                )
            out.append(Use(row, layer, name, _expand(name, layer, experts)))
    return out


def file_shape(use: Use, d: dict[str, int]) -> tuple[int, ...]:
    """The shape of each of `use.files` in the file."""
    return shape_of(use.name.shape, d)


def _spare_names(arch: object, fmt: str) -> set[str]:
    fam, on = family(arch), features(arch)
    spare = [r for r in fam.rows if r.spare and r.when and r.when not in on]
    return {n.template for r in spare for n in r.names(fmt)}


def check_source(uses: Sequence[Use], arch: object, fmt: str, source: Source, where: str) -> None:
    """Raises ParameterMismatchError listing every missing, unexpected and mis-shaped
    tensor of `source` (names and shapes only: nothing is read)."""
    d = dims(arch)
    available = set(source.names())
    missing: list[str] = []
    mismatched: list[str] = []
    used: set[str] = set()
    for use in uses:
        expected = file_shape(use, d)
        for n in use.files:
            if n in used:
                continue  # one fused tensor serves several rows
            used.add(n)
            if n not in available:
                missing.append(f"{n} {expected}")
            elif (got := tuple(source.shape(n))) != expected:
                mismatched.append(f"{n}: got {got}, expected {expected}")
    skip = used | _spare_names(arch, fmt)
    unexpected = sorted(n for n in available if n not in skip and not n.endswith(IGNORED[fmt]))
    if missing or mismatched or unexpected:
        raise ParameterMismatchError(
            where, missing=missing, unexpected=unexpected, mismatched=mismatched
        )


# ---- transforms -----------------------------------------------------------------------------


def to_jaxlearn(
    use: Use, arrays: Sequence[np.ndarray], d: dict[str, int], permuted: bool
) -> np.ndarray:
    """File tensors of `use` -> the jaxlearn array (float32, shape `use.row.shape`)."""
    name = use.name
    x = np.stack(arrays) if name.per_expert else arrays[0]
    x = np.asarray(x).astype(np.float32, copy=False)
    if name.part is not None:
        p, n = name.part
        rows = x.shape[-2] // n
        x = x[..., p * rows : (p + 1) * rows, :]
    if permuted and name.permute:
        x = unpermute_qk(x, d[name.permute])
    if name.transpose:
        x = np.swapaxes(x, -1, -2)
    return x.reshape(shape_of(use.row.shape, d))


def to_file(use: Use, value: np.ndarray, d: dict[str, int], permuted: bool) -> list[np.ndarray]:
    """The jaxlearn array of `use` -> its file tensors (one per expert for `{j}` names;
    for `part` names, the block that `join_parts` concatenates)."""
    name = use.name
    shape = list(file_shape(use, d))
    if name.per_expert:
        shape.insert(0, d["X"])
    if name.part is not None:
        shape[-2] //= name.part[1]
    if name.transpose:
        shape[-2:] = shape[-1], shape[-2]
    x = np.asarray(value).reshape(shape)
    if name.transpose:
        x = np.swapaxes(x, -1, -2)
    if permuted and name.permute:
        x = permute_qk(x, d[name.permute])
    return list(x) if name.per_expert else [x]


# ---- canonical trees ------------------------------------------------------------------------


def get_path(tree: Nested, key: str) -> np.ndarray:
    for part in key.split("."):
        tree = tree[part]
    return tree  # type: ignore[return-value]


def has_path(tree: Nested, key: str) -> bool:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def put_path(tree: Nested, key: str, value: np.ndarray) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def pop_path(tree: Nested, key: str) -> np.ndarray:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree[part]
    return tree.pop(last)


def fuse(layer: Nested, layout: frozenset[str]) -> None:
    """In place: the unfused parts of every fusion in `layout` -> the fused parameter."""
    for f in FUSIONS:
        parts = [_key(p) for p in f.parts]
        if f.when in layout and all(has_path(layer, p) for p in parts):
            joined = np.concatenate([pop_path(layer, p) for p in parts], axis=f.axis)
            put_path(layer, _key(f.path), joined)


def unfuse(layer: Nested, d: dict[str, int]) -> None:
    """In place: every fused parameter in `layer` -> its unfused parts."""
    shapes = {r.path: r.shape for fam in FAMILIES.values() for r in fam.rows}
    for f in FUSIONS:
        if has_path(layer, _key(f.path)):
            value = pop_path(layer, _key(f.path))
            sizes = [shape_of(shapes[p], d)[f.axis] for p in f.parts]
            pieces = np.split(value, np.cumsum(sizes)[:-1], axis=f.axis)
            for p, piece in zip(f.parts, pieces):
                put_path(layer, _key(p), piece)


# ---- import and export ----------------------------------------------------------------------


def read_tensors(
    arch: object,
    fmt: str,
    source: Source,
    *,
    where: str,
    layouts: Sequence[frozenset[str]] = (),
    stacked: bool = False,
) -> tuple[Nested, list[Nested], dict[str, str]]:
    """`source`'s tensors -> canonical (top, layers) in the jaxlearn layout (float32), and
    {jaxlearn param path: file tensor name} for error messages.

    Every name and shape is checked first (ParameterMismatchError listing every problem,
    before any tensor is read). layouts[i]: the fusions layer i's config asks for
    (`fused_qkv`, `fused_gate`); stacked: paths for a scanned stack.
    """
    uses = plan(arch, fmt, available=set(source.names()))
    check_source(uses, arch, fmt, source, where)
    d, permuted = dims(arch), fmt == "gguf" and family(arch).gguf_permutes_qk
    top: Nested = {}
    layers: list[Nested] = [{} for _ in range(getattr(arch, "num_layers"))]
    names: dict[str, str] = {}
    cache: dict[str, np.ndarray] = {}  # fused file tensors, read once for all their rows
    for use in uses:
        arrays = []
        for n in use.files:
            x = cache.get(n)
            if x is None:
                x = source.read(n)
                if use.name.part is not None:
                    cache[n] = x
            arrays.append(x)
        tree = top if use.layer is None else layers[use.layer]
        put_path(tree, use.row.key, to_jaxlearn(use, arrays, d, permuted))
        names[param_path(use.row, use.layer, stacked)] = (
            use.name.template.replace("{i}", "*") if stacked else use.files[0]
        )
    for layer, layout in zip(layers, layouts):
        fuse(layer, layout)
    return top, layers, names


def param_path(row: Row, layer: Optional[int], stacked: bool) -> str:
    """The jaxlearn param path of `row` at `layer` (scanned stacks: the stacked leaf)."""
    if layer is None:
        return row.path
    return row.path.replace("layer{i}", "layer" if stacked else f"layer{layer}")


def write_tensors(
    arch: object, fmt: str, top: Nested, layers: Sequence[Nested], *, alternative: int = 0
) -> dict[str, np.ndarray]:
    """Canonical (top, layers) -> {file tensor name: array in the file layout}. Fused
    parameters are split first; `alternative` picks a row's other names (see `plan`)."""
    d, permuted = dims(arch), fmt == "gguf" and family(arch).gguf_permutes_qk
    unfused = []
    for layer in layers:
        layer = copy_dicts(layer)
        unfuse(layer, d)
        unfused.append(layer)
    out: dict[str, np.ndarray] = {}
    blocks: dict[str, dict[int, np.ndarray]] = {}
    for use in plan(arch, fmt, alternative=alternative):
        tree = top if use.layer is None else unfused[use.layer]
        if not has_path(tree, use.row.key):
            raise ParameterMismatchError("params", missing=[param_path(use.row, use.layer, False)])
        pieces = to_file(use, get_path(tree, use.row.key), d, permuted)
        if use.name.part is not None:
            blocks.setdefault(use.files[0], {})[use.name.part[0]] = pieces[0]
            continue
        out.update(zip(use.files, pieces))
    for n, parts in blocks.items():
        out[n] = np.concatenate([parts[p] for p in sorted(parts)], axis=-2)
    return out


def copy_dicts(tree: Nested) -> Nested:
    """A copy of the dict structure of `tree` (leaves shared)."""
    return {k: copy_dicts(v) if isinstance(v, dict) else v for k, v in tree.items()}
