"""jaxlearn.module: modules, invocation contexts, parameters and the functional entry point.

See packages/module/README.md.
"""

from jaxlearn.module.context import (
    InvocationContext,
    ModuleError,
    OutputCollection,
    child_key,
    current_context,
    fold_in_name,
    iter_collection,
    side_input,
    stable_hash,
)
from jaxlearn.module.functional import functional, merge_state_updates
from jaxlearn.module.module import Module
from jaxlearn.module.param import (
    Constant,
    FanAxes,
    Initializer,
    Normal,
    ParameterSpec,
    VarianceScaling,
    flatten_specs,
    is_spec,
    keypath_str,
    ones,
    stack_spec,
    zeros,
)
from jaxlearn.module.remat import RematSpec, policy_from_name, remat, tag
from jaxlearn.module.scan import scan_child
from jaxlearn.module.sharding import (
    abstract_parameters,
    logical_partition_spec,
    logical_sharding,
    parameter_shardings,
    spec_tree_map,
    with_logical_constraint,
)

__all__ = [
    "Constant",
    "FanAxes",
    "Initializer",
    "InvocationContext",
    "Module",
    "ModuleError",
    "Normal",
    "OutputCollection",
    "ParameterSpec",
    "RematSpec",
    "VarianceScaling",
    "abstract_parameters",
    "child_key",
    "current_context",
    "flatten_specs",
    "fold_in_name",
    "functional",
    "is_spec",
    "iter_collection",
    "keypath_str",
    "logical_partition_spec",
    "logical_sharding",
    "merge_state_updates",
    "ones",
    "parameter_shardings",
    "policy_from_name",
    "remat",
    "scan_child",
    "side_input",
    "spec_tree_map",
    "stable_hash",
    "stack_spec",
    "tag",
    "with_logical_constraint",
    "zeros",
]
