"""Batches cut to their longest row: lengths, pairs, untouched full batches, property."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.runtime.step_programs import shape_key, trim_to_longest


def _batch(lengths, seq, pairs=False):
    n = len(lengths)
    seg = np.zeros((n, seq), np.int32)
    for i, m in enumerate(lengths):
        seg[i, :m] = 1
    b = {"input_ids": np.arange(n * seq).reshape(n, seq), "segment_ids": seg,
         "target_labels": np.where(seg > 0, 1, -1), "advantages": np.ones((n, seq)),
         "prompt_meta": np.ones((n, 3))}
    if pairs:
        b = {k: np.stack([v, v], axis=1) for k, v in b.items()}
    return b


@given(st.lists(st.integers(0, 64), min_size=1, max_size=6), st.sampled_from([1, 8, 16, 64]),
       st.booleans())
def test_cut_to_the_longest_row_rounded_up(lengths, multiple, pairs):
    b = _batch(lengths, 64, pairs)
    out = trim_to_longest(b, multiple)
    want = min(64, -(-max(max(lengths), 1) // multiple) * multiple)
    assert out["input_ids"].shape[-1] == want
    for k, v in out.items():
        if b[k].shape[-1] == 64:
            np.testing.assert_array_equal(v, b[k][..., :want])  # A prefix of each row.
        else:
            assert v is b[k]  # Features of another length are left alone.
    # Nothing real was cut.
    assert out["segment_ids"].sum() == b["segment_ids"].sum()


def test_a_full_batch_is_returned_as_is_and_shapes_key_programs():
    b = _batch([64, 3], 64)
    assert trim_to_longest(b, 32) is b
    assert shape_key(trim_to_longest(_batch([3], 64), 32)) != shape_key(b)
