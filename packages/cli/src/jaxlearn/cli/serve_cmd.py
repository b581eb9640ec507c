"""`jaxlearn serve` and `jaxlearn generate`.

    jaxlearn serve --model PATH [--host 127.0.0.1] [--port 8000] [--max_batch 8]
                   [--dtype bfloat16] [--param_dtype bfloat16] [--quantize int8]
                   [--engine_set decode_burst=4 ...] [--print_config]
                   [--api_key KEY] [--allowed_hosts H,..] [--allowed_origins O,..]
                   [--max_connections N] [--max_pending_connections N]
                   [--header_timeout S] [--max_active_per_request N]
    jaxlearn generate --model PATH --prompt TEXT [--chat] [--max_new_tokens 128]
                      [--temperature 0] [--top_k 0] [--top_p 1] [--seed N]

The serving settings are the fields of `Engine.Config`: the flags (`--max_seq_len`,
`--max_batch`, ...) and `--engine_set PATH=VALUE` set them, the rest keep their defaults.
Both commands print the engine config (`engine.` lines, the flat text form) at start;
`--print_config` prints it, with the model config of a jaxlearn run, and exits.

PATH is resolved by `load_model`:
- a jaxlearn run (a training output_dir, its `checkpoints/` directory or one `step_*`
  directory): the model config is rebuilt from the run's record (`run.json`, see
  `jaxlearn.runtime.record`): from its recorded flat text (`jaxlearn.config.from_flat_text`),
  or, when that text no longer parses, from its experiment + mesh selector + overrides
  checked against the recorded `model.` lines; then `--set` overrides on top; the
  tokenizer is the recorded config's `input.tokenizer`, the params come from
  `jaxlearn.checkpoint` (Engine.from_checkpoint). A checkpoint without a record takes
  its config from `--experiment`, or else from a guess: the experiment whose model
  config matches the one saved with the checkpoint (a warning says so);
- anything else (an HF model directory, a `.gguf` file) goes to
  `jaxlearn.interop.load_pretrained`, with its tokenizer and chat template, as a loop
  (unstacked) layer stack: faster decode steps than a scanned one (no per-layer weight
  slices), for a longer compile.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

# Flags that set `Engine.Config` fields of the same name (None: the field's default).
ENGINE_FLAGS = ("max_seq_len", "max_batch", "prefill_chunk", "kv_cache_tokens", "page_size",
                "prefix_caching", "quantize")
_STEP_DIR = re.compile(r"step_(\d+)")
PARAM_DTYPES = ("float32", "bfloat16", "float16")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="PATH",
                   help="jaxlearn run dir (or its checkpoints/ or a step_* dir), HF model "
                        "dir, or .gguf file")
    p.add_argument("--experiment", default=None,
                   help="recipe of a jaxlearn checkpoint that has no run record")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a field of the run's config (jaxlearn runs), e.g. "
                        "--set model.dtype='bfloat16'")
    p.add_argument("--dtype", default=None, help="compute dtype, e.g. bfloat16 (HF / GGUF)")
    p.add_argument("--param_dtype", default=None, choices=PARAM_DTYPES,
                   help="dtype the weights are stored in (HF / GGUF; default float32); "
                        "bfloat16 with --dtype bfloat16 halves the weight memory and the "
                        "bytes each decode step reads")
    p.add_argument("--quantize", default=None, metavar="int8",
                   help="weight-only int8: dense weights and a tied output head become int8 "
                        "+ per-channel scales at load (a quarter of the f32 weight memory)")
    p.add_argument("--max_seq_len", type=int, default=None,
                   help="prompt + generated tokens (default 2048)")
    p.add_argument("--max_batch", type=int, default=None,
                   help="most requests running at once (default 8)")
    p.add_argument("--prefill_chunk", type=int, default=None,
                   help="prompt tokens per chunk (default 256)")
    p.add_argument("--kv_cache_tokens", type=int, default=None,
                   help="tokens the paged KV pool holds, all requests together (default "
                        "max_batch x max_seq_len; smaller pools preempt the youngest request "
                        "when live tokens exceed them)")
    p.add_argument("--page_size", type=int, default=None, help="tokens per KV page (default 16)")
    p.add_argument("--prefix_caching", action="store_true", default=None,
                   help="share the KV pages of common prompt prefixes between requests "
                        "(the default)")
    p.add_argument("--no_prefix_caching", dest="prefix_caching", action="store_false",
                   default=None, help="prefill every prompt in full")
    p.add_argument("--engine_set", action="append", default=[], metavar="PATH=VALUE",
                   help="set an Engine.Config field, e.g. --engine_set decode_burst=4 "
                        "(repeatable; see the printed engine config)")
    p.add_argument("--print_config", action="store_true",
                   help="print the engine config (and a jaxlearn run's model config), exit")


def add_parsers(sub: Any) -> None:
    """Adds the `serve` and `generate` subcommands to main's subparsers."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server for a model")
    _model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max_queue", type=int, default=None,
                   help="waiting requests before 429 (default 64)")
    p.add_argument("--served_model_name", default=None, help="the `model` name clients use")
    p.add_argument("--warmup", default="auto", choices=("none", "auto", "all"),
                   help="programs compiled before serving: auto (default) those of requests "
                        "within the first 64 positions, at every batch size and sampling "
                        "feature; all: every program the engine can run (minutes the "
                        "first time, then loaded from the compilation cache); none")
    p.add_argument("--api_key", default=None,
                   help="require 'Authorization: Bearer KEY' (all paths but /health; "
                        "default: $JAXLEARN_API_KEY, else none)")
    p.add_argument("--allowed_hosts", action="append", default=[], metavar="HOST[,HOST]",
                   help="Host headers to accept besides the loopback names (bound to "
                        "loopback; otherwise any Host unless given); '*': any")
    p.add_argument("--allowed_origins", action="append", default=[],
                   metavar="ORIGIN[,ORIGIN]",
                   help="browser origins allowed cross-origin (CORS; default: none), "
                        "e.g. http://localhost:3000; '*': any")
    p.add_argument("--max_connections", type=int, default=None,
                   help="open connections (default max_batch + max_queue + 16); a new one "
                        "beyond closes the oldest connection still waiting for its request, "
                        "or gets 429 when all are busy with requests")
    p.add_argument("--max_pending_connections", type=int, default=None,
                   help="of those, how many may wait for their request line and headers "
                        "(new, idle kept-alive or half-sent); a new one beyond closes the "
                        "oldest of them (default max_connections // 2)")
    p.add_argument("--header_timeout", type=float, default=3.0,
                   help="seconds a new connection has to send its request line and headers "
                        "(a kept-alive one: from its next request's first byte; default 3)")
    p.add_argument("--max_active_per_request", type=int, default=None,
                   help="engine requests (prompts x best_of) one HTTP request keeps queued "
                        "or running at a time, the rest submitted as those finish, so other "
                        "clients' requests interleave (default max(1, max_batch // 2))")

    p = sub.add_parser("generate", help="generate from a prompt, streaming to stdout")
    _model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--repetition_penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def engine_config(args: argparse.Namespace, **fields: Any) -> Any:
    """The `Engine.Config` of the command line: defaults, then `fields` (command-specific
    settings), then the flags that were given, then `--engine_set` overrides. A model_name
    left at its default becomes the name of --model's file or directory."""
    from jaxlearn.cli.main import UsageError
    from jaxlearn.config import ConfigError, apply_overrides
    from jaxlearn.inference import Engine
    from jaxlearn.inference.engine import check_settings

    cfg = Engine.default_config()
    try:
        cfg.set(**fields)
        cfg.set(**{k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None})
        apply_overrides(cfg, args.engine_set)
        check_settings(cfg)
        if cfg.model_name == Engine.default_config().model_name:
            p = Path(args.model)
            cfg.model_name = (p.stem if p.is_file() else p.name) or cfg.model_name
    except (ConfigError, ValueError) as e:
        raise UsageError(f"engine config: {e}") from None
    return cfg


