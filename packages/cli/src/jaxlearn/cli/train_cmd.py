"""`jaxlearn train` and `jaxlearn config`: the same flags, one builder.

    jaxlearn train --experiment NAME --output_dir DIR [--mesh_selector SEL] [--set ...]
                   [--max_step N] [--data PATH ...] [--profile_steps 5,6] [--elastic]
                   [--init_from PATH [--init_adapter PEFT_DIR_OR_RUN]] [--reward SPEC ...]
                   [--supervise [--max_restarts N] [--restart_backoff_s S]]
                   [--coordinator_address H:P --num_processes N --process_id I ...]
    jaxlearn config --experiment NAME [--mesh_selector SEL] [--set ...] [train's run flags]

Both parse their flags into `jaxlearn.experiments.RunFlags` and call
`jaxlearn.experiments.build_run`, which builds, validates, adapts (`--elastic`) and checks the
input pipeline of the final config: `config` prints it, `train` runs it, so both see the same
config. The run flags are the rows of `experiments.RUN_FLAGS` (`RUN_FLAG_ARGS` here gives
each its argparse settings; a test checks both tables name the same flags).

`train` joins the process group first (the multi-process flags, or the scheduler's
variables: `jaxlearn.launch.distributed`), then builds the config, checks the output
directory, and runs the trainer; errors it can name map to one `jaxlearn: error:` line (exit
2), detected faults to their own exit status (`jaxlearn.resilience.failures`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from jaxlearn.checkpoint import (
    CheckpointStructureError,
    NoGoodCheckpointError,
    StorageError,
    storage,
)
from jaxlearn.cli.common import UsageError, add_experiment_args, one_line
from jaxlearn.config import ConfigError, to_flat_text
from jaxlearn.experiments import (
    RUN_FLAGS,
    BuildError,
    BuiltRun,
    RunFlags,
    build_run,
    resolve_selector,
)
from jaxlearn.experiments.build import normalize_output_dir
from jaxlearn.interop import InteropError
from jaxlearn.launch import distributed
from jaxlearn.mesh import detect_hardware, hardware_for_selector
from jaxlearn.resilience.failures import Preempted, ResilienceError
from jaxlearn.resilience.manager import CheckpointSaveFailed
from jaxlearn.resilience.supervisor import Supervisor, child_argv, python_module_command
from jaxlearn.runtime.data import DataError
from jaxlearn.runtime.init_from import InitFromError
from jaxlearn.runtime.summary import format_number
from jaxlearn.runtime.trainer import TrainerError

EXIT_DISTRIBUTED = 3

# argparse settings of each run flag (`experiments.RUN_FLAGS` says which fields it sets).
RUN_FLAG_ARGS: dict[str, dict[str, Any]] = {
    "output_dir": dict(default=None, help=(
        "checkpoints, TensorBoard, metrics: a local directory or an object store, "
        "s3://BUCKET/PATH (needs s3fs; AWS_ENDPOINT_URL for an S3-compatible server) or "
        "gs://BUCKET/PATH (needs gcsfs)")),
    "max_step": dict(type=int, default=None, help="stop after this many steps"),
    "data": dict(action="append", default=[], metavar="PATH", help=(
        "train on local .txt/.jsonl files or directories instead of the bundled data "
        "(repeatable)")),
    "profile_steps": dict(type=str, default=None, help=(
        "comma-separated steps to trace with the JAX profiler, e.g. 5,6,7")),
    "init_from": dict(default=None, metavar="PATH", help=(
        "start from a pretrained model: an HF model directory, a GGUF file or a jaxlearn "
        "run; its architecture, tokenizer and chat template become the model and input "
        "fields, its weights the first params (a run with checkpoints resumes them instead)")),
    "init_adapter": dict(default=None, metavar="PATH", help=(
        "with --init_from BASE and a LoRA recipe: train on from a LoRA adapter of BASE, a "
        "PEFT adapter directory (adapter_config.json + adapter_model.safetensors) or a "
        "jaxlearn LoRA run; its rank, alpha, dropout and adapted projections replace the "
        "recipe's, its lora_A/lora_B the first adapter params")),
    "elastic": dict(action="store_true", help=(
        "on a device count other than the run's first, keep the global batch by raising "
        "learner.num_microbatches (the mesh's -1 axis adapts)")),
    "reward": dict(action="append", default=[], metavar="SPEC", help=(
        "RL recipes: a reward function, repeatable: a built-in (numeric_match, exact_match, "
        "length), regex:PATTERN, json_schema:FILE, FILE.py:function or module:function; "
        "weights: the rollout.reward_weights field")),
}


def add_run_args(p: argparse.ArgumentParser, *, output_dir_required: bool) -> None:
    """One flag per `RUN_FLAGS` row, its help ending with the fields it sets."""
    for name, row in RUN_FLAGS.items():
        kwargs = dict(RUN_FLAG_ARGS[name])
        kwargs["help"] = f"{kwargs['help']} (sets {row.fields})"
        if name == "output_dir":
            kwargs["required"] = output_dir_required
        p.add_argument(f"--{name}", **kwargs)


def run_flags(args: argparse.Namespace) -> RunFlags:
    """The parsed run flags as typed `RunFlags`."""
    values = {name: getattr(args, name) for name in RUN_FLAGS}
    values["data"] = tuple(values["data"])
    values["reward"] = tuple(values["reward"])
    return RunFlags(**values)


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """Multi-process flags of `jaxlearn train` (each also readable from the environment)."""
    g = p.add_argument_group(
        "multi-process", "Default: detected from Slurm, Open MPI, Kubernetes/JobSet or "
        "JAXLEARN_* variables (see `jaxlearn launch`); one process if none are set.")
    g.add_argument("--coordinator_address", default=None, metavar="HOST:PORT",
                   help="process 0's address, the same for every process")
    g.add_argument("--num_processes", type=int, default=None)
    g.add_argument("--process_id", type=int, default=None)
    g.add_argument("--local_device_ids", default=None, metavar="I,J,...",
                   help="accelerators this process uses (default: all local ones)")
    g.add_argument("--initialization_timeout", type=float, default=None, metavar="SECONDS",
                   help="give up (naming the missing processes) if not all have joined "
                        "(default: $JAXLEARN_INITIALIZATION_TIMEOUT or 300)")
    g.add_argument("--heartbeat_timeout", type=float, default=None, metavar="SECONDS",
                   help="a process silent this long is dead (default: "
                        "$JAXLEARN_HEARTBEAT_TIMEOUT or 100)")
    g.add_argument("--num_cpu_devices", type=int, default=None,
                   help="CPU devices per process (CPU runs and tests)")


def add_parsers(sub: Any) -> None:
    """Adds `train` and `config` to the `jaxlearn` parser."""
    p = sub.add_parser("train", help="train an experiment (resumes from --output_dir)")
    add_experiment_args(p)
    add_run_args(p, output_dir_required=True)
    p.add_argument("--supervise", action="store_true",
                   help="run training in a child process and restart it (from the newest "
                        "good checkpoint) when it crashes or hangs; implies --elastic")
    p.add_argument("--max_restarts", type=int, default=3,
                   help="with --supervise: restart budget (default 3)")
    p.add_argument("--restart_backoff_s", type=float, default=10.0,
                   help="with --supervise: first restart delay, doubled each restart")
    add_distributed_args(p)
    p = sub.add_parser("config", help="print an experiment's final config (flat text form), "
                       "with the same flags as train")
    add_experiment_args(p)
    add_run_args(p, output_dir_required=False)


def start_distributed(args: argparse.Namespace) -> Any:
    """Joins the process group `args` and the environment describe (before any JAX use)."""
    ids = None
    if args.local_device_ids:
        try:
            ids = [int(x) for x in args.local_device_ids.split(",")]
        except ValueError:
            raise UsageError(f"--local_device_ids {args.local_device_ids!r}: expected "
                             "I,J,...") from None
    try:
        return distributed.initialize(
            args.coordinator_address, args.num_processes, args.process_id, ids,
            initialization_timeout=args.initialization_timeout,
            heartbeat_timeout=args.heartbeat_timeout, num_cpu_devices=args.num_cpu_devices)
    except distributed.ClusterConfigError as e:
        raise UsageError(str(e)) from None
    except distributed.DistributedError as e:
        print(f"jaxlearn: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_DISTRIBUTED) from None


def _build(args: argparse.Namespace, *, warn: bool) -> BuiltRun:
    """`build_run` of the flags (its BuildError a UsageError); with `warn`, a loud line
    first when the selector's hardware is not this machine's."""
    try:
        selector = resolve_selector(args.mesh_selector)
        if warn:
            _warn_other_hardware(selector)
        return build_run(args.experiment, selector, args.overrides, run_flags(args))
    except BuildError as e:
        raise UsageError(str(e)) from None


def _warn_other_hardware(selector: str) -> None:
    target, here = hardware_for_selector(selector), detect_hardware()
    if target.platform != here.platform:
        print(f"jaxlearn: WARNING: --mesh_selector {selector} is a mesh for {target.kind} "
              f"({target.platform}) hardware, but this machine has {here.kind} devices: the run "
              f"uses that mesh's rule on {here.platform}", file=sys.stderr)


def _check_output_dir(path: str) -> list[str]:
    """Creates a local `path` (checks a remote one's backend); returns the directories it
    created, deepest first, for `_remove_if_empty`."""
    if storage.is_remote(path):
        try:
            storage.resolve(path)  # Backend package, credentials, bucket.
        except StorageError as e:
            raise UsageError(f"--output_dir {one_line(e)}") from None
        return []
    created, missing = [], os.path.abspath(path)
    while not os.path.lexists(missing) and missing != os.path.dirname(missing):
        created.append(missing)
        missing = os.path.dirname(missing)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--output_dir {path}: cannot create it ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--output_dir {path}: not writable")
    return created


def _remove_if_empty(created: list[str]) -> None:
    """Removes the directories `_check_output_dir` created (deepest first) while empty."""
    for directory in created:
        try:
            os.rmdir(directory)
        except OSError:
            return


_SUPERVISOR_FLAGS = {"--supervise": False, "--max_restarts": True, "--restart_backoff_s": True}


def _supervise(args: argparse.Namespace) -> int:
    """The parent of `train --supervise`: never touches the accelerators itself."""
    if args.max_restarts < 0:
        raise UsageError(f"--max_restarts must be >= 0, got {args.max_restarts}")
    if not args.restart_backoff_s >= 0:
        raise UsageError(f"--restart_backoff_s must be >= 0, got {args.restart_backoff_s}")
    argv = ["train", *child_argv(args.argv, _SUPERVISOR_FLAGS)]
    argv += ["--elastic", "--set", "resilience.watchdog.exit_on_hang=True"]
    supervisor = Supervisor(python_module_command("jaxlearn.cli", argv),
                            output_dir=storage.local_dir(args.output_dir),
                            max_restarts=args.max_restarts,
                            backoff_s=args.restart_backoff_s)
    return supervisor.run()


def cmd_train(args: argparse.Namespace) -> int:
    args.output_dir = normalize_output_dir(args.output_dir)
    if args.supervise:
        return _supervise(args)
    start_distributed(args)  # Multi-process: join before any JAX use.
    run = _build(args, warn=True)
    try:
        trainer = run.config.instantiate(run_record=run.record())
    except (ConfigError, TrainerError) as e:
        raise UsageError(str(e)) from None
    created = _check_output_dir(args.output_dir)
    try:
        return _run_trainer(args, trainer, run)
    except BaseException:  # An early failure leaves no empty directory behind.
        _remove_if_empty(created)
        raise


def _run_trainer(args: argparse.Namespace, trainer: Any, run: BuiltRun) -> int:
    if run.elastic is not None:
        run.elastic.record()
    print(f"jaxlearn: training {args.experiment} on {len(trainer.mesh.devices.flat)} device(s) "
          f"(mesh {dict(trainer.mesh.shape)}), output in {args.output_dir}", file=sys.stderr)
    try:
        last = trainer.run().metrics
    except (InitFromError, InteropError) as e:  # The pretrained params do not fit the model.
        raise UsageError(f"--init_from {args.init_from}: {one_line(e)}") from None
    except (CheckpointStructureError, NoGoodCheckpointError, DataError) as e:
        # Another model's checkpoint, all checkpoints damaged, another input's state.
        raise UsageError(f"--output_dir {args.output_dir}: {one_line(e)}") from None
    except Preempted as e:  # SIGTERM/SIGINT: status 46 (saved) or 47; a rerun resumes.
        print(f"jaxlearn: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    except ResilienceError as e:
        print(f"jaxlearn: error: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    except CheckpointSaveFailed as e:
        print(f"jaxlearn: error: {one_line(e)}", file=sys.stderr)
        return 1
    print("jaxlearn: done. " + ", ".join(f"{k}={format_number(v)}"
                                         for k, v in sorted(last.items())), file=sys.stderr)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    sys.stdout.write(to_flat_text(_build(args, warn=False).config))
    return 0


COMMANDS = {"train": cmd_train, "config": cmd_config}

__all__ = ["COMMANDS", "RUN_FLAG_ARGS", "add_distributed_args", "add_parsers", "add_run_args",
           "cmd_config", "cmd_train", "run_flags", "start_distributed"]
