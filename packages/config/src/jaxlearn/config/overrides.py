"""Overrides from strings: `model.decoder.num_layers=4`.

Values are parsed with `ast.literal_eval` (never `eval`). A field annotated `str` takes the
raw text when it is not a string literal; a field annotated with a class or callable takes
a dotted import path (`pkg.module.Name`), which is imported, not evaluated.
"""

from __future__ import annotations

import ast
import importlib
import re
import typing
from typing import Any, Iterable

from jaxlearn.config.base import (
    ConfigBase,
    ConfigError,
    ConfigTypeError,
    UnknownFieldError,
    parse_path,
    type_matches,
)

_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")


class OverrideError(ConfigError):
    """A malformed or invalid `path=value` override."""


def _accepts_str(hint: Any) -> bool:
    return type_matches("x", hint) and hint is not Any


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


def parse_value(text: str, hint: Any = Any, where: str = "") -> Any:
    """Parses the text of an override for a field annotated `hint`."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = _NOT_LITERAL
    if value is not _NOT_LITERAL and type_matches(value, hint):
        return value
    if _accepts_str(hint) and type_matches(text, hint):
        return text
    if _DOTTED.match(text.strip()) and typing.get_origin(hint) is not typing.Literal:
        try:
            obj = _import_dotted(text.strip())
        except (ImportError, AttributeError):
            obj = _NOT_LITERAL
        if obj is not _NOT_LITERAL and type_matches(obj, hint):
            return obj
    if value is _NOT_LITERAL:
        raise OverrideError(f"{where}: cannot parse {text!r} as a Python literal")
    raise ConfigTypeError(
        f"{where}: expects {getattr(hint, '__name__', hint)}, got {type(value).__name__} {text!r}"
    )


_NOT_LITERAL = object()


def apply_override(cfg: ConfigBase, override: str) -> None:
    """Applies one `path=value` override in place."""
    if "=" not in override:
        raise OverrideError(f"Override {override!r} is not of the form path=value")
    path, _, text = override.partition("=")
    path = path.strip()
    keys = parse_path(path)
    parent = cfg.get_recursively(keys[:-1]) if len(keys) > 1 else cfg
    hint: Any = Any
    if isinstance(parent, ConfigBase):
        if not isinstance(keys[-1], str) or keys[-1] not in parent:
            # Let set_recursively produce the did-you-mean error.
            cfg.set_recursively(keys, None)
        hint = parent.field_type(str(keys[-1]))
    value = parse_value(text.strip(), hint, where=path)
    cfg.set_recursively(keys, value)


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
