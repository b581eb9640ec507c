"""llama.cpp's `gemma2` / `gemma3` GGUF metadata <-> the Gemma fields of `Architecture`.

llama.cpp (`llama-model.cpp`) does not store what it can derive, so import derives it the
same way and export refuses what it would derive differently:

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

from jaxlearn.families.arch import Architecture
from jaxlearn.families.checks import LIMITS, number
from jaxlearn.interop.errors import UnsupportedModelError

GEMMA_ARCHITECTURES = {"gemma2": "gemma2", "gemma3": "gemma3_text"}
_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's set_swa_pattern
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
_LOCAL_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3
_CAPS = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}  # (attention, final) defaults


def _local(arch_name: str, layers: int, window: Optional[int]) -> tuple[Optional[int], ...]:
    every = _PATTERN[arch_name]
    return tuple(window if i % every < every - 1 else None for i in range(layers))


def _query_scalar(arch_name: str, layers: int, dim: int, heads: int, head_dim: int) -> int:
    """The `query_pre_attn_scalar` whose inverse square root llama.cpp scales q by."""
    return dim // heads if layers == _LAYERS_27B[arch_name] else head_dim


def gemma_fields_from_gguf(f: Any, arch_name: str, sizes: dict[str, Any]) -> dict[str, Any]:
    """The Gemma `Architecture` fields of GGUF file `f` (a `gguf.GGUFFile`), checked;
    `sizes` are the file's `gguf._sizes`."""
    where = str(f.path)
    key = f"{arch_name}.attention.sliding_window"
    window = f.integer(key, high=LIMITS["window"], required=arch_name == "gemma2")
    if sizes["rotary_fraction"] != 1.0:
        raise UnsupportedModelError(f"{where}: {arch_name} has full RoPE")
    attn_default, final_default = _CAPS[arch_name]
    caps = []
    for name, default in (("attn", attn_default), ("final", final_default)):
        k = f"{arch_name}.{name}_logit_softcapping"
        value = f.get(k, default)
        caps.append(None if value is None or (arch_name == "gemma3" and name == "attn")
                    else number(value, where, k))  # fmt: skip
    layers = sizes["num_layers"]
    return dict(
        family=GEMMA_ARCHITECTURES[arch_name],
        sliding_windows=_local(arch_name, layers, window) if window is not None else (),
        query_pre_attn_scalar=float(_query_scalar(
            arch_name, layers, sizes["dim"], sizes["num_heads"], sizes["head_dim"])),
        attn_logit_soft_cap=caps[0],
        final_logit_soft_cap=caps[1],
        local_rope_theta=_LOCAL_THETA if arch_name == "gemma3" else None,
    )  # fmt: skip


def _refuse(arch: Architecture, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"cannot export {arch.family} to GGUF: {why}")


def gemma_gguf_name(arch: Architecture) -> str:
    """`general.architecture` for a Gemma `arch`, after checking that llama.cpp derives
    the same model from what the file can hold (UnsupportedModelError saying what not)."""
    name = next(k for k, v in GEMMA_ARCHITECTURES.items() if v == arch.family)
    windows = arch.sliding_windows
    window = next((w for w in windows if w is not None), None)
    if windows and windows != _local(name, arch.num_layers, window):
        kinds = ["local" if w else "global" for w in windows]
        raise _refuse(arch, f"llama.cpp's {name} has local layers i % {_PATTERN[name]} < "
                            f"{_PATTERN[name] - 1}, not {kinds}")  # fmt: skip
    if name == "gemma2" and window is None:
        raise _refuse(arch, "llama.cpp's gemma2 needs a sliding window")
    q = _query_scalar(name, arch.num_layers, arch.dim, arch.num_heads, arch.head_dim)
    if arch.query_pre_attn_scalar is not None and arch.query_pre_attn_scalar != q:
        raise _refuse(arch, f"query_pre_attn_scalar {arch.query_pre_attn_scalar:g}: llama.cpp "
                            f"scales queries by {q} ** -0.5 for {arch.num_layers} layers of "
                            f"head_dim {arch.head_dim}")  # fmt: skip
    if arch.qkv_bias or arch.output_bias:
        raise _refuse(arch, "llama.cpp's Gemma attention has no biases")
    if name == "gemma2":
        if not arch.tie_embeddings:
            raise _refuse(arch, "llama.cpp's gemma2 has no separate output head")
        if arch.attn_logit_soft_cap is None or arch.final_logit_soft_cap is None:
            raise _refuse(arch, "llama.cpp's gemma2 always soft-caps attention and final logits")
        if arch.local_rope_theta not in (None, arch.rope_theta) or arch.rope_scaling:
            raise _refuse(arch, "llama.cpp's gemma2 has one unscaled RoPE")
    elif windows and arch.local_rope_theta not in (None, _LOCAL_THETA):
        raise _refuse(arch, f"local RoPE theta {arch.local_rope_theta:g}; llama.cpp's gemma3 "
                            f"uses {_LOCAL_THETA:g}")  # fmt: skip
    return name


def write_gemma_keys(w: Any, arch: Architecture) -> None:
    """The gemma2 / gemma3 keys besides the common ones (`gguf_export._write_architecture`):
    the local window and the soft caps."""
    window = next((x for x in arch.sliding_windows if x is not None), None)
    if window is not None:
        w.add_sliding_window(int(window))
    if arch.attn_logit_soft_cap is not None:
        w.add_attn_logit_softcapping(float(arch.attn_logit_soft_cap))
    if arch.final_logit_soft_cap is not None:
        w.add_final_logit_softcapping(float(arch.final_logit_soft_cap))

