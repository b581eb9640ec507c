"""Int8Dot / Fp8Dot: error against f32, gradients, saturation, delayed scaling, learning."""

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxlearn.config import REQUIRED
from jaxlearn.layers.dense import DotGeneral, Linear
from jaxlearn.layers.quantized import Fp8Dot, Int8Dot, QuantizationError
from jaxlearn.module import Module, functional


def _rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _operands(tokens: int = 64, din: int = 96, dout: int = 48) -> tuple:
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (tokens, din))
    w = jax.random.normal(k2, (din, dout)) / np.sqrt(din)
    g = jax.random.normal(k3, (tokens, dout))
    return x, w, g


def _grads(dot: Any, x: jax.Array, w: jax.Array, g: jax.Array) -> tuple:
    return jax.grad(lambda x, w: jnp.sum(dot(x, w) * g), argnums=(0, 1))(x, w)


INT8 = Int8Dot.default_config()
FP8 = Fp8Dot.default_config()


# ---- int8 --------------------------------------------------------------------------------


def _np_int8_reference(x: np.ndarray, w: np.ndarray, bits: int = 8) -> np.ndarray:
    """Per-row (x) / per-output-column (w) symmetric quantise-dequantise, then matmul."""
    q = 2 ** (bits - 1) - 1
    x, w = x.astype(np.float64), w.astype(np.float64)
    sx = np.abs(x).max(axis=1, keepdims=True) / q
    sw = np.abs(w).max(axis=0, keepdims=True) / q
    qx = np.clip(np.round(x / sx), -q, q)
    qw = np.clip(np.round(w / sw), -q, q)
    return (qx @ qw) * sx * sw


@pytest.mark.parametrize("bits,bound", [(8, 0.02), (4, 0.3)])
def test_int8_forward_matches_per_channel_reference_and_f32(bits: int, bound: float) -> None:
    x, w, _ = _operands()
    y = INT8.clone(bits=bits).instantiate()(x, w)
    assert y.dtype == jnp.float32 and y.shape == (64, 48)
    # Exactly the per-channel quantised product (int32 accumulation is exact).
    np.testing.assert_allclose(
        y, _np_int8_reference(np.asarray(x), np.asarray(w), bits), rtol=1e-5, atol=1e-5
    )
    err = _rel(y, np.asarray(x, np.float64) @ np.asarray(w, np.float64))
    assert err < bound, err  # measured: 0.0088 (int8), 0.16 (int4)


def test_int8_scales_are_per_row_and_per_column() -> None:
    x, w, _ = _operands()
    # A huge row (or column) must not degrade the other rows' (columns') precision.
    x_big = x.at[0].multiply(1e4)
    w_big = w.at[:, 0].multiply(1e4)
    dot = INT8.instantiate()
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert _rel(dot(x_big, w)[1:], ref[1:]) < 0.02
    assert _rel(dot(x, w_big)[:, 1:], ref[:, 1:]) < 0.02


def test_int8_uses_integer_matmul() -> None:
    x, w, _ = _operands(8, 16, 8)
    text = jax.jit(INT8.instantiate()).lower(x, w).as_text()
    assert "xi8>" in text and "xi32>" in text  # s8 operands, s32 accumulator


def test_int8_gradient_is_straight_through() -> None:
    x, w, g = _operands()
    gx, gw = _grads(INT8.instantiate(), x, w, g)
    rx, rw = _grads(lambda a, b: a @ b, x, w, g)
    assert _rel(gx, rx) < 1e-6 and _rel(gw, rw) < 1e-6


def test_int8_zero_and_bf16_inputs() -> None:
    dot = INT8.instantiate()
    assert not np.any(dot(jnp.zeros((4, 8)), jnp.zeros((8, 3))))
    x, w, g = _operands()
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    y = jax.jit(dot)(xb, wb)
    assert y.dtype == jnp.bfloat16
    assert _rel(y, np.asarray(x, np.float64) @ np.asarray(w, np.float64)) < 0.03
    gx, gw = _grads(dot, xb, wb, g.astype(jnp.bfloat16))
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    rx, rw = _grads(lambda a, b: a @ b, x, w, g)
    assert _rel(gx, rx) < 0.02 and _rel(gw, rw) < 0.02


# ---- fp8 ---------------------------------------------------------------------------------


def _np_fp8_reference(x: jax.Array, w: jax.Array) -> np.ndarray:
    """Per-tensor current scaling emulated by casting through float8_e4m3fn."""

    def qdq(t: jax.Array) -> np.ndarray:
        s = float(jnp.max(jnp.abs(t))) / 448.0
        return np.asarray((t / s).astype(jnp.float8_e4m3fn), np.float64) * s

    return qdq(x) @ qdq(w)


def test_fp8_forward_error() -> None:
    x, w, _ = _operands()
    y = FP8.instantiate()(x, w)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, _np_fp8_reference(x, w), rtol=1e-4, atol=1e-4)
    err = _rel(y, np.asarray(x, np.float64) @ np.asarray(w, np.float64))
    # e4m3 keeps 3 mantissa bits: ~2^-4/sqrt(3) = 3.6% rms per operand element.
    assert err < 0.06, err  # measured: 0.036


def test_fp8_gradients_finite_and_close() -> None:
    x, w, g = _operands()
    gx, gw = jax.jit(lambda x, w, g: _grads(FP8.instantiate(), x, w, g))(x, w, g)
    rx, rw = _grads(lambda a, b: a @ b, x, w, g)
    assert np.all(np.isfinite(gx)) and np.all(np.isfinite(gw))
    # e5m2 gradient (2 mantissa bits) times e4m3 operands.
    assert _rel(gx, rx) < 0.12 and _rel(gw, rw) < 0.12  # measured: 0.061, 0.061


