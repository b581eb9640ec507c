"""`jaxlearn serve` and `jaxlearn generate`.

    jaxlearn serve --model PATH [--host 127.0.0.1] [--port 8000] [--max_batch 8]
    jaxlearn generate --model PATH --prompt TEXT [--chat] [--max_new_tokens 128]
                      [--temperature 0] [--top_k 0] [--top_p 1] [--seed N]

PATH is resolved by `load_model`:
- a jaxlearn checkpoint (a Checkpointer directory with `step_*/`, or a training
  output_dir with `checkpoints/`): the model config comes from `--experiment` (or, when
  omitted, from the experiment whose model config equals the one saved with the
  checkpoint) plus `--set` overrides, the tokenizer from that experiment's input, and the
  params from `jaxlearn.checkpoint` (Engine.from_checkpoint);
- anything else (an HF model directory, a `.gguf` file) goes to
  `jaxlearn.interop.load_pretrained`, with its tokenizer and chat template.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="PATH",
                   help="jaxlearn checkpoint dir, HF model dir, or .gguf file")
    p.add_argument("--experiment", default=None,
                   help="recipe of a jaxlearn checkpoint (default: inferred from it)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a field of the experiment config (jaxlearn checkpoints)")
    p.add_argument("--dtype", default=None, help="compute dtype, e.g. bfloat16 (HF / GGUF)")
    p.add_argument("--max_seq_len", type=int, default=2048, help="prompt + generated tokens")
    p.add_argument("--max_batch", type=int, default=8, help="most requests running at once")
    p.add_argument("--prefill_chunk", type=int, default=256, help="prompt tokens per chunk")
    p.add_argument("--kv_cache_tokens", type=int, default=None,
                   help="tokens the paged KV pool holds, all requests together (default "
                        "max_batch x max_seq_len; smaller pools preempt the youngest request "
                        "when live tokens exceed them)")
    p.add_argument("--page_size", type=int, default=16, help="tokens per KV page")


def add_parsers(sub: Any) -> None:
    """Adds the `serve` and `generate` subcommands to main's subparsers."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server for a model")
    _model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max_queue", type=int, default=64, help="waiting requests before 429")
    p.add_argument("--served_model_name", default=None, help="the `model` name clients use")

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


def _checkpoint_root(path: Path) -> Optional[Path]:
    for root in (path, path / "checkpoints"):
        if root.is_dir() and any(p.is_dir() for p in root.glob("step_*")):
            return root
    return None


def _model_lines(flat_text: str) -> list[str]:
    return [line for line in flat_text.splitlines() if line.startswith("model.")]


def same_model(saved_text: str, flat_text: str) -> bool:
    """Whether a checkpoint's saved config text and an experiment's flat text describe the
    same model: every saved `model.` line is in the experiment's, and the experiment's other
    lines are fields the saved text does not have at all (fields added to the layers since
    the checkpoint was written, e.g. `fused_qkv`, which keep their defaults)."""
    saved, have = set(_model_lines(saved_text)), set(_model_lines(flat_text))
    saved_keys = {line.split(": ", 1)[0] for line in saved}
    extra = have - saved
    return saved <= have and not any(line.split(": ", 1)[0] in saved_keys for line in extra)


def _experiment_config(root: Path, experiment: Optional[str], overrides: Sequence[str]) -> Any:
    """The trainer config of a checkpoint: --experiment, or the experiment whose model
    config equals the one saved with the newest step."""
    from jaxlearn.checkpoint import Checkpointer
    from jaxlearn.cli.main import UsageError, final_config
    from jaxlearn.config import to_flat_text
    from jaxlearn.experiments import EXPERIMENTS

    if experiment is not None:
        return final_config(experiment, None, overrides)
    with Checkpointer.default_config().set(directory=str(root)).instantiate() as ckpt:
        step = ckpt.latest_step()
        saved = ckpt.read_metadata(step).config_text if step is not None else None
    if not saved:
        raise UsageError(f"--model {root}: no config saved with the checkpoint; pass "
                         f"--experiment NAME")
    for name in sorted(EXPERIMENTS):
        try:
            cfg = final_config(name, None, overrides)
        except UsageError:  # E.g. an override that only some experiments have.
            continue
        if same_model(saved, to_flat_text(cfg)):
            return cfg
    raise UsageError(f"--model {root}: no experiment has the checkpoint's model config; pass "
                     f"--experiment NAME (and --set overrides)")


