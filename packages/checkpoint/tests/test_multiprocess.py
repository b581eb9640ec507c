"""Two processes x 4 CPU devices (jax.distributed on localhost): each writes its own
shards and its own data-iterator state (copied to host before save() returns, or on the
commit thread with snapshot=False), commit waits for both, restore reshards across
processes, damage is agreed on by both, and one process alone restores it all."""

import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

WORKER = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    directory, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
        initialization_timeout=60, heartbeat_timeout_seconds=30,
    )
    import os
    from pathlib import Path
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxlearn.checkpoint import Checkpointer

    W = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    def put(x, spec, m=mesh):
        return jax.make_array_from_callback(x.shape, NamedSharding(m, spec), lambda i: x[i])
    ckpt = Checkpointer.default_config().set(directory=directory).instantiate()
    for step in (1, 2):
        state = {"w": put(W * step, P("data", "model")), "b": put(np.full(8, step, np.int32), P())}
        # Step 2 copies to host on the commit thread (orbax's barriers: key-value ones).
        ckpt.save(step, state, data_iterator_state=f"proc{pid}-step{step}".encode(),
                  config_text="model.dim: 32\\n", extra={"step": step}, snapshot=step == 1)
    ckpt.wait_until_finished()
    assert ckpt.steps() == [1, 2], ckpt.steps()
    assert ckpt.read_metadata(2).data_iterator_state == f"proc{pid}-step2".encode()

    # Restore onto a 4x2 mesh that spans both processes, with other specs.
    m42 = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    def sds(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(m42, spec))
    target = {"w": sds((64, 32), np.float32, P("y", "x")), "b": sds((8,), np.int32, P("x"))}
    got = ckpt.restore(2, target)
    assert (multihost_utils.process_allgather(got["w"], tiled=True) == W * 2).all()
    assert (multihost_utils.process_allgather(got["b"], tiled=True) == 2).all()

    # Damage step 2 in process 1's sub-store: both processes must agree to fall back.
    if pid == 0:  # A local path or an object-store URI (test_remote.py).
        from jaxlearn.checkpoint import layout, storage
        root = storage.resolve(directory, check=False)
        d = root / "step_00000002" / "state" / "ocdbt.process_1" / "d"
        sizes = layout.file_sizes(d)
        (d / max(sizes, key=sizes.get)).unlink()
    multihost_utils.sync_global_devices("damaged")
    step, got = ckpt.restore_latest(target)
    assert step == 1, step
    assert (multihost_utils.process_allgather(got["w"], tiled=True) == W).all()
    ckpt.close()
    print("WORKER-OK", pid, flush=True)
    jax.distributed.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_save_commit_reshard_and_fall_back(tmp_path, make_checkpointer):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    directory = tmp_path / "ckpt"
    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(directory), port, str(pid)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        for pid in (0, 1)
    ]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append(out)
    for pid, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and f"WORKER-OK {pid}" in out, out[-3000:]

    # Each process wrote its own shards and its own iterator state.
    step1 = directory / "step_00000001"
    assert (step1 / "state" / "ocdbt.process_0").is_dir()
    assert (step1 / "state" / "ocdbt.process_1").is_dir()
    # One process alone, one device: the 2-process checkpoint restores bit for bit.
    ckpt = make_checkpointer(directory)
    got = ckpt.restore(
        1, {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32), "b": np.zeros(8, np.int32)}
    )
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    assert np.asarray(got["w"]).tobytes() == w.tobytes()
    np.testing.assert_array_equal(got["b"], np.ones(8, np.int32))
    md = ckpt.read_metadata(1, process_index=1)
    assert md.data_iterator_state == b"proc1-step1" and md.process_count == 2
    assert md.config_text == "model.dim: 32\n" and md.extra == {"step": 1}
