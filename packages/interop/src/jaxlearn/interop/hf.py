"""HF transformers checkpoints: load an HF model directory and export one.

    loaded = load_hf("path/to/dir")          # LoadedModel (config, params, tokenizer, ...)
    export_hf("out/", loaded.config, loaded.params, tokenizer=loaded.tokenizer,
              chat_template=loaded.chat_template)

Supported `model_type`s: llama (incl. Llama-3.1 RoPE scaling, attention/MLP biases),
mistral (sliding window), qwen2 (q/k/v biases, per-layer sliding windows via
`layer_types` / `use_sliding_window` + `max_window_layers`), qwen3 (per-head q/k RMSNorm,
explicit head_dim, optional q/k/v/o biases, windows as qwen2), qwen3_moe (qwen3 attention,
top-k softmax experts with `norm_topk_prob`, dense layers from `mlp_only_layers` /
`decoder_sparse_step`, `use_sliding_window` windows every layer; hub layout
`mlp.experts.N.{gate,up,down}_proj`), mixtral (top-k softmax MoE;
both the hub layout `block_sparse_moe.experts.N.w1/w2/w3` and the fused
`mlp.experts.gate_up_proj/down_proj` layout of transformers 5). Tensors are read with
`safetensors` into numpy (no torch, no pickle), single-file or sharded
(`model.safetensors.index.json`); bf16 works through `ml_dtypes`.

Tensor names and layouts (HF `nn.Linear` weights are [out, in]; ours [in, *out]) come
from the name table in `jaxlearn.families.names`, which import and export both read.
RoPE uses the rotate-half convention of HF, so q/k need no permutation.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Iterable, Optional

import jax.numpy as jnp  # noqa: F401  (imports ml_dtypes: numpy then reads bf16/fp8 tensors)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxlearn.families.arch import Architecture, architecture_from_config, build_config
from jaxlearn.families.checks import check_layers_present
from jaxlearn.families.hf_config import architecture_from_hf, hf_config_dict
from jaxlearn.families.tree import assemble_params, layer_layouts, split_params, stack_kind
from jaxlearn.interop.atomic import prepare_output, write_atomically
from jaxlearn.interop.convert import read_tensors, write_tensors
from jaxlearn.interop.errors import (
    InteropError,
    MalformedFileError,
    TokenizerError,
    tokenizer_errors_as_interop,
)
from jaxlearn.interop.model import LoadedModel
from jaxlearn.text import errors as text_errors
from jaxlearn.text import hf_files
from jaxlearn.text.chat import ChatTemplate

Nested = dict[str, Any]
INDEX_FILE = "model.safetensors.index.json"


# ---- config.json and index files ------------------------------------------------------


MAX_JSON_BYTES = 64 * 2**20  # config.json and index files are kilobytes


def read_json(path: pathlib.Path, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The parsed JSON of `path` (at most `max_bytes`; one-line InteropError otherwise)."""
    try:
        if path.exists() and not path.is_file():  # a FIFO or device would block or never end
            raise MalformedFileError(f"{path}: not a regular file")
        size = path.stat().st_size
        if size > max_bytes:
            raise MalformedFileError(f"{path}: {size} bytes, more than the {max_bytes} allowed")
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise InteropError(f"{path}: not found") from None
    except OSError as e:
        raise InteropError(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise MalformedFileError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise MalformedFileError(f"{path}: invalid JSON ({e})") from None
    except RecursionError:
        raise MalformedFileError(f"{path}: JSON nested too deeply") from None


# ---- safetensors ----------------------------------------------------------------------------


class SafetensorsReader:
    """Name -> numpy tensor over the *.safetensors files of a directory (sharded via
    `model.safetensors.index.json`, or every *.safetensors file).

    The `safetensors` library checks each header against its file (header length, dtypes,
    shapes, offsets that cover the data exactly); its errors become one-line
    MalformedFileErrors naming the file. Index shards must be plain files of `directory`.

    A multimodal checkpoint (Gemma3ForConditionalGeneration: text weights under
    `model.language_model.` or `language_model.model.`) is seen as its text model: those
    tensors under `model.`, `language_model.lm_head` as `lm_head`, and the vision tower and
    projector left out (`ignored` counts them).
    """

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        index = directory / INDEX_FILE
        self._where: dict[str, pathlib.Path] = {}
        self._handles: dict[pathlib.Path, Any] = {}
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise MalformedFileError(f"{index}: no 'weight_map' object")
            for name, file in weight_map.items():
                self._where[name] = self._shard(index, name, file)
        else:
            files = check_safetensors(directory)
            for path in files:
                for name in self._open(path).keys():
                    self._where[name] = path
        self._stored = {n: n for n in self._where}  # name seen -> name in the file
        self.ignored = 0
        if any(n.startswith(_TEXT_PREFIXES) for n in self._where):
            self._stored = {}
            for n in self._where:
                seen = _text_name(n)
                if seen is None:
                    self.ignored += 1
                else:
                    self._stored[seen] = n

    def _shard(self, index: pathlib.Path, name: str, file: Any) -> pathlib.Path:
        """The checked path of the shard that the index says holds tensor `name`."""
        if not isinstance(file, str) or pathlib.PurePath(file).name != file or file in ("", ".."):
            raise MalformedFileError(
                f"{index}: weight_map[{name!r}] = {file!r} is not a file name in {self.directory}"
            )
        path = self.directory / file
        if not path.is_file():
            raise InteropError(f"{index}: shard {file!r} (for {name}) is missing")
        return path

    def _open(self, path: pathlib.Path) -> Any:
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="numpy")
            except Exception as e:  # safetensors raises its own error types
                raise MalformedFileError(
                    f"{path}: not a readable safetensors file ({_one_line(e)})"
                ) from None
        return self._handles[path]

    def names(self) -> list[str]:
        return list(self._stored)

    def __contains__(self, name: str) -> bool:
        return name in self._stored

    def _slice(self, name: str) -> Any:
        stored = self._stored.get(name, name)
        return self._open(self._where[stored]).get_slice(stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._guard(name, lambda: self._slice(name).get_shape()))

    def read(self, name: str) -> np.ndarray:
        stored = self._stored.get(name, name)
        return np.asarray(self._guard(
            name, lambda: self._open(self._where[stored]).get_tensor(stored)))

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return np.asarray(self._guard(name, lambda: self._slice(name)[index]))

    def _guard(self, name: str, fn: Any) -> Any:
        try:
            return fn()
        except InteropError:
            raise
        except Exception as e:  # e.g. the index names a tensor its shard does not hold
            where = self._where.get(self._stored.get(name, name), self.directory)
            raise MalformedFileError(f"{where}: tensor {name}: {_one_line(e)}") from None


PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")  # PyTorch pickles: never read


def check_safetensors(directory: pathlib.Path) -> list[pathlib.Path]:
    """The *.safetensors files of `directory` (none needed when it has an index); raises a
    one-line InteropError naming it when it has neither, saying so when it holds only
    PyTorch pickle weights (`pytorch_model.bin`), which are never unpickled."""
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if files or (directory / INDEX_FILE).exists():
        return files
    pickles = sorted({p.name for pattern in PICKLE_WEIGHTS for p in directory.glob(pattern)})
    if pickles:
        shown = ", ".join(pickles[:3]) + (f" and {len(pickles) - 3} more" if pickles[3:] else "")
        raise InteropError(
            f"{directory}: holds only PyTorch pickle weights ({shown}); only safetensors are "
            "read (pickles are never unpickled): convert them to model.safetensors first")
    raise InteropError(f"{directory}: no *.safetensors files (and no {INDEX_FILE})")


_TEXT_PREFIXES = ("model.language_model.", "language_model.")


def _text_name(name: str) -> Optional[str]:
    """The text-model name of tensor `name` of a multimodal checkpoint (None: not text)."""
    for prefix, to in (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def load_hf_params(
    directory: str | pathlib.Path,
    arch: Architecture,
    model: Any,
    *,
    reader: Optional[SafetensorsReader] = None,
) -> Nested:
    """Reads the safetensors of `directory` into `model`'s params (numpy, spec dtypes),
    through the name table of `arch.family`.

    Raises ParameterMismatchError listing every missing, unexpected or mis-shaped tensor
    (checked from the file headers before any tensor is read).
    """
    directory = pathlib.Path(directory)
    top, layers, names = read_tensors(
        arch,
        "hf",
        reader or SafetensorsReader(directory),
        where=str(directory),
        layouts=layer_layouts(model),
        stacked=stack_kind(model) == "scan",
    )
    return assemble_params(model, top, layers, source=str(directory), names=names)


# ---- tokenizer ------------------------------------------------------------------------------


def load_hf_tokenizer(
    directory: str | pathlib.Path,
) -> tuple[Any, Optional[ChatTemplate], dict[str, Any]]:
    """(tokenizers.Tokenizer or None, ChatTemplate or None, info) of an HF model directory;
    see `jaxlearn.text.hf_files.load_hf_tokenizer`."""
    try:
        return hf_files.load_hf_tokenizer(directory)
    except text_errors.TokenizerError as e:
        raise TokenizerError(str(e)) from None


# ---- entry points ---------------------------------------------------------------------------


def load_hf(
    path: str | pathlib.Path,
    *,
    stack: str = "scan",
    dtype: Optional[str] = None,
    param_dtype: Optional[str] = None,
    attention_implementation: str = "auto",
    moe_dropless_method: str = "ragged_dot",
    hf_config: Optional[dict[str, Any]] = None,
) -> LoadedModel:
    """Loads an HF model directory (config.json + safetensors [+ tokenizer files]).

    stack / dtype / param_dtype / attention_implementation / moe_dropless_method: see
    `build_config`. Params are numpy arrays in `param_dtype` (default float32).
    `hf_config`: config.json as already read (`ModelSource`), instead of reading it again.
    """
    directory = pathlib.Path(path)
    if not directory.is_dir():
        raise InteropError(f"{directory}: not a directory")
    hf = read_json(directory / "config.json") if hf_config is None else hf_config
    arch = architecture_from_hf(hf, where=str(directory / "config.json"))
    reader = SafetensorsReader(directory)
    check_layers_present(
        arch,
        "hf",
        reader.names(),
        where=str(directory / "config.json"),
        field="num_hidden_layers",
        source=f"the safetensors of {directory}",
    )
    config = build_config(
        arch,
        stack=stack,
        dtype=dtype,
        param_dtype=param_dtype,
        attention_implementation=attention_implementation,
        moe_dropless_method=moe_dropless_method,
    )
    model = config.instantiate()
    params = load_hf_params(directory, arch, model, reader=reader)
    tokenizer, chat, info = load_hf_tokenizer(directory)
    eos = tuple(dict.fromkeys(arch.eos_token_ids + info["eos_token_ids"]))
    pad = hf.get("pad_token_id")
    if pad is None and tokenizer is not None and info["pad_token"] is not None:
        pad = tokenizer.token_to_id(info["pad_token"])
    return LoadedModel(
        config=config,
        params=params,
        tokenizer=tokenizer,
        chat_template=chat,
        eos_token_ids=eos,
        bos_token_id=arch.bos_token_id,
        pad_token_id=pad,
        architecture=arch,
        format="hf",
        source=str(directory),
        metadata=hf if not reader.ignored else dict(hf, ignored=(
            f"{reader.ignored} tensors outside the text model (vision tower, projector) "
            "are not loaded")),
    )


def _cast_for_export(x: np.ndarray, dtype: str) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x).astype(np.dtype(dtype)))


