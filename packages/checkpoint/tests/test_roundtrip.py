"""Round trips: bit-exact across meshes and dtypes, subsets, metadata, async overlap."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxlearn.checkpoint import (
    CheckpointCorruptionError,
    Checkpointer,
    CheckpointError,
    CheckpointStructureError,
    StepMetadata,
)
from jaxlearn.config import RequiredFieldError, to_flat_text


def mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def put(x, m, *spec):
    return jax.device_put(x, NamedSharding(m, PartitionSpec(*spec)))


def host(tree):
    """Bit-exact host copies (keys as key data) for comparisons."""

    def one(x):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(one, tree)


def assert_bit_equal(a, b):
    la, lb = jax.tree.leaves(host(a)), jax.tree.leaves(host(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def make_state(m):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((16, 8), dtype=np.float32)
    f32[0, :3] = [np.nan, -0.0, np.inf]  # Bit patterns that value comparison would miss.
    return {
        "params": {
            "w": put(f32, m, "data", "model"),
            "b": put(rng.standard_normal(8).astype(ml_dtypes.bfloat16), m, None),
            "emb": put(rng.integers(-128, 127, (8, 4), dtype=np.int8), m, "model", None),
        },
        "opt": [
            put(rng.standard_normal((16, 8)).astype(np.float16), m, ("data", "model")),
            put(rng.integers(0, 2**32 - 1, (4,), dtype=np.uint32), m, None),
            put(rng.random((8,)) > 0.5, m, "data"),
        ],
        "rng": jax.random.key(42),
        "count": jnp.int32(7),
        "host_table": np.arange(6, dtype=np.int32).reshape(2, 3),
        "step": 5,
    }


def abstract(state, m, spec_fn):
    """ShapeDtypeStructs of `state` on mesh `m` with specs from spec_fn(x)."""

    def one(x):
        if isinstance(x, jax.Array):
            s = (
                NamedSharding(m, spec_fn(x))
                if m is not None
                else SingleDeviceSharding(jax.devices()[0])
            )
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        return x

    return jax.tree.map(one, state)


def spec_4x2(x):
    if x.ndim == 2:
        return PartitionSpec("y", "x")
    if x.ndim == 1 and x.shape[0] % 4 == 0:
        return PartitionSpec("x")
    return PartitionSpec()


def test_round_trip_across_meshes_2x4_4x2_1(make_checkpointer):
    state = make_state(mesh((2, 4), ("data", "model")))
    ckpt = make_checkpointer()
    ckpt.save(1, state)
    ckpt.wait_until_finished()

    m42 = mesh((4, 2), ("x", "y"))
    on_42 = ckpt.restore(1, abstract(state, m42, spec_4x2))
    assert_bit_equal(on_42, state)
    assert on_42["params"]["w"].sharding.spec == PartitionSpec("y", "x")
    assert isinstance(on_42["step"], int) and on_42["step"] == 5
    assert isinstance(on_42["host_table"], np.ndarray)

    ckpt.save(2, on_42)  # Saved from the 4x2 layout ...
    ckpt.wait_until_finished()
    on_1 = ckpt.restore(2, abstract(state, None, None))  # ... restored onto one device.
    assert_bit_equal(on_1, state)
    assert on_1["params"]["w"].sharding.device_set == {jax.devices()[0]}


@pytest.mark.parametrize("saved_zarr3", [False, True])
def test_zarr2_and_zarr3_steps_restore_with_either_setting(make_checkpointer, tmp_path,
                                                            saved_zarr3):
    """A step written in one array format (zarr2, or zarr3 with small OCDBT data files, the
    default) restores bit-exact, verified, through a Checkpointer
    configured for the other, resharded 2x4 -> 4x2."""
    state = make_state(mesh((2, 4), ("data", "model")))
    writer = make_checkpointer(use_zarr3=saved_zarr3, data_file_bytes=4096)
    writer.save(1, state)
    writer.wait_until_finished()
    state_dir = tmp_path / "ckpt" / "step_00000001" / "state"
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state_dir}"}).result()
    meta = "params.w/zarr.json" if saved_zarr3 else "params.w/.zarray"
    assert meta.encode() in kv.list().result()
    reader = make_checkpointer(use_zarr3=not saved_zarr3)
    assert_bit_equal(reader.restore(1, abstract(state, mesh((4, 2), ("x", "y")), spec_4x2)),
                     state)


def test_restore_into_other_dtypes(make_checkpointer):
    m = mesh((2, 4), ("data", "model"))
    w = np.random.default_rng(1).standard_normal((8, 8), dtype=np.float32)
    ckpt = make_checkpointer()
    ckpt.save(3, {"w": put(w, m, "data", None), "h": w.copy()}, config_text=None)
    ckpt.wait_until_finished()
    sharding = NamedSharding(mesh((8,), ("d",)), PartitionSpec(None, "d"))
    target = {
        "w": jax.ShapeDtypeStruct((8, 8), jnp.bfloat16, sharding=sharding),
        "h": np.zeros((8, 8), np.float16),
    }
    out = ckpt.restore(3, target)
    assert out["w"].dtype == jnp.bfloat16 and out["w"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(out["w"]), w.astype(ml_dtypes.bfloat16))
    assert out["h"].dtype == np.float16
    np.testing.assert_array_equal(out["h"], w.astype(np.float16))


def test_partial_restore_and_structure_errors(make_checkpointer):
    state = make_state(mesh((2, 4), ("data", "model")))
    ckpt = make_checkpointer()
    ckpt.save(1, state)
    ckpt.wait_until_finished()
    params_only = {"params": abstract(state, None, None)["params"]}
    out = ckpt.restore(1, params_only, partial=True)
    assert set(out) == {"params"}
    assert_bit_equal(out["params"], state["params"])

    with pytest.raises(CheckpointStructureError) as err:
        ckpt.restore(1, params_only)  # Not partial: everything else is missing.
    assert "count" in err.value.missing and "opt.0" in err.value.missing
    assert "pass partial=True" in str(err.value)

    bad = dict(params_only)
    bad["params"] = dict(bad["params"], extra_bias=jax.ShapeDtypeStruct((3,), jnp.float32))
    with pytest.raises(CheckpointStructureError) as err:
        ckpt.restore(1, bad, partial=True)
    assert err.value.unexpected == ["params.extra_bias"] and err.value.missing == []
    assert "params.extra_bias" in str(err.value) and "step 1" in str(err.value)

    wrong_shape = {"params": {"w": jax.ShapeDtypeStruct((8, 16), jnp.float32)}}
    with pytest.raises(CheckpointStructureError, match=r"params\.w: target shape \(8, 16\)"):
        ckpt.restore(1, wrong_shape, partial=True)


@pytest.mark.parametrize(
    "iter_state", [b"\x00grain-state\xff", "text state", {"next_index": 17, "seed": [1, 2]}]
)
def test_metadata_round_trip(make_checkpointer, iter_state):
    ckpt = make_checkpointer()
    cfg = Checkpointer.default_config().set(directory="/x", keep_last_n=2)
    ckpt.save(
        4,
        {"x": jnp.arange(4.0)},
        extra={"tokens_seen": 1024, "note": "ok", "nested": {"a": [1, 2.5, None]}},
        data_iterator_state=iter_state,
        config_text=to_flat_text(cfg),
        metrics={"loss": jnp.float32(0.25), "acc": 0.5},
    )
    ckpt.wait_until_finished()
    md = ckpt.read_metadata(4)
    assert isinstance(md, StepMetadata)
    assert md.extra == {"tokens_seen": 1024, "note": "ok", "nested": {"a": [1, 2.5, None]}}
    assert md.metrics == {"loss": 0.25, "acc": 0.5}
    assert md.config_text == to_flat_text(cfg) and "keep_last_n: 2" in md.config_text
    assert md.data_iterator_state == iter_state and type(md.data_iterator_state) is type(iter_state)
    assert md.arrays["x"].shape == (4,) and md.arrays["x"].dtype == "float32"
    assert md.process_count == 1
    assert ckpt.read_metadata(4, process_index=3).data_iterator_state is None


def test_extra_files_written_and_covered_by_the_manifest(make_checkpointer):
    ckpt = make_checkpointer()
    record = b'{"experiment": "tiny-llama"}\n'
    ckpt.save(2, {"x": jnp.arange(3.0)}, extra_files={"run.json": record})
    ckpt.wait_until_finished()
    step_dir = ckpt.directory / "step_00000002"
    assert (step_dir / "run.json").read_bytes() == record
    files = json.loads((step_dir / "manifest.json").read_text())["files"]
    assert files["run.json"]["sha256"] is not None
    (step_dir / "run.json").write_bytes(record.replace(b"tiny", b"huge"))  # Same size.
    with pytest.raises(CheckpointCorruptionError, match="run.json"):
        ckpt.restore(2, {"x": jax.ShapeDtypeStruct((3,), jnp.float32)})


@pytest.mark.parametrize("files, error, message", [
    ({"../run.json": b""}, ValueError, "plain file name"),
    ({"config.txt": b""}, ValueError, "plain file name"),
    ({"manifest.json": b""}, ValueError, "plain file name"),
    ({"run.json": "text"}, TypeError, "must be bytes"),
])
def test_extra_files_rejects_bad_names_and_values(make_checkpointer, files, error, message):
    ckpt = make_checkpointer()
    with pytest.raises(error, match=message):
        ckpt.save(1, {"x": jnp.zeros(2)}, extra_files=files)
    assert ckpt.steps() == []


def test_save_rejects_bad_inputs(make_checkpointer):
    ckpt = make_checkpointer()
    with pytest.raises(TypeError, match="extra is not JSON"):
        ckpt.save(1, {"x": jnp.zeros(2)}, extra={"bad": object()})
    with pytest.raises(TypeError, match="unsupported type"):
        ckpt.save(1, {"x": "a string"})
    with pytest.raises(ValueError, match="cannot name a checkpoint array"):
        ckpt.save(1, {"a.b": jnp.zeros(2)})
    ckpt.save(1, {"x": jnp.zeros(2)})
    ckpt.wait_until_finished()
    with pytest.raises(FileExistsError, match="step 1 already exists"):
        ckpt.save(1, {"x": jnp.zeros(2)})
    with pytest.raises(CheckpointError):
        ckpt.restore(99, {"x": jnp.zeros(2)})


def test_config_is_configurable(tmp_path):
    with pytest.raises(RequiredFieldError, match="directory"):
        Checkpointer.default_config().instantiate()
    with pytest.raises(ValueError, match="best_metric"):
        Checkpointer.default_config().set(directory=str(tmp_path), keep_best_n=2).instantiate()
    cfg = Checkpointer.default_config().set(directory=str(tmp_path), keep_last_n=3)
    text = to_flat_text(cfg)
    assert (
        "keep_last_n: 3" in text and "klass: jaxlearn.checkpoint.checkpointer.Checkpointer" in text
    )
    with cfg.instantiate() as ckpt:
        assert ckpt.steps() == [] and ckpt.latest_step() is None
        assert ckpt.restore_latest({"x": jnp.zeros(2)}) is None


def _written_elements(state_dir: str, array: str) -> int:
    """How many elements of `array` the save wrote (chunk count x chunk size)."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state_dir}"}).result()
    keys = [k.decode() for k in kv.list().result() if k.decode().startswith(array + "/")]
    meta = {k for k in keys if k.endswith((".zarray", "zarr.json"))}
    chunks = [k for k in keys if k not in meta]
    (name,) = meta
    found = json.loads(kv.read(name).result().value)
    if name.endswith("zarr.json"):  # zarr3: a key per chunk of the regular grid.
        shape = found["chunk_grid"]["configuration"]["chunk_shape"]
    else:
        shape = found["chunks"]
    return len(chunks) * int(np.prod(shape))


