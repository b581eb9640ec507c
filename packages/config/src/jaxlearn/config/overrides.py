"""Overrides from strings: `model.decoder.transformer.num_layers=4`.

Values are parsed with `ast.literal_eval` (never `eval`). A field annotated `str` takes the
raw text when it is not a string literal; a field annotated with a class or callable takes
a dotted import path (`pkg.module.Name`), which is imported, not evaluated; a field that
holds a config takes a Configurable class's path and gets its default config
(`input.source=jaxlearn.runtime.data.TextFilesSource`). Every line of
the flat text form (`to_flat_text`) is itself a valid override.
"""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import enum
import importlib
import re
import types
import typing
from typing import Any, Iterable, Optional, Sequence, Union

from jaxlearn.config.base import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    ConfigTypeError,
    UnknownFieldError,
    parse_path,
)
from jaxlearn.config.typecheck import element_hint, is_unresolved, type_matches, type_name

_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")


class OverrideError(ConfigError):
    """A malformed or invalid `path=value` override."""


def _accepts_raw_text(text: str, hint: Any) -> bool:
    return hint is not Any and not is_unresolved(hint) and type_matches(text, hint)


def _accepts_objects(hint: Any) -> bool:
    """Whether a field annotated `hint` may hold classes, callables or other objects that
    only a dotted import path can name (as opposed to literals only)."""
    if hint is Any or is_unresolved(hint) or hint is type or hint is collections.abc.Callable:
        return True
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        return any(_accepts_objects(a) for a in typing.get_args(hint))
    if origin in (type, collections.abc.Callable):
        return True
    return isinstance(hint, type) and origin is None and hint not in _LITERAL_TYPES


