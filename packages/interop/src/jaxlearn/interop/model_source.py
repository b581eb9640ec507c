"""`open_model(path) -> ModelSource`: the one owner of "what model is at this path".

    source = open_model("SmolLM2-135M-Instruct/")      # or model.gguf, or a jaxlearn run
    source.kind                                         # "hf" | "gguf" | "jaxlearn"
    source.model_config(stack="scan")                   # CausalLM.Config
    source.tokenizer_config()                           # a jaxlearn.text tokenizer config
    source.chat_template                                # ChatTemplate or None
    source.text_tokenizer()                             # what the engine serves with
    source.load(model, shardings)                       # params placed per shardings
    source.load_host()                                  # LoadedModel (numpy params)

What a path holds (`model_kind`):
- a `*.gguf` file, or a directory holding exactly one -> "gguf" (that file);
- a directory with `config.json` -> "hf";
- a run's output dir (`run.json`), its `checkpoints/` dir or one step dir
  (`jaxlearn.checkpoint.locate`) -> "jaxlearn".

The path is read once per `open_model`: the GGUF header is parsed once and handed to the
loaders (`load_gguf`, the sharded readers); an HF directory's config.json is read once
and handed to `load_hf`.
A jaxlearn run's model config, tokenizer and chat template are its record's
(`jaxlearn.checkpoint.run_record.RunModel`, read on first use); a checkpoint without a
record has none, and `open_model(path, run=RunModel.from_config_text(...))` supplies them
(the CLI builds one from `--experiment`): nothing is guessed.

`ModelSource` is a Configurable (`Config.path`), so a run records it: it is the trainer's
`init_from` (`describe`, `load`), loading an HF/GGUF model shard by shard
(`sharded.load_sharded`) or a jaxlearn run's newest step (or the given step dir) straight
into the train state's shardings.
"""

from __future__ import annotations

import copy
import functools
import pathlib
import re
from typing import Any, Callable, Optional, TypeVar, Union

from jaxlearn.checkpoint import is_checkpoint
from jaxlearn.checkpoint.run_record import RECORD_FILE, RunModel, read_run_model
from jaxlearn.config import REQUIRED, Configurable
from jaxlearn.interop.errors import InteropError, MalformedFileError, ParameterMismatchError
from jaxlearn.text import errors as text_errors

T = TypeVar("T")


def model_kind(path: Union[str, pathlib.Path]) -> tuple[str, pathlib.Path]:
    """("hf" | "gguf" | "jaxlearn", the path to load) of `path`; an InteropError naming
    `path` when it is none of them."""
    p = pathlib.Path(path)
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return "gguf", p
        raise InteropError(f"{p}: a file that is not .gguf; expected a GGUF file or a directory")
    if not p.is_dir():
        raise InteropError(f"{p}: no such file or directory")
    if (p / "config.json").exists():
        return "hf", p
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if (p / RECORD_FILE).is_file() or is_checkpoint(p):
        return "jaxlearn", p
    raise InteropError(
        f"{p}: neither an HF model directory (no config.json), a GGUF file ({len(ggufs)} "
        f"*.gguf files here) nor a jaxlearn run (no run.json, no checkpoint steps)")


def guard(path: Union[str, pathlib.Path], fn: Callable[[], T]) -> T:
    """`fn()`, with what a malformed file provokes below interop (a `jaxlearn.text` error,
    a value error from numpy or tokenizers) turned into a one-line MalformedFileError
    naming `path`."""
    try:
        return fn()
    except InteropError:
        raise
    except text_errors.TextError as e:
        raise MalformedFileError(" ".join(str(e).split())) from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, UnicodeError) as e:
        what = " ".join(str(e).split())[:500]
        raise MalformedFileError(f"{path}: cannot be loaded ({type(e).__name__}: {what})") from None


