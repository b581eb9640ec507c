"""Mixtral: the Llama decoder with every FFN a top-k softmax MoE of SwiGLU experts whose
top-k weights are renormalised, HF `MixtralForCausalLM` (one sliding window, no
biases). llama.cpp writes it as `llama` (`expert_count`, stacked `ffn_*_exps`); its
`qwen2` / `qwen3` files with experts are read as Mixtral too. Config builder:
`jaxlearn.layers.mixtral_config` (or `build_config`: `llama_config` + experts)."""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.families.family import Family
from jaxlearn.families.hf_config import one_window_fields, size
from jaxlearn.families.names import ATTENTION_ROWS, MOE_FFN_ROWS, TOP_ROWS, Row


class Mixtral(Family):
    name = "mixtral"
    hf_class = "MixtralForCausalLM"
    gguf_architecture = "llama"
    gguf_permutes_qk = True
    rows: tuple[Row, ...] = TOP_ROWS + ATTENTION_ROWS + MOE_FFN_ROWS
    experts = True

    def check_config(self, fields: dict[str, Any], windows: list[Optional[int]]) -> None:
        if fields.get("dense_layers") or not fields["normalize_top_k"]:
            raise self.refuse(
                "has no dense layers and renormalises its top-k weights (both need q/k "
                "norms: Qwen3-MoE)"
            )
        super().check_config(fields, windows)
        if fields["qkv_bias"] or fields["output_bias"]:
            raise self.refuse("has no attention biases")
        self.check_one_window(windows)

    def hf_fields(self, hf: dict[str, Any], where: str, layers: int) -> dict[str, Any]:
        experts = size(hf, where, "num_local_experts", "num_experts")
        return dict(one_window_fields(hf, where, layers), num_experts=experts)

    def hf_dict(self, arch: Any, out: dict[str, Any]) -> None:
        out["sliding_window"] = arch.sliding_windows[0] if arch.sliding_windows else None
        out["num_local_experts"] = arch.num_experts
        out["num_experts_per_tok"] = arch.num_experts_per_token
        out["router_aux_loss_coef"] = arch.router_aux_loss_coef
        out["output_router_logits"] = False
        out["router_jitter_noise"] = 0.0


MIXTRAL = Mixtral()
