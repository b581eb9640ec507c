"""Per-slice readers of a pretrained checkpoint's parameters, for loading straight into
sharded arrays: nothing reads or holds the whole model.

    readers = param_readers("model_dir_or_file.gguf", model)   # {param path: SliceReader}
    r = readers["decoder.transformer.layer.self_attention.q_proj.weight"]
    r.shape                                 # the jaxlearn shape, e.g. (L, E, H, D)
    block = r((slice(0, 2), slice(None), slice(4, 8), slice(None)))   # numpy, spec dtype

`r(index)` returns `param[index]` exactly as `load_pretrained(path).params` holds it (same
values, same dtype) but reads only that slice from the file: the name table's transform
(`jaxlearn.families.names`: row block `part`, llama.cpp q/k row permutation, transpose,
reshape; per-expert tensors stacked; fused q/k/v and gate/up concatenated; scanned layers
stacked) is mapped back from the target index to file index ranges.

What one call reads:
- HF safetensors: `safe_open(...).get_slice(name)[file index]` for each contiguous block
  (memory-mapped); the bytes read equal the slice's bytes in the file dtype, whenever the
  slice keeps a head's whole `head_dim` (every mesh rule here does). A slice through
  `head_dim` reads one block per head; of a q/k projection in a permuted GGUF file, the
  whole heads it touches.
- GGUF: F32/F16 tensors like safetensors (memory-mapped rows and columns). Quantised
  tensors hold blocks along a row, so the needed rows are dequantised at full row width
  and then cut: a shard of rows reads its rows, a shard of columns reads every row.
- A tensor whose layout transform cannot be mapped back per axis (none in the name table
  today) is read and transformed whole per call: peak memory one tensor.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
from typing import Any, Optional, Sequence, Union

import numpy as np

from jaxlearn.families.arch import Architecture
from jaxlearn.families.names import FUSIONS, block, dims, key_of, shape_of
from jaxlearn.families.registry import family
from jaxlearn.families.tree import flatten, group_size, layer_layouts, stack_kind
from jaxlearn.interop.convert import Use, check_source, plan, to_jaxlearn, unpermute_qk
from jaxlearn.interop.errors import InteropError, ParameterMismatchError

Index = tuple[tuple[int, int], ...]  # (start, stop) per axis
Node = Union["_Leaf", "_Stack", "_Concat", "_Whole"]


# ---- file access ----------------------------------------------------------------------------


class SafetensorsSlices:
    """`read_slice(name, index)` over the safetensors of an HF model directory."""

    def __init__(self, directory: pathlib.Path):
        from jaxlearn.interop.hf import SafetensorsReader

        self.reader = SafetensorsReader(directory)

    def names(self) -> list[str]:
        return self.reader.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(name)

    def read(self, name: str) -> np.ndarray:
        return self.reader.read(name)

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.reader.read_slice(name, index)


class GGUFSlices:
    """`read_slice(name, index)` over a GGUF file (see the module doc for what it reads)."""

    def __init__(self, f: Any):
        self.f = f

    def names(self) -> list[str]:
        return self.f.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.f.shape(name)

    def read(self, name: str) -> np.ndarray:
        return self.f.tensor(name)

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        t = self.f.tensors[name]
        data = self.f.header.data(name)  # a view of the validated, memory-mapped file
        if tuple(data.shape) == self.f.shape(name) and data.dtype.kind == "f":
            return np.asarray(data[index], np.float32)
        from gguf import quants  # a quantised (or BF16) tensor: [rows..., bytes per row]

        rows = np.asarray(data[index[:-1]])
        try:
            values = quants.dequantize(rows, t.tensor_type)
        except NotImplementedError as e:
            raise InteropError(
                f"{self.f.path}: tensor {name} has type {t.tensor_type.name}, which the gguf "
                f"package cannot dequantise ({e})"
            ) from None
        return np.asarray(values, np.float32)[..., index[-1]]


# ---- the view tree --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One file tensor seen in the jaxlearn layout.

    groups[t]: the jaxlearn axes that axis t of the transposed file tensor splits into;
    offset: rows skipped on file axis -2 (a `part` block); permute: the head_dim of q/k
    rows that llama.cpp permuted (undone per whole head), with `permute_axis` the jaxlearn
    axis of head_dim; shift: subtracted from every value (`names.Name.shift`)."""

    name: str
    shape: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    transpose: bool
    offset: int = 0
    permute: Optional[int] = None
    permute_axis: int = -1
    shift: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Stack:
    """Children stacked on a new leading axis (scanned layers, per-expert tensors)."""

    children: tuple[Node, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.children), *self.children[0].shape)


