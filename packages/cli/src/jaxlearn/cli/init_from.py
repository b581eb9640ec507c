"""`--init_from PATH`: a recipe's config made to start from a pretrained model.

    cfg = apply_init_from(get_experiment("finetune"), "SmolLM2-135M-Instruct/")

PATH is an HF model directory (config.json + safetensors + tokenizer files), a GGUF file
(or a directory holding exactly one), or a jaxlearn run (its output dir, `checkpoints/`
or one step dir). Config fields set from PATH, so `jaxlearn config` prints them and the
run record holds them:

- `model`: the pretrained architecture (`families.build_config`, a scanned stack), keeping
  the recipe's compute and param dtypes and its LoRA layers (rank, alpha, dropout and
  adapted weights re-applied with `layers.use_lora`); a jaxlearn run's model as recorded
  (the recipe's LoRA layers applied to it the same way when the run has none);
- `input.tokenizer` (and `eval_input`'s): `HFTokenizer` on `tokenizer.json` with the
  BOS/EOS/pad token texts of `tokenizer_config.json`; `GGUFTokenizer` on the GGUF file;
  a jaxlearn run's recorded tokenizer;
- `input.chat_template`, `bos_token`, `eos_token` (SFT inputs, when PATH has a template);
- `init_from`: `interop.sharded.PretrainedParams` (HF/GGUF) or
  `runtime.init_from.CheckpointParams` (jaxlearn), which the trainer loads into its param
  shardings when the output dir has no checkpoint yet.

Only config.json / GGUF metadata / the run record are read here, never tensor data. This
runs before the mesh rules, so remat and sharding rules apply to the pretrained model as
to the recipe's own. Problems raise `InitFromUsageError` (one line naming PATH).
"""

from __future__ import annotations

import pathlib
from typing import Any, Optional

from jaxlearn.config import ConfigBase


class InitFromUsageError(ValueError):
    """PATH is not a model `--init_from` can start from (the message names it)."""


def _kind(p: pathlib.Path) -> tuple[str, pathlib.Path]:
    """("hf" | "gguf" | "jaxlearn", the path to load) for `--init_from p`
    (`interop.source.model_kind`)."""
    from jaxlearn.interop import InteropError
    from jaxlearn.interop.source import model_kind

    try:
        return model_kind(p)
    except InteropError as e:
        what = str(e).removeprefix(f"{p}: ")
        raise InitFromUsageError(f"--init_from {p}: {what}") from None


def _lora_settings(model: Any) -> Optional[dict[str, Any]]:
    """`use_lora` arguments that rebuild the LoRA layers of a recipe's model (None: none):
    its first LoRA layer's rank, alpha and dropout, targets = the config names of every
    adapted projection (`q_proj`, `wi`, ...)."""
    from jaxlearn.config import visit

    found: list[tuple[str, Any]] = []
    visit(model, lambda path, c: found.append((path, c)) if hasattr(c, "lora_rank") else None)
    if not found:
        return None
    names = sorted({path.rsplit(".", 1)[-1] for path, _ in found})
    first = found[0][1]
    return {"rank": first.lora_rank, "alpha": first.lora_alpha,
            "dropout": first.lora_dropout, "targets": rf".*\.({'|'.join(names)})"}


def _pretrained_model(cfg: Any, arch: Any) -> Any:
    """PATH's architecture with the recipe's dtypes and LoRA layers (`use_lora` again)."""
    from jaxlearn.families import build_config
    from jaxlearn.layers import use_lora

    model = cfg.model
    new = build_config(arch, stack="scan", dtype=getattr(model, "dtype", None),
                       param_dtype=getattr(model, "param_dtype", None))
    lora = _lora_settings(model)
    return new if lora is None else use_lora(new, **lora)


def _hf(p: pathlib.Path) -> tuple[Any, Any, Any]:
    """(architecture, tokenizer config, ChatTemplate or None) of an HF directory."""
    from jaxlearn.families import architecture_from_hf
    from jaxlearn.interop.hf import check_safetensors, read_json
    from jaxlearn.text.hf_files import load_hf_tokenizer
    from jaxlearn.text.tokenizers import HFTokenizer

    arch = architecture_from_hf(read_json(p / "config.json"), where=str(p / "config.json"))
    check_safetensors(p)  # weights in a format that is read at all, before any run starts
    if not (p / "tokenizer.json").exists():
        raise InitFromUsageError(f"--init_from {p}: no tokenizer.json (the model's tokenizer "
                                 "is needed to tokenize the training data)")
    _, chat, info = load_hf_tokenizer(p)
    tok = HFTokenizer.default_config().set(
        path=str(p / "tokenizer.json"), bos_token=info["bos_token"],
        eos_token=info["eos_token"], pad_token=info["pad_token"])
    return arch, tok, chat


