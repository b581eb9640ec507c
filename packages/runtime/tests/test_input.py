"""The input pipeline: sources, bundled corpus, packing invariants, sharding, resume, errors."""

from __future__ import annotations

import itertools
import json
import os
import sys
from typing import Any, Iterator, Optional

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.config import ConfigError
from jaxlearn.runtime.bundled import STDLIB_FILES, STDLIB_SHA256, BundledSource, stdlib_sha256
from jaxlearn.runtime.data import DataError, InlineSource, TextFilesSource
from jaxlearn.runtime.input_pipeline import FEATURES, Input, merge_states
from jaxlearn.text.tokenizers import ByteTokenizer

BOS, EOS, PAD = 1, 2, 0
TOK = ByteTokenizer.default_config().instantiate()
TEXTS = [
    "alpha beta gamma",
    "x",
    "a somewhat longer document that spans more than one row of thirty-two tokens",
    "short one",
    "def f(x):\n    return x + 1\n",
    "the end",
    "é ü ß unicode text",
] + [f"doc {i}: " + "word " * (i % 11) for i in range(150)]
# grain's index_shuffle costs milliseconds per element on a domain of a few elements (it is
# fast from ~1000 on), so the shared corpus has ~150 documents to keep the tests quick.


def inline(texts: list[str] = TEXTS, **kwargs: Any) -> Input:
    cfg = Input.default_config().set(
        source=InlineSource.default_config().set(texts=texts),
        seq_len=32,
        global_batch_size=4,
        eval_fraction=0.0,
    )
    return cfg.set(**kwargs).instantiate()


def take(it: Iterator[dict[str, np.ndarray]], n: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(n)]


def assert_same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def check_row(row: dict[str, np.ndarray]) -> None:
    """Invariants of one packed row."""
    seg, pos = row["segment_ids"], row["positions"]
    ids, labels, weights = row["input_ids"], row["target_labels"], row["target_weights"]
    valid = seg > 0
    n = int(valid.sum())
    assert valid[:n].all() and not valid[n:].any(), "padding only at the end"
    if n:
        assert seg[0] == 1
        assert np.all(np.diff(seg[:n]) >= 0) and np.all(np.diff(seg[:n]) <= 1), "monotone"
    starts = np.r_[True, seg[1:] != seg[:-1]] & valid
    assert np.all(pos[starts] == 0), "positions restart at segment starts"
    inner = valid & ~starts
    assert np.all(pos[inner] == np.r_[0, pos[:-1]][inner] + 1), "positions count up"
    np.testing.assert_array_equal(weights, valid.astype(np.float32))
    assert np.all(labels[~valid] == -1) and np.all(ids[~valid] == PAD) and np.all(pos[~valid] == 0)
    assert np.all(labels[valid] >= 0)
    # Inside a segment, the target is the next input token.
    same = valid[:-1] & (seg[1:] == seg[:-1])
    np.testing.assert_array_equal(labels[:-1][same], ids[1:][same])


def stream_tokens(batches: list[dict[str, np.ndarray]], r: int, key: str) -> list[int]:
    return [int(t) for b in batches for t in b[key][r][b["target_weights"][r] > 0]]


# ---- bundled corpus ----------------------------------------------------------------------


def test_bundled_corpus_is_fixed() -> None:
    assert 40 <= len(STDLIB_FILES) <= 80
    assert list(STDLIB_FILES) == sorted(set(STDLIB_FILES))
    docs = BundledSource.default_config().instantiate().documents()
    assert [d.origin for d in docs] == [f"stdlib:{n}" for n in STDLIB_FILES]
    assert all(d.text.strip() for d in docs)
    version = "%d.%d.%d" % sys.version_info[:3]
    if version not in STDLIB_SHA256:
        pytest.skip(f"no recorded sha256 for Python {version}")
    assert stdlib_sha256() == STDLIB_SHA256[version]


def test_default_input_splits_bundled_corpus() -> None:
    cfg = Input.default_config().set(seq_len=32, global_batch_size=4)
    train = cfg.instantiate().documents()
    held_out = cfg.clone(split="eval").instantiate().documents()
    assert train and held_out
    assert len(held_out) < len(train)
    assert {d.origin for d in train}.isdisjoint({d.origin for d in held_out})
    assert len(train) + len(held_out) == len(STDLIB_FILES)
    batch = next(cfg.instantiate().iterator())
    assert set(batch) == set(FEATURES)
    for name, dtype in FEATURES.items():
        assert batch[name].shape == (4, 32) and batch[name].dtype == dtype
    assert cfg.instantiate().batch_shapes(process_count=2)["input_ids"] == ((2, 32), np.int32)
    for r in range(4):
        check_row({k: v[r] for k, v in batch.items()})


