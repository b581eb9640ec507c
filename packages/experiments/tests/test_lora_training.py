"""LoRA end to end: loss and adapter gradients on FSDP / TP meshes equal single-device
(Llama and Mixtral, 8 fake CPU devices, f32), and a few Trainer steps with only adapters
trainable lower the loss, keep every base weight bit-identical, hold optimizer state for
the adapters only and resume bit-exactly, also from a step saved with the layer stack in
its other form."""

import functools
import json
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxlearn.checkpoint import Checkpointer
from jaxlearn.layers import (
    ADAPTERS,
    LoopStack,
    llama_config,
    merge_lora,
    swapped_stack,
    use_lora,
    use_moe,
)
from jaxlearn.mesh import (
    DEFAULT_AXIS_NAMES,
    DEFAULT_AXIS_RULES,
    logical_to_partition_spec,
    make_mesh,
    mesh_shape_from_axes,
)
from jaxlearn.module import functional, is_spec, logical_sharding
from jaxlearn.runtime.bundled import BundledSource
from jaxlearn.runtime.input_pipeline import Input
from jaxlearn.runtime.trainer import Trainer
from jaxlearn.text.tokenizers import ByteTokenizer

VOCAB, SEQ, BATCH = 64, 16, 8


def _model_cfg(kind: str, vocab: int = VOCAB):
    cfg = llama_config(vocab_size=vocab, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_dim=64, rope_theta=10000.0)
    if kind == "mixtral":
        cfg = use_moe(cfg, num_experts=4, top_k=2)
    return use_lora(cfg, rank=4, alpha=8.0)


def _leaves(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(k.key) for k in kp): v for kp, v in flat}


@functools.lru_cache(maxsize=None)
def _setup(kind: str):
    model = _model_cfg(kind).instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    # Trained-looking adapters, so that every gradient (A's too) is non-zero.
    params = jax.tree_util.tree_map_with_path(
        lambda kp, x: 0.2 * jax.random.normal(jax.random.key(len(str(kp))), x.shape)
        if str(kp[-1].key) == "lora_b" else x, params)
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    batch = {"input_ids": ids[:, :-1], "target_labels": ids[:, 1:]}

    def loss_fn(p, b):
        (loss, _), _ = functional(model, None, p, (b,), is_training=False)
        return loss

    ref = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    return model, params, batch, loss_fn, ref


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
def test_sharded_lora_equals_single_device(kind, strategy):
    model, params, batch, loss_fn, (ref_loss, ref_grads) = _setup(kind)
    axes = dict(fsdp=8) if strategy == "fsdp" else dict(data=2, model=4)
    mesh = make_mesh(mesh_shape_from_axes(**axes), DEFAULT_AXIS_NAMES)

    def spec(axes, shape=None):
        return logical_to_partition_spec(axes, DEFAULT_AXIS_RULES, mesh, shape=shape)

    specs = model.create_parameter_specs_recursively()
    p_shard = jax.tree.map(lambda s: NamedSharding(mesh, spec(s.mesh_axes, s.shape)), specs,
                           is_leaf=is_spec)
    b_shard = {k: NamedSharding(mesh, spec(("batch", "seq"), v.shape)) for k, v in batch.items()}
    fn = jax.jit(jax.value_and_grad(loss_fn), in_shardings=(p_shard, b_shard),
                 out_shardings=(NamedSharding(mesh, spec(())), p_shard))
    with jax.set_mesh(mesh), logical_sharding(mesh, spec):
        loss, grads = fn(jax.device_put(params, p_shard), jax.device_put(batch, b_shard))
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    got, want = _leaves(grads), _leaves(ref_grads)
    adapters = [p for p in want if re.fullmatch(ADAPTERS, p)]
    assert adapters and all(float(np.abs(want[p]).max()) > 0 for p in adapters)
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=2e-4, atol=2e-6, err_msg=path)
    # The adapters are sharded by the rules like their base weights (rank axis whole).
    shard = _leaves(p_shard)
    attn = "decoder/transformer/layer/self_attention"
    if strategy == "tp":
        assert "model" in str(shard[f"{attn}/q_proj/adapter/lora_b"].spec)
        assert shard[f"{attn}/q_proj/adapter/lora_b"].spec[1] is None  # [layers, rank, h, d]
    else:
        assert "fsdp" in str(shard[f"{attn}/q_proj/adapter/lora_a"].spec)


