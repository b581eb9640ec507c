"""The serving variants of `Linear` (`inference.serving_layers`) against the trained
layer: `TransposedLinear` on the weight stored [out, in], `Int8Linear` on int8 weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.inference.serving_layers import Int8Linear, TransposedLinear
from jaxlearn.layers import DotGeneral, Linear

BF16 = jnp.bfloat16


def _rand(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(key), shape, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
@pytest.mark.parametrize("x_shape,w_shape,in_dims", [
    ((2, 3, 8), (8, 4, 5), 1),     # q_proj-like, [b, s, in] with 2 leading dims
    ((1, 1, 8), (8, 6), 1),        # one decode row (bf16: padded to two)
    ((4, 1, 8), (8, 6), 1),        # a decode batch
    ((2, 3, 4, 5), (4, 5, 8), 2),  # o_proj [heads, head_dim, embed]
])
def test_transposed_linear_equals_the_trained_layout(dtype, x_shape, w_shape, in_dims):
    """`TransposedLinear` (serving: the weight stored [out, in]) gives `Linear`'s result
    on the weight as trained: f32 within rounding of the summation order, bf16 within its
    rounding of the f32 products (both accumulate in f32)."""
    from jaxlearn.kernels import transpose_weight
    from jaxlearn.module import functional

    x, w = _rand(0, x_shape, dtype), _rand(1, w_shape, dtype)
    dims = dict(input_dim=w_shape[:in_dims], output_dim=w_shape[in_dims:],
                dtype=jnp.dtype(dtype).name,
                weight_axes=(None,) * len(w_shape), use_bias=True, name="lin")
    b = _rand(2, w_shape[in_dims:], dtype)
    plain = Linear.default_config().set(**dims).instantiate()
    moved = TransposedLinear.default_config().set(**dims).instantiate()

    def run(m, p, **kw):
        return functional(m, None, p, {"x": x, **kw}, is_training=False)[0]

    want = run(plain, {"weight": w, "bias": b}, out_dtype=jnp.float32)
    wt = {"weight_t": transpose_weight(w, in_dims).t, "bias": b}
    got = run(moved, wt, out_dtype=jnp.float32)
    assert got.shape == want.shape == (*x_shape[: len(x_shape) - in_dims], *w_shape[in_dims:])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert run(moved, wt).dtype == dtype
    with pytest.raises(ValueError, match="TransposedLinear takes no injected dot"):
        TransposedLinear.default_config().set(**dims, dot=DotGeneral.default_config()
                                              ).instantiate()


def test_int8_linear_runs_the_int8_kernel():
    """`Int8Linear` on `quantize_int8`'s values and scales equals `kernels.int8_matmul`."""
    from jaxlearn.kernels import int8_matmul, quantize_int8
    from jaxlearn.module import functional

    x, w = _rand(0, (2, 3, 4, 5)), _rand(1, (4, 5, 8))
    q = quantize_int8(w, (0, 1))
    m = Int8Linear.default_config().set(name="lin", input_dim=(4, 5), output_dim=8,
                                        weight_axes=("heads", "head_dim", "embed")).instantiate()
    specs = m.create_parameter_specs_recursively()
    assert {k: (v.shape, v.dtype) for k, v in specs.items()} == {
        "weight": ((4, 5, 8), jnp.int8), "scale": ((1, 1, 8), jnp.float32)}
    got = functional(m, None, {"weight": q.q, "scale": q.scale}, (x,), is_training=False)[0]
    want = int8_matmul(x.reshape(6, 20), q.q.reshape(20, 8), q.scale.reshape(8))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want).reshape(2, 3, 8))
