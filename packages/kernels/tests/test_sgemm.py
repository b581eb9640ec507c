"""oneMKL's f32 GEMM through the FFI (`kernels.sgemm`) against numpy in f64: every
transpose form, row and column splits, odd sizes, an empty depth, a summed addend
(aliased or copied); `sgemm_matmul`'s and `sgemm_lora_matmul`'s gradients against XLA's
autodiff of `jnp.dot`; wrong inputs fail naming the shapes."""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlearn.kernels import mkl
from jaxlearn.kernels import sgemm as sgemm_lib
from jaxlearn.kernels.sgemm import (
    sgemm,
    sgemm_lora_matmul,
    sgemm_matmul,
    sgemm_matmul_nt,
    sgemm_runs,
    unavailable_reason,
)

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or platform.machine() not in ("x86_64", "AMD64"),
    reason="oneMKL's sgemm runs on x86-64 CPU backends only")


def test_runs_on_this_cpu() -> None:
    # The `mkl` requirement and a C++ compiler are there: a failed build must not hide.
    assert unavailable_reason() is None


def test_small_gemms_take_fewer_blocks() -> None:
    # A LoRA adapter's rank-8 product at 1024 tokens (9.4 MFLOP): 2 blocks of >= 4 MFLOP; a
    # projection's: every CPU's share; a tiny one: a single task.
    most = sgemm_lib._BLOCKS_PER_CPU * mkl.host_threads()
    assert sgemm_lib._parts(2 * 1024 * 576 * 8) == min(2, most)
    assert sgemm_lib._parts(2 * 1024 * 576 * 576) == most
    assert sgemm_lib._parts(2 * 4 * 4 * 4) == 1


def test_not_chosen_with_several_devices() -> None:
    # The tests run with 8 CPU devices: the FFI call is opaque to SPMD partitioning, so
    # `SgemmDot`'s "auto" must not pick it here, whatever the CPU.
    assert jax.device_count() > 1 and not sgemm_runs()


def _operands(rng: np.random.Generator, m: int, k: int, n: int, ta: bool, tb: bool
              ) -> tuple[np.ndarray, np.ndarray]:
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    return a, b


def _reference(a: np.ndarray, b: np.ndarray, ta: bool, tb: bool) -> np.ndarray:
    return (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 40), n=st.integers(1, 70),
       ta=st.booleans(), tb=st.booleans(), seed=st.integers(0, 2**16))
def test_every_transpose_form_matches_numpy(m: int, k: int, n: int, ta: bool, tb: bool,
                                            seed: int) -> None:
    # m >= n splits c's rows over the pool, m < n its columns: both, with tails.
    a, b = _operands(np.random.default_rng(seed), m, k, n, ta, tb)
    c = jax.jit(lambda x, y: sgemm(x, y, trans_a=ta, trans_b=tb))(a, b)
    assert c.shape == (m, n) and c.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(c), _reference(a, b, ta, tb), rtol=1e-5, atol=1e-4)


def test_larger_blocks_and_an_empty_depth() -> None:
    rng = np.random.default_rng(0)
    for m, k, n in ((300, 96, 40), (33, 128, 257)):
        a, b = _operands(rng, m, k, n, False, True)
        np.testing.assert_allclose(np.asarray(sgemm(jnp.asarray(a), jnp.asarray(b),
                                                    trans_b=True)),
                                   _reference(a, b, False, True), rtol=1e-5, atol=1e-3)
    empty = sgemm(jnp.zeros((3, 0)), jnp.zeros((0, 5)))
    np.testing.assert_array_equal(np.asarray(empty), np.zeros((3, 5), np.float32))


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 11), m=st.integers(1, 40), k=st.integers(1, 24),
       n=st.integers(1, 40), ta=st.booleans(), tb=st.booleans(), seed=st.integers(0, 2**16))
def test_batched_operands_match_numpy_per_entry(batch: int, m: int, k: int, n: int, ta: bool,
                                                tb: bool, seed: int) -> None:
    # [batch, ...] operands: one GEMM per entry, the entries split over the pool (more
    # entries than the call's parts, and fewer).
    rng = np.random.default_rng(seed)
    pairs = [_operands(rng, m, k, n, ta, tb) for _ in range(batch)]
    a, b = np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
    c = jax.jit(lambda x, y: sgemm(x, y, trans_a=ta, trans_b=tb))(a, b)
    assert c.shape == (batch, m, n)
    for i, (ai, bi) in enumerate(pairs):
        np.testing.assert_allclose(np.asarray(c[i]), _reference(ai, bi, ta, tb), rtol=1e-5,
                                   atol=1e-4, err_msg=f"entry {i}")


