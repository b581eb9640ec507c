"""Toy layers built only from jaxlearn.module primitives, shared by the module tests."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED
from jaxlearn.module import Module, ParameterSpec, with_logical_constraint, zeros


class Linear(Module):
    """y = x @ weight + bias; records the mean input as a summary."""

    class Config(Module.Config):
        input_dim: int = REQUIRED
        output_dim: int = REQUIRED

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        c = self.config
        return {
            "weight": ParameterSpec((c.input_dim, c.output_dim), ("embed", "mlp")),
            "bias": ParameterSpec((c.output_dim,), ("mlp",), initializer=zeros()),
        }

    def forward(self, x: jax.Array) -> jax.Array:
        p = self.parameters
        self.add_summary("mean", jnp.mean(x))
        return x @ p["weight"].astype(self.dtype) + p["bias"].astype(self.dtype)


class Block(Module):
    """Residual MLP block: x + down(tag(gelu(up(x)))); records `aux_loss`."""

    class Config(Module.Config):
        dim: int = REQUIRED
        hidden_dim: int = REQUIRED
        dropout_rate: float = 0.0

    def __init__(self, cfg: "Block.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        self._add_child("up", Linear.default_config().set(input_dim=c.dim, output_dim=c.hidden_dim))
        self._add_child(
            "down", Linear.default_config().set(input_dim=c.hidden_dim, output_dim=c.dim)
        )

    def forward(self, x: jax.Array) -> jax.Array:
        h = jnp.tanh(self.up(x))
        h = self.checkpoint_name(h, "hidden")
        rate = self.config.dropout_rate
        if self.is_training and rate > 0:
            keep = jax.random.bernoulli(self.prng_key, 1.0 - rate, h.shape)
            h = jnp.where(keep, h / (1.0 - rate), 0.0)
        h = with_logical_constraint(h, ("batch", "mlp"))
        y = self.down(h)
        self.add_module_output("aux_loss", jnp.mean(h**2))
        return x + y


class Stack(Module):
    """`num_layers` Blocks as named children ("layer0", ...), applied in order."""

    class Config(Module.Config):
        num_layers: int = 2
        block: Block.Config = Block.default_config()

    def __init__(self, cfg: "Stack.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        for i in range(self.config.num_layers):
            self._add_child(f"layer{i}", self.config.block)

    def forward(self, x: jax.Array) -> jax.Array:
        for i in range(self.config.num_layers):
            x = getattr(self, f"layer{i}")(x)
        return x


def block_config(dim: int = 8, hidden_dim: int = 16, **kw: Any) -> Block.Config:
    return Block.default_config().set(dim=dim, hidden_dim=hidden_dim, **kw)


def tree_paths(tree: Any) -> list[str]:
    """The key path of every leaf, to compare tree structures."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute difference over two pytrees of arrays."""
    diffs = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)
    return max(jax.tree.leaves(diffs), default=0.0)
