"""Rematerialisation (activation checkpointing) policies, selected by name in configs.

Policy names:
  nothing_saveable | everything_saveable | dots_saveable | dots_with_no_batch_dims_saveable
  save_names:a,b     save only activations tagged `checkpoint_name(x, "a")` / "b"
  offload_names:a,b  offload tagged activations to pinned host memory (TPU/GPU)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxlearn.config import ConfigBase, ConfigError

_NAMED = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class RematSpec(ConfigBase):
    """How a module's call is rematerialised in training (None on a module: no remat)."""

    policy: str = "nothing_saveable"
    prevent_cse: bool = True


def policy_from_name(name: str) -> Optional[Callable[..., Any]]:
    if name in _NAMED:
        return _NAMED[name]
    kind, _, names = name.partition(":")
    tagged = [n for n in names.split(",") if n]
    if kind == "save_names" and tagged:
        return jax.checkpoint_policies.save_only_these_names(*tagged)
    if kind == "offload_names" and tagged:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=tagged,
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ConfigError(
        f"Unknown remat policy {name!r}; use one of {sorted(_NAMED)}, "
        f"'save_names:a,b' or 'offload_names:a,b'"
    )


def remat(fn: Callable[..., Any], spec: RematSpec) -> Callable[..., Any]:
    """`jax.checkpoint(fn)` with the spec's policy."""
    return jax.checkpoint(fn, policy=policy_from_name(spec.policy), prevent_cse=spec.prevent_cse)


def tag(x: Any, name: str) -> Any:
    """Names an activation so 'save_names:'/'offload_names:' policies can select it."""
    return checkpoint_name(x, name)
