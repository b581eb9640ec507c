"""Where the time of a jaxlearn train step goes: a JAX profiler (Perfetto) trace of a few
steps, aggregated per XLA op and per category (YNNPACK dot fusions, other fusions,
copies, scatters, ...), joined with the compiled HLO for each op's output shape.

    python jl_profile.py --model llama --dtype bf16 [--steps 2] [--top 30] [--set PATH=VALUE]
    python jl_profile.py --config /tmp/lora_bench/full.txt --batches /tmp/lora_bench/batches.npz
    python jl_profile.py --model mixtral --patch jaxlearn.layers.moe.ragged_matmul=variant.fn

(the second form profiles a recipe's own step: the flat config `jaxlearn config` prints, its
parameters from `init_from`, on the first batch `lora_bench.py data` saved).

Prints a table and emits one BENCH_RESULT line with the per-category milliseconds per step
and how long ops ran, and two at once (XLA:CPU runs independent ops concurrently; a
synchronous FFI call that holds its thread shows up as less overlap). An asynchronous FFI
call's op time is only its launch: its work runs in pool tasks the trace does not name.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
from collections import defaultdict
from typing import Any, Callable

from common import emit, model_cfg, patched, rnd


def category(name: str, hlo_line: str) -> str:
    if "ynn_fusion" in name or "__ynn" in hlo_line:
        return "dot (ynn)"
    if "ffi_call" in name or "custom-call" in hlo_line:
        return "ffi call"
    if " dot(" in hlo_line or "dot" in name:
        return "dot (other)"
    for key in ("scatter", "copy", "transpose", "gather", "reduce", "convert", "select",
                "concatenate", "dynamic"):
        if key in name:
            return key
    return "other fusion"


def phase(hlo_line: str) -> str:
    """The part of a train step an op belongs to, from its JAX op_name: forward (`jvp`),
    backward (`transpose(jvp`), the update inside the non-finite guard's `cond`, or other."""
    m = re.search(r'op_name="([^"]*)"', hlo_line)
    name = m.group(1) if m else ""
    if "transpose(jvp" in name:
        return "backward"
    if "jvp(" in name:
        return "forward"
    return "update (cond)" if "/cond/" in name else "other"


def trace_events(call: Callable[[], Any]) -> list[dict[str, Any]]:
    """The Perfetto trace events of one `call()` under the JAX profiler."""
    import jax

    d = tempfile.mkdtemp(prefix="jltrace_")
    try:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        call()
        jax.profiler.stop_trace()
        with gzip.open(glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"),
                                 recursive=True)[0]) as f:
            trace = json.load(f)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def trace_op_ms(call: Callable[[], Any], top: int = 8) -> dict[str, Any]:
    """Per-category and top XLA op milliseconds (summed over threads) of one `call()`,
    from a JAX profiler trace: {"op_ms", "categories", "top"}."""
    per_op: dict[str, float] = defaultdict(float)
    for e in trace_events(call):
        name = e.get("name", "")
        if e.get("ph") == "X" and re.match(r"[a-z_\-]+(\.\d+)+$|[a-z_]+$", name):
            per_op[name] += float(e.get("dur", 0.0)) / 1e3
    cats: dict[str, float] = defaultdict(float)
    for name, ms in per_op.items():
        cats[category(name, "")] += ms
    ranked = sorted(cats.items(), key=lambda x: -x[1])
    return dict(op_ms=round(sum(per_op.values()), 1),
                categories={k: round(v, 1) for k, v in ranked},
                top=[[n, round(v, 1)]
                     for n, v in sorted(per_op.items(), key=lambda x: -x[1])[:top]])


