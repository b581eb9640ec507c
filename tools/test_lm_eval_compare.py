"""tools/bench/lm_eval_compare.py on two small lm-eval output directories written here in
lm-eval 0.4.13's layout (results_*.json + samples_<task>_*.jsonl under a model dir)."""

import importlib.util
import json
import pathlib

import pytest

ROOT = next(p for p in [pathlib.Path.cwd(), *pathlib.Path(__file__).resolve().parents]
            if (p / "tools" / "bench" / "lm_eval_compare.py").exists())
_spec = importlib.util.spec_from_file_location(
    "lm_eval_compare", ROOT / "tools" / "bench" / "lm_eval_compare.py")
assert _spec is not None and _spec.loader is not None
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)

ARGS = {"gen_args_0": {"arg_0": "Q", "arg_1": " a"}, "gen_args_1": {"arg_0": "Q", "arg_1": " b"}}


def write_run(root: pathlib.Path, lls: list[list[float]], texts: list[str], acc: float):
    d = root / "model"
    d.mkdir(parents=True)
    results = {"results": {
        "mc": {"acc,none": acc, "acc_norm,none": acc},
        "gen": {"exact_match,strip": 0.5}},
        "config": {"model": "hf", "model_args": {"pretrained": "m", "device": "cpu"}},
        "lm_eval_version": "0.4.13", "total_evaluation_time_seconds": "12.5"}
    (d / "results_2026-01-01T00-00-00.json").write_text(json.dumps(results))
    with open(d / "samples_mc_2026-01-01T00-00-00.jsonl", "w") as f:
        for i, row in enumerate(lls):  # lm-eval logs (loglikelihood, is_greedy) as strings.
            resps = [[[str(x), "False"]] for x in row]
            f.write(json.dumps({"doc_id": i, "arguments": ARGS, "resps": resps}) + "\n")
    with open(d / "samples_gen_2026-01-01T00-00-00.jsonl", "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"doc_id": i, "arguments": {"gen_args_0": {"arg_0": "Q"}},
                                "resps": [[" " + t]], "filtered_resps": [t],
                                "exact_match": 1.0}) + "\n")


def test_summary_reports_max_difference_and_differing_items(tmp_path):
    write_run(tmp_path / "a", [[-1.0, -2.0], [-3.0, -2.5]], ["Rome", "4"], 0.5)
    write_run(tmp_path / "b", [[-1.25, -2.0], [-2.4, -2.5]], ["Rome", "5"], 1.0)
    text = compare.summary(str(tmp_path / "a"), str(tmp_path / "b"), ("x", "y"))
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines()}
    assert rows["mc"][2:6] == ["0.5000 (0.5000)", "1.0000 (1.0000)", "6.00e-01", "2"]
    assert rows["mc"][6].strip(" |") == "1"  # doc 1: argmax 1 in a, 0 in b.
    assert rows["gen"][4:7] == ["-", "2", "1 |"]
    assert text.startswith("lm-eval 0.4.13; x: lm-eval `hf` (pretrained=m), 12 s; y: ")
    assert "- mc doc 1: x choice 1 greedy [False, False], y choice 0 greedy [False, False]" in text
    assert "- gen doc 1: x '4', y '5'" in text


def test_different_items_are_refused(tmp_path):
    write_run(tmp_path / "a", [[-1.0, -2.0], [-3.0, -2.5]], ["Rome", "4"], 0.5)
    write_run(tmp_path / "b", [[-1.0, -2.0]], ["Rome", "4"], 0.5)
    with pytest.raises(SystemExit, match="mc: the runs scored different doc_ids"):
        compare.summary(str(tmp_path / "a"), str(tmp_path / "b"), ("x", "y"))
