"""`SgemmDot`: a config swap (`use_dot`) that runs a model's f32 dense dots, the chunked LM
head's included, on oneMKL's sgemm. Loss, metrics and every gradient equal the default
XLA dots' (tied and untied head, chunked and full-logit loss); the lowered step holds the
FFI call only where it should (f32, backend "onemkl"; not bf16, not "xla")."""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.config import ConfigBase, visit
from jaxlearn.kernels import mkl
from jaxlearn.kernels.chunked_loss import head_cross_entropy
from jaxlearn.kernels.sgemm import sgemm
from jaxlearn.layers import llama_config
from jaxlearn.layers.composition import use_dot, use_lora, use_moe
from jaxlearn.layers.dense import SgemmDot
from jaxlearn.layers.quantized import Int8Dot
from jaxlearn.module import functional

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or platform.machine() not in ("x86_64", "AMD64"),
    reason="oneMKL's sgemm runs on x86-64 CPU backends only")

V, D = 40, 16
ONEMKL = SgemmDot.default_config().set(backend="onemkl")


def _batch():
    k = jax.random.split(jax.random.key(3), 2)
    labels = np.asarray(jax.random.randint(k[0], (2, 12), 0, V)).copy()
    labels[0, -3:] = -1
    weights = np.asarray(jax.random.uniform(k[1], (2, 12))) * (labels >= 0)
    return {"input_ids": jnp.asarray(np.maximum(labels, 0)), "target_labels": jnp.asarray(labels),
            "target_weights": jnp.asarray(weights, jnp.float32)}


def _model(dot, *, chunk, tie, dtype=None, moe=False):
    cfg = llama_config(V, D, 2, 4, 2, 24, rope_theta=100.0, z_loss_weight=1e-2, dtype=dtype,
                       tie_embeddings=tie)
    cfg.loss_chunk_tokens = chunk
    if moe:
        cfg = use_moe(cfg, num_experts=4, top_k=2)
    return use_dot(cfg, dot).instantiate()


def _loss_and_grads(model, params, batch):
    def loss(p):
        out, _ = functional(model, None, p, (batch,), is_training=False)
        return out[0], out[1]

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return fn(params), fn.lower(params).as_text()


@pytest.mark.parametrize("chunk,tie,moe", [(8, False, False), (8, True, False),
                                           (None, False, False), (None, True, False),
                                           (8, True, True)])