def concurrency(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(time covered by at least one, by at least two) of [start, end) intervals."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    one = two = 0.0
    depth, last = 0, 0.0
    for t, d in edges:
        one += (t - last) if depth >= 1 else 0.0
        two += (t - last) if depth >= 2 else 0.0
        depth, last = depth + d, t
    return one, two


def operand_shapes(line: str, shapes: dict[str, str]) -> str:
    """An HLO instruction's operand shapes, e.g. "f32[1024,576],f32[576,8]" (layouts
    dropped)."""
    m = re.search(r"\w+\(((?:%[\w.\-]+(?:, )?)+)\)", line.split(" = ", 1)[-1])
    names = re.findall(r"%([\w.\-]+)", m.group(1)) if m else []
    return ",".join(re.sub(r"\{[^}]*\}", "", shapes.get(n, "?")) for n in names)


def print_by_shape(per_op: dict[str, float], count: dict[str, int], lines: dict[str, str],
                   shapes: dict[str, str], steps: int, top: int) -> None:
    """Op time per step grouped by (category, output shape <- operand shapes): which
    products (say, LoRA's rank-8 ones) the dot time goes to."""
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, us in per_op.items():
        line = lines.get(name, "")
        out = re.sub(r"\{[^}]*\}", "", shapes.get(name, ""))
        key = f"{category(name, line):12s} {out} <- {operand_shapes(line, shapes)}"
        groups[key][0] += us / steps / 1e3
        groups[key][1] += count[name] / steps
    print(f"top {top} (category, output <- operands) (ms per step, ops per step):")
    for key, (ms, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {ms:8.1f} {n:6.0f}  {key[:110]}")


def build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(trainer, global batch, initial state) of a bench model or of a recipe's config."""
    if args.config:
        from jl_train import recipe_trainer

        trainer, batch = recipe_trainer(args.config, args.batches, tuple(args.set))
        return trainer, trainer.global_batch(batch), trainer.init_state()
    from jl_train import build_trainer, random_batch

    c = model_cfg(args.model)
    trainer = build_trainer(c, dtype=args.dtype, stack=args.stack, remat=None,
                            nonfinite=args.nonfinite, moe_method="ragged_dot",
                            overrides=tuple(args.set))
    return trainer, trainer.global_batch(random_batch(c)), trainer.init_state()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama", choices=["llama", "mixtral"])
    p.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    p.add_argument("--stack", default="loop")
    p.add_argument("--nonfinite", default="skip")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--set", action="append", default=[],
                   help="trainer config override PATH=VALUE (repeatable)")
    p.add_argument("--config", help="a flat trainer config (`jaxlearn config` output)")
    p.add_argument("--batches", help="with --config: an .npz of stacked batches")
    p.add_argument("--dump_hlo", help="write the compiled step's HLO text to this file")
    p.add_argument("--by_shape", type=int, default=0,
                   help="also print the N costliest (category, output <- operand shapes)")
    p.add_argument("--patch", action="append", default=[],
                   help="MOD.ATTR=MOD2.ATTR2 set while the step is built and compiled "
                        "(repeatable; a code variant kept in a module on PYTHONPATH)")
    args = p.parse_args()
    import jax

    with patched(args.patch):
        trainer, batch, state = build(args)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
        step = trainer.compile_train_step(abstract)
    cost = step.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    hlo = step.as_text()
    if args.dump_hlo:
        with open(args.dump_hlo, "w") as f:
            f.write(hlo)
    shapes = {m.group(1): m.group(2) for m in re.finditer(r"%([\w.\-]+) = (\S+) ", hlo)}
    lines = {m.group(1): m.group(0) for m in re.finditer(r"%([\w.\-]+) = [^\n]*", hlo)}
    with jax.set_mesh(trainer.mesh):
        for _ in range(2):
            state, s = step(state, batch)
            float(s["loss"])

        def profiled_steps() -> None:
            nonlocal state
            for _ in range(args.steps):
                state, s = step(state, batch)
                float(s["loss"])

        events = trace_events(profiled_steps)
    per_op: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    executions: list[float] = []
    spans: list[tuple[float, float]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        name, dur = e.get("name", ""), float(e.get("dur", 0.0))
        if name in lines:
            per_op[name] += dur
            count[name] += 1
            spans.append((float(e["ts"]), float(e["ts"]) + dur))
        elif name.startswith("ThunkExecutor::Execute"):  # One per program run.
            executions.append(dur)
    # The steps' programs are the longest executions (the rest are small host programs).
    longest = sorted(executions, reverse=True)[:args.steps]
    step_us = sum(longest) / max(len(longest), 1)
    total = sum(per_op.values()) / args.steps / 1e3
    cats: dict[str, float] = defaultdict(float)
    for name, us in per_op.items():
        cats[category(name, lines.get(name, ""))] += us / args.steps / 1e3
    print(f"ops traced: {len(per_op)}, op time per step {total:.1f} ms "
          f"(thread-summed; 2 threads run ops concurrently)")
    busy, both = (x / args.steps / 1e3 for x in concurrency(spans))
    print(f"step {step_us / 1e3:.1f} ms (XLA executor span, mean of the steps); ops run "
          f"{busy:.1f} ms per step, two ops at once {both:.1f} ms")
    for k, v in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"  {k:14s} {v:8.1f} ms  {v / max(total, 1e-9):5.1%}")
    phases: dict[str, float] = defaultdict(float)
    for name, us in per_op.items():
        phases[phase(lines.get(name, ""))] += us / args.steps / 1e3
    print("by phase: " + ", ".join(f"{k} {v:.1f} ms" for k, v in
                                   sorted(phases.items(), key=lambda kv: -kv[1])))
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, us in per_op.items():
        kinds[re.sub(r"(\.\d+)+$", "", name)][0] += us / args.steps / 1e3
        kinds[re.sub(r"(\.\d+)+$", "", name)][1] += count[name] / args.steps
    ranked_kinds = sorted(kinds.items(), key=lambda kv: -kv[1][0])[:12]
    print("by op kind (ms per step, ops per step): "
          + ", ".join(f"{k} {v[0]:.1f}/{v[1]:.0f}" for k, v in ranked_kinds))
    print(f"top {args.top} ops (ms per step, output shape):")
    for name, us in sorted(per_op.items(), key=lambda kv: -kv[1])[: args.top]:
        meta = re.search(r'op_name="([^"]*)"', lines.get(name, ""))
        print(f"  {us / args.steps / 1e3:8.2f}  {name:34s} {shapes.get(name, '')[:40]:40s} "
              f"{(meta.group(1) if meta else '')[-60:]}")
    if args.by_shape:
        print_by_shape(per_op, count, lines, shapes, args.steps, args.by_shape)
    emit(bench="profile", framework="jaxlearn", model=args.config or args.model,
         dtype=None if args.config else args.dtype,
         overrides=list(args.set), patches=list(args.patch),
         compiled_flops=float(cost.get("flops", 0.0)),
         op_ms_per_step=rnd(total), ops_busy_ms=rnd(busy), two_ops_ms=rnd(both),
         categories={k: rnd(v) for k, v in cats.items()},
         phases={k: rnd(v) for k, v in phases.items()},
         top=[[n, rnd(us / args.steps / 1e3)] for n, us in
              sorted(per_op.items(), key=lambda kv: -kv[1])[: args.top]])


if __name__ == "__main__":
    main()
