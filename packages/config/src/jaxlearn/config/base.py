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
import difflib
import re
import types
import typing
from typing import Any, Sequence, TypeVar, Union

T = TypeVar("T", bound="ConfigBase")


class ConfigError(ValueError):
    """Base class of every error raised by jaxlearn.config."""


class RequiredFieldError(ConfigError):
    """A REQUIRED field was used or instantiated before it was set."""


class UnknownFieldError(ConfigError, AttributeError):
    """A field name (or path) that the config does not declare."""


class ConfigTypeError(ConfigError, TypeError):
    """A value that does not match the field's annotated type."""


class _Required:
    """Sentinel for fields that must be set before use. Any use as a value raises."""

    _instance: "_Required | None" = None

    def __new__(cls) -> "_Required":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REQUIRED"

    def __copy__(self) -> "_Required":
        return self

    def __deepcopy__(self, memo: dict) -> "_Required":
        return self

    def __reduce__(self) -> str:
        return "REQUIRED"

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise RequiredFieldError(
            "A REQUIRED config field was used before it was set; set it on the config "
            "(cfg.set(...), or --set path=value) before instantiating."
        )

    __bool__ = __int__ = __float__ = __index__ = __len__ = __iter__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _fail
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __pow__ = _fail
    __lt__ = __le__ = __gt__ = __ge__ = __neg__ = __getitem__ = __call__ = _fail


REQUIRED: Any = _Required()


