"""The fit check (`jaxlearn.aot.fit`) and the AOT matrix store (`jaxlearn.aot.matrix`):
both work on a config's flat text and explicit paths."""

from __future__ import annotations

import json

import pytest
from aot_toys import mlp_trainer_config

from jaxlearn.aot import fit, matrix
from jaxlearn.config import to_flat_text

GiB = 2**30


def _entry(required: int, hbm: int = 16 * GiB) -> dict:
    return {"fits": required <= 0.95 * hbm, "required_bytes": required, "hbm_bytes": hbm,
            "params_bytes": GiB, "optimizer_bytes": 2 * GiB, "temp_bytes": required - 3 * GiB}


def test_config_digest_ignores_what_the_compiled_step_does_not_depend_on():
    text = "learner.learning_rate: 0.001\noutput_dir: 'a'\ncheckpointer.keep_last_n: 3\n"
    moved = text.replace("'a'", "'b'").replace("keep_last_n: 3", "keep_last_n: 9")
    assert matrix.config_digest(text, "cpu-8") == matrix.config_digest(moved, "cpu-8")
    assert matrix.config_digest(text, "cpu-8") != matrix.config_digest(text, "cpu-16")
    changed = text.replace("0.001", "0.002")
    assert matrix.config_digest(text, "cpu-8") != matrix.config_digest(changed, "cpu-8")


def test_matrix_records_looks_up_by_digest_and_renders(tmp_path):
    path = str(tmp_path / "docs" / "aot_matrix.json")
    assert matrix.load(path) == {"entries": {}}
    key = matrix.entry_key("r", "gpu-h100-8x4", ["input.seq_len=64"])
    assert key == "r@gpu-h100-8x4 --set input.seq_len=64"
    matrix.record(path, "r", "gpu-h100-8x4", ["input.seq_len=64"], "d1",
                  {"fits": False, "error": "boom"})
    assert matrix.lookup(path, key, "d1")["error"] == "boom"
    assert matrix.lookup(path, key, "d2") is None  # The config changed since the compile.
    page = matrix.render(path, lambda e: False, [key, "r@tpu-v5p-512"])
    assert f"| {key} (stale) | - |" in page and "NO (error: boom)" in page
    assert "Not compiled yet (1 pairs): r@tpu-v5p-512." in page
    (tmp_path / "bad.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="not an AOT matrix"):
        matrix.load(str(tmp_path / "bad.json"))


def test_a_fresh_matrix_entry_answers_without_measuring(tmp_path):
    verdict = fit.check_fit("not a config", "cpu-8", cache_dir=str(tmp_path),
                            matrix_entry=_entry(20 * GiB))
    assert verdict.method == "aot matrix" and verdict.fits is False
    assert verdict.usable_bytes == int(0.95 * 16 * GiB)
    assert verdict.describe().startswith("the compiled step (AOT matrix) needs 20.00 GiB per "
                                         "device (params 1.00 GiB, optimizer state 2.00 GiB")
    assert fit.from_matrix({"error": "boom"}) is None and fit.from_matrix(None) is None
    assert list(tmp_path.iterdir()) == []


def test_the_floor_of_a_toy_trainer_and_its_cache(tmp_path):
    """The floor: exact sharded state, one more params shard for the gradients, no
    activations for a model without a transformer stack; measured once, then cached."""
    cfg = mlp_trainer_config(fsdp=8)
    figures = fit.floor(cfg, "cpu-8")
    parts = dict(figures["parts"])
    params = (128 * 64 * 2 + 64 * 128 * 2) * 4 // 8  # f32, FSDP over 8 devices
    assert parts["gradients"] == params
    assert parts["state"] >= 3 * params  # params + Adam's two moments (+ step counters)
    assert parts["activations kept for the backward pass"] == 0
    assert figures["required_bytes"] == sum(parts.values())
    text = to_flat_text(cfg)
    cache = tmp_path / "cache"
    digest = matrix.config_digest(text, "cpu-8")
    path = fit._cache_path(str(cache), digest, "floor")
    cache.mkdir()
    with open(path, "w") as f:
        json.dump(figures, f)
    verdict = fit.check_fit(text, "cpu-8", cache_dir=str(cache))  # Read from the cache.
    assert verdict.method == "floor" and verdict.fits is True
    assert verdict.required_bytes == figures["required_bytes"]
    assert verdict.describe().startswith("at least ")
