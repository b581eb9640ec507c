"""jaxlearn.config: typed hierarchical configs. Imports no jax.

See packages/config/README.md for the public API and the "every FFN becomes MoE" example.
"""

from jaxlearn.config.base import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    ConfigTypeError,
    RequiredFieldError,
    UnknownFieldError,
    below_minimum,
    format_path,
    parse_path,
)
from jaxlearn.config.configurable import (
    ClassConfigBase,
    Configurable,
    FunctionConfigBase,
    InstantiableConfig,
    config_for_class,
    config_for_function,
)
from jaxlearn.config.flat import (
    diff_configs,
    diff_flat_texts,
    format_value,
    path_sort_key,
    to_flat_dict,
    to_flat_text,
)
from jaxlearn.config.overrides import (
    OverrideError,
    apply_override,
    apply_overrides,
    import_dotted,
    parse_value,
)
from jaxlearn.config.rebuild import IMPORTABLE, FlatTextError, from_flat_text
from jaxlearn.config.traverse import carry_over_fields, leaves, replace_config, visit

__all__ = [
    "REQUIRED",
    "ClassConfigBase",
    "ConfigBase",
    "ConfigError",
    "ConfigTypeError",
    "Configurable",
    "FlatTextError",
    "FunctionConfigBase",
    "IMPORTABLE",
    "InstantiableConfig",
    "OverrideError",
    "RequiredFieldError",
    "UnknownFieldError",
    "apply_override",
    "apply_overrides",
    "below_minimum",
    "carry_over_fields",
    "config_for_class",
    "config_for_function",
    "diff_configs",
    "diff_flat_texts",
    "format_path",
    "format_value",
    "from_flat_text",
    "import_dotted",
    "leaves",
    "parse_path",
    "parse_value",
    "path_sort_key",
    "replace_config",
    "to_flat_dict",
    "to_flat_text",
    "visit",
]
