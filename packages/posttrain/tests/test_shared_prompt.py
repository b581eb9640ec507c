"""A preference pair in one row, its prompt computed once (`PreferenceInput.shared_prompt`,
`kernels.segments`): each response's token log-probabilities, the DPO loss and its
gradients equal those of the two-row layout, rows fit seq_len, and a step trains on the
bundled pairs."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlearn.kernels import blockwise_attention, segments_visible, shared_segment
from jaxlearn.layers import llama_config, use_lora
from jaxlearn.posttrain import DPOObjective, token_logprobs
from jaxlearn.posttrain.preference_data import fit_shared, shared_length, shared_row

VOCAB, SEQ = 40, 24


def _model():
    cfg = use_lora(llama_config(VOCAB, 16, 2, 4, 2, 32, stack="scan").set(name="model"),
                   rank=4, alpha=8.0)
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    params = jax.tree_util.tree_map_with_path(  # Adapters that add something.
        lambda kp, x: 0.1 * jax.random.normal(jax.random.key(len(str(kp))), x.shape)
        if str(kp[-1].key) == "lora_b" else x, params)
    return model, params


def _pair(rng, prompt: int, chosen: int, rejected: int):
    """(ids, weights) per side: a common prompt, then different responses (trained)."""
    p = rng.integers(3, VOCAB, size=prompt)
    sides = []
    for n, first in ((chosen, 1), (rejected, 2)):
        ids = np.concatenate([p, [first], rng.integers(3, VOCAB, size=n - 1)])
        w = np.concatenate([np.zeros(prompt), np.ones(n)])
        sides += [ids.astype(np.int32), w.astype(np.float32)]
    return tuple(sides)


def _separate(pair):
    """The two-row layout of one pair: [2, SEQ] per feature."""
    rows = []
    for ids, w in (pair[:2], pair[2:]):
        n = len(ids) - 1
        row = {"input_ids": np.zeros(SEQ, np.int32), "target_labels": np.full(SEQ, -1),
               "target_weights": np.zeros(SEQ, np.float32), "segment_ids": np.zeros(SEQ),
               "positions": np.zeros(SEQ)}
        row["input_ids"][:n], row["target_labels"][:n] = ids[:n], ids[1:]
        row["target_weights"][:n], row["segment_ids"][:n] = w[1:], 1
        row["positions"][:n] = np.arange(n)
        rows.append(row)
    return {k: np.stack([r[k] for r in rows]).astype(
        np.float32 if k == "target_weights" else np.int32) for k in rows[0]}


def _shared(pair):
    row = shared_row(*pair, seq_len=SEQ, pad_id=0)
    return {k: v.astype(np.float32 if k == "target_weights" else np.int32)
            for k, v in row.items()}


def test_visibility_rule():
    g = shared_segment(1, 0)
    seg = jnp.array([0, 1, 2, g, g + 1, g + 2, 2 * g, 2 * g + 1])
    vis = np.asarray(segments_visible(seg[:, None], seg[None, :]))
    want = np.eye(8, dtype=bool)
    want[4, 3] = want[5, 3] = want[7, 6] = True  # Branches see their own group's prefix.
    np.testing.assert_array_equal(vis, want)


def test_each_branch_computes_what_its_own_row_does():
    """Token log-probabilities of every trained label: shared row == separate rows, with
    LoRA adapters on."""
    model, params = _model()
    rng = np.random.default_rng(0)
    for prompt, chosen, rejected in ((9, 6, 4), (5, 1, 8), (1, 3, 3)):
        pair = _pair(rng, prompt, chosen, rejected)
        sep, sh = _separate(pair), _shared(pair)
        logp_sep, _ = token_logprobs(model, params, sep)
        logp_sh, _ = token_logprobs(model, params, {k: v[None] for k, v in sh.items()})
        member = sh["segment_ids"] - shared_segment(1, 0)
        for side in (0, 1):
            got = np.asarray(logp_sh[0])[(member == side + 1) & (sh["target_weights"] > 0)]
            want = np.asarray(logp_sep[side])[sep["target_weights"][side] > 0]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        saved = (sep["segment_ids"] > 0).sum() - (sh["segment_ids"] > 0).sum()
        assert saved == prompt - 1  # The prompt's slots but the last, once instead of twice.


def test_blockwise_attention_applies_the_same_rule():
    rng = np.random.default_rng(1)
    pair = _pair(rng, 7, 5, 6)
    sh = _shared(pair)
    q, k, v = (jnp.asarray(rng.normal(size=(1, SEQ, 2, 8)), jnp.float32) for _ in range(3))
    seg, pos = jnp.asarray(sh["segment_ids"])[None], jnp.asarray(sh["positions"])[None]
    got = blockwise_attention(q, k, v, q_positions=pos, k_positions=pos, q_segment_ids=seg,
                              k_segment_ids=seg, causal=True, block_q=4, block_k=4)
    mask = segments_visible(seg[0][:, None], seg[0][None, :]) & (pos[0][None] <= pos[0][:, None])
    s = jnp.einsum("qhd,khd->hqk", q[0], k[0]) / np.sqrt(8)
    p = jax.nn.softmax(jnp.where(mask[None], s, -1e30), axis=-1) * mask.any(-1)[None, :, None]
    np.testing.assert_allclose(got[0], jnp.einsum("hqk,khd->qhd", p, v[0]), atol=1e-5)


def test_dpo_loss_and_gradients_equal_between_layouts():
    model, params = _model()
    rng = np.random.default_rng(2)
    pairs = [_pair(rng, 6, 4, 7), _pair(rng, 8, 5, 2), _pair(rng, 3, 9, 5)]
    sep = {k: np.stack([_separate(p)[k] for p in pairs]) for k in _separate(pairs[0])}
    sh = {k: np.stack([_shared(p)[k] for p in pairs]) for k in _shared(pairs[0])}
    for kw in ({}, {"length_normalized": True}, {"loss_type": "ipo"}):
        objective = DPOObjective.default_config().set(**kw).instantiate()

        def loss(p, batch):
            out, metrics, _ = objective(model, p, batch, None, is_training=False)
            return out, metrics

        (l_sep, m_sep), g_sep = jax.value_and_grad(loss, has_aux=True)(params, sep)
        (l_sh, m_sh), g_sh = jax.value_and_grad(loss, has_aux=True)(params, sh)
        np.testing.assert_allclose(l_sh, l_sep, rtol=1e-5)
        for name in m_sep:
            np.testing.assert_allclose(m_sh[name], m_sep[name], rtol=1e-5, atol=1e-6,
                                       err_msg=name)
        for a, b in zip(jax.tree.leaves(g_sh), jax.tree.leaves(g_sep)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)  # f32 sum order
    assert float(jnp.abs(jnp.concatenate([x.ravel() for x in jax.tree.leaves(g_sh)])).max()) > 0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(1, 30), st.integers(1, 30), st.integers(4, 40))
def test_fit_shared_rows_fit_and_keep_each_sides_start(prompt, chosen, rejected, seq_len):
    pair = _pair(np.random.default_rng(prompt * 7 + chosen), prompt, chosen, rejected)
    k = shared_length(*pair)
    assert k == prompt - 1  # Every prompt slot but the last (its label is a response's).
    cut = fit_shared(*pair, seq_len=seq_len)
    if k + 2 > seq_len:  # No slot left for a response: the pair is dropped.
        assert cut is None
        return
    assert cut is not None and shared_length(*cut) == k
    row = shared_row(*cut, seq_len=seq_len, pad_id=0)
    used = int((row["segment_ids"] > 0).sum())
    assert used == len(cut[0]) + len(cut[2]) - 2 - k <= seq_len
    for side, (ids, w) in enumerate(((cut[0], cut[1]), (cut[2], cut[3]))):
        full = pair[2 * side]
        np.testing.assert_array_equal(ids, full[:len(ids)])  # Cut from the end only.
        branch = row["segment_ids"] == shared_segment(1, side + 1)
        np.testing.assert_array_equal(row["input_ids"][branch], ids[k:-1])
        np.testing.assert_array_equal(row["target_labels"][branch], ids[k + 1:])
        np.testing.assert_array_equal(row["positions"][branch], np.arange(k, len(ids) - 1))
    prefix = row["segment_ids"] == shared_segment(1, 0)
    assert not row["target_weights"][prefix].any()
    if prompt + chosen + rejected <= seq_len:  # Fits whole: nothing was cut.
        assert all(len(a) == len(b) for a, b in zip(cut, pair))
