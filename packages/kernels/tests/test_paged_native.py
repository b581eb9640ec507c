"""The native paged-attention kernel against a float64 numpy reference read straight from
the pool: f32 and bf16, any page size / head_dim / grouping, causal or not, sliding
windows, soft caps, chunks of more than 16 queries, stacked and single pools; the same
answer as `paged.attend_pages`' XLA loop; bad page entries fail with an error naming them."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlearn.kernels import paged
from jaxlearn.kernels.paged_native import attend_pages_native, unavailable_reason

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="the native paged attention runs on CPU backends only")


def test_runs_on_this_cpu() -> None:
    # A CPU backend with a C++ compiler: the kernel must build and load (a silent
    # fallback to the XLA loop would hide a broken build).
    assert unavailable_reason() is None


def _reference(q: np.ndarray, kp: np.ndarray, vp: np.ndarray, table: np.ndarray,
               q_index: np.ndarray, kv_end: np.ndarray, layer: int, scale: float,
               causal: bool, window: Optional[int], cap: Optional[float]) -> np.ndarray:
    """q [b, s, h, d]; kp [L, P, kv, d, ps]; vp [L, P, kv, ps, d] (float64)."""
    b, s, h, d = q.shape
    kv, ps = kp.shape[2], kp.shape[4]
    g = h // kv
    n = table.shape[1]
    out = np.zeros((b, s, h, d))
    for bi in range(b):
        keys = np.concatenate([kp[layer, p].transpose(2, 0, 1) for p in table[bi]])  # [n*ps, kv, d]
        vals = np.concatenate([vp[layer, p].transpose(1, 0, 2) for p in table[bi]])
        pos = np.arange(n * ps)
        for si in range(s):
            qi = q_index[bi, si]
            vis = pos < kv_end[bi]
            if causal:
                vis &= pos <= qi
            if window is not None:
                vis &= qi - pos < window
            if not vis.any():
                continue
            for hi in range(h):
                logit = keys[:, hi // g] @ q[bi, si, hi] * scale
                if cap is not None:
                    logit = cap * np.tanh(logit / cap)
                logit = np.where(vis, logit, -np.inf)
                w = np.exp(logit - logit.max())
                out[bi, si, hi] = (w / w.sum()) @ vals[:, hi // g]
    return out


def _case(rng: np.random.Generator, b: int, s: int, kv: int, g: int, d: int, ps: int,
          n: int, layers: int, bf16: bool) -> tuple:
    pages = b * n + 3
    kp = rng.standard_normal((layers, pages, kv, d, ps)).astype(np.float32)
    vp = rng.standard_normal((layers, pages, kv, ps, d)).astype(np.float32)
    q = rng.standard_normal((b, s, kv * g, d)).astype(np.float32)
    table = rng.permutation(pages)[: b * n].reshape(b, n).astype(np.int32)
    kv_end = rng.integers(s, n * ps + 1, (b,)).astype(np.int32)
    q_index = (kv_end[:, None] - s + np.arange(s)).astype(np.int32)
    if bf16:  # Round to bf16 so the reference sees the values the kernel reads.
        kp, vp, q = (np.asarray(np.asarray(x, jnp.bfloat16), np.float32) for x in (kp, vp, q))
        pools = tuple(jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.bfloat16), jnp.uint16)
                      for x in (kp, vp))
        qj = jnp.asarray(q, jnp.bfloat16)
    else:
        pools = (jnp.asarray(kp), jnp.asarray(vp))
        qj = jnp.asarray(q)
    return q, kp, vp, table, q_index, kv_end, qj, pools


@settings(max_examples=16, deadline=None)
@given(b=st.integers(1, 3), s=st.sampled_from([1, 2, 5, 17]), kv=st.integers(1, 3),
       g=st.integers(1, 4), d=st.sampled_from([8, 24, 32, 64]), ps=st.sampled_from([4, 16, 32]),
       n=st.integers(1, 4), bf16=st.booleans(), causal=st.booleans(),
       window=st.sampled_from([None, 1, 7]), cap=st.sampled_from([None, 2.5]),
       seed=st.integers(0, 2**16))
def test_matches_numpy(b: int, s: int, kv: int, g: int, d: int, ps: int, n: int, bf16: bool,
                       causal: bool, window: Optional[int], cap: Optional[float],
                       seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = max(n, -(-s // ps))
    q, kp, vp, table, q_index, kv_end, qj, pools = _case(rng, b, s, kv, g, d, ps, n, 2, bf16)
    scale = d ** -0.5
    got = jax.jit(lambda *a: attend_pages_native(
        *a, scale=scale, causal=causal, sliding_window=window, logit_soft_cap=cap,
        layer=jnp.int32(1)))(qj, *pools, table, q_index, kv_end)
    assert got.shape == qj.shape and got.dtype == qj.dtype
    ref = _reference(*(x.astype(np.float64) for x in (q, kp, vp)), table, q_index, kv_end, 1,
                     scale, causal, window, cap)
    err = np.abs(np.asarray(got, np.float64) - ref)
    # f32: sums of products in another order; bf16: plus one rounding of the output.
    tol = (2 ** -8 * np.abs(ref) + 1e-2) if bf16 else 1e-5 * (np.abs(ref) + 1)
    assert np.all(err <= tol), float(err.max())


def test_a_single_pool_and_the_xla_loop_agree() -> None:
    rng = np.random.default_rng(1)
    q, kp, vp, table, q_index, kv_end, qj, pools = _case(rng, 3, 3, 2, 3, 16, 16, 4, 1, False)
    kw = dict(scale=0.25, sliding_window=20)
    native = attend_pages_native(qj, pools[0][0], pools[1][0], table, q_index, kv_end, **kw)
    xla = paged.attend_pages(qj, pools[0][0], pools[1][0], table, q_index, kv_end, **kw)
    dispatched = paged.attend_pages(qj, pools[0][0], pools[1][0], table, q_index, kv_end,
                                    kernel="native", **kw)
    np.testing.assert_allclose(np.asarray(native), np.asarray(xla), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(dispatched), np.asarray(native))


def test_one_layers_pool_written_then_read_is_not_copied() -> None:
    # A one-row decode step over one layer's (unstacked) pools: write the token's entries,
    # then attend. The write is a dynamic-update-slice of the donated pool in place; the
    # kernel must read that same buffer (a reshape of the pool for the call once made XLA
    # fuse the write twice and copy every pool per step).
    rng = np.random.default_rng(5)
    _, _, _, table, _, _, qj, pools = _case(rng, 1, 1, 2, 2, 16, 8, 3, 1, False)
    kp, vp = pools[0][0], pools[1][0]

    def step(kp: jax.Array, vp: jax.Array, q: jax.Array, pos: jax.Array) -> tuple:
        kp = paged.write_pages(kp, q[:, :, :2], pos, table, layout="kdt")
        vp = paged.write_pages(vp, q[:, :, :2], pos, table, layout="ktd")
        o = attend_pages_native(q, kp, vp, table, pos[:, None], pos + 1, scale=0.25)
        return kp, vp, o

    pos = jnp.array([5], jnp.int32)
    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(kp, vp, qj, pos).compile().as_text()
    pool_shapes = {f"f32[{','.join(map(str, x.shape))}]" for x in (kp, vp)}
    copies = [line for line in hlo.splitlines() if " copy(" in line
              and any(shape in line.split("=", 1)[1] for shape in pool_shapes)]
    assert not copies, copies
    got_kp, got_vp, o = step(kp, vp, qj, pos)
    xla = paged.attend_pages(qj, got_kp, got_vp, table, pos[:, None], pos + 1, scale=0.25)
    np.testing.assert_allclose(np.asarray(o), np.asarray(xla), rtol=1e-5, atol=1e-6)


def test_one_query_answers_the_same_alone_or_in_a_chunk() -> None:
    # Decode (one query) and a verify / prefill chunk (many) give bit-identical rows:
    # speculative decoding relies on it.
    rng = np.random.default_rng(2)
    _, _, _, table, q_index, kv_end, qj, pools = _case(rng, 2, 20, 3, 3, 64, 16, 3, 1, True)
    kw = dict(scale=0.125)
    chunk = attend_pages_native(qj, *pools, table, q_index, kv_end, layer=jnp.int32(0), **kw)
    for i in (0, 7, 16, 19):
        alone = attend_pages_native(qj[:, i:i + 1], *pools, table, q_index[:, i:i + 1],
                                    kv_end, layer=jnp.int32(0), **kw)
        np.testing.assert_array_equal(np.asarray(alone[:, 0]), np.asarray(chunk[:, i]))


def test_a_page_outside_the_pool_is_an_error_naming_it() -> None:
    rng = np.random.default_rng(3)
    _, _, _, table, q_index, kv_end, qj, pools = _case(rng, 1, 1, 1, 1, 8, 4, 2, 1, False)
    bad = table.copy()
    bad[0, 0] = 999
    kv_end = np.full((1,), 8, np.int32)
    with pytest.raises(Exception, match="page table entry 999 is outside the"):
        np.asarray(attend_pages_native(qj, *pools, bad, np.full((1, 1), 7, np.int32), kv_end,
                                       scale=1.0, layer=jnp.int32(0)))


def test_float16_queries_keep_the_xla_loop() -> None:
    rng = np.random.default_rng(4)
    _, kp, vp, table, q_index, kv_end, qj, _ = _case(rng, 2, 1, 1, 2, 8, 4, 2, 1, False)
    pools = tuple(jax.lax.bitcast_convert_type(jnp.asarray(x[0], jnp.float16), jnp.uint16)
                  for x in (kp, vp))
    q16 = qj.astype(jnp.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        attend_pages_native(q16, *pools, table, q_index, kv_end, scale=1.0)
    np.testing.assert_array_equal(
        np.asarray(paged.attend_pages(q16, *pools, table, q_index, kv_end, scale=1.0,
                                      kernel="native")),
        np.asarray(paged.attend_pages(q16, *pools, table, q_index, kv_end, scale=1.0)))
    with pytest.raises(ValueError, match="kernel 'cuda' not in"):
        paged.attend_pages(q16, *pools, table, q_index, kv_end, scale=1.0, kernel="cuda")


def test_choose_kernel_resolves_auto_and_says_why_native_cannot_run(monkeypatch, caplog):
    from jaxlearn.kernels import paged_native

    assert paged_native.choose_kernel("auto", one_device=True) == "native"
    assert paged_native.choose_kernel("auto", one_device=False) == "xla"
    with pytest.raises(ValueError, match="^where='cuda': must be one of auto, xla, native$"):
        paged_native.choose_kernel("cuda", one_device=True, where="where")
    with pytest.raises(ValueError, match="^kernel='native' needs one device$"):
        paged_native.choose_kernel("native", one_device=False)
    monkeypatch.setattr(paged_native, "unavailable_reason", lambda: "no C++ compiler")
    with caplog.at_level("WARNING", logger=paged_native.__name__):
        assert paged_native.choose_kernel("auto", one_device=True) == "xla"
    assert "native paged attention unavailable (no C++ compiler); using xla" in caplog.text
    with pytest.raises(RuntimeError, match=r"^kernel='native': no C\+\+ compiler$"):
        paged_native.choose_kernel("native", one_device=True)