# ---- packing invariants ------------------------------------------------------------------

texts_strategy = st.lists(st.text(alphabet="ab c\né", max_size=50), min_size=1, max_size=9)


@given(
    texts=texts_strategy,
    seq_len=st.integers(1, 24),
    batch=st.sampled_from([1, 2, 3, 4]),
    epochs=st.integers(1, 2),
    shuffle=st.booleans(),
    add_bos=st.booleans(),
)
def test_packing_invariants(
    texts: list[str], seq_len: int, batch: int, epochs: int, shuffle: bool, add_bos: bool
) -> None:
    docs = [t for t in texts if t.strip()]
    if not docs:
        with pytest.raises(DataError, match="no documents"):
            inline(texts).iterator()
        return
    inp = inline(
        texts,
        seq_len=seq_len,
        global_batch_size=batch,
        num_epochs=epochs,
        shuffle=shuffle,
        add_bos=add_bos,
    )
    batches = list(inp.iterator())
    for b in batches:
        for r in range(batch):
            check_row({k: v[r] for k, v in b.items()})
    encoded = [([BOS] if add_bos else []) + TOK.encode(t) + [EOS] for t in docs]
    order = [p % len(docs) for p in range(len(docs) * epochs)]  # Unshuffled order.
    seen_inputs, seen_targets, rows = [], [], []
    for r in range(batch):
        inputs = stream_tokens(batches, r, "input_ids")
        rows.append(-(-len(inputs) // seq_len))
        targets = stream_tokens(batches, r, "target_labels")
        if not shuffle:  # Every input token of every document, in order; targets shifted.
            mine = [encoded[i] for i in order[r::batch]]
            assert inputs == [t for e in mine for t in e[:-1]]
            assert targets == [t for e in mine for t in e[1:]]
        seen_inputs += inputs
        seen_targets += targets
    # Shuffled or not, every document appears `epochs` times (as multisets of tokens).
    assert sorted(seen_inputs) == sorted(t for i in order for t in encoded[i][:-1])
    assert sorted(seen_targets) == sorted(t for i in order for t in encoded[i][1:])
    # Each stream fills all its rows but its last: the iterator stops after the longest.
    assert len(batches) == max(rows)


def test_documents_split_across_rows_continue_in_the_same_stream() -> None:
    long_text = "0123456789" * 7  # 70 bytes + BOS + EOS over rows of 32.
    inp = inline([long_text], global_batch_size=1, num_epochs=1)
    batches = list(inp.iterator())
    assert len(batches) == 3
    assert stream_tokens(batches, 0, "input_ids") == [BOS] + TOK.encode(long_text)
    assert stream_tokens(batches, 0, "target_labels") == TOK.encode(long_text) + [EOS]
    assert batches[2]["positions"][0][0] == 0 and batches[2]["segment_ids"][0][0] == 1


# ---- determinism, epochs, sharding -------------------------------------------------------


def test_deterministic_for_a_seed() -> None:
    a = take(inline(seed=3).iterator(), 6)
    assert_same(a, take(inline(seed=3).iterator(), 6))
    b = take(inline(seed=4).iterator(), 6)
    assert any(not np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))


def test_epochs_reshuffle_and_repeat_forever() -> None:
    docs = [f"document number {i}" for i in range(8)]
    inp = inline(docs, global_batch_size=1, seq_len=16)
    it = inp.iterator()
    batches = take(it, 60)  # 8 docs of 18 input tokens: > 5 epochs.
    text = TOK.decode(stream_tokens(batches, 0, "input_ids"))
    epochs = [text[i : i + 8 * 17] for i in range(0, 5 * 8 * 17, 8 * 17)]
    orders = [[int(e[j + 16]) for j in range(0, len(e), 17)] for e in epochs]
    assert all(sorted(o) == list(range(8)) for o in orders)
    assert len({tuple(o) for o in orders}) > 1, "each epoch is shuffled differently"


@pytest.mark.parametrize("num_epochs", [None, 1])
@pytest.mark.parametrize("process_count", [2, 4])
def test_processes_together_equal_one_process(
    num_epochs: Optional[int], process_count: int
) -> None:
    one = list(zip(range(40), inline(num_epochs=num_epochs).iterator()))
    parts = [
        list(zip(range(40), inline(num_epochs=num_epochs).iterator(i, process_count)))
        for i in range(process_count)
    ]
    assert all(len(p) == len(one) for p in parts), "every process yields as many batches"
    for step, (_, batch) in enumerate(one):
        for k in FEATURES:
            got = np.concatenate([p[step][1][k] for p in parts])
            np.testing.assert_array_equal(got, batch[k])
            assert parts[0][step][1][k].shape == (4 // process_count, 32)


def test_bad_process_arguments() -> None:
    with pytest.raises(ConfigError, match="not divisible by the 3 processes"):
        inline().iterator(0, 3)
    with pytest.raises(ConfigError, match=r"process_index 4 is not in \[0, 4\)"):
        inline().iterator(4, 4)
    with pytest.raises(ConfigError, match="seq_len must be >= 1"):
        inline(seq_len=0)
    with pytest.raises(ConfigError, match="num_epochs"):
        inline(num_epochs=0)


# ---- exact resume ------------------------------------------------------------------------


@given(
    k=st.integers(0, 40),
    m=st.integers(1, 8),
    shuffle=st.booleans(),
    num_epochs=st.sampled_from([None, 1, 2]),
    seq_len=st.sampled_from([4, 8, 32]),
)
def test_resume_is_exact(
    k: int, m: int, shuffle: bool, num_epochs: Optional[int], seq_len: int
) -> None:
    texts = TEXTS[:20]
    kwargs = dict(shuffle=shuffle, num_epochs=num_epochs, seq_len=seq_len)
    it = inline(texts, **kwargs).iterator()
    list(itertools.islice(it, k))
    state = it.get_state()
    expected = list(itertools.islice(it, m))
    restored = inline(texts, **kwargs).iterator()
    restored.set_state(state)
    assert_same(list(itertools.islice(restored, m)), expected)
    assert restored.get_state() == it.get_state()


def test_resume_bundled_and_state_is_json() -> None:
    cfg = Input.default_config().set(seq_len=32, global_batch_size=4)
    it = cfg.instantiate().iterator()
    take(it, 7)
    state = it.get_state()
    assert isinstance(state, bytes)
    parsed = json.loads(state)
    assert parsed["batches"] == 7 and sorted(parsed["streams"]) == ["0", "1", "2", "3"]
    expected = take(it, 5)
    restored = cfg.instantiate().iterator()
    restored.set_state(state.decode())  # A str works too (e.g. from a JSON metadata file).
    assert_same(take(restored, 5), expected)


def test_resume_finite_at_the_end() -> None:
    it = inline(num_epochs=1).iterator()
    batches = list(it)
    state = it.get_state()
    restored = inline(num_epochs=1).iterator()
    restored.set_state(state)
    assert list(restored) == []
    mid = inline(num_epochs=1).iterator()
    take(mid, 1)
    restored.set_state(mid.get_state())
    assert_same(list(restored), batches[1:])


def test_merged_states_restore_on_any_process_count() -> None:
    runs = [inline().iterator(i, 2) for i in range(2)]
    for r in runs:
        take(r, 5)
    merged = merge_states([r.get_state() for r in runs])
    expected = take(inline().iterator(), 13)[5:]
    single = inline().iterator()
    single.set_state(merged)
    assert_same(take(single, 8), expected)
    quarters = [inline().iterator(i, 4) for i in range(4)]
    for q in quarters:
        q.set_state(merged)
    got = [take(q, 8) for q in quarters]
    for step in range(8):
        for k in FEATURES:
            np.testing.assert_array_equal(
                np.concatenate([g[step][k] for g in got]), expected[step][k]
            )
    with pytest.raises(DataError, match="merge_states"):
        inline().iterator(0, 1).set_state(runs[1].get_state())


def test_state_from_another_input_is_refused() -> None:
    state = inline().iterator().get_state()
    with pytest.raises(DataError, match="seq_len: saved 32, now 16"):
        inline(seq_len=16).iterator().set_state(state)
    with pytest.raises(DataError, match="corpus_sha256"):
        inline(TEXTS[:-1]).iterator().set_state(state)
    with pytest.raises(DataError, match="not valid JSON"):
        inline().iterator().set_state(b"\x80pickle")
    with pytest.raises(DataError, match="not a jaxlearn.input/1 state"):
        inline().iterator().set_state(b'{"a": 1}')


# ---- local files and bad input -----------------------------------------------------------


def files_input(paths: Any, **kwargs: Any) -> Input:
    src = TextFilesSource.default_config().set(paths=paths)
    for key in ("jsonl_field", "txt_documents"):
        if key in kwargs:
            setattr(src, key, kwargs.pop(key))
    cfg = Input.default_config().set(source=src, seq_len=32, global_batch_size=4, eval_fraction=0.0)
    return cfg.set(**kwargs).instantiate()


def write(path: str, data: str | bytes) -> str:
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return path


def test_text_and_jsonl_files(tmp_path: os.PathLike) -> None:
    d = str(tmp_path)
    txt = write(os.path.join(d, "a.txt"), "first para\nstill first\n\n  \nsecond para\n")
    jl = write(os.path.join(d, "b.jsonl"), '{"text": "one"}\n\n{"text": "  "}\n{"text": "two"}\n')
    docs = files_input([txt, jl]).documents()
    assert [x.text for x in docs] == ["first para\nstill first\n\n  \nsecond para\n", "one", "two"]
    assert [x.origin for x in docs][1:] == [f"{jl}:1", f"{jl}:4"]
    docs = files_input([d], txt_documents="blank_lines").documents()  # A directory.
    assert [x.text for x in docs] == ["first para\nstill first", "second para", "one", "two"]
    body = write(os.path.join(d, "c.jsonl"), '{"body": "x y"}\n')
    assert [x.text for x in files_input(body, jsonl_field="body").documents()] == ["x y"]
    batches = list(files_input([txt, jl], num_epochs=1, shuffle=False).iterator())
    assert TOK.decode(stream_tokens(batches, 1, "input_ids")) == "one"


def test_eval_split_is_by_document_hash(tmp_path: os.PathLike) -> None:
    texts = [f"doc {i}" for i in range(200)]
    train = inline(texts, eval_fraction=0.25).documents()
    held = inline(texts, eval_fraction=0.25, split="eval").documents()
    assert sorted(d.text for d in train + held) == sorted(texts)
    assert 25 <= len(held) <= 75
    # Order independent: the same documents are held out from a reversed corpus.
    again = inline(texts[::-1], eval_fraction=0.25, split="eval").documents()
    assert {d.text for d in again} == {d.text for d in held}
    with pytest.raises(DataError, match="the 'eval' split is empty"):
        inline(texts[:2], eval_fraction=0.0, split="eval").iterator()


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.txt", None, "no such file"),
        ("empty.txt", b"", "file is empty"),
        ("blank.txt", b" \n\t\n", "no usable text"),
        ("latin1.txt", "caf\xe9".encode("latin-1"), "not valid UTF-8 (byte 0xe9 at offset 3)"),
        ("blank.jsonl", b'{"text": " "}\n', "no usable text"),
        ("bad.jsonl", b'{"text": "a"}\n{"text": \n', ":2: not valid JSON"),
        ("other.jsonl", b'{"content": "a"}\n', ":1: no field 'text' (fields: content)"),
        ("list.jsonl", b'["a"]\n', ":1: expected a JSON object"),
        ("number.jsonl", b'{"text": 3}\n', ":1: field 'text' is a int"),
        ("binary.jsonl", b'{"text": "\xff"}\n', "not valid UTF-8"),
    ],
)
def test_bad_files_raise_one_line_data_error(
    tmp_path: os.PathLike, name: str, content: Optional[bytes], message: str
) -> None:
    path = os.path.join(tmp_path, name)
    if content is not None:
        write(path, content)
    good = write(os.path.join(tmp_path, "good.txt"), "fine text")
    inp = files_input([good, path])  # Building the Input reads nothing yet.
    with pytest.raises(DataError) as e:
        inp.iterator()  # Files are read and checked before any batch.
    text = str(e.value)
    assert text.startswith(path) and message in text, text
    assert "\n" not in text
    assert isinstance(e.value, ValueError)


def test_empty_directory_and_no_paths(tmp_path: os.PathLike) -> None:
    with pytest.raises(DataError, match="directory has no .txt or .jsonl files"):
        files_input([str(tmp_path)]).iterator()
    with pytest.raises(DataError, match="paths is empty"):
        files_input([]).iterator()
