"""`jaxlearn aot` and `jaxlearn plan`: check a recipe against a hardware target without it.

    jaxlearn aot  --experiment NAME --mesh_selector tpu-v5p-256 [--set ...] [--json]
    jaxlearn plan --experiment NAME --mesh_selector gpu-h100-8x4 [--max_candidates 24] [--json]

`aot` compiles the experiment's train step for the target and prints per-device memory vs
HBM, FLOPs, predicted step time and collectives; it exits 1 if the step does not fit.
`plan` compiles candidate layouts and prints the fastest that fits as a mesh rule; it exits
1 if none fits. Both exit 2 on usage errors. See jaxlearn.aot.target / .compile / .plan.

Fake CPU devices must be requested before JAX initialises: the commands do that first
thing; if JAX is already up with too few CPU devices (e.g. `main()` called from a process
that used JAX), the command re-runs itself in a subprocess with `JAX_NUM_CPU_DEVICES`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any, Optional

from jaxlearn.aot.compile import aot_compile
from jaxlearn.aot.plan import format_plan, plan
from jaxlearn.aot.report import format_report
from jaxlearn.aot.target import AOTError, ensure_cpu_devices, resolve_target
from jaxlearn.cli.common import UsageError, add_experiment_args, final_config
from jaxlearn.inference.aot import compile_inference_steps
from jaxlearn.layers import ScanStack
from jaxlearn.layers.pipeline import pipeline_config
from jaxlearn.mesh import ReplaceConfigModifier, UnknownHardwareError, selector_num_devices

_REEXEC_ENV = "JAXLEARN_AOT_REEXEC"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'123', '16GiB', '80GB', '1.5e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 16GiB, 80GB, 1e9)")
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--mfu", type=float, default=0.5,
                   help="model FLOPs utilisation assumed for the predicted step time")
    p.add_argument("--hbm_bytes", type=parse_bytes, default=None,
                   help="memory per device to check against (default: the hardware "
                        "catalogue's), e.g. 16GiB")
    p.add_argument("--hbm_utilization", type=float, default=0.95,
                   help="share of HBM a step may use")
    p.add_argument("--topology", choices=("auto", "tpu", "fake"), default="auto",
                   help="TPU targets: mock TPU topology (needs libtpu) or a fake CPU mesh")


def add_parsers(sub: Any) -> None:
    """Adds the `aot` and `plan` subcommands to the `jaxlearn` parser."""
    p = sub.add_parser("aot", help="AOT-compile an experiment for a hardware target and "
                                   "check that it fits")
    add_experiment_args(p)
    _common(p)
    p = sub.add_parser("plan", help="search parallelism layouts for a target; print the "
                                    "best as a mesh rule")
    add_experiment_args(p)
    _common(p)
    p.add_argument("--max_candidates", type=int, default=24,
                   help="at most this many layouts are compiled")
    p.add_argument("--remat_target", default="auto",
                   help="regex of module config paths whose remat_spec is varied ('auto': "
                        "the transformer layer, or where the recipe set remat; 'none': "
                        "do not vary remat)")
    p.add_argument("--remat_policies", default="dots_saveable,nothing_saveable",
                   help="remat policies to try when memory is short, weakest first")
    p.add_argument("--microbatches", default="1,2,4,8",
                   help="gradient accumulation counts to try when memory is short")
    p.add_argument("--max_model_parallel", type=int, default=16)
    p.add_argument("--search", choices=("estimate", "compile"), default="estimate",
                   help="estimate: rank every layout analytically, compile the best; "
                        "compile: compile-driven search")
    p.add_argument("--finalists", type=int, default=2,
                   help="estimate search: stop once this many compiled layouts fit")
    p.add_argument("--attention", default="einsum,blockwise",
                   help="self-attention implementations to try ('' keeps the recipe's)")
    p.add_argument("--pipeline_stages", default="2,4",
                   help="pipeline stage counts to try ('' for none)")


def _argv(args: argparse.Namespace) -> list[str]:
    """The command line that reproduces `args` (for the re-run in a subprocess)."""
    out = [args.command, "--experiment", args.experiment, "--mesh_selector", args.mesh_selector]
    for o in args.overrides:
        out += ["--set", o]
    if args.json:
        out.append("--json")
    out += ["--mfu", repr(args.mfu), "--hbm_utilization", repr(args.hbm_utilization),
            "--topology", args.topology]
    if args.hbm_bytes is not None:
        out += ["--hbm_bytes", str(args.hbm_bytes)]
    if args.command == "plan":
        out += ["--max_candidates", str(args.max_candidates), "--remat_target",
                args.remat_target, "--remat_policies", args.remat_policies, "--microbatches",
                args.microbatches, "--max_model_parallel", str(args.max_model_parallel),
                "--search", args.search, "--finalists", str(args.finalists),
                "--attention", args.attention, "--pipeline_stages", args.pipeline_stages]
    return out


def _devices_ready(args: argparse.Namespace) -> Optional[int]:
    """Requests the target's device count as fake CPU devices; if JAX is already up with
    too few, re-runs the command in a subprocess and returns its exit status."""
    if not args.mesh_selector:
        raise UsageError(f"{args.command} needs --mesh_selector (e.g. tpu-v5p-256, "
                         f"gpu-h100-8x4, trn2-16, cpu-8)")
    try:
        n = selector_num_devices(args.mesh_selector)
    except UnknownHardwareError as e:
        raise UsageError(str(e)) from None
    if ensure_cpu_devices(n):
        return None
    if os.environ.get(_REEXEC_ENV):
        raise UsageError(f"could not get {n} fake CPU devices (JAX_NUM_CPU_DEVICES={n})")
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(n), **{_REEXEC_ENV: "1"})
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                              env.get("XLA_FLAGS", "")).strip()
    proc = subprocess.run([sys.executable, "-m", "jaxlearn.cli", *_argv(args)], env=env,
                          check=False)
    return proc.returncode


def _target(args: argparse.Namespace) -> Any:
    try:
        return resolve_target(args.mesh_selector, hbm_bytes=args.hbm_bytes,
                              topology=args.topology)
    except AOTError as e:
        raise UsageError(str(e)) from None


def pipeline_hook(stages: int, microbatches: int) -> tuple[Any, str]:
    """The modifier that turns every ScanStack into a PipelineStack (and its source), for
    the planner (the aot package cannot import the layers)."""
    mod = ReplaceConfigModifier.default_config().set(
        match=ScanStack, replacement=pipeline_config(stages, microbatches))
    text = ("ReplaceConfigModifier.default_config().set(match=ScanStack, "
            f"replacement=pipeline_config({stages}, {microbatches}))")
    return mod, text


def cmd_aot(args: argparse.Namespace) -> int:
    rc = _devices_ready(args)
    if rc is not None:
        return rc
    target = _target(args)
    cfg = final_config(args.experiment, args.mesh_selector, args.overrides)
    try:
        report = aot_compile(cfg, target, mfu=args.mfu, hbm_utilization=args.hbm_utilization,
                             # The inference steps: the aot package cannot import the
                             # inference package; the CLI links them.
                             inference_steps=compile_inference_steps)
    except AOTError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print(format_report(report))
    return 0 if report.fits else 1


def cmd_plan(args: argparse.Namespace) -> int:
    rc = _devices_ready(args)
    if rc is not None:
        return rc
    target = _target(args)
    cfg = final_config(args.experiment, args.mesh_selector, args.overrides)
    remat_target = None if args.remat_target == "none" else args.remat_target
    try:
        policies = tuple(p for p in args.remat_policies.split(",") if p)
        microbatches = tuple(int(m) for m in args.microbatches.split(",") if m)
        stages = tuple(int(m) for m in args.pipeline_stages.split(",") if m)
    except ValueError:
        raise UsageError(f"--microbatches / --pipeline_stages: not integers: "
                         f"{args.microbatches!r} / {args.pipeline_stages!r}") from None
    attention = tuple(a for a in args.attention.split(",") if a)

    def progress(c: Any) -> None:
        status = "fits" if c.fits else ("error" if c.report is None else "does not fit")
        print(f"jaxlearn plan: {c.layout.describe()}: {status}", file=sys.stderr, flush=True)

    try:
        result = plan(cfg, target, max_candidates=args.max_candidates, mfu=args.mfu,
                      hbm_utilization=args.hbm_utilization, remat_target=remat_target,
                      remat_policies=policies, microbatches=microbatches,
                      max_model_parallel=args.max_model_parallel, progress=progress,
                      search=args.search, finalists=args.finalists, attention=attention,
                      pipeline=pipeline_hook if stages else None, pipeline_stages=stages)
    except AOTError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(format_plan(result))
    return 0 if result.winner is not None else 1


COMMANDS = {"aot": cmd_aot, "plan": cmd_plan}

__all__ = ["COMMANDS", "add_parsers", "cmd_aot", "cmd_plan", "parse_bytes"]
