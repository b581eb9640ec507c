"""Parameter paths of checkpoints written before projections were `Linear` children.

Attention and FeedForward used to hold their projections as their own params
(`self_attention.q_proj`, `q_bias`, `o_bias`, `feed_forward.wi_0`, `wi_0_bias`, LoRA
`q_proj_lora_a`); they are now children (`self_attention.q_proj.weight`, `q_proj.bias`,
`o_proj.bias`, `feed_forward.wi_0.weight`, `wi_0.bias`, `q_proj.adapter.lora_a`).
`older_param_path` maps a param path of today's layout to the one such a checkpoint
stored it under; restore sites pass it to `jaxlearn.checkpoint.restore_subtree(...,
aliases=older_param_path)`, which reads a leaf the step lacks under its older name.
Mixture-of-experts weights (`feed_forward.wi_0` next to a `router`) never moved.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["older_param_path"]

_ATTENTION = ("q", "k", "v", "qkv", "o")
_FFN = ("wi", "wi_0", "wi_1", "wi_fused", "wo")
_PROJ = "|".join([f"{n}_proj" for n in _ATTENTION] + list(_FFN))
# <sep><projection><sep>(weight|bias|adapter<sep>lora_a|lora_b) at the end of a path.
_NEW = re.compile(rf"(?P<sep>[./])(?P<proj>{_PROJ})[./](?P<leaf>weight|bias|adapter[./]lora_[ab])$")


def older_param_path(path: str) -> Optional[str]:
    """The path (same separator, "." or "/") that the flat projection layout stored the
    param at `path` under; None when it did not move.

    `...self_attention.q_proj.weight` -> `...self_attention.q_proj`,
    `...q_proj.bias` -> `...q_bias` (`o_proj.bias` -> `o_bias`, `qkv_proj.bias` ->
    `qkv_bias`), `...feed_forward.wi_0.bias` -> `...wi_0_bias`,
    `...q_proj.adapter.lora_a` -> `...q_proj_lora_a`."""
    m = _NEW.search(path)
    if m is None:
        return None
    head, sep, proj, leaf = path[: m.start()], m["sep"], m["proj"], m["leaf"]
    if leaf == "weight":
        old = proj
    elif leaf == "bias":
        old = f"{proj.removesuffix('_proj')}_bias"
    else:
        old = f"{proj}_{leaf[-6:]}"
    return f"{head}{sep}{old}"
