"""Applies the name table of `jaxlearn.families.names` to checkpoints: `plan` resolves the
rows of an architecture against a file's tensor names, `read_tensors` checks every name
and shape from the headers and then builds the canonical (top, layers) trees of
`jaxlearn.families.tree`, `write_tensors` turns those trees into file tensors. One code
path serves HF safetensors and GGUF, import and export.
"""

from __future__ import annotations

import dataclasses
from typing import Container, Iterable, Optional, Protocol, Sequence

import numpy as np

from jaxlearn.families.arch import Architecture
from jaxlearn.families.family import Family
from jaxlearn.families.names import (
    FORMATS,
    FUSIONS,
    IGNORED,
    Name,
    Row,
    block,
    dims,
    features,
    key_of,
    shape_of,
)
from jaxlearn.families.registry import FAMILIES, family
from jaxlearn.interop.errors import ParameterMismatchError, UnsupportedModelError

Nested = dict


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
    arch: Architecture, fmt: str, *, available: Optional[set[str]] = None, alternative: int = 0
) -> list[Use]:
    """The tensors of `arch` in format `fmt`, top rows first, then layer by layer. With
    `available` (the names a file holds), each row takes the first of its names the file
    has (else its first, which is then reported missing); otherwise name `alternative`
    (clipped to the row's last)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    fam, experts = family(arch), arch.num_experts
    out = []
    for layer in [None, *range(arch.num_layers)]:
        on = features(arch, layer)
        for row in fam.rows:
            if row.per_layer != (layer is not None) or (row.when and row.when not in on):
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


def held_features(fam: Family, fmt: str, available: Container[str]) -> frozenset[str]:
    """The `Row.when` features of `fam` whose `fmt` tensors (of layer 0) `available` holds,
    e.g. {"qkv_bias", "untied"}: how a file without a config says which it has."""
    out: set[str] = set()
    for row in fam.rows:
        if row.when and any(_expand(n, 0, 1)[0] in available for n in row.names(fmt)):
            out.add(row.when)
    return frozenset(out)


def file_shape(use: Use, d: dict[str, int]) -> tuple[int, ...]:
    """The shape of each of `use.files` in the file."""
    return shape_of(use.name.shape, d)


def _spare_names(arch: Architecture, fmt: str) -> set[str]:
    fam, on = family(arch), features(arch)
    spare = [r for r in fam.rows if r.spare and r.when and r.when not in on]
    return {n.template for r in spare for n in r.names(fmt)}


def check_source(
    uses: Sequence[Use], arch: Architecture, fmt: str, source: Source, where: str
) -> None:
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
        first, rows = block(name, x.shape[-2], d)
        x = x[..., first : first + rows, :]
    if permuted and name.permute:
        x = unpermute_qk(x, d[name.permute])
    if name.transpose:
        x = np.swapaxes(x, -1, -2)
    if name.shift:
        x = x - np.float32(name.shift)
    return x.reshape(shape_of(use.row.shape, d))


def to_file(use: Use, value: np.ndarray, d: dict[str, int], permuted: bool) -> list[np.ndarray]:
    """The jaxlearn array of `use` -> its file tensors (one per expert for `{j}` names;
    for `part` names, the block that `write_tensors` concatenates)."""
    name = use.name
    shape = list(file_shape(use, d))
    if name.per_expert:
        shape.insert(0, d["X"])
    if name.part is not None:
        shape[-2] = block(name, shape[-2], d)[1]
    if name.transpose:
        shape[-2:] = shape[-1], shape[-2]
    x = np.asarray(value).reshape(shape)
    if name.shift:
        x = x + np.asarray(name.shift, x.dtype)
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
        parts = [key_of(p) for p in f.parts]
        if f.when in layout and all(has_path(layer, p) for p in parts):
            joined = np.concatenate([pop_path(layer, p) for p in parts], axis=f.axis)
            put_path(layer, key_of(f.path), joined)


def unfuse(layer: Nested, d: dict[str, int], rows: Sequence[Row] = ()) -> None:
    """In place: every fused parameter in `layer` -> its unfused parts, sized by `rows`
    (the rows of this layer; default: every family's, first wins)."""
    shapes: dict[str, str] = {r.path: r.shape for r in rows}
    for fam in FAMILIES.values():
        for r in fam.rows:
            shapes.setdefault(r.path, r.shape)
    for f in FUSIONS:
        if has_path(layer, key_of(f.path)):
            value = pop_path(layer, key_of(f.path))
            sizes = [shape_of(shapes[p], d)[f.axis] for p in f.parts]
            pieces = np.split(value, np.cumsum(sizes)[:-1], axis=f.axis)
            for p, piece in zip(f.parts, pieces):
                put_path(layer, key_of(p), piece)


# ---- import and export ----------------------------------------------------------------------


def read_tensors(
    arch: Architecture,
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
    layers: list[Nested] = [{} for _ in range(arch.num_layers)]
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
    arch: Architecture, fmt: str, top: Nested, layers: Sequence[Nested], *, alternative: int = 0
) -> dict[str, np.ndarray]:
    """Canonical (top, layers) -> {file tensor name: array in the file layout}. Fused
    parameters are split first; `alternative` picks a row's other names (see `plan`)."""
    d, permuted = dims(arch), fmt == "gguf" and family(arch).gguf_permutes_qk
    unfused = []
    for i, layer in enumerate(layers):
        layer = copy_dicts(layer)
        on = features(arch, i)
        unfuse(layer, d, [r for r in family(arch).rows if not r.when or r.when in on])
        unfused.append(layer)
    out: dict[str, np.ndarray] = {}
    blocks: dict[str, dict[int, np.ndarray]] = {}
    uses = plan(arch, fmt, alternative=alternative)
    _check_trees(uses, top, unfused, where=f"export ({arch.family} name table)")
    for use in uses:
        tree = top if use.layer is None else unfused[use.layer]
        pieces = to_file(use, get_path(tree, use.row.key), d, permuted)
        if use.name.part is not None:
            blocks.setdefault(use.files[0], {})[use.name.part[0]] = pieces[0]
            continue
        out.update(zip(use.files, pieces))
    for n, parts in blocks.items():
        out[n] = np.concatenate([parts[p] for p in sorted(parts)], axis=-2)
    return out


def _check_trees(
    uses: Sequence[Use], top: Nested, layers: Sequence[Nested], *, where: str
) -> None:
    """Raises ParameterMismatchError unless (top, layers) hold exactly the rows of `uses`."""
    want = {param_path(u.row, u.layer, False) for u in uses}
    have = set(_leaf_paths(top, "decoder."))
    for i, layer in enumerate(layers):
        have.update(_leaf_paths(layer, f"decoder.transformer.layer{i}."))
    if want != have:
        raise ParameterMismatchError(
            where,
            missing=sorted(want - have),
            unexpected=sorted(have - want),
        )


def _leaf_paths(tree: Nested, prefix: str) -> list[str]:
    out: list[str] = []
    for k, v in tree.items():
        out += _leaf_paths(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    return out


def copy_dicts(tree: Nested) -> Nested:
    """A copy of the dict structure of `tree` (leaves shared)."""
    return {k: copy_dicts(v) if isinstance(v, dict) else v for k, v in tree.items()}