def engine_text(engine_cfg: Any) -> str:
    """The engine config as `engine.`-prefixed flat text lines."""
    from jaxlearn.config import to_flat_text

    return "".join(f"engine.{line}\n" for line in to_flat_text(engine_cfg).splitlines())


# ---- jaxlearn runs ---------------------------------------------------------------------


def checkpoint_location(path: Path) -> Optional[tuple[Path, Optional[int]]]:
    """(Checkpointer directory, step or None for the newest) of a run dir, a checkpoints
    dir or one step dir; None when `path` holds no jaxlearn checkpoint."""
    from jaxlearn.checkpoint import is_checkpoint, locate

    return locate(path) if is_checkpoint(path) else None


def _newest_step_dir(root: Path) -> Optional[Path]:
    steps = [(int(m.group(1)), p) for p in root.glob("step_*")
             if (m := _STEP_DIR.fullmatch(p.name))]
    return max(steps)[1] if steps else None


def _model_lines(flat_text: str) -> list[str]:
    return [line for line in flat_text.splitlines() if line.startswith("model.")]


def same_model(saved_text: str, flat_text: str) -> bool:
    """Whether a checkpoint's saved config text and an experiment's flat text describe the
    same model: the lines both have a field for agree, the experiment's other lines are
    fields the saved text does not have at all (fields added to the layers since the
    checkpoint was written, e.g. `qkv_proj`, which keep their defaults) and the saved
    text's other lines fields the experiment no longer has (e.g. `fused_qkv`, removed when
    projections became Linear children). Only used for checkpoints without a run record,
    where the match is a guess."""
    def key(line: str) -> str:
        return line.split(": ", 1)[0]

    saved, have = set(_model_lines(saved_text)), set(_model_lines(flat_text))
    saved_keys, have_keys = {key(line) for line in saved}, {key(line) for line in have}
    shared = {line for line in saved if key(line) in have_keys}
    extra = have - shared
    return shared <= have and not any(key(line) in saved_keys for line in extra)


