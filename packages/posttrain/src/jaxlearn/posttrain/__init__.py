"""jaxlearn.posttrain: post-training objectives on the same layers as pretraining and
serving: DPO (`DPOObjective`, a `Trainer.Config.objective`, on `PreferenceInput` pairs),
the trainer's token
log-probabilities, the LoRA reference policy (`adapters_off`) and the in-process sampler
(`EngineSampler`). See README.md."""

from jaxlearn.posttrain.dpo import DPOObjective, dpo_loss, sequence_logprobs
from jaxlearn.posttrain.logprobs import adapters_off, has_adapters, token_logprobs
from jaxlearn.posttrain.preference_data import PreferenceInput, PreferenceSource, parse_pair
from jaxlearn.posttrain.sampler import EngineSampler, Rollout

__all__ = ["DPOObjective", "EngineSampler", "PreferenceInput", "PreferenceSource", "Rollout",
           "adapters_off", "dpo_loss", "has_adapters", "parse_pair", "sequence_logprobs",
           "token_logprobs"]