def _trainer_cfg(output_dir: str) -> Trainer.Config:
    model = _model_cfg("llama", vocab=320)  # Byte vocabulary (259 ids), padded.
    data = Input.default_config().set(
        source=BundledSource.default_config(), tokenizer=ByteTokenizer.default_config(),
        seq_len=32, global_batch_size=8, split="train", shuffle=True)
    cfg = Trainer.default_config().set(
        model=model, input=data, output_dir=output_dir, max_step=12, log_every_n_steps=1,
        save_every_n_steps=12, mesh_shape=mesh_shape_from_axes(data=2, fsdp=4),
        checkpointer=Checkpointer.default_config())
    cfg.learner.set(learning_rate=3e-2, schedule="constant", warmup_steps=0,
                    weight_decay=0.0, trainable=ADAPTERS)
    cfg.summary_writer.set(progress=False)
    return cfg


def test_trainer_trains_only_adapters(tmp_path):
    trainer = _trainer_cfg(str(tmp_path / "run")).instantiate()
    start = jax.device_get(trainer.init_state()["params"])  # What run() initialises too.
    state = jax.device_get(trainer.run().state)
    before, after = _leaves(start), _leaves(state["params"])
    adapters = {p for p in after if re.fullmatch(ADAPTERS, p)}
    assert len(adapters) == 2 * 7  # Scanned: [layers, ...] per projection, (a, b) each.
    for path in after:
        if path in adapters:
            continue
        np.testing.assert_array_equal(after[path], before[path], err_msg=path)
    assert all(not np.array_equal(after[p], before[p]) for p in adapters if p.endswith("_b"))
    # Optimizer state: Adam's two moments of the adapters, plus scalar counts.
    leaves = jax.tree.leaves(state["opt_state"])
    adapter_bytes = sum(after[p].nbytes for p in adapters)
    assert sum(x.nbytes for x in leaves if x.ndim > 0) == 2 * adapter_bytes
    assert sum(x.nbytes for x in leaves) < 2 * adapter_bytes + 64
    model_bytes = sum(x.nbytes for x in after.values())
    assert 2 * adapter_bytes < 0.2 * model_bytes
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) >= 10 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses
    # The merged model is a plain Llama that computes what the adapted one does.
    cfg = trainer.config.model
    merged_cfg, merged = merge_lora(cfg, state["params"])
    ids = np.arange(2 * 9).reshape(2, 9) % 256

    def logits(m, p):
        return functional(m, None, p, ({"input_ids": ids},), method="logits",
                          is_training=False)[0]

    np.testing.assert_allclose(logits(merged_cfg.instantiate(), merged),
                               logits(trainer.model, state["params"]), rtol=1e-5, atol=1e-5)
    # Stopped at step 6 and resumed from its checkpoint (adapter-only optimizer state):
    # the same parameters as the straight run, bit for bit.
    resumed = str(tmp_path / "resumed")
    _trainer_cfg(resumed).set(max_step=6, save_every_n_steps=6).instantiate().run()
    again = _trainer_cfg(resumed).set(save_every_n_steps=6).instantiate().run()
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
             if '"split": "train"' in line]
    assert steps == list(range(1, 13)), steps  # The second run started at step 7.
    for a, b in zip(jax.tree.leaves(jax.device_get(again.state)), jax.tree.leaves(state)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_frozen_parameters_get_no_backward(tmp_path):
    """With only adapters trainable the step computes no gradient for the frozen weights
    (the embedding's dW of the LM head alone is 2 x tokens x dim x vocab FLOPs), and
    `grad_norm` is the adapters' gradient norm, checked against jax.grad of the loss."""
    trainer = _trainer_cfg(str(tmp_path / "run")).instantiate()
    ids = np.random.default_rng(1).integers(0, 259, size=(8, 33)).astype(np.int32)
    batch = trainer.global_batch({"input_ids": ids[:, :-1], "target_labels": ids[:, 1:]})
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)

    def flops(step):
        cost = step.cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    step = trainer.compile_train_step(abstract)
    mask = trainer._trainable
    trainer._trainable = None  # Every parameter in the backward, masked only by the update.
    every = flops(trainer.compile_train_step(abstract))
    trainer._trainable = mask
    per_device = 2 * 8 * 32 * 32 * 320 / trainer.mesh.devices.size  # cost_analysis: one device's.
    assert every - flops(step) >= per_device, (every, flops(step))

    state = trainer.init_state()
    params = jax.device_get(state["params"])
    with jax.set_mesh(trainer.mesh):
        grads = jax.grad(lambda p: trainer._loss(p, batch, jax.random.key(0))[0])(
            state["params"])
    grads = _leaves(jax.device_get(grads))
    adapters = [g for p, g in grads.items() if re.fullmatch(ADAPTERS, p)]
    want = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in adapters))
    every_norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads.values()))
    assert every_norm > 1.1 * want  # The check below could tell the two apart.
    with jax.set_mesh(trainer.mesh):
        new_state, summaries = step(state, batch)
    np.testing.assert_allclose(float(summaries["grad_norm"]), want, rtol=1e-5)
    after = _leaves(jax.device_get(new_state["params"]))
    for path, before in _leaves(params).items():
        if not re.fullmatch(ADAPTERS, path):
            np.testing.assert_array_equal(after[path], before, err_msg=path)


