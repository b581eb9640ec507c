"""LM head + cross entropy over the vocab in token chunks, never holding the f32 logits of
the whole batch.

`head_cross_entropy(x, w, labels, weights, ...)` is `cross_entropy(x @ w, ...)` summed
(plus the z-loss and an optional logit soft cap) for hidden states x [batch, seq, dim] and
a head weight w [dim, vocab]. The sequence is cut into chunks of about `chunk_tokens`
tokens (all batch rows together, so a batch-sharded x stays sharded); chunk j of a row
holds its tokens j, j + n, j + 2n, ... (n chunks), so a sequence sharded over devices
stays sharded too: every chunk is spread over all the sequence shards and none is
gathered (the sums do not depend on the order of the tokens). A `lax.scan` runs one
chunk at a time: logits [batch, chunk, vocab] (f32 accumulation), logsumexp, label logit,
"correct", and, when differentiated, the gradient at once (Liger-style fused linear cross
entropy): dlogits = w_t ((1 + 2 z lse_t) softmax_t - onehot_t), dx_chunk = dlogits @ wᵀ,
dW += x_chunkᵀ dlogits (f32). The custom VJP's backward only scales dx and dW by the
loss cotangent, so no logits are recomputed: FLOPs equal the plain head + loss. Without
differentiation (eval) the scan computes the loss terms only. `gemm` (2-D
`gemm(a, b, trans_a=, trans_b=) -> op(a) @ op(b)`, e.g. `kernels.sgemm.sgemm`) runs the
three head dots instead of XLA's (f32 only). `transposed`: w is [vocab, dim] (a tied
embedding table as stored), so no transposed copy of it is made.

`compact=True` makes the head's work follow the weighted tokens (SFT's assistant turns;
not the prompt tokens or the padding, whose weight is 0): each row's tokens are put in a
stable order with its weighted ones first (a gather along the sequence), the chunks are
contiguous runs of that order, and a chunk whose tokens all weigh 0 is skipped (a
`lax.cond`: no logits, no softmax, no dots). Every skipped term is exactly 0, so only
the sums' rounding changes. The gather moves tokens within a row: for a batch-sharded or
unsharded x, not a sequence-sharded one (each chunk would gather the whole sequence).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array
_F32 = jnp.float32


def chunk_length(seq: int, batch: int, chunk_tokens: int) -> int:
    """The largest divisor of `seq` with batch * length <= chunk_tokens (at least 1)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunked loss: chunk_tokens must be >= 1, got {chunk_tokens}")
    best = 1
    for c in range(1, seq + 1):
        if seq % c == 0 and batch * c <= chunk_tokens:
            best = c
    return best


Gemm = Optional[Callable[..., Array]]


def _logits(xc: Array, wc: Array, gemm: Gemm, tr: bool) -> Array:
    """xc [b, c, dim] @ wc [dim, vocab] (tr: wcᵀ, wc [vocab, dim]) -> [b, c, vocab] f32."""
    if gemm is not None:
        return gemm(xc.reshape(-1, xc.shape[-1]), wc, trans_b=tr).reshape(*xc.shape[:2], -1)
    return lax.dot_general(xc, wc, (((2,), (1 if tr else 0,)), ((), ())),
                           preferred_element_type=_F32)


def _grads(xc: Array, wc: Array, dl: Array, gemm: Gemm, tr: bool) -> tuple[Array, Array]:
    """dl [b, c, vocab] -> (dxc = dl @ wcᵀ [b, c, dim], dwc = xcᵀ dl [dim, vocab]), f32
    (tr: dxc = dl @ wc, dwc = dlᵀ xc [vocab, dim])."""
    if gemm is not None:
        dl2, x2 = dl.reshape(-1, dl.shape[-1]), xc.reshape(-1, xc.shape[-1])
        dxc = gemm(dl2, wc, trans_b=not tr).reshape(*xc.shape)
        return dxc, (gemm(dl2, x2, trans_a=True) if tr else gemm(x2, dl2, trans_a=True))
    dxc = lax.dot_general(dl, wc, (((2,), (0 if tr else 1,)), ((), ())),
                          preferred_element_type=_F32)
    spec = "zbck,zbcm->mk" if tr else "zbck,zbcm->km"
    return dxc, jnp.einsum(spec, xc[None], dl[None], preferred_element_type=_F32)


