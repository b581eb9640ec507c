"""Gemma 2 and Gemma 3 (text): `gemma_config` decoders (embeddings scaled by sqrt(dim),
norms `* (1 + scale)` before and after attention and FFN, GeGLU, local sliding-window
and global layers, query scale `query_pre_attn_scalar ** -0.5`); Gemma 2 soft-caps
attention and final logits, Gemma 3 normalises q/k per head and gives local layers
their own RoPE theta. HF `Gemma2ForCausalLM` (model type `gemma2`) and
`Gemma3ForCausalLM` (`gemma3_text`; the multimodal `gemma3`,
`Gemma3ForConditionalGeneration`, is read as its text model: `multimodal_text_config`).
Local layers are those with a sliding window.

GGUF: llama.cpp's `gemma2` / `gemma3` (`llama-model.cpp`) do not store what they can
derive, so import derives it the same way and export refuses what they would derive
differently:

- local layers: gemma2 every other layer from layer 0 (`set_swa_pattern(2)`), gemma3
  five of every six (`set_swa_pattern(6)`: layer i is local when i % 6 < 5), all with
  `{arch}.attention.sliding_window` (required by gemma2; a gemma3 file without it has
  only global layers);
- query scale: `attention.key_length ** -0.5`, except for the 27B models (gemma2 with
  46 layers, gemma3 with 62), which use `(embedding_length / head_count) ** -0.5`;
  jaxlearn reads it as `query_pre_attn_scalar`;
- RoPE: `rope.freq_base` for the global layers (gemma2: every layer), 10000 unscaled for
  gemma3's local layers; a linear `rope.scaling` applies to the global layers only;
- soft caps: gemma2 always caps attention logits and final logits
  (`attn_logit_softcapping`, default 50; `final_logit_softcapping`, default 30); gemma3
  caps the final logits only when `final_logit_softcapping` is present;
- every norm weight holds `1 + scale` (`names.Name.shift`); gemma2 has no `output.weight`
  (the embedding is the head), gemma3 may.
"""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.families.arch import Architecture, layer_configs
from jaxlearn.families.checks import LIMITS, flag, number, optional_integer
from jaxlearn.families.errors import MalformedFileError, UnsupportedModelError
from jaxlearn.families.family import Family, read_flag
from jaxlearn.families.names import GEMMA2_ROWS, GEMMA3_ROWS, Row
from jaxlearn.layers import (
    Attention,
    FeedForward,
    LinearFrequencyScaling,
    RMSNorm,
    TransformerLayer,
    gemma_config,
)

_TYPES = ("sliding_attention", "full_attention")
_LOCAL_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3
# Gemma3TextConfig's defaults, which a multimodal config's `text_config` may leave out.
_GEMMA3_TEXT = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    rope_theta=1e6, max_position_embeddings=131072, tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh",
)  # fmt: skip


