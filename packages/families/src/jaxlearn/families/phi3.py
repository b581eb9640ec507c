"""Phi-3 / Phi-3.5: the Llama decoder (no biases, no experts, one sliding window) with
RoPE on the first `partial_rotary_factor` of each head, usually LongRoPE scaling
("su" / "yarn" in older config.json files; the original maximum at the top level), and
fused `qkv_proj` / `gate_up_proj` tensors; HF `Phi3ForCausalLM`. llama.cpp's `phi3`
(fused `attn_qkv` / `ffn_up`, unpermuted q/k rows, LongRoPE factors as
`rope_factors_long/short.weight`). Config builder: `jaxlearn.layers.phi3_config`."""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.families.errors import UnsupportedModelError
from jaxlearn.families.family import Family
from jaxlearn.families.hf_config import one_window_fields
from jaxlearn.families.names import PHI3_MODEL_ROWS, Row
from jaxlearn.layers import phi3_config


class Phi3(Family):
    name = "phi3"
    hf_class = "Phi3ForCausalLM"
    gguf_architecture = "phi3"
    gguf_reads: tuple[str, ...] = ("phi3",)
    rows: tuple[Row, ...] = PHI3_MODEL_ROWS
    partial_rotary = True
    recipe = staticmethod(phi3_config)
    rope_aliases = {"su": "longrope", "yarn": "longrope"}

    def check_config(self, fields: dict[str, Any], windows: list[Optional[int]]) -> None:
        """Phi-3: partial RoPE or LongRoPE; no biases, no experts, one window."""
        why = [k for k in ("qkv_bias", "output_bias", "mlp_bias", "num_experts") if fields[k]]
        scaling = (fields["rope_scaling"] or {}).get("rope_type", "longrope")
        if why or any(w != windows[0] for w in windows) or scaling != "longrope":
            raise UnsupportedModelError(
                "cannot export: partial RoPE / LongRoPE need HF Phi-3, which has no biases, "
                f"experts or per-layer windows and only LongRoPE scaling (got {why}, {scaling})"
            )

    def hf_fields(self, hf: dict[str, Any], where: str, layers: int) -> dict[str, Any]:
        return one_window_fields(hf, where, layers)

    def hf_dict(self, arch: Any, out: dict[str, Any]) -> None:
        """Phi-3's config.json fields: one window, partial RoPE, the original maximum at the
        top level (where Phi3Config reads it), no pad/bos/eos defaults (1, 32000)."""
        out.update(
            sliding_window=arch.sliding_windows[0] if arch.sliding_windows else None,
            partial_rotary_factor=arch.rotary_fraction,
            attention_bias=False, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=None,
            bos_token_id=arch.bos_token_id,
            eos_token_id=arch.eos_token_ids[0] if len(arch.eos_token_ids) == 1
            else list(arch.eos_token_ids) or None,
        )  # fmt: skip
        original = (out["rope_scaling"] or {}).get("original_max_position_embeddings")
        if original is not None:
            out["original_max_position_embeddings"] = original


PHI3 = Phi3()
