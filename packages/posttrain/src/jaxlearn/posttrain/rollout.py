"""GRPO's sample-and-score step: the trainer's `rollout` (`runtime.rollout.Rollout`).

    cfg.input = PromptInput.default_config().set(num_generations=4, global_batch_size=16, ...)
    cfg.rollout = GRPORollout.default_config().set(rewards=["numeric_match"])
    cfg.objective = GRPOObjective.default_config()

Before each step: the `EngineSampler` (the serving engine, in this process, running the
trainer's current params: no copy to another process, no weight sync) samples
`num_generations` completions of each of this step's prompts; every completion is scored
by the reward functions (`rewards`); `group_advantages` centres (and with
`advantage_scale="group_std"` scales) the rewards within each prompt's group; and
`grpo.rollout_batch` builds the training batch (a row per prompt, its completions as
branches of it, or a row per completion: `PromptInput.shared_prompt`) with the sampler's
log-probabilities as the old policy's (`old_logprobs="sampler"`: the test proves they
equal the trainer's forward in f32; "trainer" computes them with an extra forward of the
same params instead).

Sampling is seeded by (seed, step, the row's position in the global batch), so a resumed
run samples what the uninterrupted one did, and N processes sample what one does. Scalars
per step: `reward_mean`, `reward_std`, `reward_<name>` (each function's mean),
`completion_length` (tokens), `completion_clipped` (share that hit max_new_tokens),
`zero_advantage_groups` (share of groups whose rewards were all equal: no signal),
`sample_time`, `sampling_tokens_per_sec`, `sampler_kv_gb` (the engine's KV pool; freed
while the step trains with `keep_kv_pool=False`), `peak_memory_gb` (the device's peak, or
on CPU the process's peak RSS).
"""

from __future__ import annotations

import re
import resource
import time
from typing import Any, Literal, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxlearn.checkpoint.multihost import background_barrier
from jaxlearn.config import ConfigError
from jaxlearn.posttrain.grpo import group_advantages, rollout_batch
from jaxlearn.posttrain.logprobs import token_logprobs
from jaxlearn.posttrain.prompt_data import PromptInput
from jaxlearn.posttrain.rewards import load_rewards, score
from jaxlearn.posttrain.sampler import Completion, EngineSampler
from jaxlearn.runtime.data import DataError
from jaxlearn.runtime.input_pipeline import rows_per_process
from jaxlearn.runtime.rollout import Rollout

__all__ = ["GRPORollout"]


