"""Rows from Parquet files and saved `datasets` (`runtime.row_files`): the same examples as
the same rows in JSONL (preference and prompt rows: posttrain/tests/test_parquet_rows.py);
bad rows and unreadable inputs are errors naming file:row."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from jaxlearn.runtime.data import DataError
from jaxlearn.runtime.row_files import row_files, row_lines
from jaxlearn.runtime.sft import SFTInput, SFTSource
from jaxlearn.text.tokenizers import ByteTokenizer

datasets = pytest.importorskip("datasets", reason="Parquet and saved datasets need datasets")

ROWS = [
    {"messages": [{"role": "user", "content": f"question {i}"},
                  {"role": "assistant", "content": f"answer {i}" * (i + 1)}]}
    for i in range(5)
]


def jsonl(path: Any, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def parquet(path: Any, rows: list[dict[str, Any]]) -> str:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def saved(path: Any, rows: list[dict[str, Any]]) -> str:
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def examples(path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    cfg = SFTInput.default_config().set(
        source=SFTSource.default_config().set(paths=[path]), seq_len=128,
        global_batch_size=2, eval_fraction=0.0, tokenizer=ByteTokenizer.default_config())
    return cfg.instantiate().examples()


@pytest.mark.parametrize("write", [parquet, saved], ids=["parquet", "save_to_disk"])
def test_the_same_examples_as_jsonl(tmp_path: Any, write: Any) -> None:
    want = examples(jsonl(tmp_path / "rows.jsonl", ROWS))
    got = examples(write(tmp_path / "rows.parquet" if write is parquet else tmp_path / "ds",
                         ROWS))
    assert len(got) == len(want) == 5
    for (ids, w), (ref_ids, ref_w) in zip(got, want):
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_array_equal(w, ref_w)


def test_origins_name_file_and_row_and_directories_mix_kinds(tmp_path: Any) -> None:
    d = tmp_path / "data"
    d.mkdir()
    jsonl(d / "a.jsonl", ROWS[:2])
    parquet(d / "b.parquet", ROWS[2:])
    (d / "notes.txt").write_text("not data")
    assert row_files([str(d)]) == [str(d / "a.jsonl"), str(d / "b.parquet")]
    origins = [where for _, where, _ in row_lines([str(d)], 10_000)]
    assert origins == [f"{d}/a.jsonl:1", f"{d}/a.jsonl:2", f"{d}/b.parquet:1",
                       f"{d}/b.parquet:2", f"{d}/b.parquet:3"]


def test_bad_rows_and_inputs_name_file_and_row(tmp_path: Any) -> None:
    bad = parquet(tmp_path / "bad.parquet", [*ROWS[:2], {"messages": [
        {"role": "user", "content": "q"}, {"role": "wizard", "content": "a"}]}])
    with pytest.raises(DataError, match=rf"{bad}:3: "):
        examples(bad)
    blob = parquet(tmp_path / "blob.parquet", [{"text": "a", "raw": b"\x00\x01"}])
    with pytest.raises(DataError, match=rf"{blob}:1: column 'raw' holds a bytes"):
        list(row_lines([blob], 10_000))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="junk.parquet: cannot be read as a Parquet file"):
        list(row_lines([str(tmp_path / "junk.parquet")], 10_000))
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(dd))
    with pytest.raises(DataError, match=r"a saved DatasetDict; give one of its splits .*train"):
        row_files([str(dd)])
    with pytest.raises(DataError, match=r"train:1: the row has \d+ characters, over "
                                        r"SFTSource.max_row_chars=10"):
        list(row_lines([str(dd / "train")], 10))
