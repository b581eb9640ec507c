"""Traversal of config trees and rewriting by predicate.

`visit` walks configs, lists, tuples, dicts and dataclasses in a stable order (declaration
order for config fields and dataclass fields, insertion order for dicts), calling
`enter(path, value)` before and `exit(path, value)` after each node. Paths look like
`model.decoder.layers[3].feed_forward`.

`replace_config` swaps every sub-config that matches (by class, by path regex, or by a
predicate) for a new one, carrying over the fields both share. It is how one recipe line
turns every FFN into a mixture of experts.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional

from jaxlearn.config.base import REQUIRED, ConfigBase, ConfigError, format_path

EnterFn = Callable[[str, Any], Optional[bool]]
ExitFn = Callable[[str, Any], None]


def children(value: Any) -> list[tuple[Any, Any]]:
    """(key, child) pairs of a container node, or [] for a leaf."""
    if isinstance(value, ConfigBase):
        return list(value.items())
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, (list, tuple)):
        return list(enumerate(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    return []


def is_container(value: Any) -> bool:
    return isinstance(value, (ConfigBase, dict, list, tuple)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    )


def visit(
    tree: Any,
    enter: Optional[EnterFn] = None,
    exit: Optional[ExitFn] = None,
    *,
    prefix: str = "",
) -> None:
    """Depth-first traversal. If `enter` returns True the node's children are skipped."""

    def rec(keys: list[Any], value: Any) -> None:
        path = _join(prefix, keys)
        if enter is not None and enter(path, value):
            return
        for key, child in children(value):
            rec(keys + [key], child)
        if exit is not None:
            exit(path, value)

    rec([], tree)


def _join(prefix: str, keys: list[Any]) -> str:
    rest = format_path(keys)
    if not prefix:
        return rest
    if not rest:
        return prefix
    return prefix + rest if rest.startswith("[") else f"{prefix}.{rest}"


def leaves(tree: Any) -> list[tuple[str, Any]]:
    """Every (path, leaf) pair; empty containers count as leaves."""
    out: list[tuple[str, Any]] = []

    def enter(path: str, value: Any) -> bool:
        if not is_container(value) or not children(value):
            out.append((path, value))
            return True
        return False

    visit(tree, enter)
    return out


Matcher = Any  # a config class, a Configurable class, a path regex str, or fn(path, cfg)->bool
Replacement = Any  # a config (cloned per match) or fn(old_cfg, path) -> new cfg


def _matches(match: Matcher, path: str, cfg: ConfigBase) -> bool:
    if isinstance(match, str):
        return re.fullmatch(match, path) is not None
    if isinstance(match, type):
        if issubclass(match, ConfigBase):
            return isinstance(cfg, match)
        klass = cfg.klass if "klass" in cfg else None
        return isinstance(klass, type) and issubclass(klass, match)
    return bool(match(path, cfg))


def carry_over_fields(old: ConfigBase, new: ConfigBase, exclude: tuple[str, ...] = ()) -> None:
    """Copies into `new` every field it shares with `old` that `old` has set."""
    for name, value in old.items():
        if name in ("klass", "fn") or name in exclude or name not in new or value is REQUIRED:
            continue
        new.set(**{name: value})


def replace_config(
    root: ConfigBase,
    match: Matcher,
    replacement: Replacement,
    *,
    carry_over: bool = True,
    exclude: tuple[str, ...] = (),
    allow_no_match: bool = False,
) -> ConfigBase:
    """Returns a copy of `root` with every matching sub-config replaced.

    Args:
        root: the config tree (not modified).
        match: a config class (isinstance), a Configurable class (the config's `klass` is a
            subclass), a regex that must fully match the path (e.g. r'.*layers\\[\\d*[02468]\\]
            \\.feed_forward'), or a predicate `fn(path, cfg) -> bool`.
        replacement: a config (cloned for each match) or `fn(old_cfg, path) -> new_cfg`.
        carry_over: copy fields shared by the old and new config (e.g. `input_dim`,
            `hidden_dim`) from the old one, except those in `exclude`.
        allow_no_match: if False (default), matching nothing raises ConfigError, because a
            rewrite that silently does nothing is almost always a typo.

    Matched configs are not searched further, so a replacement that contains a config of
    the matched kind (MoE wrapping an FFN) is not rewritten again.
    """
    new_root = root.clone()
    count = 0

    def rewrite(path: str, value: Any) -> Any:
        nonlocal count
        if isinstance(value, ConfigBase) and path and _matches(match, path, value):
            new = replacement(value, path) if callable(replacement) and not isinstance(
                replacement, ConfigBase
            ) else replacement.clone()
            if not isinstance(new, ConfigBase):
                raise ConfigError(f"replace_config: replacement for '{path}' is not a config")
            if carry_over:
                carry_over_fields(value, new, exclude)
            count += 1
            return new
        for key, child in children(value):
            sub = _join(path, [key])
            new_child = rewrite(sub, child)
            if new_child is not child:
                _assign(value, key, new_child)
        return value

    rewrite("", new_root)
    if count == 0 and not allow_no_match:
        raise ConfigError(f"replace_config: nothing in the tree matched {match!r}")
    return new_root


def _assign(container: Any, key: Any, value: Any) -> None:
    if isinstance(container, ConfigBase):
        object.__setattr__(container, key, value)  # Already validated by the replacement.
    elif isinstance(container, (dict, list)):
        container[key] = value
    elif dataclasses.is_dataclass(container):
        object.__setattr__(container, key, value)
    else:
        raise ConfigError(f"Cannot replace inside an immutable {type(container).__name__}")
