"""Activations and the position-wise FeedForward (plain or gated: SwiGLU, GeGLU)."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED
from jaxlearn.layers.dense import DotGeneral, dense, maybe_dot
from jaxlearn.module import FanAxes, Module, ParameterSpec, with_logical_constraint, zeros

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "linear": lambda x: x,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
}


def get_activation(name: str) -> Callable[[jax.Array], jax.Array]:
    if name not in ACTIVATIONS:
        raise ValueError(f"Unknown activation {name!r}; known: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class FeedForward(Module):
    """x [batch, seq, embed] -> [batch, seq, embed].

    Gated (two activations, e.g. ("silu", "linear") = SwiGLU, ("gelu_tanh", "linear") =
    GeGLU): wo(act0(x @ wi_0) * act1(x @ wi_1)). Params `wi_0`, `wi_1` [embed, mlp],
    `wo` [mlp, embed]. Plain (one activation): wo(act(x @ wi)), params `wi`, `wo`.
    Keeps x's [batch, seq] layout (see `dense`).
    """

    class Config(Module.Config):
        input_dim: int = REQUIRED  # Set by the parent layer.
        hidden_dim: int = REQUIRED
        activation: tuple[str, ...] = ("silu", "linear")
        use_bias: bool = False
        dot: Optional[DotGeneral.Config] = None
        # Gated only: one `wi_fused` [embed, 2 * mlp] (= [wi_0 | wi_1]) instead of two
        # matmuls. Single-device serving only (`composition.fuse_projections`).
        fused_gate: bool = False

    def __init__(self, cfg: "FeedForward.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        if len(c.activation) not in (1, 2):
            raise ValueError(f"{self.path()}.activation: one or two names, got {c.activation}")
        for name in c.activation:
            get_activation(name)
        self._dot = maybe_dot(c.dot)

    def _in_names(self) -> list[str]:
        return ["wi_0", "wi_1"] if len(self.config.activation) == 2 else ["wi"]

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        c = self.config
        fan = FanAxes((0,), (1,))
        specs = {}
        if c.fused_gate:
            if len(c.activation) != 2:
                raise ValueError(f"{self.path()}.fused_gate needs a gated FFN (two activations)")
            specs["wi_fused"] = ParameterSpec(
                (c.input_dim, 2 * c.hidden_dim), ("embed", None), fan_axes=fan
            )
            if c.use_bias:
                specs["wi_fused_bias"] = ParameterSpec(
                    (2 * c.hidden_dim,), (None,), initializer=zeros()
                )
        for name in [] if c.fused_gate else self._in_names():
            specs[name] = ParameterSpec((c.input_dim, c.hidden_dim), ("embed", "mlp"), fan_axes=fan)
            if c.use_bias:
                specs[f"{name}_bias"] = ParameterSpec(
                    (c.hidden_dim,), ("mlp",), initializer=zeros()
                )
        specs["wo"] = ParameterSpec((c.hidden_dim, c.input_dim), ("mlp", "embed"), fan_axes=fan)
        if c.use_bias:
            specs["wo_bias"] = ParameterSpec((c.input_dim,), ("embed",), initializer=zeros())
        return specs

    def _proj(self, x: jax.Array, name: str) -> jax.Array:
        p = self.parameters
        y = dense(x, p[name], dot=self._dot)
        if f"{name}_bias" in p:
            y = y + p[f"{name}_bias"].astype(y.dtype)
        return y

    def forward(self, x: jax.Array) -> jax.Array:
        c = self.config
        x = x.astype(self.dtype)
        if c.fused_gate:
            both = self._proj(x, "wi_fused")  # [..., 2 * mlp]
            pre = [both[..., : c.hidden_dim], both[..., c.hidden_dim :]]
        else:
            pre = [self._proj(x, n) for n in self._in_names()]
        hs = [get_activation(a)(self.checkpoint_name(h, "ffn_hidden"))
              for a, h in zip(c.activation, pre)]
        h = self.checkpoint_name(hs[0] * hs[1] if len(hs) == 2 else hs[0], "ffn_activation")
        y = self._proj(h, "wo")
        return with_logical_constraint(y, ("batch", "seq", "embed")) if y.ndim == 3 else y
