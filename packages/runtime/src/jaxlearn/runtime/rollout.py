"""What makes a step's batch from the current policy: RL's sample-and-score.

    cfg.rollout = GRPORollout.default_config().set(rewards=["numeric_match"])

Plain training reads its batches from `input`. An RL recipe's input yields prompts
(`input` rows that are not yet a batch); before each step the trainer hands them, with the
current params and the step number, to `Trainer.Config.rollout`, which samples
completions from those params, scores them and returns the step's training batch (host
numpy, the shapes of `input.batch_shapes()`) and its scalars (reward, sampling time...),
which are logged with the step's own. The rollout must be a pure function of (rows, params,
step): the resumed run draws the same samples at the same step (bit-exact resume).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxlearn.config import Configurable


class Rollout(Configurable):
    """The interface: `bind` once, then `__call__` per step."""

    def bind(self, *, model_cfg: Any, input: Any, process_index: int,
             process_count: int, trainable: Any = None) -> None:
        """Called once before the first step with the model config, the built input (its
        tokenizer, template and rows) and the learner's `trainable` mask (a params-like
        tree, False where a parameter keeps its value for the whole run, e.g. a LoRA base;
        None: all train); raises what is wrong with them."""
        raise NotImplementedError(type(self).__name__)

    def __call__(self, rows: dict[str, np.ndarray], params: Any,
                 step: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """(this process's training batch, scalars) for `step` (1-based) from the input's
        `rows` and the policy's `params` (the trainer's, as they are before `step`)."""
        raise NotImplementedError(type(self).__name__)