def load_model(path: str, *, experiment: Optional[str] = None, overrides: Sequence[str] = (),
               dtype: Optional[str] = None, **engine_kwargs: Any) -> Any:
    """An `Engine` for PATH (see module docstring); engine_kwargs go to `Engine`."""
    from jaxlearn.cli.main import UsageError
    from jaxlearn.inference import ByteTokenizer, Engine

    p = Path(path)
    if not p.exists():
        raise UsageError(f"--model {path}: no such file or directory")
    root = _checkpoint_root(p) if p.is_dir() else None
    if root is not None:
        cfg = _experiment_config(root, experiment, overrides)
        tokenizer: Any = ByteTokenizer()
        if getattr(cfg, "input", None) is not None and "tokenizer" in cfg.input:
            tokenizer = cfg.input.tokenizer.instantiate()
        engine_kwargs.setdefault("model_name", p.name or "jaxlearn")
        return Engine.from_checkpoint(root, cfg.model, tokenizer, **engine_kwargs)
    try:
        from jaxlearn.interop import InteropError, load_pretrained
    except ImportError:
        raise UsageError(f"--model {path}: not a jaxlearn checkpoint, and jaxlearn.interop "
                         f"(HF / GGUF loading) is not installed") from None
    try:
        loaded = load_pretrained(p, **({"dtype": dtype} if dtype else {}))
    except InteropError as e:
        raise UsageError(str(e)) from None
    if loaded.tokenizer is None:
        raise UsageError(f"--model {path}: the checkpoint has no tokenizer")
    engine_kwargs.setdefault("model_name", p.stem if p.is_file() else p.name)
    # The LoadedModel is its own tokenizer bundle (tokenizer, EOS ids, chat template).
    return Engine(loaded.config, loaded.params, loaded, **engine_kwargs)


def _engine(args: argparse.Namespace, **extra: Any) -> Any:
    from jaxlearn.cli.main import UsageError
    from jaxlearn.inference import RequestError

    t0 = time.monotonic()
    try:
        engine = load_model(args.model, experiment=args.experiment, overrides=args.overrides,
                            dtype=args.dtype, max_seq_len=args.max_seq_len,
                            max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                            kv_cache_tokens=args.kv_cache_tokens, page_size=args.page_size,
                            **extra)
    except (ValueError, RequestError, OSError) as e:
        raise UsageError(f"--model {args.model}: {e}") from None
    r = engine.runner
    print(f"jaxlearn: loaded {args.model} in {time.monotonic() - t0:.1f}s (vocab "
          f"{engine.vocab_size}, up to {engine.max_batch} requests x {engine.max_seq_len} "
          f"tokens; KV pool {(r.num_pages - 1) * r.page_size} tokens = "
          f"{r.cache_bytes() / 2**20:.0f} MiB)", file=sys.stderr)
    return engine


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxlearn.inference.server import InferenceServer

    extra: dict[str, Any] = {"max_queue": args.max_queue}
    if args.served_model_name:
        extra["model_name"] = args.served_model_name
    engine = _engine(args, **extra)
    t0 = time.monotonic()
    engine.generate([engine.tokenizer.bos_id or 0, 3], max_new_tokens=2)  # Compile.
    print(f"jaxlearn: warmed up in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    server = InferenceServer(engine, args.host, args.port)
    host, port = server.address
    print(f"jaxlearn: serving {engine.model_name!r} on http://{host}:{port}/v1 (Ctrl-C stops)",
          file=sys.stderr)
    try:
        server.serve_forever()
    finally:
        server.httpd.server_close()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxlearn.cli.main import UsageError
    from jaxlearn.inference import RequestError, chat_prompt

    engine = _engine(args, max_queue=1)
    prompt: Any = args.prompt
    if args.chat:
        prompt = chat_prompt(engine.tokenizer, [{"role": "user", "content": args.prompt}])
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
