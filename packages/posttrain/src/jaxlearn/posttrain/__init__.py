"""jaxlearn.posttrain: post-training objectives on the same layers as pretraining and
serving: DPO (`DPOObjective`, a `Trainer.Config.objective`, on `PreferenceInput` pairs),
GRPO (`GRPOObjective`, a `Trainer.Config.rollout` `GRPORollout` that samples and
scores `PromptInput` prompts with reward functions), the trainer's token
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
from jaxlearn.posttrain.prompt_data import PromptInput, PromptSource
from jaxlearn.posttrain.rewards import load_rewards
from jaxlearn.posttrain.rollout import GRPORollout
from jaxlearn.posttrain.sampler import Completion, EngineSampler

__all__ = ["Completion", "DPOObjective", "EngineSampler", "GRPOObjective", "GRPORollout",
           "PreferenceInput", "PreferenceSource", "PromptInput", "PromptSource",
           "adapters_off", "dpo_loss", "group_advantages", "has_adapters", "load_rewards",
           "parse_pair", "rollout_batch", "sequence_logprobs", "token_logprobs",
           "token_logprobs_and_entropy"]
