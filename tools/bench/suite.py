"""The driver of the suite (run by tools/bench/run.sh with the JAX bench venv).

Every measurement is its own process; jaxlearn and peer processes alternate (the order
flips every repeat). Before each process the driver waits for the CPUs to be idle
(`--idle` fraction over one second, at most `--max-wait` seconds) and records how idle they
were, so contended runs can be told apart. Results are appended to
tools/bench/results/<group>.jsonl with a `run_id`; `report.py` summarises the newest run of
each group into results/summary.md and the plots.

    run.sh [--only peak,train,mixtral,compile,decode,ckpt,memory,profile] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = HERE / "results"
GROUPS = ("peak", "train", "mixtral", "compile", "decode", "ckpt", "memory", "profile")


def cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return idle, sum(parts[:8])


def idle_fraction(seconds: float = 1.0) -> float:
    i0, t0 = cpu_times()
    time.sleep(seconds)
    i1, t1 = cpu_times()
    return (i1 - i0) / max(t1 - t0, 1)


def wait_for_idle(threshold: float, max_wait: float) -> tuple[float, float]:
    """Waits until the CPUs are >= threshold idle (or max_wait passed); (idle, waited s)."""
    t0 = time.monotonic()
    idle = idle_fraction()
    while idle < threshold and time.monotonic() - t0 < max_wait:
        idle = idle_fraction()
    return idle, time.monotonic() - t0


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "packages"],
                               capture_output=True, text=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class Runner:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.run_id = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.py = {"jax": os.environ.get("BENCH_JAX_PYTHON", sys.executable),
                   "torch": os.environ.get("BENCH_TORCH_PYTHON", "python3")}
        self.meta = {"run_id": self.run_id, "commit": git_commit(), "cpu": cpu_model(),
                     "cores": os.cpu_count()}
        RESULTS.mkdir(parents=True, exist_ok=True)

    def run(self, group: str, side: str, script: str, *argv: Any,
            timeout: Optional[float] = None, env: Optional[dict] = None) -> Optional[dict]:
        a = self.args
        idle, waited = wait_for_idle(a.idle, a.max_wait)
        cmd = [self.py[side], str(HERE / script), *map(str, argv)]
        t0 = time.time()
        load0 = os.getloadavg()[0]
        penv = dict(os.environ, **(env or {}))
        penv["PYTHONPATH"] = f"{HERE}:{penv.get('PYTHONPATH', '')}"
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=penv, cwd=ROOT,
                                  timeout=timeout or a.timeout)
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = "timeout", -9
        rec: dict[str, Any] = {}
        for line in out.splitlines():
            if line.startswith("BENCH_RESULT "):
                rec = json.loads(line[len("BENCH_RESULT "):])
        rec.update(self.meta, group=group, side=side, script=script, argv=[str(x) for x in argv],
                   idle_before=round(idle, 3), waited_s=round(waited, 1),
                   load_before=round(load0, 2), proc_wall_s=round(time.time() - t0, 1),
                   returncode=rc, ok=rc == 0 and "bench" in rec,
                   malloc_env={k: v for k, v in penv.items()
                               if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"})
        if not rec["ok"]:
            rec["stderr_tail"] = err[-2000:]
        with open(RESULTS / f"{group}.jsonl", "a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
        short = {k: rec.get(k) for k in ("tokens_per_s", "step_s", "compile_s", "ms_per_token",
                                          "matmul_f32_gflops", "read_bw_gbs") if k in rec}
        print(f"[{time.strftime('%H:%M:%S')}] {group}/{side} {script} {' '.join(map(str, argv))}"
              f" idle={idle:.2f} rc={rc} {short}", flush=True)
        if not rec["ok"]:
            print(err[-1500:], file=sys.stderr, flush=True)
        return rec if rec["ok"] else None


def alternate(runner: Runner, repeats: int, pairs: list[tuple[tuple, tuple]]) -> None:
    """For each repeat, runs every (jax job, torch job) pair, flipping the order."""
    for r in range(repeats):
        for jax_job, torch_job in pairs:
            jobs = [jax_job, torch_job] if r % 2 == 0 else [torch_job, jax_job]
            for job in jobs:
                if job:
                    runner.run(*job)


def plan_peak(rn: Runner, reps: int) -> None:
    n = "20" if not rn.args.quick else "8"
    alternate(rn, reps, [(("peak", "jax", "jl_peak.py", "--repeats", n),
                          ("peak", "torch", "pt_peak.py", "--repeats", n))])


def plan_train(rn: Runner, reps: int, model: str) -> None:
    steps = ["--steps", "3" if rn.args.quick else "6", "--warmup", "2"]
    group = "train" if model == "llama" else "mixtral"
    pairs = []
    for dtype in ("f32", "bf16"):
        pairs.append(((group, "jax", "jl_train.py", "--model", model, "--dtype", dtype, *steps),
                      (group, "torch", "pt_train.py", "--model", model, "--dtype", dtype,
                       *steps)))
    alternate(rn, reps, pairs)


def plan_compile(rn: Runner, reps: int) -> None:
    depths = (2, 4, 8) if rn.args.quick else (2, 4, 8, 16)
    for r in range(max(1, reps - 1)):
        for layers in depths:
            for stack in ("loop", "scan") if r % 2 == 0 else ("scan", "loop"):
                rn.run("compile", "jax", "jl_train.py", "--model", "llama", "--dtype", "bf16",
                       "--stack", stack, "--layers", layers, "--steps", "3", "--warmup", "1")


def plan_decode(rn: Runner, reps: int) -> None:
    q = ["--quick"] if rn.args.quick else []
    pairs = []
    for dtype in ("f32", "bf16"):
        for case in ("latency", "continuous"):
            # The latency runs also trace one call per batch after timing it (`ops`).
            trace = ["--trace"] if case == "latency" else []
            pairs.append((("decode", "jax", "jl_decode.py", "--case", case, "--dtype", dtype, *q,
                           *trace),
                          ("decode", "torch", "pt_decode.py", "--case", case, "--dtype", dtype,
                           *q)))
    alternate(rn, reps, pairs)


def plan_ckpt(rn: Runner, reps: int) -> None:
    for _ in range(max(1, reps - 1)):
        rn.run("ckpt", "jax", "jl_ckpt.py", timeout=1800)


def plan_memory(rn: Runner, reps: int) -> None:
    rn.run("memory", "jax", "jl_memory.py", "--part", "fsdp", timeout=2400)
    for stack in ("loop", "scan"):
        for remat in ("none", "dots_with_no_batch_dims_saveable", "nothing_saveable"):
            rn.run("memory", "jax", "jl_memory.py", "--part", "remat", "--remat", remat,
                   "--stack", stack)


def plan_profile(rn: Runner, reps: int) -> None:
    for model in ("llama", "mixtral"):
        for dtype in ("bf16", "f32"):
            rn.run("profile", "jax", "jl_profile.py", "--model", model, "--dtype", dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(GROUPS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--idle", type=float, default=0.9, help="idle CPU fraction to wait for")
    p.add_argument("--max-wait", type=float, default=120.0)
    p.add_argument("--timeout", type=float, default=1200.0, help="per process, seconds")
    p.add_argument("--report", action="store_true", help="only write summary.md and plots")
    args = p.parse_args()
    if args.quick:
        args.repeats = 1
    only = [g.strip() for g in args.only.split(",") if g.strip()]
    unknown = set(only) - set(GROUPS)
    if unknown:
        p.error(f"unknown groups {sorted(unknown)}; known: {', '.join(GROUPS)}")
    if not args.report:
        rn = Runner(args)
        print(f"[bench] run {rn.run_id}: {', '.join(only)}; {args.repeats} repeat(s); "
              f"results in {RESULTS}", flush=True)
        if "peak" in only or any(g in only for g in ("train", "mixtral", "decode")):
            plan_peak(rn, args.repeats if "peak" in only else 1)
        if "train" in only:
            plan_train(rn, args.repeats, "llama")
        if "mixtral" in only:
            plan_train(rn, max(1, args.repeats - 1), "mixtral")
        if "compile" in only:
            plan_compile(rn, args.repeats)
        if "decode" in only:
            plan_decode(rn, args.repeats)
        if "ckpt" in only:
            plan_ckpt(rn, args.repeats)
        if "memory" in only:
            plan_memory(rn, args.repeats)
        if "profile" in only:
            plan_profile(rn, args.repeats)
    import report

    report.main([])


if __name__ == "__main__":
    main()
