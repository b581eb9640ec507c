"""The `jaxlearn` command.

    jaxlearn train --experiment finetune --init_from MODEL_DIR_OR.gguf --data chat.jsonl
                   --output_dir runs/ft
    jaxlearn train --experiment tiny-llama --output_dir runs/tiny [--mesh_selector cpu-8]
                   [--set learner.learning_rate=1e-3 ...] [--max_step N]
                   [--supervise [--max_restarts N] [--restart_backoff_s S]] [--elastic]
    jaxlearn experiments
    jaxlearn config --experiment NAME [--mesh_selector SEL] [--set ...] [train's run flags]
    jaxlearn config-diff A B        (experiment names or flat-text files)

The run flags (`--output_dir`, `--max_step`, `--data`, `--profile_steps`, `--elastic`) are
config overrides (`run_flag_overrides`), applied after `--set`, so `jaxlearn config` with
the same flags prints exactly the config `train` runs; `train` records the experiment, the
selector, every override and the `--init_from` path (`base_model`) in
`<output_dir>/run.json` and in each checkpoint. `--init_from` sets the model, tokenizer and
chat template fields from the pretrained model before the mesh rules (`cli.init_from`).

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
from typing import Any, Optional, Sequence

from jaxlearn.cli import aot_cmd, export_cmd, launch_cmd, serve_cmd

EXIT_USAGE = 2


class UsageError(Exception):
    """A problem with what the user asked for; printed as one line."""


def _add_experiment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experiment", required=True, help="recipe name (see `jaxlearn experiments`)")
    p.add_argument("--mesh_selector", default=None,
                   help="hardware target, e.g. cpu-8, tpu-v5p-256, gpu-h100-8x4 "
                        "(default: detected from this machine)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a config field, e.g. --set model.decoder.transformer.num_layers=4"
                        " or --set learner.learning_rate=1e-3 (repeatable; values are Python "
                        "literals; `jaxlearn config` lists every path)")


def _add_run_args(p: argparse.ArgumentParser, *, output_dir_required: bool) -> None:
    """The flags that stand for config fields (see `run_flag_overrides`)."""
    p.add_argument("--output_dir", required=output_dir_required, default=None,
                   help="checkpoints, TensorBoard, metrics: a local directory or an object "
                        "store, s3://BUCKET/PATH (needs s3fs; AWS_ENDPOINT_URL for an "
                        "S3-compatible server) or gs://BUCKET/PATH (needs gcsfs) "
                        "(sets output_dir)")
    p.add_argument("--max_step", type=int, default=None,
                   help="stop after this many steps (sets max_step)")
    p.add_argument("--data", action="append", default=[], metavar="PATH",
                   help="train on local .txt/.jsonl files or directories instead of the "
                        "bundled data (repeatable; sets input.source and eval_input.source)")
    p.add_argument("--profile_steps", type=str, default=None,
                   help="comma-separated steps to trace with the JAX profiler, e.g. 5,6,7 "
                        "(sets profile_steps)")
    p.add_argument("--init_from", default=None, metavar="PATH",
                   help="start from a pretrained model: an HF model directory, a GGUF file or "
                        "a jaxlearn run; its architecture, tokenizer and chat template become "
                        "the model and input fields, its weights the first params (sets "
                        "init_from; a run with checkpoints resumes them instead)")
    p.add_argument("--elastic", action="store_true",
                   help="on a device count other than the run's first, keep the global batch "
                        "by raising learner.num_microbatches (the mesh's -1 axis adapts; "
                        "sets resilience.elastic)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxlearn", description="Train and serve large "
                                     "models on JAX (see README.md).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train an experiment (resumes from --output_dir)")
    _add_experiment_args(p)
    _add_run_args(p, output_dir_required=True)
    p.add_argument("--supervise", action="store_true",
                   help="run training in a child process and restart it (from the newest "
                        "good checkpoint) when it crashes or hangs; implies --elastic")
    p.add_argument("--max_restarts", type=int, default=3,
                   help="with --supervise: restart budget (default 3)")
    p.add_argument("--restart_backoff_s", type=float, default=10.0,
                   help="with --supervise: first restart delay, doubled each restart")
    launch_cmd.add_distributed_args(p)  # --coordinator_address, --num_processes, ...

    sub.add_parser("experiments", help="list the named experiments")

    p = sub.add_parser("config", help="print an experiment's final config (flat text form), "
                       "with the same flags as train")
    _add_experiment_args(p)
    _add_run_args(p, output_dir_required=False)

    p = sub.add_parser("config-diff", help="diff two configs (experiment names or files)")
    p.add_argument("a")
    p.add_argument("b")

    aot_cmd.add_parsers(sub, _add_experiment_args)  # aot, plan
    serve_cmd.add_parsers(sub)  # serve, generate
    export_cmd.add_parsers(sub)  # export
    launch_cmd.add_parsers(sub)  # launch local|slurm|k8s

    p = sub.add_parser("golden", help="check or regenerate golden_configs/")
    p.add_argument("--write", action="store_true", help="rewrite the golden files")
    p.add_argument("--dir", default=None, help="default: <repo>/golden_configs")
    return parser


def final_config(experiment: str, mesh_selector: Optional[str], overrides: Sequence[str],
                 *, validate: bool = True, init_from: Optional[str] = None) -> Any:
    """Recipe -> `--init_from` model (`cli.init_from`) -> mesh rule for the selector ->
    `path=value` overrides -> validation (field limits, `Config.validate`). `run.json`'s
    experiment, mesh_selector, overrides and base_model give the run's config again."""
    from jaxlearn.config import ConfigError, apply_overrides
    from jaxlearn.experiments import get_experiment
    from jaxlearn.experiments.init_from import InitFromUsageError, apply_init_from
    from jaxlearn.mesh import MeshError, apply_mesh_rules

    try:
        cfg: Any = get_experiment(experiment)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None
    try:
        cfg = apply_init_from(cfg, init_from)
    except InitFromUsageError as e:
        raise UsageError(str(e)) from None
    selector = resolve_selector(mesh_selector)
    try:
        cfg, _ = apply_mesh_rules(cfg, selector)
        apply_overrides(cfg, overrides)
        if validate:
            cfg.validate()
    except (ConfigError, MeshError) as e:
        raise UsageError(_one_line(e)) from None
    return cfg


