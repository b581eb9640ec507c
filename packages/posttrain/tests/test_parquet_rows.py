"""Preference pairs and GRPO prompts from a Parquet file and a saved dataset: the same
documents as the same rows in JSONL, origins `file:row`, a bad row named."""

from __future__ import annotations

import json
from typing import Any

import pytest

from jaxlearn.posttrain.preference_data import PreferenceSource
from jaxlearn.posttrain.prompt_data import PromptSource
from jaxlearn.runtime.data import DataError

datasets = pytest.importorskip("datasets", reason="Parquet and saved datasets need datasets")

PAIRS = [{"prompt": f"p{i}", "chosen": "yes", "rejected": "no"} for i in range(3)]
PROMPTS = [{"prompt": f"2+{i}?", "answer": str(2 + i)} for i in range(3)]


def docs(source: Any, path: str) -> list[Any]:
    return source.default_config().set(paths=[path]).instantiate().documents()


@pytest.mark.parametrize("source, rows", [(PreferenceSource, PAIRS), (PromptSource, PROMPTS)],
                         ids=["preference", "prompt"])
def test_parquet_and_saved_rows_equal_jsonl(tmp_path: Any, source: Any, rows: Any) -> None:
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "r.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    want = docs(source, str(tmp_path / "r.jsonl"))
    for path in (tmp_path / "r.parquet", tmp_path / "saved"):
        got = docs(source, str(path))
        assert [d.text for d in got] == [d.text for d in want]
        assert [d.origin for d in got] == [f"{path}:{n}" for n in (1, 2, 3)]


def test_a_bad_pair_names_file_and_row(tmp_path: Any) -> None:
    path = tmp_path / "bad.parquet"
    datasets.Dataset.from_list([*PAIRS, {"prompt": "p", "chosen": "yes",
                                         "rejected": None}]).to_parquet(str(path))
    with pytest.raises(DataError, match=rf"{path}:4: "):
        docs(PreferenceSource, str(path))
