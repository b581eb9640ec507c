"""`jaxlearn export`: a model as an HF directory or a GGUF file, a LoRA run's adapters alone
as a PEFT adapter directory.

    jaxlearn export --model RUN_DIR|CKPT|HF_DIR|FILE.gguf --format hf --output DIR
    jaxlearn export --model RUN_DIR --format gguf --output FILE.gguf [--dtype q8_0]
    jaxlearn export --model LORA_RUN_DIR --format peft --output DIR
    jaxlearn export ... --output DIR_OR_FILE_THAT_EXISTS --overwrite

--model is opened like `serve` does (`experiments.open_run_model`, an `interop.ModelSource`):
a jaxlearn run gives the model config, the tokenizer it trained with and the chat template
its data was rendered with from its run record, and its params from the newest step that
verifies (or the step dir given, or `--step`). LoRA adapters are folded into the base weights first
(`jaxlearn.layers.merge_lora`), so the export is a plain model of its family. An HF
directory or GGUF file is converted (its tokenizer and template travel with it). The
writers are `jaxlearn.interop.export_hf` / `export_gguf`; every failure is one line.

`--format peft` writes only the adapters of a jaxlearn LoRA run, unmerged, in Hugging Face
PEFT's layout (`jaxlearn.interop.peft.export_peft`: adapter_config.json naming the run's
base model, adapter_model.safetensors); a run without adapters is refused before its
params are read.

`--output` is checked before the model is read: a GGUF output that is a directory, an HF
output that is a file, and (without `--overwrite`) one that exists and is not empty are
refused; `--overwrite` never replaces a directory that holds `--model`. The output appears
whole (`jaxlearn.interop.atomic`): it is written into a hidden temp next to it and renamed
into place, an existing HF directory replaced whole (no old index or shards stay beside
the new files). A killed export leaves the previous output as it was, plus a hidden temp
that the next export to that output deletes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")
HF_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def add_parsers(sub: Any) -> None:
    """Adds the `export` subcommand to main's subparsers."""
    p = sub.add_parser("export", help="write a model as an HF directory or a GGUF file, or a "
                                      "LoRA run's adapters as a PEFT adapter directory")
    p.add_argument("--model", required=True,
                   help="a jaxlearn run (output_dir, checkpoints/ or step dir), an HF model "
                        "directory or a .gguf file")
    p.add_argument("--format", required=True, choices=("hf", "gguf", "peft"),
                   help="hf / gguf: the whole model (LoRA folded in); peft: a LoRA run's "
                        "adapters alone")
    p.add_argument("--output", required=True,
                   help="directory (hf, peft) or file (gguf) to write; missing or empty, "
                        "unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output whole (written aside, then renamed in)")
    p.add_argument("--dtype", default="f32", choices=GGUF_DTYPES,
                   help="stored weight type (hf, peft: f32/f16/bf16; gguf: also q8_0)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--experiment", default=None,
                   help="the run's experiment, for checkpoints without a run record")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="PATH=VALUE", help="config override applied to the run's config")


def _run_model(args: argparse.Namespace, source: Any) -> tuple[Any, Any, Any, Any]:
    """(model config, numpy params, tokenizer, chat template) of a jaxlearn run's
    `ModelSource`."""
    from jaxlearn.layers import merge_lora

    model_cfg = source.model_config().clone(name="model")
    params, step = source.host_params(model_cfg, step=args.step)
    if any(k.endswith(("lora_a", "lora_b")) for k in _leaf_names(params)):
        model_cfg, params = merge_lora(model_cfg, params)
        print(f"jaxlearn: folded the LoRA adapters of step {step} into the base weights",
              file=sys.stderr)
    tokenizer = source.text_tokenizer()
    template = tokenizer.chat_template if tokenizer is not None else None
    return model_cfg, params, tokenizer, template