def resolve_selector(selector: Optional[str]) -> str:
    """`selector` checked against the hardware catalogue, or this machine's selector."""
    from jaxlearn.mesh import HARDWARE, UnknownHardwareError, current_selector, parse_selector

    if selector is None:
        return current_selector()
    try:
        parse_selector(selector)
    except UnknownHardwareError as e:
        raise UsageError(f"--mesh_selector {selector!r} is not a known mesh selector "
                         f"({str(e).split(';')[0]}); known kinds: {', '.join(sorted(HARDWARE))}, "
                         "written KIND-COUNT such as cpu-8 or tpu-v5p-256") from None
    return selector


def run_flag_overrides(args: argparse.Namespace, cfg: Any) -> list[tuple[str, str]]:
    """(flag, `path=value` override) for every run flag given: the one place where flags
    become config fields. `cfg` (the config after `--set`) tells which inputs exist."""
    out = []
    if args.output_dir is not None:
        out.append(("--output_dir", f"output_dir={args.output_dir!r}"))
    if args.max_step is not None:
        out.append(("--max_step", f"max_step={args.max_step}"))
    if args.data:
        for name in ("input", "eval_input"):
            inp = getattr(cfg, name, None)
            if inp is None:
                continue
            if not _is_sft_source(inp.source):  # SFT rows stay SFT rows: only the paths
                out.append(("--data", f"{name}.source=jaxlearn.runtime.data.TextFilesSource"))
            out.append(("--data", f"{name}.source.paths={list(args.data)!r}"))
    if args.profile_steps is not None:
        try:
            steps = tuple(int(s) for s in args.profile_steps.split(",") if s.strip())
        except ValueError:
            raise UsageError(f"--profile_steps {args.profile_steps!r}: expected comma-separated "
                             "step numbers, e.g. 5,6,7") from None
        out.append(("--profile_steps", f"profile_steps={steps!r}"))
    if args.elastic:
        out.append(("--elastic", "resilience.elastic=True"))
    return out


def _is_sft_source(source: Any) -> bool:
    from jaxlearn.runtime.sft import SFTSource

    klass = getattr(source, "klass", None)
    return isinstance(klass, type) and issubclass(klass, SFTSource)


