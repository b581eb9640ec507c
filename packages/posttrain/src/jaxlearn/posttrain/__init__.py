"""jaxlearn.posttrain: post-training objectives on the same layers as pretraining and
serving: DPO (`DPOObjective`, a `Trainer.Config.objective`, on `PreferenceInput` pairs),
the GRPO loss (`GRPOObjective`, `group_advantages`, `rollout_batch`),
the trainer's token
log-probabilities, the LoRA reference policy (`adapters_off`) and the in-process sampler
(`EngineSampler`). See README.md."""

from jaxlearn.posttrain.dpo import DPOObjective, dpo_loss, sequence_logprobs
from jaxlearn.posttrain.grpo import GRPOObjective, group_advantages, rollout_batch
from jaxlearn.posttrain.logprobs import (
    adapters_off,
    has_adapters,
    token_logprobs,
    token_logprobs_and_entropy,
)
from jaxlearn.posttrain.preference_data import PreferenceInput, PreferenceSource, parse_pair
from jaxlearn.posttrain.sampler import EngineSampler, Rollout

__all__ = ["DPOObjective", "EngineSampler", "GRPOObjective", "PreferenceInput",
           "PreferenceSource", "Rollout", "adapters_off", "dpo_loss", "group_advantages",
           "has_adapters", "parse_pair", "rollout_batch", "sequence_logprobs", "token_logprobs",
           "token_logprobs_and_entropy"]
