"""A training run written in the flat projection layout (`self_attention.q_proj`,
`q_bias`, `feed_forward.wi_0`, ... in params, EMA and the AdamW moments;
fixtures/old_layout_run: tiny-llama with `_SETTINGS`, 2 steps on 8 CPU devices) resumes
with today's Trainer: every leaf of the state is the saved array, and training goes on."""

import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxlearn.checkpoint.tree import flatten
from jaxlearn.experiments.build import build_run
from jaxlearn.layers import older_param_path

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "old_layout_run"
STEP_STATE = FIXTURE / "checkpoints" / "step_00000002" / "state"

# The `--set` overrides the fixture was trained with.
_SETTINGS = [
    "model.decoder.dim=16",
    "model.decoder.transformer.num_layers=1",
    "model.decoder.transformer.layer.self_attention.num_heads=2",
    "model.decoder.transformer.layer.self_attention.num_kv_heads=1",
    "model.decoder.transformer.layer.self_attention.qkv_bias=True",
    "model.decoder.transformer.layer.feed_forward.hidden_dim=32",
    "input.seq_len=16",
    "input.global_batch_size=8",
    "eval_input=None",
    "learner.ema_decay=0.9",
    "save_every_n_steps=2",
]


def _saved_arrays() -> dict[str, np.ndarray]:
    """{saved name: value} of every array of the fixture's step, read by orbax alone."""
    raw = ocp.PyTreeCheckpointer().restore(STEP_STATE.resolve())
    return {p: np.asarray(v) for p, v in flatten(raw)[0]}


def _config(output_dir: pathlib.Path, max_step: int):
    overrides = [*_SETTINGS, f"output_dir={str(output_dir)!r}", f"max_step={max_step}"]
    return build_run("tiny-llama", "cpu-8", overrides).config


def test_old_layout_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    resumed = _config(run_dir, max_step=2).instantiate().run()
    assert resumed.step == 2
    saved = _saved_arrays()
    named = dict(flatten(resumed.state)[0])
    layer = "decoder.transformer.layer"
    for section in ("params", "ema", "opt_state.1.mu", "opt_state.1.nu"):
        for new in (f"{layer}.self_attention.q_proj.weight", f"{layer}.self_attention.k_proj.bias",
                    f"{layer}.feed_forward.wi_0.weight"):
            assert f"{section}.{new}" in named
    used = set()
    for path, value in named.items():
        if path == "prng_key":
            value = jax.random.key_data(value)
        old = path if path in saved else older_param_path(path)
        assert old in saved, path
        np.testing.assert_array_equal(np.asarray(value), saved[old], err_msg=path)
        used.add(old)
    assert used == set(saved)  # Every saved array went to one leaf.

    # Training goes on from there (step 3 is saved in today's layout next to step 2).
    more = _config(run_dir, max_step=3).instantiate().run()
    assert more.step == 3
    assert np.isfinite(more.metrics["loss"])
