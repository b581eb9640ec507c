"""Configs rebuilt from their flat text form: `from_flat_text(to_flat_text(cfg))`.

    klass: jaxlearn.runtime.trainer.Trainer          -> Trainer.default_config()
    learner.klass: jaxlearn.runtime.learner.Learner  -> its default config, set at `learner`
    learner.learning_rate: 0.0003                    -> parsed for the field's annotation
    mesh_rules[0][0]: 'tpu-v5e-.*'                   -> lists/tuples/dicts built by path

A `klass:`/`fn:` line names the configurable whose `default_config()` (or signature-derived
config, for plain classes and functions) is built at that path; every other line is parsed
as the typed value of its field (`parse_value`). Only modules under `importable` prefixes
are ever imported, so a file cannot make the reader import or call arbitrary code.

The text does not name the class of a dataclass held in an `Any` field whose default is
not one (`mesh_shape: HybridMeshShape`): it comes back as a dict of its fields, which
prints the same and which the fields that hold such values accept.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from typing import Any, Optional, Sequence, Union

from jaxlearn.config.base import ConfigBase, ConfigError
from jaxlearn.config.configurable import (
    InstantiableConfig,
    config_for_class,
    config_for_function,
)
from jaxlearn.config.overrides import import_dotted, parse_value
from jaxlearn.config.paths import format_path, parse_path
from jaxlearn.config.typecheck import element_hint

# Module prefixes a flat text may name: jaxlearn itself and the stdlib/optax callables
# that configs hold.
IMPORTABLE = ("jaxlearn.", "optax.", "math.", "operator.")


class FlatTextError(ConfigError):
    """A flat text that does not describe a config (the message names the line)."""


@dataclasses.dataclass
class _Node:
    """The lines below one path: a leaf value, or children keyed by field/index/key."""

    keys: list[Any]
    leaf: Optional[tuple[int, str]] = None  # (line number, value text)
    children: dict[Any, "_Node"] = dataclasses.field(default_factory=dict)

    @property
    def path(self) -> str:
        return format_path(self.keys) or "<root>"

    def first_line(self) -> int:
        if self.leaf is not None:
            return self.leaf[0]
        return min(child.first_line() for child in self.children.values())


def _split_line(line: str) -> tuple[str, str]:
    """`path: value` split at the first ': ' outside a quoted key; ('', '') if none."""
    quote, escaped = "", False
    for i, ch in enumerate(line):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif line.startswith(": ", i):
            return line[:i], line[i + 2 :]
    return "", ""


def _parse_tree(text: str, where: str) -> _Node:
    root = _Node([])
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        path, value = _split_line(line)
        if not path:
            raise FlatTextError(f"{where} line {lineno}: expected 'path: value', got {line!r:.80}")
        try:
            keys = parse_path(path)
        except ConfigError as e:
            raise FlatTextError(f"{where} line {lineno}: {e}") from None
        node = root
        for i, key in enumerate(keys):
            node = node.children.setdefault(key, _Node(keys[: i + 1]))
        if node.leaf is not None:
            raise FlatTextError(f"{where} line {lineno}: '{path}' repeats line {node.leaf[0]}")
        node.leaf = (lineno, value)
    return root


def from_flat_text(
    text: str, *, importable: Sequence[str] = IMPORTABLE, where: str = "flat text"
) -> ConfigBase:
    """Rebuilds the config tree whose `to_flat_text` is `text`.

    The root needs a `klass:` (or `fn:`) line. Unknown fields, malformed values, paths
    that name no config, and classes outside `importable` raise FlatTextError naming the
    line (`where` names the source, e.g. a file path).
    """
    root = _parse_tree(text, where)
    if "klass" not in root.children and "fn" not in root.children:
        raise FlatTextError(f"{where}: no root 'klass:' or 'fn:' line, so the config class "
                            "is unknown")
    return _Builder(tuple(importable), where).config(root, None)


class _Builder:
    def __init__(self, importable: tuple[str, ...], where: str):
        self.importable = importable
        self.where = where

    def _at(self, node: _Node, line: Optional[int] = None) -> str:
        return f"{self.where} line {line or node.first_line()} ({node.path})"

    def value(self, node: _Node, existing: Any, hint: Any) -> Any:
        """The value described by `node`; `existing` is what the default config holds."""
        if node.leaf is not None:
            if node.children:
                raise FlatTextError(f"{self._at(node)}: is both a value and a container")
            lineno, text = node.leaf
            try:
                return parse_value(text, hint, where=self._at(node, lineno),
                                   importable=self.importable)
            except FlatTextError:
                raise
            except ConfigError as e:
                raise FlatTextError(str(e)) from None
        if "klass" in node.children or "fn" in node.children:
            return self.config(node, existing)
        if isinstance(existing, ConfigBase):
            return self.fill(existing, node)
        config_class = _config_class(hint)
        if config_class is not None:
            return self.fill(config_class(), node)
        keys = list(node.children)
        if all(isinstance(k, int) for k in keys):
            return self.sequence(node, existing, hint)
        if dataclasses.is_dataclass(existing) and not isinstance(existing, type):
            return self.dataclass(node, existing)
        if isinstance(existing, dict) or _origin_in(hint, collections.abc.Mapping) or \
                hint is Any:
            old = existing if isinstance(existing, dict) else {}
            return {k: self.value(child, old.get(k), element_hint(hint, k))
                    for k, child in node.children.items()}
        raise FlatTextError(f"{self._at(node)}: names no config, list, dict or dataclass "
                            "(a sub-config needs its 'klass:' line)")

    def config(self, node: _Node, existing: Any) -> ConfigBase:
        """A sub-config from its `klass:`/`fn:` line, then its other fields."""
        name = "klass" if "klass" in node.children else "fn"
        target_node = node.children[name]
        if target_node.leaf is None:
            raise FlatTextError(f"{self._at(target_node)}: must be a dotted import path")
        lineno, text = target_node.leaf
        at = self._at(target_node, lineno)
        try:
            target = import_dotted(text.strip(), self.importable, where=at)
        except (ImportError, AttributeError) as e:
            raise FlatTextError(f"{at}: cannot import {text.strip()!r} ({e})") from None
        except ConfigError as e:
            raise FlatTextError(str(e)) from None
        if isinstance(existing, ConfigBase) and name in existing and \
                getattr(existing, name) is target:
            cfg = existing
        elif name == "fn":
            cfg = config_for_function(target)
        elif isinstance(target, type) and callable(getattr(target, "default_config", None)):
            cfg = getattr(target, "default_config")()
        elif isinstance(target, type):
            cfg = config_for_class(target)
        else:
            raise FlatTextError(f"{at}: {text.strip()!r} is not a class")
        if not isinstance(cfg, ConfigBase):
            raise FlatTextError(f"{at}: {text.strip()}.default_config() is not a config")
        return self.fill(cfg, node)

    def fill(self, cfg: ConfigBase, node: _Node) -> ConfigBase:
        for key, child in node.children.items():
            if not isinstance(key, str) or key not in cfg:
                raise FlatTextError(
                    f"{self._at(child)}: {type(cfg).__qualname__} has no field {key!r}; "
                    f"fields: {', '.join(cfg.keys())}"
                )
            value = self.value(child, getattr(cfg, key), cfg.field_type(key))
            try:
                setattr(cfg, key, value)
            except ConfigError as e:
                raise FlatTextError(f"{self._at(child)}: {e}") from None
        return cfg

    def sequence(self, node: _Node, existing: Any, hint: Any) -> Any:
        n = max(node.children) + 1
        missing = sorted(set(range(n)) - set(node.children))
        if missing or min(node.children) < 0:
            raise FlatTextError(f"{self._at(node)}: items {missing or sorted(node.children)} "
                                f"are missing or negative; a list needs every index 0..{n - 1}")
        old = existing if isinstance(existing, (list, tuple)) else ()
        items = [self.value(node.children[i], old[i] if i < len(old) else None,
                            element_hint(hint, i)) for i in range(n)]
        if isinstance(existing, tuple) or (
            not isinstance(existing, list) and _origin_in(hint, tuple)
        ):
            return tuple(items)
        return items

    def dataclass(self, node: _Node, existing: Any) -> Any:
        names = {f.name for f in dataclasses.fields(existing)}
        changes = {}
        for key, child in node.children.items():
            if key not in names:
                raise FlatTextError(f"{self._at(child)}: {type(existing).__qualname__} has no "
                                    f"field {key!r}")
            changes[key] = self.value(child, getattr(existing, key), Any)
        return dataclasses.replace(existing, **changes)


def _alternatives(hint: Any) -> list[Any]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return [a for a in typing.get_args(hint) if a is not type(None)]
    return [hint]


def _config_class(hint: Any) -> Optional[type[ConfigBase]]:
    """The one plain ConfigBase subclass `hint` names (Optional included), if any;
    instantiable configs are built from their `klass:`/`fn:` line instead."""
    found = [a for a in _alternatives(hint) if isinstance(a, type) and issubclass(a, ConfigBase)]
    if len(found) != 1 or issubclass(found[0], InstantiableConfig):
        return None
    return found[0]


def _origin_in(hint: Any, kind: type) -> bool:
    for alt in _alternatives(hint):
        origin = typing.get_origin(alt) or alt
        if isinstance(origin, type) and issubclass(origin, kind):
            return True
    return False


__all__ = ["IMPORTABLE", "FlatTextError", "from_flat_text"]