def model_difference(recorded: str, rebuilt: str) -> Optional[str]:
    """None when both flat texts have the same `model.` lines, else the first difference
    and how many lines differ, e.g. "model.decoder.dim: recorded 128, now 64; 1 line"."""
    def split(text: str) -> dict[str, str]:
        return dict(line.split(": ", 1) for line in _model_lines(text))

    a, b = split(recorded), split(rebuilt)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if not keys:
        return None
    k = keys[0]
    what = (f"recorded {a[k]}, now {b[k]}" if k in a and k in b
            else "only in the record" if k in a else "not in the record")
    return f"{k}: {what}; {len(keys)} line(s) differ"


def config_from_record(record: Any, where: str, experiment: Optional[str],
                       overrides: Sequence[str]) -> tuple[Any, str]:
    """(trainer config, where it came from) of a run record, with `overrides` applied.

    The recorded flat text is what the run trained, so the config is rebuilt from it
    (`from_flat_text`): a recipe changed or removed since does not change the model. Only
    when the text no longer parses (a field renamed since the run) is the recorded
    experiment rebuilt from its name, mesh selector and overrides, and then checked against
    the recorded `model.` lines. UsageError (one line) when neither works."""
    from jaxlearn.cli.main import UsageError
    from jaxlearn.config import ConfigError, FlatTextError, apply_overrides, from_flat_text

    if record.experiment is not None and experiment not in (None, record.experiment):
        raise UsageError(f"--experiment {experiment}: the run record of {where} says the run "
                         f"is experiment {record.experiment!r}")
    described = (f"experiment {record.experiment or experiment!r}, mesh_selector "
                 f"{record.mesh_selector}, overrides {list(record.overrides)}")
    try:
        cfg = from_flat_text(record.config_text, where=f"{where} (run record config_text)")
        source = f"the run record's config text ({described})"
    except FlatTextError as e:
        cfg = _rebuild_experiment(record, where, experiment, str(e))
        source = f"the run record: {described}"
    try:
        apply_overrides(cfg, overrides)
    except ConfigError as e:
        raise UsageError(f"--set: {e}") from None
    return cfg, source


