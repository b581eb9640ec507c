"""Mixture of experts: a drop-in replacement for `FeedForward`.

    moe = MixtureOfExperts.default_config().set(
        input_dim=512, hidden_dim=1376, num_experts=8, num_experts_per_token=2)

Routing (per token, in float32): logits = x @ router; scores = softmax(logits) (or
sigmoid); the top-k scores pick the experts; with `normalize_top_k_weights` (default) the
k weights are divided by their sum — for softmax scores this is the softmax over the top-k
logits, exactly what HF `MixtralSparseMoeBlock` does. The token's output is the weighted sum
of its experts' FFN outputs (gated, e.g. SwiGLU, like `FeedForward`).

Dispatch:
  * `capacity_factor=None` (dropless): every assignment is computed.
    `dropless_method="ragged_dot"` sorts the (token, expert) assignments by expert and runs
    grouped matmuls (`jax.lax.ragged_dot`; on CPU `kernels.ragged_matmul`); `"dense"` runs
    every token through every expert and masks by the routing weights (exact, E/k times the
    FLOPs; meant for tiny models and as a reference). With a quantized `dot` (a
    `DotGeneral` subclass) the dense form is used, because the injectable dot contract is
    a plain 2-D matmul (vmapped over experts).
    The router always runs in float32 and is never quantized.
  * `capacity_factor=c`: GShard-style dispatch/combine tensors (einsum). Tokens are grouped
    per leading row (each sequence of `[batch, seq, embed]` is a group, so groups follow the
    batch sharding); each expert takes at most `C = min(S, ceil(c * S * k / E))` tokens of
    a group. Slots are filled in priority order: every token's first choice (in sequence
    order), then every token's second choice, and so on. Assignments beyond capacity are
    dropped (their weight is lost; the residual connection carries the token). The fraction
    of dropped assignments is the summary `dropped_fraction`.

Auxiliary losses (emitted as the module output `aux_loss`, already weighted):
  * load balancing (Switch / GShard): `E * sum_e f_e * P_e`, with f_e the fraction of the
    T*k assignments routed to expert e (before capacity drops) and P_e the mean router
    probability of e (sigmoid scores are normalised per token first). It is 1 for a
    perfectly balanced router and E at worst. (HF's `load_balancing_loss_func` divides the
    counts by T instead of T*k, so its value is k times this one.)
  * router z-loss (ST-MoE): `mean_t logsumexp(logits_t)**2`.
Summaries: `load_balance_loss`, `router_z_loss`, `dropped_fraction` (0 when dropless),
`max_expert_load` (E * max_e f_e: 1 when balanced).

Parameters (logical axes): `router [embed, expert]`, `wi_0`/`wi_1 [expert, embed, mlp]`
(gate / up; a single-activation FFN has `wi`), `wo [expert, mlp, embed]`. HF Mixtral maps
as `router = gate.weight.T`, `wi_0 = gate_up_proj[:, :H].transpose(0, 2, 1)`,
`wi_1 = gate_up_proj[:, H:].transpose(0, 2, 1)`, `wo = down_proj.transpose(0, 2, 1)`.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED
from jaxlearn.kernels.ragged_matmul import ragged_matmul
from jaxlearn.layers.dense import DotGeneral, SgemmDot, einsum, maybe_dot
from jaxlearn.layers.ffn import ACTIVATIONS, apply_activation
from jaxlearn.module import FanAxes, Module, ParameterSpec, with_logical_constraint

__all__ = ["MixtureOfExperts", "MoEConfigError", "expert_capacity"]

_EXPERT_FAN = FanAxes(in_axis=(-2,), out_axis=(-1,), batch_axis=(0,))


def expert_capacity(
    capacity_factor: float, group_size: int, num_experts_per_token: int, num_experts: int
) -> int:
    """Slots per expert for a group of `group_size` tokens:
    `min(group_size, ceil(capacity_factor * group_size * k / E))`, at least 1. (An expert
    never receives more than `group_size` assignments from a group: the k choices of a
    token are distinct experts.)"""
    want = math.ceil(capacity_factor * group_size * num_experts_per_token / num_experts)
    return max(1, min(group_size, want))


class MoEConfigError(ValueError):
    """An invalid MixtureOfExperts config; the message names the config path."""


class MixtureOfExperts(Module):
    """Top-k routed experts with capacity-based or dropless dispatch (see module doc)."""

    class Config(Module.Config):
        input_dim: int = REQUIRED  # Set by the parent (embed).
        hidden_dim: int = REQUIRED  # Per-expert FFN width (mlp).
        activation: tuple[str, ...] = ("silu", "linear")  # Two entries: gated (SwiGLU).
        dot: Optional[DotGeneral.Config] = None  # Injectable (quantized) 2-D dot.
        num_experts: int = REQUIRED
        num_experts_per_token: int = 2  # top-k
        router_scores: str = "softmax"  # softmax | sigmoid
        normalize_top_k_weights: bool = True  # Mixtral: weights / sum(top-k weights).
        capacity_factor: Optional[float] = None  # None: dropless.
        dropless_method: str = "ragged_dot"  # ragged_dot | dense
        load_balance_loss_weight: float = 0.01
        router_z_loss_weight: float = 0.0

    def __init__(self, cfg: "MixtureOfExperts.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        where = self.path()

        def bad(field: str, why: str) -> MoEConfigError:
            return MoEConfigError(f"{where}.{field}={getattr(c, field)!r}: {why}")

        if c.num_experts < 1:
            raise bad("num_experts", "must be >= 1")
        if not 1 <= c.num_experts_per_token <= c.num_experts:
            raise bad("num_experts_per_token", f"must be in [1, num_experts={c.num_experts}]")
        if c.router_scores not in ("softmax", "sigmoid"):
            raise bad("router_scores", "must be 'softmax' or 'sigmoid'")
        if len(c.activation) not in (1, 2):
            raise bad("activation", "must have one entry (plain) or two (gated)")
        for a in c.activation:
            if a not in ACTIVATIONS:
                raise bad("activation", f"unknown activation {a!r}; known: {sorted(ACTIVATIONS)}")
        if c.capacity_factor is not None and not c.capacity_factor > 0:
            raise bad("capacity_factor", "must be > 0, or None for dropless")
        if c.dropless_method not in ("ragged_dot", "dense"):
            raise bad("dropless_method", "must be 'ragged_dot' or 'dense'")
        # SgemmDot computes the default product on 2-D dense dots; the experts' grouped
        # matmuls keep XLA's (ragged_dot / the custom-VJP einsum).
        dot = maybe_dot(c.dot)
        self._dot = None if isinstance(dot, SgemmDot) else dot

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        c = self.config
        e, d, h = c.num_experts, c.input_dim, c.hidden_dim
        specs = {"router": ParameterSpec((d, e), ("embed", "expert"))}
        wi_names = ["wi_0", "wi_1"] if len(c.activation) == 2 else ["wi"]
        for name in wi_names:
            specs[name] = ParameterSpec((e, d, h), ("expert", "embed", "mlp"), fan_axes=_EXPERT_FAN)
        specs["wo"] = ParameterSpec((e, h, d), ("expert", "mlp", "embed"), fan_axes=_EXPERT_FAN)
        return specs

    def forward(self, x: jax.Array) -> jax.Array:
        """x: [..., seq, embed] (usually [batch, seq, embed]) -> the same shape."""
        c = self.config
        if x.ndim < 2 or x.shape[-1] != c.input_dim:
            raise MoEConfigError(
                f"{self.path()}: expected inputs [..., seq, {c.input_dim}], got {x.shape}"
            )
        shape = x.shape
        x = x.astype(self.dtype)
        tokens = x.reshape(-1, c.input_dim)
        logits, scores, top_w, top_idx = self._route(tokens)
        self._emit_aux_losses(logits, scores, top_idx)

        if c.capacity_factor is not None:
            groups = math.prod(shape[:-2])
            y = self._capacity_dispatch(
                x.reshape(groups, shape[-2], c.input_dim),
                top_w.reshape(groups, shape[-2], -1),
                top_idx.reshape(groups, shape[-2], -1),
            )
        else:
            self.add_summary("dropped_fraction", jnp.zeros((), jnp.float32))
            plain_dot = self._dot is None or type(self._dot) is DotGeneral
            if c.dropless_method == "ragged_dot" and plain_dot:
                y = self._dropless_ragged(tokens, top_w, top_idx)
            else:
                y = self._dropless_dense(tokens, top_w, top_idx)
        y = y.reshape(shape).astype(self.dtype)
        return with_logical_constraint(y, ("batch", "seq", "embed")) if y.ndim == 3 else y

    def _route(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """float32 router: logits [T, E], scores [T, E], top-k weights [T, k] and top-k
        expert ids [T, k]."""
        c = self.config
        router = self.parameters["router"].astype(jnp.float32)
        logits = jnp.dot(tokens.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)
        if c.router_scores == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
        top_w, top_idx = jax.lax.top_k(scores, c.num_experts_per_token)
        if c.normalize_top_k_weights:
            top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
        return logits, scores, top_w, top_idx

    def _emit_aux_losses(self, logits: jax.Array, scores: jax.Array, top_idx: jax.Array) -> None:
        c = self.config
        e, k = c.num_experts, c.num_experts_per_token
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        counts = jnp.sum(jax.nn.one_hot(top_idx, e, dtype=jnp.float32), axis=(0, 1))  # [E]
        frac = counts / (top_idx.shape[0] * k)
        load_balance = e * jnp.sum(frac * jnp.mean(probs, axis=0))
        z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        aux = c.load_balance_loss_weight * load_balance + c.router_z_loss_weight * z_loss
        self.add_module_output("aux_loss", aux)
        self.add_summary("load_balance_loss", load_balance)
        self.add_summary("router_z_loss", z_loss)
        self.add_summary("max_expert_load", e * jnp.max(frac))

    def _matmul(self, a: jax.Array, w: jax.Array) -> jax.Array:
        """a [E, N, in] x w [E, in, out] -> [E, N, out] per expert (through `dot` if set)."""
        w = w.astype(self.dtype)
        if self._dot is not None:
            return jax.vmap(self._dot)(a, w).astype(self.dtype)
        return einsum("eni,eio->eno", a, w)  # bf16-friendly custom VJP, f32 accumulation.

    def _ffn(self, x: jax.Array, mm: Callable[[jax.Array, str], jax.Array]) -> jax.Array:
        """wo(act(wi(x))) with mm(a, param name) the experts' matmul."""
        names = ["wi_0", "wi_1"] if len(self.config.activation) == 2 else ["wi"]
        return mm(apply_activation(self.config.activation, [mm(x, n) for n in names]), "wo")

    def _experts(self, xe: jax.Array) -> jax.Array:
        """Every expert's FFN on its own rows: xe [E, N, embed] -> [E, N, embed]."""
        return self._ffn(xe, lambda a, name: self._matmul(a, self.parameters[name]))

    def _dropless_dense(self, tokens: jax.Array, top_w: jax.Array, top_idx: jax.Array) -> jax.Array:
        e = self.config.num_experts
        combine = jnp.einsum("tk,tke->te", top_w, jax.nn.one_hot(top_idx, e, dtype=top_w.dtype))
        out = self._experts(jnp.broadcast_to(tokens, (e, *tokens.shape)))  # [E, T, D]
        return jnp.einsum("te,etd->td", combine, out, preferred_element_type=jnp.float32)

    def _dropless_ragged(
        self, tokens: jax.Array, top_w: jax.Array, top_idx: jax.Array
    ) -> jax.Array:
        """Assignments sorted by expert, one grouped matmul per weight. XLA:CPU lowers
        `ragged_dot` to one dense dot per expert over all rows (E times the work, a very
        slow compile): on CPU `kernels.ragged_matmul` (row blocks against each weight)."""
        return jax.lax.platform_dependent(
            tokens, top_w, top_idx, cpu=partial(self._dropless_sorted, ragged_matmul),
            default=partial(self._dropless_sorted, self._ragged_dot))

    def _ragged_dot(self, x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
        out = jax.lax.ragged_dot(x, w.astype(self.dtype), sizes,
                                 preferred_element_type=jnp.float32)
        return out.astype(self.dtype)

    def _dropless_sorted(self, grouped: Callable[..., jax.Array], tokens: jax.Array,
                         top_w: jax.Array, top_idx: jax.Array) -> jax.Array:
        c = self.config
        e, k = c.num_experts, c.num_experts_per_token
        p = self.parameters
        flat_expert = top_idx.reshape(-1)  # [T*k], assignment a = t*k + j
        order = jnp.argsort(flat_expert, stable=True)
        group_sizes = jnp.bincount(flat_expert, length=e).astype(jnp.int32)
        xs = jnp.take(tokens, order // k, axis=0)  # [T*k, D], grouped by expert

        out_sorted = self._ffn(xs, lambda a, name: grouped(a, p[name], group_sizes))
        out = jnp.take(out_sorted, jnp.argsort(order), axis=0)  # Back to assignment order.
        out = out.reshape(tokens.shape[0], k, -1)
        return jnp.einsum("tkd,tk->td", out.astype(jnp.float32), top_w)

    def _capacity_dispatch(self, x: jax.Array, top_w: jax.Array, top_idx: jax.Array) -> jax.Array:
        """x [G, S, D], top_w / top_idx [G, S, k] -> [G, S, D] (GShard dispatch/combine)."""
        c = self.config
        e, k = c.num_experts, c.num_experts_per_token
        g, s, d = x.shape
        cap = expert_capacity(c.capacity_factor, s, k, e)
        mask = jax.nn.one_hot(top_idx, e, dtype=jnp.int32)  # [G, S, k, E]
        # Priority: choice rank first, then sequence position -> cumsum over (k, S).
        ranked = mask.transpose(0, 2, 1, 3).reshape(g, k * s, e)
        position = (jnp.cumsum(ranked, axis=1) - 1).reshape(g, k, s, e).transpose(0, 2, 1, 3)
        slot = jnp.sum(position * mask, axis=-1)  # [G, S, k] slot in the chosen expert
        kept_b = slot < cap  # [G, S, k]
        kept = kept_b.astype(jnp.float32)
        slot_1h = jax.nn.one_hot(slot, cap, dtype=jnp.float32) * kept[..., None]  # [G,S,k,C]
        mask_f = mask.astype(jnp.float32)
        dispatch = jnp.einsum("gske,gskc->gsec", mask_f, slot_1h)  # 0/1
        combine = jnp.einsum("gske,gskc->gsec", mask_f * top_w[..., None], slot_1h)
        num_dropped = jnp.sum(jnp.logical_not(kept_b).astype(jnp.int32))
        self.add_summary("dropped_fraction", num_dropped.astype(jnp.float32) / kept_b.size)

        xe = jnp.einsum("gsec,gsd->egcd", dispatch.astype(x.dtype), x)  # [E, G, C, D]
        out = self._experts(xe.reshape(e, g * cap, d)).reshape(e, g, cap, d)
        return jnp.einsum(
            "gsec,egcd->gsd", combine, out.astype(jnp.float32), preferred_element_type=jnp.float32
        )