def multimodal_text_config(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The `gemma3_text` config.json of a multimodal `gemma3` one: its `text_config` over
    Gemma3TextConfig's defaults, with the top level's special ids where the text config
    has none. The vision tower is not part of the result (nor of the loaded model)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise MalformedFileError(f"{where}: model_type 'gemma3' without a text_config object")
    out = {**_GEMMA3_TEXT, **text, "model_type": "gemma3_text"}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if k in hf and k not in text:
            out[k] = hf[k]
    return out



class Gemma2(Family):
    """Gemma 2 (see the module docstring). Class attributes: HF class defaults of fields a
    config.json may leave out (`hf_defaults`: query_pre_attn_scalar,
    attn_logit_softcapping, final_logit_softcapping, sliding_window,
    sliding_window_pattern; `hf_local_theta`: rope_local_base_freq), llama.cpp's
    `swa_pattern` (`set_swa_pattern`), layer count of its 27B model, and default soft caps
    of its files (`gguf_caps`: attention, final)."""

    name = "gemma2"
    hf_class = "Gemma2ForCausalLM"
    gguf_architecture = "gemma2"
    gguf_reads: tuple[str, ...] = ("gemma2",)
    rows: tuple[Row, ...] = GEMMA2_ROWS
    hf_activation = "gelu_pytorch_tanh"
    hf_defaults: tuple[Any, ...] = (256, 50.0, 30.0, 4096, 2)
    hf_local_theta: Optional[float] = None
    attention_soft_cap = True  # HF's attention applies attn_logit_softcapping
    swa_pattern = 2
    layers_27b = 46
    gguf_caps: tuple[Optional[float], Optional[float]] = (50.0, 30.0)

    # ---- CausalLM config

    def build_config(self, arch: Architecture, *, stack: str = "scan", **kwargs: Any) -> Any:
        """`gemma_config` for `arch` (kwargs: dtype, attention_implementation, name);
        linear RoPE scaling applies to the global layers (Gemma 3 4B+)."""
        kwargs.pop("moe_dropless_method", None)
        s = arch.rope_scaling
        if s is not None and s.get("rope_type") != "linear":
            raise UnsupportedModelError(f"{arch.family}: RoPE scaling {s.get('rope_type')!r}")
        windows = arch.sliding_windows or (None,) * arch.num_layers
        scaling = None if s is None else LinearFrequencyScaling.default_config().set(
            factor=s["factor"])
        return gemma_config(
            arch.vocab_size, arch.dim, arch.num_layers, arch.num_heads, arch.num_kv_heads,
            arch.ffn_dim, head_dim=arch.head_dim, stack=stack,
            layer_pattern=["local" if w else "global" for w in windows],
            sliding_window=next((w for w in windows if w), None),
            query_pre_attn_scalar=arch.query_pre_attn_scalar, rope_theta=arch.rope_theta,
            rope_local_theta=arch.local_rope_theta, global_rope_scaling=scaling,
            attn_logit_soft_cap=arch.attn_logit_soft_cap,
            final_logit_soft_cap=arch.final_logit_soft_cap, qk_norm=self.qk_norm,
            norm_eps=arch.norm_eps, attention_bias=arch.qkv_bias,
            tie_embeddings=arch.tie_embeddings, family=self.name, **kwargs,
        )  # fmt: skip

    def architecture_from_config(self, cfg: Any) -> Architecture:
        return Architecture(**gemma_architecture(self, cfg))  # (defined below)

    # ---- HF config.json

    def hf_text_config(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        return hf

    def hf_act(self, hf: dict[str, Any]) -> Any:
        return hf.get("hidden_activation", hf.get("hidden_act"))

    def hf_fields(self, hf: dict[str, Any], where: str, layers: int) -> dict[str, Any]:
        """The Gemma `Architecture` fields of an HF config.json (checked)."""
        if flag(hf.get("use_bidirectional_attention"), where, "use_bidirectional_attention"):
            raise UnsupportedModelError(f"{where}: use_bidirectional_attention is not supported")
        keys = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
        q, attn, final = (hf.get(k, d) for k, d in zip(keys, self.hf_defaults))
        q, attn, final = (None if v is None else number(v, where, k)
                          for k, v in zip(keys, (q, attn, final)))  # fmt: skip
        window = optional_integer(hf.get("sliding_window", self.hf_defaults[3]), where,
                                  "sliding_window", high=2**40)  # fmt: skip
        every = hf.get("sliding_window_pattern", self.hf_defaults[4])
        every = optional_integer(every, where, "sliding_window_pattern", high=2**20) or 1
        types = hf.get("layer_types") or [_TYPES[(i + 1) % every == 0] for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers or not set(types) <= set(_TYPES):
            raise MalformedFileError(f"{where}: layer_types is not a list of num_hidden_layers "
                                     f"= {layers} entries from {_TYPES}")  # fmt: skip
        local = hf.get("rope_local_base_freq", self.hf_local_theta)
        params = (hf.get("rope_parameters") or {}).get("sliding_attention")
        if isinstance(params, dict):
            if params.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"{where}: RoPE scaling of sliding_attention layers")
            local = params.get("rope_theta", local)
        bias = read_flag(hf, where, "attention_bias")
        local = None if local is None else number(local, where, "rope_local_base_freq")
        return dict(
            qkv_bias=bias, output_bias=bias, mlp_bias=False,
            sliding_windows=tuple(window if t == _TYPES[0] else None for t in types),
            query_pre_attn_scalar=q, final_logit_soft_cap=final, local_rope_theta=local,
            # transformers' Gemma 3 attention ignores attn_logit_softcapping.
            attn_logit_soft_cap=attn if self.attention_soft_cap else None,
        )  # fmt: skip

    def hf_dict(self, arch: Any, out: dict[str, Any]) -> None:
        """The Gemma fields of an HF config.json for `arch` (classic RoPE keys)."""
        del out["hidden_act"]
        windows = arch.sliding_windows or (None,) * arch.num_layers
        q = arch.query_pre_attn_scalar or arch.head_dim
        out.update(
            hidden_activation="gelu_pytorch_tanh", attention_bias=arch.qkv_bias,
            query_pre_attn_scalar=int(q) if float(q).is_integer() else q,  # HF: an int
            attn_logit_softcapping=arch.attn_logit_soft_cap,
            final_logit_softcapping=arch.final_logit_soft_cap,
            sliding_window=next((w for w in windows if w), None),
            layer_types=[_TYPES[w is None] for w in windows], use_bidirectional_attention=False,
        )  # fmt: skip
        if self.hf_local_theta is not None:
            out["rope_local_base_freq"] = arch.local_rope_theta or arch.rope_theta

    # ---- GGUF metadata

    def _local(self, layers: int, window: Optional[int]) -> tuple[Optional[int], ...]:
        every = self.swa_pattern
        return tuple(window if i % every < every - 1 else None for i in range(layers))

    def _query_scalar(self, layers: int, dim: int, heads: int, head_dim: int) -> int:
        """The `query_pre_attn_scalar` whose inverse square root llama.cpp scales q by."""
        return dim // heads if layers == self.layers_27b else head_dim

    def gguf_fields(self, f: Any, arch_name: str, sizes: dict[str, Any]) -> dict[str, Any]:
        """The Gemma `Architecture` fields of GGUF file `f`, checked."""
        where = str(f.path)
        key = f"{arch_name}.attention.sliding_window"
        window = f.integer(key, high=LIMITS["window"], required=self.gguf_caps[0] is not None)
        if sizes["rotary_fraction"] != 1.0:
            raise UnsupportedModelError(f"{where}: {arch_name} has full RoPE")
        caps = []
        for name, default in zip(("attn", "final"), self.gguf_caps):
            k = f"{arch_name}.{name}_logit_softcapping"
            value = f.get(k, default)
            caps.append(None if value is None or (name == "attn" and not self.attention_soft_cap)
                        else number(value, where, k))  # fmt: skip
        layers = sizes["num_layers"]
        return dict(
            family=self.name,
            sliding_windows=self._local(layers, window) if window is not None else (),
            query_pre_attn_scalar=float(self._query_scalar(
                layers, sizes["dim"], sizes["num_heads"], sizes["head_dim"])),
            attn_logit_soft_cap=caps[0],
            final_logit_soft_cap=caps[1],
            local_rope_theta=_LOCAL_THETA if self.hf_local_theta is not None else None,
        )  # fmt: skip

    def _refuse(self, why: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"cannot export {self.name} to GGUF: {why}")

    def gguf_name(self, arch: Architecture) -> str:
        """`general.architecture` for `arch`, after checking that llama.cpp derives the
        same model from what the file can hold (UnsupportedModelError saying what not)."""
        name = str(self.gguf_architecture)
        windows = arch.sliding_windows
        window = next((w for w in windows if w is not None), None)
        if windows and windows != self._local(arch.num_layers, window):
            kinds = ["local" if w else "global" for w in windows]
            raise self._refuse(f"llama.cpp's {name} has local layers i % {self.swa_pattern} "
                               f"< {self.swa_pattern - 1}, not {kinds}")  # fmt: skip
        q = self._query_scalar(arch.num_layers, arch.dim, arch.num_heads, arch.head_dim)
        if arch.query_pre_attn_scalar is not None and arch.query_pre_attn_scalar != q:
            raise self._refuse(f"query_pre_attn_scalar {arch.query_pre_attn_scalar:g}: "
                               f"llama.cpp scales queries by {q} ** -0.5 for "
                               f"{arch.num_layers} layers of head_dim {arch.head_dim}")  # fmt: skip
        if arch.qkv_bias or arch.output_bias:
            raise self._refuse("llama.cpp's Gemma attention has no biases")
        self.check_gguf(arch, window)
        return name

    def check_gguf(self, arch: Architecture, window: Optional[int]) -> None:
        """What llama.cpp's gemma2 derives: a window, tied head, soft caps, one RoPE."""
        if window is None:
            raise self._refuse("llama.cpp's gemma2 needs a sliding window")
        if not arch.tie_embeddings:
            raise self._refuse("llama.cpp's gemma2 has no separate output head")
        if arch.attn_logit_soft_cap is None or arch.final_logit_soft_cap is None:
            raise self._refuse("llama.cpp's gemma2 always soft-caps attention and final logits")
        if arch.local_rope_theta not in (None, arch.rope_theta) or arch.rope_scaling:
            raise self._refuse("llama.cpp's gemma2 has one unscaled RoPE")

    def write_gguf_keys(self, w: Any, arch: Architecture) -> None:
        """The local window and the soft caps."""
        window = next((x for x in arch.sliding_windows if x is not None), None)
        if window is not None:
            w.add_sliding_window(int(window))
        if arch.attn_logit_soft_cap is not None:
            w.add_attn_logit_softcapping(float(arch.attn_logit_soft_cap))
        if arch.final_logit_soft_cap is not None:
            w.add_final_logit_softcapping(float(arch.final_logit_soft_cap))


class Gemma3(Gemma2):
    name = "gemma3_text"
    hf_class = "Gemma3ForCausalLM"
    hf_names: tuple[str, ...] = ("gemma3", "Gemma3ForConditionalGeneration")
    gguf_architecture = "gemma3"
    gguf_reads: tuple[str, ...] = ("gemma3",)
    rows: tuple[Row, ...] = GEMMA3_ROWS
    qk_norm = True
    hf_defaults = (256, None, None, 4096, 6)
    hf_local_theta = 10000.0
    attention_soft_cap = False
    swa_pattern = 6
    layers_27b = 62
    gguf_caps = (None, None)

    def hf_text_config(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        """A multimodal `gemma3` config.json: its text model (`multimodal_text_config`)."""
        multimodal = hf.get("model_type") in self.hf_names
        return multimodal_text_config(hf, where) if multimodal else hf

    def check_gguf(self, arch: Architecture, window: Optional[int]) -> None:
        """llama.cpp's gemma3 gives local layers RoPE theta 10000."""
        if arch.sliding_windows and arch.local_rope_theta not in (None, _LOCAL_THETA):
            raise self._refuse(f"local RoPE theta {arch.local_rope_theta:g}; llama.cpp's "
                               f"gemma3 uses {_LOCAL_THETA:g}")  # fmt: skip


def _bad(path: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"cannot export {path}: {why}")


def _eps(path: str, norm: Any) -> float:
    if getattr(norm, "klass", None) is not RMSNorm or norm.scale_offset != 1.0:
        raise _bad(path, "Gemma norms are RMSNorm * (1 + scale)")
    return float(norm.eps)


def _layer(where: str, lc: Any, dim: int, eps: float) -> dict[str, Any]:
    """The `Architecture` fields every layer of a Gemma model shares, checked."""
    if lc.klass is not TransformerLayer or lc.post_norm is None:
        raise _bad(where, "Gemma layers are TransformerLayers with post_norm")
    a, f = lc.self_attention, lc.feed_forward
    norms = [(name, getattr(lc, name)) for name in ("norm", "post_norm")]
    for name, norm in norms + ([("self_attention.qk_norm", a.qk_norm)] if a.qk_norm else []):
        if _eps(f"{where}.{name}", norm) != eps:
            raise _bad(f"{where}.{name}.eps", "HF Gemma has one rms_norm_eps")
    if a.klass is not Attention or not a.causal or a.rope is None or a.qkv_bias != a.output_bias:
        raise _bad(f"{where}.self_attention", "causal, RoPE, q/k/v and o biases together")
    if f.klass is not FeedForward or tuple(f.activation) != ("gelu_tanh", "linear") or f.use_bias:
        raise _bad(f"{where}.feed_forward", "Gemma MLPs are GeGLU (gelu_tanh) without bias")
    if a.rope.rotary_fraction != 1.0:
        raise _bad(f"{where}.self_attention.rope.rotary_fraction", "Gemma has full RoPE")
    head_dim = a.head_dim if a.head_dim is not None else dim // a.num_heads
    scale = a.query_scale if a.query_scale is not None else head_dim**-0.5
    return dict(
        num_heads=a.num_heads, num_kv_heads=a.num_kv_heads or a.num_heads, head_dim=head_dim,
        ffn_dim=f.hidden_dim, qkv_bias=bool(a.qkv_bias), output_bias=bool(a.output_bias),
        qk_norm=a.qk_norm is not None, query_pre_attn_scalar=round(scale**-2, 6),
        attn_logit_soft_cap=a.logit_soft_cap,
    )  # fmt: skip


def _rope(where: str, rope: Any, local: bool) -> tuple[float, Optional[float]]:
    fs = rope.frequency_scaling
    if fs is not None and (fs.klass is not LinearFrequencyScaling or local):
        raise _bad(f"{where}.self_attention.rope", "linear scaling of global layers only")
    return float(rope.theta), None if fs is None else float(fs.factor)


def gemma_architecture(fam: Gemma2, cfg: Any) -> dict[str, Any]:
    """`Architecture` fields of a `CausalLM.Config` of Gemma family `fam`;
    `UnsupportedModelError` naming the config path of anything HF Gemma2 / Gemma3 cannot
    express."""
    dec, first = cfg.decoder, None
    if not dec.emb.scale_by_sqrt_dim:
        raise _bad("model.decoder.emb.scale_by_sqrt_dim", "Gemma scales embeddings by sqrt(dim)")
    layers = layer_configs(dec.transformer)
    ropes: dict[bool, tuple[float, Optional[float]]] = {}
    eps = _eps("model.decoder.output_norm", dec.output_norm)
    windows = [lc.self_attention.sliding_window for lc in layers]
    for i, lc in enumerate(layers):
        where = f"model.decoder.transformer.layers[{i}]"
        this = _layer(where, lc, dec.dim, eps)
        if first is not None and this != first:
            raise _bad(where, f"differs from layer 0 in {[k for k in this if this[k] != first[k]]}")
        first, local = first or this, windows[i] is not None
        rope = _rope(where, lc.self_attention.rope, local)
        if ropes.setdefault(local, rope) != rope:
            raise _bad(f"{where}.self_attention.rope", "one RoPE per layer kind")
    assert first is not None
    if len({w for w in windows if w is not None}) > 1:
        raise _bad("model.decoder.transformer", "one sliding window for every local layer")
    theta, factor = ropes.get(False) or ropes[True]
    local_theta = ropes[True][0] if True in ropes else None
    if first.pop("qk_norm") != fam.qk_norm:
        has = "has" if fam.qk_norm else "has no"
        raise _bad("model.decoder.transformer.layers[0].self_attention.qk_norm",
                   f"family {fam.name} {has} per-head q/k norms")  # fmt: skip
    if not fam.attention_soft_cap and first["attn_logit_soft_cap"] is not None:
        raise _bad("model.decoder.transformer", "HF Gemma 3 has no attention soft cap")
    if fam.hf_local_theta is None and local_theta not in (None, theta):
        raise _bad("model.decoder.transformer", "Gemma 2 has one RoPE theta (q/k norms: Gemma 3)")
    return dict(
        first, family=fam.name, vocab_size=dec.vocab_size, dim=dec.dim, num_layers=len(layers),
        norm_eps=eps, rope_theta=theta,
        local_rope_theta=(local_theta or theta) if fam.hf_local_theta is not None else None,
        rope_scaling=None if factor is None else {"rope_type": "linear", "factor": factor},
        tie_embeddings=dec.lm_head is None, sliding_windows=tuple(windows),
        final_logit_soft_cap=dec.logits_soft_cap,
    )  # fmt: skip


GEMMA2 = Gemma2()
GEMMA3 = Gemma3()