@pytest.mark.parametrize("nt,batch", [(False, ()), (True, ()), (False, (5,)), (True, (5,))])
def test_matmul_gradients_match_xla_autodiff(nt: bool, batch: tuple[int, ...]) -> None:
    """`sgemm_matmul` (w [in, out]) and `sgemm_matmul_nt` (w [out, in], used as w^T), 2-D
    and batched ([5, ...]: attention's products)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((*batch, 37, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((*batch, *((19, 24) if nt else (24, 19)))), jnp.float32)
    t = jnp.asarray(rng.standard_normal((*batch, 37, 19)), jnp.float32)
    ours = sgemm_matmul_nt if nt else sgemm_matmul

    def loss(dot, x, w):  # A non-trivial cotangent: d loss / d y = t * cos(y).
        return jnp.sum(jnp.sin(dot(x, w)) * t)

    def xla(a, b):
        return jnp.matmul(a, jnp.swapaxes(b, -1, -2) if nt else b, precision="highest")

    got = jax.jit(jax.value_and_grad(lambda x, w: loss(ours, x, w), (0, 1)))(x, w)
    ref = jax.value_and_grad(lambda x, w: loss(xla, x, w), (0, 1))(x, w)
    np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-5)
    for g, r in zip(got[1], ref[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(0, 40), n=st.integers(1, 70),
       ta=st.booleans(), tb=st.booleans(), seed=st.integers(0, 2**16))
def test_an_addend_is_summed_by_the_gemm(m: int, k: int, n: int, ta: bool, tb: bool,
                                         seed: int) -> None:
    # Row and column splits (m >= n, m < n), an empty depth (c = d), and d both donated to
    # the call (aliased: summed in place) and still live after it (XLA copies it first).
    rng = np.random.default_rng(seed)
    a, b = _operands(rng, m, k, n, ta, tb)
    d = rng.standard_normal((m, n)).astype(np.float32)
    want = _reference(a, b, ta, tb) + d

    def both(x, y, e):  # e is used again after the call: not aliased.
        return sgemm(x, y, trans_a=ta, trans_b=tb, add=e), e * 2.0

    c, twice = jax.jit(both)(a, b, d)
    np.testing.assert_allclose(np.asarray(c), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(twice), d * 2.0)  # d itself unchanged.
    c = jax.jit(lambda x, y, e: sgemm(x, y, trans_a=ta, trans_b=tb, add=e + 1.0))(a, b, d)
    np.testing.assert_allclose(np.asarray(c), want + 1.0, rtol=1e-5, atol=1e-4)


def test_lora_matmul_and_its_gradients_match_xla_autodiff() -> None:
    """x @ w + scale * x @ a @ b, all four gradients; with w frozen (stop_gradient, as a
    LoRA model's base weight) the same for x, a and b."""
    rng = np.random.default_rng(2)
    # The adapter's factors scaled so that y stays O(1) (sin's sum is then well conditioned).
    x, w, a, b, t = (jnp.asarray(rng.standard_normal(s) * f, jnp.float32)
                     for s, f in (((37, 24), 1), ((24, 19), 1), ((24, 4), 0.2), ((4, 19), 0.2),
                                  ((37, 19), 1)))

    def xla(x, w, a, b, scale):
        hi = dict(precision="highest")
        return jnp.matmul(x, w, **hi) + scale * jnp.matmul(jnp.matmul(x, a, **hi), b, **hi)

    def loss(dot, x, w, a, b, frozen=False):
        w = jax.lax.stop_gradient(w) if frozen else w
        return jnp.sum(jnp.sin(dot(x, w, a, b, 2.5)) * t)

    for frozen in (False, True):
        args = (0, 2, 3) if frozen else (0, 1, 2, 3)
        got = jax.jit(jax.value_and_grad(
            lambda *p: loss(sgemm_lora_matmul, *p, frozen=frozen), args))(x, w, a, b)
        ref = jax.value_and_grad(lambda *p: loss(xla, *p, frozen=frozen), args)(x, w, a, b)
        np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-5)
        for g, r in zip(got[1], ref[1], strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("a_shape,b_shape,kw,match", [
    ((4, 3), (5, 2), {}, r"op\(a\) is \[4, 3\] but op\(b\) is \[5, 2\]"),
    ((4, 3), (2, 5), {"trans_b": True}, r"op\(a\) is \[4, 3\] but op\(b\) is \[5, 2\]"),
    ((2, 4, 3), (3, 2), {}, r"both 3-D with one batch, got float32\[2, 4, 3\]"),
    ((2, 4, 3), (3, 3, 2), {}, r"both 3-D with one batch, got float32\[2, 4, 3\] and "),
    ((2, 2, 4, 3), (2, 2, 3, 2), {}, r"float32\[2, 2, 4, 3\]"),
])
def test_bad_operands_name_the_shapes(a_shape, b_shape, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        sgemm(jnp.zeros(a_shape), jnp.zeros(b_shape), **kw)
    with pytest.raises(ValueError, match=r"add must be float32 \[4, 2\] with 2-D operands, "
                                         r"got float32\[2, 4\]"):
        sgemm(jnp.zeros((4, 3)), jnp.zeros((3, 2)), add=jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"one batch, got bfloat16\[4, 3\]"):
        sgemm(jnp.zeros((4, 3), jnp.bfloat16), jnp.zeros((3, 2)))
