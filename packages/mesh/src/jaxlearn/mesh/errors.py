"""Exception types of jaxlearn.mesh. Every one is a ValueError, so callers may catch broadly."""

from __future__ import annotations


class MeshError(ValueError):
    """Base class of every error raised by jaxlearn.mesh."""


class MeshShapeError(MeshError):
    """A mesh shape that cannot be built: bad sizes, several -1, not dividing the devices."""


class AxisRulesError(MeshError):
    """Malformed logical->physical axis rules, or a logical axis name the rules do not know."""


class MeshRuleError(MeshError):
    """No mesh rule matched a selector, a rule is malformed, or a config modifier failed."""


class UnknownHardwareError(MeshError):
    """A mesh selector or device kind that the hardware catalogue does not know."""


__all__ = ["AxisRulesError", "MeshError", "MeshRuleError", "MeshShapeError", "UnknownHardwareError"]
