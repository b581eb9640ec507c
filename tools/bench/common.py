"""Shared by every bench script, on both sides (stdlib only: the torch venv imports it too).

The model configs, the FLOP formula, timers that also report CPU utilisation, and the
one-JSON-line output of a measurement process.
"""

from __future__ import annotations

import contextlib
import json
import os
import pkgutil
import resource
import statistics
import sys
import time
from typing import Any, Callable
from unittest import mock

# The ~60M Llama of the benchmark targets: 58.07M params.
LLAMA: dict[str, Any] = dict(
    vocab=32000, dim=512, layers=8, heads=8, kv_heads=8, ffn=1376, seq=256, batch=4,
    rope_theta=10000.0, norm_eps=1e-5,
)
# Mixtral-style: the same with every FFN an 8-expert top-2 mixture (dropless).
MIXTRAL: dict[str, Any] = dict(LLAMA, experts=8, top_k=2, rope_theta=1e6)
MODELS = {"llama": LLAMA, "mixtral": MIXTRAL}


def model_cfg(name: str, **overrides: Any) -> dict[str, Any]:
    cfg = dict(MODELS[name])
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


def matmul_params_per_token(c: dict[str, Any]) -> float:
    """Parameters each token multiplies (MoE: the top-k experts and the router)."""
    d, f, layers = c["dim"], c["ffn"], c["layers"]
    hd = d // c["heads"]
    attn = d * hd * (2 * c["heads"] + 2 * c["kv_heads"])
    if "experts" in c:
        ffn = c["top_k"] * 3 * d * f + d * c["experts"]
    else:
        ffn = 3 * d * f
    return layers * (attn + ffn) + d * c["vocab"]  # + lm_head


def train_flops_per_token(c: dict[str, Any]) -> float:
    """Model FLOPs of fwd + bwd per token: 6 * matmul params + 12 * layers * dim * seq
    (attention scores and values, no causal halving; the PaLM / peer formula)."""
    return 6.0 * matmul_params_per_token(c) + 12.0 * c["layers"] * c["dim"] * c["seq"]


SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def host_cpu() -> str:
    """The CPU a result was measured on: model name, family / model numbers (a VM's model
    name may not tell Zen 4 from Zen 5), logical CPUs and which of the SIMD flags that move
    ratios between hosts it has (/proc/cpuinfo, as `lscpu` shows them)."""
    model, flags = "unknown CPU", set()
    ids: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                elif key.strip() in ("cpu family", "model"):
                    ids.setdefault(key.strip().split()[-1], value.strip())
    except OSError:
        pass
    have = [f for f in SIMD_FLAGS if f in flags]
    no512 = "" if any(f.startswith("avx512") for f in flags) else ", no AVX-512"
    fam = f" (family {ids['family']} model {ids['model']})" if len(ids) == 2 else ""
    return f"{model}{fam}, {os.cpu_count()} CPUs, {'+'.join(have) or 'no AVX2'}{no512}"


def emit(**fields: Any) -> None:
    """The measurement's result: one JSON line on stdout (the driver reads the last one)."""
    fields.setdefault("pid", os.getpid())
    fields.setdefault("host", host_cpu())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    fields.setdefault("max_rss_mb", round(rss, 1))
    print("BENCH_RESULT " + json.dumps(fields, sort_keys=True), flush=True)


def run_result(cmd: list[str]) -> dict[str, Any]:
    """Runs one measuring process (`cmd`) and returns its last BENCH_RESULT record, or
    {"error", "cmd"} when it failed or emitted none."""
    import subprocess

    log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}", "cmd": " ".join(cmd)}
    return json.loads(lines[-1][len("BENCH_RESULT "):])


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


class Timer:
    """Wall and process-CPU time of a block; `cpu_util` = CPU s / (wall s * cores)."""

    def __enter__(self) -> "Timer":
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0

    def util(self) -> float:
        return self.cpu / max(self.wall * (os.cpu_count() or 1), 1e-9)


def time_calls(fn: Callable[[], Any], repeats: int) -> tuple[list[float], float]:
    """`repeats` wall times of fn() (which must block until its result is ready) and the
    CPU utilisation over all of them."""
    times = []
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    wall = (time.perf_counter() - w0) * (os.cpu_count() or 1)
    util = (time.process_time() - c0) / max(wall, 1e-9)
    return times, util


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def rnd(x: float, n: int = 4) -> float:
    return float(f"{x:.{n}g}")


def trl_bench_main(doc: str, script: str, *, bench: str, out: str, steps: int,
                   results: Any, stages: dict[str, Callable[..., None]],
                   ratios: Callable[[dict, dict], dict[str, float]]) -> None:
    """The command line of a jaxlearn-vs-TRL benchmark script: `data` (stages["data"](out)),
    `jl` / `pt` (stages[...](out, steps, warmup, tag): one side, one BENCH_RESULT line),
    and `drive`: rounds that run each side as its own process, in alternating order, and
    append one row per round (both records, `ratios(jaxlearn, trl)`, load and host) to
    `results`."""
    import argparse
    import pathlib
    import shlex

    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("stage", choices=("data", "jl", "pt", "drive"))
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(out))
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--jl", default="tools/jaxlearn python")
    p.add_argument("--pt", default="/tmp/tvenv/bin/python")
    p.add_argument("--results", type=pathlib.Path, default=results)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "data":
        stages["data"](args.out)
        return
    if args.stage != "drive":
        stages[args.stage](args.out, args.steps, args.warmup, args.tag)
        return
    me = os.path.abspath(script)
    sides = {"jaxlearn": shlex.split(args.jl) + [me, "jl"],
             "trl": shlex.split(args.pt) + [me, "pt"]}
    for r in range(args.rounds):
        order = ["jaxlearn", "trl"] if r % 2 == 0 else ["trl", "jaxlearn"]
        got = {s: run_result(sides[s] + ["--out", str(args.out), "--steps", str(args.steps),
                                   "--warmup", str(args.warmup), "--tag", args.tag])
               for s in order}
        row = {"bench": f"{bench}-round", "round": r, "order": order, "tag": args.tag,
               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "load_1min": os.getloadavg()[0], "host": host_cpu(), **got}
        if "error" not in got["jaxlearn"] and "error" not in got["trl"]:
            row.update(ratios(got["jaxlearn"], got["trl"]))
        args.results.parent.mkdir(parents=True, exist_ok=True)
        with args.results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        log(json.dumps({k: v for k, v in row.items()
                        if k == "round" or k.endswith("_ratio")}))


def patched(specs: list[str]) -> contextlib.ExitStack:
    """Each "MOD.ATTR=MOD2.ATTR2" set while inside (`unittest.mock.patch`), restored after."""
    stack = contextlib.ExitStack()
    for spec in specs:
        target, _, source = spec.partition("=")
        stack.enter_context(mock.patch(target, pkgutil.resolve_name(source)))
    return stack
