"""The sampler of RL post-training: the serving `Engine`, in the trainer's process, on the
trainer's model config, running the trainer's current params.

    sampler = EngineSampler(model_cfg, params, tokenizer, max_batch=16, max_seq_len=256)
    rollouts = sampler.sample(prompt_ids, n=4, temperature=1.0, max_new_tokens=64, seed=s)
    sampler.set_params(new_params)      # after a train step: swapped, never copied
    sampler.release()                   # frees the KV pool until the next set_params

Each `Completion` carries the sampled tokens and the log-probability the engine computed for
each of them (the raw f32 model distribution, before temperature / top-p), so a trainer
can check them against its own forward (`logprobs.token_logprobs`). The engine is built
with the trained weight layout (`weight_layout="in_out"`, `roll_layers=False`: the
params are the trainer's tree as is), no fusion or quantization. Copy j of the prompts
(prompt j // n, sample j % n) samples with seed `seed + j`, so a rerun of a step with the
same seed samples the same tokens.

`dtype="bfloat16"` samples from a bf16 copy of the params instead, made at construction
and at each `set_params`, computed in bf16: on one CPU device of a host with native bf16
dots the copy's dense weights are packed for oneMKL (a LoRA projection's base weight too,
its adapter as it is; `inference.weight_layout`), a decode step 2-3x faster than f32 here.
Its log-probabilities are then the bf16 policy's, not the f32 trainer's: the trainer's
`logprob_mismatch_*` metrics measure the gap, and as old-policy log-probabilities they
make the PPO ratio the trained policy's over the policy that really sampled. Given the
learner's `trainable` mask, `set_params` casts only the trained leaves and keeps the
engine's copy (packed or not) of every frozen one: a LoRA run packs its base once, not
every step (SmolLM2-135M: 0.3-0.9 s per step saved).

A prompt's n copies share its KV pages: `sample` first prefills each distinct prompt once
(a `max_new_tokens=0` call) and then samples the copies, whose admission finds the
prompt's full pages in the engine's prefix cache, so only each copy's last partial page is
computed again. The cache is dropped whenever the weights change (`set_params`,
`release`): no page outlives the params it was computed with.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from jaxlearn.inference.engine import Engine
from jaxlearn.inference.weight_layout import pack_weights, packed_layout_chosen

__all__ = ["EngineSampler", "Completion"]


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion of prompt `prompt_index`: ids, per-token log-probabilities
    (the sampler's), why it ended ("stop" or "length"), and its text (cut before a stop
    string, no special tokens)."""

    prompt_index: int
    prompt_ids: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    text: str = ""


