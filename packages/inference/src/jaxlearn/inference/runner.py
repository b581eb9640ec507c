"""ModelRunner: the device side of the engine. It owns the params, the paged KV pool, the
per-slot "seen tokens" mask and generated-token counts, and runs jit'ed programs through
the `CausalLM` decode API (`init_paged_states`, `extend_step`, `logits`), i.e. the same
layer code as training:

- `prefill`: prompt chunks of several requests, ids [rows, bucket]; row r is written at
  positions [start[r], start[r] + bucket) of its pages and the token after its last
  valid position is sampled (only that position's logits: `logits_index`); a call
  scoring prompt tokens (echo + logprobs) computes every position's.
- `decode`: `steps` fused decode steps (`lax.scan` over `extend_step` + sampling) for a
  compacted list of decoding rows (any slots), one token per row per step.
- `rows`: a mixed step over ragged rows, decode rows and prompt chunks back to back
  (`rows_step.py`, `mixed.py`).
- `verify`: speculative verification; `logits`: a cache-free forward (`Engine.logits`).

KV memory is one pool of pages per layer ([num_pages, *page], `jaxlearn.kernels.paged`),
allocated once and donated to every call; the scheduler's `PageTable` hands pages to
requests as they grow and a call receives its rows' page tables. Page 0 belongs to
nobody: padding rows and positions past a row's pages read and write it.

Every call passes each row's whole page table ([rows, max_len / page_size]); attention
follows each row's live length at run time, so no length is part of a program's shape.
Programs are compiled per (rows, bucket, scoring) for prefill, (rows, steps) for decode
and (rows, tokens) for mixed steps, all powers of two. Sampling settings are never part
of the key: every call passes the same fixed-width per-row arrays (`decoding.sampling`:
temperature, top-k/p, penalties, a `MAX_LOGIT_BIAS`-wide logit bias, grammar bit rows,
whether the row wants logprobs) and the program skips at run time what no row uses. So
the set of programs is fixed by the engine's config (`programs.reachable`), compiled by
`warmup`, and no request can add one.

Padding rows (to reach a power of two) use slot `num_slots`, a seen-mask / counts row
nobody owns, and the null page table. Each row's LoRA slot (`adapters.py`; 0: none) is
a per-row setting, handed to the model as the `multi_lora.ADAPTER_ROWS` side input.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.decoding.logprobs import MAX_LOGPROBS, token_logprobs, wanted_logprobs
from jaxlearn.decoding.penalties import pack
from jaxlearn.decoding.sampling import sample_tokens
from jaxlearn.inference.rows_step import rows_args, rows_step
from jaxlearn.layers.attention import Attention
from jaxlearn.layers.multi_lora import ADAPTER_ROWS
from jaxlearn.module import Module, functional, logical_sharding

log = logging.getLogger(__name__)
Array = jax.Array


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def kv_window(model: Module) -> Optional[int]:
    """How far back a query of `model` sees when every attention layer of it is causal
    with a sliding window: the largest window (keys at distance >= it are masked in every
    layer). None when some layer sees the whole prefix (e.g. the global layers of Gemma)
    or there is no attention: then a paged cache must keep every position."""
    windows, todo = [], [model]
    while todo:
        m = todo.pop()
        if isinstance(m, Attention):
            if m.config.sliding_window is None or not m.config.causal:
                return None
            windows.append(int(m.config.sliding_window))
        todo.extend(m.children.values())
    return max(windows) if windows else None


def _call(model: Module, params: Any, method: str, inputs: Any, side: Any = None) -> Any:
    out, _ = functional(model, None, params, inputs, method=method, is_training=False,
                        side_inputs=side)
    return out


def _set_rows(seen: Array, counts: Array, slot: Array, s: Array, c: Array) -> tuple[Array, Array]:
    return seen.at[slot].set(s), counts.at[slot].set(c)


class ModelRunner:
    """Params + paged KV pool + jit'ed prefill / decode / logits (see module docstring).

    model: an instantiated `CausalLM` (anything with `init_paged_states(num_pages,
        page_size)`, `extend_step(states, ids, logits_index)`, `logits(batch)`).
    num_slots: requests that may hold pages at once (rows of the seen-mask).
    num_pages / page_size: the pool (page 0 included, never handed out); page_size a
        power of two <= 64.
    max_len: positions per request (a multiple of page_size).
    vocab_limit: ids >= this never get sampled (None: the model's vocabulary).
    mesh / spec_fn: optional; the jit'ed programs trace under
        `logical_sharding(mesh, spec_fn)`; params keep their shardings, the pool is
        replicated.
    """

    def __init__(
        self,
        model: Module,
        params: Any,
        *,
        num_slots: int,
        num_pages: int,
        page_size: int,
        max_len: int,
        vocab_size: int,
        vocab_limit: Optional[int] = None,
        mesh: Optional[Mesh] = None,
        spec_fn: Any = None,
    ):
        if page_size & (page_size - 1) or not 0 < page_size <= 64 or max_len % page_size:
            raise ValueError(
                f"page_size={page_size} must be a power of two <= 64 dividing max_len={max_len}"
            )
        self.model = model
        self.params = params
        self.num_slots = num_slots
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.vocab_limit = vocab_limit if vocab_limit and vocab_limit < vocab_size else None
        self.mesh = mesh
        self._spec_fn = spec_fn
        if mesh is not None:
            rep = NamedSharding(mesh, PartitionSpec())
            abstract = jax.eval_shape(self._init_pool)
            self._pool_sh: Any = jax.tree.map(lambda _: rep, abstract)
            self._rep: Any = rep
        else:
            self._pool_sh = self._rep = None
        self.mask_words = -(-vocab_size // 32)
        # Compiled prefill / decode programs by `_key`; `sealed` once warm-up has run.
        self.programs: dict[tuple, Any] = {}
        self.sealed = False
        self.compiled_late = 0
        self._jit_prefill = self._jit(self._prefill, static=("scoring",))
        self._jit_decode = self._jit(self._decode, static=("steps",))
        self._jit_verify = self._jit(self._verify, static=())
        self._jit_mixed = self._jit(functools.partial(rows_step, self), static=())
        self._jit_logits = jax.jit(self._logits)
        rows_kw: dict[str, Any] = {} if mesh is None else {"out_shardings": (self._rep,) * 2}
        self._jit_rows = jax.jit(_set_rows, donate_argnums=(0, 1), **rows_kw)
        self.pool: Any = None
        self.seen: Any = None
        self.counts: Any = None
        self.reset()

    # ---- setup --------------------------------------------------------------------------

    def _jit(self, fn: Any, *, static: tuple[str, ...]) -> Any:
        kwargs: dict[str, Any] = {"static_argnames": static, "donate_argnums": (1, 2, 3)}
        if self.mesh is not None:
            kwargs["out_shardings"] = (self._pool_sh, self._rep, self._rep, self._rep)
        return jax.jit(fn, **kwargs)

    def _traced(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.mesh is None:
            return fn(*args, **kwargs)
        with jax.set_mesh(self.mesh), logical_sharding(self.mesh, self._spec_fn):
            return fn(*args, **kwargs)

    def _init_pool(self) -> Any:
        states = _call(
            self.model, self.params, "init_paged_states", (self.num_pages, self.page_size)
        )
        return states["decoder"]

    def reset(self) -> None:
        """(Re)allocates an empty pool, seen-mask and generated-token counts (drops every
        request's contents)."""
        self.pool = self.seen = self.counts = None  # Free the old buffers first.
        self.pool = self._traced(jax.jit(self._init_pool, out_shardings=self._pool_sh))
        shape = (self.num_slots + 1, self.vocab_size)
        seen, counts = jnp.zeros(shape, bool), jnp.zeros(shape, jnp.int32)
        self.seen = seen if self._rep is None else jax.device_put(seen, self._rep)
        self.counts = counts if self._rep is None else jax.device_put(counts, self._rep)

    def cache_bytes(self) -> int:
        """Bytes of the KV pool (all layers, all pages)."""
        return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.pool)))

    def bytes_per_page(self) -> int:
        return self.cache_bytes() // self.num_pages

    def _table(self, tables: Any, rows: int) -> np.ndarray:
        """Page tables [n, pages] -> [rows, max_len / page_size], padded with page 0 (a
        padded prefill chunk near max_len writes its positions past it there)."""
        tables = np.asarray(tables, np.int32)
        out = np.zeros((rows, self.max_len // self.page_size), np.int32)
        w = min(out.shape[1], tables.shape[1])
        out[: len(tables), :w] = tables[:, :w]
        return out

    # ---- jit'ed programs ----------------------------------------------------------------

    def _forward(
        self, params: Any, pool: Any, table: Array, time_step: Array, ids: Array, last: Any,
        adapters: Array,
    ) -> tuple[Any, Array]:
        states = {"time_step": time_step, "decoder": pool, "page_table": table}
        new_states, logits = _call(self.model, params, "extend_step", (states, ids, last),
                                   {ADAPTER_ROWS: adapters})
        return new_states["decoder"], logits

    def _prefill(
        self,
        params: Any,
        pool: Any,
        seen: Array,
        counts: Array,
        slots: Array,
        table: Array,
        ids: Array,
        start: Array,
        n_valid: Array,
        gen_from: Array,
        targets: Array,
        samp: dict[str, Array],
        pen: dict[str, Array],
        allow: Array,
        *,
        scoring: bool,
    ) -> tuple[Any, Array, Array, dict[str, Array]]:
        """ids [rows, bucket] at positions [start, start + bucket) of each row's pages
        (table [rows, max_len / page_size]); positions >= gen_from [rows] hold generated
        tokens (they count for presence / frequency penalties). Returns {"tok": [rows]}
        sampled after position start + n_valid - 1 and its `wanted_logprobs` ("lp" [rows],
        "top_ids" / "top_lp" [rows, MAX_LOGPROBS]); with scoring also "prompt": the
        `token_logprobs` of targets [rows, bucket] (the next id at each position) [rows,
        bucket, ...]: then every position's logits are computed, else only the last
        one's (`logits_index`)."""
        last = (n_valid - 1)[:, None]
        samp = dict(samp)
        want, lora = samp.pop("logprobs"), samp.pop("adapter")
        pool, logits = self._forward(params, pool, table, start, ids,
                                     None if scoring else last, lora)
        out: dict[str, Any] = {}
        if scoring:
            out["prompt"] = token_logprobs(logits, targets, MAX_LOGPROBS)
            logits = jnp.take_along_axis(logits, last[..., None], axis=1)  # [rows, 1, v]
        rows, bucket, v = ids.shape[0], ids.shape[1], seen.shape[1]
        r = jnp.arange(rows)[:, None]
        valid = jnp.arange(bucket)[None, :] < n_valid[:, None]
        fresh = jnp.zeros((rows, v), bool).at[r, jnp.where(valid, ids, v)].set(True, mode="drop")
        seen_rows = jnp.where((start == 0)[:, None], fresh, seen[slots] | fresh)
        seen = seen.at[slots].set(seen_rows)
        generated = valid & (start[:, None] + jnp.arange(bucket)[None, :] >= gen_from[:, None])
        added = jnp.zeros((rows, v), counts.dtype).at[r, jnp.where(generated, ids, v)].add(
            1, mode="drop")
        count_rows = jnp.where((start == 0)[:, None], 0, counts[slots]) + added
        counts = counts.at[slots].set(count_rows)
        tok = sample_tokens(logits[:, 0], seen_rows, vocab_limit=self.vocab_limit,
                            counts=count_rows, pen=pen, allow=allow, **samp)
        out["tok"] = tok
        out.update(wanted_logprobs(logits[:, 0], tok, want))
        return pool, seen, counts, out

    def _decode(
        self,
        params: Any,
        pool: Any,
        seen: Array,
        counts: Array,
        slots: Array,
        table: Array,
        ids: Array,
        time_step: Array,
        active: Array,
        samp: dict[str, Array],
        pen: dict[str, Array],
        allow: Array,
        *,
        steps: int,
    ) -> tuple[Any, Array, Array, dict[str, Array]]:
        """`steps` decode steps of rows (slots [rows]); ids / time_step / active [rows]:
        the last token of each row, its position, whether it is a real row. Every row's
        time_step + steps <= the table's width x page_size. Returns {"tok": [steps, rows]}
        and their `wanted_logprobs` ([steps, rows, ...]). `allow` (grammar bit rows
        [rows, words]) masks every step's draw: the host passes all ones when steps > 1
        (a grammar's mask follows each token)."""
        sub_seen, sub_counts, samp = seen[slots], counts[slots], dict(samp)
        index0, want, lora = samp.pop("index"), samp.pop("logprobs"), samp.pop("adapter")
        r = jnp.arange(ids.shape[0])
        v = seen.shape[1]

        def body(carry: Any, _: Any) -> tuple[Any, dict[str, Array]]:
            pool, sub_seen, sub_counts, tok, t, index = carry
            where = jnp.where(active, tok, v)
            sub_seen = sub_seen.at[r, where].set(True, mode="drop")
            sub_counts = sub_counts.at[r, where].add(1, mode="drop")
            pool, logits = self._forward(params, pool, table, t, tok[:, None], None, lora)
            nxt = sample_tokens(
                logits[:, 0], sub_seen, vocab_limit=self.vocab_limit, index=index,
                counts=sub_counts, pen=pen, allow=allow, **samp
            )
            nxt = jnp.where(active, nxt, tok)
            out = {"tok": nxt, **wanted_logprobs(logits[:, 0], nxt, want)}
            step = active.astype(jnp.int32)
            return (pool, sub_seen, sub_counts, nxt, t + step, index + step), out

        init = (pool, sub_seen, sub_counts, ids, time_step, index0)
        (pool, sub_seen, sub_counts, _, _, _), outs = lax.scan(body, init, None, length=steps)
        return pool, seen.at[slots].set(sub_seen), counts.at[slots].set(sub_counts), outs

    def _verify(
        self,
        params: Any,
        pool: Any,
        seen: Array,
        counts: Array,
        slots: Array,
        table: Array,
        ids: Array,
        time_step: Array,
        active: Array,
        samp: dict[str, Array],
        pen: dict[str, Array],
        allow: Array,
    ) -> tuple[Any, Array, Array, dict[str, Array]]:
        """Speculative verification (`decoding.speculative`): ids [rows, k + 1] (last token, k
        drafts) at positions time_step + [0, k]; position j is sampled with generated
        index index + j. Returns {"tok": [rows, k + 1], "accepted": [rows]} (drafts
        matching their position's sample; tok[r, :accepted + 1] are the new tokens)."""
        rows, width = ids.shape
        v = seen.shape[1]
        samp = dict(samp)
        index0, _, lora = samp.pop("index"), samp.pop("logprobs"), samp.pop("adapter")
        pool, logits = self._forward(params, pool, table, time_step, ids, None, lora)
        rep = lambda a: jnp.repeat(a, width, axis=0)  # noqa: E731  [rows, ...] -> [rows * w, ...]
        index = (index0[:, None] + jnp.arange(width, dtype=index0.dtype)[None, :]).reshape(-1)
        tok = sample_tokens(
            logits.reshape(rows * width, v), rep(seen[slots]), vocab_limit=self.vocab_limit,
            index=index, counts=rep(counts[slots]), pen=jax.tree.map(rep, pen),
            allow=rep(allow), **{k: rep(a) for k, a in samp.items()},
        ).reshape(rows, width)
        match = ids[:, 1:] == tok[:, :-1]  # [rows, k]
        accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
        taken = active[:, None] & (jnp.arange(width)[None, :] <= accepted[:, None])
        r = jnp.broadcast_to(jnp.arange(rows)[:, None], ids.shape)
        where = jnp.where(taken, ids, v)
        sub_seen = seen[slots].at[r, where].set(True, mode="drop")
        sub_counts = counts[slots].at[r, where].add(1, mode="drop")
        return (pool, seen.at[slots].set(sub_seen), counts.at[slots].set(sub_counts),
                {"tok": tok, "accepted": accepted})

    def _logits(self, params: Any, ids: Array) -> Array:
        return _call(self.model, params, "logits", ({"input_ids": ids},))

    # ---- host API -------------------------------------------------------------------------

    # Per-row settings: (dtype, value of a padding row); "adapter": the row's LoRA slot.
    SAMPLING = {
        "temperature": (np.float32, 0),
        "top_k": (np.int32, 0),
        "top_p": (np.float32, 1),
        "penalty": (np.float32, 1),
        "seeds": (np.uint32, 0),
        "index": (np.int32, 0),
        "logprobs": (np.bool_, False),
        "adapter": (np.int32, 0),
    }

    def _row_sampling(self, sampling: dict[str, list[Any]], rows: int) -> dict[str, np.ndarray]:
        """`sampling` (one list per key of SAMPLING; index: the token's generated index,
        logprobs: whether the row wants them; a missing key: every row gets the padding
        value) as arrays padded to `rows`."""
        return {k: self._pad(sampling.get(k, ()), rows, fill, dt)
                for k, (dt, fill) in self.SAMPLING.items()}

    def _pad(self, a: Any, rows: int, fill: Any, dtype: Any) -> np.ndarray:
        a = np.asarray(a, dtype)
        out = np.full((rows, *a.shape[1:]), fill, dtype)
        out[: len(a)] = a
        return out

    def _features(self, rows: int, penalties: Optional[dict[str, np.ndarray]],
                  allow: Optional[np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The penalty arrays and grammar bit rows of a call, all "off" where not given."""
        if penalties is None:
            penalties = pack([], rows, self.vocab_size)
        if allow is None:
            allow = np.full((rows, self.mask_words), -1, np.int32)
        elif allow.shape != (rows, self.mask_words):
            raise ValueError(f"allow: grammar bit rows {allow.shape}, expected "
                             f"{(rows, self.mask_words)}")
        return penalties, allow

    def prefill_call(
        self,
        *,
        slots: list[int],
        chunks: list[np.ndarray],
        starts: list[int],
        tables: np.ndarray,
        bucket: int,
        sampling: dict[str, list[Any]],
        gen_from: Optional[list[int]] = None,
        targets: Optional[list[np.ndarray]] = None,
        penalties: Optional[dict[str, np.ndarray]] = None,
        allow: Optional[np.ndarray] = None,
    ) -> tuple[Any, tuple, dict[str, Any]]:
        """The prefill program and its inputs (`_run` runs them, `compile_programs`
        compiles them): chunk i (len <= bucket) goes at positions [starts[i], starts[i] +
        len) of the pages in tables[i]; the next token of each is sampled with index
        `sampling["index"][i]`.
        gen_from[i]: first position of generated tokens (default: none in the chunk);
        targets[i] (len <= bucket): the id following each chunk position, scored (the
        call's "prompt" output) when targets are given; penalties: `penalties.pack`
        arrays for next_pow2(n) rows (None: no row uses any); allow: grammar bit rows
        [next_pow2(n), mask_words] (`grammar.fill_masks`; None: no row has a grammar)."""
        n = len(slots)
        rows = next_pow2(n)
        ids = np.zeros((rows, bucket), np.int32)
        tgt = np.zeros((rows, bucket), np.int32)
        n_valid = np.ones(rows, np.int32)
        for i, c in enumerate(chunks):
            if not 0 < len(c) <= bucket:
                raise ValueError(f"prefill: a chunk of {len(c)} ids in bucket {bucket}")
            ids[i, : len(c)] = c
            n_valid[i] = len(c)
            if targets is not None:
                tgt[i, : len(targets[i])] = targets[i]
        far = np.iinfo(np.int32).max
        pen, allow = self._features(rows, penalties, allow)
        args = (
            self._pad(slots, rows, self.num_slots, np.int32),
            self._table(tables, rows),
            ids,
            self._pad(starts, rows, 0, np.int32),
            n_valid,
            self._pad(gen_from if gen_from is not None else [far] * n, rows, far, np.int32),
            tgt,
            self._row_sampling(sampling, rows),
            pen,
            allow,
        )
        return self._jit_prefill, args, {"scoring": targets is not None}

    def prefill(self, **kwargs: Any) -> dict[str, Any]:
        """Runs `prefill_call(**kwargs)` (start 0 resets slot i's seen-mask and counts).
        Returns host arrays cut to n rows: "tok" [n], "lp" [n], "top_ids" / "top_lp" [n,
        MAX_LOGPROBS] (zeros unless a row wants logprobs); with targets "prompt" [n,
        bucket, ...]."""
        out = self._run(*self.prefill_call(**kwargs))
        return jax.tree.map(lambda a: np.asarray(a)[: len(kwargs["slots"])], out)

    def decode_call(
        self,
        *,
        steps: int,
        slots: list[int],
        tables: np.ndarray,
        ids: list[int],
        time_step: list[int],
        sampling: dict[str, list[Any]],
        penalties: Optional[dict[str, np.ndarray]] = None,
        allow: Optional[np.ndarray] = None,
    ) -> tuple[Any, tuple, dict[str, Any]]:
        """The program of `steps` decode steps for the given rows and its inputs
        (per-row lists and `sampling` lists; tables [n, pages]; penalties:
        `penalties.pack` arrays for next_pow2(n) rows; allow: grammar bit rows
        [next_pow2(n), mask_words], only with steps == 1). Every row's time_step + steps
        must be <= max_len and covered by its pages."""
        n = len(slots)
        rows = next_pow2(n)
        if allow is not None and steps != 1:
            raise ValueError(f"decode: grammar masks need steps=1, got steps={steps}")
        pen, allow = self._features(rows, penalties, allow)
        args = (
            self._pad(slots, rows, self.num_slots, np.int32),
            self._table(tables, rows),
            self._pad(ids, rows, 0, np.int32),
            self._pad(time_step, rows, 0, np.int32),
            np.arange(rows) < n,
            self._row_sampling(sampling, rows),
            pen,
            allow,
        )
        return self._jit_decode, args, {"steps": steps}

    def decode(self, **kwargs: Any) -> dict[str, Any]:
        """Runs `decode_call(**kwargs)`. Returns host "tok" [steps, n] int32, "lp" [steps,
        n], "top_ids" / "top_lp" [steps, n, MAX_LOGPROBS] (zeros unless a row wants them)."""
        out = self._run(*self.decode_call(**kwargs))
        return jax.tree.map(lambda a: np.asarray(a)[:, : len(kwargs["slots"])], out)

    def verify_call(
        self,
        *,
        slots: list[int],
        tables: np.ndarray,
        ids: list[list[int]],
        time_step: list[int],
        sampling: dict[str, list[Any]],
        penalties: Optional[dict[str, np.ndarray]] = None,
    ) -> tuple[Any, tuple, dict[str, Any]]:
        """The verification program and its inputs: ids[i] = row i's last token and k
        drafts, at positions time_step[i] + [0, k] (covered by its pages)."""
        n = len(slots)
        rows = next_pow2(n)
        width = len(ids[0])
        pen, allow = self._features(rows, penalties, None)
        grid = np.zeros((rows, width), np.int32)
        grid[:n] = np.asarray(ids, np.int32)
        args = (self._pad(slots, rows, self.num_slots, np.int32), self._table(tables, rows),
                grid, self._pad(time_step, rows, 0, np.int32), np.arange(rows) < n,
                self._row_sampling(sampling, rows), pen, allow)
        return self._jit_verify, args, {}

    def verify(self, **kwargs: Any) -> dict[str, Any]:
        """Runs `verify_call(**kwargs)`: host "tok" [n, k + 1], "accepted" [n]."""
        out = self._run(*self.verify_call(**kwargs))
        return jax.tree.map(lambda a: np.asarray(a)[: len(kwargs["slots"])], out)

    def rows_call(self, **kwargs: Any) -> tuple[Any, tuple, dict[str, Any]]:
        return self._jit_mixed, rows_args(self, **kwargs), {}  # `rows_step.rows_args`

    def rows(self, **kwargs: Any) -> dict[str, Any]:
        """Runs `rows_call(**kwargs)`: host "tok" [n], "lp" [n], "top_ids" / "top_lp"."""
        out = self._run(*self.rows_call(**kwargs))
        return jax.tree.map(lambda a: np.asarray(a)[: len(kwargs["slots"])], out)

    # ---- the program table ----------------------------------------------------------------

    def _key(self, fn: Any, args: tuple, static: dict[str, Any]) -> tuple:
        """A program's identity: which program, its static settings, its inputs' shapes."""
        shapes = tuple((a.shape, a.dtype.str) for a in jax.tree.leaves(args))
        kind = {self._jit_decode: "decode", self._jit_verify: "verify",
                self._jit_mixed: "rows"}.get(fn, "prefill")
        return (kind, tuple(sorted(static.items())), shapes)

    def _lower(self, fn: Any, args: tuple, static: dict[str, Any]) -> Any:
        return self._traced(fn.lower, self.params, self.pool, self.seen, self.counts, *args,
                            **static)

    def _run(self, fn: Any, args: tuple, static: dict[str, Any]) -> Any:
        """Runs the program of (fn, static, shapes of args) on the runner's state and args,
        compiling it first when it is new (counted in `compiled_late` once `sealed`)."""
        key = self._key(fn, args, static)
        program = self.programs.get(key)
        if program is None:
            if self.sealed:
                self.compiled_late += 1
                log.warning("compiling a program warm-up did not cover (%s %s): every "
                            "request waits for it", key[0],
                            dict(static, rows=args[0].shape[0],
                                 **({"width": args[2].shape[-1]} if key[0] != "decode"
                                    else {})))
            program = self.programs[key] = self._lower(fn, args, static).compile()
        self.pool, self.seen, self.counts, out = program(
            self.params, self.pool, self.seen, self.counts, *args)
        return out

    def compile_programs(self, calls: Sequence[tuple[Any, tuple, dict[str, Any]]],
                         threads: int = 1) -> int:
        """Compiles the programs of `calls` ((fn, args, static) as `_run` takes them) not
        yet in the table, lowering one at a time and compiling on `threads` threads (XLA
        compiles outside the GIL). Returns how many were new."""
        todo: dict[tuple, Any] = {}
        for fn, args, static in calls:
            key = self._key(fn, args, static)
            if key not in self.programs and key not in todo:
                todo[key] = self._lower(fn, args, static)
        with ThreadPoolExecutor(max(1, threads)) as pool:
            for key, program in zip(todo, pool.map(lambda low: low.compile(), todo.values())):
                self.programs[key] = program
        return len(todo)

    def set_history(self, slot: int, ids: Sequence[int], gen_from: int) -> None:
        """Sets slot's seen-mask to `ids` and its generated-token counts to ids[gen_from:]'s:
        a prefix found in the prefix cache, not prefilled."""
        a = np.asarray(ids, np.int64)
        seen = np.zeros(self.vocab_size, bool)
        seen[a] = True
        counts = np.bincount(a[gen_from:], minlength=self.vocab_size).astype(np.int32)
        self.seen, self.counts = self._traced(
            self._jit_rows, self.seen, self.counts, np.int32(slot), seen, counts)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Cache-free forward: ids [b, s] -> logits [b, s, vocab] (f32, host)."""
        return np.asarray(self._traced(self._jit_logits, self.params, ids))

    @functools.cached_property
    def compute_dtype(self) -> Any:
        """The KV entries' dtype (the compute dtype; a 16-bit pool stores uint16 bits)."""
        shapes = jax.eval_shape(
            lambda p: _call(self.model, p, "init_states", (1, self.page_size)), self.params
        )
        return jax.tree.leaves(shapes["decoder"])[0].dtype
