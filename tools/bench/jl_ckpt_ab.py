"""Checkpoint write/restore A/B in one process: Checkpointer configs, saves interleaved.

The state is random f32 arrays with the sizes of the 60M Llama's params, Adam mu and nu
(≈ 0.67 GB; random data does not compress, like trained float weights). Per variant:
median `save(snapshot=False)` + wait time, throughput vs the raw numpy+fsync bandwidth
measured in the same process, verified restore time; plus the digest pass alone.

    python jl_ckpt_ab.py [--repeats 3] [--dir /tmp/x]        # zstd vs no compression
    python jl_ckpt_ab.py --variant f32m:data_file_bytes=33554432 \
        --variant f8m:data_file_bytes=8388608 --variant one:data_file_bytes=None

A variant is NAME:PATH=VALUE[,PATH=VALUE...]: `Checkpointer.Config` overrides, parsed as
`--set` parses them (`jaxlearn.config.apply_overrides`).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import tempfile
import time
from pathlib import Path

from common import emit, log, med, model_cfg, rnd

ROOT = Path(__file__).resolve().parents[2]
CKPT_BENCH = ROOT / "packages" / "checkpoint" / "bench" / "bench_checkpoint.py"


def _sizes(tree: str = "layer") -> list[int]:
    """Array sizes of one copy of the 60M Llama's params: one array per layer ("layer"),
    or one per parameter as the train state holds them ("param": 75 arrays, norms too)."""
    c = model_cfg("llama")
    d, f, hd = c["dim"], c["ffn"], c["dim"] // c["heads"]
    params = [d * c["heads"] * hd] * 2 + [d * c["kv_heads"] * hd] * 2 + [d * f] * 3
    if tree == "param":
        return [c["vocab"] * d] * 2 + (params + [d, d]) * c["layers"] + [d]
    return [c["vocab"] * d] * 2 + [sum(params)] * c["layers"]


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """NAME:PATH=VALUE[,PATH=VALUE...] -> {NAME: ["PATH=VALUE", ...]} (overrides of
    `Checkpointer.Config`, applied by `jaxlearn.config.apply_overrides`)."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, _, overrides = spec.partition(":")
        if not name or "=" not in overrides:
            raise SystemExit(f"--variant {spec!r}: expected NAME:PATH=VALUE[,PATH=VALUE]")
        out[name] = overrides.split(",")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--tree", choices=("layer", "param"), default="layer",
                   help="one array per layer (30 in all) or per parameter (225, the train "
                        "state's)")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME:PATH=VALUE[,PATH=VALUE] (default: zstd vs plain)")
    args = p.parse_args()
    variants = parse_variants(args.variant) or {"zstd": ["use_compression=True"],
                                                "plain": ["use_compression=False"]}
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxlearn.checkpoint import Checkpointer
    from jaxlearn.checkpoint import digest as digest_lib
    from jaxlearn.config import apply_overrides

    rng = np.random.default_rng(0)
    state = {f"a{i}": jnp.asarray(rng.standard_normal(s, dtype=np.float32))
             for i, s in enumerate(_sizes(args.tree) * 3)}
    nbytes = sum(x.nbytes for x in state.values())
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_ab_"))
    ckpts = {n: apply_overrides(Checkpointer.default_config().set(
                 directory=str(root / n), keep_last_n=1), overrides).instantiate()
             for n, overrides in variants.items()}
    for c in ckpts.values():  # Set-up save (orbax pools, compilation of the digests).
        c.save(0, state, snapshot=False)
        c.wait_until_finished()
    commit: dict[str, list[float]] = {n: [] for n in ckpts}
    for r in range(args.repeats):
        for n, c in (ckpts.items() if r % 2 == 0 else reversed(ckpts.items())):
            t0 = time.perf_counter()
            c.save(r + 1, state, snapshot=False)
            c.wait_until_finished()
            commit[n].append(time.perf_counter() - t0)
            log(f"{n} save {r}: {commit[n][-1]:.2f} s")
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
              for k, v in state.items()}
    restore: dict[str, list[float]] = {n: [] for n in ckpts}
    for _ in range(2):
        for n in ckpts:
            reader = Checkpointer.default_config().set(directory=str(root / n)).instantiate()
            t0 = time.perf_counter()
            jax.block_until_ready(reader.restore(args.repeats, target))
            restore[n].append(time.perf_counter() - t0)
            reader.close()
    disk = {n: sum(f.stat().st_size for f in (root / n).rglob("*") if f.is_file())
            for n in ckpts}
    for c in ckpts.values():
        c.close()
    leaves = list(state.values())
    digest_s = []
    for _ in range(2):
        t0 = time.perf_counter()
        digest_lib.fetch_digests(digest_lib.start_digests(leaves))
        digest_s.append(time.perf_counter() - t0)
    spec = importlib.util.spec_from_file_location("bench_checkpoint", CKPT_BENCH)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    raw = max(mod.raw_write_bandwidth(root, nbytes) for _ in range(2))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    out = {}
    for n in ckpts:
        gbs = nbytes / med(commit[n]) / 1e9
        out[n] = dict(commit_s=rnd(med(commit[n])), write_gbs=rnd(gbs),
                      write_vs_raw=rnd(gbs / raw, 3), restore_s=rnd(med(restore[n])),
                      on_disk_bytes=disk[n])
        log(f"{n}: commit {med(commit[n]):.2f} s = {gbs / raw:.2f}x raw disk, "
            f"restore {med(restore[n]):.2f} s")
    emit(bench="ckpt_ab", framework="jaxlearn", version=jax.__version__, state_bytes=nbytes,
         arrays=len(state),
         raw_disk_gbs=rnd(raw), digest_s=rnd(min(digest_s)), variants=out,
         configs=variants,
         wall_time=time.time())


if __name__ == "__main__":
    main()
