"""GGUF export: a jaxlearn `CausalLM` (config + params) and its tokenizer as one llama.cpp
file, written with the `gguf` package's `GGUFWriter`.

    export_gguf("model.gguf", config, params, tokenizer=tok, chat_template=chat, dtype="q8_0")

Architectures as llama.cpp names them: Llama, Mistral and Mixtral are `llama` (Mistral
adds `llama.attention.sliding_window`, Mixtral `llama.expert_count` /
`expert_used_count` and stacked `ffn_*_exps` tensors), Qwen2 is `qwen2`, Phi-3 `phi3`
(fused `attn_qkv` / `ffn_up`, LongRoPE as `rope_factors_long/short.weight`), Qwen3 /
Qwen3-MoE `qwen3` / `qwen3moe`, Gemma 2 / 3 `gemma2` / `gemma3` (norms as `1 + scale`;
refusing what llama.cpp would derive differently: layer pattern, query scale, local
RoPE). The family (`jaxlearn.families.registry`) names the architecture and writes the
keys only it has (`Family.gguf_name`, `write_gguf_keys`). Tensors come
from `gguf_params_to_tensors` (llama.cpp names and layout, q/k rows permuted for `llama`).
Llama-3 RoPE scaling becomes the `rope_freqs.weight` divisors llama.cpp reads; linear
scaling `rope.scaling.type/factor`, YaRN also `original_context_length` and
`yarn_beta_fast/slow`; dynamic NTK raises `UnsupportedModelError`.

dtype: "f32", "f16", "bf16" or "q8_0" for the matrices (embeddings, projections, experts,
output); norms, biases, the MoE router (`ffn_gate_inp`) and `rope_freqs` stay F32, as
llama.cpp's converter keeps them. q8_0 rows whose length is not a multiple of 32 are
written F16 (llama.cpp's fallback).
"""

from __future__ import annotations

import pathlib
from typing import Any, Iterable, Optional

import numpy as np

from jaxlearn.families.arch import Architecture, architecture_from_config
from jaxlearn.families.registry import family
from jaxlearn.interop.atomic import prepare_output, write_atomically
from jaxlearn.interop.errors import (
    InteropError,
    UnsupportedModelError,
    tokenizer_errors_as_interop,
)
from jaxlearn.interop.gguf import _require_gguf, gguf_params_to_tensors
from jaxlearn.text.chat import ChatTemplate
from jaxlearn.text.tokenizer_export import (
    ExportTokenizer,
    export_tokenizer,
    gguf_tokenizer_metadata,
)

DTYPES = ("f32", "f16", "bf16", "q8_0")
_KEEP_F32 = ("_norm.weight", ".bias", "ffn_gate_inp.weight", "rope_freqs.weight",
             "rope_factors_long.weight", "rope_factors_short.weight")  # fmt: skip


def _arch_name(arch: Architecture) -> str:
    """llama.cpp's `general.architecture` for `arch` (raises for what GGUF cannot hold)."""
    if not all(r.gguf for r in family(arch).rows if r.when != "untied"):
        raise UnsupportedModelError(f"cannot export to GGUF: {arch.family} has no GGUF names")
    return family(arch).gguf_name(arch)


def _rope_tensors(arch: Architecture) -> dict[str, np.ndarray]:
    """The RoPE tensors llama.cpp reads: Llama-3's `rope_freqs.weight`, LongRoPE's
    `rope_factors_long/short.weight` (per-frequency divisors, F32)."""
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type") == "longrope":
        return {f"rope_factors_{k}.weight": np.asarray(scaling[f"{k}_factor"], np.float32)
                for k in ("long", "short")}  # fmt: skip
    freqs = _rope_freqs(arch)
    return {} if freqs is None else {"rope_freqs.weight": freqs}


