"""Direct preference optimisation (Rafailov et al. 2023) as a training objective.

    cfg.objective = DPOObjective.default_config().set(beta=0.1)   # on a LoRA model

A batch holds one pair per row, as `PreferenceInput` lays it out: `input_ids`,
`target_labels`, `target_weights`, `positions`, `segment_ids` of shape [batch, seq], the
prompt once and the two responses as branches of it (segment ids `(1 << 16) + 1` chosen,
`+ 2` rejected: `kernels.segments`), or of shape [batch, 2, seq], index 0 the chosen
response, 1 the rejected one (`shared_prompt=False`); weights 1 on the response's tokens
only (the prompt is context). Each sequence's log-probability is the weighted sum of its
tokens' (`length_normalized`: their mean; IPO always uses the mean, as its paper and TRL do).

With r = beta * (log pi(y|x) - log pi_ref(y|x)) for each response and z = r_chosen -
r_rejected (in units of beta):
  sigmoid   -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)   (eps: `label_smoothing`)
  ipo       (z / beta - 1 / (2 beta))^2
The reference policy of LoRA DPO is the model's own base: `reference="adapters_off"` runs
the same forward with every LoRA adapter zeroed (`logprobs.adapters_off`), so no second
copy of the weights exists; at step 0 (adapters initialised to add 0) policy == reference
and the sigmoid loss is exactly log 2. A full fine-tune uses `reference="ema"`: the
learner's EMA of the params, which with `learner.ema_decay=1.0` is the initial model,
frozen (one copy of the weights, checkpointed with the state, so a resumed run keeps its
reference); a decay below 1 is TR-DPO's soft reference update.
Metrics: loss, reward_chosen / reward_rejected / reward_margin (means of r), reward_accuracy
(share of pairs with r_chosen > r_rejected), logp_chosen / logp_rejected (policy), and
num_tokens.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp

from jaxlearn.kernels import shared_segment
from jaxlearn.module import Module
from jaxlearn.posttrain.logprobs import adapters_off, has_adapters, token_logprobs
from jaxlearn.runtime.objective import Objective

__all__ = ["DPOObjective", "dpo_loss", "sequence_logprobs"]

LOSS_TYPES = ("sigmoid", "ipo")


def sequence_logprobs(token_logp: jax.Array, weights: jax.Array, *,
                      mean: bool) -> jax.Array:
    """Per sequence: the weighted sum (or mean) of token log-probabilities [..., seq]."""
    total = jnp.sum(token_logp * weights, axis=-1)
    return total / jnp.maximum(jnp.sum(weights, axis=-1), 1.0) if mean else total


def dpo_loss(policy: jax.Array, reference: jax.Array, *, beta: float, loss_type: str,
             label_smoothing: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(mean loss, metrics) of pairs of sequence log-probabilities [batch, 2] (chosen,
    rejected) under the policy and the reference (module doc)."""
    ratios = policy - reference  # [batch, 2]
    z = ratios[:, 0] - ratios[:, 1]
    if loss_type == "sigmoid":
        losses = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * z)
                  - label_smoothing * jax.nn.log_sigmoid(-beta * z))
    elif loss_type == "ipo":
        losses = jnp.square(z - 1.0 / (2.0 * beta))
    else:
        raise ValueError(f"dpo_loss: loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    rewards = beta * ratios
    loss = jnp.mean(losses)
    return loss, {
        "loss": loss,
        "reward_chosen": jnp.mean(rewards[:, 0]),
        "reward_rejected": jnp.mean(rewards[:, 1]),
        "reward_margin": jnp.mean(rewards[:, 0] - rewards[:, 1]),
        "reward_accuracy": jnp.mean((rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)),
        "logp_chosen": jnp.mean(policy[:, 0]),
        "logp_rejected": jnp.mean(policy[:, 1]),
    }


class DPOObjective(Objective):
    """The DPO loss of a batch of (chosen, rejected) pairs (module doc)."""

    class Config(Objective.Config):
        beta: float = 0.1
        loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
        label_smoothing: float = 0.0
        length_normalized: bool = False
        # "adapters_off": the LoRA base (no copy); "ema": the learner's EMA of the params
        # (`learner.ema_decay=1.0`: the initial model, frozen; < 1: TR-DPO's soft update).
        reference: Literal["adapters_off", "ema"] = "adapters_off"

        def _field_problems(self) -> dict[str, str]:
            problems = {}
            if not self.beta > 0:
                problems["beta"] = f"must be > 0, got {self.beta!r}"
            if self.loss_type not in LOSS_TYPES:
                problems["loss_type"] = f"must be one of {LOSS_TYPES}, got {self.loss_type!r}"
            if not 0.0 <= self.label_smoothing < 0.5:
                problems["label_smoothing"] = f"must be in [0, 0.5), got {self.label_smoothing!r}"
            if self.reference not in ("adapters_off", "ema"):
                problems["reference"] = f"must be 'adapters_off' or 'ema', got {self.reference!r}"
            return problems

    def __init__(self, cfg: "DPOObjective.Config"):
        super().__init__(cfg)
        self.config.validate()

    def __call__(self, model: Module, params: Any, batch: Any, key: Optional[jax.Array], *,
                 is_training: bool,
                 reference: Any = None) -> tuple[jax.Array, dict[str, jax.Array], Any]:
        c = self.config
        if c.reference == "adapters_off" and not has_adapters(params):
            raise ValueError("DPOObjective.reference='adapters_off': the model has no LoRA "
                             "adapters (apply layers.use_lora, or for a full fine-tune set "
                             "objective.reference='ema' with learner.ema_decay=1.0)")
        if c.reference == "ema" and reference is None:
            raise ValueError("DPOObjective.reference='ema': the learner keeps no EMA; set "
                             "learner.ema_decay=1.0 (a frozen copy of the initial params)")
        ref_params = adapters_off(params) if c.reference == "adapters_off" else reference
        ids = batch["input_ids"]
        if ids.ndim == 2 and "segment_ids" in batch:  # [batch, seq]: a shared prompt.
            flat = batch
            member = flat["segment_ids"] - shared_segment(1, 0)
            sides = jnp.stack([member == 1, member == 2], axis=1)  # [batch, 2, seq]
        elif ids.ndim == 3 and ids.shape[1] == 2:
            flat = {k: v.reshape(2 * ids.shape[0], v.shape[-1]) for k, v in batch.items()}
            sides = None
        else:
            raise ValueError(f"DPOObjective: batch input_ids must be [batch, seq] with "
                             f"segment_ids (a shared prompt) or [batch, 2, seq] (chosen, "
                             f"rejected), got {ids.shape}")
        n = ids.shape[0]
        weights = flat["target_weights"].astype(jnp.float32) * (flat["target_labels"] >= 0)
        logp, collection = token_logprobs(model, params, flat, key, is_training=is_training)
        ref_logp, _ = token_logprobs(model, jax.lax.stop_gradient(ref_params), flat)
        mean = c.length_normalized or c.loss_type == "ipo"
        if sides is not None:  # Each branch's tokens, summed per pair.
            weights = weights[:, None, :] * sides
            logp, ref_logp = logp[:, None, :], ref_logp[:, None, :]
        policy = sequence_logprobs(logp, weights, mean=mean).reshape(n, 2)
        reference = sequence_logprobs(ref_logp, weights, mean=mean).reshape(n, 2)
        loss, metrics = dpo_loss(policy, reference, beta=c.beta, loss_type=c.loss_type,
                                 label_smoothing=c.label_smoothing)
        return loss, {**metrics, "num_tokens": jnp.sum(weights)}, collection
