"""The registry of model families: name -> `Family` (one module each), and the lookups
by HF config.json (`model_type`, else `architectures`) and by GGUF
`general.architecture`.

    from jaxlearn.families.registry import FAMILIES, family, family_of_gguf, family_of_hf
    FAMILIES["qwen3"].hf_class                     # "Qwen3ForCausalLM"

Adding a family: one module with a `Family` subclass and its instance, and one line in
`_ALL` below.
"""

from __future__ import annotations

from typing import Any

from jaxlearn.families.errors import UnsupportedModelError
from jaxlearn.families.family import Family
from jaxlearn.families.gemma import GEMMA2, GEMMA3
from jaxlearn.families.llama import LLAMA, MISTRAL
from jaxlearn.families.mixtral import MIXTRAL
from jaxlearn.families.phi3 import PHI3
from jaxlearn.families.qwen import QWEN2, QWEN3
from jaxlearn.families.qwen3_moe import QWEN3_MOE

_ALL = (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE, PHI3, GEMMA2, GEMMA3)
FAMILIES: dict[str, Family] = {f.name: f for f in _ALL}
HF_CLASSES = {f.name: f.hf_class for f in _ALL}
_BY_HF = {key: f for f in _ALL for key in (f.name, f.hf_class, *f.hf_names)}
_BY_GGUF = {key: f for f in _ALL for key in f.gguf_reads}
GGUF_ARCHITECTURES = tuple(_BY_GGUF)


def family(arch: Any) -> Family:
    """The family of an `Architecture` (its name table, HF class, ...)."""
    if arch.family not in FAMILIES:
        raise UnsupportedModelError(f"architecture family {arch.family!r} has no name table")
    return FAMILIES[arch.family]


def family_of_hf(hf: dict[str, Any], where: str) -> Family:
    """The family of a config.json dict: by `model_type`, else by its `architectures`."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    key = model_type if model_type is not None else next(iter(archs), None)
    if not isinstance(key, str) or key not in _BY_HF:
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} ({archs}) is not supported; "
            f"supported: {sorted(HF_CLASSES)}"
        )
    return _BY_HF[key]


def family_of_gguf(arch_name: Any, where: str) -> Family:
    """The family that reads GGUF files of `general.architecture` `arch_name` (which may
    resolve a file to another family: `Family.gguf_family`)."""
    if not isinstance(arch_name, str) or arch_name not in _BY_GGUF:
        raise UnsupportedModelError(
            f"{where}: general.architecture {arch_name!r} is not supported "
            f"({GGUF_ARCHITECTURES})"
        )
    return _BY_GGUF[arch_name]
