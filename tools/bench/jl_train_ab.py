"""A/B of train-step variants in one process, steps interleaved round-robin.

On a shared machine separate processes see different contention; here every variant's
steps alternate, so each round sees the same load and the ratios hold even when absolute
times do not. Each variant is a list of trainer config overrides (`--set` syntax):

    python jl_train_ab.py --layers 2 --variant plain=model.loss_chunk_tokens=None \\
        --variant chunked=model.loss_chunk_tokens=1024 --rounds 6

Emits, per variant: median wall and process-CPU s/step, ratios to the first variant,
compiled temp and argument (state + batch) bytes and FLOPs, the loss after the last step
(the variants train the same model from the same state, so it should agree to rounding).
`--patch NAME:MOD.ATTR=MOD2.ATTR2` replaces an attribute (a function, a method) with
another while variant NAME is built and compiled, so code changes A/B in one process
too (e.g. the previous form of a function, kept in a module on PYTHONPATH).
`--seq` / `--batch` override the model's sequence length and batch. `--config FLAT
--batches NPZ` A/Bs a recipe's own step instead (the flat config `jaxlearn config` prints,
its `init_from` weights, the first batch `lora_bench.py data` saved).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from common import Timer, emit, log, med, model_cfg, patched, rnd
from jl_train import build_trainer, random_batch, recipe_trainer


def build_variant(args: argparse.Namespace, c: dict[str, Any], name: str,
                  overrides: tuple[str, ...]) -> dict[str, Any]:
    """A variant's trainer, batch, compiled step and initial state."""
    import jax

    if args.config:
        tr, host_batch = recipe_trainer(args.config, args.batches, overrides)
    else:
        tr = build_trainer(c, dtype=args.dtype, stack=args.stack, remat=None,
                           nonfinite="skip", moe_method="ragged_dot", overrides=overrides)
        host_batch = random_batch(c)
    batch = tr.global_batch(host_batch)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
    with jax.set_mesh(tr.mesh), tr._logical():
        compiled = tr.compile_train_step(abstract)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    return dict(name=name, overrides=list(overrides), trainer=tr, batch=batch,
                fn=compiled, state=tr.init_state(), wall=[], cpu=[], util=[],
                temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0) or 0),
                argument_bytes=int(getattr(mem, "argument_size_in_bytes", 0) or 0),
                flops=float(cost.get("flops", 0.0)) if cost else None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama", choices=["llama", "mixtral"])
    p.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    p.add_argument("--stack", default="loop", choices=["loop", "scan"])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--variant", action="append", required=True,
                   help="NAME=OVERRIDE[;OVERRIDE...] (NAME= alone: no overrides)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--tag", default="")
    p.add_argument("--patch", action="append", default=[],
                   help="NAME:MOD.ATTR=MOD2.ATTR2 while variant NAME is built (repeatable)")
    p.add_argument("--config", help="a flat trainer config (`jaxlearn config` output)")
    p.add_argument("--batches", help="with --config: an .npz of stacked batches")
    args = p.parse_args()

    import jax

    c = model_cfg(args.model, layers=args.layers, seq=args.seq, batch=args.batch)
    runs: list[dict[str, Any]] = []
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        overrides = tuple(o for o in rest.split(";") if o)
        with patched([p.partition(":")[2] for p in args.patch if p.startswith(name + ":")]):
            runs.append(build_variant(args, c, name, overrides))
    for r in range(args.warmup + args.rounds):
        order = runs if r % 2 == 0 else runs[::-1]
        for run in order:
            with jax.set_mesh(run["trainer"].mesh), Timer() as t:
                run["state"], summ = run["fn"](run["state"], run["batch"])
                run["loss"] = float(summ["loss"])  # Blocks on the step.
            if r >= args.warmup:
                run["wall"].append(t.wall)
                run["cpu"].append(t.cpu)
                run["util"].append(t.util())
    base_wall, base_cpu = med(runs[0]["wall"]), med(runs[0]["cpu"])
    out = []
    for run in runs:
        w, cs = med(run["wall"]), med(run["cpu"])
        out.append(dict(name=run["name"], overrides=run["overrides"], step_s=rnd(w),
                        step_cpu_s=rnd(cs), wall_ratio_to_first=rnd(base_wall / w, 3),
                        cpu_ratio_to_first=rnd(base_cpu / cs, 3),
                        cpu_util=rnd(med(run["util"]), 3), temp_bytes=run["temp_bytes"],
                        argument_bytes=run["argument_bytes"],
                        compiled_flops=run["flops"], loss_last=rnd(run["loss"], 5)))
        # Each round's own ratio (the two steps of a round ran back to back): robust to
        # load that comes and goes over a run, where the ratio of medians is not.
        paired = [a / b for a, b in zip(runs[0]["wall"], run["wall"])]
        out[-1]["paired_wall_ratios"] = [rnd(x, 3) for x in paired]
        log(f"{run['name']}: {w:.3f} s/step wall, {cs:.3f} cpu s; speed-up vs "
            f"{runs[0]['name']}: wall {base_wall / w:.3f}x, cpu {base_cpu / cs:.3f}x; "
            f"per round {' '.join(f'{x:.2f}' for x in paired)} (median {med(paired):.3f}x)")
    emit(bench="train_ab", framework="jaxlearn", version=jax.__version__,
         model=args.config or args.model,
         dtype=None if args.config else args.dtype,  # A recipe's: its config's.
         stack=args.stack, layers=None if args.config else c["layers"],
         batch=int(runs[0]["batch"]["input_ids"].shape[0]),
         seq=int(runs[0]["batch"]["input_ids"].shape[1]),
         rounds=args.rounds, variants=out, tag=args.tag, wall_time=time.time())


if __name__ == "__main__":
    main()
