"""ModelRunner: the device side of the engine. It owns the params, the slot KV cache and
the per-slot "seen tokens" mask, and runs three jit'ed programs through the `CausalLM`
decode API (`init_states`, `extend_step`, `logits`), i.e. the same layer code as training:

- `prefill_chunk`: tokens [1, bucket] of one slot written at cache slots [start, start +
  bucket) by `extend_step(steps=bucket)` on that slot's row; samples the token after the
  last valid one. `bucket` is a power of two (<= prefill_chunk), so a prompt of any
  length compiles at most log2(prefill_chunk) + 1 programs.
- `decode`: `steps` (1, 2, 4, ...) fused decode steps (`lax.scan` over `extend_step` +
  sampling) for the first `rows` slots (a power of two), writing one token per active
  row per step.
- `logits`: a cache-free forward for `Engine.logits`.

KV memory is per slot: a fixed cache [cache_batch, cache_len] per layer, allocated once,
donated to every call (updated in place with dynamic_update_slice) and never copied
host-side. A finished request frees its slot for the next one; the memory a slot holds
does not shrink with the request's length (no paging).

Rows that are not decoding (free, or mid-prefill) still flow through `decode` with their
time_step frozen: they write one garbage entry at their own next slot, which the next
prefill chunk (or decode step) overwrites before anything attends to it (`extend_step`
hides cache slots >= time_step + steps).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.inference.sampling import Mode, sample_tokens
from jaxlearn.module import Module, functional, logical_sharding

log = logging.getLogger(__name__)
Array = jax.Array


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _batch_axes(model: Module, params: Any) -> Any:
    """Per cache leaf, the axis that indexes the batch (found by comparing batch 1 vs 2)."""

    def shapes(b: int) -> Any:
        return jax.eval_shape(lambda p: _call(model, p, "init_states", (b, 4))["decoder"], params)

    def axis(a: jax.ShapeDtypeStruct, c: jax.ShapeDtypeStruct) -> int:
        diff = [i for i, (x, y) in enumerate(zip(a.shape, c.shape)) if x != y]
        if len(diff) != 1:
            raise ValueError(f"cannot find the batch axis of a decode-state leaf {a.shape}")
        return diff[0]

    return jax.tree.map(axis, shapes(1), shapes(2))


def _call(model: Module, params: Any, method: str, inputs: Any) -> Any:
    out, _ = functional(model, None, params, inputs, method=method, is_training=False)
    return out


class ModelRunner:
    """Params + slot cache + jit'ed prefill / decode / logits (see module docstring).

    model: an instantiated `CausalLM` (anything with `init_states(batch, max_len)`,
        `extend_step(states, ids)`, `logits(batch)`).
    cache_batch / cache_len: slots and tokens per slot of the cache.
    vocab_limit: ids >= this never get sampled (None: the model's vocabulary).
    mesh / spec_fn: optional; the jit'ed programs trace under
        `logical_sharding(mesh, spec_fn)` and params/cache/outputs keep fixed shardings.
    """

    def __init__(
        self,
        model: Module,
        params: Any,
        *,
        cache_batch: int,
        cache_len: int,
        vocab_size: int,
        vocab_limit: Optional[int] = None,
        mesh: Optional[Mesh] = None,
        spec_fn: Any = None,
        cache_shardings: Any = None,
    ):
        self.model = model
        self.params = params
        self.cache_batch = cache_batch
        self.cache_len = cache_len
        self.vocab_size = vocab_size
        self.vocab_limit = vocab_limit if vocab_limit and vocab_limit < vocab_size else None
        self.mesh = mesh
        self._spec_fn = spec_fn
        self._axes = _batch_axes(model, params)
        if mesh is not None:
            rep = NamedSharding(mesh, PartitionSpec())
            abstract = jax.eval_shape(self._init_cache)
            self._cache_sh: Any = (
                cache_shardings
                if cache_shardings is not None
                else jax.tree.map(lambda _: rep, abstract)
            )
            self._seen_sh: Any = rep
            self._rep: Any = rep
        else:
            self._cache_sh = self._seen_sh = self._rep = None
        self._jit_prefill = self._jit(self._prefill, static=(), donate=(1, 2))
        self._jit_decode = self._jit(self._decode, static=("rows", "steps", "mode"), donate=(1, 2))
        self._jit_logits = self._jit(self._logits, static=(), donate=())
        self.cache: Any = None
        self.seen: Any = None
        self.reset()

    # ---- setup --------------------------------------------------------------------------

    def _jit(self, fn: Any, *, static: tuple[str, ...], donate: tuple[int, ...]) -> Any:
        kwargs: dict[str, Any] = {"static_argnames": static, "donate_argnums": donate}
        if self.mesh is not None and donate:
            kwargs["out_shardings"] = (self._cache_sh, self._seen_sh, self._rep)
        return jax.jit(fn, **kwargs)

    def _traced(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.mesh is None:
            return fn(*args, **kwargs)
        with jax.set_mesh(self.mesh), logical_sharding(self.mesh, self._spec_fn):
            return fn(*args, **kwargs)

    def _init_cache(self) -> Any:
        return _call(self.model, self.params, "init_states", (self.cache_batch, self.cache_len))[
            "decoder"
        ]

    def reset(self) -> None:
        """(Re)allocates an empty cache and seen-mask (drops every slot's contents)."""
        self.cache = self.seen = None  # Free the old buffers first.
        init = jax.jit(self._init_cache, out_shardings=self._cache_sh)
        self.cache = self._traced(init)
        seen = jnp.zeros((self.cache_batch, self.vocab_size), bool)
        self.seen = seen if self._seen_sh is None else jax.device_put(seen, self._seen_sh)

    def cache_bytes(self) -> int:
        """Bytes of the KV cache (all slots)."""
        return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.cache)))

    # ---- row helpers (inside jit) -----------------------------------------------------------

    def _rows(self, cache: Any, start: Any, size: int) -> Any:
        return jax.tree.map(
            lambda c, ax: lax.dynamic_slice_in_dim(c, start, size, axis=ax), cache, self._axes
        )

    def _put_rows(self, cache: Any, rows: Any, start: Any) -> Any:
        return jax.tree.map(
            lambda c, r, ax: lax.dynamic_update_slice_in_dim(c, r, start, axis=ax),
            cache,
            rows,
            self._axes,
        )

    def _forward(self, params: Any, cache: Any, time_step: Array, ids: Array) -> Any:
        states = {"time_step": time_step, "decoder": cache}
        new_states, logits = _call(self.model, params, "extend_step", (states, ids))
        return new_states["decoder"], logits

    # ---- jit'ed programs ----------------------------------------------------------------

    def _prefill(
        self,
        params: Any,
        cache: Any,
        seen: Array,
        slot: Array,
        ids: Array,
        start: Array,
        n_valid: Array,
        samp: dict[str, Array],
    ) -> tuple[Any, Array, Array]:
        """ids [1, bucket] at [start, start + bucket) of row `slot`; returns the token
        sampled after position start + n_valid - 1 (with generated index 0)."""
        row = self._rows(cache, slot, 1)
        row, logits = self._forward(params, row, jnp.reshape(start, (1,)), ids)
        cache = self._put_rows(cache, row, slot)
        v = seen.shape[1]
        valid = jnp.arange(ids.shape[1]) < n_valid
        fresh = jnp.zeros((v,), bool).at[jnp.where(valid, ids[0], v)].set(True, mode="drop")
        seen_row = jnp.where(start == 0, fresh, seen[slot] | fresh)
        seen = lax.dynamic_update_slice_in_dim(seen, seen_row[None], slot, axis=0)
        last = lax.dynamic_index_in_dim(logits[0], n_valid - 1, axis=0)  # [1, v]
        tok = sample_tokens(
            last, seen_row[None], mode="filter", vocab_limit=self.vocab_limit, **samp
        )
        return cache, seen, tok[0]

    def _decode(
        self,
        params: Any,
        cache: Any,
        seen: Array,
        ids: Array,
        time_step: Array,
        active: Array,
        samp: dict[str, Array],
        *,
        rows: int,
        steps: int,
        mode: Mode,
    ) -> tuple[Any, Array, Array]:
        """`steps` decode steps of slots [0, rows). ids / time_step / active [rows]: the
        last token of each row, its cache position, whether it is decoding. Returns
        tokens [steps, rows]."""
        whole = rows == self.cache_batch
        sub = cache if whole else self._rows(cache, 0, rows)
        sub_seen = seen[:rows]
        index0 = samp.pop("index")
        r = jnp.arange(rows)
        v = seen.shape[1]

        def body(carry: Any, _: Any) -> tuple[Any, Array]:
            sub, sub_seen, tok, t, index = carry
            sub_seen = sub_seen.at[r, jnp.where(active, tok, v)].set(True, mode="drop")
            sub, logits = self._forward(params, sub, t, tok[:, None])
            nxt = sample_tokens(
                logits[:, 0],
                sub_seen,
                mode=mode,
                vocab_limit=self.vocab_limit,
                index=index,
                **samp,
            )
            nxt = jnp.where(active, nxt, tok)
            step = active.astype(jnp.int32)
            return (sub, sub_seen, nxt, t + step, index + step), nxt

        init = (sub, sub_seen, ids, time_step, index0)
        (sub, sub_seen, _, _, _), toks = lax.scan(body, init, None, length=steps)
        cache = sub if whole else self._put_rows(cache, sub, 0)
        seen = lax.dynamic_update_slice_in_dim(seen, sub_seen, 0, axis=0)
        return cache, seen, toks

    def _logits(self, params: Any, ids: Array) -> Array:
        return _call(self.model, params, "logits", ({"input_ids": ids},))

    # ---- host API -------------------------------------------------------------------------

    @staticmethod
    def _samp(
        temperature: Any, top_k: Any, top_p: Any, penalty: Any, seeds: Any, index: Any
    ) -> dict[str, np.ndarray]:
        return {
            "temperature": np.asarray(temperature, np.float32),
            "top_k": np.asarray(top_k, np.int32),
            "top_p": np.asarray(top_p, np.float32),
            "penalty": np.asarray(penalty, np.float32),
            "seeds": np.asarray(seeds, np.uint32),
            "index": np.asarray(index, np.int32),
        }

    def prefill_chunk(
        self,
        slot: int,
        ids: np.ndarray,
        start: int,
        bucket: int,
        *,
        temperature: float,
        top_k: int,
        top_p: float,
        penalty: float,
        seed: int,
    ) -> int:
        """Writes ids [n] (n <= bucket) at cache positions [start, start + n) of `slot`
        (start == 0 resets the slot's seen-mask) and returns the sampled next token.
        Requires start + bucket <= cache_len."""
        n = len(ids)
        if not 0 < n <= bucket or start + bucket > self.cache_len:
            raise ValueError(f"prefill_chunk: {n} ids in bucket {bucket} at {start}")
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :n] = ids
        samp = self._samp([temperature], [top_k], [top_p], [penalty], [seed], [0])
        self.cache, self.seen, tok = self._traced(
            self._jit_prefill,
            self.params,
            self.cache,
            self.seen,
            np.int32(slot),
            padded,
            np.int32(start),
            np.int32(n),
            samp,
        )
        return int(tok)

    def decode(
        self,
        *,
        rows: int,
        steps: int,
        mode: Mode,
        ids: np.ndarray,
        time_step: np.ndarray,
        active: np.ndarray,
        temperature: np.ndarray,
        top_k: np.ndarray,
        top_p: np.ndarray,
        penalty: np.ndarray,
        seeds: np.ndarray,
        index: np.ndarray,
    ) -> np.ndarray:
        """`steps` decode steps over slots [0, rows); per-row arrays are [rows].
        Returns tokens [steps, rows] (int32, host)."""
        samp = self._samp(temperature, top_k, top_p, penalty, seeds, index)
        self.cache, self.seen, toks = self._traced(
            self._jit_decode,
            self.params,
            self.cache,
            self.seen,
            np.asarray(ids, np.int32),
            np.asarray(time_step, np.int32),
            np.asarray(active, bool),
            samp,
            rows=rows,
            steps=steps,
            mode=mode,
        )
        return np.asarray(toks)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Cache-free forward: ids [b, s] -> logits [b, s, vocab] (f32, host)."""
        return np.asarray(self._traced(self._jit_logits, self.params, ids))

    @functools.cached_property
    def compute_dtype(self) -> Any:
        return jax.tree.leaves(self.cache)[0].dtype
