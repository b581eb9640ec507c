"""Memory from AOT compilation (no step runs).

--part fsdp: per-device memory of the train step vs N devices under FSDP: the reused
  packages/runtime/bench/bench_fsdp_memory.py (its toy MlpLM), and the 60M Llama
  (Trainer with mesh fsdp=N on N fake CPU devices, one subprocess per N).
--part remat: the 60M Llama train step's temp (activation) bytes with a remat policy.

    python jl_memory.py --part fsdp --sizes 1,2,4,8
    python jl_memory.py --part remat --remat nothing_saveable
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import emit, log, model_cfg

ROOT = Path(__file__).resolve().parents[2]
FSDP_BENCH = ROOT / "packages" / "runtime" / "bench" / "bench_fsdp_memory.py"


def llama_fsdp(n: int, dtype: str) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    from jl_train import build_trainer, random_batch

    from jaxlearn.aot.report import memory_figures, state_breakdown, state_bytes_per_device
    from jaxlearn.mesh import mesh_shape_from_axes

    c = model_cfg("llama")
    c["batch"] = max(c["batch"], n)  # The batch must split over the fsdp axis.
    trainer = build_trainer(c, dtype=dtype, stack="scan", remat=None, nonfinite="skip",
                            moe_method="ragged_dot", mesh_shape=mesh_shape_from_axes(fsdp=n))
    batch = random_batch(c)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
                for k, v in batch.items()}
    compiled = trainer.compile_train_step(abstract)
    mem = memory_figures(compiled)
    state = trainer.abstract_state(derived=True)
    return {"n": n, "batch": c["batch"], "argument_bytes": mem["argument"],
            "temp_bytes": mem["temp"], "output_bytes": mem["output"],
            "state_bytes": state_bytes_per_device(state), "state": state_breakdown(state)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", default="fsdp", choices=["fsdp", "remat"])
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--remat", default="none")
    p.add_argument("--stack", default="loop", choices=["loop", "scan"])
    p.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print("ONE " + json.dumps(llama_fsdp(args.one, args.dtype)), flush=True)
        return
    if args.part == "remat":
        import jax
        from jl_train import build_trainer, random_batch

        c = model_cfg("llama")
        trainer = build_trainer(c, dtype=args.dtype, stack=args.stack,
                                remat=None if args.remat == "none" else args.remat,
                                nonfinite="skip", moe_method="ragged_dot")
        batch = trainer.global_batch(random_batch(c))
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
        from jaxlearn.aot.report import memory_figures

        mem = memory_figures(trainer.compile_train_step(abstract))
        emit(bench="memory", part="remat", framework="jaxlearn", dtype=args.dtype,
             remat=args.remat, stack=args.stack, temp_bytes=mem["temp"],
             argument_bytes=mem["argument"],
             output_bytes=mem["output"], batch=c["batch"], seq=c["seq"])
        return

    sizes = [int(s) for s in args.sizes.split(",")]
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{env.get('PYTHONPATH', '')}:{ROOT / 'packages' / 'runtime' / 'tests'}"
    toy = []
    res = subprocess.run([sys.executable, str(FSDP_BENCH), "--sizes", args.sizes],
                         capture_output=True, text=True, env=env, timeout=1200)
    for line in res.stdout.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "argument_bytes" in rec:
            toy.append(rec)
    if not toy:
        log(res.stderr[-2000:])
    llama = []
    for n in sizes:
        e = dict(env, JAX_NUM_CPU_DEVICES=str(n))
        r = subprocess.run([sys.executable, __file__, "--one", str(n), "--dtype", args.dtype],
                           capture_output=True, text=True, env=e, timeout=1200)
        lines = [x for x in r.stdout.splitlines() if x.startswith("ONE ")]
        if lines:
            llama.append(json.loads(lines[-1][4:]))
            log(f"llama fsdp={n}: {llama[-1]}")
        else:
            log(r.stderr[-2000:])
    emit(bench="memory", part="fsdp", framework="jaxlearn", sizes=sizes, toy=toy,
         llama=llama, dtype=args.dtype)


if __name__ == "__main__":
    main()