def run_config(args: argparse.Namespace) -> tuple[Any, str, list[str]]:
    """(final config, mesh selector, every override in order) for train/config's flags."""
    from jaxlearn.config import ConfigError, apply_override

    _normalize_output_dir(args)
    selector = resolve_selector(args.mesh_selector)
    cfg = final_config(args.experiment, selector, args.overrides, validate=False,
                       init_from=args.init_from)
    overrides = list(args.overrides)
    for flag, override in run_flag_overrides(args, cfg):
        try:
            apply_override(cfg, override)
        except ConfigError as e:
            raise UsageError(f"{flag}: {_one_line(e)}") from None
        overrides.append(override)
    try:
        cfg.validate()
    except ConfigError as e:
        raise UsageError(_one_line(e)) from None
    return cfg, selector, overrides


def _warn_other_hardware(selector: str) -> None:
    """A loud line when the selector's hardware is not this machine's."""
    from jaxlearn.mesh import detect_hardware, hardware_for_selector

    target, here = hardware_for_selector(selector), detect_hardware()
    if target.platform != here.platform:
        print(f"jaxlearn: WARNING: --mesh_selector {selector} is a mesh for {target.kind} "
              f"({target.platform}) hardware, but this machine has {here.kind} devices: the run "
              f"uses that mesh's rule on {here.platform}", file=sys.stderr)


def _normalize_output_dir(args: argparse.Namespace) -> None:
    """A local `--output_dir` with `..` becomes the real path it names (`x/../run` is
    `run`), so making it never creates `x` on the way; other paths stay as given."""
    from jaxlearn.checkpoint import storage

    path = args.output_dir
    if path is not None and not storage.is_remote(path) and ".." in path.split(os.sep):
        args.output_dir = os.path.realpath(path)


def _check_output_dir(path: str) -> list[str]:
    """Creates a local `path` (checks a remote one's backend); returns the directories it
    created, deepest first, for `_remove_if_empty`."""
    from jaxlearn.checkpoint import StorageError, storage

    if storage.is_remote(path):
        try:
            storage.resolve(path)  # Backend package, credentials, bucket.
        except StorageError as e:
            raise UsageError(f"--output_dir {_one_line(e)}") from None
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
    from jaxlearn.resilience.supervisor import Supervisor, child_argv, python_module_command

    if args.max_restarts < 0:
        raise UsageError(f"--max_restarts must be >= 0, got {args.max_restarts}")
    if not args.restart_backoff_s >= 0:
        raise UsageError(f"--restart_backoff_s must be >= 0, got {args.restart_backoff_s}")
    argv = ["train", *child_argv(args.argv, _SUPERVISOR_FLAGS)]
    argv += ["--elastic", "--set", "resilience.watchdog.exit_on_hang=True"]
    supervisor = Supervisor(python_module_command("jaxlearn.cli", argv),
                            output_dir=_local_dir(args.output_dir),
                            max_restarts=args.max_restarts,
                            backoff_s=args.restart_backoff_s)
    return supervisor.run()


def _local_dir(output_dir: str) -> str:
    """Where the supervisor's own files go (a local mirror for an object-store run)."""
    from jaxlearn.checkpoint import storage

    return storage.local_dir(output_dir)


def _one_line(e: BaseException) -> str:
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip())


