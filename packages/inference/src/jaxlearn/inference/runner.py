"""ModelRunner: the device side of the engine. It owns the params, the slot KV cache and
the per-slot "seen tokens" mask, and runs three jit'ed programs through the `CausalLM`
decode API (`init_states`, `extend_step`, `logits`), i.e. the same layer code as training:

- `prefill_chunk`: tokens [1, bucket] of one slot written at cache positions [start,
  start + bucket) by `extend_step(steps=bucket)` on that slot's row; samples the token
  after the last valid one. `bucket` is a power of two (<= prefill_chunk), so a prompt of
  any length compiles at most log2(prefill_chunk) + 1 programs per window.
- `decode`: `steps` fused decode steps (`lax.scan` over `extend_step` + sampling) for
  the first `rows` slots (a power of two), writing one token per active row per step.
- `logits`: a cache-free forward for `Engine.logits`.

KV memory is per slot: a fixed cache [cache_batch, cache_len] per layer, allocated once,
donated to every call (updated in place with dynamic_update_slice) and never copied
host-side. A finished request frees its slot for the next one; the memory a slot holds
does not shrink with the request's length (no paging).

Compute and memory traffic, however, follow the live tokens: every call works on a
window [rows, time_len] of the cache (`time_len` a power of two covering the longest
live row, >= 64), sliced out and written back inside the jit, so `extend_step`'s
attention and its cache copies cost O(live tokens), not O(max_seq_len). Programs are
compiled per (rows, time_len, steps, sampling mode) and per (bucket, time_len).

Rows that are not decoding (free, or mid-prefill) still flow through `decode` with their
time_step frozen: they write one garbage entry at their own next position, which the next
prefill chunk (or decode step) overwrites before anything attends to it (`extend_step`
hides cache positions >= time_step + steps). The window always covers those positions,
so no write is ever clamped onto live data.
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


def _cache_axes(model: Module, params: Any) -> Any:
    """Per cache leaf, (batch axis, time axis or None), found by comparing the shapes of
    `init_states` for batch 1 vs 2 and max_len 4 vs 8."""

    def shapes(b: int, t: int) -> Any:
        return jax.eval_shape(
            lambda p: _call(model, p, "init_states", (b, t))["decoder"], params
        )

    def differing(a: jax.ShapeDtypeStruct, c: jax.ShapeDtypeStruct) -> list[int]:
        return [i for i, (x, y) in enumerate(zip(a.shape, c.shape)) if x != y]

    def axes(a: Any, b2: Any, t8: Any) -> tuple[int, Optional[int]]:
        batch, time = differing(a, b2), differing(a, t8)
        if len(batch) != 1 or len(time) > 1:
            raise ValueError(f"cannot find the batch / time axes of a decode-state leaf {a.shape}")
        return batch[0], (time[0] if time else None)

    base = shapes(1, 4)
    return jax.tree.map(axes, base, shapes(2, 4), shapes(1, 8))


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
        self._axes = _cache_axes(model, params)
        self.min_window = min(64, cache_len)
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
        self._jit_prefill = self._jit(self._prefill, static=("time_len",), donate=(1, 2))
        self._jit_decode = self._jit(
            self._decode, static=("rows", "steps", "mode", "time_len"), donate=(1, 2)
        )
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

    def window(self, needed: int) -> int:
        """Cache positions a call must see to reach position `needed - 1`: a power of two
        (>= min_window), or the whole cache. Attention and cache traffic scale with it."""
        return min(self.cache_len, max(self.min_window, next_pow2(needed)))

    def _starts(self, c: Any, ax: tuple[int, Optional[int]], row: Any) -> list[Any]:
        starts: list[Any] = [0] * c.ndim
        starts[ax[0]] = row
        return starts

    def _slice(self, cache: Any, row: Any, rows: int, time_len: int) -> Any:
        """The [rows, time_len] window of every cache leaf starting at slot `row`."""

        def one(c: Array, ax: tuple[int, Optional[int]]) -> Array:
            sizes = list(c.shape)
            sizes[ax[0]] = rows
            if ax[1] is not None:
                sizes[ax[1]] = time_len
            return lax.dynamic_slice(c, self._starts(c, ax, row), sizes)

        return jax.tree.map(one, cache, self._axes, is_leaf=lambda x: isinstance(x, jax.Array))

    def _put(self, cache: Any, window: Any, row: Any) -> Any:
        return jax.tree.map(
            lambda c, w, ax: lax.dynamic_update_slice(c, w, self._starts(c, ax, row)),
            cache,
            window,
            self._axes,
            is_leaf=lambda x: isinstance(x, jax.Array),
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
        *,
        time_len: int,
    ) -> tuple[Any, Array, Array]:
        """ids [1, bucket] at [start, start + bucket) of row `slot` (start + bucket <=
        time_len); returns the token sampled after position start + n_valid - 1 (with
        generated index 0)."""
        row = self._slice(cache, slot, 1, time_len)
        row, logits = self._forward(params, row, jnp.reshape(start, (1,)), ids)
        cache = self._put(cache, row, slot)
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
        time_len: int,
    ) -> tuple[Any, Array, Array]:
        """`steps` decode steps of slots [0, rows), seeing cache positions [0, time_len)
        (every row's time_step + steps <= time_len, frozen rows included). ids /
        time_step / active [rows]: the last token of each row, its cache position,
        whether it is decoding. Returns tokens [steps, rows]."""
        whole = rows == self.cache_batch and time_len == self.cache_len
        sub = cache if whole else self._slice(cache, 0, rows, time_len)
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
        cache = sub if whole else self._put(cache, sub, 0)
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
        time_len = self.window(start + bucket)
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
            time_len=time_len,
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
        """`steps` decode steps over slots [0, rows); per-row arrays are [rows]. Every
        row's time_step + steps must be <= cache_len. Returns tokens [steps, rows]
        (int32, host)."""
        samp = self._samp(temperature, top_k, top_p, penalty, seeds, index)
        time_len = self.window(int(np.max(time_step)) + steps)
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
            time_len=time_len,
        )
        return np.asarray(toks)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Cache-free forward: ids [b, s] -> logits [b, s, vocab] (f32, host)."""
        return np.asarray(self._traced(self._jit_logits, self.params, ids))

    @functools.cached_property
    def compute_dtype(self) -> Any:
        return jax.tree.leaves(self.cache)[0].dtype