def _rope_scaling_keys(w: Any, arch: Architecture) -> None:
    """`{arch}.rope.scaling.*` of linear, YaRN (type, factor, original length, betas) and
    LongRoPE (original length, attention factor); dynamic NTK and YaRN with an explicit
    attention factor, mscale or without truncation have no llama.cpp form."""
    from jaxlearn.layers import scaling_config

    g, scaling = _require_gguf(), dict(arch.rope_scaling or {})
    kind = scaling.get("rope_type")
    odd = [k for k in ("attention_factor", "mscale", "mscale_all_dim") if k in scaling]
    if kind == "dynamic" or (kind == "yarn" and (odd or not scaling["truncate"])):
        raise UnsupportedModelError(
            f"cannot export to GGUF: llama.cpp has no {kind} RoPE scaling with {odd or scaling}"
        )
    if kind in ("linear", "yarn"):
        w.add_rope_scaling_type(g.RopeScalingType[kind.upper()])
        w.add_rope_scaling_factor(float(scaling["factor"]))
    if kind == "yarn":
        w.add_rope_scaling_yarn_beta_fast(float(scaling["beta_fast"]))
        w.add_rope_scaling_yarn_beta_slow(float(scaling["beta_slow"]))
    if kind in ("llama3", "yarn", "longrope"):
        w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    if kind == "longrope":
        factor = scaling_config(scaling).instantiate().attention_factor()
        w.add_rope_scaling_attn_factors(float(factor))


def _rope_freqs(arch: Architecture) -> Optional[np.ndarray]:
    """llama.cpp's `rope_freqs.weight` (per-frequency divisors [head_dim / 2]) for Llama-3
    scaling, computed with jaxlearn's own `Llama3FrequencyScaling`; None otherwise."""
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type") != "llama3":
        return None
    from jaxlearn.layers import Llama3FrequencyScaling

    fields = {k: v for k, v in scaling.items() if k != "rope_type"}
    d = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    scaled = Llama3FrequencyScaling.default_config().set(**fields).instantiate()(inv)
    return np.asarray(inv / np.asarray(scaled, np.float64), np.float32)


def _write_architecture(w: Any, arch: Architecture, context_length: int) -> None:
    w.add_context_length(int(context_length))
    w.add_embedding_length(arch.dim)
    w.add_block_count(arch.num_layers)
    w.add_feed_forward_length(arch.ffn_dim)
    w.add_head_count(arch.num_heads)
    w.add_head_count_kv(arch.num_kv_heads)
    w.add_key_length(arch.head_dim)
    w.add_value_length(arch.head_dim)
    rotary = int(arch.head_dim * arch.rotary_fraction)
    w.add_rope_dimension_count(rotary - rotary % 2)
    w.add_rope_freq_base(float(arch.rope_theta))
    w.add_layer_norm_rms_eps(float(arch.norm_eps))
    w.add_vocab_size(arch.vocab_size)
    _rope_scaling_keys(w, arch)
    family(arch).write_gguf_keys(w, arch)  # windows, experts, soft caps, ...


def _write_tokenizer(
    w: Any, tok: ExportTokenizer, chat_template: Optional[ChatTemplate], vocab_size: int
) -> None:
    with tokenizer_errors_as_interop():
        meta = gguf_tokenizer_metadata(tok, vocab_size=vocab_size)
    w.add_tokenizer_model(meta["model"])
    if "pre" in meta:
        w.add_tokenizer_pre(meta["pre"])
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["token_type"])
    if "merges" in meta:
        w.add_token_merges(meta["merges"])
    if "scores" in meta:
        w.add_token_scores(meta["scores"])
        w.add_add_space_prefix(bool(meta["add_space_prefix"]))
        if meta["unk"] is not None:
            w.add_unk_token_id(meta["unk"])
    if tok.bos is not None:
        w.add_bos_token_id(int(tok.bos))
    # llama.cpp holds one EOS; further end-of-generation ids go to EOT and EOM.
    for add, i in zip((w.add_eos_token_id, w.add_eot_token_id, w.add_eom_token_id), tok.eos):
        add(int(i))
    if tok.pad is not None:
        w.add_pad_token_id(int(tok.pad))
    w.add_add_bos_token(bool(tok.add_bos and tok.bos is not None))
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template.source)


