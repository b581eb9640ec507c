"""The GRPO loop through `Trainer.run`: prompts from JSONL, the in-process engine samples
from the trainer's params, a reward function loaded from a file scores them, the step
trains on them; the reward rises, a crashed run resumes bit for bit, and bad rewards or
prompts fail naming the row."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxlearn.checkpoint import Checkpointer
from jaxlearn.config import ConfigError
from jaxlearn.layers import llama_config
from jaxlearn.mesh import mesh_shape_from_axes
from jaxlearn.posttrain import GRPOObjective, GRPORollout, PromptInput, PromptSource
from jaxlearn.posttrain.rewards import RewardError
from jaxlearn.runtime.data import DataError
from jaxlearn.runtime.trainer import Trainer

VOCAB, SEQ, NEW = 272, 104, 8
PROMPTS = ["Say digits.", "Numbers please.", "Count!", "Write 0-9."]
# Dense toy reward: the share of the completion's characters that are digits.
REWARD = "def digits(prompt, completion, row):\n" \
         "    return sum(c.isdigit() for c in completion) / max(len(completion), 1)\n"


def _files(tmp_path, rows=None, reward=REWARD):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in
                               (rows or [{"prompt": p, "id": i} for i, p in enumerate(PROMPTS)])))
    fn = tmp_path / "reward.py"
    fn.write_text(reward)
    return str(prompts), f"{fn}:digits"


def _config(tmp_path, out, *, rows=None, reward=REWARD, max_step=10, **rollout):
    prompts, spec = _files(tmp_path, rows, reward)
    cfg = Trainer.default_config().set(
        model=llama_config(VOCAB, 32, 2, 4, 2, 64, stack="scan"),
        input=PromptInput.default_config().set(
            source=PromptSource.default_config().set(paths=[prompts]), seq_len=SEQ,
            global_batch_size=8, num_generations=4, eval_fraction=0.0),
        rollout=GRPORollout.default_config().set(rewards=[spec], max_new_tokens=NEW,
                                                 **rollout),
        objective=GRPOObjective.default_config(), checkpointer=Checkpointer.default_config(),
        output_dir=str(out), max_step=max_step, save_every_n_steps=4, log_every_n_steps=1,
        # A row per prompt (its 4 completions as branches): 2 rows, over 2 batch shards.
        mesh_shape=mesh_shape_from_axes(data=2, model=4))
    cfg.learner.set(learning_rate=3e-2, warmup_steps=0, weight_decay=0.0)
    cfg.summary_writer.set(progress=False)
    return cfg


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["split"] == "train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    cfg = _config(tmp, tmp / "run")
    result = cfg.instantiate().run()
    return tmp / "run", result


def test_grpo_raises_the_reward_on_policy(reference):
    out, result = reference
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, 11))
    first, last = np.mean([r["reward_mean"] for r in rows[:3]]), np.mean(
        [r["reward_mean"] for r in rows[-2:]])
    assert last > first + 0.15, [r["reward_mean"] for r in rows]
    for r in rows:  # The sampler's log-probabilities are the trainer's (f32).
        assert r["logprob_mismatch_max"] <= 1e-5, r
        assert r["completion_length"] <= NEW and r["sampling_tokens_per_sec"] > 0
        # Every step's time holds its rollout, the first one's too (it compiled the
        # train step after sampling; only the compilation is left out).
        assert r["step_time"] >= r["rollout_time"] > 0, r
    goodput = json.loads((out / "goodput.json").read_text())
    assert goodput["seconds"]["rollout"] > 0


def test_a_crashed_run_resumes_bit_exact(tmp_path, reference):
    ref_out, ref = reference
    out = tmp_path / "run"
    cfg = _config(tmp_path, out)
    cfg.resilience.set(faults="crash@6")
    with pytest.raises(RuntimeError, match="crash before step 6"):
        cfg.instantiate().run()
    result = cfg.instantiate().run()  # Resumes from step 4, samples what the first run did.
    # From step 4's checkpoint: step 5, done before the crash, is redone once (rework).
    assert result.step == 10 and result.resilience.goodput.steps["rework"] == 1
    assert sorted(r["step"] for r in _rows(out)) == list(range(1, 11))  # Logged once each.
    for a, b in zip(jax.tree.leaves(result.state["params"]),
                    jax.tree.leaves(ref.state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = {r["step"]: r["reward_mean"] for r in _rows(ref_out)}
    assert {r["step"]: r["reward_mean"] for r in _rows(out)} == want


CHILD = """
import pathlib, sys
sys.path[:0] = {path!r}
import conftest  # noqa: F401  (8 fake CPU devices, as in this process)
from test_grpo_loop import _config
cfg = _config(pathlib.Path({tmp!r}), pathlib.Path({out!r}))
cfg.resilience.set(faults="kill@6:rollout+{delay}")
cfg.instantiate().run()
"""


@pytest.mark.parametrize("delay", [0, 300])
def test_sigkill_while_sampling_resumes_bit_exact(tmp_path, reference, delay):
    """SIGKILL while step 6's completions are being sampled (at its start, or 0.3 s in):
    the rerun resumes from the newest committed checkpoint (step 4, or none while its
    async commit was unfinished), samples what the first run sampled and ends with the
    uninterrupted run's params, bit for bit, and its rewards at every step."""
    out = tmp_path / "run"
    path = [os.path.abspath(p) for p in sys.path if p]
    code = CHILD.format(path=path, tmp=str(tmp_path), out=str(out), delay=delay)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]
    cfg = _config(tmp_path, out)
    cfg.resilience.set(faults="kill@6:rollout+%d" % delay)  # Fired already: not again.
    result = cfg.instantiate().run()
    for a, b in zip(jax.tree.leaves(result.state["params"]),
                    jax.tree.leaves(reference[1].state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = {r["step"]: r["reward_mean"] for r in _rows(reference[0])}
    assert {r["step"]: r["reward_mean"] for r in _rows(out)} == want  # The rerun's rows last.


def test_old_logprobs_from_the_trainer_agree_with_the_sampler(tmp_path):
    cfg = _config(tmp_path, tmp_path / "fwd", max_step=1, old_logprobs="trainer")
    result = cfg.instantiate().run()
    assert result.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert result.metrics["logprob_mismatch_max"] <= 1e-5


def test_a_released_kv_pool_samples_the_same(tmp_path, reference):
    """`keep_kv_pool=False` frees the pool while each step trains; the samples (so the
    rewards and the params) are those of the run that keeps it."""
    out = tmp_path / "release"
    result = _config(tmp_path, out, keep_kv_pool=False).instantiate().run()
    rows, want = _rows(out), _rows(reference[0])
    assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in want]
    for a, b in zip(jax.tree.leaves(result.state["params"]),
                    jax.tree.leaves(reference[1].state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(r["sampler_kv_gb"] > 0 and r["peak_memory_gb"] > 0 for r in rows)


def test_batches_cut_to_their_longest_row_train_like_full_ones(tmp_path, reference):
    """`pad_to_multiple_of`: each batch is cut to its longest row (rounded up to 2 of
    the 104 slots); the first step (the same samples) reports the same loss, grad
    norm and rewards as the full-length step."""
    cfg = _config(tmp_path, tmp_path / "cut", max_step=1)
    cfg.pad_to_multiple_of = 2
    trainer = cfg.instantiate()
    result = trainer.run()
    want = _rows(reference[0])[0]
    for k in ("reward_mean", "num_tokens"):
        assert result.metrics[k] == want[k]
    for k in ("loss", "grad_norm", "entropy"):
        assert result.metrics[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k
    (shape,) = [dict((n, s) for n, s, _ in key)["input_ids"] for key in trainer._programs.flops]
    assert shape[1] < SEQ and shape[1] % 2 == 0


def test_a_row_per_completion_trains_like_the_shared_prompt_rows(tmp_path, reference):
    """`shared_prompt=False` (a row per completion, the prompt in each): the first step
    (the same samples) has the loss, grad norm and metrics of the default layout (a row
    per prompt, its completions as branches), over 4x the rows."""
    cfg = _config(tmp_path, tmp_path / "rows", max_step=1)
    cfg.input.shared_prompt = False
    cfg.mesh_shape = mesh_shape_from_axes(data=8)
    result = cfg.instantiate().run()
    want = _rows(reference[0])[0]
    for k in ("reward_mean", "num_tokens", "num_completions"):
        assert result.metrics[k] == want[k], k
    # The first step's loss is a sum of O(1) terms that cancels to ~0 (ratio 1, advantages
    # of mean 0): the two layouts' summation orders part by f32 rounding of those terms.
    for k in ("loss", "grad_norm", "entropy", "ratio_mean"):
        assert result.metrics[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k


def test_failing_rewards_and_bad_prompts_name_the_row(tmp_path):
    raising = "def digits(prompt, completion, row):\n    raise KeyError(row['id'])\n"
    with pytest.raises(RewardError, match=r"prompts.jsonl:\d: reward .*reward.py:digits raised "
                                          "KeyError") as e:
        _config(tmp_path, tmp_path / "a", reward=raising, max_step=1).instantiate().run()
    line, row_id = re.search(r"prompts.jsonl:(\d).*KeyError: (\d)", str(e.value)).groups()
    assert int(line) == int(row_id) + 1  # The row named is the one the reward failed on.
    nan = "def digits(prompt, completion, row):\n    return float('nan')\n"
    with pytest.raises(RewardError, match=r"prompts.jsonl:\d: reward .* returned nan, not a "
                                          "finite number"):
        _config(tmp_path, tmp_path / "b", reward=nan, max_step=1).instantiate().run()
    rows = [{"prompt": "ok"}, {"messages": [{"role": "user", "content": "x"},
                                            {"role": "assistant", "content": "y"}]}]
    with pytest.raises(DataError, match="prompts.jsonl:2: 'messages' ends with an assistant"):
        _config(tmp_path, tmp_path / "c", rows=rows, max_step=1).instantiate().run()
    long = [{"prompt": "x" * 200}]
    with pytest.raises(DataError, match=r"prompts.jsonl:1: the prompt has \d+ tokens"):
        _config(tmp_path, tmp_path / "d", rows=long, max_step=1).instantiate().run()
    with pytest.raises(ConfigError, match="num_generations=3 must be >= 1 and divide"):
        PromptInput.default_config().set(
            source=PromptSource.default_config().set(paths=["x"]), seq_len=8,
            global_batch_size=8, num_generations=3).instantiate()
    with pytest.raises(RewardError, match="no function 'nope'"):
        _config(tmp_path, tmp_path / "e", max_step=1).rollout.set(
            rewards=[str(tmp_path / "reward.py") + ":nope"]).instantiate()