def _export_adapters(args: argparse.Namespace, source: Any) -> None:
    """`--format peft`: the run's adapters alone, as a PEFT adapter directory."""
    from jaxlearn.cli.common import UsageError
    from jaxlearn.interop.peft import export_peft, lora_layers

    if source.kind != "jaxlearn":
        raise UsageError(f"--model {args.model}: a {source.kind} model; --format peft exports "
                         "the adapters of a jaxlearn LoRA run")
    model_cfg = source.model_config().clone(name="model")
    if not lora_layers(model_cfg):
        raise UsageError(f"--model {args.model}: the run has no LoRA adapters to export "
                         "(--format hf writes the whole model)")
    params, step = source.host_params(model_cfg, step=args.step)
    export_peft(args.output, model_cfg, params, base_model_name_or_path=source.run.base_model,
                dtype=HF_DTYPES[args.dtype], overwrite=args.overwrite)
    print(f"jaxlearn: the LoRA adapters of step {step}", file=sys.stderr)


def _leaf_names(tree: Any) -> list[str]:
    if isinstance(tree, dict):
        return [name for k, v in tree.items() for name in ([k] + _leaf_names(v))]
    return []


def _check_output(args: argparse.Namespace, model: Path) -> None:
    """Refuses an `--output` the export may not write, before the model is read."""
    from jaxlearn.cli.common import UsageError
    from jaxlearn.interop import InteropError
    from jaxlearn.interop.atomic import prepare_output

    try:
        target = prepare_output(args.output, kind="file" if args.format == "gguf" else "dir",
                                overwrite=args.overwrite, label=f"--output {args.output}",
                                overwrite_flag="--overwrite")
    except InteropError as e:
        raise UsageError(str(e)) from None
    source = model.resolve()
    if target == source or target in source.parents:
        raise UsageError(f"--output {args.output}: holds --model {args.model}, which "
                         "--overwrite would delete; write the export elsewhere")


def _export_model(args: argparse.Namespace, source: Any, where: Any, path: Path) -> None:
    """`--format hf|gguf`: the whole model (a run's LoRA adapters folded in)."""
    from jaxlearn.cli.common import UsageError
    from jaxlearn.interop import export_gguf, export_hf

    if source.kind == "jaxlearn":
        print(f"jaxlearn: model config from {where}", file=sys.stderr)
        config, params, tokenizer, template = _run_model(args, source)
    else:
        loaded = source.load_host()
        config, params = loaded.config, loaded.params
        tokenizer, template = loaded.text_tokenizer(), loaded.chat_template
    if tokenizer is None:
        raise UsageError(f"--model {args.model}: the model has no tokenizer to export")
    if args.format == "hf":
        export_hf(args.output, config, params, tokenizer=tokenizer, chat_template=template,
                  dtype=HF_DTYPES[args.dtype], overwrite=args.overwrite)
    else:
        export_gguf(args.output, config, params, tokenizer=tokenizer,
                    chat_template=template, dtype=args.dtype, name=path.name or "model",
                    overwrite=args.overwrite)


def cmd_export(args: argparse.Namespace) -> int:
    from jaxlearn.cli.common import UsageError, open_model_flag
    from jaxlearn.interop import InteropError

    path = Path(args.model)
    if not path.exists():
        raise UsageError(f"--model {args.model}: no such file or directory")
    if args.format != "gguf" and args.dtype not in HF_DTYPES:
        raise UsageError(f"--dtype {args.dtype}: {args.format.upper()} export stores f32, f16 "
                         "or bf16")
    _check_output(args, path)
    t0 = time.monotonic()
    try:
        source, where = open_model_flag(args.model, args.experiment, args.overrides)
        if args.format == "peft":
            _export_adapters(args, source)
        else:
            _export_model(args, source, where, path)
    except (InteropError, ValueError, OSError) as e:  # ValueError: config / text errors.
        raise UsageError(f"export: {e}") from None
    print(f"jaxlearn: wrote {args.format} {args.output} ({args.dtype}) in "
          f"{time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0


COMMANDS = {"export": cmd_export}