def _named(state) -> dict:
    """Every leaf of a trainer state (dicts and optax tuples) by its path."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                     for k in kp): v for kp, v in flat}


def _as_stacked(leaves: dict) -> dict:
    """Leaves named per layer (`.../transformer/layer{i}/...`) stacked under `layer`."""
    out, per_layer = {}, {}
    for path, x in leaves.items():
        m = re.fullmatch(r"(.*/transformer)/layer(\d+)/(.*)", path)
        if m is None:
            out[path] = np.asarray(x)
        else:
            per_layer.setdefault(f"{m[1]}/layer/{m[3]}", {})[int(m[2])] = np.asarray(x)
    for path, rows in per_layer.items():
        out[path] = np.stack([rows[i] for i in range(len(rows))])
    return out


def test_resume_reads_a_step_saved_with_the_other_stack_form(tmp_path, caplog):
    """A run saved with its layers scanned (params, and Adam's moments of the adapters,
    stacked [layers, ...]) resumes into the same model looped over per-layer params (the
    CPU fine-tuning rule's form), bit for bit; and a looped run's step into the scan."""
    run = str(tmp_path / "run")
    scan = _trainer_cfg(run).set(max_step=2, save_every_n_steps=2)
    saved = jax.device_get(scan.instantiate().run().state)
    loop = scan.clone()
    loop.model.decoder.transformer = swapped_stack(scan.model.decoder.transformer)[0]
    assert loop.model.decoder.transformer.klass is LoopStack
    with caplog.at_level("WARNING", logger="jaxlearn.runtime.stack_forms"):
        restored = loop.instantiate().run()  # max_step reached: the restored state.
    assert restored.step == 2
    assert "step 2 holds the layers of" in caplog.text and "saved stacked" in caplog.text
    got = _named(jax.device_get(restored.state))
    assert any("/layer1/" in p for p in got) and not any("/layer/" in p for p in got)
    want = _named(saved)
    got = _as_stacked(got)
    assert sorted(got) == sorted(want)
    for path, x in want.items():
        assert got[path].tobytes() == np.asarray(x).tobytes(), path
    # The looped run trains on and saves per layer; the scan resumes from that step.
    looped = jax.device_get(loop.set(max_step=3, save_every_n_steps=1).instantiate()
                            .run().state)
    back = scan.set(max_step=3).instantiate().run()
    assert back.step == 3
    want = _as_stacked(_named(looped))
    got = _named(jax.device_get(back.state))
    assert sorted(got) == sorted(want)
    for path, x in got.items():
        assert np.asarray(x).tobytes() == want[path].tobytes(), path