_LITERAL_TYPES = (int, float, complex, str, bytes, bool, list, tuple, dict, set, type(None))
_FLOAT_WORDS = {"nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}


def _enum_member(text: str, hint: Any) -> Any:
    """`RED` for a field annotated with an Enum (or Optional of one) -> the member."""
    candidates = [hint]
    if typing.get_origin(hint) in (Union, types.UnionType):
        candidates = list(typing.get_args(hint))
    for klass in candidates:
        if isinstance(klass, type) and issubclass(klass, enum.Enum) and text in klass.__members__:
            return klass.__members__[text]
    return _NOT_LITERAL


def _allowed(name: str, importable: Optional[Sequence[str]]) -> bool:
    return importable is None or any(name.startswith(p) or name == p.rstrip(".")
                                     for p in importable)


def import_dotted(text: str, importable: Optional[Sequence[str]] = None,
                  where: str = "") -> Any:
    """The object a dotted path (`pkg.module.Name`) names. With `importable` (module-name
    prefixes such as `"jaxlearn."`), a path outside them is never imported, and an object
    found under an allowed module but defined elsewhere (`jaxlearn.x.os.system`) is refused.
    Raises ImportError/AttributeError for paths that do not resolve."""
    if not _allowed(text, importable):
        raise OverrideError(
            f"{where}: {text!r} is outside the importable modules "
            f"({', '.join(importable or ())}); refusing to import it"
        )
    obj = _import_dotted(text)
    if importable is None:
        return obj
    module: Any
    if isinstance(obj, types.ModuleType):
        module = obj.__name__
    elif isinstance(obj, enum.Enum):
        module = type(obj).__module__
    else:
        module = getattr(obj, "__module__", None)
    if not (isinstance(module, str) and _allowed(module + ".", importable)):
        raise OverrideError(
            f"{where}: {text!r} resolves to an object defined in {module!r}, outside the "
            f"importable modules ({', '.join(importable)}); refusing it"
        )
    return obj


def _import_dotted(text: str) -> Any:
    module_name, _, attr = text.rpartition(".")
    while module_name:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module_name, _, head = module_name.rpartition(".")
            attr = f"{head}.{attr}"
            continue
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    raise ImportError(text)


def parse_value(
    text: str, hint: Any = Any, where: str = "", importable: Optional[Sequence[str]] = None
) -> Any:
    """Parses the text of an override for a field annotated `hint`.

    In order: a Python literal (`ast.literal_eval`, never `eval`) that fits `hint`; `nan`
    and `inf` for float fields; an enum member's name for enum fields; the raw text for
    fields that accept `str`; a dotted import path for fields that hold classes, callables
    or other objects (a Configurable class, for a field that holds configs, gives its
    `default_config()`) (with `importable`, only under those module prefixes; see
    `import_dotted`).
    """
    text = text.strip()
    if text == "REQUIRED":  # As the flat form prints it; quote it to mean the string.
        return REQUIRED
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        value = _NOT_LITERAL
    if value is not _NOT_LITERAL and type_matches(value, hint):
        return value
    if text.lower() in _FLOAT_WORDS and type_matches(float("nan"), hint):
        return float(text)
    member = _enum_member(text, hint)
    if member is not _NOT_LITERAL:
        return member
    if _accepts_raw_text(text, hint):
        return text
    if _DOTTED.match(text) and _accepts_objects(hint):
        try:
            obj = import_dotted(text, importable, where)
        except (ImportError, AttributeError):
            obj = _NOT_LITERAL
        if obj is not _NOT_LITERAL and type_matches(obj, hint):
            return obj
        default = _default_config_of(obj, hint)
        if default is not None:
            return default
        if obj is not _NOT_LITERAL:
            value = obj
    shown = type_name(hint)
    if value is _NOT_LITERAL:
        raise OverrideError(
            f"{where}: cannot parse {text!r} as a Python literal (expected {shown}; quote "
            "strings, and name classes or functions by an importable dotted path)"
        )
    raise ConfigTypeError(f"{where}: expects {shown}, got {type(value).__name__} {text!r}")


_NOT_LITERAL = object()


def _default_config_of(obj: Any, hint: Any) -> Any:
    """`obj.default_config()` when `obj` is a Configurable class and a field annotated `hint`
    holds configs (`input.source=jaxlearn.runtime.data.TextFilesSource`); else None."""
    make = getattr(obj, "default_config", None) if isinstance(obj, type) else None
    if not callable(make):
        return None
    cfg = make()
    return cfg if isinstance(cfg, ConfigBase) and type_matches(cfg, hint) else None


def _assignment_index(override: str) -> int:
    """Index of the `=` that ends the path (not one inside a quoted `['a=b']` key)."""
    quote = ""
    for i, ch in enumerate(override):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "=":
            return i
    return -1


def _dataclass_hints(klass: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(klass)
    except Exception:
        return {}


def apply_override(cfg: ConfigBase, override: str) -> None:
    """Applies one `path=value` override in place (type-checked against the field)."""
    split = _assignment_index(override)
    if split < 0:
        raise OverrideError(f"Override {override!r} is not of the form path=value")
    path, text = override[:split].strip(), override[split + 1 :]
    keys = parse_path(path)
    if not keys:
        raise OverrideError(f"Override {override!r} has an empty path")
    # Walk to the parent, tracking the annotation that governs each step.
    node: Any = cfg
    hint: Any = Any
    for i, key in enumerate(keys):
        if isinstance(node, ConfigBase):
            if not isinstance(key, str) or key not in node:
                cfg.set_recursively(keys[: i + 1], None)  # Raises the did-you-mean error.
            assert isinstance(key, str)
            hint = node.field_type(key)
        elif dataclasses.is_dataclass(node):
            hint = _dataclass_hints(type(node)).get(str(key), Any)
        else:
            hint = element_hint(hint, key)
        if i < len(keys) - 1:
            node = cfg.get_recursively(keys[: i + 1])
    cfg.set_recursively(keys, parse_value(text, hint, where=path))


def apply_overrides(cfg: ConfigBase, overrides: Iterable[str]) -> ConfigBase:
    """Applies `path=value` overrides in order (in place); returns `cfg`."""
    for override in overrides:
        try:
            apply_override(cfg, override)
        except UnknownFieldError as e:
            raise UnknownFieldError(f"--set {override}: {e}") from None
        except ConfigError as e:
            raise type(e)(f"--set {override}: {e}") from None
    return cfg
