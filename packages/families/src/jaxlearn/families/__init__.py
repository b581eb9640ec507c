"""jaxlearn.families: what a model family is, independent of the file it comes from.

    from jaxlearn.families import architecture_from_hf, build_config
    arch = architecture_from_hf(config_json_dict)   # checked; one-line errors
    cfg = build_config(arch, stack="scan")          # CausalLM.Config
    arch = architecture_from_config(cfg)            # and back, through cfg.family
    FAMILIES["qwen3"]                                # a Family: everything Qwen3 is

See packages/families/README.md. File formats (safetensors, GGUF) are `jaxlearn.interop`.
"""

from jaxlearn.families.arch import (
    Architecture,
    architecture_from_config,
    build_config,
    layer_configs,
)
from jaxlearn.families.errors import (
    InteropError,
    MalformedFileError,
    ParameterMismatchError,
    UnsupportedModelError,
)
from jaxlearn.families.family import Family
from jaxlearn.families.hf_config import architecture_from_hf, hf_config_dict
from jaxlearn.families.registry import FAMILIES, HF_CLASSES, family_of_gguf, family_of_hf

__all__ = [
    "FAMILIES",
    "HF_CLASSES",
    "Architecture",
    "Family",
    "InteropError",
    "MalformedFileError",
    "ParameterMismatchError",
    "UnsupportedModelError",
    "architecture_from_config",
    "architecture_from_hf",
    "build_config",
    "family_of_gguf",
    "family_of_hf",
    "hf_config_dict",
    "layer_configs",
]