def _gguf(p: pathlib.Path) -> tuple[Any, Any, Any]:
    """(architecture, tokenizer config, ChatTemplate or None) of a GGUF file."""
    from jaxlearn.interop.gguf import GGUFFile, architecture_from_gguf
    from jaxlearn.text.gguf_tokenizer import GGUFTokenizer, chat_template_of

    f = GGUFFile(p)
    if f.get("tokenizer.ggml.tokens") is None:
        raise InitFromUsageError(f"--init_from {p}: the GGUF file has no embedded tokenizer")
    tok = GGUFTokenizer.default_config().set(path=str(p))
    return architecture_from_gguf(f), tok, chat_template_of(f.metadata, str(p))


def _set_input(inp: Any, tok: Any, chat: Any) -> None:
    if inp is None or not hasattr(inp, "tokenizer"):
        return
    inp.tokenizer = tok
    if chat is not None and hasattr(inp, "chat_template"):
        inp.set(chat_template=chat.source, bos_token=chat.bos_token or "",
                eos_token=chat.eos_token or "")


def _from_run(cfg: Any, p: pathlib.Path) -> Any:
    """The model, tokenizer and chat template of a jaxlearn run, as its record holds them."""
    from jaxlearn.checkpoint import is_checkpoint, locate
    from jaxlearn.config import from_flat_text
    from jaxlearn.runtime.init_from import CheckpointParams
    from jaxlearn.runtime.record import find_run_record

    record = find_run_record(p) or (find_run_record(locate(p)[0]) if is_checkpoint(p) else None)
    if record is None:
        raise InitFromUsageError(f"--init_from {p}: a jaxlearn checkpoint without run.json "
                                 "(its model config is unknown)")
    from jaxlearn.cli.serve_cmd import use_run_tokenizer

    base = use_run_tokenizer(
        from_flat_text(record.config_text, where=f"{p} (run record config_text)"), p)
    lora = _lora_settings(cfg.model)
    if lora is not None and _lora_settings(base.model) is None:
        from jaxlearn.layers import use_lora

        cfg.model = use_lora(base.model, **lora)  # the recipe's adapters on the run's model
    else:
        cfg.model = base.model
    for name in ("input", "eval_input"):
        inp, old = getattr(cfg, name, None), getattr(base, "input", None)
        if inp is None or old is None:
            continue
        inp.tokenizer = old.tokenizer
        for field in ("chat_template", "bos_token", "eos_token"):
            if hasattr(inp, field) and hasattr(old, field):
                setattr(inp, field, getattr(old, field))
    cfg.init_from = CheckpointParams.default_config().set(path=str(p))
    return cfg


def apply_init_from(cfg: ConfigBase, path: Optional[str]) -> Any:
    """`cfg` (a recipe's Trainer config, before mesh rules) set up to start from `path`
    (see the module doc); `path` None leaves it as it is."""
    if path is None:
        return cfg
    from jaxlearn.config import ConfigError
    from jaxlearn.interop import InteropError
    from jaxlearn.interop.sharded import PretrainedParams
    from jaxlearn.runtime.record import RunRecordError
    from jaxlearn.text.errors import TextError

    kind, target = _kind(pathlib.Path(path))
    try:
        if kind == "jaxlearn":
            return _from_run(cfg, target)
        arch, tok, chat = _hf(target) if kind == "hf" else _gguf(target)
        cfg.model = _pretrained_model(cfg, arch)
    except (InteropError, TextError, RunRecordError, ConfigError) as e:
        raise InitFromUsageError(f"--init_from {path}: {' '.join(str(e).split())}") from None
    for name in ("input", "eval_input"):
        _set_input(getattr(cfg, name, None), tok, chat)
    cfg.init_from = PretrainedParams.default_config().set(path=str(target))
    return cfg


__all__ = ["InitFromUsageError", "apply_init_from"]
