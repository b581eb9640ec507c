"""The AOT matrix and the launch fit check by recipe name: `jaxlearn.aot.matrix` and
`jaxlearn.aot.fit` work on a final config's flat text and an explicit matrix file; here a
recipe, mesh selector and `--set` overrides become that config (`build.build_config`).

    entry = lookup(path, "llama2-7b", "gpu-h100-8x4", [])       # fresh entry or None
    entry = run(path, "llama2-7b", "gpu-h100-8x4", [], argv)     # compile (argv) + record
    text = render(path)                                         # the Markdown page
    verdict = check_fit("llama2-7b", "gpu-h100-8x4", [], cache_dir=..., matrix=path)
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from jaxlearn.aot import fit, matrix
from jaxlearn.config import to_flat_text
from jaxlearn.experiments.build import BuildError, build_config
from jaxlearn.experiments.golden import SELECTORS
from jaxlearn.experiments.recipes import REAL_SIZE


def config_text(experiment: str, selector: str, overrides: Sequence[str]) -> str:
    """The final config's flat text (BuildError for an unknown recipe or bad override)."""
    return to_flat_text(build_config(experiment, selector, overrides))


def digest(experiment: str, selector: str, overrides: Sequence[str]) -> str:
    """`matrix.config_digest` of the pair's final config."""
    return matrix.config_digest(config_text(experiment, selector, overrides), selector)


def lookup(path: str, experiment: str, selector: str, overrides: Sequence[str]
           ) -> Optional[dict[str, Any]]:
    """The pair's entry in the matrix at `path` while it matches the current config."""
    return matrix.lookup(path, matrix.entry_key(experiment, selector, overrides),
                         digest(experiment, selector, overrides))


def run(path: str, experiment: str, selector: str, overrides: Sequence[str],
        argv: Sequence[str]) -> dict[str, Any]:
    """Compiles the pair with `argv` (its `jaxlearn aot --json` command line) and records
    the result in the matrix at `path`."""
    return matrix.compile_and_record(path, argv, experiment, selector, overrides,
                                     digest(experiment, selector, overrides))


def is_fresh(entry: dict[str, Any]) -> bool:
    """Whether a recorded entry's digest matches its recipe's current config (a recipe that
    no longer builds is stale)."""
    try:
        now = digest(entry["experiment"], entry["selector"], entry.get("overrides", []))
    except BuildError:
        return False
    return bool(entry.get("digest") == now)


def default_pairs() -> list[tuple[str, str]]:
    """Every real-size recipe x every accelerator golden selector (`tools/aot_matrix.sh`)."""
    return [(r, s) for r in REAL_SIZE for s in SELECTORS if not s.startswith("cpu")]


def render(path: str) -> str:
    """The matrix at `path` as a Markdown page (stale rows marked, missing pairs listed)."""
    return matrix.render(path, is_fresh, [f"{r}@{s}" for r, s in default_pairs()])


def check_fit(experiment: str, selector: str, overrides: Sequence[str], *, cache_dir: str,
              matrix_path: Optional[str] = None, aot: bool = False) -> fit.Verdict:
    """`fit.check_fit` of the pair's final config: the fresh entry of the matrix at
    `matrix_path` (None: no matrix; an unreadable one is ignored) when there is one, else
    the floor (or with `aot` the compiled step), cached in `cache_dir`."""
    text = config_text(experiment, selector, overrides)
    entry = None
    if matrix_path is not None:
        try:
            entry = matrix.lookup(matrix_path, matrix.entry_key(experiment, selector, overrides),
                                  matrix.config_digest(text, selector))
        except (OSError, ValueError):  # An unreadable matrix file: the other checks answer.
            entry = None
    return fit.check_fit(text, selector, cache_dir=cache_dir, aot=aot, matrix_entry=entry)


__all__ = ["check_fit", "config_text", "default_pairs", "digest", "is_fresh", "lookup",
           "render", "run"]