def _rebuild_experiment(record: Any, where: str, experiment: Optional[str], why: str) -> Any:
    """The recorded experiment rebuilt by name (the recorded text did not parse: `why`),
    checked against the recorded `model.` lines."""
    from jaxlearn.cli.main import UsageError, final_config
    from jaxlearn.config import to_flat_text

    name = record.experiment or experiment
    if name is None:
        raise UsageError(f"--model {where}: cannot rebuild the recorded config ({why}) and "
                         f"the record names no experiment; pass --experiment NAME")
    try:
        cfg = final_config(name, record.mesh_selector, record.overrides,
                           init_from=record.base_model)
    except UsageError as e:
        raise UsageError(f"--model {where}: cannot rebuild the recorded config ({why}) nor "
                         f"experiment {name!r}: {e}") from None
    diff = model_difference(record.config_text, to_flat_text(cfg))
    if diff is not None:
        raise UsageError(f"--model {where}: cannot rebuild the recorded config ({why}), and "
                         f"experiment {name!r} now builds a different model ({diff})")
    return cfg


def guess_config(saved: str, overrides: Sequence[str], where: str,
                 why: str) -> tuple[Any, str]:
    """The experiment whose model config matches the flat text `saved` (`same_model`),
    with `overrides`; the description says it is a guess and `why`."""
    from jaxlearn.cli.main import UsageError, final_config
    from jaxlearn.config import to_flat_text
    from jaxlearn.experiments import EXPERIMENTS

    for name in sorted(EXPERIMENTS):
        try:
            cfg = final_config(name, None, overrides)
        except UsageError:  # E.g. an override that only some experiments have.
            continue
        if same_model(saved, to_flat_text(cfg)):
            return cfg, f"a guess: {why}, and experiment {name!r} has its model config"
    raise UsageError(f"--model {where}: {why} and no experiment has its model config; pass "
                     f"--experiment NAME (and --set overrides)")


def run_config(path: Path, root: Path, experiment: Optional[str],
               overrides: Sequence[str]) -> tuple[Any, str]:
    """(trainer config, where it came from) of the jaxlearn run at `path`: from its run
    record (`path`'s own, else the newest step's), else `--experiment`, else a guess from
    the config text saved with the newest checkpoint."""
    from jaxlearn.checkpoint import Checkpointer
    from jaxlearn.cli.main import UsageError, final_config
    from jaxlearn.runtime.record import RunRecordError, find_run_record

    newest = _newest_step_dir(root)
    try:
        record = find_run_record(path)
        if record is None and newest is not None and newest != path:
            record = find_run_record(newest)
    except RunRecordError as e:
        raise UsageError(str(e)) from None
    if record is not None:
        cfg, source = config_from_record(record, str(path), experiment, overrides)
        return use_run_tokenizer(cfg, path), source
    if experiment is not None:
        return final_config(experiment, None, overrides), f"--experiment {experiment}"
    with Checkpointer.default_config().set(directory=str(root)).instantiate() as ckpt:
        step = ckpt.latest_step()
        saved = ckpt.read_metadata(step).config_text if step is not None else None
    if not saved:
        raise UsageError(f"--model {path}: no run record (run.json) and no config saved with "
                         f"the checkpoint; pass --experiment NAME")
    return guess_config(saved, overrides, str(path), "no run record (run.json)")


def use_run_tokenizer(cfg: Any, path: Path) -> Any:
    """`cfg` (the config of the run at `path`) with its inputs' tokenizer file read from the
    run directory's own copy when it has one (`runtime.record.save_tokenizer`): a moved or
    copied run directory keeps working without its base model's directory."""
    from jaxlearn.runtime.record import run_tokenizer_path

    for name in ("input", "eval_input"):
        data = getattr(cfg, name, None)
        tok = getattr(data, "tokenizer", None) if data is not None else None
        if tok is not None and isinstance(getattr(tok, "path", None), str):
            tok.path = run_tokenizer_path(path, tok.path)
    return cfg


def run_tokenizer(cfg: Any) -> Any:
    """The tokenizer a run trained with (`input.tokenizer`), with the chat template its data
    was rendered with (`input.chat_template`, e.g. a fine-tuning run's) when the tokenizer
    brings none of its own; None when the run's input has no tokenizer."""
    from jaxlearn.text.chat import ChatTemplate

    data = getattr(cfg, "input", None)
    if data is None or "tokenizer" not in data:
        return None
    tokenizer = data.tokenizer.instantiate()
    source = data.chat_template if "chat_template" in data else None
    if source and tokenizer.chat_template is None:
        tokenizer.set_chat_template(ChatTemplate(
            source, bos_token=data.bos_token, eos_token=data.eos_token,
            origin="the run's input.chat_template"))
    return tokenizer


