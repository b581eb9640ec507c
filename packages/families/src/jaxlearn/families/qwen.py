"""Qwen2 and Qwen3: the Llama decoder as HF `Qwen2ForCausalLM` (biases on q/k/v, not o)
and `Qwen3ForCausalLM` (per-head q/k RMSNorm before RoPE, optional biases on q/k/v and o
together, an explicit head_dim). Both: full attention in the first `max_window_layers`
layers and one sliding window after (`use_sliding_window`, or per-layer `layer_types`).
llama.cpp's `qwen2` / `qwen3` architectures do not permute q/k rows; their files with
experts are read as Mixtral. Config builders: `jaxlearn.layers.llama_config` (Qwen2),
`qwen3_config` (Qwen3)."""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.families.checks import integer
from jaxlearn.families.errors import UnsupportedModelError
from jaxlearn.families.family import Family, read_flag
from jaxlearn.families.hf_config import layer_type_windows, sliding_window
from jaxlearn.families.llama import DENSE_ROWS
from jaxlearn.families.mixtral import MIXTRAL
from jaxlearn.families.names import QK_NORM_ROWS, Row
from jaxlearn.layers import qwen3_config


class Qwen2(Family):
    name = "qwen2"
    hf_class = "Qwen2ForCausalLM"
    gguf_architecture = "qwen2"
    gguf_reads: tuple[str, ...] = ("qwen2",)
    rows: tuple[Row, ...] = DENSE_ROWS

    def check_config(self, fields: dict[str, Any], windows: list[Optional[int]]) -> None:
        super().check_config(fields, windows)
        if not fields["qkv_bias"] or fields["output_bias"]:
            raise self.refuse("has biases on q/k/v and none on o")
        self.check_no_biases(fields, "mlp_bias")
        check_qwen_windows(self.hf_class, windows)

    def hf_fields(self, hf: dict[str, Any], where: str, layers: int) -> dict[str, Any]:
        return dict(qkv_bias=True, output_bias=False, mlp_bias=False,
                    sliding_windows=qwen_windows(hf, where, layers))  # fmt: skip

    def hf_dict(self, arch: Any, out: dict[str, Any]) -> None:
        windows = arch.sliding_windows
        sliding = [i for i, w in enumerate(windows) if w is not None]
        out["use_sliding_window"] = bool(sliding)
        out["sliding_window"] = windows[sliding[0]] if sliding else None
        out["max_window_layers"] = sliding[0] if sliding else arch.num_layers
        if sliding:
            out["layer_types"] = [
                "sliding_attention" if w is not None else "full_attention" for w in windows
            ]

    def gguf_family(self, experts: int, window: Optional[int]) -> Family:
        return MIXTRAL if experts else self


class Qwen3(Qwen2):
    name = "qwen3"
    hf_class = "Qwen3ForCausalLM"
    gguf_architecture = "qwen3"
    gguf_reads: tuple[str, ...] = ("qwen3",)
    rows: tuple[Row, ...] = DENSE_ROWS + QK_NORM_ROWS
    qk_norm = True
    recipe = staticmethod(qwen3_config)

    def check_config(self, fields: dict[str, Any], windows: list[Optional[int]]) -> None:
        Family.check_config(self, fields, windows)
        check_qwen3_biases(self, fields)
        check_qwen_windows(self.hf_class, windows)

    def hf_fields(self, hf: dict[str, Any], where: str, layers: int) -> dict[str, Any]:
        bias = read_flag(hf, where, "attention_bias")
        return dict(qkv_bias=bias, output_bias=bias, mlp_bias=False,
                    sliding_windows=qwen_windows(hf, where, layers))  # fmt: skip

    def hf_dict(self, arch: Any, out: dict[str, Any]) -> None:
        super().hf_dict(arch, out)
        out["attention_bias"] = arch.qkv_bias


def check_qwen3_biases(fam: Family, fields: dict[str, Any]) -> None:
    """Qwen3 / Qwen3-MoE: biases on q/k/v and o together, none in the MLP."""
    if fields["qkv_bias"] != fields["output_bias"]:
        raise UnsupportedModelError("cannot export: Qwen3 biases are on q/k/v and o together")
    if fields["mlp_bias"]:
        raise UnsupportedModelError("cannot export: Qwen3 has no MLP biases")


def qwen_windows(hf: dict[str, Any], where: str, layers: int) -> tuple[Optional[int], ...]:
    """Qwen2 / Qwen3 windows: `sliding_window` if `use_sliding_window`, in the layers
    `layer_types` says, else in the layers from `max_window_layers` on."""
    window = sliding_window(hf, where)
    if not read_flag(hf, where, "use_sliding_window"):
        window = None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        k = integer(hf.get("max_window_layers", layers), where, "max_window_layers",
                    low=0, high=layers)  # fmt: skip
        layer_types = ["full_attention"] * k + ["sliding_attention"] * (layers - k)
    return layer_type_windows(layer_types, window, where, layers)


def check_qwen_windows(name: str, windows: list[Optional[int]]) -> None:
    """Qwen2/Qwen3: full attention for layers < max_window_layers, one window after."""
    if all(w is None for w in windows):
        return
    k = next(i for i, w in enumerate(windows) if w is not None)
    if any(w is not None for w in windows[:k]) or any(w != windows[k] for w in windows[k:]):
        raise UnsupportedModelError(
            f"cannot export: {name} windows must be full attention then one window"
        )


QWEN2 = Qwen2()
QWEN3 = Qwen3()
