"""The AOT matrix: recipe x hardware target verdicts of `jaxlearn aot`, recorded in a JSON file.

    data = load(path)                                      # {"entries": {key: entry}}
    entry = lookup(path, key, digest)                      # the entry while `digest` matches
    entry = compile_and_record(path, argv, experiment, selector, overrides, digest)
    text = render(path, is_fresh, expected)                # the Markdown page

Every function takes the matrix file's path (the CLI's `--matrix`, default the checkout's
`docs/aot_matrix.json`). `compile_and_record` runs `argv` (a `jaxlearn aot --json` command
line, which sets up the target's fake device count) and merges its per-device figures under
`EXPERIMENT@SELECTOR` (plus ` --set ...` when overridden), with `digest`: the
`config_digest` of the final config. An entry is fresh while that digest still matches the
current config: a recipe or mesh rule edited since the compile makes it stale (`lookup`
gives None, `render` marks it). Naming recipes (building their configs) is the caller's
part: `jaxlearn.experiments.aot_matrix`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
import time
from typing import Any, Callable, Optional, Sequence

import jax

GiB = 2**30
_NOT_COMPILED = re.compile(r"output_dir:|checkpointer\.")


def config_digest(config_text: str, selector: str) -> str:
    """sha256 of a final config's flat text and the selector, without what the compiled
    steps do not depend on (the output paths, the checkpointer's settings)."""
    text = "\n".join(line for line in config_text.splitlines() if not _NOT_COMPILED.match(line))
    return hashlib.sha256(f"{text}\n{selector}".encode()).hexdigest()


def entry_key(experiment: str, selector: str, overrides: Sequence[str]) -> str:
    return f"{experiment}@{selector}" + "".join(f" --set {o}" for o in overrides)


def load(path: str) -> dict[str, Any]:
    """The matrix ({"entries": {key: entry}}); empty when the file does not exist."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {"entries": {}}
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise ValueError(f"{path}: not an AOT matrix (no 'entries' object)")
    return data


def lookup(path: str, key: str, digest: str) -> Optional[dict[str, Any]]:
    """The entry recorded under `key` if its config digest is `digest` (the current one)."""
    entry = load(path)["entries"].get(key)
    if entry is None or entry.get("digest") != digest:
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


def record(path: str, experiment: str, selector: str, overrides: Sequence[str], digest: str,
           result: dict[str, Any]) -> dict[str, Any]:
    """Merges one pair's `result` (a `summarize` dict or {"error": ...}) into the matrix."""
    entry = {"experiment": experiment, "selector": selector, "overrides": list(overrides),
             "digest": digest, "jax": jax.__version__, **result}
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


def compile_and_record(path: str, argv: Sequence[str], experiment: str, selector: str,
                       overrides: Sequence[str], digest: str) -> dict[str, Any]:
    """Runs `argv` (the pair's `jaxlearn aot --json` command line, a subprocess) and records
    its report (or its last error line) with `digest`."""
    t0 = time.monotonic()
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    try:
        result = summarize(json.loads(done.stdout))
    except (ValueError, KeyError):
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        result = {"fits": False, "error": last[-400:]}
    result["wall_seconds"] = round(wall, 1)
    return record(path, experiment, selector, overrides, digest, result)


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


def render(path: str, is_fresh: Callable[[dict[str, Any]], bool],
           expected: Sequence[str] = ()) -> str:
    """The matrix as a Markdown page: one row per recorded pair, marked stale unless
    `is_fresh(entry)`; the `expected` keys not recorded yet are listed after the table."""
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
        lines.append(_row(key, e, is_fresh(e)))
    missing = [k for k in expected if k not in data["entries"]]
    if missing:
        lines += ["", f"Not compiled yet ({len(missing)} pairs): " + ", ".join(missing) + "."]
    return "\n".join(lines) + "\n"


__all__ = ["GiB", "compile_and_record", "config_digest", "entry_key", "load", "lookup",
           "record", "render", "summarize"]