@dataclasses.dataclass(frozen=True)
class _Concat:
    """Children concatenated on `axis` (a fused q/k/v or gate/up parameter)."""

    children: tuple[Node, ...]
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        first = list(self.children[0].shape)
        first[self.axis] = sum(c.shape[self.axis] for c in self.children)
        return tuple(first)


@dataclasses.dataclass(frozen=True)
class _Whole:
    """Fallback: the file tensors of `use`, read and transformed whole per call."""

    use: Use
    shape: tuple[int, ...]
    d: tuple[tuple[str, int], ...]
    permuted: bool


def _groups(t_shape: Sequence[int], shape: Sequence[int]) -> Optional[tuple[tuple[int, ...], ...]]:
    """Consecutive jaxlearn axes whose sizes multiply to each transposed file axis, or None
    when `shape` is not such a split of `t_shape`."""
    groups: list[tuple[int, ...]] = []
    a = 0
    for length in t_shape:
        group: list[int] = []
        prod = 1
        while a < len(shape) and (prod < length or (not group and length == 1)):
            group.append(a)
            prod *= shape[a]
            a += 1
        if prod != length:
            return None
        groups.append(tuple(group))
    if a < len(shape):
        if not groups or any(shape[i] != 1 for i in range(a, len(shape))):
            return None
        groups[-1] = groups[-1] + tuple(range(a, len(shape)))
    return tuple(groups)


def _leaf(use: Use, file: str, shape: tuple[int, ...], d: dict[str, int], permuted: bool) -> Node:
    name = use.name
    file_shape = list(shape_of(name.shape, d))
    offset = 0
    if name.part is not None:
        offset, file_shape[-2] = block(name, file_shape[-2], d)
    t_shape = list(file_shape)
    if name.transpose:
        t_shape[-2:] = t_shape[-1], t_shape[-2]
    groups = _groups(t_shape, shape)
    permute = d["D"] if permuted and name.permute else None
    if groups is None or (permute is not None and shape[-1] != d["D"]):
        return _Whole(use, shape, tuple(d.items()), permuted)
    return _Leaf(file, shape, groups, name.transpose, offset, permute, len(shape) - 1,
                 name.shift)


def _use_node(use: Use, d: dict[str, int], permuted: bool) -> Node:
    shape = shape_of(use.row.shape, d)
    if use.name.per_expert:
        return _Stack(tuple(_leaf(use, f, shape[1:], d, permuted) for f in use.files))
    return _leaf(use, use.files[0], shape, d, permuted)


# ---- reading --------------------------------------------------------------------------------


