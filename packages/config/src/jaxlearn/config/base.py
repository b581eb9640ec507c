"""Typed, hierarchical config objects.

A config class declares its fields as annotated class attributes::

    class AttentionConfig(ConfigBase):
        num_heads: int = REQUIRED
        head_dim: int = 64
        rope: Optional[ConfigBase] = None

Every instance owns deep copies of its defaults, values are type-checked and deep-copied on
set (no aliasing between configs), unknown fields raise with a did-you-mean suggestion, and
a field left `REQUIRED` raises as soon as it is used as a value.

This module imports no third-party packages (and in particular no jax).
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import types
import typing
from typing import Any, Sequence, TypeVar

from jaxlearn.config.errors import (
    REQUIRED,
    ConfigError,
    ConfigTypeError,
    RequiredFieldError,
    UnknownFieldError,
    suggest,
)
from jaxlearn.config.paths import format_path, join_path, parse_path, with_items
from jaxlearn.config.typecheck import is_classvar, resolve_annotation, type_matches, type_name

T = TypeVar("T", bound="ConfigBase")


class _Field:
    __slots__ = ("name", "default")

    def __init__(self, name: str, default: Any):
        self.name = name
        self.default = default


# Values that are references, not data: shared, never deep-copied.
_ATOMIC = (
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
)


def _copy_value(value: Any) -> Any:
    """A deep copy in which no two places share an object: `[layer] * 4` becomes four
    independent layers, so editing one path never changes another."""
    return _copy_tree(value, set())


def _copy_tree(value: Any, active: set[int]) -> Any:
    if isinstance(value, _ATOMIC):
        return value
    kind = type(value)
    is_dataclass = dataclasses.is_dataclass(value) and not isinstance(value, type)
    if not (isinstance(value, ConfigBase) or kind in (list, dict, tuple) or is_dataclass):
        return copy.deepcopy(value)
    if id(value) in active:
        raise ConfigError(f"A config value contains itself: {type(value).__name__}")
    active.add(id(value))
    try:
        if isinstance(value, ConfigBase):
            new = object.__new__(type(value))
            for name in value._fields:
                object.__setattr__(new, name, _copy_tree(getattr(value, name), active))
            return new
        if kind is list:
            return [_copy_tree(v, active) for v in value]
        if kind is tuple:
            return tuple(_copy_tree(v, active) for v in value)
        if kind is dict:
            return {k: _copy_tree(v, active) for k, v in value.items()}
        new_dc = copy.copy(value)
        for field in dataclasses.fields(value):
            copied = _copy_tree(getattr(value, field.name), active)
            object.__setattr__(new_dc, field.name, copied)  # Works for frozen ones too.
        return new_dc
    finally:
        active.discard(id(value))


def _short_repr(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_not_reserved(cls: type, name: str) -> None:
    for klass in cls.__mro__[1:]:
        if name in vars(klass) and name not in getattr(klass, "_fields", {}):
            raise ConfigError(
                f"{cls.__qualname__}: field '{name}' would shadow {klass.__qualname__}.{name}; "
                "rename the field"
            )


class ConfigBase:
    """Base class of all configs. Subclasses declare fields as annotated class attributes."""

    _fields: dict[str, _Field] = {}
    _hints: dict[str, Any] | None = None
    _defaults_checked: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields: dict[str, _Field] = {}
        for base in reversed(cls.__mro__[1:]):
            fields.update(getattr(base, "_fields", {}))
        # A subclass may change an inherited default without repeating the annotation.
        for name in fields:
            if name in cls.__dict__:
                fields[name] = _Field(name, cls.__dict__[name])
        for name, annotation in cls.__dict__.get("__annotations__", {}).items():
            if name.startswith("_") or is_classvar(annotation):
                continue
            _check_not_reserved(cls, name)
            default = cls.__dict__.get(name, fields[name].default if name in fields else REQUIRED)
            fields[name] = _Field(name, default)
        cls._fields = fields
        cls._hints = None
        cls._defaults_checked = False

    @classmethod
    def _field_hints(cls) -> dict[str, Any]:
        cached = cls.__dict__.get("_hints")
        if cached is not None:
            return cached
        try:
            hints = typing.get_type_hints(cls)
            resolved = True
        except Exception:  # Some forward reference does not resolve: resolve field by field.
            hints, resolved = {}, True
            for klass in reversed(cls.__mro__):
                localns = dict(vars(klass))
                for name, ann in klass.__dict__.get("__annotations__", {}).items():
                    hints[name] = resolve_annotation(ann, klass.__module__, localns)
                    resolved = resolved and not isinstance(hints[name], str)
        if resolved:  # Unresolved names may be defined later: retry next time.
            cls._hints = hints
        return hints

    @classmethod
    def _check_defaults(cls) -> None:
        hints = cls._field_hints()
        for name, field in cls._fields.items():
            hint = hints.get(name, Any)
            if not type_matches(field.default, hint):
                raise ConfigTypeError(
                    f"{cls.__qualname__}.{name}: default {field.default!r} does not match its "
                    f"annotation {type_name(hint)}"
                )
        cls._defaults_checked = True

    def __init__(self, **kwargs: Any):
        if not type(self).__dict__.get("_defaults_checked", True):
            type(self)._check_defaults()
        for name, field in self._fields.items():
            object.__setattr__(self, name, _copy_value(field.default))
        self.set(**kwargs)

    def __deepcopy__(self: T, memo: dict[int, Any]) -> T:
        new: T = _copy_value(self)
        return new

    # ---- field access -----------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._fields:
            raise UnknownFieldError(
                f"{type(self).__qualname__} has no field '{name}'"
                f"{suggest(name, list(self._fields))}; fields: {', '.join(self._fields)}"
            )
        hint = self._field_hints().get(name, Any)
        if not type_matches(value, hint):
            raise ConfigTypeError(
                f"{type(self).__qualname__}.{name} expects {type_name(hint)}, "
                f"got {type(value).__name__} {_short_repr(value)}"
            )
        object.__setattr__(self, name, _copy_value(value))

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails, i.e. for undeclared names.
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnknownFieldError(
            f"{type(self).__qualname__} has no field '{name}'{suggest(name, list(self._fields))}"
        )

    def field_type(self, name: str) -> Any:
        """The annotated type of field `name` (Any if unannotated or unresolvable)."""
        if name not in self._fields:
            raise UnknownFieldError(f"{type(self).__qualname__} has no field '{name}'")
        return self._field_hints().get(name, Any)

    def keys(self) -> list[str]:
        return list(self._fields)

    def items(self) -> list[tuple[str, Any]]:
        return [(k, getattr(self, k)) for k in self._fields]

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other):
            return False
        assert isinstance(other, ConfigBase)
        return self.items() == other.items()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.items())
        return f"{type(self).__qualname__}({body})"

    # ---- mutation -----------------------------------------------------------------------

    def set(self: T, **kwargs: Any) -> T:
        """Sets fields (validated, deep-copied) and returns self, so calls chain."""
        for name, value in kwargs.items():
            setattr(self, name, value)
        return self

    def clone(self: T, **kwargs: Any) -> T:
        """A deep copy with `kwargs` applied; the original is unchanged."""
        new: T = _copy_value(self)
        return new.set(**kwargs)

    def get_recursively(self, path: str | Sequence[str | int]) -> Any:
        """Value at `path`, e.g. 'model.decoder.layers[3].feed_forward' or a key list."""
        keys = parse_path(path) if isinstance(path, str) else list(path)
        node: Any = self
        for i, key in enumerate(keys):
            node = _child(node, key, format_path(keys[: i + 1]))
        return node

    def set_recursively(self, path: str | Sequence[str | int], value: Any) -> None:
        """Sets the value at `path`, validated against the annotation of the config field
        that owns it: `a.layers[2]=x` rebuilds the list and sets `a.layers` (type-checked);
        items of lists, tuples, dicts and dataclasses can all be set this way.
        """
        keys = parse_path(path) if isinstance(path, str) else list(path)
        if not keys:
            raise ConfigError("set_recursively needs a non-empty path")
        where = format_path(keys)
        nodes: list[Any] = [self]
        for i, key in enumerate(keys[:-1]):
            nodes.append(_child(nodes[-1], key, format_path(keys[: i + 1])))
        owner = max(i for i, node in enumerate(nodes) if isinstance(node, ConfigBase))
        new = value
        for i in range(len(keys) - 1, owner, -1):
            new = _with_item(nodes[i], keys[i], new, format_path(keys[: i + 1]))
        cfg, name = nodes[owner], keys[owner]
        if not isinstance(name, str) or name not in cfg._fields:
            raise UnknownFieldError(
                f"Unknown config path '{where}': {type(cfg).__qualname__} has no field "
                f"'{name}'{suggest(str(name), list(cfg._fields))}"
            )
        try:
            setattr(cfg, name, new)
        except ConfigTypeError as e:
            raise ConfigTypeError(f"{where}: {e}") from None

    # ---- validation ---------------------------------------------------------------------

    def missing_fields(self, prefix: str = "", *, into_instantiable: bool = False) -> list[str]:
        """Full paths of every REQUIRED field below this config.

        Sub-configs that are instantiable (children built by their parent, which may still
        fill in shared fields such as dims) are skipped unless `into_instantiable`.
        """
        from jaxlearn.config.traverse import visit

        missing: list[str] = []

        def enter(path: str, value: Any) -> bool:
            if value is REQUIRED:
                missing.append(path)
            if value is not self and not into_instantiable and isinstance(value, ConfigBase):
                from jaxlearn.config.configurable import InstantiableConfig

                if isinstance(value, InstantiableConfig):
                    return True  # Do not descend.
            return False

        visit(self, enter, prefix=prefix)
        return missing

    def _field_problems(self) -> dict[str, str]:
        """{field: what is wrong with its value} for this config alone; subclasses whose
        fields have limits (a positive step count) override it."""
        return {}

    def validate(self, prefix: str = "") -> None:
        """Raises ConfigError naming every field below this config whose value is out of its
        limits (`save_every_n_steps: must be >= 1, got 0`), each with its full path."""
        from jaxlearn.config.traverse import visit

        problems: list[str] = []

        def enter(path: str, value: Any) -> bool:
            if isinstance(value, ConfigBase):
                for name, problem in value._field_problems().items():
                    problems.append(f"{join_path(path, [name])}: {problem}")
            return False

        visit(self, enter, prefix=prefix)
        if problems:
            raise ConfigError("; ".join(problems))

    def check_required(self, prefix: str = "") -> None:
        """Raises RequiredFieldError listing every unset REQUIRED field with its path."""
        missing = self.missing_fields(prefix)
        if missing:
            raise RequiredFieldError(
                f"{type(self).__qualname__}: required field(s) not set: {', '.join(missing)}"
            )


def below_minimum(cfg: ConfigBase, **minimums: float) -> dict[str, str]:
    """{field: problem} for each named numeric field of `cfg` below its minimum (unset
    fields and None are skipped): a building block of `_field_problems`."""
    out: dict[str, str] = {}
    for name, low in minimums.items():
        value = getattr(cfg, name)
        if value is REQUIRED or value is None:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        bad = [v for v in values if isinstance(v, (int, float)) and not v >= low]
        if bad:
            out[name] = f"must be >= {low}, got {value!r}"
    return out


def _child(node: Any, key: str | int, where: str) -> Any:
    """Item `key` of `node`; `where` is the path of that item, for error messages."""
    if isinstance(node, ConfigBase):
        if not isinstance(key, str) or key not in node._fields:
            raise UnknownFieldError(
                f"Unknown config path '{where}': {type(node).__qualname__} has no field "
                f"'{key}'{suggest(str(key), list(node._fields))}"
            )
        return getattr(node, key)
    if isinstance(node, collections.abc.Mapping):
        if key not in node:
            raise UnknownFieldError(
                f"Unknown config path '{where}': no key {key!r}"
                f"{suggest(str(key), [str(k) for k in node])}"
            )
        return node[key]
    if isinstance(node, (list, tuple)) and isinstance(key, int):
        if not -len(node) <= key < len(node):
            raise UnknownFieldError(
                f"Unknown config path '{where}': index {key} out of range (length {len(node)})"
            )
        return node[key]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        names = [f.name for f in dataclasses.fields(node)]
        if key not in names:
            raise UnknownFieldError(
                f"Unknown config path '{where}': {type(node).__qualname__} has no field "
                f"'{key}'{suggest(str(key), names)}"
            )
        return getattr(node, str(key))
    raise UnknownFieldError(f"Unknown config path '{where}': cannot index a {type(node).__name__}")


def _with_item(container: Any, key: Any, value: Any, where: str) -> Any:
    """A copy of `container` with item `key` set to `value` (containers never change in
    place, so a failed type check leaves the config untouched)."""
    if not isinstance(container, collections.abc.MutableMapping):
        _child(container, key, where)  # Index / field check with a readable error.
    try:
        return with_items(container, {key: value})
    except TypeError:
        raise ConfigError(f"Cannot set '{where}': parent is a {type(container).__name__}") from None


__all__ = [
    "REQUIRED",
    "ConfigBase",
    "below_minimum",
    "ConfigError",
    "ConfigTypeError",
    "RequiredFieldError",
    "UnknownFieldError",
    "format_path",
    "parse_path",
    "suggest",
    "type_matches",
]
