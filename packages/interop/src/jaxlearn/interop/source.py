"""What kind of model a path holds: the one place that tells an HF directory, a GGUF file
and a jaxlearn run apart (`model_kind`), for `load_pretrained` and the CLI's
`--init_from` / `--model`.

- a `*.gguf` file, or a directory holding exactly one -> "gguf" (that file);
- a directory with `config.json` -> "hf";
- a run's output dir (`run.json`), its `checkpoints/` dir or one step dir
  (`jaxlearn.checkpoint.locate`) -> "jaxlearn".
"""

from __future__ import annotations

import pathlib
from typing import Union

from jaxlearn.checkpoint import is_checkpoint
from jaxlearn.interop.errors import InteropError

RUN_RECORD_FILE = "run.json"  # jaxlearn.runtime.record.RECORD_FILE (runtime is not a dependency)


def model_kind(path: Union[str, pathlib.Path]) -> tuple[str, pathlib.Path]:
    """("hf" | "gguf" | "jaxlearn", the path to load) of `path`; an InteropError naming
    `path` when it is none of them."""
    p = pathlib.Path(path)
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return "gguf", p
        raise InteropError(f"{p}: a file that is not .gguf; expected a GGUF file or a directory")
    if not p.is_dir():
        raise InteropError(f"{p}: no such file or directory")
    if (p / "config.json").exists():
        return "hf", p
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if (p / RUN_RECORD_FILE).is_file() or is_checkpoint(p):
        return "jaxlearn", p
    raise InteropError(
        f"{p}: neither an HF model directory (no config.json), a GGUF file ({len(ggufs)} "
        f"*.gguf files here) nor a jaxlearn run (no run.json, no checkpoint steps)")


__all__ = ["model_kind"]
