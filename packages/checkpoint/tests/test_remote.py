"""Checkpoints on an object store (S3, served locally by moto): the same commit protocol
(the manifest's PUT is the commit), digests, file inventory, retention and async save,
and one-line errors for a missing backend, credentials or bucket."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from moto_s3 import start, use
from test_multiprocess import WORKER, _free_port
from test_roundtrip import abstract, assert_bit_equal, make_state, mesh, spec_4x2

from jaxlearn.checkpoint import (
    CheckpointCorruptionError,
    Checkpointer,
    StorageError,
    storage,
)


@pytest.fixture(scope="module")
def s3_server():
    server = start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    use(s3_server, monkeypatch)
    return s3_server


def ckpt_on(uri, **fields):
    return Checkpointer.default_config().set(directory=uri, **fields).instantiate()


def test_round_trip_on_s3_resharded_with_metadata(s3):
    m = mesh((2, 4), ("data", "model"))
    state = make_state(m)
    uri = s3.uri()
    with ckpt_on(uri) as ckpt:
        ckpt.save(10, state, extra={"tokens": 123}, data_iterator_state={"pos": 7},
                  config_text="a: 1\n", metrics={"loss": 2.5}, extra_files={"run.json": b"{}"})
        ckpt.wait_until_finished()
        assert ckpt.steps() == [10]
        keys = s3.keys(uri)
        step = uri.removeprefix(f"s3://{s3.bucket}/") + "/step_00000010/"
        assert step + "manifest.json" in keys and step + "config.txt" in keys
        assert not [k for k in keys if ".tmp" in k or not k.startswith(step)], keys
        restored = ckpt.restore(10, abstract(state, mesh((4, 2), ("y", "x")), spec_4x2))
        meta = ckpt.read_metadata(10)
    assert_bit_equal(restored, state)
    assert meta.extra == {"tokens": 123} and meta.metrics == {"loss": 2.5}
    assert meta.data_iterator_state == {"pos": 7} and meta.config_text == "a: 1\n"
    manifest = json.loads(s3.client().get_object(Bucket=s3.bucket, Key=step + "manifest.json")
                          ["Body"].read())
    assert manifest["files"]["run.json"]["sha256"]
    # A second Checkpointer (a restarted job) sees the same step.
    with ckpt_on(uri + "/") as again:
        assert again.latest_step() == 10


def _flip_bytes_of(s3, uri, needle):
    """Flips the 16 bytes at `needle` in the data object of step 2 that holds them."""
    client = s3.client()
    for key in s3.keys(uri):
        if "step_00000002/state/ocdbt.process_0/d/" not in key:
            continue
        data = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
        at = data.find(needle)
        if at >= 0:
            for i in range(at, at + 16):
                data[i] ^= 0x5A
            client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
            return
    raise AssertionError("needle not found in any data object")


def test_flipped_bytes_in_an_object_are_caught_and_restore_latest_falls_back(s3):
    x = np.random.default_rng(1).standard_normal((64, 64), dtype=np.float32)
    uri = s3.uri()
    with ckpt_on(uri, use_compression=False, hash_files_up_to_bytes=0) as ckpt:
        ckpt.save(1, {"w": jax.numpy.asarray(x)})
        ckpt.save(2, {"w": jax.numpy.asarray(x + 1)})
        ckpt.wait_until_finished()
        _flip_bytes_of(s3, uri, (x + 1)[3, :8].tobytes())
        target = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype)}
        with pytest.raises(CheckpointCorruptionError) as err:
            ckpt.restore(2, target)
        assert err.value.arrays == ["w"] and "digest" in str(err.value), str(err.value)
        step, got = ckpt.restore_latest(target)
    assert step == 1 and np.asarray(got["w"]).tobytes() == x.tobytes()


def test_crashed_save_is_invisible_and_cleaned_retention_deletes_old_steps(s3):
    uri = s3.uri()
    prefix = uri.removeprefix(f"s3://{s3.bucket}/")
    # What a save killed before its manifest leaves: objects under step_00000003/.
    s3.client().put_object(Bucket=s3.bucket, Key=f"{prefix}/step_00000003/state/x", Body=b"1")
    with ckpt_on(uri, keep_last_n=2) as ckpt:
        assert ckpt.steps() == [] and ckpt.restore_latest({"w": np.zeros(2)}) is None
        for step in range(1, 6):
            ckpt.save(step, {"w": jax.numpy.full((8,), float(step))}, snapshot=step % 2 == 0)
        ckpt.wait_until_finished()
        assert ckpt.steps() == [4, 5]
        step, got = ckpt.restore_latest({"w": np.zeros(8, np.float32)})
    assert step == 5 and got["w"].tolist() == [5.0] * 8
    dirs = {k.split("/")[1] for k in s3.keys(prefix)}
    assert dirs == {"step_00000004", "step_00000005"}, dirs
    assert f"{prefix}/step_00000003/state/x" not in s3.keys(prefix)


def test_async_save_returns_before_the_commit(s3, monkeypatch):
    from jaxlearn.checkpoint import commit

    uri = s3.uri()
    released = []
    finish = commit.finish

    def slow_finish(*args, **kwargs):
        while not released:
            pass
        return finish(*args, **kwargs)

    monkeypatch.setattr(commit, "finish", slow_finish)
    with ckpt_on(uri) as ckpt:
        ckpt.save(1, {"w": jax.numpy.ones((4,))})
        assert ckpt.steps() == []  # Not committed while the commit thread waits.
        released.append(True)
        ckpt.wait_until_finished()
        assert ckpt.steps() == [1]


def test_quarantine_moves_steps_aside_on_s3(s3):
    uri = s3.uri()
    with ckpt_on(uri) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": jax.numpy.ones((4,))})
        ckpt.wait_until_finished()
        moved = ckpt.quarantine_newer_than(1)
        assert [str(p).rsplit("/", 1)[-1] for p in moved] == ["step_00000002.corrupt"]
        assert ckpt.steps() == [1]
    assert any("step_00000002.corrupt/manifest.json" in k for k in s3.keys(uri))


def test_missing_bucket_credentials_or_backend_is_one_line(s3, monkeypatch):
    with pytest.raises(StorageError, match=r"s3://no-such-bucket/x: bucket 'no-such-bucket' "
                                           r"does not exist"):
        storage.resolve("s3://no-such-bucket/x")
    with pytest.raises(StorageError, match="no bucket name"):
        storage.resolve("s3:///x")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    storage.check_backend.cache_clear()
    with pytest.raises(StorageError, match=rf"{s3.uri('a')}: no AWS credentials found"):
        Checkpointer.default_config().set(directory=s3.uri("a")).instantiate()


def test_unreachable_endpoint_is_one_line(s3, monkeypatch):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # Closed once the block ends: nothing listens there.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    storage.check_backend.cache_clear()
    with pytest.raises(StorageError) as e:
        storage.resolve(f"s3://{s3.bucket}/x")
    assert f"cannot reach bucket '{s3.bucket}' at http://127.0.0.1:{port}" in str(e.value)
    assert "\n" not in str(e.value)


def test_gcs_without_gcsfs_names_the_missing_package():
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(StorageError, match=r"^gs://bkt/run: gs:// needs the gcsfs package"):
        storage.resolve("gs://bkt/run")


def test_two_processes_commit_reshard_and_agree_on_damage_on_s3(s3, tmp_path):
    """The multi-process protocol on S3: both processes' shards and iterator states under
    step_n/, the manifest PUT after both, damage in process 1's objects agreed on."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    uri, port = s3.uri(), str(_free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(script), uri, port, str(pid)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                              text=True) for pid in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for pid, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and f"WORKER-OK {pid}" in out, out[-3000:]
    keys = s3.keys(uri)
    step1 = uri.removeprefix(f"s3://{s3.bucket}/") + "/step_00000001/"
    for name in ("state/ocdbt.process_0/", "state/ocdbt.process_1/",
                 "data_iterator/process_00001.bin", "manifest.json"):
        assert any(k.startswith(step1 + name) for k in keys), (name, keys)
    with ckpt_on(uri) as ckpt:  # One process alone restores it bit for bit.
        got = ckpt.restore(1, {"w": np.zeros((64, 32), np.float32), "b": np.zeros(8, np.int32)})
        assert ckpt.read_metadata(1, process_index=1).data_iterator_state == b"proc1-step1"
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    assert got["w"].tobytes() == w.tobytes() and got["b"].tolist() == [1] * 8
