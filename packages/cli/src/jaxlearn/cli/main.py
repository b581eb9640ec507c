"""The `jaxlearn` command: the parser of every subcommand, and the dispatch.

    jaxlearn train --experiment finetune --init_from MODEL_DIR_OR.gguf --data chat.jsonl
                   --output_dir runs/ft
    jaxlearn train --experiment tiny-llama --output_dir runs/tiny [--mesh_selector cpu-8]
                   [--set learner.learning_rate=1e-3 ...] [--max_step N]
                   [--supervise [--max_restarts N] [--restart_backoff_s S]] [--elastic]
    jaxlearn experiments
    jaxlearn config --experiment NAME [--mesh_selector SEL] [--set ...] [train's run flags]
    jaxlearn config-diff A B        (experiment names or flat-text files)
    jaxlearn golden [--write] [--dir DIR]

`train` and `config` build their config with `jaxlearn.experiments.build_run` (train_cmd):
`jaxlearn config` with the same flags prints exactly the config `train` runs; `train`
records the experiment, the selector, every override and the `--init_from` path
(`base_model`) in `<output_dir>/run.json` and in each checkpoint.

`--output_dir` may be an object store, `s3://BUCKET/PATH` (s3fs; `AWS_ENDPOINT_URL` for
an S3-compatible server) or `gs://BUCKET/PATH` (gcsfs): checkpoints, metrics, TensorBoard,
config.txt and run.json go there (see the runtime README).

Errors in what the user gave (unknown experiment, bad --set, bad data, unwritable output
dir, an object store without its backend, credentials or bucket, a checkpoint in
--output_dir from another model) print one line `jaxlearn: error: ...`
and exit with status 2; nothing is written. Detected faults exit with their own status
(42 hang, 43 silent data corruption, 44 non-finite values, 45 health check; see
jaxlearn.resilience.failures), which `--supervise` uses to restart the run. SIGTERM or
SIGINT saves and commits the current step, prints one `jaxlearn: preemption: ...` line and
exits 46 (47: the grace period `resilience.preemption.grace_s` ran out before the commit; a
second signal exits at once with 143/130); a rerun resumes from the newest committed step.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

import jax

from jaxlearn.cli import aot_cmd, export_cmd, launch_cmd, matrix_cmd, serve_cmd, train_cmd
from jaxlearn.cli.common import (
    EXIT_USAGE,
    UsageError,
    final_config,
    in_checkout,
)
from jaxlearn.config import diff_flat_texts, to_flat_text
from jaxlearn.experiments import EXPERIMENTS, golden_drift, write_golden


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxlearn", description="Train and serve large "
                                     "models on JAX (see README.md).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train_cmd.add_parsers(sub)  # train, config
    sub.add_parser("experiments", help="list the named experiments")
    p = sub.add_parser("config-diff", help="diff two configs (experiment names or files)")
    p.add_argument("a")
    p.add_argument("b")
    aot_cmd.add_parsers(sub)  # aot, plan
    matrix_cmd.add_parsers(sub)  # aot-matrix run|render
    serve_cmd.add_parsers(sub)  # serve, generate
    export_cmd.add_parsers(sub)  # export
    launch_cmd.add_parsers(sub, build_parser)  # launch local|slurm|k8s
    p = sub.add_parser("golden", help="check or regenerate golden_configs/")
    p.add_argument("--write", action="store_true", help="rewrite the golden files")
    p.add_argument("--dir", default=None,
                   help="the golden files (default: golden_configs/ of the checkout: "
                        "$JAXLEARN_CHECKOUT, else the directory with pants.toml from the "
                        "current one upwards)")
    return parser


def cmd_experiments(args: argparse.Namespace) -> int:
    for name, fn in sorted(EXPERIMENTS.items()):
        doc = (fn.__doc__ or "").strip().splitlines()
        print(f"{name:16s} {doc[0] if doc else ''}")
    return 0


def _flat_text(name: str) -> str:
    if os.path.exists(name):
        with open(name, encoding="utf-8") as f:
            return f.read()
    return to_flat_text(final_config(name, None, []))


def cmd_config_diff(args: argparse.Namespace) -> int:
    diff = diff_flat_texts(_flat_text(args.a), _flat_text(args.b), args.a, args.b)
    sys.stdout.write(diff)
    return 1 if diff else 0


def cmd_golden(args: argparse.Namespace) -> int:
    directory = args.dir or in_checkout("golden_configs")
    if directory is None:
        raise UsageError("golden: not inside a jaxlearn checkout (no pants.toml in "
                         f"{os.getcwd()} or above, $JAXLEARN_CHECKOUT unset); pass --dir")
    directory = os.path.normpath(directory)
    if args.write:
        names = write_golden(directory)
        print(f"jaxlearn: wrote {len(names)} golden configs to {directory}", file=sys.stderr)
        return 0
    diffs = golden_drift(directory)
    sys.stdout.write("".join(diffs))
    print(f"jaxlearn: {len(diffs)} golden config(s) drifted", file=sys.stderr)
    return 1 if diffs else 0


COMMANDS = {
    **train_cmd.COMMANDS,
    "experiments": cmd_experiments,
    "config-diff": cmd_config_diff,
    **aot_cmd.COMMANDS,
    **matrix_cmd.COMMANDS,
    **serve_cmd.COMMANDS,
    **export_cmd.COMMANDS,
    **launch_cmd.COMMANDS,
    "golden": cmd_golden,
}


def enable_compilation_cache() -> None:
    """Persistent XLA compilation cache (JAXLEARN_COMPILATION_CACHE=0 disables it)."""
    path = os.environ.get("JAXLEARN_COMPILATION_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "jaxlearn", "xla"))
    if path in ("", "0"):
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def _configure_logging() -> None:
    """INFO lines with a time stamp on stderr, unless the root logger already has handlers
    of its own (e.g. pytest's). The handler absl adds on import (orbax logs while it is
    imported, and absl then calls `logging.basicConfig()`) is not one: it is replaced."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if (type(h) is logging.StreamHandler and h.formatter is not None
                and h.formatter._fmt == logging.BASIC_FORMAT):
            root.removeHandler(h)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]  # After the command name (train --supervise re-runs them).
    _configure_logging()
    enable_compilation_cache()
    try:
        return COMMANDS[args.command](args)
    except UsageError as e:
        print(f"jaxlearn: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("jaxlearn: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