def test_fp8_uses_e4m3_forward_and_e5m2_backward() -> None:
    x, w, g = _operands(8, 16, 8)
    fwd = jax.jit(FP8.instantiate()).lower(x, w).as_text()
    assert "f8E4M3FN" in fwd and "f8E5M2" not in fwd
    bwd = jax.jit(lambda x, w, g: _grads(FP8.instantiate(), x, w, g)).lower(x, w, g).as_text()
    assert "f8E5M2" in bwd


def test_fp8_saturates_instead_of_nan() -> None:
    x, w, g = _operands()
    x = x.at[0, 0].set(1e6)  # Outlier: current scaling adapts, nothing overflows.
    y = FP8.instantiate()(x, w)
    assert np.all(np.isfinite(y))
    gx, gw = _grads(FP8.instantiate(), x, w, g * 1e5)
    assert np.all(np.isfinite(gx)) and np.all(np.isfinite(gw))


def test_fp8_delayed_scaling_history() -> None:
    x, w, g = _operands()
    dot = FP8.clone(scaling="delayed", amax_history_length=4).instantiate()
    with pytest.raises(QuantizationError, match="call_with_history"):
        dot(x, w)
    hist = dot.init_amax_history()
    assert hist["x"].shape == (4,) and not np.any(hist["x"])
    # Step 1: empty history -> falls back to the current amax (same as current scaling).
    y1, hist = jax.jit(dot.call_with_history)(x, w, hist)
    np.testing.assert_allclose(y1, FP8.instantiate()(x, w), rtol=1e-6)
    np.testing.assert_allclose(hist["x"], [float(jnp.max(jnp.abs(x))), 0, 0, 0], rtol=1e-6)
    # Step 2: x grew 2x; the stale (delayed) scale saturates its largest values, finitely.
    y2, hist = dot.call_with_history(2 * x, w, hist)
    np.testing.assert_allclose(hist["x"][:2], [2 * float(jnp.max(jnp.abs(x))), hist["x"][1]])
    assert np.all(np.isfinite(y2)) and _rel(y2, 2 * (x @ w)) < 0.3
    # Step 3: the history now covers the larger amax; error back at the fp8 level.
    y3, hist = dot.call_with_history(2 * x, w, hist)
    assert _rel(y3, 2 * (x @ w)) < 0.06
    # Gradients flow to x and w (not into the history).
    gx, gw = jax.grad(
        lambda x, w: jnp.sum(dot.call_with_history(x, w, hist)[0] * g), argnums=(0, 1)
    )(x, w)
    rx, rw = _grads(lambda a, b: a @ b, x, w, g)
    assert _rel(gx, rx) < 0.12 and _rel(gw, rw) < 0.12


def test_config_validation_and_contract() -> None:
    with pytest.raises(QuantizationError, match="bits"):
        INT8.clone(bits=9).instantiate()
    with pytest.raises(QuantizationError, match="scaling"):
        FP8.clone(scaling="just_in_time").instantiate()
    with pytest.raises(QuantizationError, match="x2d"):
        INT8.instantiate()(jnp.ones((2, 3, 4)), jnp.ones((4, 5)))
    assert isinstance(INT8.instantiate(), DotGeneral) and isinstance(FP8.instantiate(), DotGeneral)


@pytest.mark.parametrize("cfg", [INT8, FP8], ids=["int8", "fp8"])
def test_vmapped_over_experts(cfg: Any) -> None:
    x = jax.random.normal(jax.random.key(1), (3, 10, 16))
    w = jax.random.normal(jax.random.key(2), (3, 16, 8)) / 4
    y = jax.vmap(cfg.instantiate())(x, w)
    assert _rel(y, jnp.einsum("eti,eio->eto", x, w)) < 0.06


# ---- a tiny model still learns -----------------------------------------------------------


class _MLP(Module):
    class Config(Module.Config):
        dim: int = REQUIRED
        hidden: int = 32
        dot: Optional[DotGeneral.Config] = None

    def __init__(self, cfg: "_MLP.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        lin = Linear.default_config().set(dot=c.dot, use_bias=True)
        self._add_child("up", lin.clone(input_dim=c.dim, output_dim=c.hidden))
        self._add_child("down", lin.clone(input_dim=c.hidden, output_dim=1))

    def forward(self, x: jax.Array) -> jax.Array:
        return self.down(jnp.tanh(self.up(x)))


@pytest.mark.parametrize("dot", [INT8, FP8], ids=["int8", "fp8"])
def test_tiny_mlp_learns_with_quantized_dots(dot: Any) -> None:
    model = _MLP.default_config().set(name="mlp", dim=8, dot=dot).instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (256, 8))
    y = jnp.sin(x @ jax.random.normal(kw, (8, 1)))

    def loss_fn(p: Any) -> jax.Array:
        pred, _ = functional(model, None, p, (x,))
        return jnp.mean((pred - y) ** 2)

    opt = optax.adam(1e-2)

    @jax.jit
    def step(p: Any, s: Any) -> tuple:
        loss, g = jax.value_and_grad(loss_fn)(p)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    state = opt.init(params)
    first = float(loss_fn(params))
    for _ in range(200):
        params, state, _ = step(params, state)
    last = float(loss_fn(params))
    assert np.isfinite(last) and last < 0.5 * first, (first, last)
