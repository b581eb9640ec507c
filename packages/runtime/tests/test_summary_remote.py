"""The summary writer on an object store (S3 served locally by moto): metrics.jsonl is PUT
whole (periodically, on flush() and at close), a resume purges redone steps, TensorBoard
events land in the bucket; a missing TensorBoard backend is one line."""

import json
import struct

import pytest
from moto_s3 import start, use

from jaxlearn.checkpoint import StorageError
from jaxlearn.runtime import summary
from jaxlearn.runtime.summary import SummaryWriter


@pytest.fixture(scope="module")
def s3_server():
    server = start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    use(s3_server, monkeypatch)
    return s3_server


def _get(s3, key):
    return s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()


def _events(data):
    from tensorboardX.proto.event_pb2 import Event

    out, pos = [], 0
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        out.append(Event.FromString(data[pos + 12:pos + 12 + n]))
        pos += 12 + n + 4
    return out


def test_jsonl_put_on_flush_purged_on_resume_and_tensorboard_in_the_bucket(s3):
    uri = s3.uri()
    prefix = uri.removeprefix(f"s3://{s3.bucket}/")
    cfg = SummaryWriter.default_config().set(progress=False)
    first = cfg.instantiate(output_dir=uri, max_step=5)
    for step in range(1, 6):
        first.write(step, {"loss": float(step)})
    first.flush()  # Before a checkpoint: every record so far is in the object.
    rows = [json.loads(x) for x in _get(s3, f"{prefix}/metrics.jsonl").splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    first.close()
    resumed = cfg.instantiate(output_dir=uri, max_step=5, resumed_at=3)
    rows = [json.loads(x) for x in _get(s3, f"{prefix}/metrics.jsonl").splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # Purged at once, in one PUT.
    for step in (4, 5):
        resumed.write(step, {"loss": 10.0 + step})
    resumed.close()
    rows = [json.loads(x) for x in _get(s3, f"{prefix}/metrics.jsonl").splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0),
                                                       (4, 14.0), (5, 15.0)]
    events = [k for k in s3.keys(prefix) if k.startswith(f"{prefix}/tensorboard/events.out")]
    assert events, s3.keys(prefix)
    scalars = [(e.step, v.simple_value) for k in events for e in _events(_get(s3, k))
               for v in e.summary.value if v.tag == "train/loss"]
    assert sorted(scalars) == sorted([(s, float(s)) for s in range(1, 6)]
                                     + [(4, 14.0), (5, 15.0)])


def test_metrics_are_put_periodically_not_per_record(s3, monkeypatch):
    uri = s3.uri()
    prefix = uri.removeprefix(f"s3://{s3.bucket}/")
    clock = [1000.0]
    monkeypatch.setattr(summary.time, "monotonic", lambda: clock[0])
    writer = SummaryWriter.default_config().set(progress=False, tensorboard=False).instantiate(
        output_dir=uri, max_step=5)
    writer.write(1, {"loss": 1.0})
    assert f"{prefix}/metrics.jsonl" not in s3.keys(prefix)  # Within FLUSH_SECS: in memory.
    clock[0] += summary.FLUSH_SECS
    writer.write(2, {"loss": 2.0})
    assert len(_get(s3, f"{prefix}/metrics.jsonl").splitlines()) == 2
    writer.close()


def test_missing_tensorboard_backend_is_one_line(s3, monkeypatch):
    real = summary.importlib.util.find_spec
    monkeypatch.setattr(summary.importlib.util, "find_spec",
                        lambda name, *a: None if name == "boto3" else real(name, *a))
    uri = s3.uri("run")
    with pytest.raises(StorageError) as e:
        SummaryWriter.default_config().instantiate(output_dir=uri, max_step=5)
    assert str(e.value) == (f"{uri}: TensorBoard on s3:// needs the boto3 package, which is "
                            "not installed (pip install boto3, or set "
                            "summary_writer.tensorboard=False)")
