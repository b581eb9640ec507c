"""The packed matmul against numpy, on both backends (oneMKL, and the AVX-512 BF16 / VNNI
kernels where the CPU has them): f32 and bf16 weights, any row count, column blocks and
panels that do not divide the width, odd depths, inside jit and a scanned stack of ids;
int8 weights bit for bit against XLA's `int8_matmul` (and so the two backends against each
other); freed ids and wrong inputs fail with errors naming them."""

from __future__ import annotations

import functools
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlearn.kernels import (
    PackedTable,
    PackedWeights,
    int8_matmul,
    mkl,
    packed_matmul,
    quantize_int8,
)
from jaxlearn.kernels.packed_gemm import unavailable_reason

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or platform.machine() not in ("x86_64", "AMD64"),
    reason="the packed GEMM (oneMKL) runs on x86-64 CPU backends only")


def test_runs_on_this_cpu() -> None:
    # An x86-64 CPU with the `mkl` requirement and a C++ compiler: the kernel must build
    # and load (a silent fallback to XLA's dot would hide a broken build).
    assert unavailable_reason() is None


def _backends(dtype: str) -> list[str]:
    """The backends that run `dtype` weights here (avx512: f32 / bf16 / int8 on a CPU
    with AVX512F / AVX512_BF16 / VNNI)."""
    return ["onemkl"] + (["avx512"] if mkl.avx512_runs(dtype) else [])


def test_backend_choice_follows_the_vendor_and_the_override(monkeypatch) -> None:
    monkeypatch.delenv("JAXLEARN_PACKED_GEMM", raising=False)
    f32_avx512 = mkl.avx512_runs("float32") and not mkl.host_is_intel()
    assert mkl.backend_for("float32") == ("avx512" if f32_avx512 else "onemkl")
    for dtype in ("bfloat16", "int8"):
        intel_without_amx = mkl.host_is_intel() and not mkl.amx_runs(dtype)
        assert mkl.backend_for(dtype) == ("onemkl" if intel_without_amx else "avx512")
        assert mkl.backend_for(dtype, k=128) == mkl.backend_for(dtype)
        # A k the tiles cannot step through stays on oneMKL on Intel.
        odd = "onemkl" if mkl.host_is_intel() else "avx512"
        assert mkl.backend_for(dtype, k=96 + 16) == odd
    monkeypatch.setenv("JAXLEARN_PACKED_GEMM", "avx512")
    assert mkl.backend_for("int8") == "avx512"
    monkeypatch.setenv("JAXLEARN_PACKED_GEMM", "blas")
    with pytest.raises(ValueError, match="JAXLEARN_PACKED_GEMM='blas': must be one of"):
        mkl.backend_for("int8")
    with pytest.raises(ValueError, match=r"PackedWeights\(backend='blas'\)"):
        PackedWeights(backend="blas")
    if not mkl.avx512_runs("float32"):
        with pytest.raises(ValueError, match="avx512 backend cannot pack a float32 weight"):
            PackedWeights(backend="avx512").pack(np.ones((4, 4), np.float32))


def _reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ w.astype(np.float64)


@settings(max_examples=16, deadline=None)
@given(m=st.integers(1, 19), k=st.integers(1, 70), n=st.integers(1, 300),
       parts=st.integers(1, 3), bf16=st.booleans(), seed=st.integers(0, 2**16),
       data=st.data())
def test_matches_numpy(m: int, k: int, n: int, parts: int, bf16: bool, seed: int,
                       data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    w = np.asarray(rng.standard_normal((k, n)), dtype)
    x = np.asarray(rng.standard_normal((m, k)), dtype)
    backend = data.draw(st.sampled_from(_backends("bfloat16" if bf16 else "float32")))
    owner = PackedWeights(parts=parts, backend=backend)
    wid = owner.pack(w)
    y = np.asarray(jax.jit(packed_matmul, static_argnums=2)(jnp.asarray(x), jnp.int32(wid), n))
    assert y.shape == (m, n) and y.dtype == np.float32
    ref = _reference(np.asarray(x, np.float32), np.asarray(w, np.float32))
    # f32 accumulation of exact products (bf16 x bf16 is exact in f32), another order.
    tol = 1e-5 * (np.abs(np.asarray(x, np.float32)) @ np.abs(np.asarray(w, np.float32)) + 1)
    assert np.all(np.abs(y - ref) <= tol)
    owner.close()


@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 17])
@pytest.mark.parametrize("k,n", [(1, 1), (63, 33), (512, 96)])
def test_f32_panels_match_numpy(m: int, k: int, n: int) -> None:
    """f32 weights on the AVX-512 panels (one FMA per element, 8-row blocks and their
    tails, a last panel with fewer than 32 columns) against numpy in float64."""
    if not mkl.avx512_runs("float32"):
        pytest.skip("the avx512 backend does not run float32 on this CPU (no AVX512F)")
    rng = np.random.default_rng(m * 1000 + k + n)
    w = rng.standard_normal((k, n), dtype=np.float32)
    x = rng.standard_normal((m, k), dtype=np.float32)
    owner = PackedWeights(backend="avx512")
    wid = owner.pack(w)
    assert owner.backends == {"avx512"}
    y = np.asarray(jax.jit(packed_matmul, static_argnums=2)(jnp.asarray(x), jnp.int32(wid), n))
    tol = 1e-5 * (np.abs(x) @ np.abs(w) + 1)
    assert np.all(np.abs(y - _reference(x, w)) <= tol)
    owner.close()