def test_model_on_sgemm_equals_xla_dots(chunk, tie, moe):
    # An MoE layer keeps its grouped expert matmuls (ragged_dot) under SgemmDot.
    batch = _batch()
    ref_model = _model(None, chunk=chunk, tie=tie, moe=moe)
    params = ref_model.initialize_parameters_recursively(jax.random.key(0))
    ((rloss, rm), rg), ref_text = _loss_and_grads(ref_model, params, batch)
    ((loss, m), g), text = _loss_and_grads(_model(ONEMKL, chunk=chunk, tie=tie, moe=moe),
                                           params, batch)
    # The experts keep their path (ragged_dot lowers to a loop on CPU), not a dense one.
    assert text.count("stablehlo.while") == ref_text.count("stablehlo.while")
    assert mkl.SGEMM_TARGET in text and mkl.SGEMM_TARGET not in ref_text
    # Attention's q.k per (batch, kv head): [2 x 2, 2 heads x 12, 4] @ [4, 12, 4]^T.
    assert "tensor<4x24x4xf32>, tensor<4x12x4xf32>) -> tensor<4x24x12xf32>" in text
    if tie and chunk is None:  # The head reads the table as stored (trans_b), no copy.
        assert f"tensor<{V}x{D}xf32>) -> tensor<{D}x{V}xf32>" not in text
    for k in ("loss", "cross_entropy", "z_loss", "accuracy", "num_tokens"):
        np.testing.assert_allclose(m[k], rm[k], rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(loss, rloss, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(rg)):
        scale = float(jnp.abs(b).max()) + 1e-12
        np.testing.assert_allclose(a, b, atol=1e-4 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("dot,adapter_dot", [(ONEMKL, True), (Int8Dot.default_config(), False)])
def test_lora_adapters_run_on_their_linears_exact_dot(dot, adapter_dot):
    # A rank-3 adapter's matmuls ([24, 16] @ [16, 3], [24, 3] @ [3, out]) on oneMKL, summed
    # into the projection's GEMM (`sgemm(add=)`, forward and backward), with the adapters'
    # gradients of XLA's dots; a quantizing dot stays on the base weight. With adapter
    # dropout in training the adapter runs as its own child (dropout on its input only).
    cfg = use_lora(llama_config(V, D, 2, 4, 2, 24, rope_theta=100.0), rank=3)
    ref_model, model = cfg.instantiate(), use_dot(cfg.clone(), dot).instantiate()
    adapter = model.decoder.transformer.layer.self_attention.q_proj.adapter
    assert (adapter._dot is not None) == adapter_dot
    if not adapter_dot:
        return
    params = ref_model.initialize_parameters_recursively(jax.random.key(0))
    params = jax.tree.map(lambda x: x + 0.01, params)  # lora_b starts at zero.
    batch = _batch()
    (rloss, _), rg = _loss_and_grads(ref_model, params, batch)[0]
    ((loss, _), g), text = _loss_and_grads(model, params, batch)
    assert "tensor<24x16xf32>, tensor<16x3xf32>) -> tensor<24x3xf32>" in text
    assert mkl.SGEMM_ADD_TARGET in text
    np.testing.assert_allclose(loss, rloss, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(rg)):
        scale = float(jnp.abs(b).max()) + 1e-12
        np.testing.assert_allclose(a, b, atol=1e-4 * scale, err_msg=jax.tree_util.keystr(path))
    dropout = use_dot(use_lora(llama_config(V, D, 2, 4, 2, 24, rope_theta=100.0), rank=3,
                               dropout=0.1), dot).instantiate()
    text = jax.jit(lambda p: functional(dropout, jax.random.key(1), p, (batch,))[0][0]
                   ).lower(params).as_text()
    assert mkl.SGEMM_TARGET in text and mkl.SGEMM_ADD_TARGET not in text


@pytest.mark.parametrize("dot,dtype", [(ONEMKL, "bfloat16"),
                                       (ONEMKL.clone(backend="xla"), None),
                                       (SgemmDot.default_config(), None)])
def test_falls_back_to_xla_dots(dot, dtype):
    # bf16 compute, backend "xla", and "auto" with this process's 8 devices: no FFI call.
    model = _model(dot, chunk=8, tie=True, dtype=dtype)
    params = model.initialize_parameters_recursively(jax.random.key(0))
    _, text = _loss_and_grads(model, params, _batch())
    assert mkl.SGEMM_TARGET not in text


def test_chunked_head_on_the_gemm_equals_xla():
    k = jax.random.split(jax.random.key(1), 2)
    x, w = jax.random.normal(k[0], (2, 12, D)), jax.random.normal(k[1], (D, V)) * 0.5
    b = _batch()
    labels, weights = b["target_labels"], b["target_weights"]

    def total(x, w, gemm):
        return head_cross_entropy(x, w, labels, weights, z_loss_weight=1e-2, chunk_tokens=8,
                                  gemm=gemm)["total"]

    got = jax.jit(jax.value_and_grad(lambda x, w: total(x, w, sgemm), (0, 1)))
    ref = jax.value_and_grad(lambda x, w: total(x, w, None), (0, 1))(x, w)
    assert got.lower(x, w).as_text().count(f"@{mkl.SGEMM_TARGET}") >= 3  # logits, dx, dW
    (v, (gx, gw)), (rv, (rgx, rgw)) = got(x, w), ref
    np.testing.assert_allclose(v, rv, rtol=1e-5)
    np.testing.assert_allclose(gx, rgx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gw, rgw, rtol=1e-4, atol=1e-5)


def test_serving_drops_sgemm_dots_only():
    cfg = use_dot(_model(None, chunk=8, tie=True).config, ONEMKL)
    cfg.decoder.transformer.layer.feed_forward.wo.dot = Int8Dot.default_config()
    dots = []
    visit(use_dot(cfg, None, of=SgemmDot), lambda path, c: dots.append((path, c.dot))
          if isinstance(c, ConfigBase) and "dot" in c and "klass" in c else None)
    kept = {p: d.klass for p, d in dots if d is not None}
    assert kept == {"decoder.transformer.layer.feed_forward.wo": Int8Dot} and len(dots) > 5


def test_bad_backend_is_named():
    with pytest.raises(ValueError, match=r"SgemmDot.backend: 'mkl' is not one of"):
        ONEMKL.clone(backend="mkl").instantiate()
