"""Golden configs: the flat text of every experiment and of every experiment x mesh
selector whose rule changes it, under `golden_configs/`.

    tools/jaxlearn golden --write     # regenerate after an intended change
    tools/jaxlearn golden             # check: one diff per drifted file (`golden_drift`)
"""

from __future__ import annotations

import os

from jaxlearn.config import diff_flat_texts, to_flat_text
from jaxlearn.experiments.recipes import EXPERIMENTS
from jaxlearn.experiments.remat_fit import planned_host_memory
from jaxlearn.mesh import apply_mesh_rules

# One representative selector per hardware family.
SELECTORS = ("cpu-8", "tpu-v5e-256", "tpu-v5p-512", "tpu-v6e-256", "gpu-h100-8x4",
             "gpu-h200-8x16", "gpu-b200-8x8", "trn2-64")
# The host memory CPU rules that depend on it (`RematToFitModifier`) plan for here, so
# that the files do not depend on the machine that writes or checks them.
GOLDEN_HOST_MEMORY = 16 << 30


def golden_texts() -> dict[str, str]:
    """{file name: flat text}: `<exp>.txt` for the recipe, `<exp>@<selector>.txt` per target."""
    out: dict[str, str] = {}
    with planned_host_memory(GOLDEN_HOST_MEMORY):
        for name, fn in sorted(EXPERIMENTS.items()):
            base = fn()
            out[f"{name}.txt"] = to_flat_text(base)
            for selector in SELECTORS:
                cfg, _ = apply_mesh_rules(base, selector)
                out[f"{name}@{selector}.txt"] = to_flat_text(cfg)
    return out


def write_golden(directory: str) -> list[str]:
    """Writes every golden file (removing stale ones); returns the names written."""
    os.makedirs(directory, exist_ok=True)
    texts = golden_texts()
    for stale in set(os.listdir(directory)) - set(texts):
        if stale.endswith(".txt"):
            os.remove(os.path.join(directory, stale))
    for name, text in texts.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.write(text)
    return sorted(texts)


def golden_drift(directory: str) -> list[str]:
    """One unified diff (golden file -> current config) per golden file in `directory`
    that differs from its current text or is missing."""
    diffs = []
    for name, text in golden_texts().items():
        path = os.path.join(directory, name)
        old = ""
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                old = f.read()
        if old != text:
            diffs.append(diff_flat_texts(old, text, f"golden/{name}", "current"))
    return diffs
