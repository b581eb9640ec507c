"""Llama and Mistral: the plain Llama decoder (RMSNorm pre-norm, GQA + RoPE, SwiGLU), as
HF `LlamaForCausalLM` (optional attention biases on q/k/v and o together, MLP biases, no
sliding window) and `MistralForCausalLM` (one sliding window for every layer, no
biases). llama.cpp's `llama` architecture holds both (and Mixtral: `mixtral.py`), with
the q/k rows permuted for its interleaved RoPE; `mistral`-named files have the same
layout. Config builder: `jaxlearn.layers.llama_config`."""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.families.family import Family, read_flag
from jaxlearn.families.hf_config import layer_type_windows, one_window_fields, sliding_window
from jaxlearn.families.mixtral import MIXTRAL
from jaxlearn.families.names import ATTENTION_ROWS, DENSE_FFN_ROWS, TOP_ROWS, Row

DENSE_ROWS = TOP_ROWS + ATTENTION_ROWS + DENSE_FFN_ROWS


class Llama(Family):
    name = "llama"
    hf_class = "LlamaForCausalLM"
    gguf_architecture = "llama"
    gguf_reads: tuple[str, ...] = ("llama", "mistral")
    gguf_permutes_qk = True
    rows: tuple[Row, ...] = DENSE_ROWS

    def check_config(self, fields: dict[str, Any], windows: list[Optional[int]]) -> None:
        super().check_config(fields, windows)
        if fields["qkv_bias"] != fields["output_bias"]:
            raise self.refuse("has biases on q/k/v and o together (q/k/v only: Qwen2)")
        if any(w is not None for w in windows):
            raise self.refuse("has no sliding window (Mistral: one window, Qwen2: per layer)")

    def hf_fields(self, hf: dict[str, Any], where: str, layers: int) -> dict[str, Any]:
        bias = read_flag(hf, where, "attention_bias")
        layer_types = hf.get("layer_types")
        windows = () if layer_types is None else layer_type_windows(
            layer_types, sliding_window(hf, where), where, layers)  # fmt: skip
        return dict(qkv_bias=bias, output_bias=bias, mlp_bias=read_flag(hf, where, "mlp_bias"),
                    sliding_windows=windows)  # fmt: skip

    def hf_dict(self, arch: Any, out: dict[str, Any]) -> None:
        out["attention_bias"] = arch.qkv_bias
        out["mlp_bias"] = arch.mlp_bias

    def gguf_family(self, experts: int, window: Optional[int]) -> Family:
        """A `llama` / `mistral` file is Mixtral with experts, Mistral with a window."""
        return MIXTRAL if experts else MISTRAL if window is not None else self


class Mistral(Llama):
    name = "mistral"
    hf_class = "MistralForCausalLM"
    gguf_reads: tuple[str, ...] = ()

    def check_config(self, fields: dict[str, Any], windows: list[Optional[int]]) -> None:
        Family.check_config(self, fields, windows)
        self.check_no_biases(fields)
        self.check_one_window(windows)

    def hf_fields(self, hf: dict[str, Any], where: str, layers: int) -> dict[str, Any]:
        return one_window_fields(hf, where, layers)

    def hf_dict(self, arch: Any, out: dict[str, Any]) -> None:
        out["sliding_window"] = arch.sliding_windows[0] if arch.sliding_windows else None


LLAMA = Llama()
MISTRAL = Mistral()
