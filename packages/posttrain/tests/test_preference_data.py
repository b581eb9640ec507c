"""Preference pairs: [batch, 2, seq] rows, or one row per pair with the prompt shared,
whose weights cover exactly the final response (rendered with the chat template), bad rows
named by file:line, exact resume."""

import json

import numpy as np
import pytest

from jaxlearn.kernels import shared_segment
from jaxlearn.posttrain import PreferenceInput, PreferenceSource
from jaxlearn.runtime.data import DataError
from jaxlearn.runtime.input_pipeline import FEATURES

ROWS = [
    {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "Capital of France?"}],
     "chosen": [{"role": "assistant", "content": "Paris"}], "rejected": "Lyon"},
    {"prompt": "Colour of the sky?", "chosen": "blue", "rejected": "green"},
]


def _input(tmp_path, rows, **kw):
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PreferenceInput.default_config().set(
        source=PreferenceSource.default_config().set(paths=[str(path)]), seq_len=256,
        global_batch_size=2, eval_fraction=0.0, shuffle=False, **kw).instantiate(), path


def _weighted_text(tok, row):
    ids, w = row["target_labels"], row["target_weights"]
    return tok.decode([int(t) for t in ids[w > 0]])


def test_pairs_weight_only_the_final_response(tmp_path):
    inp, _ = _input(tmp_path, ROWS, shared_prompt=False)
    assert {k: v[0] for k, v in inp.batch_shapes().items()} == {k: (2, 2, 256) for k in FEATURES}
    it = inp.iterator()
    first, second = next(it), next(it)
    assert all(first[k].shape == (2, 2, 256) for k in FEATURES)
    got = [[_weighted_text(inp.tokenizer, {k: b[k][i, side] for k in b}) for side in (0, 1)]
           for b in (first, second) for i in range(2)]
    assert [g[0].removesuffix("<|im_end|>") for g in got[:3]] == ["4", "Paris", "blue"]
    assert [g[1].removesuffix("<|im_end|>") for g in got[:3]] == ["5", "Lyon", "green"]
    # The context's earlier assistant turn ("Hello") is not trained.
    assert "Hello" not in got[1][0]
    # Real tokens are segment 1 with positions from 0; padding is labelled -1, weight 0.
    seg, pos, labels = (first[k][0, 0] for k in ("segment_ids", "positions", "target_labels"))
    n = int(seg.sum())
    assert np.array_equal(pos[:n], np.arange(n)) and (labels[n:] == -1).all()


def test_shared_rows_hold_each_side_once_and_the_prompt_once(tmp_path):
    """The default layout: [batch, seq], the prompt's slots once, then each response as a
    branch whose tokens and labels continue the prompt exactly as the side's own row."""
    shared, _ = _input(tmp_path, ROWS)
    plain, _ = _input(tmp_path, ROWS, shared_prompt=False)
    assert {k: v[0] for k, v in shared.batch_shapes().items()} == {k: (2, 256) for k in FEATURES}
    g = shared_segment(1, 0)
    its = shared.iterator(), plain.iterator()
    for a, b in ((next(its[0]), next(its[1])) for _ in range(2)):  # 3 pairs, 2 per batch.
        for i in range(2):
            seg = a["segment_ids"][i]
            if not seg.any():
                continue
            prompt = seg == g
            assert not a["target_weights"][i][prompt].any()
            for side in (0, 1):
                n = int(b["segment_ids"][i, side].sum())
                branch = seg == g + 1 + side
                k = int(prompt.sum())
                for key in ("input_ids", "target_labels", "positions", "target_weights"):
                    got = np.concatenate([a[key][i][prompt], a[key][i][branch]])
                    np.testing.assert_array_equal(got, b[key][i, side][:n], err_msg=key)
                assert k > 10  # The chat template's prompt, now computed once.


def test_resume_gives_the_same_next_batch(tmp_path):
    inp, _ = _input(tmp_path, ROWS * 3, num_epochs=None)
    it = inp.iterator()
    next(it)
    state = it.get_state()
    want = next(it)
    again = inp.iterator()
    again.set_state(state)
    got = next(again)
    for k in FEATURES:
        np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize("row, message", [
    ({"prompt": "x", "chosen": "a"}, "needs 'chosen' and 'rejected'"),
    ({"prompt": "x", "messages": [], "chosen": "a", "rejected": "b"}, "exactly one of"),
    ({"prompt": "x", "chosen": "", "rejected": "b"}, "'chosen' must be a non-empty"),
    ({"prompt": "x", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
     "chosen[0].role must be 'assistant'"),
    ({"messages": [{"role": "robot", "content": "a"}], "chosen": "a", "rejected": "b"},
     "messages[0].role 'robot'"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, row, message):
    inp, path = _input(tmp_path, [ROWS[0], row])
    with pytest.raises(DataError) as e:
        inp.iterator()
    assert str(e.value).startswith(f"{path}:2: ") and message in str(e.value)
