"""restore(..., aliases=): target leaves read from arrays saved under older names, also
inside optimizer-like NamedTuples, verified like any other array."""

import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.checkpoint import CheckpointCorruptionError, CheckpointStructureError

# The older flat names of two params, as "."-joined path tails.
_OLDER = {"layer.proj.weight": "layer.proj", "layer.proj.bias": "layer.proj_bias"}


class AdamLike(NamedTuple):
    count: Any
    mu: Any
    nu: Any


class Empty(NamedTuple):
    pass


def _params(rng, m, new: bool):
    w = jax.device_put(rng.standard_normal((8, 4), dtype=np.float32),
                       NamedSharding(m, PartitionSpec("data", None)))
    b = jax.device_put(rng.standard_normal(4).astype(jnp.bfloat16),
                       NamedSharding(m, PartitionSpec()))
    norm = jax.device_put(np.arange(4, dtype=np.float32), NamedSharding(m, PartitionSpec()))
    if new:
        return {"layer": {"proj": {"weight": w, "bias": b}, "norm": norm}}
    return {"layer": {"proj": w, "proj_bias": b, "norm": norm}}


def _state(new: bool):
    m = Mesh(np.array(jax.devices()[:2]), ("data",))
    rng = np.random.default_rng(0)  # The same values in both layouts.
    params = _params(rng, m, new)
    opt = (Empty(), AdamLike(jnp.int32(3), _params(rng, m, new), _params(rng, m, new)))
    return {"params": params, "opt_state": opt, "step": 3}


def _abstract(state):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.Array) else x, state)


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_aliased_leaves_restore_bit_identical(make_checkpointer):
    ckpt = make_checkpointer()
    ckpt.save(3, _state(new=False))
    ckpt.wait_until_finished()
    target = _abstract(_state(new=True))
    with pytest.raises(CheckpointStructureError, match="params.layer.proj.weight"):
        ckpt.restore(3, target)
    asked: list[str] = []

    def older(rest: str):
        asked.append(rest)
        return _OLDER.get(rest)

    restored = ckpt.restore(3, target, aliases=older)
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    assert isinstance(restored["opt_state"][1], AdamLike)
    assert _bits(restored) == _bits(_state(new=True))
    # Only leaves missing from the step are looked up (norm, count, step never are).
    assert not any(a.endswith(("norm", "count", "step")) for a in asked)
    found = ckpt.restore_latest(target, aliases=older)
    assert found is not None and found[0] == 3 and _bits(found[1]) == _bits(restored)
    # A partial target: only the moment estimates of the moved weight.
    part = ckpt.restore(3, {"opt_state": (Empty(), target["opt_state"][1]._replace(
        count=None, nu=None, mu={"layer": {"proj": {"weight": target["params"]["layer"]["proj"][
            "weight"]}}}))}, partial=True, aliases=older)
    assert _bits(part) == [_bits(restored["opt_state"][1].mu["layer"]["proj"]["weight"])[0]]


def test_leaf_missing_under_both_names_is_a_structure_error(make_checkpointer):
    ckpt = make_checkpointer()
    ckpt.save(3, _state(new=False))
    ckpt.wait_until_finished()
    target = _abstract(_state(new=True))
    target["params"]["layer"]["gate"] = {"weight": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    with pytest.raises(CheckpointStructureError, match=r"params\.layer\.gate\.weight") as e:
        ckpt.restore(3, target, aliases={**_OLDER, "layer.gate.weight": "layer.gate"}.get)
    assert "params.layer.proj" not in str(e.value)  # The aliased leaves are fine.


def test_aliased_arrays_are_verified(make_checkpointer, tmp_path):
    ckpt = make_checkpointer()
    ckpt.save(3, _state(new=False))
    ckpt.wait_until_finished()
    manifest = tmp_path / "ckpt" / "step_00000003" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["arrays"]["opt_state.1.mu.layer.proj"]["digest"] = "0" * 16
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointCorruptionError) as e:
        ckpt.restore(3, _abstract(_state(new=True)), aliases=_OLDER.get)
    assert e.value.arrays == ["opt_state.1.mu.layer.proj"]
