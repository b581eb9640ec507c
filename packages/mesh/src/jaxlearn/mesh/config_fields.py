"""The mesh fields a trainer (or server) config exposes, as a mixin, and building its mesh.

`jaxlearn.runtime` declares its trainer config with these fields at the root, e.g.
`class Config(SomeBase.Config, MeshFieldsConfig)`, so that mesh rules, `--set` overrides
and golden files use the same paths everywhere:

    mesh_shape: (1, -1, 1, 1, 1, 1)          # or a HybridMeshShape
    mesh_axis_names: ('pipeline', 'data', 'fsdp', 'expert', 'seq', 'model')
    mesh_axis_rules: (('batch', ('data', 'fsdp', 'expert')), ...)
    mesh_rules: (('tpu-v5p-.*', ...), ...)
    mesh_selector: 'cpu-8'                   # recorded by apply_mesh_rules
    mesh_rule: 'cpu-.*'                      # recorded by apply_mesh_rules
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from jax.sharding import Mesh

from jaxlearn.config import REQUIRED, ConfigBase
from jaxlearn.mesh.axis_rules import DEFAULT_AXIS_RULES
from jaxlearn.mesh.mesh_shape import DEFAULT_AXIS_NAMES, make_mesh


class MeshFieldsConfig(ConfigBase):
    """Root-level mesh fields of a trainer/server config."""

    mesh_shape: Any = REQUIRED  # tuple[int, ...] | HybridMeshShape, aligned with axis names
    mesh_axis_names: tuple[str, ...] = DEFAULT_AXIS_NAMES
    mesh_axis_rules: Sequence[tuple[str, Any]] = DEFAULT_AXIS_RULES
    mesh_rules: Sequence[tuple[str, Any]] = ()
    mesh_selector: Optional[str] = None
    mesh_rule: Optional[str] = None


def mesh_from_config(cfg: ConfigBase, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """`make_mesh(cfg.mesh_shape, cfg.mesh_axis_names, devices)`."""
    return make_mesh(cfg.mesh_shape, cfg.mesh_axis_names, devices)


__all__ = ["MeshFieldsConfig", "mesh_from_config"]
