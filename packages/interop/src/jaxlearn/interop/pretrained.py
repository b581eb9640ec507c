"""`load_pretrained(path)`: one entry point for every checkpoint format.

- a directory with `config.json` -> HF transformers checkpoint (`jaxlearn.interop.hf`);
- a `*.gguf` file -> GGUF (`jaxlearn.interop.gguf`);
- a jaxlearn checkpoint directory -> not handled here: `jaxlearn.inference` owns that
  loader (its config comes from a recipe, its params from `jaxlearn.checkpoint`).
"""

from __future__ import annotations

import pathlib
from typing import Any

from jaxlearn.interop.errors import InteropError, MalformedFileError
from jaxlearn.interop.model import LoadedModel
from jaxlearn.interop.source import model_kind
from jaxlearn.text import errors as text_errors


class JaxlearnCheckpointError(InteropError):
    """`load_pretrained` was given a jaxlearn checkpoint directory; those are loaded by
    `jaxlearn.inference` (config from the recipe + params from `jaxlearn.checkpoint`)."""


def load_pretrained(path: str | pathlib.Path, **kwargs: Any) -> LoadedModel:
    """Loads an HF model directory or a GGUF file into a `LoadedModel`.

    kwargs go to `load_hf` / `load_gguf` (stack, dtype, param_dtype,
    attention_implementation, moe_dropless_method).

    Files are untrusted: headers, sizes and layer tensors are validated before anything is
    allocated (`jaxlearn.text.gguf_file`, `checks`, `hf_config`), and every failure is an
    InteropError whose message names the file (a `jaxlearn.text` error, whose message
    names the file and key, becomes a MalformedFileError with that message). A
    value error that a malformed file provokes deeper in the stack (numpy, tokenizers)
    becomes a one-line `MalformedFileError` naming `path`.
    """
    p = pathlib.Path(path)
    try:
        return _load(p, **kwargs)
    except InteropError:
        raise
    except text_errors.TextError as e:
        raise MalformedFileError(" ".join(str(e).split())) from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, UnicodeError) as e:
        what = " ".join(str(e).split())[:500]
        raise MalformedFileError(f"{p}: cannot be loaded ({type(e).__name__}: {what})") from None


def _load(p: pathlib.Path, **kwargs: Any) -> LoadedModel:
    kind, target = model_kind(p)
    if kind == "gguf":
        from jaxlearn.interop.gguf import load_gguf

        return load_gguf(target, **kwargs)
    if kind == "hf":
        from jaxlearn.interop.hf import load_hf

        return load_hf(target, **kwargs)
    raise JaxlearnCheckpointError(
        f"{p}: a jaxlearn run or checkpoint directory; load it with jaxlearn.inference "
        f"(its config comes from the run record), not jaxlearn.interop.load_pretrained")