def _chunk_terms(
    xc: Array, wc: Array, labels: Array, cap: Optional[float], gemm: Gemm = None,
    tr: bool = False,
) -> tuple[Array, Array, Array, Array, Array, Optional[Array]]:
    """One chunk: xc [b, c, dim], wc [dim, vocab] (tr: [vocab, dim]), labels [b, c] ->
    (ce [b, c], lse [b, c], correct [b, c], softmax [b, c, vocab] (of the capped logits;
    from the exponentials the logsumexp took, not a second exp), onehot mask [b, c, vocab],
    tanh [b, c, vocab] or None when uncapped)."""
    logits = _logits(xc, wc, gemm, tr)
    t = None
    if cap is not None:
        t = jnp.tanh(logits / cap)
        logits = cap * t
    m = jnp.max(logits, axis=-1)
    e = jnp.exp(logits - m[..., None])
    total = jnp.sum(e, axis=-1)
    lse = m + jnp.log(total)
    safe = jnp.where(labels >= 0, labels, 0)
    onehot = lax.broadcasted_iota(jnp.int32, logits.shape, 2) == safe[..., None]
    label_logit = jnp.sum(jnp.where(onehot, logits, 0.0), axis=-1)
    correct = (label_logit >= m).astype(_F32)
    return lse - label_logit, lse, correct, e * (1.0 / total)[..., None], onehot, t


