"""`locate` (run dir, checkpoints/ dir, step dir) and `restore_subtree` (one subtree of the
newest good step or of a given step, into given shardings)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.checkpoint import CheckpointNotFoundError, locate, restore_subtree


def _state(v):
    return {"params": {"w": np.full((8, 4), v, np.float32)},
            "ema": {"w": np.full((8, 4), -v, np.float32)},
            "opt": {"m": np.zeros((3,), np.float32)}}


@pytest.fixture
def run_dir(tmp_path, make_checkpointer):
    ckpt = make_checkpointer(tmp_path / "run" / "checkpoints")
    for step in (1, 2):
        ckpt.save(step, _state(float(step)))
    ckpt.wait_until_finished()
    return tmp_path / "run"


def test_locate_forms(run_dir):
    root = run_dir / "checkpoints"
    assert locate(run_dir) == (root, None)
    assert locate(root) == (root, None)
    assert locate(root / "step_00000001") == (root, 1)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint step"):
        locate(run_dir.parent)


def test_restore_subtree_newest_step_and_given_step(run_dir):
    abstract = {"w": jax.ShapeDtypeStruct((8, 4), np.float32)}
    root, step = locate(run_dir)
    params, got = restore_subtree(root, "params", abstract, step=step)
    assert got == 2 and np.all(np.asarray(params["w"]) == 2.0)
    ema, got = restore_subtree(root, "ema", abstract, step=1)
    assert got == 1 and np.all(np.asarray(ema["w"]) == -1.0)
    with pytest.raises(ValueError, match="subtree='opt'"):
        restore_subtree(root, "opt", abstract)


def test_restore_subtree_into_shardings(run_dir):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    sharding = {"w": NamedSharding(mesh, PartitionSpec("data", None))}
    abstract = {"w": jax.ShapeDtypeStruct((8, 4), np.float32)}
    params, _ = restore_subtree(run_dir / "checkpoints", "params", abstract,
                                shardings=sharding)
    assert params["w"].sharding == sharding["w"]
    assert np.all(np.asarray(params["w"]) == 2.0)


def test_restore_subtree_skip_missing(run_dir):
    abstract = {"w": jax.ShapeDtypeStruct((8, 4), np.float32),
                "w_lora_a": jax.ShapeDtypeStruct((8, 2), np.float32)}
    params, _ = restore_subtree(run_dir / "checkpoints", "params", abstract,
                                skip_missing=True)
    assert set(params) == {"w"}


def test_restore_subtree_reads_renamed_leaves_under_their_older_names(run_dir):
    """`aliases`: a leaf the step lacks (`proj.weight`) is read where an older layout put
    it (`w`) and returned at its own path; leaves the step holds are read as they are."""
    abstract = {"proj": {"weight": jax.ShapeDtypeStruct((8, 4), np.float32)},
                "adapter": {"a": jax.ShapeDtypeStruct((8, 2), np.float32)}}
    older = {"proj.weight": "w"}
    params, step = restore_subtree(run_dir / "checkpoints", "params", abstract,
                                   skip_missing=True, aliases=older.get)
    assert step == 2 and set(params) == {"proj"} and set(params["proj"]) == {"weight"}
    assert np.all(np.asarray(params["proj"]["weight"]) == 2.0)
    plain, _ = restore_subtree(run_dir / "checkpoints", "params",
                               {"w": jax.ShapeDtypeStruct((8, 4), np.float32)},
                               aliases=lambda path: "nowhere")
    assert np.all(np.asarray(plain["w"]) == 2.0)
