"""The trainer's side of post-training: per-token log-probabilities of given tokens under
the model's own forward pass, and the reference policy of a LoRA model (its base: the
adapters switched off) without a second copy of the weights.

    logp, collection = token_logprobs(model, params, batch)   # [n, seq] f32
    ref = adapters_off(params)    # the same base arrays; every LoRA `lora_b` zeroed

`batch` holds `input_ids` [n, seq], `target_labels` [n, seq] (-1: none) and optionally
`positions` / `segment_ids`; the log-probability at a position with no label is 0.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxlearn.layers.lora import ADAPTERS
from jaxlearn.module import Module, functional, keypath_str

__all__ = ["adapters_off", "has_adapters", "token_logprobs", "token_logprobs_and_entropy"]


def token_logprobs(model: Module, params: Any, batch: dict[str, jax.Array],
                   key: Optional[jax.Array] = None, *,
                   is_training: bool = False) -> tuple[jax.Array, Any]:
    """(log p(target_labels | prefix) [n, seq] f32, the forward's collection) of a causal
    LM (`model.logits`); 0 where the label is negative."""
    logp, _, collection = token_logprobs_and_entropy(model, params, batch, key,
                                                     is_training=is_training)
    return logp, collection


def token_logprobs_and_entropy(model: Module, params: Any, batch: dict[str, jax.Array],
                               key: Optional[jax.Array] = None, *, is_training: bool = False
                               ) -> tuple[jax.Array, jax.Array, Any]:
    """`token_logprobs` plus the entropy of each position's next-token distribution
    [n, seq] (no gradient: a metric)."""
    inputs = {k: batch[k] for k in ("input_ids", "positions", "segment_ids") if k in batch}
    logits, collection = functional(model, key, params, (inputs,), method="logits",
                                    is_training=is_training)
    logits = logits.astype(jnp.float32)
    labels = batch["target_labels"]
    safe = jnp.where(labels >= 0, labels, 0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    logp = jnp.where(labels >= 0, picked - lse, 0.0)
    probs = jax.lax.stop_gradient(jax.nn.softmax(logits, axis=-1))
    entropy = lse - jnp.sum(probs * jax.lax.stop_gradient(logits), axis=-1)
    return logp, jax.lax.stop_gradient(entropy), collection


def has_adapters(params: Any) -> bool:
    """Whether `params` hold LoRA adapters (`layers.use_lora`)."""
    return any(re.fullmatch(ADAPTERS, keypath_str(kp))
               for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def adapters_off(params: Any) -> Any:
    """`params` with every LoRA `lora_b` zeroed: the adapters add exactly 0, so the model
    computes its base (the reference policy of LoRA post-training). Every other leaf is
    the same array: no copy of the base weights."""
    def leaf(keypath: Any, x: Any) -> Any:
        path = keypath_str(keypath)
        return jnp.zeros_like(x) if re.fullmatch(ADAPTERS, path) and \
            path.endswith("lora_b") else x

    return jax.tree_util.tree_map_with_path(leaf, params)
