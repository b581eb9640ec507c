"""Paged KV cache through CausalLM: paged decoding gives the logits of the contiguous cache
(scan / loop / MoE / Qwen3 q/k-norm stacks, scattered pages, ragged rows), the pool is
updated in place, plus `logits_index`. (The page kernels: packages/kernels/tests.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.kernels import paged
from jaxlearn.layers import llama_config, mixtral_config, qwen3_config
from jaxlearn.module import functional

VOCAB, DIM, PS = 32, 16, 4


def run(model, params, *args, method):
    return functional(model, None, params, args, method=method, is_training=False)[0]


def tiny(stack, moe=False, sliding_window=None, qwen3=False):
    if moe:
        return mixtral_config(VOCAB, DIM, 2, 4, 2, 24, 4, 2, stack=stack, rope_theta=100.0)
    if qwen3:  # q/k RMSNorm, head_dim 8 != DIM / 4 heads
        return qwen3_config(VOCAB, DIM, 2, 4, 2, 24, head_dim=8, stack=stack, rope_theta=100.0)
    cfg = llama_config(VOCAB, DIM, 2, 4, 2, 24, stack=stack, rope_theta=100.0)
    if sliding_window is not None:
        cfg.decoder.transformer.layer.self_attention.sliding_window = sliding_window
    return cfg


def _contiguous(model, params, chunks, lengths):
    states = run(model, params, len(lengths), 16, method="init_states")
    logits = []
    for ids in chunks:
        states, lg = run(model, params, states, ids, method="extend_step")
        logits.append(lg)
    return logits, states


@pytest.mark.parametrize(
    "stack,kw",
    [
        ("scan", {}),
        ("loop", {}),
        ("scan", {"moe": True}),
        ("scan", {"sliding_window": 3}),
        ("loop", {"qwen3": True}),
    ],
)
def test_paged_decode_equals_contiguous_cache(stack, kw):
    model = tiny(stack, **kw).instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(1))
    ids = jax.random.randint(jax.random.key(2), (3, 12), 0, VOCAB)
    # A 5-token prompt chunk, then single-token steps; rows start at different offsets so
    # their writes cross page boundaries at different steps.
    chunks = [ids[:, :5]] + [ids[:, k : k + 1] for k in range(5, 12)]
    want, cstates = _contiguous(model, params, chunks, [0, 0, 0])
    table = jnp.asarray([[7, 2, 9, 5], [1, 8, 3, 0], [4, 6, 10, 11]])  # Scattered pages.
    pools = run(model, params, 12, PS, method="init_paged_states")
    step = jax.jit(lambda p, s, x: run(model, p, s, x, method="extend_step"))
    states = {**pools, "time_step": jnp.zeros(3, jnp.int32), "page_table": table}
    for chunk, lg_want in zip(chunks, want):
        states, lg = step(params, states, chunk)
        np.testing.assert_allclose(lg, lg_want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(states["time_step"], [12, 12, 12])
    # The pool holds exactly what the contiguous cache holds, page by page.
    kc = cstates["decoder"]
    leaf = (
        (lambda t: t["self_attention"]["key"])
        if stack != "loop"
        else (lambda t: t["layer1"]["self_attention"]["key"])
    )

    def gather(pool):  # Keys are stored in "kdt" pages.
        return paged.gather_pages(pool, table, jnp.float32, layout="kdt")

    got = (
        jax.vmap(gather)(leaf(states["decoder"]))
        if stack != "loop"
        else gather(leaf(states["decoder"]))
    )
    np.testing.assert_allclose(
        np.asarray(got)[..., :12, :, :], np.asarray(leaf(kc))[..., :12, :, :], atol=1e-5
    )


def test_logits_index_selects_steps():
    model = tiny("scan").instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(1))
    ids = jax.random.randint(jax.random.key(3), (2, 6), 0, VOCAB)
    states = run(model, params, 2, 8, method="init_states")
    _, full = run(model, params, states, ids, method="extend_step")
    idx = jnp.asarray([[5], [2]])
    _, some = run(model, params, states, ids, idx, method="extend_step")
    assert some.shape == (2, 1, VOCAB)
    np.testing.assert_allclose(some[:, 0], full[jnp.arange(2), idx[:, 0]], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stack", ["loop", "scan"])
def test_decode_loop_updates_the_pool_in_place(stack):
    """A donated pool through a scanned multi-step decode (what the engine compiles) is
    never copied: no copy of a pool-shaped buffer in the compiled HLO (XLA did copy every
    layer's pool per step when the read and the write did not depend on each other)."""
    import re

    from jax import lax

    cfg = llama_config(VOCAB, DIM, 2, 4, 2, 24, stack=stack, rope_theta=100.0, dtype="bfloat16")
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    pools = run(model, params, 40, PS, method="init_paged_states")["decoder"]
    table = jnp.asarray(np.arange(1, 17).reshape(4, 4), jnp.int32)

    def decode(params, pools, ids, t):
        def body(carry, _):
            pools, ids, t = carry
            states = {"decoder": pools, "time_step": t, "page_table": table}
            states, lg = run(model, params, states, ids[:, None], method="extend_step")
            return (states["decoder"], jnp.argmax(lg[:, 0], -1).astype(jnp.int32), t + 1), None

        return lax.scan(body, (pools, ids, t), None, length=4)[0][0]

    args = (params, pools, jnp.zeros(4, jnp.int32), jnp.full(4, 10, jnp.int32))
    text = jax.jit(decode, donate_argnums=1).lower(*args).compile().as_text()
    leaf = jax.tree.leaves(pools)[0]
    assert leaf.dtype == jnp.uint16  # bf16 entries stored as bits.
    shape = ",".join(map(str, leaf.shape))
    assert not re.search(rf"= u16\[{shape}\]\{{[^}}]*\}} copy\(", text)


@pytest.mark.parametrize("stack,kw,kernel", [("scan", {}, "xla"), ("scan", {}, "native"),
                                             ("loop", {"qwen3": True}, "xla"),
                                             ("scan", {"sliding_window": 3}, "native")])
def test_ragged_rows_in_one_call_equal_each_rows_own_call(stack, kw, kernel):
    """`paged.PagedRows`: a decode row (one token), a prompt chunk from position 0 and one
    continuing a prefix, back to back in x [1, T] with padding after them, give each
    row's logits and pool entries of its own call."""
    cfg = tiny(stack, **kw)
    cfg.decoder.transformer.layer.self_attention.paged_kernel = kernel
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(1))
    table = jnp.asarray([[7, 2, 9, 5], [1, 8, 3, 0], [4, 6, 10, 11]])
    pools = run(model, params, 12, PS, method="init_paged_states")
    step = jax.jit(lambda p, s, x: run(model, p, s, x, method="extend_step"))
    prefix = jax.random.randint(jax.random.key(4), (3, 6), 0, VOCAB)
    states = {**pools, "time_step": jnp.zeros(3, jnp.int32), "page_table": table}
    states, _ = step(params, states, prefix)  # Rows 0 and 2 hold 6 positions; row 1 restarts.
    ids = jax.random.randint(jax.random.key(5), (9,), 0, VOCAB)
    rows = [(0, 6, ids[:1]), (1, 0, ids[1:6]), (2, 6, ids[6:9])]  # (row, start, tokens)
    want = []
    for r, start, toks in rows:
        one = {"decoder": states["decoder"], "time_step": jnp.asarray([start]),
               "page_table": table[r:r + 1]}
        _, lg = step(params, one, toks[None])
        want.append(lg[0])
    starts = jnp.asarray([0, 1, 6, 9], jnp.int32)
    positions = jnp.concatenate([jnp.asarray([6]), jnp.arange(5), jnp.arange(6, 9),
                                 jnp.zeros(3, jnp.int32)]).astype(jnp.int32)
    ragged = {"decoder": states["decoder"], "time_step": jnp.zeros(1, jnp.int32),
              "page_table": paged.PagedRows(table, starts, positions)}
    new, got = step(params, ragged, jnp.concatenate([ids, jnp.zeros(3, ids.dtype)])[None])
    np.testing.assert_allclose(got[0, :9], jnp.concatenate(want), rtol=2e-5, atol=2e-5)
    # The pool holds each row's new entries where its own call put them.
    for r, start, toks in rows:
        one = {"decoder": states["decoder"], "time_step": jnp.asarray([start]),
               "page_table": table[r:r + 1]}
        mine, _ = step(params, one, toks[None])
        leaf = (lambda t: t["self_attention"]["key"]) if stack != "loop" else (
            lambda t: t["layer1"]["self_attention"]["key"])
        for page in np.asarray(table[r])[np.asarray(table[r]) > 0]:  # Page 0: padding's.
            np.testing.assert_allclose(np.asarray(leaf(new["decoder"]))[..., page, :, :, :],
                                       np.asarray(leaf(mine["decoder"]))[..., page, :, :, :],
                                       atol=1e-5)