def export_hf(
    path: str | pathlib.Path,
    config: Any,
    params: Nested,
    *,
    tokenizer: Any = None,
    chat_template: Optional[ChatTemplate] = None,
    bos_token_id: Optional[int] = None,
    eos_token_ids: Iterable[int] = (),
    pad_token_id: Optional[int] = None,
    max_position_embeddings: Optional[int] = None,
    dtype: str = "float32",
    max_shard_bytes: Optional[int] = None,
    overwrite: bool = False,
) -> pathlib.Path:
    """Writes an HF model directory for a jaxlearn `CausalLM` (config + params): config.json,
    model.safetensors (or shards + index when larger than `max_shard_bytes`) and
    generation_config.json (bos/eos/pad ids); with a tokenizer (a `tokenizers.Tokenizer`,
    jaxlearn's `ByteTokenizer` or `HFTokenizer`) also tokenizer.json,
    tokenizer_config.json (special tokens, `chat_template`, `model_max_length`),
    special_tokens_map.json and chat_template.jinja, as transformers saves them. Special
    ids not given come from the chat template's token texts, then the tokenizer.
    dtype: "float32", "bfloat16" or "float16".

    The directory appears whole (`jaxlearn.interop.atomic`: written into a hidden temp
    directory next to `path`, then renamed into place). `path` may be missing or an empty
    directory; a non-empty one is refused (InteropError, before any conversion) unless
    `overwrite`, and then replaced whole: no file of the old model (an index, shards)
    survives. A kill mid-export leaves the previous directory as it was.

    Raises UnsupportedModelError if the config has features HF
    Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen3-MoE cannot express (the message names the
    config path), ParameterMismatchError for params that do not match the config,
    TokenizerError for a tokenizer larger than the model's vocab.
    """
    from jaxlearn.text.tokenizer_export import (
        export_tokenizer,
        generation_config,
        write_hf_tokenizer_files,
    )

    out = pathlib.Path(path)
    prepare_output(out, kind="dir", overwrite=overwrite)
    arch = architecture_from_config(config, max_position_embeddings=max_position_embeddings)
    top, layers = split_params(config.instantiate(), params)
    tensors = write_tensors(arch, "hf", top, layers)
    tok = None
    if tokenizer is not None:
        with tokenizer_errors_as_interop():
            tok = export_tokenizer(
                tokenizer,
                vocab_size=arch.vocab_size,
                chat_template=chat_template,
                bos_token_id=bos_token_id,
                eos_token_ids=eos_token_ids,
                pad_token_id=pad_token_id,
            )
    gen = generation_config(tok, bos_token_id, tuple(eos_token_ids), pad_token_id)
    arch.bos_token_id = gen.get("bos_token_id")
    eos = gen.get("eos_token_id")
    arch.eos_token_ids = tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)
    state = {k: _cast_for_export(v, dtype) for k, v in tensors.items()}
    hf = hf_config_dict(arch, dtype=dtype)
    if "pad_token_id" in gen:
        hf["pad_token_id"] = gen["pad_token_id"]
    with write_atomically(out, kind="dir", overwrite=overwrite) as tmp:
        _save_safetensors(tmp, state, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tok is not None:
            write_hf_tokenizer_files(
                tmp, tok, chat_template, model_max_length=hf["max_position_embeddings"]
            )
    return out


def export_pretrained(path: str | pathlib.Path, loaded: LoadedModel, **kwargs: Any) -> pathlib.Path:
    """`export_hf` of a `LoadedModel` (e.g. a GGUF file -> an HF directory), carrying its
    tokenizer, chat template, BOS/EOS ids and context length. kwargs: dtype,
    max_shard_bytes, overwrite."""
    arch = loaded.architecture
    return export_hf(
        path,
        loaded.config,
        loaded.params,
        tokenizer=loaded.tokenizer,
        chat_template=loaded.chat_template,
        bos_token_id=loaded.bos_token_id,
        eos_token_ids=loaded.eos_token_ids,
        pad_token_id=loaded.pad_token_id,
        max_position_embeddings=arch.max_position_embeddings if arch is not None else None,
        **kwargs,
    )


def _save_safetensors(
    out: pathlib.Path, state: dict[str, np.ndarray], max_shard_bytes: Optional[int]
) -> None:
    meta = {"format": "pt"}
    total = sum(v.nbytes for v in state.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(state, str(out / "model.safetensors"), metadata=meta)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(state):
        if shards[-1] and size + state[name].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += state[name].nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata=meta)
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def hf_params_to_state(config: Any, params: Nested) -> dict[str, np.ndarray]:
    """The HF state dict (numpy, float32) of a jaxlearn config + params, without writing."""
    arch = architecture_from_config(config)
    top, layers = split_params(config.instantiate(), params)
    return write_tensors(arch, "hf", top, layers)
