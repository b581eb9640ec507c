"""Which paged-attention implementation an `Engine` serves with
(`Engine.Config.attention_kernel`).

- "auto" (default): "native" on one CPU device when the kernel builds here
  (`kernels.paged_native.unavailable_reason`), else "xla";
- "native": `kernels.paged_native`, one XLA FFI call per layer that reads keys and values
  where they sit in the page pool (one device only);
- "xla": `kernels.paged.attend_pages`' loop, which gathers each block's pages first.

Measured on the 2-core Sapphire Rapids dev host, SmolLM2-135M shapes (9 heads, 3 kv
heads, head_dim 64, pages of 16), bf16 pools, 30 layers, 200-250 positions per row
(`tools/bench/jl_paged_attention.py`): 8 / 16 / 32 decode rows 24.6 / 32.1 / 61.2 ms
("xla") -> 4.3 / 9.6 / 20.5 ms ("native"); a 256-token prefill chunk 46.6 -> 34.5 ms.

The choice is a config swap: every `layers.Attention` gets `paged_kernel`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import jax

from jaxlearn.config import replace_config
from jaxlearn.kernels.paged_native import unavailable_reason
from jaxlearn.layers import Attention

ATTENTION_KERNELS = ("auto", "xla", "native")
log = logging.getLogger(__name__)


def check_attention_kernel(kernel: str, mesh_shape: Optional[tuple[int, ...]]) -> None:
    """ValueError (one line, naming the field) for an unknown kernel, or "native" on a mesh."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"Engine.Config.attention_kernel={kernel!r}: must be one of "
                         f"{', '.join(ATTENTION_KERNELS)}")
    if kernel == "native" and mesh_shape is not None:
        raise ValueError(f"Engine.Config.attention_kernel='native' needs mesh_shape=None (one "
                         f"device), got mesh_shape={mesh_shape}")


def chosen_attention_kernel(kernel: str, mesh_shape: Optional[tuple[int, ...]]) -> str:
    """"xla" or "native": what `kernel` ("auto" resolved, see module doc) runs here.
    "native" where the kernel cannot run is a RuntimeError saying why."""
    check_attention_kernel(kernel, mesh_shape)
    if kernel == "xla":
        return "xla"
    if kernel == "auto" and (mesh_shape is not None or jax.default_backend() != "cpu"):
        return "xla"
    reason = unavailable_reason()
    if reason is None:
        return "native"
    if kernel == "native":
        raise RuntimeError(f"Engine.Config.attention_kernel='native': {reason}")
    log.warning("attention_kernel auto: native paged attention unavailable (%s); using xla",
                reason)
    return "xla"


def use_attention_kernel(model_cfg: Any, kernel: str) -> Any:
    """model_cfg with every Attention layer's `paged_kernel` set to `kernel`."""
    return replace_config(model_cfg, Attention.Config,
                          lambda old, path: old.clone(paged_kernel=kernel),
                          allow_no_match=True)
