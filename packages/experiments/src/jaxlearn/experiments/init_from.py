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
- `init_from`: `interop.ModelSource` on PATH, which the trainer loads into its param
  shardings when the output dir has no checkpoint yet.

`--init_adapter ADAPTER` (with `--init_from BASE` and a LoRA recipe) trains on from a LoRA
adapter: a PEFT adapter directory or a jaxlearn LoRA run, read for BASE's model by
`interop.lora_source.open_lora_adapter`. The recipe's LoRA layers give way to the
adapter's (its rank, alpha, dropout and adapted projections, `layers.use_lora`), and
`init_from` becomes `interop.lora_source.AdaptedModelSource` (BASE's weights, the
adapter's lora_a / lora_b).

What PATH holds is `jaxlearn.interop.open_model`'s to say, read once (config.json / the
GGUF header / the run record, never tensor data). This runs before the mesh rules, so
remat and sharding rules apply to the pretrained model as to the recipe's own. Problems
raise `InitFromUsageError` (one line naming PATH).
"""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.config import ConfigBase


class InitFromUsageError(ValueError):
    """PATH is not a model `--init_from` can start from (the message names it)."""


def _lora_settings(model: Any) -> Optional[dict[str, Any]]:
    """`use_lora` arguments that rebuild the LoRA layers of a recipe's model (None: none):
    its first LoRA layer's rank, alpha and dropout, targets = the config names of every
    adapted projection (`q_proj`, `wi`, ...)."""
    from jaxlearn.config import leaves

    # One call for the whole tree (no per-node callback back into this package).
    fields: dict[str, dict[str, Any]] = {}
    for path, value in leaves(model, literal_sequences=True):
        node, _, name = path.rpartition(".")
        if name.startswith("lora_"):
            fields.setdefault(node, {})[name] = value
    found = {node: f for node, f in fields.items() if "lora_rank" in f}
    if not found:
        return None
    names = sorted({node.rpartition(".")[2] for node in found})
    first = next(iter(found.values()))
    return {"rank": first["lora_rank"], "alpha": first["lora_alpha"],
            "dropout": first["lora_dropout"], "targets": rf".*\.({'|'.join(names)})"}


def _pretrained_model(cfg: Any, source: Any) -> Any:
    """PATH's architecture with the recipe's dtypes and LoRA layers (`use_lora` again)."""
    from jaxlearn.layers import use_lora

    model = cfg.model
    new = source.model_config(stack="scan", dtype=getattr(model, "dtype", None),
                              param_dtype=getattr(model, "param_dtype", None))
    lora = _lora_settings(model)
    return new if lora is None else use_lora(new, **lora)


def _set_input(inp: Any, tok: Any, chat: Any) -> None:
    if inp is None or not hasattr(inp, "tokenizer"):
        return
    inp.tokenizer = tok
    if chat is not None and hasattr(inp, "chat_template"):
        inp.set(chat_template=chat.source, bos_token=chat.bos_token or "",
                eos_token=chat.eos_token or "")


def _from_run(cfg: Any, source: Any) -> Any:
    """The model, tokenizer and chat template of a jaxlearn run, as its record holds them;
    the recipe's LoRA layers applied to the run's model when it has none."""
    base = source.model_config()
    lora = _lora_settings(cfg.model)
    if lora is not None and _lora_settings(base) is None:
        from jaxlearn.layers import use_lora

        base = use_lora(base, **lora)  # the recipe's adapters on the run's model
    cfg.model = base
    run = source.run
    for name in ("input", "eval_input"):
        inp = getattr(cfg, name, None)
        if inp is None or not hasattr(inp, "tokenizer") or run.tokenizer is None:
            continue
        inp.tokenizer = source.tokenizer_config()
        if hasattr(inp, "chat_template") and run.chat_template is not None:
            inp.set(chat_template=run.chat_template, bos_token=run.bos_token,
                    eos_token=run.eos_token)
    return cfg


def _apply_adapter(cfg: Any, base: str, adapter: str) -> Any:
    """`cfg` (already set up from `--init_from base`) made to start from `adapter` too."""
    from jaxlearn.interop import InteropError
    from jaxlearn.interop.lora_source import AdaptedModelSource, open_lora_adapter

    if _lora_settings(cfg.model) is None:
        raise InitFromUsageError(f"--init_adapter {adapter}: the experiment has no LoRA layers "
                                 "to train on from it; use a LoRA recipe (lora, dpo-lora, "
                                 "grpo-lora)")
    try:
        cfg.model = open_lora_adapter(adapter, cfg.model).model_config
    except InteropError as e:
        what = " ".join(str(e).split()).removeprefix(f"{adapter}: ")
        raise InitFromUsageError(f"--init_adapter {adapter}: {what}") from None
    cfg.init_from = AdaptedModelSource.default_config().set(path=base, adapter=str(adapter))
    return cfg


def apply_init_from(cfg: ConfigBase, path: Optional[str], adapter: Optional[str] = None) -> Any:
    """`cfg` (a recipe's Trainer config, before mesh rules) set up to start from `path`
    and, with `adapter`, from that LoRA adapter on it (see the module doc); `path` None
    leaves it as it is."""
    if path is None:
        if adapter is not None:
            raise InitFromUsageError(f"--init_adapter {adapter}: needs --init_from BASE, the "
                                     "model the adapter was trained on")
        return cfg
    from jaxlearn.checkpoint.run_record import RunRecordError
    from jaxlearn.config import ConfigError
    from jaxlearn.interop import InteropError, open_model
    from jaxlearn.text.errors import TextError

    try:
        source = open_model(path)
        if source.kind == "jaxlearn":
            cfg = _from_run(cfg, source)
        else:
            cfg.model = _pretrained_model(cfg, source)
            if source.kind == "hf":
                from jaxlearn.interop.hf import check_safetensors

                check_safetensors(source.target)  # weights in a format that is read at all
            tok = source.tokenizer_config()
            if tok is None:
                what = ("no tokenizer.json" if source.kind == "hf"
                        else "the GGUF file has no embedded tokenizer")
                raise InitFromUsageError(f"--init_from {path}: {what} (the model's "
                                         "tokenizer is needed to tokenize the training data)")
            for name in ("input", "eval_input"):
                _set_input(getattr(cfg, name, None), tok, source.chat_template)
    except (InteropError, TextError, RunRecordError, ConfigError) as e:
        what = " ".join(str(e).split()).removeprefix(f"{path}: ")
        raise InitFromUsageError(f"--init_from {path}: {what}") from None
    cfg.init_from = source.config.clone()
    return cfg if adapter is None else _apply_adapter(cfg, str(source.config.path), adapter)


__all__ = ["InitFromUsageError", "apply_init_from"]