def test_replicated_arrays_written_once(make_checkpointer):
    m = mesh((2, 4), ("data", "model"))
    state = {
        "replicated": put(np.arange(64, dtype=np.float32), m),
        "half": put(np.arange(64, dtype=np.float32).reshape(8, 8), m, "data", None),
        "full": put(np.arange(64, dtype=np.float32).reshape(8, 8), m, "data", "model"),
    }
    ckpt = make_checkpointer()
    ckpt.save(1, state)
    ckpt.wait_until_finished()
    state_dir = os.path.join(ckpt.directory, "step_00000001", "state")
    # 8 replicas (or 4 per shard) on 8 devices, yet each element is written exactly once
    # (orbax spreads one replica's data over the replicas as disjoint slices).
    for name in state:
        assert _written_elements(state_dir, name) == 64, name


def test_async_save_overlapping_training_does_not_change_results(make_checkpointer):
    m = mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((64, 64), dtype=np.float32)
    x = put(rng.standard_normal((16, 64), dtype=np.float32), m, "data", None)

    @jax.jit
    def step(w, x):
        g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g

    donating = jax.jit(step.__wrapped__, donate_argnums=0)

    def train(w, n, save_at=None, ckpt=None):
        for i in range(n):
            if i == save_at:
                ckpt.save(i, {"w": w}, metrics={"i": i})  # Returns before the write ends.
            w = donating(w, x)
        return np.asarray(w)

    reference = train(put(w0, m, "data", "model"), 6)
    ckpt = make_checkpointer()
    w = put(w0, m, "data", "model")
    for _ in range(3):
        w = step(w, x)
    snapshot = np.asarray(w).copy()
    got = train(w, 3, save_at=0, ckpt=ckpt)  # Donates `w` while the save is in flight.
    ckpt.wait_until_finished()
    np.testing.assert_array_equal(got, reference)
    restored = ckpt.restore(0, {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)})
    assert np.asarray(restored["w"]).tobytes() == snapshot.tobytes()


