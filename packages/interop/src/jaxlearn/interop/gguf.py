"""GGUF (llama.cpp) checkpoints: metadata, (de)quantised tensors, embedded tokenizer.

    loaded = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")      # LoadedModel

The header is read and validated by `jaxlearn.text.gguf_file` (every count, length,
dimension and offset against the file size; the file memory-mapped read-only), then every
size in the metadata by `jaxlearn.families.checks`. Every tensor is dequantised to
float32 with `gguf.quants.dequantize` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the
K-quants and the IQ types that the package implements), then cast to the param dtype.

Architectures: `llama` (Llama 1/2/3, Mistral and Mixtral as llama.cpp converts them, and
SmolLM), `qwen2` (q/k/v biases), `qwen3` (`attn_q_norm` / `attn_k_norm`, explicit
`attention.key_length`), `qwen3moe` (qwen3 attention, every FFN top-k experts of width
`expert_feed_forward_length`), `phi3` (fused `attn_qkv` / `ffn_up`, partial RoPE,
LongRoPE factors as `rope_factors_long/short.weight`), `mistral`-named files with the
llama layout, `gemma2` / `gemma3` (`jaxlearn.families.gemma`: what llama.cpp derives rather
than stores, norms holding `1 + scale`). Each family (`jaxlearn.families.registry`) reads
the metadata only it has. YaRN is `rope.scaling.type` yarn. llama.cpp
permutes the rows of the q/k projections of `llama` files for its interleaved RoPE
(`convert_hf_to_gguf.LlamaModel.permute`); `unpermute_qk` undoes it so the weights match the
HF rotate-half layout that jaxlearn's RoPE uses. qwen2 and qwen3 files are not permuted. Tensor
names, shapes and transforms come from the name table in `jaxlearn.families.names`.

Llama-3.1 RoPE scaling is stored by llama.cpp as a `rope_freqs.weight` tensor of per-
frequency divisors; the loader recovers the `Llama3FrequencyScaling` parameters that
produce exactly those divisors (or raises UnsupportedModelError).

Tokenizer (`tokenizer.ggml.*`): rebuilt by `jaxlearn.text.gguf_vocab` (byte-level BPE for
model `gpt2`, SentencePiece-style BPE for `llama`). The chat template is
`tokenizer.chat_template`, rendered by `jaxlearn.text.chat`.
"""

from __future__ import annotations

import pathlib
from typing import Any, Optional

import numpy as np

from jaxlearn.families.arch import Architecture, architecture_from_config, build_config
from jaxlearn.families.checks import (
    LIMITS,
    check_heads,
    check_layers_present,
    flag,
    integer,
    number,
)
from jaxlearn.families.registry import FAMILIES, GGUF_ARCHITECTURES, family_of_gguf
from jaxlearn.families.tree import assemble_params, layer_layouts, split_params, stack_kind
from jaxlearn.interop.convert import held_features, read_tensors, write_tensors
from jaxlearn.interop.convert import permute_qk as permute_qk  # re-exported
from jaxlearn.interop.convert import unpermute_qk as unpermute_qk  # re-exported
from jaxlearn.interop.errors import (
    InteropError,
    MalformedFileError,
    TokenizerError,
    UnsupportedModelError,
)
from jaxlearn.interop.model import LoadedModel
from jaxlearn.text import errors as text_errors
from jaxlearn.text.chat import ChatTemplate
from jaxlearn.text.gguf_vocab import tokenizer_from_gguf_metadata

_gguf: Any
try:
    import gguf as _gguf
except ImportError:  # pragma: no cover - depends on the environment
    _gguf = None

Nested = dict[str, Any]
# The `general.architecture` values read, each by its family (`Family.gguf_fields`).
ARCHITECTURES = GGUF_ARCHITECTURES


def _require_gguf() -> Any:
    if _gguf is None:
        raise InteropError(
            "reading GGUF files needs the `gguf` package (pip install gguf; it is pinned in "
            "third_party/python/requirements.txt)"
        )
    return _gguf


# ---- metadata -------------------------------------------------------------------------------