@pytest.mark.parametrize("m", [1, 15, 16, 17, 33, 70])
@pytest.mark.parametrize("k,n", [(64, 40), (128, 64), (192, 300)])
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_panels_with_whole_tile_steps_match_the_reference(m: int, k: int, n: int,
                                                          dtype: str) -> None:
    """The shapes the AMX tiles take where the CPU has them (`mkl.amx_runs`): k a
    multiple of 64, row blocks of 16 and 32 with tails, a last panel with fewer than 32
    columns. bf16 against numpy; int8 equal to `int8_matmul` bit for bit. Where there are
    no tiles the same shapes run the AVX-512 blocks."""
    if not mkl.avx512_runs(dtype):
        pytest.skip(f"the avx512 backend does not run {dtype} on this CPU")
    rng = np.random.default_rng(m * 1000 + k + n)
    owner = PackedWeights(backend="avx512")
    if dtype == "int8":
        w8 = quantize_int8(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), (0,))
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        wid = owner.pack(np.asarray(w8.q), scale=np.asarray(w8.scale).reshape(n))
        mm = jax.jit(functools.partial(packed_matmul, int8=True), static_argnums=2)
        ref = jax.jit(int8_matmul)(x, w8.q, w8.scale.reshape(n))
        np.testing.assert_array_equal(np.asarray(mm(x, jnp.int32(wid), n)), np.asarray(ref))
    else:
        w = np.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
        xb = np.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        wid = owner.pack(w)
        y = np.asarray(jax.jit(packed_matmul, static_argnums=2)(jnp.asarray(xb),
                                                                jnp.int32(wid), n))
        x32, w32 = np.asarray(xb, np.float32), np.asarray(w, np.float32)
        tol = 1e-5 * (np.abs(x32) @ np.abs(w32) + 1)
        assert np.all(np.abs(y - _reference(x32, w32)) <= tol)
    owner.close()


def test_a_scanned_stack_of_ids_reads_each_layers_weight() -> None:
    rng = np.random.default_rng(0)
    layers, k = 4, 96
    ws = np.asarray(rng.standard_normal((layers, k, k)) / np.sqrt(k), np.float32)
    owner = PackedWeights()
    ids = jnp.asarray(owner.pack_stack(ws, lead=1))
    assert ids.shape == (layers,) and ids.dtype == jnp.int32
    assert owner.nbytes == ws.nbytes and owner.reserved_bytes >= ws.nbytes

    @jax.jit
    def stack(x: jax.Array, ids: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda h, i: (jnp.tanh(packed_matmul(h, i, k)), None), x, ids)[0]

    x = rng.standard_normal((5, k)).astype(np.float32)
    want = x.astype(np.float64)
    for w in ws:
        want = np.tanh(want @ w)
    np.testing.assert_allclose(np.asarray(stack(jnp.asarray(x), ids)), want, atol=2e-5)