def test_sync_mode_commits_before_returning(make_checkpointer):
    ckpt = make_checkpointer(async_save=False)
    ckpt.save(1, {"x": jnp.ones(3)})
    assert ckpt.steps() == [1]  # No wait needed.


def test_background_failure_surfaces_and_step_stays_invisible(make_checkpointer, monkeypatch):
    from jaxlearn.checkpoint import CheckpointSaveError, commit

    ckpt = make_checkpointer()
    ckpt.save(1, {"x": jnp.ones(3)})
    ckpt.wait_until_finished()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(commit, "publish", broken)
    ckpt.save(2, {"x": jnp.ones(3)})  # Returns: the failure happens in the background.
    with pytest.raises(CheckpointSaveError, match="disk full"):
        ckpt.wait_until_finished()
    assert ckpt.steps() == [1]
    monkeypatch.undo()
    ckpt.save(3, {"x": jnp.ones(3)})  # The error was reported once; saving goes on.
    ckpt.wait_until_finished()
    assert ckpt.steps() == [1, 3]
    assert not (ckpt.directory / "step_00000002.tmp").exists()  # Cleaned by the GC.


def test_grain_iterator_state_resumes_exactly(make_checkpointer):
    grain = pytest.importorskip("grain.python")

    def loader():
        return grain.DataLoader(
            data_source=grain.RangeDataSource(0, 64, 1),
            sampler=grain.IndexSampler(
                64, grain.NoSharding(), shuffle=True, num_epochs=1, seed=7
            ),
            operations=[grain.Batch(4)],
            worker_count=0,
        )

    it = iter(loader())
    for _ in range(3):
        next(it)
    ckpt = make_checkpointer()
    ckpt.save(3, {"x": jnp.zeros(2)}, data_iterator_state=it.get_state())
    ckpt.wait_until_finished()
    expected = [next(it) for _ in range(3)]

    resumed = iter(loader())
    resumed.set_state(ckpt.read_metadata(3).data_iterator_state)
    for want in expected:
        np.testing.assert_array_equal(next(resumed), want)
