"""Activation names and host offload: every layer tags its activations (`ACTIVATION_NAMES`),
an `offload_names:` remat policy moves exactly those to pinned host memory in the lowered
train step, and gradients are those of the model without remat.

The CPU backend has host memory kinds but no host-offload compiler pass: `device_put` to
another memory kind lowers to nothing there, so on CPU the policy only saves the named
activations (gradients unchanged) and its transfers are checked in the step lowered for
TPU and GPU (StableHLO `annotate_device_placement` to `pinned_host`, which XLA's
HostOffloader turns into host copies). With the optional `libtpu` installed, the same step
is compiled by the real TPU compiler on a mock topology: its HLO holds the host copies
(buffers in memory space S(5)), the activations count as host temp memory and the
device's peak memory falls.
"""

import contextlib
import importlib.util
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from jaxlearn.layers import ACTIVATION_NAMES, llama_config
from jaxlearn.module import functional

VOCAB, DIM, SEQ, BATCH = 64, 32, 16, 4
OFFLOAD = "offload_names:" + ",".join(ACTIVATION_NAMES)
SAVE = "save_names:" + ",".join(ACTIVATION_NAMES)
HOST = re.compile(r"annotate_device_placement.*_xla_buffer_placement = \"pinned_host\"")


def tiny(policy=None, stack="scan", **kw):
    return llama_config(VOCAB, DIM, 2, 4, 2, 48, rope_theta=100.0, stack=stack,
                        remat_policy=policy, **kw).instantiate()


def batch(b=BATCH, s=SEQ):
    ids = jax.random.randint(jax.random.key(3), (b, s + 1), 0, VOCAB)
    return {"input_ids": ids[:, :-1], "target_labels": ids[:, 1:]}


def loss_fn(model):
    return lambda p, b: functional(model, jax.random.key(1), p, (b,))[0][0]


@pytest.fixture(scope="module")
def params():
    return tiny().initialize_parameters_recursively(jax.random.key(0))


def saved_names(model, params):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda p: loss_fn(model)(p, batch()), params)
    return re.findall(r"named '([^']+)'", out.getvalue())


def test_every_activation_name_is_tagged():
    # A loop stack: the residuals of a scanned stack are the scan's, not the names inside.
    model = tiny(SAVE, stack="loop")
    names = saved_names(model, model.initialize_parameters_recursively(jax.random.key(0)))
    # q/k/v, context and residual once per layer, ffn_hidden twice (SwiGLU's two inputs).
    per_layer = {n: 2 if n == "ffn_hidden" else 1 for n in ACTIVATION_NAMES}
    assert {n: names.count(n) for n in ACTIVATION_NAMES} == {
        n: 2 * k for n, k in per_layer.items()}


@pytest.mark.parametrize("policy", [OFFLOAD, "offload_names:q_proj,ffn_activation"])
def test_offload_keeps_loss_and_gradients(params, policy):
    ref = jax.jit(jax.value_and_grad(loss_fn(tiny())))(params, batch())
    got = jax.jit(jax.value_and_grad(loss_fn(tiny(policy))))(params, batch())
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def lowered_text(policy, platform, stack="scan"):
    model = tiny(policy, stack=stack)
    f = jax.jit(jax.value_and_grad(loss_fn(model)))
    p = model.initialize_parameters_recursively(jax.random.key(0))
    return f.trace(p, batch()).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("stack", ["scan", "loop"])
def test_offload_policy_moves_tagged_activations_to_host(platform, stack):
    text = lowered_text(OFFLOAD, platform, stack)
    to_host = HOST.findall(text)
    # One transfer per tagged value per layer (scan: the body once).
    per_layer = len(ACTIVATION_NAMES) + 1  # ffn_hidden twice.
    assert len(to_host) == per_layer * (2 if stack == "loop" else 1)
    # Each comes back to the device for the backward pass.
    back = re.findall(r"_xla_buffer_placement = \"device\"", text)
    assert len(back) == len(to_host)
    # Saving the same names keeps everything on the device.
    assert not HOST.findall(lowered_text(SAVE, platform, stack))


def test_cpu_lowering_has_no_host_transfers():
    # The documented limitation: XLA:CPU has no host offload, so nothing moves there.
    assert not HOST.findall(lowered_text(OFFLOAD, "cpu"))


def _mock_tpu_compile(policy):
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = topologies.make_mesh(topo, (4,), ("data",))
    rep, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    model = llama_config(256, 256, 2, 4, 4, 1024, rope_theta=100.0, dtype="bfloat16",
                         remat_policy=policy).instantiate()
    p = jax.eval_shape(lambda: model.initialize_parameters_recursively(jax.random.key(0)))
    p = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), p)
    b = {k: jax.ShapeDtypeStruct((8, 512), jnp.int32, sharding=rows)
         for k in ("input_ids", "target_labels")}
    return jax.jit(jax.grad(loss_fn(model))).lower(p, b).compile()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs the optional libtpu package (mock TPU topology)")
def test_mock_tpu_compiles_host_transfers_and_saves_device_memory():
    offload, save = _mock_tpu_compile(OFFLOAD), _mock_tpu_compile(SAVE)
    hlo = offload.as_text()
    assert re.search(r"S\(5\)", hlo), "no buffer in host memory space S(5)"
    assert not re.search(r"S\(5\)", save.as_text())
    on, off = offload.memory_analysis(), save.memory_analysis()
    assert on.host_temp_size_in_bytes > 0 == off.host_temp_size_in_bytes
    assert on.peak_memory_in_bytes < off.peak_memory_in_bytes  # 49 vs 74 MB measured
