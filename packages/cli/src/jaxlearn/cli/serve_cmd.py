"""`jaxlearn serve` and `jaxlearn generate`.

    jaxlearn serve --model PATH [--host 127.0.0.1] [--port 8000] [--max_batch 8]
                   [--dtype bfloat16] [--param_dtype bfloat16] [--quantize int8]
                   [--engine_set decode_burst=4 ...] [--print_config]
                   [--api_key KEY] [--allowed_hosts H,..] [--allowed_origins O,..]
                   [--max_connections N] [--max_pending_connections N]
                   [--header_timeout S] [--max_active_per_request N]
                   [--lora NAME=PATH ...] [--max_loras N] [--max_lora_rank R]
                   [--allow_runtime_lora] [--draft_model PATH]
    jaxlearn generate --model PATH --prompt TEXT [--chat] [--max_new_tokens 128]
                      [--temperature 0] [--top_k 0] [--top_p 1] [--seed N]
                      [--lora NAME=PATH --adapter NAME]

The serving settings are the fields of `Engine.Config`: the flags (`--max_seq_len`,
`--max_batch`, ...) and `--engine_set PATH=VALUE` set them, the rest keep their defaults.
Both commands print the engine config (`engine.` lines, the flat text form) at start;
`--print_config` prints it, with the model config of a jaxlearn run, and exits.

What PATH holds is `jaxlearn.interop.open_model`'s to say (`experiments.open_run_model`):
- a jaxlearn run (a training output_dir, its `checkpoints/` directory or one `step_*`
  directory): the model config, tokenizer and chat template are the run record's
  (`run.json`, read by `jaxlearn.checkpoint.run_record.RunModel` from its `model.` and
  `input.` lines alone), or, when those no longer parse, its experiment + mesh selector +
  overrides rebuilt and checked against the recorded `model.` lines; then `--set`
  overrides of `model.*` / `input.tokenizer.*` on top; the params come from
  `jaxlearn.checkpoint` (Engine.from_checkpoint on the ModelSource's root and step). A
  checkpoint without a record needs `--experiment`: nothing is guessed;
- an HF model directory or a `.gguf` file: `ModelSource.load_host`, with its tokenizer
  and chat template, as the layer stack `inference.weight_layout.serving_stack` picks:
  a loop (unstacked) stack, whose decode steps copy no per-layer weight slices, or a
  scanned one (2-3x faster warm-up) when the engine packs the weights.

`--lora NAME=PATH` (repeatable) loads a LoRA adapter into the engine's adapter banks
(`Engine.load_adapter`, `jaxlearn.inference.adapters`) under NAME; requests select it by
name (the request's `model`; `generate --adapter NAME`). PATH: a PEFT adapter directory
or a jaxlearn LoRA run, read for the served base model by
`jaxlearn.interop.load_lora_adapter`. `--max_loras` (default: the number of --lora
adapters) and `--max_lora_rank` (default: the largest of their ranks) size the banks;
`--allow_runtime_lora` adds the load / unload routes (`jaxlearn.serve.server`).

`--draft_model PATH` (with `--engine_set speculative_tokens=K`) loads a second model the
same way, whose tokenizer must equal --model's (`text.protocol.vocabulary_mismatch`), as
the draft speculative decoding verifies (`jaxlearn.inference.draft`); outputs stay
--model's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

# Flags that set `Engine.Config` fields of the same name (None: the field's default).
ENGINE_FLAGS = ("max_seq_len", "max_batch", "prefill_chunk", "kv_cache_tokens", "page_size",
                "prefix_caching", "quantize", "max_loras", "max_lora_rank")
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
                   help="int8: dense weights and a tied output head become int8 + per-channel "
                        "scales at load (a quarter of the f32 weight memory), activations are "
                        "quantized per row; packed for an int8 GEMM on VNNI / AMX hosts")
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
    p.add_argument("--draft_model", default=None, metavar="PATH",
                   help="a smaller model with the same tokenizer (HF dir, .gguf or jaxlearn "
                        "run) whose guesses speculative decoding verifies; needs "
                        "--engine_set speculative_tokens=K (outputs stay the model's)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="load a LoRA adapter under NAME (repeatable); PATH: a jaxlearn LoRA "
                        "run dir (its adapters; the base weights are --model's)")
    p.add_argument("--max_loras", type=int, default=None,
                   help="LoRA adapters servable at once, in one batch (default: the number "
                        "of --lora adapters)")
    p.add_argument("--max_lora_rank", type=int, default=None,
                   help="largest adapter rank (default: the largest --lora adapter's)")
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
                   help="programs compiled before serving: auto (default) and all: every "
                        "program the engine can run (one per batch shape: no length or "
                        "sampling feature adds one; loaded from the compilation cache "
                        "after the first start); none: each compiles on first use")
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
    p.add_argument("--allow_runtime_lora", action="store_true",
                   help="serve POST /v1/load_lora_adapter {lora_name, lora_path} and "
                        "/v1/unload_lora_adapter {lora_name} (the server reads lora_path "
                        "from its own disk; needs --max_loras)")
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
    p.add_argument("--adapter", default=None, metavar="NAME",
                   help="generate with the --lora adapter NAME (default: the base model)")


def lora_rank(spec: str, path: str) -> int:
    """The rank of the adapter at PATH (a PEFT adapter directory's `r`, or a jaxlearn LoRA
    run's), read before the engine is built to size its banks."""
    from jaxlearn.cli.common import UsageError
    from jaxlearn.interop import InteropError, open_model
    from jaxlearn.interop.peft import is_peft_adapter, lora_layers, read_peft_config

    try:
        if is_peft_adapter(path):
            return int(read_peft_config(path)["r"])
        ranks = {rank for rank, _, _ in lora_layers(open_model(path).model_config()).values()}
    except (InteropError, OSError, ValueError, KeyError) as e:
        raise UsageError(f"--lora {spec}: {e}") from None
    if len(ranks) != 1:
        what = "no LoRA adapters" if not ranks else f"several ranks {sorted(ranks)}"
        raise UsageError(f"--lora {spec}: the run has {what}; one rank per adapter is served")
    return int(ranks.pop())


def adapter_loader(engine: Any) -> Any:
    """path -> (rank, alpha, params) for `Engine.load_adapter`: a PEFT adapter directory
    or a jaxlearn LoRA run, read for the engine's base model by
    `jaxlearn.interop.load_lora_adapter` (ValueError naming the path otherwise)."""
    from jaxlearn.interop import InteropError, load_lora_adapter

    def load(path: str) -> tuple[int, float, Any]:
        try:
            w = load_lora_adapter(path, engine.base_model_cfg)
        except InteropError as e:
            raise ValueError(str(e)) from None
        return w.rank, w.alpha, w.params

    return load


def lora_flags(args: argparse.Namespace) -> dict[str, str]:
    """The --lora adapters, {NAME: PATH}, checked before the engine is built;
    --max_loras / --max_lora_rank default to what they need."""
    from jaxlearn.cli.common import UsageError

    out: dict[str, str] = {}
    ranks = []
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or name in out:
            raise UsageError(f"--lora {spec!r}: expected NAME=PATH with a new NAME")
        if not Path(path).exists():
            raise UsageError(f"--lora {spec}: no such file or directory")
        ranks.append(lora_rank(spec, path))
        out[name] = path
    if getattr(args, "allow_runtime_lora", False) and not out and args.max_loras is None:
        raise UsageError("--allow_runtime_lora: set --max_loras (and --max_lora_rank) to "
                         "size the adapter banks")
    if out and args.max_loras is None:
        args.max_loras = len(out)
    if ranks and args.max_lora_rank is None:
        args.max_lora_rank = max(ranks)
    return out


def load_loras(engine: Any, loras: dict[str, str]) -> None:
    """`Engine.load_adapter` for each of `lora_flags`' adapters."""
    from jaxlearn.cli.common import UsageError

    load = adapter_loader(engine)
    for name, path in loras.items():
        t0 = time.monotonic()
        try:
            rank, alpha, params = load(path)
            engine.load_adapter(name, rank, alpha, params)
        except ValueError as e:
            raise UsageError(f"--lora {name}={path}: {e}") from None
        print(f"jaxlearn: LoRA adapter {name!r} (rank {rank}, alpha {alpha:g}) loaded in "
              f"{time.monotonic() - t0:.2f}s", file=sys.stderr)


def engine_config(args: argparse.Namespace, **fields: Any) -> Any:
    """The `Engine.Config` of the command line: defaults, then `fields` (command-specific
    settings), then the flags that were given, then `--engine_set` overrides. A model_name
    left at its default becomes the name of --model's file or directory."""
    from jaxlearn.cli.common import UsageError
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


def load_model(path: str, engine_cfg: Any, *, experiment: Optional[str] = None,
               overrides: Sequence[str] = (), dtype: Optional[str] = None,
               param_dtype: Optional[str] = None, draft: Optional[str] = None) -> Any:
    """An `Engine` with `engine_cfg` for PATH (see module docstring). `dtype` (compute) and
    `param_dtype` (weight storage) apply to HF / GGUF models; a jaxlearn run's dtypes are
    its config's (`--set model...`). draft: the PATH of a draft model for speculative
    decoding (`--draft_model`), loaded the same way (no overrides), which must share the
    model's tokenizer."""
    from jaxlearn.cli.common import UsageError
    from jaxlearn.inference import Engine
    from jaxlearn.text.protocol import as_tokenizer, vocabulary_mismatch

    model_cfg, params, tokenizer, source = _model_parts(
        path, engine_cfg, "--model", experiment=experiment, overrides=overrides, dtype=dtype,
        param_dtype=param_dtype, restore=engine_cfg.mesh_shape is None)
    extra: dict[str, Any] = {}
    if draft is not None:
        dcfg, dparams, dtok, _ = _model_parts(draft, engine_cfg, "--draft_model", dtype=dtype,
                                              param_dtype=param_dtype)
        why = vocabulary_mismatch(as_tokenizer(tokenizer), as_tokenizer(dtok))
        if why is not None:
            raise UsageError(f"--draft_model {draft}: its tokenizer differs from --model "
                             f"{path}'s ({why}); a draft model must share it")
        extra = dict(draft_model_cfg=dcfg, draft_params=dparams)
    if params is None:  # A jaxlearn run restored into the engine's mesh.
        if draft is not None:
            raise UsageError(f"--draft_model: speculative decoding serves on one device, got "
                             f"mesh_shape={engine_cfg.mesh_shape}")
        return Engine.from_checkpoint(source.root, model_cfg, tokenizer, step=source.step,
                                      engine_cfg=engine_cfg)
    return engine_cfg.instantiate(model_cfg=model_cfg, params=params, tokenizer=tokenizer,
                                  **extra)


def _model_parts(path: str, engine_cfg: Any, flag: str, *, experiment: Optional[str] = None,
                 overrides: Sequence[str] = (), dtype: Optional[str] = None,
                 param_dtype: Optional[str] = None, restore: bool = True) -> tuple:
    """(model config, params, tokenizer, run source) of the model at PATH (`flag` names it
    in errors); a jaxlearn run's params only with `restore` (else None: see load_model)."""
    from jaxlearn.cli.common import UsageError, open_model_flag
    from jaxlearn.inference.engine_setup import restore_params
    from jaxlearn.inference.weight_layout import serving_stack
    from jaxlearn.interop import InteropError

    source, where = open_model_flag(path, experiment, overrides)
    if source.kind == "jaxlearn":
        if param_dtype is not None:
            raise UsageError(f"--param_dtype: applies to HF / GGUF models; {path} is a "
                             f"jaxlearn run (its params keep their checkpoint dtype)")
        print(f"jaxlearn: {flag.strip('-').replace('_', ' ')} config from {where}",
              file=sys.stderr)
        try:
            tokenizer = source.text_tokenizer()
            if source.root is None:
                raise UsageError(f"{flag} {path}: a jaxlearn run without checkpoint steps")
        except InteropError as e:
            raise UsageError(str(e)) from None
        cfg = source.model_config()
        params = restore_params(source.root, cfg, step=source.step)[0] if restore else None
        return cfg, params, tokenizer, source
    try:
        opts = {k: v for k, v in (("dtype", dtype), ("param_dtype", param_dtype)) if v}
        stack = serving_stack(engine_cfg.weight_layout, dtype=dtype, param_dtype=param_dtype,
                              mesh_shape=engine_cfg.mesh_shape, quantize=engine_cfg.quantize)
        loaded = source.load_host(stack=stack, **opts)
    except InteropError as e:
        raise UsageError(str(e)) from None
    if loaded.tokenizer is None:
        raise UsageError(f"{flag} {path}: the checkpoint has no tokenizer")
    # The LoadedModel is its own tokenizer bundle (tokenizer, EOS ids, chat template).
    return loaded.config, loaded.params, loaded, source


def print_config(args: argparse.Namespace, engine_cfg: Any) -> int:
    """`--print_config`: the engine config and, for a jaxlearn run, its model config."""
    from jaxlearn.cli.common import open_model_flag
    from jaxlearn.config import path_sort_key, to_flat_text

    sys.stdout.write(engine_text(engine_cfg))
    source, where = open_model_flag(args.model, args.experiment, args.overrides)
    if source.kind == "jaxlearn":
        print(f"jaxlearn: model config from {where}", file=sys.stderr)
        run = source.run
        lines = [f"model.{line}" for line in to_flat_text(run.model).splitlines()]
        if run.tokenizer is not None:
            lines += [f"input.tokenizer.{line}"
                      for line in to_flat_text(run.tokenizer).splitlines()]
        lines.sort(key=lambda line: path_sort_key(line.split(": ", 1)[0]))
        sys.stdout.write("".join(f"{line}\n" for line in lines))
    return 0


def _engine(args: argparse.Namespace, engine_cfg: Any) -> Any:
    from jaxlearn.cli.common import UsageError
    from jaxlearn.inference import RequestError

    t0 = time.monotonic()
    try:
        engine = load_model(args.model, engine_cfg, experiment=args.experiment,
                            overrides=args.overrides, dtype=args.dtype,
                            param_dtype=args.param_dtype, draft=args.draft_model)
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
    if engine.scheduler.draft is not None:
        print(f"jaxlearn: draft model {args.draft_model} proposes "
              f"{engine.config.speculative_tokens} tokens per verification (KV pool "
              f"{engine.scheduler.draft.runner.cache_bytes() / 2**20:.0f} MiB)", file=sys.stderr)
    return engine


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxlearn.cli.common import UsageError
    from jaxlearn.serve.httpd import is_loopback
    from jaxlearn.serve.server import InferenceServer

    fields: dict[str, Any] = {}
    if args.max_queue is not None:
        fields["max_queue"] = args.max_queue
    if args.served_model_name:
        fields["model_name"] = args.served_model_name
    loras = lora_flags(args) if not args.print_config else {}
    engine_cfg = engine_config(args, **fields)
    if args.print_config:
        return print_config(args, engine_cfg)
    server_options(args)  # Bad HTTP flags fail before the model loads.
    engine = _engine(args, engine_cfg)
    load_loras(engine, loras)
    t0 = time.monotonic()
    compiled = engine.warmup(args.warmup)
    print(f"jaxlearn: warmed up in {time.monotonic() - t0:.1f}s ({compiled} programs, "
          f"--warmup {args.warmup})", file=sys.stderr)
    opts = server_options(args)
    limits = InferenceServer.default_limits(engine, **opts.pop("limits"))
    try:
        server = InferenceServer(engine, args.host, args.port, limits=limits, **opts,
                                 adapter_loader=(adapter_loader(engine)
                                                 if args.allow_runtime_lora else None))
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
    from jaxlearn.cli.common import UsageError
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
    from jaxlearn.cli.common import UsageError
    from jaxlearn.inference import RequestError, chat_prompt

    loras = lora_flags(args) if not args.print_config else {}
    engine_cfg = engine_config(args, max_queue=1)
    if args.print_config:
        return print_config(args, engine_cfg)
    engine = _engine(args, engine_cfg)
    load_loras(engine, loras)
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
            seed=args.seed, stop=args.stop, adapter=args.adapter,
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
