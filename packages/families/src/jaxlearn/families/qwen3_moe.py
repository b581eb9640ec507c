"""Qwen3-MoE: Qwen3 attention (per-head q/k norms) with top-k softmax experts in every
layer (`moe_intermediate_size`) except dense SwiGLU layers (`intermediate_size`;
`mlp_only_layers`, the layers `decoder_sparse_step` skips), optionally renormalised
top-k weights (`norm_topk_prob`), one sliding window for every layer; HF
`Qwen3MoeForCausalLM`. llama.cpp's `qwen3moe` (a file without experts is Qwen3).
Config builder: `jaxlearn.layers.qwen3_moe_config` (or `build_config`)."""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.families.checks import LIMITS, flag, integer
from jaxlearn.families.errors import MalformedFileError
from jaxlearn.families.family import Family, read_flag
from jaxlearn.families.hf_config import size, sliding_window
from jaxlearn.families.names import (
    ATTENTION_ROWS,
    QK_NORM_ROWS,
    QWEN3_MOE_FFN_ROWS,
    TOP_ROWS,
    Row,
)
from jaxlearn.families.qwen import QWEN3, check_qwen3_biases
from jaxlearn.layers import qwen3_config


class Qwen3Moe(Family):
    name = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    gguf_architecture = "qwen3moe"
    gguf_reads: tuple[str, ...] = ("qwen3moe",)
    rows: tuple[Row, ...] = TOP_ROWS + ATTENTION_ROWS + QK_NORM_ROWS + QWEN3_MOE_FFN_ROWS
    qk_norm = True
    experts = True
    dense_moe_layers = True
    recipe = staticmethod(qwen3_config)
    hf_ffn_field = "moe_intermediate_size"

    def check_config(self, fields: dict[str, Any], windows: list[Optional[int]]) -> None:
        super().check_config(fields, windows)
        check_qwen3_biases(self, fields)
        self.check_one_window(windows)

    def hf_fields(self, hf: dict[str, Any], where: str, layers: int) -> dict[str, Any]:
        window = sliding_window(hf, where)
        if not read_flag(hf, where, "use_sliding_window"):
            window = None
        bias = read_flag(hf, where, "attention_bias")
        name = "num_experts" if "num_local_experts" not in hf else "num_local_experts"
        return dict(
            num_experts=size(hf, where, name, "num_experts"),
            qkv_bias=bias, output_bias=bias, mlp_bias=False,
            sliding_windows=(window,) * layers if window else (),  # every layer
            **_dense_layers(hf, where, layers),
        )  # fmt: skip

    def hf_dict(self, arch: Any, out: dict[str, Any]) -> None:
        windows = arch.sliding_windows  # one window for every layer, or none
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

    def gguf_family(self, experts: int, window: Optional[int]) -> Family:
        return self if experts else QWEN3

    def gguf_name(self, arch: Any) -> str:
        if arch.dense_layers:
            raise self.refuse("dense layers have no form in llama.cpp's qwen3moe")
        return super().gguf_name(arch)

    def write_gguf_keys(self, w: Any, arch: Any) -> None:
        super().write_gguf_keys(w, arch)
        w.add_expert_feed_forward_length(arch.ffn_dim)
        w.add_expert_weights_norm(arch.normalize_top_k)


def _dense_layers(hf: dict[str, Any], where: str, layers: int) -> dict[str, Any]:
    """The dense-layer and routing fields of a Qwen3-MoE config.json: dense FFNs
    (`intermediate_size`) in `mlp_only_layers` and in the layers `decoder_sparse_step`
    skips (experts have `moe_intermediate_size`), `norm_topk_prob`."""
    step = integer(hf.get("decoder_sparse_step", 1), where, "decoder_sparse_step", high=layers)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list):
        raise MalformedFileError(f"{where}: mlp_only_layers = {only!r} is not a list")
    only_set = {integer(i, where, "mlp_only_layers", low=0, high=layers - 1) for i in only}
    dense = tuple(i for i in range(layers) if i in only_set or (i + 1) % step)
    ffn = 0
    if dense:
        ffn = integer(
            hf.get("intermediate_size"), where, "intermediate_size", high=LIMITS["ffn_dim"]
        )
    return dict(
        dense_layers=dense,
        dense_ffn_dim=ffn,
        normalize_top_k=flag(hf.get("norm_topk_prob"), where, "norm_topk_prob"),
    )


QWEN3_MOE = Qwen3Moe()
