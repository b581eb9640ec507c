"""jaxlearn.posttrain: post-training objectives on the same layers as pretraining and
serving: DPO (`DPOObjective`, a `Trainer.Config.objective`, on `PreferenceInput` pairs),
the trainer's token
log-probabilities and the LoRA reference policy (`adapters_off`). See README.md."""

from jaxlearn.posttrain.dpo import DPOObjective, dpo_loss, sequence_logprobs
from jaxlearn.posttrain.logprobs import adapters_off, has_adapters, token_logprobs
from jaxlearn.posttrain.preference_data import PreferenceInput, PreferenceSource, parse_pair

__all__ = ["DPOObjective", "PreferenceInput", "PreferenceSource", "adapters_off", "dpo_loss",
           "has_adapters", "parse_pair", "sequence_logprobs", "token_logprobs"]
