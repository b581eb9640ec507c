"""`TransposedWeight` / `transpose_weight`: the stored [*lead, out, in] array, the logical
shape it reports, pytree behaviour (jit, scan over a stacked leading axis) and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.kernels import TransposedWeight, transpose_weight


def _w(shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(0), shape, dtype)


@pytest.mark.parametrize("shape,in_dims,lead", [
    ((8, 12), 1, 0),            # Linear [in, out]
    ((8, 4, 3), 1, 0),          # q_proj [embed, heads, head_dim]
    ((4, 3, 8), 2, 0),          # o_proj [heads, head_dim, embed]
    ((2, 8, 4, 3), 1, 1),       # a scanned stack's q_proj [layers, embed, heads, head_dim]
])
def test_stored_array_is_the_flattened_transpose(shape, in_dims, lead):
    w = _w(shape, jnp.bfloat16)
    t = transpose_weight(w, in_dims, lead=lead)
    assert t.shape == shape and t.ndim == len(shape) and t.dtype == jnp.bfloat16
    k = int(np.prod(shape[lead : lead + in_dims]))
    n = int(np.prod(shape[lead + in_dims :]))
    assert t.t.shape == (*shape[:lead], n, k) and t.nbytes == w.nbytes
    ref = np.asarray(w, np.float32).reshape(*shape[:lead], k, n)
    np.testing.assert_array_equal(np.asarray(t.t, np.float32), np.swapaxes(ref, -1, -2))
    np.testing.assert_array_equal(np.asarray(t.untranspose()), np.asarray(w))


def test_pytree_keeps_the_logical_shapes_through_jit_and_scan():
    w = _w((3, 8, 4, 2))  # [layers, in, *out]
    t = transpose_weight(w, 1, lead=1)
    leaves, treedef = jax.tree.flatten(t)
    assert len(leaves) == 1 and leaves[0] is t.t
    doubled = jax.jit(lambda a: jax.tree.map(lambda x: 2 * x, a))(t)
    assert isinstance(doubled, TransposedWeight) and doubled.shape == t.shape
    x = _w((5, 8))

    def body(carry, layer):  # lax.scan slices the stored array's leading axis.
        assert isinstance(layer, TransposedWeight) and layer.shape == (8, 4, 2)
        return carry, x @ layer.untranspose().reshape(8, 8)

    _, ys = jax.lax.scan(body, 0, t)
    ref = np.einsum("ti,lio->lto", np.asarray(x), np.asarray(w).reshape(3, 8, 8))
    np.testing.assert_allclose(np.asarray(ys), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,in_dims,lead", [((8,), 1, 0), ((8, 4), 2, 0), ((8, 4), 1, -1)])
def test_a_weight_without_out_dims_is_a_clear_error(shape, in_dims, lead):
    with pytest.raises(ValueError, match=r"transpose_weight: a weight of shape \(8"):
        transpose_weight(_w(shape), in_dims, lead=lead)