class ModelSource(Configurable):
    """The model at `Config.path` (see the module doc). Attributes: `kind`, `target` (the
    file or directory loaded), `architecture` (HF/GGUF), `gguf` (the parsed GGUFFile),
    `hf_config` (config.json), `root` / `step` (a jaxlearn checkpoint root and the step
    dir given, None: the newest that verifies)."""

    class Config(Configurable.Config):
        path: str = REQUIRED

    def __init__(self, cfg: Any, *, run: Optional[RunModel] = None, **kw: Any):
        super().__init__(cfg, **kw)
        self.path = pathlib.Path(self.config.path)
        self.kind, self.target = model_kind(self.path)
        self._run = run
        self.architecture: Any = None
        self.gguf: Any = None
        self.hf_config: Optional[dict[str, Any]] = None
        self.root: Optional[pathlib.Path] = None
        self.step: Optional[int] = None
        guard(self.path, self._open)

    def _open(self) -> None:
        if self.kind == "gguf":
            from jaxlearn.interop.gguf import GGUFFile, architecture_from_gguf

            self.gguf = GGUFFile(self.target)
            self.architecture = architecture_from_gguf(self.gguf)
        elif self.kind == "hf":
            from jaxlearn.families import architecture_from_hf
            from jaxlearn.interop.hf import read_json

            where = self.target / "config.json"
            self.hf_config = read_json(where)
            self.architecture = architecture_from_hf(self.hf_config, where=str(where))
        elif is_checkpoint(self.target):
            from jaxlearn.checkpoint import locate

            self.root, self.step = locate(self.target)

    def describe(self) -> str:
        """The model, as a run record names its base model."""
        return str(self.config.path)

    # ---- what the model is ------------------------------------------------------------

    @property
    def run(self) -> RunModel:
        """A jaxlearn run's recorded model, tokenizer and chat template (InteropError
        naming the path for a checkpoint without a record)."""
        if self.kind != "jaxlearn":
            raise InteropError(f"{self.path}: a {self.kind} model, not a jaxlearn run")
        if self._run is None:
            self._run = read_run_model(self.target)
            if self._run is None:
                raise InteropError(
                    f"{self.path}: a jaxlearn checkpoint without a run record (run.json), so "
                    "its model config is unknown; name the experiment that trained it "
                    "(--experiment NAME)")
        return self._run

    def with_run(self, run: RunModel) -> "ModelSource":
        """This jaxlearn checkpoint with `run` as its model, tokenizer and chat template
        (instead of its record's: a record-less checkpoint, or `--set` overrides)."""
        if self.kind != "jaxlearn":
            raise InteropError(f"{self.path}: a {self.kind} model, not a jaxlearn run")
        other = copy.copy(self)
        other._run = run
        return other

    def model_config(self, *, stack: str = "scan", dtype: Optional[str] = None,
                     param_dtype: Optional[str] = None, **kw: Any) -> Any:
        """The model's `CausalLM.Config`: HF/GGUF built by `families.build_config` with
        these options; a jaxlearn run's recorded one (the options do not apply)."""
        if self.kind == "jaxlearn":
            return self.run.model.clone()
        from jaxlearn.families import build_config

        return build_config(self.architecture, stack=stack, dtype=dtype,
                            param_dtype=param_dtype, **kw)

    @functools.cached_property
    def _tokenizer_files(self) -> tuple[Any, Any, dict[str, Any]]:
        """(tokenizers.Tokenizer or None, ChatTemplate or None, special-token info)."""
        if self.kind == "hf":
            from jaxlearn.interop.hf import load_hf_tokenizer

            return guard(self.path, lambda: load_hf_tokenizer(self.target))
        from jaxlearn.text.gguf_tokenizer import chat_template_of

        f = self.gguf
        tok = None
        if f.get("tokenizer.ggml.tokens") is not None:
            from jaxlearn.interop.gguf import tokenizer_from_gguf

            tok = guard(self.path, lambda: tokenizer_from_gguf(f))
        chat = guard(self.path, lambda: chat_template_of(f.metadata, str(self.target)))
        return tok, chat, {"pad_token_id": f.get("tokenizer.ggml.padding_token_id")}

    def tokenizer_config(self) -> Any:
        """The `jaxlearn.text` tokenizer config a run trains with (None: the model has no
        tokenizer): `HFTokenizer` on tokenizer.json with tokenizer_config.json's BOS/EOS/
        pad texts; `GGUFTokenizer` on the file; a jaxlearn run's recorded one."""
        if self.kind == "jaxlearn":
            tok = self.run.tokenizer
            return None if tok is None else tok.clone()
        if self.kind == "gguf":
            if self.gguf.get("tokenizer.ggml.tokens") is None:
                return None
            from jaxlearn.text.gguf_tokenizer import GGUFTokenizer

            return GGUFTokenizer.default_config().set(path=str(self.target))
        if not (self.target / "tokenizer.json").exists():
            return None
        from jaxlearn.text.tokenizers import HFTokenizer

        info = self._tokenizer_files[2]
        return HFTokenizer.default_config().set(
            path=str(self.target / "tokenizer.json"), bos_token=info["bos_token"],
            eos_token=info["eos_token"], pad_token=info["pad_token"])

    @property
    def chat_template(self) -> Any:
        """The model's `ChatTemplate` (None: none): HF tokenizer files, the GGUF metadata,
        or the template a jaxlearn run's data was rendered with."""
        if self.kind != "jaxlearn":
            return self._tokenizer_files[1]
        run = self.run
        if not run.chat_template:
            return None
        from jaxlearn.text.chat import ChatTemplate

        return ChatTemplate(run.chat_template, bos_token=run.bos_token, eos_token=run.eos_token,
                            origin=f"{self.path}: the run's input.chat_template")

    def text_tokenizer(self) -> Any:
        """The tokenizer the engine serves with and exports write (None: the model has
        none): its EOS ids (config, generation config and tokenizer), BOS, pad and chat
        template; a jaxlearn run's the recorded tokenizer, with the run's chat template
        when the tokenizer brings none."""
        if self.kind == "jaxlearn":
            cfg = self.tokenizer_config()
            if cfg is None:
                return None
            tokenizer = cfg.instantiate()
            chat = self.chat_template
            if chat is not None and tokenizer.chat_template is None:
                tokenizer.set_chat_template(chat)
            return tokenizer
        tok, chat, info = self._tokenizer_files
        if tok is None:
            return None
        from jaxlearn.text.tokenizers import HFTokenizer

        arch = self.architecture
        eos = tuple(dict.fromkeys(arch.eos_token_ids + tuple(info.get("eos_token_ids", ()))))
        pad = (self.hf_config or {}).get("pad_token_id", info.get("pad_token_id"))
        if pad is None and info.get("pad_token") is not None:
            pad = tok.token_to_id(info["pad_token"])
        return guard(self.path, lambda: HFTokenizer.from_tokenizer(
            tok, bos_id=arch.bos_token_id, eos_token_ids=eos, pad_id=pad,
            chat_template=chat, source=str(self.target)))

    def special_tokens(self) -> dict[str, Any]:
        """{"bos", "eos", "pad"}: (id, text) of the serving tokenizer's special tokens
        (None where it has none; eos: the first end-of-generation id; text None for a
        tokenizer without a vocabulary of texts, e.g. bytes)."""
        tok = self.text_tokenizer()
        vocab = getattr(tok, "tokenizer", None)  # the `tokenizers.Tokenizer` of HF / GGUF
        out: dict[str, Any] = {}
        for name, i in (("bos", getattr(tok, "bos_id", None)),
                        ("eos", (getattr(tok, "eos_token_ids", ()) or (None,))[0]),
                        ("pad", getattr(tok, "pad_id", None))):
            text = vocab.id_to_token(i) if i is not None and vocab is not None else None
            out[name] = (i, text)
        return out

    # ---- params ---------------------------------------------------------------------

    def load(self, model: Any, shardings: Any) -> Any:
        """`model`'s params placed per `shardings` (a tree like its parameter specs, or
        one sharding), read shard by shard from HF/GGUF files or restored by orbax from a
        jaxlearn checkpoint (its newest good step, or the step dir given). LoRA adapters
        the source lacks are left out (the trainer initialises them); any other missing
        param is a ParameterMismatchError."""
        if self.kind != "jaxlearn":
            from jaxlearn.interop.sharded import load_sharded

            return load_sharded(self, model, shardings)
        import jax

        from jaxlearn.checkpoint import restore_subtree
        from jaxlearn.module import is_spec

        abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(tuple(s.shape), s.dtype),
                                model.create_parameter_specs_recursively(), is_leaf=is_spec)
        # A model may name where older checkpoints stored a renamed param (a CausalLM:
        # the flat projection layout, `jaxlearn.layers.legacy`).
        params, step = restore_subtree(self._root(), "params", abstract, shardings=shardings,
                                       step=self.step, skip_missing=True,
                                       aliases=getattr(model, "older_param_path", None))
        absent = _absent(params, abstract)
        if absent:
            other = self._as_other_stack(model, step)
            if other is None:
                raise ParameterMismatchError(f"{self.path} (step {step})", missing=absent)
            params = _placed(other, shardings)
        return params

    def _as_other_stack(self, model: Any, step: int) -> Optional[Any]:
        """`model`'s params from a step written with its layer stack in the other form
        (`layers.swapped_stack`: stacked [layers, ...] <-> one tree per layer; e.g. a
        fine-tuning run from before the CPU rule looped over the layers), laid out for
        `model` (numpy); None when there is no such form or the step does not hold it."""
        import jax
        import numpy as np

        from jaxlearn.checkpoint import restore_subtree
        from jaxlearn.layers import swapped_stack
        from jaxlearn.module import is_spec

        decoder = getattr(model, "decoder", None)
        stack = getattr(decoder, "transformer", None)
        other_cfg, _ = swapped_stack(getattr(stack, "config", None))
        if other_cfg is None:
            return None
        cfg = model.config.clone()
        cfg.decoder.transformer = other_cfg
        other = cfg.instantiate()
        abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(tuple(s.shape), s.dtype),
                                other.create_parameter_specs_recursively(), is_leaf=is_spec)
        params, _ = restore_subtree(self._root(), "params", abstract, step=step,
                                    skip_missing=True,
                                    aliases=getattr(model, "older_param_path", None))
        if _absent(params, abstract):
            return None
        params = jax.tree.map(np.asarray, params)
        _, transformer = swapped_stack(other_cfg, params["decoder"]["transformer"])
        return dict(params, decoder=dict(params["decoder"], transformer=transformer))

    def load_host(self, **kwargs: Any) -> Any:
        """HF/GGUF: the whole model as a `LoadedModel` (numpy params; kwargs as for
        `load_hf` / `load_gguf`), the parsed GGUF header reused."""
        if self.kind == "gguf":
            from jaxlearn.interop.gguf import load_gguf

            return guard(self.path, lambda: load_gguf(self.gguf, **kwargs))
        if self.kind == "hf":
            from jaxlearn.interop.hf import load_hf

            return guard(self.path, lambda: load_hf(self.target, hf_config=self.hf_config,
                                                    **kwargs))
        raise InteropError(f"{self.path}: a jaxlearn run; its host params are "
                           "`host_params(model_config)`")

    def host_params(self, model_cfg: Any, step: Optional[int] = None) -> tuple[Any, int]:
        """(numpy params, step) of a jaxlearn run for `model_cfg` (default step: the step
        dir given, else the newest that verifies), for export."""
        import jax

        from jaxlearn.checkpoint import restore_subtree

        if model_cfg.name is REQUIRED:
            model_cfg = model_cfg.clone(name="model")
        model = model_cfg.instantiate()
        shapes = jax.eval_shape(model.initialize_parameters_recursively, jax.random.key(0))
        params, found = restore_subtree(self._root(), "params", shapes,
                                        step=self.step if step is None else step,
                                        aliases=getattr(model, "older_param_path", None))
        return jax.device_get(params), found

    def _root(self) -> pathlib.Path:
        if self.root is None:
            raise InteropError(f"{self.path}: a jaxlearn run without checkpoint steps")
        return self.root


