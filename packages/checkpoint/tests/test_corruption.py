"""Corruption matrix: each kind of damage is detected, named, and skipped by restore_latest.

Steps 1, 2, 3 are saved with distinct values; then step 3 (the newest) is damaged and
  * restore(3) raises CheckpointCorruptionError naming step 3 and the array or file,
  * restore_latest falls back to step 2 (bit-exact) and logs why,
  * a later save + GC deletes no good step.
"""

import logging
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.checkpoint import CheckpointCorruptionError, NoGoodCheckpointError

# After a failed read orbax leaves callbacks on a closed asyncio loop (harmless noise).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def _state(step: int):
    m = _mesh()
    # Chunks of params.w (64x16 f32 = 4 KiB) exceed OCDBT's 1 KiB inline limit, so they
    # live in the per-process data files, as any real array does.
    w = np.arange(128 * 64, dtype=np.float32).reshape(128, 64) * (step + 1)
    b = np.full((32,), step, np.int32)
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(m, PartitionSpec("data", "model"))),
            "b": jax.device_put(b, NamedSharding(m, PartitionSpec())),
        },
        "step": step,
    }


def _target():
    return {
        "params": {
            "w": jax.ShapeDtypeStruct((128, 64), jnp.float32),
            "b": jax.ShapeDtypeStruct((32,), jnp.int32),
        },
        "step": 0,
    }


def _assert_is_step(restored, step):
    want = _state(step)
    assert restored["step"] == step
    for k in ("w", "b"):
        assert (
            np.asarray(restored["params"][k]).tobytes() == np.asarray(want["params"][k]).tobytes()
        )


@pytest.fixture
def saved(make_checkpointer):
    """A checkpointer with committed steps 1, 2, 3."""
    ckpt = make_checkpointer()
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), data_iterator_state=b"iter%d" % step, config_text="a: 1\n")
    ckpt.wait_until_finished()
    assert ckpt.steps() == [1, 2, 3]
    return ckpt


def _step_dir(ckpt, step: int) -> Path:
    return Path(ckpt.directory) / f"step_{step:08d}"


def _data_files(ckpt, step: int) -> list[Path]:
    """The OCDBT data files of the process-0 sub-store (where chunks live), largest first."""
    root = _step_dir(ckpt, step) / "state" / "ocdbt.process_0" / "d"
    return sorted(root.iterdir(), key=lambda p: p.stat().st_size, reverse=True)


def _file_holding(ckpt, step: int, needle: bytes) -> tuple[Path, int]:
    for path in _data_files(ckpt, step):
        at = path.read_bytes().find(needle)
        if at >= 0:
            return path, at
    raise AssertionError("needle not found in any data file")


def _flip(path: Path, at: int, n: int = 16) -> None:
    data = bytearray(path.read_bytes())
    for i in range(at, at + n):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _check_fallback(ckpt, caplog, *, newest_good: int = 2) -> None:
    with caplog.at_level(logging.WARNING, logger="jaxlearn.checkpoint"):
        step, restored = ckpt.restore_latest(_target())
    assert step == newest_good
    _assert_is_step(restored, newest_good)
    assert any("falling back" in r.getMessage() for r in caplog.records)


def _check_no_good_step_deleted(ckpt, good: list[int]) -> None:
    ckpt.save(10, _state(10))
    ckpt.wait_until_finished()
    for step in good:
        _assert_is_step(ckpt.restore(step, _target()), step)


@pytest.mark.parametrize("compression", [True, False], ids=["zstd", "raw"])
@pytest.mark.parametrize("hash_limit", [1 << 20, 0], ids=["files-hashed", "digest-only"])
def test_flipped_bytes_in_array_data(make_checkpointer, caplog, compression, hash_limit):
    # With hash_limit=0 no data file has a sha256 in the manifest: only the array digest
    # can see the damage. With the default, the file hash sees it first and the per-array
    # diagnosis then names the array.
    ckpt = make_checkpointer(use_compression=compression, hash_files_up_to_bytes=hash_limit)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step))
    ckpt.wait_until_finished()
    if compression:  # Compressed bytes cannot be located: flip mid-file.
        path = _data_files(ckpt, 3)[0]
        at = path.stat().st_size // 2
    else:  # Flip inside row 1 of params.w, on device 0's chunk.
        chunk = np.asarray(_state(3)["params"]["w"])[1, :8].tobytes()
        path, at = _file_holding(ckpt, 3, chunk)
    _flip(path, at)
    with pytest.raises(CheckpointCorruptionError) as err:
        ckpt.restore(3, _target())
    msg = str(err.value)
    assert err.value.step == 3 and "step 3" in msg
    assert "params.w" in err.value.arrays, msg
    if not compression:
        assert "digest" in msg, msg
    _check_fallback(ckpt, caplog)
    _check_no_good_step_deleted(ckpt, [1, 2])


