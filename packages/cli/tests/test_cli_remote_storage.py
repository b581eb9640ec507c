"""`jaxlearn train --output_dir s3://...` against a local S3-compatible server (moto):
a run SIGKILLed after a committed checkpoint resumes from the bucket and ends with
parameters bit-identical to an uninterrupted run; a missing bucket or backend is one line."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from moto_s3 import start, use

from jaxlearn.checkpoint import Checkpointer
from jaxlearn.cli.main import main

FAST = ["--set", "input.seq_len=32", "--set", "input.global_batch_size=8",
        "--set", "eval_every_n_steps=0", "--set", "log_every_n_steps=1",
        "--set", "learner.warmup_steps=0", "--mesh_selector", "cpu-8"]
TRAIN = ["train", "--experiment", "tiny-llama", *FAST, "--set", "save_every_n_steps=2",
         "--max_step", "6"]


@pytest.fixture(scope="module")
def s3_server():
    server = start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    use(s3_server, monkeypatch)
    monkeypatch.setenv("JAXLEARN_LOCAL_DIR", str(tmp_path / "local"))
    return s3_server


def _params(directory):
    """{path: array} of the newest step's params, read back through the Checkpointer."""
    with Checkpointer.default_config().set(directory=directory).instantiate() as ckpt:
        step = ckpt.latest_step()
        meta = ckpt.read_metadata(step)
        target: dict = {}
        for path, rec in meta.arrays.items():
            if not path.startswith("params."):
                continue
            node = target
            *parents, leaf = path.split(".")
            for name in parents:
                node = node.setdefault(name, {})
            node[leaf] = np.zeros(rec.shape, rec.dtype)
        restored = ckpt.restore(step, target, partial=True)
    flat: dict = {}

    def walk(prefix, node):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            else:
                flat[prefix + k] = np.asarray(v)

    walk("", restored)
    return step, flat


def _object(s3, key):
    return s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()


def test_sigkill_after_a_commit_then_resume_from_s3_is_bit_identical(s3, tmp_path):
    straight = str(tmp_path / "straight")
    assert main([*TRAIN, "--output_dir", straight]) == 0

    uri = s3.uri("split")
    prefix = uri.removeprefix(f"s3://{s3.bucket}/")
    committed = f"{prefix}/checkpoints/step_00000004/manifest.json"
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8"}
    # The child blocks before step 5 (fault hang@5) while step 4 commits in the background.
    child = subprocess.Popen(
        [sys.executable, "-m", "jaxlearn.cli", *TRAIN, "--output_dir", uri,
         "--set", "resilience.faults=hang@5"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while committed not in s3.keys(f"{prefix}/checkpoints/step_00000004/"):
            assert child.poll() is None, child.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "step 4 was never committed"
            time.sleep(0.5)
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    assert f"{prefix}/checkpoints/step_00000006/manifest.json" not in s3.keys(prefix)

    assert main([*TRAIN, "--output_dir", uri]) == 0
    step_a, a = _params(os.path.join(straight, "checkpoints"))
    step_b, b = _params(uri + "/checkpoints")
    assert step_a == step_b == 6 and sorted(a) == sorted(b) and a
    for path in a:
        assert a[path].dtype == b[path].dtype and a[path].tobytes() == b[path].tobytes(), path

    keys = s3.keys(prefix)
    for name in ("config.txt", "run.json", "metrics.jsonl"):
        assert f"{prefix}/{name}" in keys, keys
    assert any(k.startswith(f"{prefix}/tensorboard/events.out") for k in keys), keys
    rows = [json.loads(line) for line in _object(s3, f"{prefix}/metrics.jsonl").splitlines()]
    with open(os.path.join(straight, "metrics.jsonl")) as f:
        want = [json.loads(line) for line in f]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7))  # Redone steps appear once.
    assert [r["loss"] for r in train] == [r["loss"] for r in want if r["split"] == "train"]
    assert not os.path.exists("s3:")


def test_missing_bucket_is_one_line_and_writes_nothing(s3, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main([*TRAIN, "--output_dir", "s3://no-such-bucket/run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert err == ["jaxlearn: error: --output_dir s3://no-such-bucket/run: bucket "
                   "'no-such-bucket' does not exist"], err
    assert os.listdir(tmp_path) == []  # No local "s3:" folder, no local mirror.


def test_gs_without_gcsfs_is_one_line(capsys, tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    monkeypatch.chdir(tmp_path)
    rc = main([*TRAIN, "--output_dir", "gs://bkt/run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["jaxlearn: error: --output_dir gs://bkt/run: gs:// needs the "
                               "gcsfs package, which is not installed (pip install gcsfs)"], err
    assert os.listdir(tmp_path) == []
