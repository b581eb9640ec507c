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
from the name table in `jaxlearn.interop.names`, which import and export both read.
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

from jaxlearn.interop.arch import Architecture, architecture_from_config, build_config
from jaxlearn.interop.convert import read_tensors, write_tensors
from jaxlearn.interop.errors import (
    InteropError,
    TokenizerError,
    UnsupportedModelError,
)
from jaxlearn.interop.model import LoadedModel
from jaxlearn.interop.names import FAMILIES
from jaxlearn.interop.tree import assemble_params, layer_layouts, split_params, stack_kind
from jaxlearn.text import errors as text_errors
from jaxlearn.text import hf_files
from jaxlearn.text.chat import ChatTemplate

Nested = dict[str, Any]
INDEX_FILE = "model.safetensors.index.json"
HF_CLASSES = {name: fam.hf_class for name, fam in FAMILIES.items()}


# ---- config.json -----------------------------------------------------------------------------


def read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InteropError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise InteropError(f"{path}: invalid JSON ({e})") from None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope(hf: dict[str, Any], where: str) -> tuple[float, Optional[dict[str, Any]]]:
    """(theta, scaling dict or None) from transformers 5 `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling: Optional[dict[str, Any]] = dict(params)
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = dict(hf["rope_scaling"]) if hf.get("rope_scaling") else None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling.pop("rope_theta", None)
        scaling.pop("type", None)
        scaling["rope_type"] = rope_type
        if rope_type == "default":
            scaling = None
        elif rope_type not in ("llama3", "linear"):
            raise UnsupportedModelError(
                f"{where}: RoPE scaling {rope_type!r} is not supported (llama3, linear)"
            )
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"{where}: partial_rotary_factor != 1 is not supported")
    return theta, scaling


def architecture_from_hf(hf: dict[str, Any], *, where: str = "config.json") -> Architecture:
    """Reads an HF `config.json` dict (Llama / Mistral / Qwen2 / Qwen3 / Mixtral)."""
    model_type = hf.get("model_type")
    if model_type not in HF_CLASSES:
        archs = hf.get("architectures") or []
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} ({archs}) is not supported; "
            f"supported: {sorted(HF_CLASSES)}"
        )
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {act!r} (only silu/SwiGLU)")
    try:
        dim = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        kv = int(hf.get("num_key_value_heads") or heads)
        layers = int(hf["num_hidden_layers"])
        theta, scaling = _rope(hf, where)
        n_windows: tuple[Optional[int], ...] = ()
        window = hf.get("sliding_window")
        layer_types = hf.get("layer_types")
        if model_type in ("qwen2", "qwen3", "qwen3_moe"):
            if not hf.get("use_sliding_window", False):
                window = None
            if layer_types is None and model_type != "qwen3_moe":
                k = int(hf.get("max_window_layers", layers))
                layer_types = [
                    "sliding_attention" if window is not None and i >= k else "full_attention"
                    for i in range(layers)
                ]
        if layer_types is not None and model_type in ("qwen2", "qwen3", "llama"):
            n_windows = tuple(
                int(window) if t == "sliding_attention" and window is not None else None
                for t in layer_types
            )
        elif model_type in ("mistral", "mixtral", "qwen3_moe") and window is not None:
            n_windows = (int(window),) * layers
        bias = bool(hf.get("attention_bias", False))
        qwen_moe = model_type == "qwen3_moe"
        moe = qwen_moe or model_type == "mixtral"
        return Architecture(
            family=model_type,
            vocab_size=int(hf["vocab_size"]),
            dim=dim,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=int(hf.get("head_dim") or dim // heads),
            ffn_dim=int(hf["moe_intermediate_size" if qwen_moe else "intermediate_size"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else bias,
            output_bias=bias if model_type in ("llama", "qwen3", "qwen3_moe") else False,
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
            sliding_windows=n_windows,
            num_experts=int(hf.get("num_local_experts", hf.get("num_experts", 0))) if moe else 0,
            num_experts_per_token=int(hf.get("num_experts_per_tok", 2)),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
            max_position_embeddings=hf.get("max_position_embeddings"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_ids(hf.get("eos_token_id")),
            **(_qwen3_moe_layers(hf, layers) if qwen_moe else {}),
        )
    except KeyError as e:
        raise InteropError(f"{where}: missing field {e.args[0]!r}") from None


def _qwen3_moe_layers(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """The dense-layer and routing fields of a Qwen3-MoE config.json: dense FFNs
    (`intermediate_size`) in `mlp_only_layers` and in the layers `decoder_sparse_step`
    skips (experts have `moe_intermediate_size`), `norm_topk_prob`."""
    experts = int(hf.get("num_local_experts", hf.get("num_experts", 0)))
    step = int(hf.get("decoder_sparse_step", 1))
    only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    dense = tuple(
        i for i in range(layers) if i in only or not (experts > 0 and (i + 1) % step == 0)
    )
    return dict(
        dense_layers=dense,
        dense_ffn_dim=int(hf["intermediate_size"]) if dense else 0,
        normalize_top_k=bool(hf.get("norm_topk_prob", False)),
    )


def hf_config_dict(arch: Architecture, *, dtype: str = "float32") -> dict[str, Any]:
    """An HF `config.json` dict for `arch` (the classic `rope_theta`/`rope_scaling` keys,
    which transformers 4 and 5 both read)."""
    scaling = None
    if arch.rope_scaling is not None:
        scaling = {k: v for k, v in arch.rope_scaling.items()}
    out: dict[str, Any] = {
        "architectures": [HF_CLASSES[arch.family]],
        "model_type": arch.family,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.dim,
        "intermediate_size": arch.ffn_dim,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": arch.max_position_embeddings or 4096,
        "rms_norm_eps": arch.norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": arch.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if arch.bos_token_id is not None:
        out["bos_token_id"] = arch.bos_token_id
    if arch.eos_token_ids:
        eos = list(arch.eos_token_ids)
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    windows = arch.sliding_windows
    if arch.family == "llama":
        out["attention_bias"] = arch.qkv_bias
        out["mlp_bias"] = arch.mlp_bias
    elif arch.family == "mistral":
        out["sliding_window"] = windows[0] if windows else None
    elif arch.family in ("qwen2", "qwen3"):
        sliding = [i for i, w in enumerate(windows) if w is not None]
        out["use_sliding_window"] = bool(sliding)
        out["sliding_window"] = windows[sliding[0]] if sliding else None
        out["max_window_layers"] = sliding[0] if sliding else arch.num_layers
        if sliding:
            out["layer_types"] = [
                "sliding_attention" if w is not None else "full_attention" for w in windows
            ]
        if arch.family == "qwen3":
            out["attention_bias"] = arch.qkv_bias
    elif arch.family == "qwen3_moe":  # one window for every layer, or none
        out.update(
            use_sliding_window=bool(windows),
            sliding_window=windows[0] if windows else None,
            attention_bias=arch.qkv_bias,
            intermediate_size=arch.dense_ffn_dim or arch.ffn_dim,
            moe_intermediate_size=arch.ffn_dim,
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.num_experts_per_token,
            norm_topk_prob=arch.normalize_top_k,
            decoder_sparse_step=1,
            mlp_only_layers=list(arch.dense_layers),
            router_aux_loss_coef=arch.router_aux_loss_coef,
            output_router_logits=False,
        )
    elif arch.family == "mixtral":
        out["sliding_window"] = windows[0] if windows else None
        out["num_local_experts"] = arch.num_experts
        out["num_experts_per_tok"] = arch.num_experts_per_token
        out["router_aux_loss_coef"] = arch.router_aux_loss_coef
        out["output_router_logits"] = False
        out["router_jitter_noise"] = 0.0
    return out


# ---- safetensors ----------------------------------------------------------------------------


class SafetensorsReader:
    """Name -> numpy tensor over the *.safetensors files of a directory (sharded via
    `model.safetensors.index.json`, or every *.safetensors file)."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        index = directory / INDEX_FILE
        self._where: dict[str, pathlib.Path] = {}
        self._handles: dict[pathlib.Path, Any] = {}
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise InteropError(f"{index}: no 'weight_map' object")
            for name, file in weight_map.items():
                path = directory / file
                if not path.exists():
                    raise InteropError(f"{index}: shard {file!r} (for {name}) is missing")
                self._where[name] = path
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise InteropError(f"{directory}: no *.safetensors files (and no {INDEX_FILE})")
            for path in files:
                for name in self._open(path).keys():
                    self._where[name] = path

    def _open(self, path: pathlib.Path) -> Any:
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="numpy")
            except Exception as e:  # safetensors raises its own error types
                raise InteropError(f"{path}: not a readable safetensors file ({e})") from None
        return self._handles[path]

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._where[name]).get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        return np.asarray(self._open(self._where[name]).get_tensor(name))