def test_bad_inputs_fail_with_errors_naming_them() -> None:
    owner = PackedWeights()
    w = np.ones((8, 16), np.float32)
    wid = owner.pack(w)
    with pytest.raises(Exception, match="x's dtype does not match weight"):
        packed_matmul(jnp.ones((2, 8), jnp.bfloat16), jnp.int32(wid), 16).block_until_ready()
    with pytest.raises(Exception, match=r"x must be \[rows, 8\]"):
        packed_matmul(jnp.ones((2, 9), jnp.float32), jnp.int32(wid), 16).block_until_ready()
    with pytest.raises(ValueError, match=r"bfloat16 or int8 weight, got float16\[8, 16\]"):
        owner.pack(w.astype(np.float16))
    with pytest.raises(ValueError, match=r"int8 weight \[8, 16\] needs scale \[16\]"):
        owner.pack(w.astype(np.int8))
    with pytest.raises(ValueError, match=r"int8 weight \[8, 16\] needs scale \[16\] float32, "
                                         r"got \[8\]"):
        owner.pack(w.astype(np.int8), scale=np.ones(8, np.float32))
    with pytest.raises(ValueError, match="scale is for int8 weights, not float32"):
        owner.pack(w, scale=np.ones(16, np.float32))
    w8 = owner.pack(w.astype(np.int8), scale=np.ones(16, np.float32))
    with pytest.raises(Exception, match=f"weight {w8} .*int8 weights the int8 target"):
        packed_matmul(jnp.ones((2, 8), jnp.float32), jnp.int32(w8), 16).block_until_ready()
    with pytest.raises(Exception, match=f"weight {wid} is not int8"):
        packed_matmul(jnp.ones((2, 8), jnp.float32), jnp.int32(wid), 16,
                      int8=True).block_until_ready()
    owner.close()
    with pytest.raises(Exception, match=f"no packed weight with id {wid}"):
        packed_matmul(jnp.ones((2, 8), jnp.float32), jnp.int32(wid), 16).block_until_ready()


def test_a_packed_table_is_a_pytree_leaf_pair() -> None:
    table = jnp.ones((6, 4), jnp.bfloat16)
    t = PackedTable(table, np.int32(3))
    leaves, tree = jax.tree.flatten(t)
    assert len(leaves) == 2 and t.shape == (6, 4) and t.dtype == jnp.bfloat16
    assert jax.tree.unflatten(tree, leaves).table is table


@settings(max_examples=16, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 80), n=st.integers(1, 300),
       parts=st.integers(1, 3), bf16=st.booleans(), zero_row=st.booleans(),
       seed=st.integers(0, 2**16), data=st.data())
def test_int8_weights_compute_what_xla_int8_matmul_computes(
        m: int, k: int, n: int, parts: int, bf16: bool, zero_row: bool, seed: int,
        data: st.DataObject) -> None:
    """Rows quantized on the fly, exact int32 sums, row and column scales: equal to
    `int8_matmul` (XLA's int8 dot) bit for bit, for f32 and bf16 activations, more rows
    than one int32 block (32), an all-zero row; and each row's result is the same when
    computed alone (integer sums do not depend on the call's row count)."""
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    w8 = quantize_int8(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), (0,))
    x = np.asarray(rng.standard_normal((m, k)) * rng.uniform(0.01, 50), dtype)
    if zero_row:
        x[m // 2] = 0
    owner = PackedWeights(parts=parts, backend=data.draw(st.sampled_from(_backends("int8"))))
    wid = owner.pack(np.asarray(w8.q), scale=np.asarray(w8.scale).reshape(n))
    # Jitted both: eager ops would divide where XLA's simplifier multiplies by reciprocals.
    mm = jax.jit(functools.partial(packed_matmul, int8=True), static_argnums=2)
    y = np.asarray(mm(jnp.asarray(x), jnp.int32(wid), n))
    ref = np.asarray(jax.jit(int8_matmul)(jnp.asarray(x), w8.q, w8.scale.reshape(n)))
    np.testing.assert_array_equal(y, ref)
    r = m - 1
    alone = mm(jnp.asarray(x[r:r + 1]), jnp.int32(wid), n)
    np.testing.assert_array_equal(np.asarray(alone)[0], y[r])
    owner.close()


@pytest.mark.parametrize("backend", _backends("int8"))
def test_an_int8_table_packs_as_a_tied_head(backend: str) -> None:
    """A tied int8 head: the table's transpose packed with its per-row scales as column
    scales gives `int8_matmul(transposed=True)`'s logits."""
    rng = np.random.default_rng(3)
    table = quantize_int8(jnp.asarray(rng.standard_normal((300, 24)), jnp.float32), (1,))
    owner = PackedWeights(backend=backend)
    head = PackedTable(table, np.int32(owner.pack(np.asarray(table.q).T,
                                                  scale=np.asarray(table.scale)[:, 0])))
    assert head.shape == (300, 24) and head.dtype == jnp.int8
    x = jnp.asarray(rng.standard_normal((5, 24)), jnp.float32)
    got = jax.jit(functools.partial(packed_matmul, n=300, int8=True))(x, head.head_id)
    want = jax.jit(lambda x: int8_matmul(x, table.q, table.scale[:, 0], transposed=True))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    owner.close()