class GGUFFile:
    """A GGUF file: `metadata` (key -> value; token arrays included), `tensors` by name
    (`jaxlearn.text.gguf_file.TensorInfo`). The header is validated by `read_header`
    before any tensor is read."""

    def __init__(self, path: str | pathlib.Path):
        _require_gguf()
        from jaxlearn.text.gguf_file import read_header

        self.path = pathlib.Path(path)
        try:
            self.header = read_header(self.path)
        except text_errors.MalformedGGUFError as e:
            raise MalformedFileError(str(e)) from None
        self.metadata: dict[str, Any] = self.header.metadata
        self.tensors = self.header.tensors

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise InteropError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]

    def integer(
        self, key: str, default: Any = None, *, low: int = 1, high: int, required: bool = False
    ) -> Any:
        """Metadata `key` as an int in [low, high] (`default` when absent and not
        `required`); anything else is a MalformedFileError naming the file and key."""
        value = self.require(key) if required else self.get(key)
        if value is None:
            return default
        return integer(value, str(self.path), key, low=low, high=high)

    def tensor(self, name: str) -> np.ndarray:
        """Dequantised float32 tensor in numpy (row-major, HF-like) shape."""
        g = _require_gguf()
        t = self.tensors[name]
        try:
            data = g.quants.dequantize(self.header.data(name), t.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name} has type {t.tensor_type.name}, which gguf "
                f"{getattr(g, '__version__', '')} cannot dequantise ({e})"
            ) from None
        return np.asarray(data, np.float32).reshape(self.shape(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed(self.tensors[name].shape))  # ggml `ne` is innermost-first

    def names(self) -> list[str]:
        """The tensor names (`names.Source`)."""
        return list(self.tensors)

    def read(self, name: str) -> np.ndarray:
        return self.tensor(name)

    def tensor_types(self) -> dict[str, int]:
        """{type name: number of tensors}, e.g. {"Q4_1": 210, "F32": 61}."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return out


def _llama3_scaling_from_factors(
    factors: np.ndarray, theta: float, rotary_dim: int, original: Optional[int]
) -> dict[str, Any]:
    """Finds Llama-3 scaling parameters whose per-frequency divisors equal `factors`."""
    from jaxlearn.layers import Llama3FrequencyScaling

    inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    factor = float(np.max(factors))
    originals = [original] if original else [8192, 4096, 16384, 2048, 32768, 131072]
    for orig in originals:
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0)):
            cand = {
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(orig),
            }
            scaled = Llama3FrequencyScaling.default_config().set(**cand).instantiate()(inv)
            if np.allclose(inv / scaled, factors, rtol=1e-4, atol=1e-5):
                return {"rope_type": "llama3", **cand}
    raise UnsupportedModelError(
        "rope_freqs.weight holds per-frequency RoPE factors that match no Llama-3 scaling "
        "(factor, low/high freq factor, original context) that was tried"
    )


def _sizes(f: GGUFFile, arch: str, partial_rotary: bool = False) -> dict[str, Any]:
    """The validated integer hyperparameters `{arch}.*` of `f` (see `checks.LIMITS`);
    `partial_rotary`: the family has RoPE on part of each head."""
    where = str(f.path)

    def key(name: str, limit: str, default: Any = None, low: int = 1, **kw: Any) -> Any:
        return f.integer(f"{arch}.{name}", default, low=low, high=LIMITS[limit], **kw)

    dim = key("embedding_length", "dim", required=True)
    heads = key("attention.head_count", "num_heads", required=True)
    kv = key("attention.head_count_kv", "num_heads", heads)
    head_dim = check_heads(
        where,
        dim=dim,
        heads=heads,
        kv_heads=kv,
        head_dim=key("attention.key_length", "head_dim"),
        fields=(
            f"{arch}.embedding_length",
            f"{arch}.attention.head_count",
            f"{arch}.attention.head_count_kv",
        ),
    )
    if key("attention.value_length", "head_dim", head_dim) != head_dim:
        raise UnsupportedModelError(f"{f.path}: key_length != value_length")
    rot = key("rope.dimension_count", "head_dim", head_dim)
    if rot > head_dim or (rot != head_dim and not partial_rotary):
        raise UnsupportedModelError(f"{f.path}: partial RoPE ({rot} of {head_dim} dims)")
    tokens = f.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, list):
        raise MalformedFileError(f"{f.path}: tokenizer.ggml.tokens is not an array")
    vocab = key("vocab_size", "vocab_size", len(tokens) if tokens else None)
    if vocab is None and "token_embd.weight" in f.tensors:
        vocab = f.shape("token_embd.weight")[0]
    if vocab is None:
        raise MalformedFileError(f"{f.path}: no {arch}.vocab_size, token list or token_embd")
    if tokens and vocab != len(tokens):
        raise MalformedFileError(
            f"{f.path}: {arch}.vocab_size = {vocab}, but tokenizer.ggml.tokens holds "
            f"{len(tokens)} tokens"
        )
    experts = key("expert_count", "num_experts", 0, low=0)
    used = key("expert_used_count", "num_experts", 2 if experts else 0, low=0)
    if experts and not 1 <= used <= experts:
        raise MalformedFileError(
            f"{f.path}: {arch}.expert_used_count = {used} is not in [1, {arch}.expert_count "
            f"= {experts}]"
        )
    ffn = key("expert_feed_forward_length", "ffn_dim") or key(
        "feed_forward_length", "ffn_dim", required=True
    )
    return dict(
        vocab_size=vocab,
        dim=dim,
        num_layers=key("block_count", "num_layers", required=True),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_dim=ffn,
        num_experts=experts,
        num_experts_per_token=used or 2,
        max_position_embeddings=key("context_length", "positions"),
        rotary_fraction=rot / head_dim,
    )


def _yarn_or_longrope(f: GGUFFile, arch: str, stype: Any, rotary: int) -> dict[str, Any]:
    """The YaRN (`rope.scaling.type` yarn) or LongRoPE (`rope_factors_long/short.weight`)
    scaling of `f`, as `jaxlearn.layers.scaling_dict` writes it."""
    from jaxlearn.layers import scaling_config, scaling_dict

    where, p = str(f.path), f"{arch}.rope.scaling."
    orig = f.integer(p + "original_context_length", high=LIMITS["positions"], required=True)
    if stype == "yarn":
        odd = [k for k in ("attn_factor", "yarn_ext_factor", "yarn_attn_factor",
                           "yarn_log_multiplier") if f.get(p + k) is not None]  # fmt: skip
        if odd:
            raise UnsupportedModelError(f"{f.path}: YaRN with {p}{odd[0]} is not supported")
        out = {"rope_type": "yarn", "original_max_position_embeddings": orig}
        for k, default in (("factor", None), ("yarn_beta_fast", 32.0), ("yarn_beta_slow", 1.0)):
            out[k.removeprefix("yarn_")] = number(f.get(p + k, default), where, p + k)
        return scaling_dict(scaling_config(out))
    factors = {}
    for k in ("long", "short"):
        name = f"rope_factors_{k}.weight"
        if name not in f.tensors or f.tensors[name].n_elements != rotary // 2:
            raise MalformedFileError(f"{f.path}: {name} must hold rotary dims / 2 = "
                                     f"{rotary // 2} factors")  # fmt: skip
        factors[f"{k}_factor"] = [float(v) for v in f.tensor(name).reshape(-1)]
    context = f.integer(f"{arch}.context_length", high=LIMITS["positions"], required=True)
    attention = number(f.get(p + "attn_factor", 1.0), where, p + "attn_factor")
    return scaling_dict(scaling_config({
        "rope_type": "longrope", "original_max_position_embeddings": orig,
        "factor": context / orig, "attention_factor": attention, **factors,
    }))  # fmt: skip


def _rope(
    f: GGUFFile, arch: str, head_dim: int, rotary: int
) -> tuple[float, Optional[dict[str, Any]]]:
    """(theta, HF-style scaling dict or None) of `f`."""
    where = str(f.path)
    theta = number(f.get(f"{arch}.rope.freq_base", 10000.0), where, f"{arch}.rope.freq_base")
    scaling: Optional[dict[str, Any]] = None
    stype = f.get(f"{arch}.rope.scaling.type")
    if stype == "linear":
        factor = f.get(f"{arch}.rope.scaling.factor", 1.0)
        scaling = {"rope_type": "linear", "factor": number(factor, where, "rope.scaling.factor")}
    elif stype == "yarn" or "rope_factors_long.weight" in f.tensors:
        scaling = _yarn_or_longrope(f, arch, stype, rotary)
    elif stype not in (None, "none"):
        raise UnsupportedModelError(f"{f.path}: RoPE scaling type {stype!r} is not supported")
    if "rope_freqs.weight" in f.tensors:
        n = f.tensors["rope_freqs.weight"].n_elements
        if n != head_dim // 2:
            raise MalformedFileError(
                f"{f.path}: tensor rope_freqs.weight has {n} elements, expected head_dim/2 = "
                f"{head_dim // 2}"
            )
        original = f.integer(f"{arch}.rope.scaling.original_context_length", high=2**40)
        scaling = _llama3_scaling_from_factors(
            f.tensor("rope_freqs.weight").reshape(-1), theta, head_dim, original
        )
    return theta, scaling


def _token_id(f: GGUFFile, key: str) -> Optional[int]:
    return f.integer(key, low=0, high=2**63 - 1)


def architecture_from_gguf(f: GGUFFile) -> Architecture:
    """Reads the hyperparameters of a GGUF file (`ARCHITECTURES`: the family that reads
    `general.architecture` gives the family-specific fields); every size is
    checked (MalformedFileError naming the file and key), and every layer `block_count`
    declares must have its tensors in the file, before anything is allocated."""
    arch_name = f.require("general.architecture")
    owner = family_of_gguf(arch_name, str(f.path))
    sizes = _sizes(f, arch_name, owner.partial_rotary)
    rotary = round(sizes["head_dim"] * sizes["rotary_fraction"])
    theta, scaling = _rope(f, arch_name, sizes["head_dim"], rotary)
    eps = f.get(f"{arch_name}.attention.layer_norm_rms_epsilon", 1e-5)
    eos = [_token_id(f, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    fields = owner.gguf_fields(f, arch_name, sizes)  # family, windows, the family's own
    held = held_features(FAMILIES[fields["family"]], "gguf", f.tensors)  # biases, untied
    # llama.cpp renormalises the top-k weights unless the file says otherwise.
    norm_key = f"{arch_name}.expert_weights_norm"
    normalize = flag(f.get(norm_key), str(f.path), norm_key, default=True)
    arch = Architecture(
        norm_eps=number(eps, str(f.path), f"{arch_name}.attention.layer_norm_rms_epsilon"),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings="untied" not in held,
        qkv_bias="qkv_bias" in held,
        output_bias="output_bias" in held,
        mlp_bias="mlp_bias" in held,
        normalize_top_k=normalize,
        bos_token_id=_token_id(f, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
        **fields,
        **sizes,
    )
    check_layers_present(
        arch,
        "gguf",
        f.tensors,
        where=str(f.path),
        field=f"{arch_name}.block_count",
        source="the file",
    )
    return arch


# ---- tensors --------------------------------------------------------------------------------


def load_gguf_params(f: GGUFFile, arch: Architecture, model: Any) -> Nested:
    """Dequantised params of `model` from GGUF file `f` (numpy, spec dtypes), through the
    name table of `arch.family` (which also says whether q/k rows are permuted)."""
    top, layers, names = read_tensors(
        arch,
        "gguf",
        f,
        where=str(f.path),
        layouts=layer_layouts(model),
        stacked=stack_kind(model) == "scan",
    )
    return assemble_params(model, top, layers, source=str(f.path), names=names)


def gguf_params_to_tensors(config: Any, params: Nested) -> dict[str, np.ndarray]:
    """{GGUF tensor name: float32 array} of a jaxlearn config + params in llama.cpp's
    layout (numpy row-major [out, in], q/k rows permuted for `llama` files, stacked expert
    tensors), as a GGUF writer (`gguf.GGUFWriter.add_tensor`) takes them."""
    arch = architecture_from_config(config)
    top, layers = split_params(config.instantiate(), params)
    return write_tensors(arch, "gguf", top, layers)


# ---- tokenizer ------------------------------------------------------------------------------


def tokenizer_from_gguf(f: GGUFFile) -> Any:
    """A `tokenizers.Tokenizer` equivalent to the one embedded in `f` (built by
    `jaxlearn.text.gguf_vocab` from the file's metadata)."""
    try:
        return tokenizer_from_gguf_metadata(f.metadata, source=str(f.path))
    except text_errors.TokenizerError as e:
        raise TokenizerError(str(e)) from None


# ---- entry point ----------------------------------------------------------------------------


def load_gguf(
    path: str | pathlib.Path | GGUFFile,
    *,
    stack: str = "scan",
    dtype: Optional[str] = None,
    param_dtype: Optional[str] = None,
    attention_implementation: str = "auto",
    moe_dropless_method: str = "ragged_dot",
) -> LoadedModel:
    """Loads a GGUF file: hyperparameters, dequantised params, tokenizer, chat template.

    Options as for `load_hf`. `metadata` holds the GGUF key/values without the large token
    arrays, plus "tensor_types" ({type name: count}).
    """
    f = path if isinstance(path, GGUFFile) else GGUFFile(path)
    arch = architecture_from_gguf(f)
    config = build_config(
        arch,
        stack=stack,
        dtype=dtype,
        param_dtype=param_dtype,
        attention_implementation=attention_implementation,
        moe_dropless_method=moe_dropless_method,
    )
    params = load_gguf_params(f, arch, config.instantiate())
    tokenizer = tokenizer_from_gguf(f) if f.get("tokenizer.ggml.tokens") is not None else None
    chat = None
    template = f.get("tokenizer.chat_template")
    tokens = f.get("tokenizer.ggml.tokens") or []

    def text(key: str) -> str:
        i = f.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else ""

    if isinstance(template, str) and template:
        chat = ChatTemplate(
            template,
            bos_token=text("tokenizer.ggml.bos_token_id"),
            eos_token=text("tokenizer.ggml.eos_token_id"),
            origin=f"{f.path}: tokenizer.chat_template",
        )
    meta = {k: v for k, v in f.metadata.items() if not (isinstance(v, list) and len(v) > 64)}
    meta["tensor_types"] = f.tensor_types()
    return LoadedModel(
        config=config,
        params=params,
        tokenizer=tokenizer,
        chat_template=chat,
        eos_token_ids=arch.eos_token_ids,
        bos_token_id=arch.bos_token_id,
        pad_token_id=_token_id(f, "tokenizer.ggml.padding_token_id"),
        architecture=arch,
        format="gguf",
        source=str(f.path),
        metadata=meta,
    )