def load_model(path: str, engine_cfg: Any, *, experiment: Optional[str] = None,
               overrides: Sequence[str] = (), dtype: Optional[str] = None,
               param_dtype: Optional[str] = None) -> Any:
    """An `Engine` with `engine_cfg` for PATH (see module docstring). `dtype` (compute) and
    `param_dtype` (weight storage) apply to HF / GGUF models; a jaxlearn run's dtypes are
    its config's (`--set model...`)."""
    from jaxlearn.cli.main import UsageError
    from jaxlearn.inference import Engine

    p = Path(path)
    if not p.exists():
        raise UsageError(f"--model {path}: no such file or directory")
    location = checkpoint_location(p)
    if location is not None:
        root, step = location
        if param_dtype is not None:
            raise UsageError(f"--param_dtype: applies to HF / GGUF models; {path} is a "
                             f"jaxlearn run (its params keep their checkpoint dtype)")
        cfg, source = run_config(p, root, experiment, overrides)
        print(f"jaxlearn: model config from {source}", file=sys.stderr)
        tokenizer = run_tokenizer(cfg)
        return Engine.from_checkpoint(root, cfg.model, tokenizer, step=step,
                                      engine_cfg=engine_cfg)
    try:
        from jaxlearn.interop import InteropError, load_pretrained
    except ImportError:
        raise UsageError(f"--model {path}: not a jaxlearn checkpoint, and jaxlearn.interop "
                         f"(HF / GGUF loading) is not installed") from None
    try:
        opts = {k: v for k, v in (("dtype", dtype), ("param_dtype", param_dtype)) if v}
        # Unstacked layers: a scanned stack slices (copies) every layer's weights out of
        # the stacked arrays on each decode step, 2x the step time of SmolLM2-135M here.
        loaded = load_pretrained(p, stack="loop", **opts)
    except InteropError as e:
        raise UsageError(str(e)) from None
    if loaded.tokenizer is None:
        raise UsageError(f"--model {path}: the checkpoint has no tokenizer")
    # The LoadedModel is its own tokenizer bundle (tokenizer, EOS ids, chat template).
    return engine_cfg.instantiate(model_cfg=loaded.config, params=loaded.params,
                                  tokenizer=loaded)


def print_config(args: argparse.Namespace, engine_cfg: Any) -> int:
    """`--print_config`: the engine config and, for a jaxlearn run, its model config."""
    from jaxlearn.cli.main import UsageError
    from jaxlearn.config import to_flat_text

    p = Path(args.model)
    if not p.exists():
        raise UsageError(f"--model {args.model}: no such file or directory")
    sys.stdout.write(engine_text(engine_cfg))
    location = checkpoint_location(p)
    if location is not None:
        cfg, source = run_config(p, location[0], args.experiment, args.overrides)
        print(f"jaxlearn: model config from {source}", file=sys.stderr)
        sys.stdout.write("".join(f"{line}\n" for line in to_flat_text(cfg).splitlines()
                                 if line.startswith(("model.", "input.tokenizer."))))
    return 0