def _tensor_type(name: str, value: np.ndarray, dtype: str) -> str:
    """The GGML type name `name` is stored as under `dtype`."""
    if value.ndim < 2 or name.endswith(_KEEP_F32) or dtype == "f32":
        return "F32"
    if dtype == "q8_0":
        block = _require_gguf().GGML_QUANT_SIZES[_require_gguf().GGMLQuantizationType.Q8_0][0]
        return "Q8_0" if value.shape[-1] % block == 0 else "F16"
    return dtype.upper()


def _add_tensor(w: Any, name: str, value: np.ndarray, qtype: str) -> None:
    g = _require_gguf()
    value = np.ascontiguousarray(value, np.float32)
    if qtype == "F32":
        w.add_tensor(name, value)
    elif qtype == "F16":
        w.add_tensor(name, value.astype(np.float16))
    else:
        kind = g.GGMLQuantizationType[qtype]
        w.add_tensor(name, g.quants.quantize(value, kind), raw_dtype=kind)


_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}


def export_gguf(
    path: str | pathlib.Path,
    config: Any,
    params: dict[str, Any],
    *,
    tokenizer: Any,
    chat_template: Optional[ChatTemplate] = None,
    dtype: str = "f32",
    name: str = "jaxlearn-model",
    bos_token_id: Optional[int] = None,
    eos_token_ids: Iterable[int] = (),
    pad_token_id: Optional[int] = None,
    context_length: Optional[int] = None,
    overwrite: bool = False,
) -> dict[str, int]:
    """Writes a GGUF file of a jaxlearn `CausalLM` with its tokenizer and chat template.

    tokenizer: a `tokenizers.Tokenizer`, or jaxlearn's `ByteTokenizer` / `HFTokenizer`
    (see `tokenizer_export.export_tokenizer` for how special ids are chosen).
    context_length: `{arch}.context_length` (default: the config's, else 4096).
    Returns {GGML type name: number of tensors}. `path` is checked first: a directory is
    refused, and so is a non-empty file unless `overwrite`; then everything else is
    checked before anything is written. The file appears only once complete
    (`jaxlearn.interop.atomic`: written to a hidden temp next to `path`, then renamed over
    it); a kill mid-export leaves the previous file as it was.
    Raises InteropError for such a `path` or an unknown dtype, ParameterMismatchError for
    params that do not match the config, UnsupportedModelError for configs GGUF cannot
    express and TokenizerError for a tokenizer larger than the model's vocab.
    """
    g = _require_gguf()
    prepare_output(path, kind="file", overwrite=overwrite)
    if dtype not in DTYPES:
        raise InteropError(f"export_gguf: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    arch = architecture_from_config(config)
    arch_name = _arch_name(arch)
    tensors = gguf_params_to_tensors(config, params)
    tensors.update(_rope_tensors(arch))
    with tokenizer_errors_as_interop():
        tok = export_tokenizer(
            tokenizer,
            vocab_size=arch.vocab_size,
            chat_template=chat_template,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            pad_token_id=pad_token_id,
        )
    types = {n: _tensor_type(n, v, dtype) for n, v in tensors.items()}
    with write_atomically(path, kind="file", overwrite=overwrite) as tmp:
        w = g.GGUFWriter(str(tmp), arch=arch_name)
        context = context_length or arch.max_position_embeddings or 4096
        try:
            w.add_name(name)
            w.add_file_type(int(g.LlamaFileType[_FILE_TYPES[dtype]]))
            w.add_quantization_version(g.GGML_QUANT_VERSION)
            _write_architecture(w, arch, context)
            _write_tokenizer(w, tok, chat_template, arch.vocab_size)
            for n, value in tensors.items():
                _add_tensor(w, n, value, types[n])
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    return counts