def peak_memory_bytes() -> int:
    """The first local device's peak bytes in use where the backend reports it (GPU,
    TPU), else this process's peak resident set (CPU: host memory is device memory)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def process_local(params: Any) -> Any:
    """`params` as arrays this process can hand its own engine: a leaf spread over several
    processes becomes its local replica when replicated, else the whole array gathered
    from every process (all processes call this in step)."""
    def local(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if x.is_fully_replicated:
            return x.addressable_data(0)
        return multihost_utils.process_allgather(x, tiled=True)

    return jax.tree.map(local, params)


def _metric_name(spec: str) -> str:
    return "reward_" + re.sub(r"[^A-Za-z0-9]+", "_", spec).strip("_")[:40]


class GRPORollout(Rollout):
    """Samples, scores and batches one GRPO step (module doc)."""

    class Config(Rollout.Config):
        rewards: Sequence[str] = ("numeric_match",)
        reward_weights: Sequence[float] = ()  # Empty: 1 each.
        temperature: float = 1.0
        top_p: float = 1.0
        max_new_tokens: int = 64
        stop: Sequence[str] = ()  # Besides the tokenizer's EOS / end of turn.
        advantage_scale: Literal["group_std", "none"] = "group_std"
        old_logprobs: Literal["sampler", "trainer"] = "sampler"
        seed: int = 0
        max_batch: Optional[int] = None  # The engine's rows (None: a step's completions).
        page_size: int = 16
        # Keep the engine's KV pool between steps (False: free it while the step trains).
        keep_kv_pool: bool = True
        # None: sample with the trainer's params as they are (f32: log-probabilities equal
        # to the trainer's); "bfloat16": from a bf16 copy (`EngineSampler`, faster on CPU).
        sampler_dtype: Optional[str] = None
        # With several processes: how long one that has sampled waits for the others before
        # the step's first collective (a key-value barrier). Sampling time differs between
        # processes (their own prompts and lengths), and the collectives' first rendezvous
        # gives up after 30 s.
        peer_wait_s: float = 3600.0

        def _field_problems(self) -> dict[str, str]:
            problems = {}
            if not self.temperature > 0:
                problems["temperature"] = f"must be > 0, got {self.temperature!r}"
            if not 0 < self.top_p <= 1:
                problems["top_p"] = f"must be in (0, 1], got {self.top_p!r}"
            if self.max_new_tokens < 1:
                problems["max_new_tokens"] = f"must be >= 1, got {self.max_new_tokens!r}"
            if self.advantage_scale not in ("group_std", "none"):
                problems["advantage_scale"] = f"must be 'group_std' or 'none', got " \
                                              f"{self.advantage_scale!r}"
            if self.sampler_dtype not in (None, "bfloat16"):
                problems["sampler_dtype"] = f"must be None or 'bfloat16', got " \
                                            f"{self.sampler_dtype!r}"
            if not self.peer_wait_s > 0:
                problems["peer_wait_s"] = f"must be > 0, got {self.peer_wait_s!r}"
            if self.old_logprobs not in ("sampler", "trainer"):
                problems["old_logprobs"] = f"must be 'sampler' or 'trainer', got " \
                                           f"{self.old_logprobs!r}"
            return problems

    def __init__(self, cfg: Any, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        self.config.validate()
        self._rewards = load_rewards(list(self.config.rewards), list(self.config.reward_weights))
        self._sampler: Optional[EngineSampler] = None
        self._forward: Any = None
        self._calls = 0  # Names each step's barrier (a step may run again after a restart).

    def bind(self, *, model_cfg: Any, input: Any, process_index: int,
             process_count: int, trainable: Any = None) -> None:
        if not isinstance(input, PromptInput):
            raise ConfigError(f"GRPORollout needs a PromptInput as input, got "
                              f"{type(input).__name__}")
        cfg, icfg = self.config, input.config
        self._input, self._model_cfg = input, model_cfg.clone(name="model")
        self._trainable = trainable
        self._group, self._seq = icfg.num_generations, icfg.seq_len
        self._shared = icfg.shared_prompt
        self._prompts = input.prompt_ids()
        per_row = self._group if self._shared else 1  # Completions in a training row.
        for i, ids in enumerate(self._prompts):
            if len(ids) - 1 + per_row * cfg.max_new_tokens > self._seq:
                raise DataError(
                    f"{input.prompt(i).origin}: the prompt has {len(ids)} tokens, and "
                    f"{per_row} x {cfg.max_new_tokens} new ones (rollout.max_new_tokens"
                    f"{', input.num_generations' if self._shared else ''}) do not fit the "
                    f"{self._seq} slots of a row (input.seq_len; a row holds the prompt but "
                    "its last token, then the completions); raise seq_len or shorten the "
                    "prompt")
        # The engine's rows hold one prompt and one completion each.
        self._max_len = max(len(ids) for ids in self._prompts) + cfg.max_new_tokens
        self._completions = rows_per_process(icfg.global_batch_size, process_index,
                                             process_count)
        self._rows = rows_per_process(icfg.batch_rows(), process_index, process_count)
        self._offset = process_index * self._completions
        self._processes = process_count

    def _sample(self, indices: list[int], params: Any, step: int) -> list[Completion]:
        cfg = self.config
        if self._processes > 1:
            params = process_local(params)
        if self._sampler is None:
            self._sampler = EngineSampler(
                self._model_cfg, params, self._input.tokenizer,
                max_batch=cfg.max_batch or self._completions, max_seq_len=self._max_len,
                page_size=cfg.page_size, dtype=cfg.sampler_dtype, trainable=self._trainable)
        else:
            self._sampler.set_params(params)
        seed = (cfg.seed * 1_000_003 + step * 65_537 + self._offset) % (1 << 31)
        return self._sampler.sample([self._prompts[i].tolist() for i in indices], n=self._group,
                                    temperature=cfg.temperature, top_p=cfg.top_p,
                                    max_new_tokens=cfg.max_new_tokens, seed=seed,
                                    stop=list(cfg.stop) or None)

    def _trainer_logprobs(self, params: Any, batch: dict[str, np.ndarray]) -> np.ndarray:
        if self._forward is None:
            model = self._model_cfg.instantiate()
            self._forward = jax.jit(lambda p, b: token_logprobs(model, p, b)[0])
        feed = {k: batch[k] for k in ("input_ids", "target_labels", "positions",
                                      "segment_ids")}
        return np.asarray(self._forward(params, feed), np.float32)

    def __call__(self, rows: dict[str, np.ndarray], params: Any,
                 step: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        t0 = time.monotonic()
        indices = [int(i) for i in rows["prompt_index"] if i >= 0]
        if not indices:
            raise DataError("GRPORollout: the input gave no prompt for this step")
        completions = self._sample(indices, params, step)
        assert self._sampler is not None
        kv_bytes = self._sampler.kv_bytes
        if not self.config.keep_kv_pool:
            self._sampler.release()
        sample_time = time.monotonic() - t0
        rewards = np.zeros(len(completions), np.float64)
        parts = np.zeros((len(completions), len(self._rewards)), np.float64)
        for j, c in enumerate(completions):
            doc = self._input.prompt(indices[c.prompt_index])
            prompt_text = self._input.tokenizer.decode(list(c.prompt_ids))
            rewards[j], parts[j] = score(self._rewards, prompt_text, c.text, doc.record,
                                         doc.origin)
        adv = np.asarray(group_advantages(jnp.asarray(rewards), self._group,
                                          scale=self.config.advantage_scale))
        batch = rollout_batch(completions, adv, seq_len=self._seq,
                              pad_id=self._input.tokenizer.pad_id or 0,
                              group=self._group if self._shared else None)
        pad = self._rows - len(batch["input_ids"])
        if pad:  # Empty prompt slots (an epoch ran out): no loss.
            batch = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)])
                     for k, v in batch.items()}
            batch["target_labels"][-pad:] = -1
        self._calls += 1
        background_barrier(f"jaxlearn_rollout_{step}_{self._calls}", self.config.peer_wait_s)
        if self.config.old_logprobs == "trainer":
            batch["old_logprobs"] = self._trainer_logprobs(params, batch) * (
                batch["target_weights"] > 0)
        return batch, self._scalars(completions, rewards, parts, sample_time, kv_bytes)

    def _scalars(self, completions: list[Completion], rewards: np.ndarray, parts: np.ndarray,
                 sample_time: float, kv_bytes: int) -> dict[str, float]:
        """The step's rollout scalars over every process's completions."""
        lengths = np.array([len(c.tokens) for c in completions], np.float64)
        clipped = np.array([c.finish_reason == "length" for c in completions], np.float64)
        flat = rewards.reshape(-1, self._group)
        zero = np.repeat(flat.std(axis=1) == 0, self._group).astype(np.float64)
        table = np.column_stack([rewards, lengths, clipped, zero, parts])
        if self._processes > 1:  # Rows of every process (each holds whole groups), as
            # uint32 pairs: the gather carries 32-bit words, and the f64 values stay exact.
            words = np.ascontiguousarray(table).view(np.uint32)
            gathered = np.asarray(multihost_utils.process_allgather(words), np.uint32)
            table = gathered.reshape(-1, words.shape[1]).view(np.float64)
        scalars = {
            "reward_mean": float(table[:, 0].mean()), "reward_std": float(table[:, 0].std()),
            "completion_length": float(table[:, 1].mean()),
            "completion_clipped": float(table[:, 2].mean()),
            "zero_advantage_groups": float(table[:, 3].mean()),
            "sample_time": sample_time,
            "sampling_tokens_per_sec": float(lengths.sum()) / max(sample_time, 1e-9),
            "sampler_kv_gb": kv_bytes / 1e9, "peak_memory_gb": peak_memory_bytes() / 1e9,
        }
        if len(self._rewards) > 1:
            for k, r in enumerate(self._rewards):
                scalars[_metric_name(r.name)] = float(table[:, 4 + k].mean())
        return scalars
