"""Compares two lm-eval runs (`--log_samples`) item by item and writes a markdown summary.

    python tools/bench/lm_eval_compare.py OUT/jaxlearn OUT/transformers --out OUT/summary.md

Each argument is an `--output_path` of lm_eval: the newest `results_*.json` found under it
and, for each task in it, the newest `samples_<task>_*.jsonl`. Per task: each run's metric
(acc for loglikelihood tasks, exact_match for generation), the number of items, and how
the runs differ on the same items (matched by doc_id and the request arguments):
max |loglikelihood a - b| over every (item, choice) and items whose prediction
(argmax choice) or is_greedy flags differ; for generation, items whose generated text differs.
Exits 1 when the two runs score different items or a different number of choices.
Standard library only (runs in lm-eval's venv or any python3).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any


def newest(pattern: str) -> str:
    files = sorted(glob.glob(pattern, recursive=True), key=os.path.getmtime)
    if not files:
        raise SystemExit(f"lm_eval_compare: no file matches {pattern}")
    return files[-1]


def load_run(path: str) -> tuple[dict[str, Any], dict[str, dict[int, dict[str, Any]]]]:
    """(results json, {task: {doc_id: sample}}) of the lm-eval output directory `path`."""
    res_file = newest(os.path.join(path, "**", "results_*.json"))
    with open(res_file) as f:
        results = json.load(f)
    samples: dict[str, dict[int, dict[str, Any]]] = {}
    for task in results["results"]:
        sfile = newest(os.path.join(os.path.dirname(res_file), f"samples_{task}_*.jsonl"))
        with open(sfile) as f:
            samples[task] = {s["doc_id"]: s for s in map(json.loads, f) if s}
    return results, samples


def loglikelihoods(sample: dict[str, Any]) -> list[float]:
    """Per choice loglikelihood of a multiple-choice sample (resps: [[[ll, is_greedy]]...])."""
    return [float(r[0][0]) for r in sample["resps"]]


def greedy(sample: dict[str, Any]) -> list[bool]:
    """Per choice is_greedy of a multiple-choice sample (logged as "True" / "False")."""
    return [str(r[0][1]) == "True" for r in sample["resps"]]


def compare_task(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]],
                 task: str) -> dict[str, Any]:
    if sorted(a) != sorted(b):
        raise SystemExit(f"lm_eval_compare: {task}: the runs scored different doc_ids")
    out: dict[str, Any] = {"items": len(a), "max_abs_dll": None, "differ": []}
    for d in sorted(a):
        sa, sb = a[d], b[d]
        if sa["arguments"] != sb["arguments"]:
            raise SystemExit(f"lm_eval_compare: {task} doc {d}: different requests")
        if "exact_match" in sa:
            ta, tb = sa["filtered_resps"][0], sb["filtered_resps"][0]
            if ta != tb:
                out["differ"].append((d, repr(ta), repr(tb)))
            continue
        la, lb = loglikelihoods(sa), loglikelihoods(sb)
        if len(la) != len(lb):
            raise SystemExit(f"lm_eval_compare: {task} doc {d}: {len(la)} vs {len(lb)} choices")
        diff = max(abs(x - y) for x, y in zip(la, lb))
        out["max_abs_dll"] = max(diff, out["max_abs_dll"] or 0.0)
        pa, pb = la.index(max(la)), lb.index(max(lb))
        ga, gb = greedy(sa), greedy(sb)
        if pa != pb or ga != gb:
            out["differ"].append((d, f"choice {pa} greedy {ga}", f"choice {pb} greedy {gb}"))
    return out


def metric(results: dict[str, Any], task: str) -> tuple[str, str]:
    """(metric name, value) of a task: "acc (acc_norm)" for loglikelihood tasks."""
    r = results["results"][task]
    if "acc,none" in r:
        return "acc (acc_norm)", f"{r['acc,none']:.4f} ({r['acc_norm,none']:.4f})"
    for name in ("exact_match,strip", "exact_match,none"):
        if name in r:
            return "exact_match", f"{r[name]:.4f}"
    raise SystemExit(f"lm_eval_compare: {task}: no acc / exact_match in {sorted(r)}")


def summary(a_dir: str, b_dir: str, names: tuple[str, str]) -> str:
    ra, sa = load_run(a_dir)
    rb, sb = load_run(b_dir)
    def run(name: str, r: dict[str, Any]) -> str:
        c = r.get("config", {})
        margs = c.get("model_args") or {}
        args = margs if isinstance(margs, str) else ",".join(
            f"{k}={v}" for k, v in sorted(margs.items())
            if k in ("model", "pretrained", "dtype", "tokenized_requests"))
        secs = float(r.get("total_evaluation_time_seconds", "nan"))
        return f"{name}: lm-eval `{c.get('model')}` ({args}), {secs:.0f} s"

    head = [f"lm-eval {ra.get('lm_eval_version')}; {run(names[0], ra)}; {run(names[1], rb)}.", ""]
    lines = head + [f"| task | metric | {names[0]} | {names[1]} | max abs d loglikelihood | items "
             "| items that differ |", "|---|---|---|---|---|---|---|"]
    notes = []
    for task in sorted(set(sa) & set(sb)):
        c = compare_task(sa[task], sb[task], task)
        m, va = metric(ra, task)
        _, vb = metric(rb, task)
        dll = "-" if c["max_abs_dll"] is None else f"{c['max_abs_dll']:.2e}"
        lines.append(f"| {task} | {m} | {va} | {vb} | {dll} | {c['items']} "
                     f"| {len(c['differ'])} |")
        for d, x, y in c["differ"]:
            notes.append(f"- {task} doc {d}: {names[0]} {x}, {names[1]} {y}")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="lm-eval output_path of the first run (jaxlearn)")
    p.add_argument("b", help="lm-eval output_path of the second run (transformers)")
    p.add_argument("--names", default="jaxlearn,transformers")
    p.add_argument("--out", default=None, help="write the table here too")
    args = p.parse_args(argv)
    names = tuple(args.names.split(","))
    if len(names) != 2:
        raise SystemExit(f"lm_eval_compare: --names wants two names, got {args.names!r}")
    text = summary(args.a, args.b, (names[0], names[1]))
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
