"""Mesh shapes with named axes, `-1` inference, hybrid (ICI x DCN) shapes, and `make_mesh`.

A mesh shape is either a flat tuple of ints aligned with a tuple of axis names, e.g.
`(1, -1, 1, 1, 1, 2)` for `DEFAULT_AXIS_NAMES`, or a `HybridMeshShape` that splits every
axis into a fast part within a granule (a TPU slice, or a GPU/Trainium host: ICI, NVLink,
NeuronLink) and a slow part across granules (DCN). The device mesh has, per axis, size
`ici_mesh_shape[i] * dcn_mesh_shape[i]`, with the granule index as the outer factor.

Axis order matters: axes are listed by increasing communication intensity (`pipeline`
outermost, `model` innermost), which `jax.experimental.mesh_utils` uses to put the most
communicating axes on the fastest, nearest links.

One `-1` per shape (per part, for hybrid shapes) is inferred from the device count.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxlearn.mesh.errors import MeshShapeError

# Outermost (least communication) to innermost (most communication).
DEFAULT_AXIS_NAMES: tuple[str, ...] = ("pipeline", "data", "fsdp", "expert", "seq", "model")


@dataclasses.dataclass(frozen=True)
class HybridMeshShape:
    """A mesh shape split into a within-granule (ICI) part and an across-granule (DCN) part.

    Attributes:
        ici_mesh_shape: per axis, the size within one granule (slice or host); one -1 allowed.
        dcn_mesh_shape: per axis, the number of granules along it; one -1 allowed.
    The full mesh has shape `[i * d for i, d in zip(ici_mesh_shape, dcn_mesh_shape)]`.
    """

    ici_mesh_shape: tuple[int, ...]
    dcn_mesh_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ici_mesh_shape", _check_sizes(self.ici_mesh_shape, "ici"))
        object.__setattr__(self, "dcn_mesh_shape", _check_sizes(self.dcn_mesh_shape, "dcn"))
        if len(self.ici_mesh_shape) != len(self.dcn_mesh_shape):
            raise MeshShapeError(
                f"HybridMeshShape: ici_mesh_shape {self.ici_mesh_shape} and dcn_mesh_shape "
                f"{self.dcn_mesh_shape} must have the same number of axes"
            )

    def __len__(self) -> int:
        return len(self.ici_mesh_shape)

    @property
    def full_shape(self) -> tuple[int, ...]:
        """Per-axis product `ici * dcn` (only meaningful once no -1 is left)."""
        return tuple(i * d for i, d in zip(self.ici_mesh_shape, self.dcn_mesh_shape))


MeshShape = Union[tuple[int, ...], HybridMeshShape]


def _check_sizes(shape: Any, what: str = "mesh") -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise MeshShapeError(f"{what} shape must be a sequence of ints, got {shape!r}")
    sizes = tuple(shape)
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise MeshShapeError(f"{what} shape {sizes}: sizes must be ints, got {size!r}")
        if size != -1 and size < 1:
            raise MeshShapeError(f"{what} shape {sizes}: sizes must be >= 1 or -1, got {size}")
    if sum(1 for s in sizes if s == -1) > 1:
        raise MeshShapeError(f"{what} shape {sizes} has more than one -1; at most one is inferred")
    return tuple(int(s) for s in sizes)


def as_mesh_shape(value: Any) -> MeshShape:
    """Normalizes a config value into a mesh shape.

    Accepts a sequence of ints, a `HybridMeshShape`, or a literal-friendly mapping
    `{"ici_mesh_shape": (...), "dcn_mesh_shape": (...)}` (handy in `--set` overrides).
    """
    if isinstance(value, HybridMeshShape):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - {"ici_mesh_shape", "dcn_mesh_shape"}
        if unknown:
            raise MeshShapeError(f"Hybrid mesh shape mapping has unknown keys {sorted(unknown)}")
        return HybridMeshShape(tuple(value["ici_mesh_shape"]), tuple(value["dcn_mesh_shape"]))
    return _check_sizes(value)


def mesh_shape_from_axes(
    axis_names: Sequence[str] = DEFAULT_AXIS_NAMES, /, **sizes: int
) -> tuple[int, ...]:
    """A flat shape aligned with `axis_names`, 1 for each axis not named.

    >>> mesh_shape_from_axes(data=-1, model=2)
    (1, -1, 1, 1, 1, 2)
    """
    unknown = [name for name in sizes if name not in axis_names]
    if unknown:
        raise MeshShapeError(
            f"Unknown mesh axis name(s) {unknown}; axis names: {tuple(axis_names)}"
        )
    return _check_sizes(tuple(sizes.get(name, 1) for name in axis_names))


def hybrid_mesh_shape_from_axes(
    ici: Mapping[str, int],
    dcn: Mapping[str, int],
    axis_names: Sequence[str] = DEFAULT_AXIS_NAMES,
) -> HybridMeshShape:
    """A `HybridMeshShape` from per-axis dicts, e.g. `ici={"fsdp": -1}, dcn={"data": -1}`."""
    return HybridMeshShape(
        mesh_shape_from_axes(axis_names, **ici), mesh_shape_from_axes(axis_names, **dcn)
    )


def infer_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Replaces the (at most one) -1 in `shape` so that its product is `num_devices`.

    Raises MeshShapeError if the known sizes do not divide `num_devices`, or if there is no
    -1 and the product differs from `num_devices`.
    """
    sizes = _check_sizes(shape)
    if num_devices < 1:
        raise MeshShapeError(f"Cannot build mesh shape {sizes} for {num_devices} devices")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise MeshShapeError(
                f"Mesh shape {sizes}: {num_devices} devices are not divisible by the product "
                f"of the fixed axes ({known}), so -1 cannot be inferred"
            )
        return tuple(num_devices // known if s == -1 else s for s in sizes)
    if known != num_devices:
        raise MeshShapeError(
            f"Mesh shape {sizes} has {known} devices but {num_devices} are available; "
            f"fix the sizes or use -1 for one axis"
        )
    return sizes


def infer_hybrid_mesh_shape(
    shape: HybridMeshShape, num_devices: int, num_granules: int
) -> HybridMeshShape:
    """Infers -1s: the DCN part spans `num_granules`, the ICI part the devices of one granule."""
    if num_granules < 1 or num_devices % num_granules:
        raise MeshShapeError(
            f"{num_devices} devices cannot be split evenly into {num_granules} granules"
        )
    try:
        dcn = infer_mesh_shape(shape.dcn_mesh_shape, num_granules)
        ici = infer_mesh_shape(shape.ici_mesh_shape, num_devices // num_granules)
    except MeshShapeError as e:
        raise MeshShapeError(
            f"{shape} on {num_devices} devices in {num_granules} granule(s) "
            f"(slices or hosts): {e}"
        ) from None
    return HybridMeshShape(ici, dcn)


def split_for_granules(shape: Sequence[int], num_granules: int) -> HybridMeshShape:
    """Splits a flat (fully known) shape into ICI x DCN, giving DCN to the outermost axes.

    E.g. `(1, 4, 1, 1, 1, 2)` over 2 granules -> ici `(1, 2, 1, 1, 1, 2)`, dcn
    `(1, 2, 1, 1, 1, 1)`: the data axis crosses granules, the model axis stays inside one.
    """
    sizes = _check_sizes(shape)
    if -1 in sizes:
        raise MeshShapeError(f"split_for_granules needs a fully inferred shape, got {sizes}")
    remaining = num_granules
    ici, dcn = [], []
    for size in sizes:
        g = math.gcd(size, remaining)
        dcn.append(g)
        ici.append(size // g)
        remaining //= g
    if remaining != 1:
        raise MeshShapeError(
            f"Cannot spread {num_granules} granules (slices or hosts) over the outer axes of "
            f"mesh shape {sizes}; give a HybridMeshShape explicitly"
        )
    return HybridMeshShape(tuple(ici), tuple(dcn))


def check_axis_names(axis_names: Sequence[str], ndim: int) -> tuple[str, ...]:
    """Validates that names are unique strings, one per mesh axis."""
    names = tuple(axis_names)
    if len(names) != ndim:
        raise MeshShapeError(f"{ndim} mesh axes but {len(names)} axis names {names}")
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise MeshShapeError(f"Mesh axis names must be unique non-empty strings, got {names}")
    return names


def _granules(devices: Sequence[Any]) -> tuple[str, list[list[Any]]]:
    """Groups devices by slice (if every device has `slice_index`) or else by process."""
    attr = "slice_index" if all(hasattr(d, "slice_index") for d in devices) else "process_index"
    groups: dict[Any, list[Any]] = collections.defaultdict(list)
    for d in devices:
        groups[getattr(d, attr)].append(d)
    return attr, [groups[k] for k in sorted(groups)]


def _single_granule_mesh(shape: Sequence[int], devices: Sequence[Any]) -> np.ndarray:
    try:
        return mesh_utils.create_device_mesh(list(shape), list(devices))
    except NotImplementedError:
        # TPU topologies whose physical axes must be split to fit the logical shape.
        return mesh_utils.create_device_mesh(
            list(shape), list(devices), allow_split_physical_axes=True
        )


def _block(ici: Sequence[int], dcn: Sequence[int], granules: list[list[Any]]) -> np.ndarray:
    """Per-granule meshes of shape `ici` tiled in a grid of shape `dcn` (granule-major)."""
    per_granule = [_single_granule_mesh(ici, g) for g in granules]
    grid = np.arange(len(granules)).reshape(tuple(dcn))
    blocks = np.vectorize(lambda i: per_granule[i], otypes=[object])(grid)
    return np.block(blocks.tolist())


def create_device_array(
    shape: MeshShape, devices: Optional[Sequence[Any]] = None
) -> np.ndarray:
    """An ndarray of devices of the (inferred) mesh shape, ordered for good collectives.

    - Flat shape, one granule: `mesh_utils.create_device_mesh` (topology-aware on TPU,
      sorted by id on GPU, plain reshape on CPU).
    - Several granules (TPU slices, or processes where devices have no `slice_index`): a
      flat shape is split with `split_for_granules`; then `create_hybrid_device_mesh`.
    - Hybrid shape on one granule of CPU devices (fake devices in tests): the devices are
      cut into `prod(dcn)` contiguous synthetic granules and tiled the same way.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise MeshShapeError("No devices to build a mesh from")
    attr, granules = _granules(devices)
    shape = as_mesh_shape(shape)
    if not isinstance(shape, HybridMeshShape):
        flat = infer_mesh_shape(shape, len(devices))
        if len(granules) == 1:
            return _single_granule_mesh(flat, devices)
        shape = split_for_granules(flat, len(granules))
    num_granules = len(granules)
    if num_granules == 1 and -1 not in shape.dcn_mesh_shape:
        num_granules = math.prod(shape.dcn_mesh_shape)
    hybrid = infer_hybrid_mesh_shape(shape, len(devices), num_granules)
    if len(granules) > 1:
        if len({len(g) for g in granules}) != 1:
            raise MeshShapeError(
                f"Granules ({attr}) have unequal device counts {[len(g) for g in granules]}"
            )
        return mesh_utils.create_hybrid_device_mesh(
            list(hybrid.ici_mesh_shape),
            list(hybrid.dcn_mesh_shape),
            devices,
            process_is_granule=attr == "process_index",
        )
    if num_granules == 1:
        return _single_granule_mesh(hybrid.ici_mesh_shape, devices)
    if devices[0].platform != "cpu":
        raise MeshShapeError(
            f"{hybrid} needs {num_granules} granules (slices or hosts) but all "
            f"{len(devices)} {devices[0].platform} devices are in one"
        )
    per = len(devices) // num_granules
    synthetic = [devices[i * per : (i + 1) * per] for i in range(num_granules)]
    return _block(hybrid.ici_mesh_shape, hybrid.dcn_mesh_shape, synthetic)


def make_mesh(
    shape: MeshShape,
    axis_names: Sequence[str] = DEFAULT_AXIS_NAMES,
    devices: Optional[Sequence[Any]] = None,
) -> Mesh:
    """A `jax.sharding.Mesh` with `Auto` axis types (GSPMD-style propagation).

    Unlike `jax.make_mesh`, whose axes default to `Explicit`, every axis here is
    `AxisType.Auto`, so shardings come from `in_shardings` / sharding constraints.

    Args:
        shape: flat sizes or a `HybridMeshShape`, aligned with `axis_names`; one -1 each.
        axis_names: one unique name per axis.
        devices: defaults to `jax.devices()`.
    Returns:
        A Mesh whose `devices` array has the inferred full shape.
    """
    shape = as_mesh_shape(shape)
    names = check_axis_names(axis_names, len(shape))
    array = create_device_array(shape, devices)
    return Mesh(array, names, axis_types=(AxisType.Auto,) * len(names))


__all__ = [
    "DEFAULT_AXIS_NAMES",
    "HybridMeshShape",
    "MeshShape",
    "as_mesh_shape",
    "check_axis_names",
    "create_device_array",
    "hybrid_mesh_shape_from_axes",
    "infer_hybrid_mesh_shape",
    "infer_mesh_shape",
    "make_mesh",
    "mesh_shape_from_axes",
    "split_for_granules",
]
