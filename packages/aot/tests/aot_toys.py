"""Small models for AOT/planner tests: a two-matmul language model whose FLOPs are known."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED
from jaxlearn.mesh import mesh_shape_from_axes
from jaxlearn.module import Module, Normal, ParameterSpec


class MlpLM(Module):
    """logits = (x + relu(x @ w1) @ w2) @ out with x = table[ids]; every weight has an
    `embed` axis (FSDP shards it). Matmul FLOPs per token forward: 2 * (2*D*H + D*V)."""

    class Config(Module.Config):
        vocab_size: int = REQUIRED
        dim: int = 64
        hidden: int = 128

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        c = self.config
        init = Normal.default_config().set(stddev=0.02)
        return {
            "table": ParameterSpec((c.vocab_size, c.dim), ("vocab", "embed"), initializer=init),
            "w1": ParameterSpec((c.dim, c.hidden), ("embed", "mlp"), initializer=init),
            "w2": ParameterSpec((c.hidden, c.dim), ("mlp", "embed"), initializer=init),
            "out": ParameterSpec((c.dim, c.vocab_size), ("embed", "vocab"), initializer=init),
        }

    def forward(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        p = self.parameters
        x = p["table"][batch["input_ids"]]
        x = x + jax.nn.relu(x @ p["w1"]) @ p["w2"]
        logits = x @ p["out"]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        labels, weights = batch["target_labels"], batch["target_weights"]
        ce = -jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        loss = jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)
        return loss, {"num_target_tokens": jnp.sum(weights)}


def mlp_trainer_config(**sizes: int) -> Any:
    """The toy trainer config with MlpLM (vocab 128) and batch 8 x 16 tokens."""
    from toy import toy_trainer_config

    cfg = toy_trainer_config("/tmp/unused-aot", mesh_shape=mesh_shape_from_axes(**sizes))
    cfg.model = MlpLM.default_config().set(vocab_size=128)
    cfg.input.set(vocab_size=128)
    return cfg


def matmul_flops_per_step(cfg: Any) -> float:
    """Global matmul FLOPs of one train step (forward 2x, backward 4x per weight use)."""
    m, inp = cfg.model, cfg.input
    tokens = inp.global_batch_size * (inp.seq_len - 1)
    return 6.0 * tokens * (2 * m.dim * m.hidden + m.dim * m.vocab_size)
