"""The compute copy (`learner.compute_param_copy`) on the real Llama and Mixtral layers
with bf16 compute: only matmul weights are copied, the forward on the copy gives the
plain bf16 path's loss bit for bit, gradients and trained params match it to bf16
rounding, and the copy after each update is exactly the new masters cast to bf16."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.experiments.common import small_model_mesh_rules, trainer_config
from jaxlearn.layers import llama_config, use_moe
from jaxlearn.mesh import mesh_shape_from_axes
from jaxlearn.runtime.compute_copy import COPY_KEY
from jaxlearn.runtime.input_pipeline import Input

VOCAB, SEQ, BATCH = 64, 16, 8


def _trainer(kind: str, copy: bool, *, stack: str = "loop", microbatches: int = 1):
    model = llama_config(VOCAB, 32, 2, 4, 2, 64, rope_theta=10000.0, dtype="bfloat16",
                         stack=stack)
    if kind == "mixtral":
        model = use_moe(model, num_experts=4, top_k=2)
    inp = Input.default_config().set(seq_len=SEQ, global_batch_size=BATCH)
    cfg = trainer_config(model, inp, max_step=10, learning_rate=1e-2, warmup_steps=0,
                         mesh_rules=small_model_mesh_rules())
    cfg.output_dir = "/tmp/unused-compute-copy"
    cfg.mesh_shape = mesh_shape_from_axes(data=1)  # One device: the numerics, not sharding.
    cfg.learner.set(compute_param_copy=copy, num_microbatches=microbatches)
    return cfg.instantiate()


def _batch(trainer):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    return trainer.global_batch({
        "input_ids": ids[:, :-1], "target_labels": ids[:, 1:],
        "target_weights": np.ones((BATCH, SEQ), np.float32),
        "segment_ids": np.ones((BATCH, SEQ), np.int32),
        "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy(),
    })


def _grads(trainer, state, batch):
    with jax.set_mesh(trainer.mesh), trainer._logical():
        loss, _, _, grads = jax.jit(trainer._grads)(state, batch, jax.random.PRNGKey(1))
    return jax.device_get(loss), jax.device_get(grads)


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@functools.lru_cache(maxsize=None)
def _pair(kind: str, stack: str = "loop", microbatches: int = 1):
    plain = _trainer(kind, False, stack=stack, microbatches=microbatches)
    copy = _trainer(kind, True, stack=stack, microbatches=microbatches)
    return plain, copy, plain.init_state(), copy.init_state(), _batch(plain)


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_only_matmul_weights_are_copied_in_bf16(kind):
    _, copy, _, state, _ = _pair(kind)
    paths = {"/".join(p) for p in copy.copy.paths}
    assert paths and not any("norm" in p or "router" in p for p in paths)
    assert any("token_emb" in p or "emb" in p for p in paths)
    leaves = jax.tree.leaves(state[COPY_KEY])
    assert len(leaves) == len(paths) and all(x.dtype == jnp.bfloat16 for x in leaves)
    # The checkpointed state (and the restore target) never hold the copy.
    assert COPY_KEY not in copy.abstract_state() and COPY_KEY in copy.abstract_state(derived=True)


@pytest.mark.parametrize("kind,stack,microbatches",
                         [("llama", "loop", 1), ("llama", "scan", 2), ("mixtral", "loop", 1)])
def test_loss_equal_and_grads_match_the_plain_bf16_path(kind, stack, microbatches):
    plain, copy, sp, sc, batch = _pair(kind, stack, microbatches)
    for a, b in zip(jax.tree.leaves(sp["params"]), jax.tree.leaves(sc["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lp, gp = _grads(plain, sp, batch)
    lc, gc = _grads(copy, sc, batch)
    # The forward reads the same bf16 values: the same loss, bit for bit.
    assert np.asarray(lp).tobytes() == np.asarray(lc).tobytes()
    flat_p = jax.tree_util.tree_flatten_with_path(gp)[0]
    flat_c = jax.tree.leaves(gc)
    for (path, a), b in zip(flat_p, flat_c):
        assert b.dtype == a.dtype == jnp.float32, path
        # dW rounded once to bf16 (8 bits of mantissa) instead of kept in f32.
        assert _rel_err(b, a) < 1e-2, (jax.tree_util.keystr(path), _rel_err(b, a))


def test_trained_params_match_and_the_copy_is_the_cast_masters():
    plain, copy, sp, sc, batch = _pair("llama")
    fp = plain.compile_train_step(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch))
    fc = copy.compile_train_step(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch))
    start = jax.device_get(sp["params"])
    sp = jax.tree.map(jnp.copy, sp)
    sc = jax.tree.map(jnp.copy, sc)
    with jax.set_mesh(plain.mesh):
        for _ in range(3):
            sp, mp = fp(sp, batch)
            sc, mc = fc(sc, batch)
    assert abs(float(mp["loss"]) - float(mc["loss"])) < 2e-2
    # Adam normalises each element's step, so an element whose gradient is ~0 may move
    # either way by ~lr: compare the whole update of each tensor, not each element.
    for p0, a, b in zip(jax.tree.leaves(start), jax.tree.leaves(sp["params"]),
                        jax.tree.leaves(sc["params"])):
        assert _rel_err(np.asarray(b) - p0, np.asarray(a) - p0) < 0.05
    expect = copy.copy.make(jax.device_get(sc["params"]))
    for a, b in zip(jax.tree.leaves(expect), jax.tree.leaves(sc[COPY_KEY])):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