def _absent(params: Any, abstract: Any) -> list[str]:
    """Paths of `abstract` that `params` lacks, LoRA adapters aside (a base model's)."""
    have = _paths(params)
    return [k for k in _paths(abstract)
            if k not in have and not re.search(r"(^|\.)adapter\.", k)]


def _placed(params: Any, shardings: Any) -> Any:
    """`params` (dict tree, maybe lacking leaves `shardings` has) put per `shardings` (a
    tree like the model's specs, or one sharding)."""
    import jax

    if not isinstance(shardings, dict):
        return jax.device_put(params, shardings)
    return {k: _placed(v, shardings[k]) if isinstance(v, dict) else
            jax.device_put(v, shardings[k]) for k, v in params.items()}


def _paths(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_paths(v, f"{prefix}.{k}" if prefix else k))
    return out


def open_model(path: Union[str, pathlib.Path], *, run: Optional[RunModel] = None) -> ModelSource:
    """The `ModelSource` of `path` (see the module doc); `run`: the model, tokenizer and
    chat template of a jaxlearn checkpoint, instead of its record's. Every failure is an
    InteropError naming the path."""
    return ModelSource.default_config().set(path=str(path)).instantiate(run=run)


__all__ = ["ModelSource", "guard", "model_kind", "open_model"]