def _to_chunks(a: Array, c: int, compact: bool) -> Array:
    """[batch, seq, ...] -> [n, batch, c, ...] (n = seq // c): chunk j holds tokens
    j, j + n, ..., j + (c - 1) n of every row (seq's sharding goes to the c axis); with
    `compact`, tokens j c .. (j + 1) c - 1 (runs of the compacted order)."""
    b, s = a.shape[:2]
    if compact:
        return jnp.moveaxis(a.reshape(b, s // c, c, *a.shape[2:]), 1, 0)
    return jnp.moveaxis(a.reshape(b, c, s // c, *a.shape[2:]), 2, 0)


def _from_chunks(a: Array, compact: bool) -> Array:
    """[n, batch, c, ...] -> [batch, c * n, ...] (inverse of `_to_chunks`)."""
    n, b, c = a.shape[:3]
    return jnp.moveaxis(a, 0, 1 if compact else 2).reshape(b, c * n, *a.shape[3:])


def _compacted(x: Array, labels: Array, weights: Array) -> tuple[Array, ...]:
    """Each row's tokens with its weighted ones first (a stable order), and the order
    [batch, seq] (order[i, j]: the position that compacted token j of row i came from)."""
    order = jnp.argsort((weights == 0).astype(jnp.int32), axis=1, stable=True)
    return (jnp.take_along_axis(x, order[..., None], axis=1),
            jnp.take_along_axis(labels, order, axis=1),
            jnp.take_along_axis(weights, order, axis=1), order)


def _expanded(dx: Array, order: Array) -> Array:
    """The compacted rows' dx [batch, seq, dim] back in the tokens' positions (a gather by
    the inverse order)."""
    return jnp.take_along_axis(dx, jnp.argsort(order, axis=1)[..., None], axis=1)


def _skipping(compact: bool, body: Callable, skip: Callable) -> Callable:
    """`body(carry, xs)` for a scan over chunks; with `compact`, `skip` instead when the
    chunk's weights (xs[2]) are all 0."""
    if not compact:
        return body
    return lambda carry, xs: lax.cond(jnp.any(xs[2] != 0), body, skip, carry, xs)


def _sums(ce: Array, lse: Array, correct: Array, w: Array, z: float) -> Array:
    """[total, ce, lse², correct] weighted sums of one chunk, [4] f32."""
    ce_s, zz_s, c_s = jnp.sum(ce * w), jnp.sum(jnp.square(lse) * w), jnp.sum(correct * w)
    return jnp.stack([ce_s + z * zz_s, ce_s, zz_s, c_s])


def _value_only(x: Array, w: Array, labels: Array, weights: Array, cfg: tuple) -> Array:
    c, z, cap, gemm, tr, compact = cfg
    wc = w.astype(x.dtype)
    if compact:
        x, labels, weights, _ = _compacted(x, labels, weights)

    def body(acc: Array, xs: tuple[Array, Array, Array]) -> tuple[Array, None]:
        xc, lc, vc = xs
        ce, lse, correct, *_ = _chunk_terms(xc, wc, lc, cap, gemm, tr)
        return acc + _sums(ce, lse, correct, vc, z), None

    xs = tuple(_to_chunks(a, c, compact) for a in (x, labels, weights))
    step = _skipping(compact, body, lambda acc, xs: (acc, None))
    return lax.scan(step, jnp.zeros((4,), _F32), xs)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(x: Array, w: Array, labels: Array, weights: Array, cfg: tuple) -> Array:
    return _value_only(x, w, labels, weights, cfg)


def _fused_fwd(x: Array, w: Array, labels: Array, weights: Array, cfg: tuple) -> tuple[Array, Any]:
    c, z, cap, gemm, tr, compact = cfg
    wc = w.astype(x.dtype)
    res_labels, res_weights = labels, weights
    if compact:
        x, labels, weights, order = _compacted(x, labels, weights)

    def body(carry: tuple[Array, Array], xs: tuple[Array, Array, Array]) -> tuple[Any, Array]:
        acc, dw = carry
        xc, lc, vc = xs
        ce, lse, correct, p, onehot, t = _chunk_terms(xc, wc, lc, cap, gemm, tr)
        scale = vc * (1.0 + 2.0 * z * lse) if z else vc
        dl = scale[..., None] * p - jnp.where(onehot, vc[..., None], 0.0)
        if t is not None:
            dl = dl * (1.0 - jnp.square(t))
        dl = dl.astype(x.dtype)
        dxc, dwc = _grads(xc, wc, dl, gemm, tr)
        dw = dw + dwc
        return (acc + _sums(ce, lse, correct, vc, z), dw), dxc.astype(x.dtype)

    def skip(carry: tuple[Array, Array], xs: tuple[Array, Array, Array]) -> tuple[Any, Array]:
        return carry, jnp.zeros(xs[0].shape, x.dtype)

    xs = tuple(_to_chunks(a, c, compact) for a in (x, labels, weights))
    init = (jnp.zeros((4,), _F32), jnp.zeros(w.shape, _F32))
    (sums, dw), dx = lax.scan(_skipping(compact, body, skip), init, xs)
    dx = _from_chunks(dx, compact)
    if compact:
        dx = _expanded(dx, order)
    res = (dx, dw, jnp.zeros((0,), w.dtype), res_labels, res_weights)
    return sums, res


def _fused_bwd(cfg: tuple, res: Any, g: Array) -> tuple[Array, Array, Any, Array]:
    dx, dw, w_dtype, labels, weights = res
    g0 = g[0]  # Only `total` is differentiable; the other sums are metrics (see caller).
    dx = (dx.astype(_F32) * g0).astype(dx.dtype)
    return dx, (dw * g0).astype(w_dtype.dtype), np.zeros(labels.shape, jax.dtypes.float0), (
        jnp.zeros_like(weights)
    )


_fused.defvjp(_fused_fwd, _fused_bwd)


def head_cross_entropy(
    x: Array,
    w: Array,
    labels: Array,
    weights: Array,
    *,
    z_loss_weight: float = 0.0,
    soft_cap: Optional[float] = None,
    chunk_tokens: int = 1024,
    gemm: Gemm = None,
    transposed: bool = False,
    compact: bool = False,
) -> dict[str, Array]:
    """x [batch, seq, dim] (compute dtype), w [dim, vocab] (`transposed`: [vocab, dim]; cast
    to x.dtype, its gradient comes back in w's dtype and layout), labels [batch, seq] int
    (negative: weight them out), weights [batch, seq] -> weighted sums {"total",
    "cross_entropy", "lse_squared", "correct"} (f32 scalars). total = cross_entropy +
    z_loss_weight * lse_squared is the only differentiable output (d/dx, d/dw); the others
    carry no gradient. `gemm`: the head's dots on that 2-D GEMM instead of XLA's, for f32
    x and w; `compact`: skip the chunks of weight-0 tokens (module doc)."""
    dim = w.shape[1] if transposed and w.ndim == 2 else w.shape[0]
    if x.ndim != 3 or w.ndim != 2 or x.shape[-1] != dim:
        raise ValueError(f"head_cross_entropy: x {x.shape} must be [batch, seq, {dim}]")
    if labels.shape != x.shape[:2] or weights.shape != x.shape[:2]:
        raise ValueError(
            f"head_cross_entropy: labels {labels.shape} / weights {weights.shape} must be "
            f"{x.shape[:2]}"
        )
    c = chunk_length(x.shape[1], x.shape[0], chunk_tokens)
    if gemm is not None and (x.dtype != _F32 or w.dtype != _F32):
        gemm = None  # The GEMM takes f32 operands; other dtypes stay on XLA's dots.
    cfg = (c, float(z_loss_weight), None if soft_cap is None else float(soft_cap), gemm,
           bool(transposed), bool(compact))
    sums = _fused(x, w, labels.astype(jnp.int32), weights.astype(_F32), cfg)
    metrics = lax.stop_gradient(sums)
    return {
        "total": sums[0],
        "cross_entropy": metrics[1],
        "lse_squared": metrics[2],
        "correct": metrics[3],
    }
