"""jaxlearn.families: what a model family is, independent of the file it comes from.

    from jaxlearn.families import architecture_from_hf, build_config
    arch = architecture_from_hf(config_json_dict)   # checked; one-line errors
    cfg = build_config(arch, stack="scan")          # CausalLM.Config
    arch = architecture_from_config(cfg)            # and back (refuses what HF can't express)

See packages/families/README.md. File formats (safetensors, GGUF) are `jaxlearn.interop`.
"""

from jaxlearn.families.arch import (
    FAMILIES,
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
from jaxlearn.families.hf_config import HF_CLASSES, architecture_from_hf, hf_config_dict

__all__ = [
    "FAMILIES",
    "HF_CLASSES",
    "Architecture",
    "InteropError",
    "MalformedFileError",
    "ParameterMismatchError",
    "UnsupportedModelError",
    "architecture_from_config",
    "architecture_from_hf",
    "build_config",
    "hf_config_dict",
    "layer_configs",
]