class EngineSampler:
    """An in-process `Engine` whose weights are swapped for the trainer's (module doc)."""

    def __init__(self, model_cfg: Any, params: Any, tokenizer: Any = None, *,
                 max_batch: int = 16, max_seq_len: int = 512, page_size: int = 16,
                 dtype: Optional[str] = None, trainable: Any = None):
        if dtype not in (None, "bfloat16"):
            raise ValueError(f"EngineSampler: dtype must be None or 'bfloat16', got {dtype!r}")
        self._dtype = dtype
        # Where set_params may keep the engine's copy (False: the leaf never changes).
        self._trained = None if trainable is None else jax.tree.leaves(trainable)
        if dtype is not None:
            devices = {d for x in jax.tree.leaves(params) if isinstance(x, jax.Array)
                       for d in x.sharding.device_set}
            if len(devices) > 1:  # A sharded bf16 engine is not a tested path.
                raise ValueError(f"EngineSampler: dtype='bfloat16' (rollout.sampler_dtype) "
                                 f"samples on one device; the params are on {len(devices)}")
            model_cfg = model_cfg.clone(dtype=dtype, param_dtype=dtype)
            params = self._cast(params)
        self._model_cfg = model_cfg
        # Packed where the host can (set_params packs anew), else the trained layout.
        packed = dtype is not None and packed_layout_chosen(model_cfg, params, "auto")
        cfg = Engine.default_config().set(
            max_batch=max_batch, max_seq_len=max_seq_len, page_size=page_size,
            prefix_caching=True, weight_layout="packed" if packed else "in_out",
            fuse_projections=False, quantize=None, add_bos=False, roll_layers=False)
        self.engine = Engine(cfg, model_cfg=model_cfg, params=params, tokenizer=tokenizer)
        current = self.engine.runner.params
        self._shardings = jax.tree.map(lambda x: x.sharding, current)
        self._shapes = jax.tree.map(lambda x: (x.shape, x.dtype), current)
        self._released = False

    @property
    def kv_bytes(self) -> int:
        """Bytes of the engine's KV pool (0 while released)."""
        return 0 if self.engine.runner.pool is None else self.engine.runner.cache_bytes()

    def _cast(self, params: Any) -> Any:
        return jax.tree.map(lambda x: x.astype(self._dtype)
                            if jnp.issubdtype(x.dtype, jnp.floating) else x, params)

    def release(self) -> None:
        """Frees the KV pool and drops the engine's reference to the params (training
        time-sliced with sampling gets that memory back, packed copies included); the
        next `sample` reallocates the pool and needs a `set_params` first."""
        runner = self.engine.runner
        runner.pool = runner.seen = runner.counts = runner.params = None
        if self.engine.packed_weights is not None:
            self.engine.packed_weights.close()
        self.engine.scheduler.pages.drop_cached()
        self._released = True

    def set_params(self, params: Any) -> None:
        """Runs `params` from now on (same tree, shapes and dtypes as the first; placed
        like the engine's current ones, which is no copy when they already are)."""
        owner = None
        if self._dtype is not None:
            kept = self._keep_frozen(params)
            if kept is not None:
                params = kept
            else:
                params = self._cast(params)
                if self.engine.packed_weights is not None:  # Packed anew (module doc).
                    _, params, owner = pack_weights(self._model_cfg, params)
        new = jax.device_put(params, self._shardings)
        if jax.tree.map(lambda x: (x.shape, x.dtype), new) != self._shapes:
            if owner is not None:
                owner.close()
            raise ValueError("EngineSampler.set_params: the params' tree, shapes or dtypes "
                             "differ from the engine's")
        if owner is not None:  # No program runs between samples: the old copies go.
            assert self.engine.packed_weights is not None
            self.engine.packed_weights.close()
            self.engine.packed_weights = owner
        self.engine.runner.params = new
        self.engine.scheduler.pages.drop_cached()  # KV pages of the old weights.
        if self._released:
            self.engine.runner.reset()
            self._released = False

    def _keep_frozen(self, params: Any) -> Optional[Any]:
        """The engine's current params with each trained leaf of `params` cast in, the
        frozen ones (and their packed copies) kept; None without a mask, after `release`,
        or when a trained leaf is not stored as it is in `params` (a packed weight: a full
        fine-tune is packed anew)."""
        current = self.engine.runner.params
        if self._trained is None or current is None:
            return None
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        if len(leaves) != len(self._trained):
            raise ValueError(f"EngineSampler.set_params: {len(leaves)} params, the trainable "
                             f"mask has {len(self._trained)}")
        out = _thaw(current)
        for (path, leaf), trained in zip(leaves, self._trained):
            if not trained:
                continue
            node = out
            keys = [getattr(k, "key", None) for k in path]
            for k in keys[:-1]:
                node = node.get(k) if isinstance(node, dict) else None
            old = node.get(keys[-1]) if isinstance(node, dict) else None
            if not isinstance(old, jax.Array) or old.shape != leaf.shape:
                return None
            node[keys[-1]] = leaf.astype(old.dtype)
        return out

    def sample(self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float = 1.0,
               top_p: float = 1.0, max_new_tokens: int = 64, seed: int = 0,
               stop: Optional[Sequence[Any]] = None) -> list[Completion]:
        """`n` completions of each prompt (token ids), in prompt-major order."""
        if n < 1:
            raise ValueError(f"EngineSampler.sample: n must be >= 1, got {n}")
        if self._released:
            raise ValueError("EngineSampler.sample: released; set_params first")
        copies = [(i, list(ids)) for i, ids in enumerate(prompts) for _ in range(n)]
        # Each distinct prompt's full pages into the prefix cache, once (module doc).
        ps = self.engine.config.page_size
        distinct = list({tuple(ids): None for ids in prompts if len(ids) > ps})
        if n > 1 and distinct:
            self.engine.generate([list(ids) for ids in distinct],
                                 params=self.engine.sampling_params(max_new_tokens=0))
        params = self.engine.sampling_params(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            seed=seed, stop=list(stop) if stop else None, logprobs=0)
        # One continuous batch; copy j (prompt j // n, sample j % n) uses seed + j.
        results = self.engine.generate([ids for _, ids in copies], params=params)
        assert isinstance(results, list)
        return [Completion(i, tuple(ids), tuple(r.tokens),
                        tuple(lp.logprob for lp in (r.logprobs or [])), r.finish_reason,
                        r.text)
                for (i, ids), r in zip(copies, results)]


def _thaw(tree: Any) -> Any:
    """A copy of a nested dict's dicts (the leaves shared), to set leaves in."""
    return {k: _thaw(v) for k, v in tree.items()} if isinstance(tree, dict) else tree
