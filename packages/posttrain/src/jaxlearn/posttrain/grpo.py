"""Group-relative policy optimisation (GRPO, Shao et al. 2024) and its variants as a
training objective over sampled completions.

    adv = group_advantages(rewards, group_size=G, scale="group_std")   # [n] per completion
    cfg.objective = GRPOObjective.default_config().set(epsilon_low=0.2, epsilon_high=0.28,
                                                       loss_aggregation="token_mean")

A batch holds one sampled completion per row, prompt included: `input_ids`,
`target_labels`, `target_weights` (1 on the completion's tokens), `advantages` (the row's
advantage at every position; per-token credit fits the same field) and `old_logprobs`
[n, seq] (the sampling policy's log-probability of each target; the
sampler's own, `sampler.EngineSampler`, or a forward of the old params). Per token, with
ratio = exp(logp - old_logp) and A the row's advantage:

    loss_t = -min(ratio A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) A)
             + beta * (exp(ref - logp) - (ref - logp) - 1)          (k3 KL estimate)

aggregated by `loss_aggregation`: "sequence_mean" (GRPO: each row's token mean, then the
mean over rows), "token_mean" (DAPO: all tokens of the batch weigh the same), "constant"
(Dr. GRPO: the token sum over rows x `max_completion_tokens`, a fixed budget that must be
set, no length bias).
`group_advantages` gives r - mean(group), divided by the group's std with
scale="group_std" (GRPO) or not with scale="none" (Dr. GRPO). With beta > 0 the reference
is the model with its LoRA adapters off (`logprobs.adapters_off`). Metrics: loss,
clip_fraction (share of tokens whose ratio was clipped where it mattered), kl, ratio_mean,
logprob_mismatch_max / _mean (|logp - old_logp| over the completion tokens: with the old
params and the sampler's log-probabilities, the sampler/trainer disagreement), entropy
(mean over completion tokens), num_tokens.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.module import Module
from jaxlearn.posttrain.logprobs import adapters_off, has_adapters, token_logprobs_and_entropy
from jaxlearn.runtime.objective import Objective

__all__ = ["AGGREGATIONS", "GRPOObjective", "group_advantages", "grpo_token_loss",
           "rollout_batch"]

AGGREGATIONS = ("sequence_mean", "token_mean", "constant")


def group_advantages(rewards: jax.Array, group_size: int, *, scale: str = "group_std",
                     eps: float = 1e-4) -> jax.Array:
    """Per completion [n] (groups of `group_size` consecutive completions of one prompt):
    reward minus its group's mean, over the group's std (+ eps) with "group_std"."""
    r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
    centred = r - r.mean(axis=1, keepdims=True)
    if scale == "group_std":
        centred = centred / (r.std(axis=1, keepdims=True) + eps)
    elif scale != "none":
        raise ValueError(f"group_advantages: scale must be 'group_std' or 'none', got {scale!r}")
    return centred.reshape(-1)


def grpo_token_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, *,
                    epsilon_low: float, epsilon_high: float) -> tuple[jax.Array, jax.Array]:
    """(per-token clipped surrogate loss [n, seq], clipped-and-active mask [n, seq]) for
    advantages [n, seq]."""
    ratio = jnp.exp(logp - old_logp)
    a = advantages
    plain, clipped = ratio * a, jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * a
    return -jnp.minimum(plain, clipped), (clipped < plain).astype(jnp.float32)


class GRPOObjective(Objective):
    """The GRPO loss of a batch of sampled completions (module doc)."""

    class Config(Objective.Config):
        epsilon_low: float = 0.2
        epsilon_high: float = 0.2  # DAPO's clip-higher: 0.28.
        beta: float = 0.0  # KL to the reference (LoRA base); 0: none (Dr. GRPO, DAPO).
        loss_aggregation: Literal["sequence_mean", "token_mean", "constant"] = "sequence_mean"
        # "constant"'s divisor per completion (Dr. GRPO's generation budget, e.g. the
        # rollout's max_new_tokens); required with it, because a batch's row length moves
        # when batches are cut to their longest row (`Trainer.Config.pad_to_multiple_of`).
        max_completion_tokens: Optional[int] = None

        def _field_problems(self) -> dict[str, str]:
            problems = {}
            for name in ("epsilon_low", "epsilon_high", "beta"):
                if not getattr(self, name) >= 0:
                    problems[name] = f"must be >= 0, got {getattr(self, name)!r}"
            if self.loss_aggregation == "constant" and self.max_completion_tokens is None:
                problems["max_completion_tokens"] = (
                    "must be set with loss_aggregation='constant' (the generation budget, "
                    "e.g. rollout.max_new_tokens)")
            if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
                problems["max_completion_tokens"] = (f"must be >= 1, got "
                                                     f"{self.max_completion_tokens!r}")
            if self.loss_aggregation not in AGGREGATIONS:
                problems["loss_aggregation"] = (f"must be one of {AGGREGATIONS}, got "
                                                f"{self.loss_aggregation!r}")
            return problems

    def __init__(self, cfg: "GRPOObjective.Config"):
        super().__init__(cfg)
        self.config.validate()

    def __call__(self, model: Module, params: Any, batch: Any, key: Optional[jax.Array], *,
                 is_training: bool,
                 reference: Any = None) -> tuple[jax.Array, dict[str, jax.Array], Any]:
        c = self.config
        labels = batch["target_labels"]
        w = batch["target_weights"].astype(jnp.float32) * (labels >= 0)
        logp, entropy, collection = token_logprobs_and_entropy(model, params, batch, key,
                                                               is_training=is_training)
        old = batch["old_logprobs"].astype(jnp.float32)
        per_token, clipped = grpo_token_loss(logp, old, batch["advantages"],
                                             epsilon_low=c.epsilon_low,
                                             epsilon_high=c.epsilon_high)
        kl = jnp.zeros_like(logp)
        if c.beta > 0:
            if not has_adapters(params):
                raise ValueError("GRPOObjective.beta > 0: the KL reference is the model with "
                                 "its LoRA adapters off, and this model has none")
            ref, _, _ = token_logprobs_and_entropy(
                model, jax.lax.stop_gradient(adapters_off(params)), batch)
            d = ref - logp
            kl = jnp.exp(d) - d - 1.0
            per_token = per_token + c.beta * kl
        tokens = jnp.maximum(jnp.sum(w), 1.0)
        if c.loss_aggregation == "sequence_mean":
            rows = jnp.sum(per_token * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)
            loss = jnp.sum(rows) / jnp.maximum(jnp.sum(jnp.sum(w, axis=1) > 0), 1.0)
        elif c.loss_aggregation == "token_mean":
            loss = jnp.sum(per_token * w) / tokens
        else:
            assert c.max_completion_tokens is not None  # Config._field_problems.
            loss = jnp.sum(per_token * w) / (labels.shape[0] * c.max_completion_tokens)
        gap = jnp.abs(logp - old) * w
        metrics = {
            "loss": loss,
            "clip_fraction": jnp.sum(clipped * w) / tokens,
            "kl": jnp.sum(kl * w) / tokens,
            "ratio_mean": jnp.sum(jnp.exp(logp - old) * w) / tokens,
            "logprob_mismatch_max": jnp.max(gap),
            "logprob_mismatch_mean": jnp.sum(gap) / tokens,
            "entropy": jnp.sum(entropy * w) / tokens,
            "num_tokens": jnp.sum(w),
        }
        return loss, metrics, collection



def rollout_batch(rollouts: Any, advantages: Any, *, seq_len: int,
                  pad_id: int = 0) -> dict[str, Any]:
    """The training batch of `rollouts` (`sampler.Completion`s, prompt + completion per row):
    `input_ids`, `target_labels` (-1 on the prompt and padding), `target_weights` (1 on
    the completion), `positions`, `segment_ids`, `advantages` (each row's, from
    `advantages` [n], at every position) and `old_logprobs` [n, seq_len] (the sampler's,
    at the completion's targets). A rollout longer than seq_len + 1 tokens is an error
    naming it."""
    n = len(rollouts)
    out = {"input_ids": np.full((n, seq_len), pad_id, np.int32),
           "target_labels": np.full((n, seq_len), -1, np.int32),
           "target_weights": np.zeros((n, seq_len), np.float32),
           "positions": np.zeros((n, seq_len), np.int32),
           "segment_ids": np.zeros((n, seq_len), np.int32),
           "old_logprobs": np.zeros((n, seq_len), np.float32),
           "advantages": np.repeat(np.asarray(advantages, np.float32).reshape(n, 1),
                                   seq_len, axis=1)}
    for i, r in enumerate(rollouts):
        full = list(r.prompt_ids) + list(r.tokens)
        if len(full) > seq_len + 1:
            raise ValueError(f"rollout_batch: rollout {i} (prompt {r.prompt_index}) has "
                             f"{len(full)} tokens, over seq_len + 1 = {seq_len + 1}")
        m, p = len(full) - 1, len(r.prompt_ids)
        out["input_ids"][i, :m] = full[:-1]
        out["target_labels"][i, p - 1:m] = full[p:]
        out["target_weights"][i, p - 1:m] = 1.0
        out["positions"][i, :m] = np.arange(m)
        out["segment_ids"][i, :m] = 1
        out["old_logprobs"][i, p - 1:m] = r.logprobs
    return out
