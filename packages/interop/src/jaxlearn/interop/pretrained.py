"""`load_pretrained(path)`: one entry point for every checkpoint format.

- a directory with `config.json` -> HF transformers checkpoint (`jaxlearn.interop.hf`);
- a `*.gguf` file -> GGUF (`jaxlearn.interop.gguf`);
- a jaxlearn run -> not handled here: `open_model(path)` gives its recorded model config,
  tokenizer and params (`ModelSource`).

Which of them a path is, is `open_model`'s to say (`jaxlearn.interop.model_source`).
"""

from __future__ import annotations

import pathlib
from typing import Any, cast

from jaxlearn.interop.errors import InteropError
from jaxlearn.interop.model import LoadedModel
from jaxlearn.interop.model_source import open_model


class JaxlearnCheckpointError(InteropError):
    """`load_pretrained` was given a jaxlearn run or checkpoint directory; those are read
    by `open_model` (config from the run record, params from `jaxlearn.checkpoint`)."""


def load_pretrained(path: str | pathlib.Path, **kwargs: Any) -> LoadedModel:
    """Loads an HF model directory or a GGUF file into a `LoadedModel`
    (`open_model(path).load_host(**kwargs)`).

    kwargs go to `load_hf` / `load_gguf` (stack, dtype, param_dtype,
    attention_implementation, moe_dropless_method).

    Files are untrusted: headers, sizes and layer tensors are validated before anything is
    allocated (`jaxlearn.text.gguf_file`, `checks`, `hf_config`), and every failure is an
    InteropError whose message names the file (a `jaxlearn.text` error, whose message
    names the file and key, becomes a MalformedFileError with that message). A
    value error that a malformed file provokes deeper in the stack (numpy, tokenizers)
    becomes a one-line `MalformedFileError` naming `path` (`model_source.guard`).
    """
    source = open_model(path)
    if source.kind == "jaxlearn":
        raise JaxlearnCheckpointError(
            f"{path}: a jaxlearn run or checkpoint directory; load it with "
            "jaxlearn.interop.open_model (its config comes from the run record), not "
            "load_pretrained")
    return cast(LoadedModel, source.load_host(**kwargs))
