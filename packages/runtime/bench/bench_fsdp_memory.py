"""Per-device memory of the AOT-compiled train step under FSDP over N fake CPU devices.

    PYTHONPATH=$(printf '%s:' packages/*/src):packages/runtime/tests \
        python packages/runtime/bench/bench_fsdp_memory.py [--sizes 1,2,4,8,16]

Prints one JSON line per N (the compiled step's argument/temp/required bytes per device,
the state per device by part) and then the ratios to N=1; each N runs in its own
subprocess with JAX_NUM_CPU_DEVICES=N. The model is the test suite's MlpLM (vocab 128,
dim 64, hidden 128, Adam) with batch 64 x 16 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def measure(n: int, batch: int) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    from aot_toys import mlp_trainer_config  # type: ignore[import-not-found]

    from jaxlearn.aot.compile import aot_compile, resolve_target

    cfg = mlp_trainer_config(fsdp=n)
    cfg.input.global_batch_size = batch
    t = aot_compile(cfg, resolve_target(f"cpu-{n}")).train
    return {"n": n, "argument_bytes": t.argument_bytes, "temp_bytes": t.temp_bytes,
            "required_bytes": t.required_bytes, "state_bytes": t.state_bytes,
            "state": t.state_breakdown}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.batch)))
        return
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(n))
        out = subprocess.run([sys.executable, __file__, "--one", str(n), "--batch",
                              str(args.batch)], env=env, check=True, capture_output=True,
                             text=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]
    for row in rows:
        ratios = {k: round(row[k] / base[k], 4) for k in
                  ("argument_bytes", "state_bytes", "required_bytes")}
        ratios.update({f"state.{k}": round(v / base["state"][k], 4)
                       for k, v in row["state"].items() if base["state"][k]})
        print(json.dumps({"n": row["n"], "ideal": round(base["n"] / row["n"], 4),
                          "ratio_to_first": ratios}))


if __name__ == "__main__":
    main()
