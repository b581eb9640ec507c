"""Mesh shapes: -1 inference and its errors, named axes, hybrid (ICI x DCN) device layout."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType

from jaxlearn.mesh import (
    DEFAULT_AXIS_NAMES,
    HybridMeshShape,
    MeshShapeError,
    as_mesh_shape,
    create_device_array,
    hybrid_mesh_shape_from_axes,
    infer_hybrid_mesh_shape,
    infer_mesh_shape,
    make_mesh,
    mesh_shape_from_axes,
    split_for_granules,
)


def test_default_axis_order_includes_pipeline():
    assert DEFAULT_AXIS_NAMES == ("pipeline", "data", "fsdp", "expert", "seq", "model")


def test_mesh_shape_from_axes():
    assert mesh_shape_from_axes(data=-1, model=2) == (1, -1, 1, 1, 1, 2)
    assert mesh_shape_from_axes(("a", "b"), b=4) == (1, 4)
    with pytest.raises(MeshShapeError, match="Unknown mesh axis.*'modle'"):
        mesh_shape_from_axes(modle=2)


def test_infer_minus_one():
    assert infer_mesh_shape((1, -1, 2), 8) == (1, 4, 2)
    assert infer_mesh_shape((2, 4), 8) == (2, 4)


@pytest.mark.parametrize(
    "shape, n, match",
    [
        ((-1, -1), 8, "more than one -1"),
        ((3, -1), 8, "not divisible"),
        ((2, 2), 8, "has 4 devices but 8"),
        ((0, 8), 8, ">= 1 or -1"),
        ((2.0, 4), 8, "must be ints"),
    ],
)
def test_infer_errors(shape, n, match):
    with pytest.raises(MeshShapeError, match=match):
        infer_mesh_shape(shape, n)


@given(
    sizes=st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=5),
    infer_at=st.integers(0, 4),
    extra=st.sampled_from([1, 2, 3, 5]),
)
def test_inference_product_equals_device_count(sizes, infer_at, extra):
    infer_at %= len(sizes)
    num_devices = math.prod(s for i, s in enumerate(sizes) if i != infer_at) * extra
    shape = [(-1 if i == infer_at else s) for i, s in enumerate(sizes)]
    out = infer_mesh_shape(shape, num_devices)
    assert math.prod(out) == num_devices
    assert out[infer_at] == extra
    assert all(o == s for o, s in zip(out, shape) if s != -1)


def test_make_mesh_auto_axes_and_order():
    mesh = make_mesh(mesh_shape_from_axes(data=-1, model=2))
    assert dict(mesh.shape) == {
        "pipeline": 1, "data": 4, "fsdp": 1, "expert": 1, "seq": 1, "model": 2
    }
    assert mesh.axis_types == (AxisType.Auto,) * 6
    # CPU: a plain reshape of jax.devices(); `model` (innermost) pairs neighbouring devices.
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(4, 2)
    np.testing.assert_array_equal(ids, np.arange(8).reshape(4, 2))


def test_make_mesh_errors():
    with pytest.raises(MeshShapeError, match="6 mesh axes but 2 axis names"):
        make_mesh(mesh_shape_from_axes(data=-1), ("data", "model"))
    with pytest.raises(MeshShapeError, match="unique"):
        make_mesh((2, 4), ("data", "data"))
    with pytest.raises(MeshShapeError, match="not divisible"):
        make_mesh((3, -1), ("data", "model"))


def test_make_mesh_on_device_subset():
    mesh = make_mesh((2, -1), ("data", "model"), devices=jax.devices()[:4])
    assert mesh.devices.shape == (2, 2)


def test_hybrid_shape_validation_and_from_axes():
    h = hybrid_mesh_shape_from_axes(ici={"fsdp": -1}, dcn={"data": 2})
    assert h.ici_mesh_shape == (1, 1, -1, 1, 1, 1)
    assert h.dcn_mesh_shape == (1, 2, 1, 1, 1, 1)
    with pytest.raises(MeshShapeError, match="same number of axes"):
        HybridMeshShape((1, 2), (1,))
    with pytest.raises(MeshShapeError, match="more than one -1"):
        HybridMeshShape((-1, -1), (1, 1))
    assert as_mesh_shape({"ici_mesh_shape": (1, 4), "dcn_mesh_shape": (2, 1)}) == HybridMeshShape(
        (1, 4), (2, 1)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.ici_mesh_shape = (1,)  # type: ignore[misc]


def test_infer_hybrid():
    h = infer_hybrid_mesh_shape(HybridMeshShape((-1, 2), (2, 1)), 8, 2)
    assert (h.ici_mesh_shape, h.dcn_mesh_shape, h.full_shape) == ((2, 2), (2, 1), (4, 2))
    h = infer_hybrid_mesh_shape(HybridMeshShape((1, 4), (-1, 1)), 16, 4)
    assert h.dcn_mesh_shape == (4, 1)
    with pytest.raises(MeshShapeError, match="granule"):
        infer_hybrid_mesh_shape(HybridMeshShape((1, 3), (2, 1)), 8, 2)


def test_hybrid_mesh_on_fake_cpu_granules():
    """dcn data=2 x ici (fsdp=2, model=2): each half of the devices is one synthetic granule,
    so crossing `data` is the slow link, and fsdp/model stay inside a granule."""
    shape = HybridMeshShape((1, 2, 2), (2, 1, 1))
    mesh = make_mesh(shape, ("data", "fsdp", "model"))
    assert mesh.devices.shape == (2, 2, 2)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert set(ids[0].ravel()) == {0, 1, 2, 3} and set(ids[1].ravel()) == {4, 5, 6, 7}


def test_hybrid_dcn_inner_axis_blocks_granules():
    # dcn on the model axis: model index 0..1 from granule 0, 2..3 from granule 1.
    mesh = make_mesh(HybridMeshShape((2, 2), (1, 2)), ("data", "model"))
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    np.testing.assert_array_equal(ids, [[0, 1, 4, 5], [2, 3, 6, 7]])


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    platform: str = "gpu"
    device_kind: str = "NVIDIA H100 80GB HBM3"


def test_multi_process_devices_use_hybrid_layout():
    # 2 hosts x 4 GPUs, listed interleaved: a flat (data=2, model=4) shape puts data across
    # hosts (DCN) and model within a host (NVLink).
    devices = [FakeDevice(i, i % 2) for i in range(8)]
    array = create_device_array((2, 4), devices)
    procs = np.vectorize(lambda d: d.process_index)(array)
    np.testing.assert_array_equal(procs, [[0] * 4, [1] * 4])
    # Only one axis > 1: it crosses hosts in two blocks.
    procs = np.vectorize(lambda d: d.process_index)(create_device_array((1, 8), devices))
    np.testing.assert_array_equal(procs, [[0] * 4 + [1] * 4])
    with pytest.raises(MeshShapeError, match="unequal device counts"):
        create_device_array((2, 2), [FakeDevice(i, int(i > 0)) for i in range(4)])


def test_split_for_granules():
    h = split_for_granules((1, 4, 1, 1, 1, 2), 2)
    assert h.ici_mesh_shape == (1, 2, 1, 1, 1, 2) and h.dcn_mesh_shape == (1, 2, 1, 1, 1, 1)
    h = split_for_granules((2, 4, 2), 4)
    assert h.dcn_mesh_shape == (2, 2, 1) and h.full_shape == (2, 4, 2)


@given(
    ici=st.lists(st.sampled_from([1, 2]), min_size=3, max_size=3),
    dcn_axis=st.integers(0, 2),
)
def test_hybrid_layout_is_a_permutation_with_granule_blocks(ici, dcn_axis):
    """Every device appears once; each granule's devices form one contiguous ICI block."""
    per_granule = math.prod(ici)
    num_granules = 8 // per_granule
    dcn = [num_granules if i == dcn_axis else 1 for i in range(3)]
    array = create_device_array(HybridMeshShape(tuple(ici), tuple(dcn)))
    ids = np.vectorize(lambda d: d.id)(array)
    assert ids.shape == tuple(i * d for i, d in zip(ici, dcn))
    assert sorted(ids.ravel()) == list(range(8))
    for g in range(num_granules):
        index = [slice(None)] * 3
        index[dcn_axis] = slice(g * ici[dcn_axis], (g + 1) * ici[dcn_axis])
        block = ids[tuple(index)]
        assert sorted(block.ravel()) == list(range(g * per_granule, (g + 1) * per_granule))