def cmd_train(args: argparse.Namespace) -> int:
    _normalize_output_dir(args)
    if args.supervise:
        return _supervise(args)
    launch_cmd.start_distributed(args)  # Multi-process: join before any JAX use.
    cfg, selector, overrides = run_config(args)
    _warn_other_hardware(selector)
    from jaxlearn.config import ConfigError, to_flat_text

    try:
        inputs = cfg.input.instantiate()
        inputs.iterator(0, 1)  # Bad data fails here, before anything is written.
    except (ConfigError, ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    from jaxlearn.runtime.record import RunRecord
    from jaxlearn.runtime.trainer import TrainerError

    try:
        elastic = None
        if cfg.resilience.elastic:
            from jaxlearn.resilience.elastic import adapt_to_devices

            micro = cfg.learner.num_microbatches
            elastic = adapt_to_devices(cfg)
            if cfg.learner.num_microbatches != micro:  # Recorded, so the record rebuilds it.
                overrides.append(f"learner.num_microbatches={cfg.learner.num_microbatches}")
        record = RunRecord(args.experiment, selector, tuple(overrides), to_flat_text(cfg),
                           base_model=args.init_from)
        trainer = cfg.instantiate(run_record=record)
    except (ConfigError, TrainerError) as e:
        raise UsageError(str(e)) from None
    created = _check_output_dir(args.output_dir)
    try:
        return _run_trainer(args, trainer, elastic)
    except BaseException:  # An early failure leaves no empty directory behind.
        _remove_if_empty(created)
        raise


def _run_trainer(args: argparse.Namespace, trainer: Any, elastic: Any) -> int:
    from jaxlearn.checkpoint import CheckpointStructureError, NoGoodCheckpointError
    from jaxlearn.interop import InteropError
    from jaxlearn.resilience.failures import Preempted, ResilienceError
    from jaxlearn.resilience.manager import CheckpointSaveFailed
    from jaxlearn.runtime.data import DataError
    from jaxlearn.runtime.init_from import InitFromError

    if elastic is not None:
        elastic.record()
    print(f"jaxlearn: training {args.experiment} on {len(trainer.mesh.devices.flat)} device(s) "
          f"(mesh {dict(trainer.mesh.shape)}), output in {args.output_dir}", file=sys.stderr)
    try:
        last = trainer.run().metrics
    except (InitFromError, InteropError) as e:  # The pretrained params do not fit the model.
        raise UsageError(f"--init_from {args.init_from}: {_one_line(e)}") from None
    except (CheckpointStructureError, NoGoodCheckpointError, DataError) as e:
        # Another model's checkpoint, all checkpoints damaged, another input's state.
        raise UsageError(f"--output_dir {args.output_dir}: {_one_line(e)}") from None
    except Preempted as e:  # SIGTERM/SIGINT: status 46 (saved) or 47; a rerun resumes.
        print(f"jaxlearn: {_one_line(e)}", file=sys.stderr)
        return e.exit_code
    except ResilienceError as e:
        print(f"jaxlearn: error: {_one_line(e)}", file=sys.stderr)
        return e.exit_code
    except CheckpointSaveFailed as e:
        print(f"jaxlearn: error: {_one_line(e)}", file=sys.stderr)
        return 1
    from jaxlearn.runtime.summary import format_number

    print("jaxlearn: done. " + ", ".join(f"{k}={format_number(v)}"
                                         for k, v in sorted(last.items())), file=sys.stderr)
    return 0


def cmd_experiments(args: argparse.Namespace) -> int:
    from jaxlearn.experiments import EXPERIMENTS

    for name, fn in sorted(EXPERIMENTS.items()):
        doc = (fn.__doc__ or "").strip().splitlines()
        print(f"{name:16s} {doc[0] if doc else ''}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from jaxlearn.config import to_flat_text

    cfg, _, _ = run_config(args)
    sys.stdout.write(to_flat_text(cfg))
    return 0


def _flat_text(name: str) -> str:
    if os.path.exists(name):
        with open(name, encoding="utf-8") as f:
            return f.read()
    from jaxlearn.config import to_flat_text

    return to_flat_text(final_config(name, None, []))


def cmd_config_diff(args: argparse.Namespace) -> int:
    from jaxlearn.config import diff_flat_texts

    diff = diff_flat_texts(_flat_text(args.a), _flat_text(args.b), args.a, args.b)
    sys.stdout.write(diff)
    return 1 if diff else 0


def cmd_golden(args: argparse.Namespace) -> int:
    from jaxlearn.config import diff_flat_texts
    from jaxlearn.experiments import golden_texts, write_golden

    directory = args.dir or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), *[os.pardir] * 5, "golden_configs"
    )
    directory = os.path.normpath(directory)
    if args.write:
        names = write_golden(directory)
        print(f"jaxlearn: wrote {len(names)} golden configs to {directory}", file=sys.stderr)
        return 0
    drift = 0
    for name, text in golden_texts().items():
        path = os.path.join(directory, name)
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        if old != text:
            drift += 1
            sys.stdout.write(diff_flat_texts(old, text, f"golden/{name}", "current"))
    print(f"jaxlearn: {drift} golden config(s) drifted", file=sys.stderr)
    return 1 if drift else 0


COMMANDS = {
    "train": cmd_train,
    "experiments": cmd_experiments,
    "config": cmd_config,
    "config-diff": cmd_config_diff,
    **aot_cmd.COMMANDS,
    **serve_cmd.COMMANDS,
    **export_cmd.COMMANDS,
    **launch_cmd.COMMANDS,
    "golden": cmd_golden,
}


def _enable_compilation_cache() -> None:
    """Persistent XLA compilation cache (JAXLEARN_COMPILATION_CACHE=0 disables it)."""
    path = os.environ.get("JAXLEARN_COMPILATION_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "jaxlearn", "xla"))
    if path in ("", "0"):
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]  # After the command name (train --supervise re-runs them).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _enable_compilation_cache()
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