def _engine(args: argparse.Namespace, engine_cfg: Any) -> Any:
    from jaxlearn.cli.main import UsageError
    from jaxlearn.inference import RequestError

    t0 = time.monotonic()
    try:
        engine = load_model(args.model, engine_cfg, experiment=args.experiment,
                            overrides=args.overrides, dtype=args.dtype,
                            param_dtype=args.param_dtype)
    except (ValueError, RequestError, OSError) as e:
        raise UsageError(f"--model {args.model}: {e}") from None
    sys.stderr.write(engine_text(engine.config))  # The one block of serving settings.
    r = engine.runner
    print(f"jaxlearn: loaded {args.model} in {time.monotonic() - t0:.1f}s (vocab "
          f"{engine.vocab_size}, up to {engine.max_batch} requests x {engine.max_seq_len} "
          f"tokens; KV pool {(r.num_pages - 1) * r.page_size} tokens = "
          f"{r.cache_bytes() / 2**20:.0f} MiB"
          f"{'; no tokenizer: token ids only' if engine.tokenizer is None else ''})",
          file=sys.stderr)
    return engine


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxlearn.cli.main import UsageError
    from jaxlearn.serve.httpd import is_loopback
    from jaxlearn.serve.server import InferenceServer

    fields: dict[str, Any] = {}
    if args.max_queue is not None:
        fields["max_queue"] = args.max_queue
    if args.served_model_name:
        fields["model_name"] = args.served_model_name
    engine_cfg = engine_config(args, **fields)
    if args.print_config:
        return print_config(args, engine_cfg)
    server_options(args)  # Bad HTTP flags fail before the model loads.
    engine = _engine(args, engine_cfg)
    t0 = time.monotonic()
    compiled = engine.warmup(args.warmup)
    print(f"jaxlearn: warmed up in {time.monotonic() - t0:.1f}s ({compiled} programs, "
          f"--warmup {args.warmup})", file=sys.stderr)
    opts = server_options(args)
    limits = InferenceServer.default_limits(engine, **opts.pop("limits"))
    try:
        server = InferenceServer(engine, args.host, args.port, limits=limits, **opts)
    except OSError as e:
        raise UsageError(f"--host {args.host} --port {args.port}: {e.strerror or e}") from None
    host, port = server.address
    if server.policy.api_key is None and not is_loopback(args.host):
        print(f"jaxlearn: warning: {args.host} is not loopback and no --api_key is set: "
              f"anyone who can reach the port can use the model", file=sys.stderr)
    print(f"jaxlearn: serving {engine.model_name!r} on http://{host}:{port}/v1 (Ctrl-C stops)",
          file=sys.stderr)
    try:
        server.serve_forever()
    finally:
        server.httpd.server_close()
    return 0


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """serve's HTTP flags (and $JAXLEARN_API_KEY), checked: InferenceServer's api_key,
    allowed_hosts, allowed_origins, and `limits`: the Limits fields given."""
    from jaxlearn.cli.main import UsageError
    from jaxlearn.serve.httpd import Limits

    key = args.api_key
    if key is None:
        key = os.environ.get("JAXLEARN_API_KEY") or None
    elif not key.strip():
        raise UsageError("--api_key: must not be empty")
    opts: dict[str, Any] = {"api_key": key}
    for flag in ("allowed_hosts", "allowed_origins"):
        items = [x.strip() for v in getattr(args, flag) for x in v.split(",")]
        if "" in items:
            raise UsageError(f"--{flag} {','.join(getattr(args, flag))!r}: an empty entry")
        opts[flag] = items
    limits: dict[str, Any] = {"header_timeout": args.header_timeout}
    for flag in ("max_connections", "max_pending_connections", "max_active_per_request"):
        if getattr(args, flag) is not None:
            limits[flag] = getattr(args, flag)
    try:
        Limits(**limits)
    except ValueError as e:  # "Limits.header_timeout=0: must be > 0"
        raise UsageError(f"--{str(e).removeprefix('Limits.')}") from None
    return {**opts, "limits": limits}


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxlearn.cli.main import UsageError
    from jaxlearn.inference import RequestError, chat_prompt

    engine_cfg = engine_config(args, max_queue=1)
    if args.print_config:
        return print_config(args, engine_cfg)
    engine = _engine(args, engine_cfg)
    if engine.tokenizer is None:
        raise UsageError(f"--model {args.model}: the model has no tokenizer, so a text "
                         f"--prompt cannot be encoded")
    prompt: Any = args.prompt
    if args.chat:
        try:
            prompt = chat_prompt(engine.tokenizer, [{"role": "user", "content": args.prompt}])
        except ValueError as e:  # ChatTemplateError: a refused or failing template
            raise UsageError(str(e)) from None
    t0 = time.monotonic()
    n = 0
    reason = None
    try:
        for delta in engine.stream(
            prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
            seed=args.seed, stop=args.stop,
        ):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            n += len(delta.tokens)
            reason = delta.finish_reason
    except RequestError as e:
        raise UsageError(str(e)) from None
    dt = time.monotonic() - t0
    sys.stdout.write("\n")
    print(f"jaxlearn: {n} tokens in {dt:.2f}s ({n / max(dt, 1e-9):.1f} tok/s, first one "
          f"includes compilation), finish_reason={reason}", file=sys.stderr)
    return 0


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate}
