"""Fault-injection report: faults injected, recovered, steps lost per fault, goodput.

    PYTHONPATH=$(printf '%s:' packages/*/src):packages/runtime/tests \
        python packages/runtime/bench/fault_injection_report.py [--out DIR] [--json PATH]

Every scenario is a supervised run (jaxlearn.resilience.supervisor, backoff 0) of the
fault-injection suite's toy job (tests/resilience_child.py: bigram model, 8 fake CPU
devices, 12 steps, checkpoints every 3 steps, eval every 4) with faults injected through
`--set resilience.faults=...`, plus one job with every fault at once. A fault counts as
recovered when the job finishes and its final parameters and optimizer state equal, bit
for bit, those of a job that saw no fault (for a skipped non-finite step: a job that saw only that
batch; after an elastic restart: equal up to float reassociation, rtol 2e-5). Steps lost =
steps recomputed after a restart + steps whose update was dropped. Goodput = productive
step time / wall time (first spawn to last exit), from the jobs' goodput records; on this
toy the step itself takes milliseconds, so process start, compilation and checkpoint
commits dominate and the absolute goodput is low; the clean job's figure is the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
CHILD = [sys.executable, os.path.join(TESTS, "resilience_child.py")]

WATCHDOG = ["--set", "resilience.watchdog.timeout_s=2.0",
            "--set", "resilience.watchdog.first_step_timeout_s=300.0",
            "--set", "resilience.watchdog.poll_interval_s=0.2",
            "--set", "resilience.watchdog.exit_on_hang=True"]
SDC_STOP = ["--set", "resilience.sdc.every_n_steps=2"]
SDC_RECOMPUTE_SKIP = ["--set", "resilience.sdc.every_n_steps=2",
                      "--set", "resilience.sdc.recompute=True",
                      "--set", "resilience.sdc.on_mismatch='skip'"]

# name, faults, child args, reference, devices per attempt. References: "clean" (no
# fault), "nan5" (only the NaN batch of step 5); a step dropped on purpose is checked
# against the other way of dropping it ("nan4": NaN at step 4; "recompute-skip4": a
# recompute mismatch at step 4 under policy skip), "close" = allclose to "clean".
SCENARIOS: list[tuple[str, str, list[str], str, Optional[list[int]]]] = [
    ("SIGKILL during a step", "kill@5:step", [], "clean", None),
    ("SIGKILL during an async save", "kill@6:save+20", [], "clean", None),
    ("SIGKILL during eval", "kill@8:eval+5", [], "clean", None),
    ("hang (watchdog 2 s)", "hang@7", WATCHDOG, "clean", None),
    ("NaN in a batch (skipped)", "nan@4", [], "recompute-skip4", None),
    ("bit flip on one device (SDC stop)", "flip@7:3", SDC_STOP, "clean", None),
    ("device computes wrongly (SDC recompute, skip)", "sdcstep@4:1", SDC_RECOMPUTE_SKIP,
     "nan4", None),
    ("disk full during a save", "enospc@9", [], "clean", None),
    ("corrupted newest checkpoint", "", [], "clean", None),
    ("elastic restart, 8 -> 4 devices", "kill@7:step", ["--elastic"], "close", [8, 4]),
]
ALL_AT_ONCE = ("every fault in one job",
               "kill@3:step,kill@6:save+20,kill@8:eval+5,hang@10,nan@5,flip@7:3,enospc@9",
               WATCHDOG + SDC_STOP, "nan5", None)


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8")
    env["PYTHONPATH"] = os.pathsep.join([TESTS] + env.get("PYTHONPATH", "").split(os.pathsep))
    return env


def _params(out: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(out, "final_params.npz")) as z:
        return {k: z[k] for k in z.files}


def _supervise(out: str, faults: str, args: list[str], devices: Optional[list[int]] = None,
               max_step: Optional[int] = None) -> tuple[int, Any]:
    from jaxlearn.resilience.supervisor import Supervisor

    extra = ["--set", f"max_step={max_step}"] if max_step else []
    sup = Supervisor([*CHILD, out, "--set", f"resilience.faults={faults}", *args, *extra],
                     output_dir=out, max_restarts=10,
                     backoff_s=0.0, env=_env(), log_path=out + ".log",
                     devices_for_attempt=(lambda k: devices[min(k, len(devices) - 1)])
                     if devices else None)
    return sup.run(), sup


def _corrupt_newest(ckpt_dir: str) -> int:
    steps = sorted(p for p in os.listdir(ckpt_dir) if p.startswith("step_") and "." not in p)
    blobs = []
    for d, _, files in os.walk(os.path.join(ckpt_dir, steps[-1], "state")):
        blobs += [os.path.join(d, f) for f in files if os.sep + "d" + os.sep in
                  os.path.join(d, f)]
    target = max(blobs, key=os.path.getsize)
    data = bytearray(open(target, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(target, "wb").write(bytes(data))
    return int(steps[-1].split("_")[1])


def _compare(params: dict, ref: dict, exact: bool) -> bool:
    if params.keys() != ref.keys():
        return False
    if exact:
        return all(params[k].tobytes() == ref[k].tobytes() for k in params)
    return all(np.allclose(params[k], ref[k], rtol=2e-5, atol=1e-6) for k in params)


def run_scenario(root: str, scenario: tuple, refs: dict[str, dict],
                 baseline_wall: float) -> dict[str, Any]:
    from jaxlearn.resilience.faults import PERSISTENT, parse

    name, faults, args, ref_name, devices = scenario
    out = os.path.join(root, name.split(" (")[0].replace(" ", "_").replace(",", "")[:40])
    t0 = time.time()
    if name == "corrupted newest checkpoint":
        rc1, _ = _supervise(out, "", args, max_step=9)
        corrupted = _corrupt_newest(os.path.join(out, "checkpoints"))
        rc, sup = _supervise(out, "", args)
        rc = rc or rc1
        injected = 1
        log = open(out + ".log").read()
        detected = f"checkpoint step {corrupted} is unusable, falling back" in log
    else:
        rc, sup = _supervise(out, faults, args, devices)
        injected = len(parse(faults))
        detected = None
    with open(os.path.join(out, "goodput.json")) as f:
        summary = json.load(f)
    params = _params(out) if rc == 0 else {}
    reference = refs["clean"] if ref_name == "close" else refs[ref_name]
    ok = rc == 0 and _compare(params, reference, exact=ref_name != "close")
    markers = os.path.join(out, "faults_fired")  # Transient faults leave one each.
    fired = (len(os.listdir(markers)) if os.path.isdir(markers) else 0) + sum(
        f.kind in PERSISTENT for f in parse(faults)) if faults else injected
    causes = [a["cause"] for a in summary["supervisor_attempts"]][:-1]
    return {
        "scenario": name,
        "faults": faults or "corrupt the newest checkpoint between runs",
        "injected": injected,
        "fired": fired,
        "recovered": injected if ok else 0,
        "final_state": ("bit-exact" if ref_name != "close" else "allclose") if ok else "MISMATCH",
        "reference": ref_name,
        "restarts": len(causes),
        "restart_causes": causes,
        "steps_lost": summary["steps_lost"],
        "steps_rework": summary["steps"]["rework"],
        "steps_skipped": summary["steps"]["skipped"],
        "goodput": summary["goodput"],
        "wall_s": summary["wall_s"],
        "time_lost_vs_clean_s": summary["wall_s"] - baseline_wall,
        "badput_s": {k: v for k, v in summary["seconds"].items() if k != "step" and v > 0.005},
        "detected_fallback": detected,
        "elapsed_s": time.time() - t0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--only", default=None, help="run only scenarios containing this")
    args = parser.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="jaxlearn-faults-")
    os.makedirs(root, exist_ok=True)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")

    refs: dict[str, dict] = {}
    baseline: dict[str, Any] = {}
    for ref, faults, extra in (("clean", "", []), ("nan4", "nan@4", []),
                               ("nan5", "nan@5", WATCHDOG + SDC_STOP),
                               ("recompute-skip4", "sdcstep@4:1", SDC_RECOMPUTE_SKIP)):
        out = os.path.join(root, f"reference_{ref}")
        shutil.rmtree(out, ignore_errors=True)
        rc, _ = _supervise(out, faults, extra)
        if rc != 0:
            print(f"reference run {ref} failed (status {rc}); see {out}.log", file=sys.stderr)
            return 1
        refs[ref] = _params(out)
        if ref == "clean":
            with open(os.path.join(out, "goodput.json")) as f:
                baseline = json.load(f)
    results = []
    for scenario in SCENARIOS + [ALL_AT_ONCE]:
        if args.only and args.only not in scenario[0]:
            continue
        res = run_scenario(root, scenario, refs, float(baseline["wall_s"]))
        results.append(res)
        print(f"  {res['scenario']:48s} recovered {res['recovered']}/{res['injected']}  "
              f"steps lost {res['steps_lost']:2d}  goodput {res['goodput']:.1%}  "
              f"{res['final_state']}", file=sys.stderr, flush=True)

    singles = [r for r in results if r["scenario"] != ALL_AT_ONCE[0]]
    report = {
        "baseline_clean": {"goodput": baseline.get("goodput"), "wall_s": baseline.get("wall_s"),
                           "badput_s": {k: v for k, v in baseline.get("seconds", {}).items()
                                        if k != "step" and v > 0.005}},
        "scenarios": results,
        "totals_single_fault_runs": {
            "faults_injected": sum(r["injected"] for r in singles),
            "recovered": sum(r["recovered"] for r in singles),
            "steps_lost": sum(r["steps_lost"] for r in singles),
        },
        "work_dir": root,
    }
    print(json.dumps(report, indent=1))
    print("\n| scenario | faults | recovered | restarts | steps lost | goodput | wall s "
          "(+ vs clean) | final state |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| no fault (baseline) | 0 | - | 0 | 0 | {baseline.get('goodput', 0):.1%} | "
          f"{baseline.get('wall_s', 0):.1f} | reference |")
    for r in results:
        print(f"| {r['scenario']} | {r['injected']} | {r['recovered']}/{r['injected']} | "
              f"{r['restarts']} | {r['steps_lost']} (rework {r['steps_rework']}, skipped "
              f"{r['steps_skipped']}) | {r['goodput']:.1%} | {r['wall_s']:.1f} "
              f"(+{r['time_lost_vs_clean_s']:.1f}) | {r['final_state']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["recovered"] == r["injected"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
