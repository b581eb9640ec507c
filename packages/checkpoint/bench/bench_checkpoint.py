"""Checkpoint benchmark (not a test): save blocking time, save throughput against the raw
disk write bandwidth measured in the same run, and restore time, for a >= 1 GiB state.

    PYTHONPATH=packages/config/src:packages/checkpoint/src \\
        .venv/bin/python packages/checkpoint/bench/bench_checkpoint.py --size-gb 1

Prints one JSON object per line. The state is float32 arrays on a 2x4 mesh of fake CPU
devices (`--devices 8`); random data, so compression gains nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def _emit(**fields: Any) -> None:
    print(json.dumps(fields, sort_keys=True), flush=True)


def raw_write_bandwidth(directory: Path, nbytes: int, *, threads: int = 8,
                        chunk_bytes: int = 16 << 20) -> float:
    """GB/s of writing `nbytes` of random data, each fsynced: the faster of one file
    written with numpy and `threads` threads each writing `chunk_bytes` files (a disk that
    serves parallel writes faster than one stream, as this VM's does, 2.2 vs 0.4-1.7 GB/s,
    is measured at its parallel speed, the one a checkpoint writer can reach)."""
    import numpy as np

    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    path = directory / "raw_write.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        data.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    single = nbytes / (time.perf_counter() - t0) / 1e9
    path.unlink()

    chunks = directory / "raw_write_chunks"
    chunks.mkdir()

    def write(start: int) -> None:
        with open(chunks / str(start), "wb") as f:
            f.write(memoryview(data)[start:start + chunk_bytes])
            f.flush()
            os.fsync(f.fileno())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(0, nbytes, chunk_bytes)))
    parallel = nbytes / (time.perf_counter() - t0) / 1e9
    shutil.rmtree(chunks)
    return max(single, parallel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--arrays", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--no-compression", action="store_true")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxlearn.checkpoint import Checkpointer

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    root.mkdir(parents=True, exist_ok=True)
    devices = np.array(jax.devices()[: args.devices])
    mesh = Mesh(devices.reshape(2, -1), ("data", "model"))
    mesh2 = Mesh(devices.reshape(-1, 2), ("x", "y"))
    per_array = int(args.size_gb * 2**30) // args.arrays // 4
    cols = 4096
    rows = max(per_array // cols // 64 * 64, 64)
    sharding = NamedSharding(mesh, PartitionSpec("data", "model"))
    keys = jax.random.split(jax.random.key(0), args.arrays)
    make = jax.jit(
        lambda k: jax.random.normal(k, (rows, cols), jnp.float32), out_shardings=sharding
    )
    state = {"params": {f"w{i}": make(keys[i]) for i in range(args.arrays)}}
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    _emit(
        event="setup",
        state_bytes=nbytes,
        state_gib=round(nbytes / 2**30, 3),
        arrays=args.arrays,
        shape=[rows, cols],
        devices=args.devices,
        cpus=os.cpu_count(),
        load_avg=os.getloadavg()[0],
        directory=str(root),
        compression=not args.no_compression,
    )

    raw = raw_write_bandwidth(root, nbytes)
    _emit(event="raw_disk_write", gb_per_s=round(raw, 3), bytes=nbytes,
          method="max(numpy one file, 8 threads x 16 MiB files), fsync")

    ckpt = (
        Checkpointer.default_config()
        .set(directory=str(root / "ckpt"), keep_last_n=1, use_compression=not args.no_compression)
        .instantiate()
    )
    blocking, committed = [], []
    for step in range(args.repeats):
        t0 = time.perf_counter()
        ckpt.save(step, state, metrics={"step": step})
        t1 = time.perf_counter()
        ckpt.wait_until_finished()
        t2 = time.perf_counter()
        blocking.append(t1 - t0)
        committed.append(t2 - t0)
        _emit(
            event="save",
            step=step,
            blocking_s=round(t1 - t0, 3),
            commit_s=round(t2 - t0, 3),
            gb_per_s=round(nbytes / (t2 - t0) / 1e9, 3),
            vs_raw_disk=round(nbytes / (t2 - t0) / 1e9 / raw, 3),
        )
    last = args.repeats - 1
    on_disk = sum(
        p.stat().st_size for p in (root / "ckpt" / f"step_{last:08d}").rglob("*") if p.is_file()
    )

    def target(m: Mesh, spec: PartitionSpec) -> Any:
        s = NamedSharding(m, spec)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state)

    restores = {}
    for name, tgt, verify in [
        ("same_sharding", target(mesh, PartitionSpec("data", "model")), True),
        ("resharded_4x2", target(mesh2, PartitionSpec("y", "x")), True),
        ("resharded_4x2_no_verify", target(mesh2, PartitionSpec("y", "x")), False),
    ]:
        reader = (
            Checkpointer.default_config()
            .set(directory=str(root / "ckpt"), verify_on_restore=verify)
            .instantiate()
        )
        t0 = time.perf_counter()
        out = reader.restore(last, tgt)
        jax.block_until_ready(out)
        secs = time.perf_counter() - t0
        restores[name] = secs
        _emit(
            event="restore",
            mode=name,
            seconds=round(secs, 3),
            gb_per_s=round(nbytes / secs / 1e9, 3),
        )
        del out
        reader.close()
    ckpt.close()

    _emit(
        event="summary",
        state_gib=round(nbytes / 2**30, 3),
        on_disk_bytes=on_disk,
        raw_disk_write_gb_per_s=round(raw, 3),
        save_blocking_s_median=round(statistics.median(blocking), 3),
        save_blocking_s_first=round(blocking[0], 3),
        save_commit_s_median=round(statistics.median(committed), 3),
        save_gb_per_s_median=round(nbytes / statistics.median(committed) / 1e9, 3),
        save_vs_raw_disk=round(nbytes / statistics.median(committed) / 1e9 / raw, 3),
        restore_s=({k: round(v, 3) for k, v in restores.items()}),
    )
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
