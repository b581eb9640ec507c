"""Multi-head attention for MHA / GQA / MQA (`num_kv_heads` = heads / divisor / 1), with
causal, sliding-window and segment (packed-sequence) masks, RoPE, optional QK-norm and
logit soft-capping, an einsum reference path or `jax.nn.dot_product_attention`, and a KV
cache (`init_states`, `prefill`, `extend_step`) that runs the same code as `forward`.

Masks are built from token *indices* (slot in the sequence / cache); `positions` feed RoPE
only, so packed sequences restart positions while the causal mask stays per token.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxlearn.config import REQUIRED, InstantiableConfig
from jaxlearn.kernels import blockwise_attention, paged, ring_attention, segments_visible
from jaxlearn.layers.dense import DotGeneral, Linear, einsum, maybe_dot
from jaxlearn.layers.rope import RotaryEmbedding
from jaxlearn.module import Module, logical_partition_spec, with_logical_constraint

IMPLEMENTATIONS = ("auto", "einsum", "dot_product_attention", "blockwise", "ring")
_NEG = float(jnp.finfo(jnp.float32).min)
# Pages of keys [kv_heads, head_dim, page_size], of values [kv_heads, page_size, head_dim]:
# the layouts `jaxlearn.kernels.paged` (and its native kernel) read them in.
_PAGE_LAYOUT = {"key": "kdt", "value": "ktd"}
KVCache = dict[str, jax.Array]  # {"key", "value": [batch, max_len, kv_heads, head_dim]}


def make_mask(
    q_index: jax.Array,
    kv_index: jax.Array,
    *,
    causal: bool,
    sliding_window: Optional[int] = None,
    q_segment_ids: Optional[jax.Array] = None,
    kv_segment_ids: Optional[jax.Array] = None,
    kv_end: Optional[jax.Array] = None,
) -> jax.Array:
    """Boolean mask [batch|1, q_len, kv_len]: True where query i may attend to key j.

    q_index [batch|1, q_len], kv_index [kv_len] are token slots; segment ids are
    [batch, q_len] / [batch, kv_len]; `kv_end [batch]` hides cache slots >= end.
    """
    qi, kj = q_index[:, :, None], kv_index[None, None, :]
    mask = jnp.ones(jnp.broadcast_shapes(qi.shape, kj.shape), bool)
    if causal:
        mask &= kj <= qi
    if sliding_window is not None:
        mask &= qi - kj < sliding_window
    if kv_end is not None:
        mask &= kj < kv_end[:, None, None]
    if q_segment_ids is not None and kv_segment_ids is not None:
        mask = mask & segments_visible(q_segment_ids[:, :, None], kv_segment_ids[:, None, :])
    return mask


class Attention(Module):
    """Self-attention. x [batch, seq, embed] -> [batch, seq, embed].

    Children (`Linear` configs; the layer sets their dims, logical axes and `use_bias`):
    q_proj [embed] -> [heads, head_dim], k_proj / v_proj [embed] -> [kv_heads, head_dim],
    o_proj [heads, head_dim] -> [embed]; params `<child>.weight` (+ `<child>.bias` with
    `qkv_bias` / `output_bias`). `qkv_proj` set (and q/k/v_proj None): one projection
    [embed] -> [heads + 2 kv_heads, head_dim] in their place (`fuse_projections`).
    Query head n uses kv head n // (heads // kv_heads) (the HF `repeat_kv` grouping).
    """

    class Config(Module.Config):
        input_dim: int = REQUIRED  # Set by the parent layer.
        num_heads: int = REQUIRED
        num_kv_heads: Optional[int] = None  # None: num_heads (MHA); 1: MQA.
        head_dim: Optional[int] = None  # None: input_dim // num_heads.
        qkv_bias: bool = False
        output_bias: bool = False
        rope: Optional[RotaryEmbedding.Config] = RotaryEmbedding.default_config()
        # Per-head norm of q and k before RoPE (e.g. RMSNorm.default_config()); None: off.
        qk_norm: Optional[InstantiableConfig] = None
        logit_soft_cap: Optional[float] = None
        causal: bool = True
        sliding_window: Optional[int] = None  # Keys at distance >= window are hidden.
        query_scale: Optional[float] = None  # None: head_dim ** -0.5.
        # "auto" | "einsum" | "dot_product_attention" | "blockwise" | "ring".
        # "blockwise" (`jaxlearn.kernels.blockwise_attention`, forward and prefill; decode
        # uses einsum): query / key block sizes of the flash-style loop. "ring": the same,
        # as `ring_attention` over the mesh axes the logical `seq` axis maps to. "auto":
        # blockwise for a call of at least `blockwise_min_seq` query positions, einsum for
        # shorter ones (on CPU, one Attention layer's fwd + bwd: blockwise 1.2-1.5x faster
        # at seq 1024, 2.1-2.5x at 4096, 0.85-0.9x at 256-512; `tools/bench/jl_attention.py`).
        implementation: str = "auto"
        block_q: int = 512
        block_k: int = 512
        blockwise_min_seq: int = 1024
        paged_kernel: str = "xla"  # Over a paged KV cache: `paged.attend_pages(kernel=)`.
        # The core's f32 products (q.k and p.v per batch and kv head) run on this dot when
        # it is exact (`SgemmDot`: oneMKL, the CPU rule); None: XLA's einsums.
        dot: Optional[DotGeneral.Config] = None
        q_proj: Optional[InstantiableConfig] = Linear.default_config()
        k_proj: Optional[InstantiableConfig] = Linear.default_config()
        v_proj: Optional[InstantiableConfig] = Linear.default_config()
        o_proj: InstantiableConfig = Linear.default_config()
        # A projection [embed] -> [heads + 2 kv_heads, head_dim] in place of q/k/v_proj
        # (which must then be None): one matmul instead of three (decode on CPU: a GEMV
        # each has a fixed cost). Single-device serving only (`fuse_projections`); its
        # heads axis is not sharded. Params convert with `fuse_projection_params`.
        qkv_proj: Optional[InstantiableConfig] = None

        def implementation_at(self, seq: int) -> str:
            """The implementation a call with `seq` query positions runs ("auto" resolved).
            The one place the rule lives: the AOT planner and `launch`'s floor estimate
            call it on the config they hold."""
            if self.implementation != "auto":
                return str(self.implementation)
            return "blockwise" if seq >= self.blockwise_min_seq else "einsum"

    def __init__(self, cfg: "Attention.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        where = self.path()
        for name, allowed in (("implementation", IMPLEMENTATIONS), ("paged_kernel", paged.KERNELS)):
            if getattr(c, name) not in allowed:
                raise ValueError(f"{where}.{name}: {getattr(c, name)!r} not in {allowed}")
        if c.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{where}: num_heads={c.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads}"
            )
        if c.logit_soft_cap is not None and c.implementation == "dot_product_attention":
            raise ValueError(f"{where}: logit_soft_cap needs implementation='einsum', "
                             "'blockwise' or 'ring'")
        if c.head_dim is None and c.input_dim % c.num_heads:
            raise ValueError(f"{where}: input_dim {c.input_dim} % num_heads {c.num_heads} != 0")
        self._add_projections()
        self._dot = maybe_dot(c.dot)
        self._rope = c.rope.instantiate() if c.rope is not None else None
        if c.qk_norm is not None:
            norm = c.qk_norm.clone(input_dim=self.head_dim)
            if "axis_name" in norm:
                norm.axis_name = None
            self._add_child("q_norm", norm)
            self._add_child("k_norm", norm)

    @property
    def num_kv_heads(self) -> int:
        c = self.config
        return c.num_heads if c.num_kv_heads is None else c.num_kv_heads

    @property
    def head_dim(self) -> int:
        c = self.config
        return c.head_dim if c.head_dim is not None else c.input_dim // c.num_heads

    def _add_projections(self) -> None:
        c, where = self.config, self.path()
        e, h, kv, d = c.input_dim, c.num_heads, self.num_kv_heads, self.head_dim
        separate = [n for n in ("q_proj", "k_proj", "v_proj") if getattr(c, n) is not None]
        if c.qkv_proj is not None:
            if separate:
                raise ValueError(f"{where}: qkv_proj replaces q_proj / k_proj / v_proj; set "
                                 f"{', '.join(separate)} to None")
            self._add_child("qkv_proj", c.qkv_proj.clone(
                input_dim=e, output_dim=(h + 2 * kv, d), weight_axes=("embed", None, "head_dim"),
                use_bias=c.qkv_bias))
        elif len(separate) != 3:
            raise ValueError(f"{where}: q_proj, k_proj and v_proj are all needed (or qkv_proj)")
        else:
            for name, n, axis in (("q_proj", h, "heads"), ("k_proj", kv, "kv_heads"),
                                  ("v_proj", kv, "kv_heads")):
                self._add_child(name, getattr(c, name).clone(
                    input_dim=e, output_dim=(n, d), weight_axes=("embed", axis, "head_dim"),
                    use_bias=c.qkv_bias))
        self._add_child("o_proj", c.o_proj.clone(
            input_dim=(h, d), output_dim=e, weight_axes=("heads", "head_dim", "embed"),
            use_bias=c.output_bias))

    def forward(
        self,
        x: jax.Array,
        positions: Optional[jax.Array] = None,
        segment_ids: Optional[jax.Array] = None,
    ) -> jax.Array:
        """x [batch, seq, embed]; positions / segment_ids [batch, seq] -> [batch, seq, embed]."""
        y, _ = self._attention(x, positions=positions, segment_ids=segment_ids)
        return y

    def init_states(self, batch_size: int, max_len: int) -> KVCache:
        """An empty KV cache: key/value [batch, max_len, kv_heads, head_dim] (compute dtype)."""
        shape = (batch_size, max_len, self.num_kv_heads, self.head_dim)
        return {"key": jnp.zeros(shape, self.dtype), "value": jnp.zeros(shape, self.dtype)}

    def init_paged_states(self, num_pages: int, page_size: int) -> KVCache:
        """An empty page pool: key [num_pages, kv_heads, head_dim, page_size], value [..,
        page_size, head_dim] (`jaxlearn.kernels.paged`; 16-bit dtypes as uint16 bits)."""
        args = (num_pages, page_size, self.num_kv_heads, self.head_dim, self.dtype)
        return {name: paged.init_pool(*args, layout=_PAGE_LAYOUT[name]) for name in _PAGE_LAYOUT}

    def prefill(
        self,
        cache: KVCache,
        x: jax.Array,
        positions: Optional[jax.Array] = None,
        segment_ids: Optional[jax.Array] = None,
    ) -> tuple[KVCache, jax.Array]:
        """Runs `forward` on a prompt x [batch, seq, embed] and writes its keys and values
        into cache slots [0, seq). Returns (cache, y [batch, seq, embed])."""
        y, (k, v) = self._attention(x, positions=positions, segment_ids=segment_ids)
        zero = jnp.int32(0)
        return {"key": _write(cache["key"], k, zero), "value": _write(cache["value"], v, zero)}, y

    def extend_step(
        self,
        cache: KVCache,
        x: jax.Array,
        time_step: jax.Array,
        positions: Optional[jax.Array] = None,
        page_table: Optional[jax.Array] = None,
        layer_index: Optional[jax.Array] = None,
    ) -> tuple[KVCache, jax.Array]:
        """Appends x [batch, steps, embed] at cache slot `time_step` ([batch] or scalar int)
        and attends over the cache. Returns (cache, y [batch, steps, embed]).

        With `page_table` [batch, pages], `cache` is a page pool (`init_paged_states`; with
        `layer_index`, pools stacked [layers, ...] of which this layer uses one): this
        call's keys/values are written into the rows' pages, then the rows' pages are
        attended over. A `paged.PagedRows` table: x [1, T] holds ragged rows' tokens."""
        y, kv_cache = self._attention(
            x,
            positions=positions,
            cache=cache,
            time_step=time_step,
            page_table=page_table,
            layer_index=layer_index,
        )
        return kv_cache, y

    def _project_qkv(
        self, x: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [batch, seq, embed] -> q [b, s, heads, d], k, v [b, s, kv_heads, d] (RoPE'd)."""
        if "qkv_proj" in self.children:  # [b, s, heads + 2 kv_heads, d] -> q, k, v
            h, kv = self.config.num_heads, self.num_kv_heads
            y = self.qkv_proj(x)
            q, k, v = y[:, :, :h], y[:, :, h : h + kv], y[:, :, h + kv :]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [b, s, heads, d]
        if self.config.qk_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self._rope is not None:
            q, k = self._rope(q, positions), self._rope(k, positions)
        q = with_logical_constraint(q, ("batch", "seq", "heads", "head_dim"))
        k = with_logical_constraint(k, ("batch", "seq", "kv_heads", "head_dim"))
        v = with_logical_constraint(v, ("batch", "seq", "kv_heads", "head_dim"))
        q, k, v = (self.checkpoint_name(t, f"{n}_proj") for t, n in zip((q, k, v), "qkv"))
        return q, k, v

    def _attention(
        self,
        x: jax.Array,
        *,
        positions: Optional[jax.Array] = None,
        segment_ids: Optional[jax.Array] = None,
        cache: Optional[KVCache] = None,
        time_step: Optional[jax.Array] = None,
        page_table: Optional[jax.Array] = None,
        layer_index: Optional[jax.Array] = None,
    ) -> tuple[jax.Array, Any]:
        """The one code path of forward / prefill (cache=None) and extend_step (cache set,
        contiguous or paged).

        Returns (y [batch, seq, embed], (k, v) of this call, or the updated cache)."""
        c = self.config
        x = x.astype(self.dtype)
        b, s, _ = x.shape
        q_index = jnp.arange(s, dtype=jnp.int32)[None, :]  # [1, s]
        if cache is not None:
            if time_step is None:
                raise ValueError(f"{self.path()}: a cache call needs time_step")
            t = jnp.broadcast_to(jnp.asarray(time_step, jnp.int32), (b,))
            q_index = q_index + t[:, None]  # [b, s]
            if isinstance(page_table, paged.PagedRows):  # Ragged rows: their own positions.
                q_index = page_table.positions[None]
        if positions is None:
            positions = jnp.broadcast_to(q_index, (b, s))
        q, k, v = self._project_qkv(x, positions)
        impl = c.implementation_at(s)
        if impl in ("blockwise", "ring") and (cache is None or time_step is None):
            kw: dict[str, Any] = dict(
                causal=c.causal, sliding_window=c.sliding_window, scale=self._scale,
                logit_soft_cap=c.logit_soft_cap, block_q=c.block_q, block_k=c.block_k)
            ring = logical_partition_spec(("batch", "seq", "heads", "head_dim"))
            if impl == "ring" and ring is not None:  # no mesh: one device
                o = ring_attention(q, k, v, mesh=ring[0], spec=ring[1], positions=q_index,
                                   segment_ids=segment_ids, **kw)
            else:
                o = blockwise_attention(q, k, v, q_positions=q_index, k_positions=q_index,
                                        q_segment_ids=segment_ids, k_segment_ids=segment_ids, **kw)
            return self._output(o), (k, v)
        if cache is not None and time_step is not None:
            o, extra = self._attend_cache(
                q, k, v, cache, time_step, q_index, page_table, layer_index
            )
            return self._output(o), extra
        mask = make_mask(
            q_index,
            jnp.arange(s, dtype=jnp.int32),
            causal=c.causal,
            sliding_window=c.sliding_window,
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
        )
        o = self._core(q, k.astype(q.dtype), v.astype(q.dtype), mask)  # [b, s, h, d]
        return self._output(o), (k, v)

    def _attend_cache(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        cache: KVCache,
        time_step: jax.Array,
        q_index: jax.Array,
        page_table: Optional[jax.Array],
        layer_index: Optional[jax.Array],
    ) -> tuple[jax.Array, KVCache]:
        """Writes this call's k/v [b, s, kv_heads, d] at time_step (scalar or [b]) into the
        cache (contiguous, or the page pool with `page_table`) and attends q over it.
        Returns (o [b, s, heads, d], the updated cache)."""
        c = self.config
        b, s = q.shape[:2]
        t = jnp.broadcast_to(jnp.asarray(time_step, jnp.int32), (b,))
        if page_table is not None:  # Write first: the gather then depends on the write.
            extra = {
                name: paged.write_pages(
                    cache[name], new, t, page_table, layer_index, _PAGE_LAYOUT[name]
                )
                for name, new in (("key", k), ("value", v))
            }
            o = paged.attend_pages(
                q, extra["key"], extra["value"], page_table, q_index, t + s,
                scale=self._scale, causal=c.causal, sliding_window=c.sliding_window,
                logit_soft_cap=c.logit_soft_cap, layer=layer_index, kernel=c.paged_kernel,
            )
            return o, extra
        k_all = _write(cache["key"], k, time_step)
        v_all = _write(cache["value"], v, time_step)
        extra = {"key": k_all, "value": v_all}
        mask = make_mask(
            q_index,
            jnp.arange(k_all.shape[1], dtype=jnp.int32),
            causal=c.causal,
            sliding_window=c.sliding_window,
            kv_end=t + s,
        )
        return self._core(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask), extra

    @property
    def _scale(self) -> float:
        c = self.config
        return c.query_scale if c.query_scale is not None else self.head_dim**-0.5

    def _output(self, o: jax.Array) -> jax.Array:
        """o [b, s, heads, head_dim] -> y [b, s, embed] through o_proj."""
        y = self.o_proj(self.checkpoint_name(o, "context"))
        return with_logical_constraint(y, ("batch", "seq", "embed"))

    def _core(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        """q [b, s, heads, d], k/v [b, t, kv_heads, d], mask [b|1, s, t] -> [b, s, heads, d]."""
        c = self.config
        scale = c.query_scale if c.query_scale is not None else self.head_dim**-0.5
        if c.implementation == "dot_product_attention":
            return jax.nn.dot_product_attention(
                q, k, v, mask=mask[:, None], scale=scale, implementation="xla"
            )
        b, s, h, d = q.shape
        kv = k.shape[2]
        low_precision = jnp.dtype(q.dtype).itemsize < 4
        # One query row per (batch, kv head) -- MHA decode -- is a bf16 GEMV that XLA
        # upcasts (converting the whole KV cache); pad it to two rows, like dense() does.
        pad = low_precision and s * (h // kv) == 1
        if pad:
            q = jnp.concatenate([q, jnp.zeros_like(q)], axis=1)
            mask = jnp.concatenate([mask, mask], axis=1)
        # Head-major operands ([b, kv_heads, group, s, d], [b, kv_heads, t, d]): XLA:CPU
        # runs the einsums on the projections' [b, s, heads, d] layout 1.3x slower
        # (SmolLM2-135M attention forward + backward, f32 and bf16), transposes included.
        qg = q.reshape(b, q.shape[1], kv, h // kv, d).transpose(0, 2, 3, 1, 4)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if low_precision:  # bf16: custom VJP keeps the backward einsums in bf16.
            ein = lambda spec, a, w, out=None: einsum(spec, a, w, out)  # noqa: E731
        else:
            ein = lambda spec, a, w, out=None: jnp.einsum(  # noqa: E731
                spec, a, w, preferred_element_type=jnp.float32
            ).astype(out or a.dtype)
            if self._dot is not None and self._dot.exact:
                ein = functools.partial(_batched, self._dot)
        logits = ein("bkgsd,bktd->bkgst", qg, k, jnp.float32) * scale
        if c.logit_soft_cap is not None:
            logits = c.logit_soft_cap * jnp.tanh(logits / c.logit_soft_cap)
        logits = jnp.where(mask[:, None, None], logits, _NEG)
        probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
        o = ein("bkgst,bktd->bkgsd", probs, v)
        return o.transpose(0, 3, 1, 2, 4)[:, :s].reshape(b, s, h, d)


def _batched(dot: DotGeneral, spec: str, a: jax.Array, w: jax.Array, out: Any = None
             ) -> jax.Array:
    """`_core`'s two einsums on `dot.batched`: a [b, kv, g, s, d | t] with w [b, kv, t, d]
    -> [b, kv, g, s, t | d]."""
    n = a.shape[0] * a.shape[1]
    y = dot.batched(a.reshape(n, -1, a.shape[-1]), w.reshape(n, *w.shape[2:]),
                    nt=spec.startswith("bkgsd"))
    return y.reshape(*a.shape[:-1], y.shape[-1])


def _write(buf: jax.Array, new: jax.Array, time_step: jax.Array) -> jax.Array:
    """Writes new [b, s, ...] into buf [b, max_len, ...] at slot time_step (scalar or [b])."""
    new = new.astype(buf.dtype)
    time_step = jnp.asarray(time_step, jnp.int32)
    zeros_ = (0,) * (buf.ndim - 2)
    if time_step.ndim == 0:
        return lax.dynamic_update_slice(buf, new, (0, time_step, *zeros_))
    if buf.shape[0] == 1:
        return lax.dynamic_update_slice(buf, new, (0, time_step[0], *zeros_))
    if new.shape[1] == 1 and jnp.dtype(buf.dtype).itemsize < 4:
        # One token per row into a bf16 cache (batched decode): XLA:CPU runs the per-row
        # scatter below through an f32 copy of the whole cache (~5 ms per [8, 512, 8, 64]
        # leaf, every step); a select writes the same slots (clamped like the scatter).
        t = jnp.clip(time_step, 0, buf.shape[1] - 1)
        hit = jnp.arange(buf.shape[1], dtype=jnp.int32)[None, :] == t[:, None]  # [b, max_len]
        return jnp.where(hit.reshape(*hit.shape, *(1,) * (buf.ndim - 2)), new, buf)
    return jax.vmap(lambda bb, nn, t: lax.dynamic_update_slice(bb, nn, (t, *zeros_)))(
        buf, new, time_step
    )