def suggest(name: str, candidates: Sequence[str]) -> str:
    """Returns ' (did you mean: x?)' for the closest candidate, or ''."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean: {close[0]}?)" if close else ""


class _Field:
    __slots__ = ("name", "default")

    def __init__(self, name: str, default: Any):
        self.name = name
        self.default = default


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def type_matches(value: Any, hint: Any) -> bool:
    """Whether `value` conforms to the annotation `hint` (shallow for containers)."""
    if value is REQUIRED or hint is Any or hint is None and value is None:
        return True
    if isinstance(hint, (str, TypeVar, typing.ForwardRef)):
        return True  # Unresolvable annotation: accept rather than guess.
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        return any(type_matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if origin is type:
        return isinstance(value, type) and (
            not args or not isinstance(args[0], type) or issubclass(value, args[0])
        )
    if origin in (collections.abc.Callable,) or hint is collections.abc.Callable:
        return callable(value)
    if origin is not None:
        if not isinstance(origin, type) or not isinstance(value, origin):
            return False
        if origin is tuple and args:
            if len(args) == 2 and args[1] is Ellipsis:
                return all(type_matches(v, args[0]) for v in value)
            return len(args) == len(value) and all(
                type_matches(v, a) for v, a in zip(value, args)
            )
        if issubclass(origin, collections.abc.Mapping) and len(args) == 2:
            return all(
                type_matches(k, args[0]) and type_matches(v, args[1]) for k, v in value.items()
            )
        if issubclass(origin, collections.abc.Iterable) and len(args) == 1:
            return all(type_matches(v, args[0]) for v in value)
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        try:
            return isinstance(value, hint)
        except TypeError:
            return True
    return True


def _copy_value(value: Any) -> Any:
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)):
        return value
    return copy.deepcopy(value)


class ConfigBase:
    """Base class of all configs. Subclasses declare fields as annotated class attributes."""

    _fields: dict[str, _Field] = {}
    _hints: dict[str, Any] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields: dict[str, _Field] = {}
        for base in reversed(cls.__mro__[1:]):
            fields.update(getattr(base, "_fields", {}))
        for name in cls.__dict__.get("__annotations__", {}):
            if name.startswith("_"):
                continue
            default = cls.__dict__.get(name, fields[name].default if name in fields else REQUIRED)
            fields[name] = _Field(name, default)
        cls._fields = fields
        cls._hints = None

    @classmethod
    def _field_hints(cls) -> dict[str, Any]:
        if cls.__dict__.get("_hints") is None:
            try:
                hints = typing.get_type_hints(cls)
            except Exception:  # Forward references that cannot be resolved: check per field.
                hints = {}
                for klass in reversed(cls.__mro__):
                    for name, ann in klass.__dict__.get("__annotations__", {}).items():
                        hints[name] = ann
            cls._hints = hints
        return cls._hints  # type: ignore[return-value]

    def __init__(self, **kwargs: Any):
        for name, field in self._fields.items():
            object.__setattr__(self, name, _copy_value(field.default))
        self.set(**kwargs)

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
                f"{type(self).__qualname__}.{name} expects {_type_name(hint)}, "
                f"got {type(value).__name__} {value!r}"
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
        return type(self) is type(other) and self.items() == other.items()  # type: ignore[attr-defined]

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
        return copy.deepcopy(self).set(**kwargs)

    def get_recursively(self, path: str | Sequence[str | int]) -> Any:
        """Value at `path`, e.g. 'model.decoder.layers[3].feed_forward' or a key list."""
        keys = parse_path(path) if isinstance(path, str) else list(path)
        node: Any = self
        for i, key in enumerate(keys):
            node = _child(node, key, keys[: i + 1])
        return node

    def set_recursively(self, path: str | Sequence[str | int], value: Any) -> None:
        """Sets the field at `path` (validated against the owning config's annotation)."""
        keys = parse_path(path) if isinstance(path, str) else list(path)
        if not keys:
            raise ConfigError("set_recursively needs a non-empty path")
        parent = self.get_recursively(keys[:-1]) if len(keys) > 1 else self
        last = keys[-1]
        where = format_path(keys)
        if isinstance(parent, ConfigBase):
            if not isinstance(last, str) or last not in parent._fields:
                raise UnknownFieldError(
                    f"Unknown config path '{where}': {type(parent).__qualname__} has no field "
                    f"'{last}'{suggest(str(last), list(parent._fields))}"
                )
            try:
                setattr(parent, last, value)
            except ConfigTypeError as e:
                raise ConfigTypeError(f"{where}: {e}") from None
        elif isinstance(parent, collections.abc.MutableMapping):
            parent[last] = _copy_value(value)
        elif isinstance(parent, list) and isinstance(last, int):
            parent[last] = _copy_value(value)
        else:
            raise ConfigError(f"Cannot set '{where}': parent is a {type(parent).__name__}")

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
            if path and not into_instantiable and isinstance(value, ConfigBase):
                from jaxlearn.config.configurable import InstantiableConfig

                if isinstance(value, InstantiableConfig):
                    return True  # Do not descend.
            return False

        visit(self, enter, prefix=prefix)
        return missing

    def check_required(self, prefix: str = "") -> None:
        """Raises RequiredFieldError listing every unset REQUIRED field with its path."""
        missing = self.missing_fields(prefix)
        if missing:
            raise RequiredFieldError(
                f"{type(self).__qualname__}: required field(s) not set: {', '.join(missing)}"
            )


_PATH_TOKEN = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)|\[(-?\d+)\]|\[('[^']*'|\"[^\"]*\")\]")


def parse_path(path: str) -> list[str | int]:
    """'a.b[3].c' -> ['a', 'b', 3, 'c']; "d['x y']" -> ['d', 'x y']."""
    keys: list[str | int] = []
    pos = 0
    while pos < len(path):
        m = _PATH_TOKEN.match(path, pos)
        if not m or (pos == 0 and path.startswith(".")):
            raise ConfigError(f"Malformed config path '{path}' at position {pos}")
        name, index, quoted = m.groups()
        keys.append(name if name is not None else int(index) if index is not None else quoted[1:-1])
        pos = m.end()
    return keys


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def format_path(keys: Sequence[Any]) -> str:
    out = ""
    for key in keys:
        if isinstance(key, int):
            out += f"[{key}]"
        elif isinstance(key, str) and _IDENT.match(key):
            out += f".{key}" if out else key
        else:
            out += f"[{str(key)!r}]"
    return out


def _child(node: Any, key: str | int, keys_so_far: Sequence[Any]) -> Any:
    where = format_path(keys_so_far)
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
            raise UnknownFieldError(f"Unknown config path '{where}': index out of range")
        return node[key]
    raise UnknownFieldError(f"Unknown config path '{where}': cannot index a {type(node).__name__}")


__all__ = [
    "REQUIRED",
    "ConfigBase",
    "ConfigError",
    "ConfigTypeError",
    "RequiredFieldError",
    "UnknownFieldError",
    "format_path",
    "parse_path",
    "suggest",
    "type_matches",
]