def load_hf_params(directory: str | pathlib.Path, arch: Architecture, model: Any) -> Nested:
    """Reads the safetensors of `directory` into `model`'s params (numpy, spec dtypes),
    through the name table of `arch.family`.

    Raises ParameterMismatchError listing every missing, unexpected or mis-shaped tensor
    (checked from the file headers before any tensor is read).
    """
    directory = pathlib.Path(directory)
    top, layers, names = read_tensors(
        arch,
        "hf",
        SafetensorsReader(directory),
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
    attention_implementation: str = "einsum",
    moe_dropless_method: str = "ragged_dot",
) -> LoadedModel:
    """Loads an HF model directory (config.json + safetensors [+ tokenizer files]).

    stack / dtype / param_dtype / attention_implementation / moe_dropless_method: see
    `build_config`. Params are numpy arrays in `param_dtype` (default float32).
    """
    directory = pathlib.Path(path)
    if not directory.is_dir():
        raise InteropError(f"{directory}: not a directory")
    hf = read_json(directory / "config.json")
    arch = architecture_from_hf(hf, where=str(directory / "config.json"))
    config = build_config(
        arch,
        stack=stack,
        dtype=dtype,
        param_dtype=param_dtype,
        attention_implementation=attention_implementation,
        moe_dropless_method=moe_dropless_method,
    )
    model = config.instantiate()
    params = load_hf_params(directory, arch, model)
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
        metadata=hf,
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
    max_position_embeddings: Optional[int] = None,
    dtype: str = "float32",
    max_shard_bytes: Optional[int] = None,
) -> pathlib.Path:
    """Writes an HF model directory for a jaxlearn `CausalLM` (config + params): config.json,
    model.safetensors (or shards + index when larger than `max_shard_bytes`),
    generation_config.json, and tokenizer.json / tokenizer_config.json when a tokenizer is
    given. dtype: "float32", "bfloat16" or "float16".

    Raises UnsupportedModelError if the config has features HF
    Llama/Mistral/Qwen2/Qwen3/Mixtral cannot express (the message names the config path).
    """
    out = pathlib.Path(path)
    arch = architecture_from_config(config, max_position_embeddings=max_position_embeddings)
    arch.bos_token_id = bos_token_id
    arch.eos_token_ids = tuple(int(i) for i in eos_token_ids)
    top, layers = split_params(config.instantiate(), params)
    tensors = write_tensors(arch, "hf", top, layers)
    state = {k: _cast_for_export(v, dtype) for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    _save_safetensors(out, state, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf_config_dict(arch, dtype=dtype), indent=2) + "\n")
    gen: dict[str, Any] = {}
    if bos_token_id is not None:
        gen["bos_token_id"] = bos_token_id
    if arch.eos_token_ids:
        gen["eos_token_id"] = list(arch.eos_token_ids)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(str(out / "tokenizer.json"))
        tc: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if chat_template is not None:
            tc["chat_template"] = chat_template.source
            tc["bos_token"] = chat_template.bos_token or None
            tc["eos_token"] = chat_template.eos_token or None
        (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    return out


def export_pretrained(path: str | pathlib.Path, loaded: LoadedModel, **kwargs: Any) -> pathlib.Path:
    """`export_hf` of a `LoadedModel` (e.g. a GGUF file -> an HF directory), carrying its
    tokenizer, chat template, BOS/EOS ids and context length. kwargs: dtype,
    max_shard_bytes."""
    arch = loaded.architecture
    return export_hf(
        path,
        loaded.config,
        loaded.params,
        tokenizer=loaded.tokenizer,
        chat_template=loaded.chat_template,
        bos_token_id=loaded.bos_token_id,
        eos_token_ids=loaded.eos_token_ids,
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
