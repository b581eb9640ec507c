"""What a training step minimises: `Objective(model, params, batch, key, is_training=...)
-> (loss, metrics, collection)`.

The default is the model's own forward (`CausalLM.forward`: next-token cross entropy).
Post-training swaps it by config (`Trainer.Config.objective`, e.g. `jaxlearn.posttrain.
DPOObjective`), so the model, its parameter tree, init_from, checkpoints and export stay
those of the plain recipe: only the loss changes. A reference policy other than the model
itself comes from the learner's EMA (`reference=`): decay 1.0 is a frozen copy of the
initial params, saved and restored with the state.
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from jaxlearn.config import Configurable
from jaxlearn.module import Module, functional


class Objective(Configurable):
    """The model's forward loss: `(loss, metrics), collection = functional(model, ...)`."""

    def __call__(self, model: Module, params: Any, batch: Any, key: Optional[jax.Array], *,
                 is_training: bool,
                 reference: Any = None) -> tuple[jax.Array, dict[str, jax.Array], Any]:
        """`reference`: the state's EMA of the params when the learner keeps one
        (`learner.ema_decay`; 1.0 keeps the initial params frozen), else None: what
        post-training objectives may use as their reference policy."""
        (loss, metrics), collection = functional(model, key, params, (batch,),
                                                 is_training=is_training)
        return loss, metrics, collection
