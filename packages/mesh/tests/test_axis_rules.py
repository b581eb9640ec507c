"""Logical -> physical axis rules: one PartitionSpec per strategy, pruning, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jaxlearn.mesh import (
    DATA_PARALLEL_RULES,
    DEFAULT_AXIS_NAMES,
    DEFAULT_AXIS_RULES,
    EXPERT_PARALLEL_RULES,
    FSDP_RULES,
    LOGICAL_AXES,
    SEQUENCE_PARALLEL_RULES,
    TENSOR_PARALLEL_RULES,
    AxisRulesError,
    logical_to_mesh_axes,
    logical_to_partition_spec,
    make_mesh,
    merge_axis_rules,
    mesh_shape_from_axes,
    spec_fn_from_rules,
    tree_partition_specs,
    validate_axis_rules,
)


def sizes(**axes: int) -> dict[str, int]:
    return dict(zip(DEFAULT_AXIS_NAMES, mesh_shape_from_axes(**axes)))


ACT = ("batch", "seq", "embed")  # activations
W_IN = ("embed", "mlp")  # FFN input projection
Q = ("embed", "heads", "head_dim")  # attention query projection
KV = ("embed", "kv_heads", "head_dim")
EMB = ("vocab", "embed")
EXPERT_W = ("expert", "embed", "mlp")
STACKED = ("layers", "embed", "mlp")


@pytest.mark.parametrize(
    "rules, mesh, axes, expected",
    [
        # Data parallel: batch on data, parameters replicated.
        (DATA_PARALLEL_RULES, sizes(data=8), ACT, P("data", None, None)),
        (DATA_PARALLEL_RULES, sizes(data=8), W_IN, P(None, None)),
        # FSDP (ZeRO-3): parameters sharded along embed; activations' batch over data+fsdp,
        # so embed of activations stays whole (fsdp already used by batch).
        (FSDP_RULES, sizes(fsdp=8), W_IN, P("fsdp", None)),
        (FSDP_RULES, sizes(fsdp=8), ACT, P("fsdp", None, None)),
        (FSDP_RULES, sizes(data=2, fsdp=4), ACT, P(("data", "fsdp"), None, None)),
        # Megatron TP.
        (TENSOR_PARALLEL_RULES, sizes(model=8), W_IN, P(None, "model")),
        (TENSOR_PARALLEL_RULES, sizes(model=8), Q, P(None, "model", None)),
        (TENSOR_PARALLEL_RULES, sizes(model=8), KV, P(None, "model", None)),
        (TENSOR_PARALLEL_RULES, sizes(model=8), EMB, P("model", None)),
        (TENSOR_PARALLEL_RULES, sizes(model=8), ("batch", "seq", "mlp"), P(None, None, "model")),
        # Expert parallel.
        (EXPERT_PARALLEL_RULES, sizes(expert=8), EXPERT_W, P("expert", None, None)),
        (EXPERT_PARALLEL_RULES, sizes(expert=8), ACT, P("expert", None, None)),
        # Sequence sharding of activations.
        (SEQUENCE_PARALLEL_RULES, sizes(data=2, seq=4), ACT, P("data", "seq", None)),
        # Default rules: strategy follows the mesh shape.
        (DEFAULT_AXIS_RULES, sizes(data=2, fsdp=2, model=2), W_IN, P("fsdp", "model")),
        (DEFAULT_AXIS_RULES, sizes(data=2, fsdp=2, model=2), ACT, P(("data", "fsdp"), None, None)),
        (DEFAULT_AXIS_RULES, sizes(data=2, fsdp=2, model=2), STACKED, P(None, "fsdp", "model")),
        (
            DEFAULT_AXIS_RULES,
            sizes(expert=2, fsdp=2, model=2),
            EXPERT_W,
            P("expert", "fsdp", "model"),
        ),
        (DEFAULT_AXIS_RULES, sizes(data=8), W_IN, P(None, None)),
        (DEFAULT_AXIS_RULES, sizes(pipeline=2, data=4), ("stage", "layers"), P("pipeline", None)),
        # Without a mesh nothing is pruned.
        (DEFAULT_AXIS_RULES, None, ACT, P(("data", "fsdp", "expert"), "seq", None)),
    ],
)
def test_strategy_specs(rules, mesh, axes, expected):
    assert logical_to_partition_spec(axes, rules, mesh) == expected


def test_works_with_a_real_mesh():
    mesh = make_mesh(mesh_shape_from_axes(data=2, fsdp=2, model=2))
    assert logical_to_partition_spec(W_IN, DEFAULT_AXIS_RULES, mesh) == P("fsdp", "model")
    spec_fn = spec_fn_from_rules(DEFAULT_AXIS_RULES, mesh)
    assert spec_fn(("batch", None)) == P(("data", "fsdp"), None)


def test_none_and_unknown_names():
    assert logical_to_partition_spec((None, "mlp"), TENSOR_PARALLEL_RULES, sizes(model=2)) == P(
        None, "model"
    )
    with pytest.raises(AxisRulesError, match="'mpl'.*no axis rule.*Add \\('mpl', None\\)"):
        logical_to_partition_spec(("embed", "mpl"), DEFAULT_AXIS_RULES)
    assert logical_to_partition_spec(("mpl",), DEFAULT_AXIS_RULES, strict=False) == P(None)


def test_axes_absent_from_mesh_are_dropped():
    assert logical_to_partition_spec(ACT, DEFAULT_AXIS_RULES, {"data": 4, "model": 2}) == P(
        "data", None, None
    )


def test_shape_drops_non_dividing_axes():
    # MQA: 1 kv head cannot be split over model=4; 6 heads not over 4 either.
    mesh = sizes(model=4)
    assert logical_to_partition_spec(KV, DEFAULT_AXIS_RULES, mesh, shape=(16, 1, 8)) == P(
        None, None, None
    )
    assert logical_to_partition_spec(KV, DEFAULT_AXIS_RULES, mesh, shape=(16, 8, 8)) == P(
        None, "model", None
    )
    # batch 2 over data=2 x fsdp=2: keeps data, drops fsdp.
    assert logical_to_partition_spec(
        ("batch",), DEFAULT_AXIS_RULES, sizes(data=2, fsdp=2), shape=(2,)
    ) == P("data")
    with pytest.raises(AxisRulesError, match="do not match shape"):
        logical_to_partition_spec(KV, DEFAULT_AXIS_RULES, mesh, shape=(16, 8))


def test_fallback_candidates():
    rules = merge_axis_rules(DEFAULT_AXIS_RULES, (("vocab", "model"), ("vocab", "fsdp")))
    assert logical_to_partition_spec(EMB, rules, sizes(model=4)) == P("model", None)
    assert logical_to_partition_spec(EMB, rules, sizes(fsdp=4)) == P("fsdp", None)
    # model taken by an earlier dim: falls back to fsdp.
    assert logical_to_partition_spec(("mlp", "vocab"), rules, sizes(fsdp=2, model=2)) == P(
        "model", "fsdp"
    )


def test_merge_overrides_per_name():
    rules = merge_axis_rules(FSDP_RULES, (("mlp", "model"),))
    names = [n for n, _ in rules]
    assert names.count("mlp") == 1 and dict(rules)["mlp"] == "model"
    assert dict(rules)["embed"] == "fsdp"
    assert set(LOGICAL_AXES) <= set(names)
    assert names.index("mlp") == list(LOGICAL_AXES).index("mlp")  # keeps its position
    assert [n for n, _ in DEFAULT_AXIS_RULES] == list(LOGICAL_AXES)
    two = merge_axis_rules(rules, (("vocab", "model"), ("vocab", "fsdp"), ("cache", None)))
    assert [r for r in two if r[0] == "vocab"] == [("vocab", "model"), ("vocab", "fsdp")]
    assert two[-1] == ("cache", None)


@pytest.mark.parametrize(
    "bad, match",
    [
        ("batch", "sequence of"),
        ((("batch",),), "must be \\(logical_name, physical\\)"),
        ((("batch", 3),), "physical must be"),
        ((("batch", ("data", "data")),), "repeats a mesh axis"),
    ],
)
def test_validate_errors(bad, match):
    with pytest.raises(AxisRulesError, match=match):
        validate_axis_rules(bad)


def test_tree_partition_specs():
    tree = {"ffn": {"w_in": W_IN, "bias": ("mlp",)}, "emb": EMB}
    specs = tree_partition_specs(tree, TENSOR_PARALLEL_RULES, sizes(model=2))
    assert specs == {"ffn": {"w_in": P(None, "model"), "bias": P("model")}, "emb": P("model", None)}


PHYS = ("data", "fsdp", "expert", "seq", "model", "pipeline", "absent")
phys_axes = st.one_of(
    st.none(),
    st.sampled_from(PHYS),
    st.lists(st.sampled_from(PHYS), min_size=1, max_size=3, unique=True).map(tuple),
)
names = sorted(LOGICAL_AXES)


@given(
    rules=st.lists(st.tuples(st.sampled_from(names), phys_axes), max_size=16),
    logical=st.lists(st.one_of(st.none(), st.sampled_from(names)), min_size=1, max_size=5),
    mesh_sizes=st.lists(st.sampled_from([1, 2, 3, 4]), min_size=6, max_size=6),
    dims=st.lists(st.sampled_from([1, 2, 4, 6, 8, 12]), min_size=5, max_size=5),
)
def test_spec_invariants(rules, logical, mesh_sizes, dims):
    rules = merge_axis_rules(DEFAULT_AXIS_RULES, rules)
    mesh = dict(zip(PHYS[:-1], mesh_sizes))
    shape = dims[: len(logical)]
    out = logical_to_mesh_axes(logical, rules, mesh, shape=shape)
    used = [a for entry in out for a in ((entry,) if isinstance(entry, str) else entry or ())]
    assert len(used) == len(set(used)), f"physical axis repeated in {out}"
    for entry, dim, name in zip(out, shape, logical):
        axes = (entry,) if isinstance(entry, str) else entry or ()
        assert all(mesh.get(a, 1) > 1 for a in axes)  # never absent or size-1 axes
        prod = 1
        for a in axes:
            prod *= mesh[a]
        assert dim % prod == 0
        if name is None:
            assert entry is None
