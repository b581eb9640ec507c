"""Golden configs: every recipe's flat text (and per mesh selector) equals the committed
file. On drift the test prints the diff; regenerate with `tools/jaxlearn golden --write`."""

import os

import pytest

from jaxlearn.config import diff_flat_texts
from jaxlearn.experiments import golden_texts

GOLDEN_DIR = "golden_configs"
TEXTS = golden_texts()


def _golden_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (GOLDEN_DIR, os.path.join(here, "..", "..", "..", GOLDEN_DIR)):
        if os.path.isdir(candidate):
            return candidate
    pytest.fail("golden_configs/ not found")


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_golden_config_unchanged(name):
    path = os.path.join(_golden_dir(), name)
    assert os.path.exists(path), f"{name} missing: run `tools/jaxlearn golden --write`"
    with open(path, encoding="utf-8") as f:
        old = f.read()
    diff = diff_flat_texts(old, TEXTS[name], f"golden/{name}", "current")
    assert not diff, f"golden config drifted (regenerate if intended):\n{diff}"


def test_no_stale_golden_files():
    stale = set(os.listdir(_golden_dir())) - set(TEXTS) - {"BUILD"}
    assert not stale, f"golden files without a recipe: {sorted(stale)}"


def test_selector_recorded_and_flat_text_deterministic():
    text = TEXTS["llama2-7b@tpu-v5p-512.txt"]
    assert "mesh_selector: 'tpu-v5p-512'" in text
    assert "mesh_rule: 'tpu-v(5p|4)-.*'" in text
    assert golden_texts() == TEXTS
