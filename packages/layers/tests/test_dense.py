"""dense(), the custom-VJP matmul / einsum, DotGeneral injection and Linear."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.layers import DotGeneral, Linear, dense, einsum, matmul
from jaxlearn.layers.dense import matmul_nt
from jaxlearn.module import functional

BF16 = jnp.bfloat16


def _rand(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(key), shape, dtype)


def test_dense_shapes_and_values():
    x, w = _rand(0, (2, 3, 8)), _rand(1, (8, 4, 5))
    y = dense(x, w)
    assert y.shape == (2, 3, 4, 5)
    np.testing.assert_allclose(y, jnp.einsum("bsi,ihd->bshd", x, w), rtol=1e-5, atol=1e-5)
    # Two contracting dims (an output projection [heads, head_dim, embed]).
    o, wo = _rand(2, (2, 3, 4, 5)), _rand(3, (4, 5, 8))
    np.testing.assert_allclose(
        dense(o, wo, in_dims=2), jnp.einsum("bshd,hde->bse", o, wo), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="in dims"):
        dense(x, _rand(4, (7, 2)))


def test_dense_casts_weight_and_out_dtype():
    x, w = _rand(0, (3, 8), BF16), _rand(1, (8, 4))
    assert dense(x, w).dtype == BF16
    assert dense(x, w, out_dtype=jnp.float32).dtype == jnp.float32


def test_one_row_bf16_is_padded_and_equal():
    x, w = _rand(0, (1, 1, 16), BF16), _rand(1, (16, 8))
    y = dense(x, w, out_dtype=jnp.float32)
    ref = jnp.dot(x[0].astype(jnp.float32), w.astype(BF16).astype(jnp.float32))
    np.testing.assert_allclose(y[0], ref, rtol=1e-2, atol=1e-2)
    jaxpr = str(jax.make_jaxpr(lambda a: dense(a, w))(x))
    assert "concatenate" in jaxpr  # The GEMV became a 2-row GEMM.


@pytest.mark.parametrize("lead, n_in, n_out", [((12,), 8, 6), ((3, 5), 32, 4), ((2, 3), 16, 4)])
def test_matmul_custom_vjp_matches_autodiff_f32(lead, n_in, n_out):
    # (The bf16 form of a narrow weight's dW runs in test_attention's bf16 gradients.)
    # 4 * n_out <= n_in: a narrow weight (LoRA's A), whose dW is computed transposed.
    x, w = _rand(0, (*lead, n_in)), _rand(1, (n_in, n_out))
    g = _rand(2, (*lead, n_out))

    def loss(f, x, w):
        return jnp.sum(f(x, w) * g)

    ours = jax.grad(lambda x, w: loss(matmul, x, w), argnums=(0, 1))(x, w)
    ref = jax.grad(lambda x, w: loss(jnp.dot, x, w), argnums=(0, 1))(x, w)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_matmul_nt_equals_dense_of_transpose_with_gradients():
    """The tied-head form x @ w.T on the stored [out, in] layout: values and gradients of
    dense(x, w.T) in f32; bf16 operands in every dot, f32 gradient for f32 weights."""
    w = _rand(1, (10, 8))
    for shape in ((2, 3, 8), (1, 1, 8)):  # [1, 1, in] is the padded one-row GEMV.
        x, g = _rand(0, shape), _rand(2, (*shape[:-1], 10))
        np.testing.assert_allclose(matmul_nt(x, w), dense(x, w.T), rtol=1e-5, atol=1e-5)
        ours = jax.grad(lambda x, w: jnp.sum(matmul_nt(x, w) * g), argnums=(0, 1))(x, w)
        ref = jax.grad(lambda x, w: jnp.sum(jnp.dot(x, w.T) * g), argnums=(0, 1))(x, w)
        for a, b in zip(ours, ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    x = _rand(0, (1, 8), BF16)
    y = matmul_nt(x, w, out_dtype=jnp.float32)
    assert y.shape == (1, 10) and y.dtype == jnp.float32
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(matmul_nt(x, w)), argnums=(0, 1)))(x, w)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2 and "concatenate" in str(jaxpr)  # dx and dw (forward: unused).
    for eqn in dots:
        assert all(v.aval.dtype == BF16 for v in eqn.invars), eqn
    assert jax.grad(lambda w: jnp.sum(matmul_nt(x, w)))(w).dtype == jnp.float32


def test_einsum_custom_vjp_matches_autodiff_f32():
    q, k = _rand(0, (2, 5, 2, 3, 4)), _rand(1, (2, 7, 2, 4))
    spec = "bskgd,btkd->bkgst"
    g = _rand(2, (2, 2, 3, 5, 7))
    ours = jax.grad(lambda a, b: jnp.sum(einsum(spec, a, b) * g), argnums=(0, 1))(q, k)
    ref = jax.grad(lambda a, b: jnp.sum(jnp.einsum(spec, a, b) * g), argnums=(0, 1))(q, k)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_gradients_close_to_f32_and_dots_stay_bf16():
    x, w = _rand(0, (16, 32)), _rand(1, (32, 24))

    def loss(x, w, dtype):
        return jnp.sum(jnp.tanh(dense(x.astype(dtype), w, out_dtype=jnp.float32)))

    g32 = jax.grad(loss, argnums=(0, 1))(x, w, jnp.float32)
    g16 = jax.grad(loss, argnums=(0, 1))(x, w, BF16)
    for a, b in zip(g16, g32):
        rel = float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
        assert rel < 2e-2, rel
    assert g16[1].dtype == jnp.float32  # Master weights get f32 gradients.
    # Every dot in the backward pass has bf16 operands and accumulates in f32.
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, BF16)
    dots = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append(eqn)
            for p in eqn.params.values():
                if hasattr(p, "jaxpr") and hasattr(p.jaxpr, "eqns"):
                    walk(p.jaxpr)
                elif hasattr(p, "eqns"):
                    walk(p)

    walk(jaxpr.jaxpr)
    assert len(dots) == 3, dots
    for eqn in dots:
        assert all(v.aval.dtype == BF16 for v in eqn.invars), eqn


class _Doubling(DotGeneral):
    """A test dot: twice the plain product (so injection is observable)."""

    def __call__(self, x, w):
        return 2.0 * jnp.dot(x, w)


def test_linear_bias_and_injected_dot():
    cfg = Linear.default_config().set(name="lin", input_dim=8, output_dim=4, use_bias=True)
    lin = cfg.instantiate()
    params = lin.initialize_parameters_recursively(jax.random.key(0))
    assert {k: v.shape for k, v in params.items()} == {"weight": (8, 4), "bias": (4,)}
    params["bias"] = jnp.arange(4.0)
    x = _rand(1, (2, 3, 8))
    y, _ = functional(lin, None, params, (x,))
    np.testing.assert_allclose(y, x @ params["weight"] + params["bias"], rtol=1e-5, atol=1e-5)
    lin2 = cfg.clone(dot=_Doubling.default_config()).instantiate()
    y2, _ = functional(lin2, None, params, (x,))
    np.testing.assert_allclose(
        y2, 2 * (x @ params["weight"]) + params["bias"], rtol=1e-5, atol=1e-5
    )
