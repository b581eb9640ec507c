"""`Architecture`: the hyperparameters of a decoder of one of the model families
(`jaxlearn.families.registry`), independent of the file format they come from (HF
config.json, GGUF metadata) or go to (HF, GGUF export).

`build_config(arch)` turns one into a `CausalLM.Config` with the config builder of
`arch.family`; `architecture_from_config(cfg)` reads one back from a `CausalLM.Config`
through the family the config records (`cfg.family`) and raises `UnsupportedModelError`
for anything that family's HF class cannot express.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jaxlearn.families.errors import UnsupportedModelError
from jaxlearn.layers import LoopStack, ScanStack

STACKS = ("scan", "loop")


@dataclasses.dataclass
class Architecture:
    """Format-neutral hyperparameters of a Llama-family causal LM.

    rope_scaling: None, or an HF-style dict with "rope_type" one of
    `jaxlearn.layers.SCALINGS` (linear, llama3, yarn, dynamic, longrope) and the fields of
    that scaling's config (`scaling_dict`). rotary_fraction: HF `partial_rotary_factor`
    (Phi-3 only). sliding_windows: one entry per layer (None = full attention), or () when no
    layer has a window. num_experts > 0 makes every FFN a top-k softmax MoE of experts
    with hidden size ffn_dim (Mixtral, Qwen3-MoE), except the `dense_layers`, which have
    a dense SwiGLU FFN of hidden size `dense_ffn_dim` (Qwen3-MoE `mlp_only_layers` /
    `decoder_sparse_step`). normalize_top_k: divide the k routing weights by their sum
    (Qwen3-MoE `norm_topk_prob`; Mixtral always does). Gemma (`jaxlearn.families.gemma`):
    attention scale query_pre_attn_scalar ** -0.5, soft caps, local layers' RoPE theta.
    """

    family: str
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]] = None
    rotary_fraction: float = 1.0
    tie_embeddings: bool = False
    qkv_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: tuple[Optional[int], ...] = ()
    num_experts: int = 0
    num_experts_per_token: int = 2
    router_aux_loss_coef: float = 0.0
    normalize_top_k: bool = True
    dense_layers: tuple[int, ...] = ()
    dense_ffn_dim: int = 0
    query_pre_attn_scalar: Optional[float] = None
    attn_logit_soft_cap: Optional[float] = None
    final_logit_soft_cap: Optional[float] = None
    local_rope_theta: Optional[float] = None
    max_position_embeddings: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        from jaxlearn.families.registry import FAMILIES  # (the families import this module)

        if self.family not in FAMILIES:
            raise UnsupportedModelError(
                f"architecture family {self.family!r} not in {tuple(FAMILIES)}"
            )
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise UnsupportedModelError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"{self.num_layers} layers"
            )
        if self.sliding_windows and all(w is None for w in self.sliding_windows):
            self.sliding_windows = ()
        if self.dense_layers and not (self.is_moe and self.dense_ffn_dim > 0):
            raise UnsupportedModelError(
                f"dense_layers {self.dense_layers} need num_experts > 0 and dense_ffn_dim > 0"
            )
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise UnsupportedModelError(
                f"dense_layers {self.dense_layers} outside [0, {self.num_layers})"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3): the family's."""
        from jaxlearn.families.registry import FAMILIES

        return FAMILIES[self.family].qk_norm

    def uniform_sliding_window(self) -> tuple[bool, Optional[int]]:
        """(True, window) when every layer has the same window (None = none)."""
        if not self.sliding_windows:
            return True, None
        first = self.sliding_windows[0]
        return all(w == first for w in self.sliding_windows), first


def build_config(
    arch: Architecture,
    *,
    stack: str = "scan",
    dtype: Optional[str] = None,
    param_dtype: Optional[str] = None,
    attention_implementation: str = "auto",
    moe_dropless_method: str = "ragged_dot",
    name: str = "model",
) -> Any:
    """A `CausalLM.Config` for `arch`, built by its family (`Family.build_config`), which
    records the family in the config (`cfg.family`).

    stack: "scan" or "loop"; layers with different sliding windows or FFNs (dense layers of
    an MoE model) need per-layer configs, so they may get a `LoopStack` (whatever `stack`
    says).
    dtype: compute dtype (e.g. "bfloat16"); param_dtype: storage dtype of the params
    (default float32).
    """
    from jaxlearn.families.registry import FAMILIES

    if stack not in STACKS:
        raise ValueError(f"stack must be one of {STACKS}, got {stack!r}")
    cfg = FAMILIES[arch.family].build_config(
        arch, stack=stack, dtype=dtype, name=name,
        attention_implementation=attention_implementation,
        moe_dropless_method=moe_dropless_method,
    )  # fmt: skip
    if param_dtype is not None:
        cfg.param_dtype = param_dtype
    return cfg


def is_a(cfg: Any, klass: type) -> bool:
    """Whether config `cfg` instantiates `klass` (or a subclass)."""
    k = getattr(cfg, "klass", None)
    return isinstance(k, type) and issubclass(k, klass)


def layer_configs(stack: Any) -> list[Any]:
    """The per-layer configs of a ScanStack / LoopStack config (a scanned `LoopStack`
    group of p layers repeated: layer i is the group's i % p)."""
    layers = list(getattr(stack, "layers", None) or [stack.layer] * stack.num_layers)
    if is_a(stack, ScanStack) and is_a(stack.layer, LoopStack):
        return [lc for group in layers for lc in layer_configs(group)]
    return layers


def architecture_from_config(cfg: Any, *, max_position_embeddings: Optional[int] = None) -> Any:
    """Reads an `Architecture` from a `CausalLM.Config` through the family it records
    (`cfg.family`, set by the family's recipe). Raises `UnsupportedModelError` for a config
    that records no family (a model built by hand) or an unknown one, and, naming the
    config path, for anything the family's HF class cannot express."""
    from jaxlearn.families.registry import FAMILIES

    name = getattr(cfg, "family", None)
    if name is None:
        raise UnsupportedModelError(
            "cannot export model.family = None: the config records no model family (a "
            f"model built by hand); set it to the family it is, one of {sorted(FAMILIES)}"
        )
    if name not in FAMILIES:
        raise UnsupportedModelError(
            f"cannot export model.family = {name!r}: not one of {sorted(FAMILIES)}"
        )
    arch = FAMILIES[name].architecture_from_config(cfg)
    arch.max_position_embeddings = max_position_embeddings
    return arch
