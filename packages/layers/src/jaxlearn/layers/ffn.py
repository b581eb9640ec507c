"""Activations and the position-wise FeedForward (plain or gated: SwiGLU, GeGLU)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED, InstantiableConfig
from jaxlearn.kernels.activations import silu, swiglu
from jaxlearn.layers.dense import Linear
from jaxlearn.module import Module, with_logical_constraint

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "linear": lambda x: x,
    "relu": jax.nn.relu,
    "silu": silu,  # jax.nn.silu as XLA:CPU evaluates it fastest (kernels.activations)
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


def apply_activation(names: Sequence[str], pre: Sequence[jax.Array]) -> jax.Array:
    """act0(pre[0]) * act1(pre[1]) (gated) or act(pre[0]); SwiGLU ("silu", "linear") as
    one op each way (`kernels.activations.swiglu`)."""
    if tuple(names) == ("silu", "linear"):
        return swiglu(pre[0], pre[1])
    hs = [get_activation(a)(h) for a, h in zip(names, pre)]
    return hs[0] * hs[1] if len(hs) == 2 else hs[0]


class FeedForward(Module):
    """x [batch, seq, embed] -> [batch, seq, embed].

    Gated (two activations, e.g. ("silu", "linear") = SwiGLU, ("gelu_tanh", "linear") =
    GeGLU): wo(act0(wi_0(x)) * act1(wi_1(x))). Plain (one activation): wo(act(wi(x))).
    The projections are `Linear` children built from the `wi` config (children `wi`, or
    `wi_0` and `wi_1`: [embed] -> [mlp]) and the `wo` config ([mlp] -> [embed]); params
    `<child>.weight` (+ `<child>.bias` with `use_bias`). `wi_fused` set (gated only): one
    child [embed] -> [2 * mlp] (= [wi_0 | wi_1]) in place of wi_0 / wi_1
    (`composition.fuse_projections`). Keeps x's [batch, seq] layout (see `dense`).
    """

    class Config(Module.Config):
        input_dim: int = REQUIRED  # Set by the parent layer.
        hidden_dim: int = REQUIRED
        activation: tuple[str, ...] = ("silu", "linear")
        use_bias: bool = False
        # The input projection(s) (every child of a gated FFN is a clone) and the output one.
        wi: InstantiableConfig = Linear.default_config()
        wo: InstantiableConfig = Linear.default_config()
        # Gated only: one projection in place of wi_0 / wi_1 (single-device serving).
        wi_fused: Optional[InstantiableConfig] = None

    def __init__(self, cfg: "FeedForward.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        if len(c.activation) not in (1, 2):
            raise ValueError(f"{self.path()}.activation: one or two names, got {c.activation}")
        for name in c.activation:
            get_activation(name)
        d, f = c.input_dim, c.hidden_dim
        if c.wi_fused is not None:
            if len(c.activation) != 2:
                raise ValueError(f"{self.path()}.wi_fused needs a gated FFN (two activations)")
            self._add_child("wi_fused", c.wi_fused.clone(
                input_dim=d, output_dim=2 * f, weight_axes=("embed", None), use_bias=c.use_bias))
        else:
            for name in self._in_names():
                self._add_child(name, c.wi.clone(
                    input_dim=d, output_dim=f, weight_axes=("embed", "mlp"), use_bias=c.use_bias))
        self._add_child("wo", c.wo.clone(
            input_dim=f, output_dim=d, weight_axes=("mlp", "embed"), use_bias=c.use_bias))

    def _in_names(self) -> list[str]:
        return ["wi_0", "wi_1"] if len(self.config.activation) == 2 else ["wi"]

    def forward(self, x: jax.Array) -> jax.Array:
        c = self.config
        x = x.astype(self.dtype)
        if "wi_fused" in self.children:
            both = self.wi_fused(x)  # [..., 2 * mlp]
            pre = [both[..., : c.hidden_dim], both[..., c.hidden_dim :]]
        else:
            pre = [self.children[n](x) for n in self._in_names()]
        pre = [self.checkpoint_name(h, "ffn_hidden") for h in pre]
        h = self.checkpoint_name(apply_activation(c.activation, pre), "ffn_activation")
        y = self.wo(h)
        return with_logical_constraint(y, ("batch", "seq", "embed")) if y.ndim == 3 else y