def _runs(sizes: Sequence[int], sel: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The contiguous (start, stop) ranges of a merged axis (row-major over `sizes`) that
    hold the selection `sel` of the split axes, in row-major order."""
    partial = [i for i, (s, n) in enumerate(zip(sel, sizes)) if s != (0, n)]
    if not partial:
        return [(0, math.prod(sizes))]
    m = partial[-1]
    stride = math.prod(sizes[m + 1 :])
    starts = [0]
    for i in range(m):
        step = math.prod(sizes[i + 1 :])
        starts = [s + k * step for s in starts for k in range(*sel[i])]
    lo, hi = sel[m]
    return [(s + lo * stride, s + hi * stride) for s in starts]


def _read_leaf(leaf: _Leaf, source: Any, index: Index) -> np.ndarray:
    want = list(index)
    sel = list(index)
    if leaf.permute is not None:  # whole heads: the permutation is within each head
        sel[leaf.permute_axis] = (0, leaf.shape[leaf.permute_axis])
    runs = [_runs([leaf.shape[a] for a in g], [sel[a] for a in g]) for g in leaf.groups]
    ndim = len(runs)

    def block(t_index: list[tuple[int, int]]) -> np.ndarray:
        f_index = list(t_index)
        if leaf.transpose:
            f_index[-2:] = f_index[-1], f_index[-2]
        if leaf.offset:
            f_index[-2] = (f_index[-2][0] + leaf.offset, f_index[-2][1] + leaf.offset)
        x = source.read_slice(leaf.name, tuple(slice(a, b) for a, b in f_index))
        x = np.asarray(x).astype(np.float32, copy=False)
        if leaf.shift:
            x = x - np.float32(leaf.shift)
        if leaf.permute is not None:
            x = unpermute_qk(x, x.shape[0] // leaf.permute)
        return np.swapaxes(x, -1, -2) if leaf.transpose else x

    def assemble(prefix: list[tuple[int, int]]) -> np.ndarray:
        if len(prefix) == ndim:
            return block(prefix)
        parts = [assemble(prefix + [r]) for r in runs[len(prefix)]]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=len(prefix))

    x = assemble([]).reshape([b - a for a, b in sel])
    cut = tuple(slice(w[0] - s[0], w[1] - s[0]) for w, s in zip(want, sel))
    return x[cut]


def read_node(node: Node, source: Any, index: Index) -> np.ndarray:
    """`node[index]` as float32 numpy, reading only what the index needs."""
    if isinstance(node, _Leaf):
        return _read_leaf(node, source, index)
    if isinstance(node, _Stack):
        (a, b), rest = index[0], index[1:]
        return np.stack([read_node(c, source, rest) for c in node.children[a:b]])
    if isinstance(node, _Concat):
        axis = node.axis % len(node.shape)
        lo, hi = index[axis]
        parts, start = [], 0
        for child in node.children:
            size = child.shape[axis]
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                sub = list(index)
                sub[axis] = (a - start, b - start)
                parts.append(read_node(child, source, tuple(sub)))
            start += size
        return np.concatenate(parts, axis=axis)
    arrays = [source.read(n) for n in node.use.files]
    full = to_jaxlearn(node.use, arrays, dict(node.d), node.permuted)
    return full[tuple(slice(a, b) for a, b in index)]


class SliceReader:
    """One parameter: `shape`, `dtype`, and `__call__(index) -> numpy param[index]`
    (index: a tuple of slices, as `jax.make_array_from_callback` passes)."""

    def __init__(self, node: Node, source: Any, dtype: Any, path: str):
        self.node, self.source, self.path = node, source, path
        self.shape: tuple[int, ...] = tuple(node.shape)
        self.dtype = np.dtype(dtype)

    def __call__(self, index: tuple[slice, ...]) -> np.ndarray:
        bounds = []
        for i, size in enumerate(self.shape):
            s = index[i] if i < len(index) else slice(None)
            start, stop, step = s.indices(size)
            if step != 1:
                raise InteropError(f"{self.path}: strided index {s} is not supported")
            bounds.append((start, max(start, stop)))
        return read_node(self.node, self.source, tuple(bounds)).astype(self.dtype, copy=False)


# ---- the readers of a model -----------------------------------------------------------------


def _open(source: Any) -> tuple[Any, str, Architecture]:
    """(slice source, format, architecture) of an HF/GGUF `ModelSource` (the GGUF header
    it parsed is reused)."""
    if source.kind == "gguf":
        return GGUFSlices(source.gguf), "gguf", source.architecture
    if source.kind == "hf":
        return SafetensorsSlices(source.target), "hf", source.architecture
    raise InteropError(f"{source.path}: neither an HF model directory (with config.json) "
                       "nor a .gguf file")


def param_readers(path: Union[str, pathlib.Path, Any], model: Any) -> dict[str, SliceReader]:
    """{dotted param path: SliceReader} for every parameter of `model` (a `CausalLM`
    built for this checkpoint, e.g. by `build_config`), from an HF model directory or a
    GGUF file (a path, or its `ModelSource`). Every file tensor name and shape is checked
    first (ParameterMismatchError listing every problem); no tensor data is read here."""
    from jaxlearn.interop.model_source import ModelSource, open_model

    opened = path if isinstance(path, ModelSource) else open_model(path)
    p = opened.target
    source, fmt, arch = _open(opened)
    uses = plan(arch, fmt, available=set(source.names()))
    check_source(uses, arch, fmt, source, str(p))
    d, permuted = dims(arch), fmt == "gguf" and family(arch).gguf_permutes_qk
    top: dict[str, Node] = {}
    layers: list[dict[str, Node]] = [{} for _ in range(arch.num_layers)]
    for use in uses:
        tree = top if use.layer is None else layers[use.layer]
        tree[use.row.key] = _use_node(use, d, permuted)
    for layer, layout in zip(layers, layer_layouts(model)):
        for f in FUSIONS:
            parts = [key_of(q) for q in f.parts]
            if f.when in layout and all(q in layer for q in parts):
                layer[key_of(f.path)] = _Concat(tuple(layer.pop(q) for q in parts), f.axis)
    nodes = {f"decoder.{k}": v for k, v in top.items()}
    if stack_kind(model) == "scan" and layers:
        g = group_size(model)
        for k, prefix in enumerate([f"layer.layer{k}" for k in range(g)] if g else ["layer"]):
            for key in layers[0]:
                stacked = tuple(layer.get(key) for layer in layers[k :: g or 1])
                if any(n is None for n in stacked):
                    raise ParameterMismatchError(
                        str(p), mismatched=[f"{key}: not in every layer; use stack='loop'"])
                nodes[f"decoder.transformer.{prefix}.{key}"] = _Stack(stacked)  # type: ignore[arg-type]
    else:
        for i, layer in enumerate(layers):
            nodes.update({f"decoder.transformer.layer{i}.{k}": v for k, v in layer.items()})
    return _check_against(model, nodes, source, str(p))


def _check_against(
    model: Any, nodes: dict[str, Node], source: Any, where: str
) -> dict[str, SliceReader]:
    from jaxlearn.layers import ADAPTERS

    specs = flatten(model.create_parameter_specs_recursively())
    adapters = {k for k in specs if k not in nodes and re.fullmatch(ADAPTERS, k.replace(".", "/"))}
    specs = {k: v for k, v in specs.items() if k not in adapters}  # the trainer inits them
    missing = sorted(k for k in specs if k not in nodes)
    unexpected = sorted(k for k in nodes if k not in specs)
    mismatched = [
        f"{k}: got {tuple(nodes[k].shape)}, expected {tuple(s.shape)}"
        for k, s in specs.items()
        if k in nodes and tuple(nodes[k].shape) != tuple(s.shape)
    ]
    if missing or unexpected or mismatched:
        raise ParameterMismatchError(
            where, missing=missing, unexpected=unexpected, mismatched=mismatched)
    return {k: SliceReader(nodes[k], source, s.dtype, k) for k, s in specs.items()}


def load_sharded(path: Union[str, pathlib.Path, Any], model: Any, shardings: Any) -> Any:
    """`model`'s params from `path` as jax.Arrays placed per `shardings` (a tree like the
    model's parameter specs), each built by `jax.make_array_from_callback` from reads of
    its addressable shards only. A shard index held by several devices is read once.
    LoRA adapters (`layers.ADAPTERS` paths) that the file lacks are left out: the caller
    initialises them (the trainer does, from its seed)."""
    flat_shardings = flatten(shardings) if isinstance(shardings, dict) else None
    out: dict[str, Any] = {}
    for name, reader in param_readers(path, model).items():
        sharding = flat_shardings[name] if flat_shardings is not None else shardings
        *parents, last = name.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = _sharded_array(reader, sharding)
    return out


def _sharded_array(reader: SliceReader, sharding: Any) -> Any:
    """`reader`'s parameter as a jax.Array with `sharding`, each distinct shard read once."""
    import jax

    cache: dict[tuple, np.ndarray] = {}

    def cb(index: Optional[tuple[slice, ...]]) -> np.ndarray:
        index = index or ()
        key = tuple(s.indices(n)[:2] for s, n in zip(index, reader.shape))
        if key not in cache:
            cache[key] = reader(index)
        return cache[key]

    return jax.make_array_from_callback(reader.shape, sharding, cb)


__all__ = [
    "GGUFSlices",
    "SafetensorsSlices",
    "SliceReader",
    "load_sharded",
    "param_readers",
    "read_node",
]
