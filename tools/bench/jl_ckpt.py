"""Checkpoint costs on the real 60M Llama training state (params + AdamW state, f32).

1. In a training loop through the real Trainer step, as `Trainer.run` does it: the time
   `Checkpointer.save(..., snapshot=False)` blocks the loop (the step after a save is the
   non-donating variant, so the device->host copy, the write and the commit all run on
   the checkpointer's background thread) and the steps that overlap the background
   write; separately, save + commit with nothing else running (the write throughput,
   digests included). The first (set-up) save is reported on its own, and one save with
   `snapshot=True` (copy to host before returning) for reference.
2. Restore time of that state (verification on).
3. The raw disk write bandwidth of the same number of bytes, fsynced (the faster of one
   numpy file and 8 threads writing 16 MiB files, `bench_checkpoint.raw_write_bandwidth`)
   in the same process, measured right before each timed save + commit: this VM's disk
   swings from one minute to the next, so `write_vs_raw` is the median of the per-pair
   ratios, not one median over another. Also the reused
   packages/checkpoint/bench/bench_checkpoint.py on a state of the same size.

    python jl_ckpt.py [--dir /tmp/x] [--steps 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit, log, med, model_cfg, rnd

ROOT = Path(__file__).resolve().parents[2]
CKPT_BENCH = ROOT / "packages" / "checkpoint" / "bench" / "bench_checkpoint.py"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--skip-reuse", action="store_true")
    p.add_argument("--compression", action="store_true",
                   help="use_compression=True (zstd; the default is off)")
    args = p.parse_args()
    import jax
    from jl_train import build_trainer, random_batch

    from jaxlearn.checkpoint import Checkpointer, layout

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt60m_"))
    c = model_cfg("llama")
    trainer = build_trainer(c, dtype=args.dtype, stack="loop", remat=None, nonfinite="skip",
                            moe_method="ragged_dot")
    batch = trainer.global_batch(random_batch(c))
    abstract_batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
    step_fn = trainer.compile_train_step(abstract_batch)
    keep_fn = trainer.compile_train_step(abstract_batch, donate=False)
    state = trainer.init_state()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))

    def run_steps(n: int, after_save: bool = False) -> list[float]:
        nonlocal state
        out = []
        with jax.set_mesh(trainer.mesh):
            for i in range(n):
                t0 = time.perf_counter()
                # Like Trainer.run: the step after a save does not donate the saved state.
                fn = keep_fn if after_save and i == 0 else step_fn
                state, summ = fn(state, batch)
                float(summ["loss"])
                out.append(time.perf_counter() - t0)
        return out

    spec = importlib.util.spec_from_file_location("bench_checkpoint", CKPT_BENCH)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)

    run_steps(2)
    # No retention policy: its background deletion of the previous step would count in
    # wait_until_finished(); older steps are removed between measurements instead.
    ckpt = Checkpointer.default_config().set(directory=str(root / "ckpt"),
                                             use_compression=args.compression).instantiate()

    def prune() -> None:
        for old in ckpt.steps()[:-1]:
            shutil.rmtree(layout.step_dir(root / "ckpt", old))

    # The first save sets orbax up (thread pools, directories): reported on its own.
    t0 = time.perf_counter()
    ckpt.save(0, state, snapshot=False)
    first_blocking = time.perf_counter() - t0
    run_steps(1, after_save=True)
    ckpt.wait_until_finished()
    first_commit = time.perf_counter() - t0
    base, blocking, overlapped, commit, paired_raw = [], [], [], [], []
    for r in range(args.repeats):
        # (a) In the loop: how long save() blocks, and the steps run during the write.
        prune()
        base += run_steps(args.steps)
        t0 = time.perf_counter()
        ckpt.save(2 * r + 1, state, metrics={"loss": 0.0}, snapshot=False)
        blocking.append(time.perf_counter() - t0)
        overlapped += run_steps(args.steps, after_save=True)
        ckpt.wait_until_finished()
        # (b) Write throughput: save and wait for the commit, nothing else running, right
        # after a raw write of the same size.
        prune()
        paired_raw.append(mod.raw_write_bandwidth(root, nbytes))
        t0 = time.perf_counter()
        ckpt.save(2 * r + 2, state, metrics={"loss": 0.0}, snapshot=False)
        ckpt.wait_until_finished()
        commit.append(time.perf_counter() - t0)
        log(f"save {r}: blocking {blocking[-1]:.3f}s, committed in {commit[-1]:.2f}s")
    # For reference: the copy-before-return path (any caller that donates afterwards).
    run_steps(1)
    t0 = time.perf_counter()
    ckpt.save(2 * args.repeats + 1, state, metrics={"loss": 0.0})
    snapshot_blocking = time.perf_counter() - t0
    ckpt.wait_until_finished()
    last_step = 2 * args.repeats + 1
    # The digest pass alone (part of every commit; on this CPU a big part).
    from jaxlearn.checkpoint import digest as digest_lib

    leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    digest_s = []
    for _ in range(2):
        t0 = time.perf_counter()
        digest_lib.fetch_digests(digest_lib.start_digests(leaves))
        digest_s.append(time.perf_counter() - t0)
    step_s = med(base)
    prune()  # The last step only.
    on_disk = sum(f.stat().st_size for f in (root / "ckpt").rglob("*") if f.is_file())

    restores = []
    target = trainer.abstract_state()
    for _ in range(2):
        reader = Checkpointer.default_config().set(directory=str(root / "ckpt")).instantiate()
        t0 = time.perf_counter()
        out = reader.restore(last_step, target)
        jax.block_until_ready(out)
        restores.append(time.perf_counter() - t0)
        del out
        reader.close()
    ckpt.close()

    raw_gbs = med(paired_raw)
    shutil.rmtree(root / "ckpt", ignore_errors=True)

    reuse = None
    if not args.skip_reuse:
        env = dict(os.environ)
        cmd = [sys.executable, str(CKPT_BENCH), "--size-gb", f"{nbytes / 2**30:.3f}",
               "--repeats", "2", "--dir", str(root / "reuse")]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
        for line in res.stdout.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "summary":
                reuse = rec
        if reuse is None:
            log(res.stderr[-2000:])
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)

    write_gbs = nbytes / med(commit) / 1e9
    ratios = [nbytes / c / 1e9 / r for c, r in zip(commit, paired_raw)]
    emit(bench="ckpt", framework="jaxlearn", version=jax.__version__, dtype=args.dtype,
         use_compression=args.compression, use_zarr3=ckpt.config.use_zarr3,
         data_file_bytes=ckpt.config.data_file_bytes,
         state_bytes=nbytes, on_disk_bytes=on_disk, step_s=rnd(step_s),
         step_s_during_write=rnd(med(overlapped)), save_blocking_s=rnd(med(blocking)),
         first_save_blocking_s=rnd(first_blocking), first_save_commit_s=rnd(first_commit),
         save_blocking_snapshot_s=rnd(snapshot_blocking), digest_s=rnd(min(digest_s)),
         save_blocking_all=[rnd(x) for x in blocking],
         blocking_frac_of_step=rnd(med(blocking) / step_s, 3),
         overlap_slowdown_s=rnd(sum(overlapped) / args.repeats - sum(base) / args.repeats),
         commit_s=rnd(med(commit)), write_gbs=rnd(write_gbs), raw_disk_gbs=rnd(raw_gbs),
         write_vs_raw=rnd(med(ratios), 3), write_vs_raw_all=[rnd(x, 3) for x in ratios],
         raw_disk_gbs_all=[rnd(x) for x in paired_raw], commit_s_all=[rnd(x) for x in commit],
         restore_s=rnd(med(restores)),
         restore_gbs=rnd(nbytes / med(restores) / 1e9), reuse_bench=reuse)


if __name__ == "__main__":
    main()
