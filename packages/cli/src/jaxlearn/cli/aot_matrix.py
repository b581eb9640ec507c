"""The AOT matrix: every recipe x hardware target compiled by `jaxlearn aot`, recorded.

    tools/aot_matrix.sh [RECIPES] [SELECTORS]     # compile, record, render (docs/)
    python -m jaxlearn.cli.aot_matrix run --experiment E --mesh_selector S [--set P=V ...]
    python -m jaxlearn.cli.aot_matrix render      # docs/aot_matrix.json -> docs/aot_matrix.md
    entry = lookup(experiment, selector, overrides)   # the recorded verdict, or None

`run` compiles one pair in a subprocess (`jaxlearn aot --json`, which sets up the target's
fake device count), then merges its per-device figures into the matrix JSON
(`$JAXLEARN_AOT_MATRIX`, default the checkout's `docs/aot_matrix.json`) under
`EXPERIMENT@SELECTOR` (plus ` --set ...` when overridden), keyed also by the digest of the
final config (less the output paths and the checkpointer's settings, which the compiled
steps do not depend on). `lookup` gives the entry only while that digest still matches: a recipe or
mesh rule edited since the compile makes its entry stale, and `render` marks it so.
`jaxlearn launch` (`launch_fit.check_fit`) uses a fresh entry instead of its floor estimate.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

GiB = 2**30
_DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), *[os.pardir] * 5, "docs")


def matrix_path() -> str:
    """$JAXLEARN_AOT_MATRIX, else docs/aot_matrix.json of the checkout this module is in."""
    return os.environ.get("JAXLEARN_AOT_MATRIX") or os.path.normpath(
        os.path.join(_DOCS, "aot_matrix.json"))


_NOT_COMPILED = re.compile(r"output_dir:|checkpointer\.")


def config_digest(experiment: str, selector: str, overrides: Sequence[str]) -> str:
    """sha256 of the final config's flat text and the selector, without what the compiled
    steps do not depend on (the output paths, the checkpointer's settings)."""
    from jaxlearn.cli.main import final_config
    from jaxlearn.config import to_flat_text

    text = to_flat_text(final_config(experiment, selector, overrides))
    text = "\n".join(line for line in text.splitlines() if not _NOT_COMPILED.match(line))
    return hashlib.sha256(f"{text}\n{selector}".encode()).hexdigest()


def entry_key(experiment: str, selector: str, overrides: Sequence[str]) -> str:
    return f"{experiment}@{selector}" + "".join(f" --set {o}" for o in overrides)


def load(path: Optional[str] = None) -> dict[str, Any]:
    """The matrix ({"entries": {key: entry}}); empty when the file does not exist."""
    try:
        with open(path or matrix_path(), encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {"entries": {}}
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise ValueError(f"{path or matrix_path()}: not an AOT matrix (no 'entries' object)")
    return data


def lookup(experiment: str, selector: str, overrides: Sequence[str],
           path: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The recorded entry of this pair if its config digest matches the current config."""
    entry = load(path)["entries"].get(entry_key(experiment, selector, overrides))
    if entry is None or entry.get("digest") != config_digest(experiment, selector, overrides):
        return None
    return dict(entry)


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """What the matrix keeps of a `jaxlearn aot --json` report (per-device bytes)."""
    step = report["steps"]["train_step"]
    state = step.get("state_breakdown") or {}
    params = int(state.get("params", 0))
    return {
        "fits": bool(report["fits"]),
        "train_step_fits": bool(step["fits"]),
        "backend": report["backend"],
        "num_devices": report["num_devices"],
        "mesh": report["mesh"],
        "num_microbatches": report["num_microbatches"],
        "remat": sorted(set(report["remat"].values())),
        "required_bytes": step["required_bytes"],
        "usable_bytes": step["usable_hbm_bytes"],
        "hbm_bytes": step["hbm_bytes"],
        "params_bytes": params,
        "optimizer_bytes": int(sum(state.values())) - params,
        "argument_bytes": step["argument_bytes"],
        "temp_bytes": step["temp_bytes"],
        "step_seconds": step["step_seconds"],
        "compute_seconds": step["compute_seconds"],
        "comm_seconds": step["comm_seconds"],
        "mfu_assumed": report["mfu"],
        "flops_per_device": step["flops"],
        "compile_seconds": step["compile_seconds"],
        "inference_fits": {k: bool(v["fits"]) for k, v in report["steps"].items()
                           if k != "train_step"},
    }


def record(experiment: str, selector: str, overrides: Sequence[str], result: dict[str, Any],
           path: Optional[str] = None) -> dict[str, Any]:
    """Merges one pair's `result` (a `summarize` dict or {"error": ...}) into the matrix."""
    import jax

    path = path or matrix_path()
    entry = {"experiment": experiment, "selector": selector, "overrides": list(overrides),
             "digest": config_digest(experiment, selector, overrides),
             "jax": jax.__version__, **result}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".lock", "w") as lock:  # Pairs compiled side by side merge in turn.
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = load(path)
        data["entries"][entry_key(experiment, selector, overrides)] = entry
        data["entries"] = dict(sorted(data["entries"].items()))
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(path + ".tmp", path)
    return entry


def run(experiment: str, selector: str, overrides: Sequence[str],
        path: Optional[str] = None) -> dict[str, Any]:
    """Compiles the pair with `jaxlearn aot --json` (a subprocess) and records it."""
    sets = [w for o in overrides for w in ("--set", o)]
    argv = [sys.executable, "-m", "jaxlearn.cli", "aot", "--json", "--experiment", experiment,
            "--mesh_selector", selector, *sets]
    t0 = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    try:
        result = summarize(json.loads(done.stdout))
    except (ValueError, KeyError):
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        result = {"fits": False, "error": last[-400:]}
    result["wall_seconds"] = round(wall, 1)
    return record(experiment, selector, overrides, result, path)


# ---- the Markdown table --------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def _row(key: str, e: dict[str, Any], fresh: bool) -> str:
    name = key if fresh else f"{key} (stale)"
    wall = f"{e['wall_seconds'] / 60:.1f}" if "wall_seconds" in e else "-"
    if "error" in e:
        return (f"| {name} | - | - | - | - | - | - | NO (error: {e['error'][:120]}) | - | - | "
                f"{wall} |")
    mesh = "x".join(f"{k}{v}" for k, v in e["mesh"].items() if v > 1) or "1"
    bound = "compute" if e["compute_seconds"] >= e["comm_seconds"] else "comm"
    fits = "yes" if e["fits"] else ("NO" if not e["train_step_fits"] else "NO (inference)")
    mfu = e["mfu_assumed"] * e["compute_seconds"] / max(e["step_seconds"], 1e-12)
    return (f"| {name} | {mesh} | {e['num_microbatches']} | "
            f"{_gib(e['params_bytes'])} + {_gib(e['optimizer_bytes'])} | "
            f"{_gib(e['temp_bytes'])} | **{_gib(e['required_bytes'])}** | "
            f"{_gib(e['usable_bytes'])} | {fits} | {e['step_seconds']:.1f} ({bound}) | "
            f"{mfu:.2f} | {e['compile_seconds'] / 60:.1f} / {wall} |")


def render(path: Optional[str] = None) -> str:
    """The matrix as a Markdown page (one row per recorded pair)."""
    data = load(path)
    lines = [
        "# AOT matrix: every real-size recipe x hardware target",
        "",
        "Generated by `tools/aot_matrix.sh` (see the README, \"Checking a target\"); do not",
        "edit by hand. Per device, from `jaxlearn aot` (the real train step compiled on a fake",
        "CPU mesh of the target's size; temporaries are the CPU compiler's estimate, usually",
        "high). `params + opt` is the sharded f32 parameters + Adam state; `temp` every",
        "temporary (gradients, gathered layer weights, saved activations, loss chunks);",
        "`required` is what is checked against `usable` (0.95 x HBM). Step time: the aot time",
        "model, max(compute at MFU 0.5, collectives at link bandwidth); `FLOP util` = 0.5 x",
        "compute / step time (hardware FLOPs, remat recompute included). Minutes: the train",
        "step's compile / the whole `jaxlearn aot` run (train and inference steps) on the",
        "machine that recorded it. A row marked stale was compiled from a config that has",
        "changed since; `jaxlearn launch` ignores it.",
        "",
        "| pair | mesh | micro-batches | params + opt (GiB) | temp (GiB) | required (GiB) | "
        "usable (GiB) | fits | step s (bound) | FLOP util | minutes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, e in data["entries"].items():
        try:
            fresh = e.get("digest") == config_digest(e["experiment"], e["selector"],
                                                     e.get("overrides", []))
        except Exception:  # noqa: BLE001 - a recipe that no longer exists is stale
            fresh = False
        lines.append(_row(key, e, fresh))
    missing = [f"{r}@{s}" for r, s in default_pairs() if f"{r}@{s}" not in data["entries"]]
    if missing:
        lines += ["", f"Not compiled yet ({len(missing)} pairs): " + ", ".join(missing) + "."]
    return "\n".join(lines) + "\n"


def default_pairs() -> list[tuple[str, str]]:
    """Every real-size recipe x every accelerator golden selector (`tools/aot_matrix.sh`)."""
    from jaxlearn.experiments import REAL_SIZE, SELECTORS

    return [(r, s) for r in REAL_SIZE for s in SELECTORS if not s.startswith("cpu")]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxlearn.cli.aot_matrix")
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="compile one pair and record it")
    r.add_argument("--experiment", required=True)
    r.add_argument("--mesh_selector", required=True)
    r.add_argument("--set", dest="overrides", action="append", default=[])
    w = sub.add_parser("render", help="write the Markdown table next to the JSON")
    w.add_argument("--output", default=None, help="default: aot_matrix.md next to the JSON")
    args = p.parse_args(argv)
    if args.what == "run":
        e = run(args.experiment, args.mesh_selector, args.overrides)
        verdict = "FITS" if e["fits"] else "NO"
        detail = e.get("error") or (f"{_gib(e['required_bytes'])} of "
                                    f"{_gib(e['usable_bytes'])} GiB usable")
        print(f"{verdict:9} {entry_key(args.experiment, args.mesh_selector, args.overrides)}"
              f" ({detail}; {e['wall_seconds'] / 60:.1f} min)", flush=True)
        return 0 if e["fits"] else 1
    out = args.output or os.path.splitext(matrix_path())[0] + ".md"
    with open(out, "w", encoding="utf-8") as f:
        f.write(render())
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
