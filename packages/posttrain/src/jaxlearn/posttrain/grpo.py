"""Group-relative policy optimisation (GRPO, Shao et al. 2024) and its variants as a
training objective over sampled completions.

    adv = group_advantages(rewards, group_size=G, scale="group_std")   # [n] per completion
    cfg.objective = GRPOObjective.default_config().set(epsilon_low=0.2, epsilon_high=0.28,
                                                       loss_aggregation="token_mean")

A batch holds the sampled completions in one of two layouts (`rollout_batch`): one
completion per row, its prompt before it, or (`group=G`) a prompt's G completions in one
row as branches of the prompt, computed once (`kernels.segments`' shared-prefix segment
ids; each branch attends to the prompt and to itself, its positions continuing from the
prompt's). Features [rows, seq]: `input_ids`, `target_labels`, `target_weights` (1 on the
completions' tokens), `positions`, `segment_ids`, `advantages` (each completion's
advantage at its tokens; per-token credit fits the same field) and `old_logprobs` (the
sampling policy's log-probability of each target; the sampler's own,
`sampler.EngineSampler`, or a forward of the old params). A completion is a run of
weighted tokens with one segment id in a row (`completion_ids`), so the objective reads
both layouts alike. Per token, with
ratio = exp(logp - old_logp) and A the row's advantage:

    loss_t = -min(ratio A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) A)
             + beta * (exp(ref - logp) - (ref - logp) - 1)          (k3 KL estimate)

aggregated by `loss_aggregation`: "sequence_mean" (GRPO: each completion's token mean,
then the mean over completions), "token_mean" (DAPO: all tokens of the batch weigh the
same), "constant" (Dr. GRPO: the token sum over completions x `max_completion_tokens`, a
fixed budget that must be set, no length bias).
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

from jaxlearn.kernels import shared_segment
from jaxlearn.module import Module
from jaxlearn.posttrain.logprobs import adapters_off, has_adapters, token_logprobs_and_entropy
from jaxlearn.runtime.objective import Objective

__all__ = ["AGGREGATIONS", "GRPOObjective", "completion_ids", "group_advantages",
           "grpo_token_loss", "rollout_batch"]

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


def completion_ids(segment_ids: jax.Array) -> jax.Array:
    """[n, s] int32: the same id for the tokens of one run of equal segment ids in a row
    (a completion, in either batch layout), distinct over the batch, in [0, n * s)."""
    n, s = segment_ids.shape
    change = jnp.concatenate([jnp.ones((n, 1), bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return jnp.cumsum(change, axis=1, dtype=jnp.int32) - 1 + \
        jnp.arange(n, dtype=jnp.int32)[:, None] * s


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
        seq = batch.get("segment_ids")
        ids = completion_ids(jnp.ones_like(labels) if seq is None else seq)
        per_completion = jax.ops.segment_sum(w.reshape(-1), ids.reshape(-1),
                                             num_segments=ids.size)
        completions = jnp.maximum(jnp.sum(per_completion > 0), 1)
        if c.loss_aggregation == "sequence_mean":
            own = jnp.maximum(per_completion[ids], 1.0)  # Each token's completion's size.
            loss = jnp.sum(per_token * w / own) / completions
        elif c.loss_aggregation == "token_mean":
            loss = jnp.sum(per_token * w) / tokens
        else:
            assert c.max_completion_tokens is not None  # Config._field_problems.
            loss = jnp.sum(per_token * w) / (completions * c.max_completion_tokens)
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
            "num_completions": completions.astype(jnp.float32),
        }
        return loss, metrics, collection



def rollout_batch(rollouts: Any, advantages: Any, *, seq_len: int, pad_id: int = 0,
                  group: Optional[int] = None) -> dict[str, Any]:
    """The training batch of `rollouts` (`sampler.Completion`s, each prompt's consecutive)
    in the module doc's layout: a row per completion, its prompt before it (`group`
    None), or a row per `group` completions of one prompt, the prompt once (all but its
    last token, the shared prefix) and each completion a branch `[last prompt token,
    completion[:-1]]` predicting `completion`. -1 labels and 0 weights on the prompt and
    padding; `old_logprobs` the sampler's at the completions' targets. A row longer than
    seq_len slots is an error naming its prompt."""
    n = len(rollouts)
    rows = n if group is None else n // group
    if group is not None and (group < 1 or n % group):
        raise ValueError(f"rollout_batch: {n} rollouts are not whole groups of {group}")
    out = {"input_ids": np.full((rows, seq_len), pad_id, np.int32),
           "target_labels": np.full((rows, seq_len), -1, np.int32),
           "target_weights": np.zeros((rows, seq_len), np.float32),
           "positions": np.zeros((rows, seq_len), np.int32),
           "segment_ids": np.zeros((rows, seq_len), np.int32),
           "old_logprobs": np.zeros((rows, seq_len), np.float32),
           "advantages": np.zeros((rows, seq_len), np.float32)}
    adv = np.asarray(advantages, np.float32).reshape(n)
    members = [[i] for i in range(n)] if group is None else \
        [list(range(k * group, (k + 1) * group)) for k in range(rows)]
    for row, idx in enumerate(members):
        prompt = list(rollouts[idx[0]].prompt_ids)
        if any(list(rollouts[i].prompt_ids) != prompt for i in idx):
            raise ValueError(f"rollout_batch: rollouts {idx} of one group have different "
                             "prompts")
        p = len(prompt)
        need = p - 1 + sum(len(rollouts[i].tokens) for i in idx)
        if need > seq_len:
            raise ValueError(f"rollout_batch: row {row} (prompt {rollouts[idx[0]].prompt_index}"
                             f") needs {need} slots, over seq_len = {seq_len}")
        out["input_ids"][row, :p - 1] = prompt[:-1]
        out["positions"][row, :p - 1] = np.arange(p - 1)
        shared = group is not None
        out["segment_ids"][row, :p - 1] = shared_segment(1, 0) if shared else 1
        at = p - 1
        for member, i in enumerate(idx, start=1):
            tokens = list(rollouts[i].tokens)
            end = at + len(tokens)
            out["input_ids"][row, at:end] = ([prompt[-1]] + tokens)[:len(tokens)]
            out["target_labels"][row, at:end] = tokens
            out["target_weights"][row, at:end] = 1.0
            out["positions"][row, at:end] = np.arange(p - 1, p - 1 + len(tokens))
            out["segment_ids"][row, at:end] = shared_segment(1, member) if shared else 1
            out["old_logprobs"][row, at:end] = rollouts[i].logprobs
            out["advantages"][row, at:end] = adv[i]
            at = end
    return out