def test_flipped_bytes_pass_silently_without_verification(make_checkpointer):
    """The blind spot our digests close: orbax alone returns wrong data."""
    ckpt = make_checkpointer(use_compression=False, verify_on_restore=False)
    ckpt.save(3, _state(3))
    ckpt.wait_until_finished()
    chunk = np.asarray(_state(3)["params"]["w"])[1, :8].tobytes()
    path, at = _file_holding(ckpt, 3, chunk)
    _flip(path, at)
    restored = ckpt.restore(3, _target())
    assert not np.array_equal(
        np.asarray(restored["params"]["w"]), np.asarray(_state(3)["params"]["w"])
    )


def test_truncated_data_file(saved, caplog):
    path = _data_files(saved, 3)[0]
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(CheckpointCorruptionError) as err:
        saved.restore(3, _target())
    rel = path.relative_to(_step_dir(saved, 3)).as_posix()
    assert rel in err.value.files and "bytes" in str(err.value)
    assert "params.w" in err.value.arrays, str(err.value)
    _check_fallback(saved, caplog)
    _check_no_good_step_deleted(saved, [1, 2])


def test_deleted_data_file(saved, caplog):
    path = _data_files(saved, 3)[0]
    path.unlink()
    with pytest.raises(CheckpointCorruptionError) as err:
        saved.restore(3, _target())
    assert "is missing" in str(err.value) and err.value.arrays, str(err.value)
    _check_fallback(saved, caplog)
    _check_no_good_step_deleted(saved, [1, 2])


def test_missing_manifest(saved, caplog):
    (_step_dir(saved, 3) / "manifest.json").unlink()
    assert saved.steps() == [1, 2]  # Not a committed step any more.
    with pytest.raises(CheckpointCorruptionError, match="manifest.json is missing") as err:
        saved.restore(3, _target())
    assert err.value.step == 3
    _check_fallback(saved, caplog)
    _check_no_good_step_deleted(saved, [1, 2])
    assert _step_dir(saved, 3).is_dir()  # Has files: left for a human, never auto-deleted.


def test_unreadable_manifest(saved, caplog):
    manifest = _step_dir(saved, 3) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    with pytest.raises(CheckpointCorruptionError, match="manifest.json is unreadable"):
        saved.restore(3, _target())
    _check_fallback(saved, caplog)


@pytest.mark.parametrize("name", ["_METADATA", "_sharding", "manifest.ocdbt"])
def test_missing_orbax_metadata(saved, caplog, name):
    (_step_dir(saved, 3) / "state" / name).unlink()
    with pytest.raises(CheckpointCorruptionError) as err:
        saved.restore(3, _target())
    assert f"state/{name}" in err.value.files and "step 3" in str(err.value)
    _check_fallback(saved, caplog)


def test_altered_sidecars(saved):
    (_step_dir(saved, 3) / "data_iterator" / "process_00000.bin").write_bytes(b"iter9")
    with pytest.raises(CheckpointCorruptionError, match="data_iterator/process_00000.bin"):
        saved.read_metadata(3)
    (_step_dir(saved, 2) / "config.txt").write_text("a: 2\n")
    with pytest.raises(CheckpointCorruptionError, match="config.txt"):
        saved.read_metadata(2)
    assert saved.read_metadata(1).data_iterator_state == b"iter1"


def test_empty_step_dir_is_ignored_and_cleaned(saved, caplog):
    empty = _step_dir(saved, 7)
    empty.mkdir()
    assert saved.steps() == [1, 2, 3]
    with pytest.raises(CheckpointCorruptionError, match="step 7"):
        saved.restore(7, _target())
    _check_fallback(saved, caplog, newest_good=3)
    _check_no_good_step_deleted(saved, [1, 2, 3])
    assert not empty.exists()  # Removed by the GC after the save of step 10.


def test_tmp_dir_is_ignored_and_cleaned(saved, caplog):
    # A crashed save of step 8: everything but the manifest, under the tmp name.
    tmp = Path(saved.directory) / "step_00000008.tmp"
    shutil.copytree(_step_dir(saved, 3), tmp)
    (tmp / "manifest.json").unlink()
    assert saved.steps() == [1, 2, 3]
    step, restored = saved.restore_latest(_target())
    assert step == 3
    _assert_is_step(restored, 3)
    _check_no_good_step_deleted(saved, [1, 2, 3])
    assert not tmp.exists()
    assert sorted(os.listdir(saved.directory)) == [f"step_{s:08d}" for s in (1, 2, 3, 10)]


def test_every_step_damaged(saved):
    for step in (1, 2, 3):
        (_step_dir(saved, step) / "state" / "_METADATA").unlink()
    with pytest.raises(NoGoodCheckpointError) as err:
        saved.restore_latest(_target())
    assert set(err.value.failures) == {1, 2, 3}
