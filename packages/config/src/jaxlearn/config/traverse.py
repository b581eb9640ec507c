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

from jaxlearn.config.base import REQUIRED, ConfigBase, ConfigError, ConfigTypeError
from jaxlearn.config.paths import join_path, with_items

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
    """Depth-first traversal of `tree`, paths prefixed by `prefix`.

    `enter(path, value)` runs before a node's children and `exit(path, value)` after them,
    for every node (leaves included), so the two always pair up. If `enter` returns True,
    the node's children are skipped (its `exit` still runs).
    """

    def rec(keys: list[Any], value: Any) -> None:
        path = join_path(prefix, keys)
        if enter is None or not enter(path, value):
            for key, child in children(value):
                rec(keys + [key], child)
        if exit is not None:
            exit(path, value)

    rec([], tree)


def is_literal_sequence(value: Any) -> bool:
    """A list/tuple of None/bool/int/float/str (or of such sequences), e.g. a mesh shape."""
    if not isinstance(value, (list, tuple)) or type(value) not in (list, tuple):
        return False
    return all(
        v is None or type(v) in (bool, int, float, str) or is_literal_sequence(v) for v in value
    )


def leaves(tree: Any, *, literal_sequences: bool = False) -> list[tuple[str, Any]]:
    """Every (path, leaf) pair; empty containers count as leaves. With
    `literal_sequences`, a list/tuple of literals is one leaf (`mesh_shape: (1, -1, 1)`)."""
    out: list[tuple[str, Any]] = []

    def enter(path: str, value: Any) -> bool:
        if (
            not is_container(value)
            or not children(value)
            or (literal_sequences and is_literal_sequence(value))
        ):
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


def carry_over_fields(
    old: ConfigBase, new: ConfigBase, exclude: tuple[str, ...] = (), *, keep_set: bool = True
) -> None:
    """Copies into `new` every field it shares with `old` that `old` has set.

    `klass`/`fn` and the names in `exclude` are never copied. With `keep_set` (default), a
    field that `new` already sets to something other than its class default keeps its
    value: what the replacement states explicitly wins over what is carried over.
    """
    for name, value in old.items():
        if name in ("klass", "fn") or name in exclude or name not in new or value is REQUIRED:
            continue
        if keep_set and not _at_default(new, name):
            continue
        new.set(**{name: value})


def _at_default(cfg: ConfigBase, name: str) -> bool:
    value, default = getattr(cfg, name), type(cfg)._fields[name].default
    if value is REQUIRED or default is REQUIRED:
        return value is default
    try:
        return bool(type(value) is type(default) and value == default)
    except Exception:  # e.g. arrays, whose == is elementwise
        return False


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
        replacement: a config (cloned for each match), a Configurable class (its
            `default_config()`), or `fn(old_cfg, path) -> new_cfg`.
        carry_over: copy fields shared by the old and new config (e.g. `input_dim`,
            `hidden_dim`) from the old one, except those in `exclude` and those the
            replacement sets to a non-default value (see `carry_over_fields`).
        allow_no_match: if False (default), matching nothing raises ConfigError, because a
            rewrite that silently does nothing is almost always a typo.

    Matched configs are not searched further, so a replacement that contains a config of
    the matched kind (MoE wrapping an FFN) is not rewritten again. The root itself is never
    matched. Replacements are set through the parent's fields, so they must fit the
    parent's annotation (annotate swappable children as e.g. `InstantiableConfig`).
    """
    new_root = root.clone()
    count = 0

    def rewrite(path: str, value: Any) -> Any:
        nonlocal count
        if isinstance(value, ConfigBase) and path and _matches(match, path, value):
            count += 1
            return _replacement_for(value, path, replacement, carry_over, exclude)
        changed = {}
        for key, child in children(value):
            new_child = rewrite(join_path(path, [key]), child)
            if new_child is not child:
                changed[key] = new_child
        return _rebuilt(value, changed, path) if changed else value

    rewrite("", new_root)
    if count == 0 and not allow_no_match:
        raise ConfigError(f"replace_config: nothing in the tree matched {match!r}")
    return new_root


def _replacement_for(
    old: ConfigBase,
    path: str,
    replacement: Replacement,
    carry_over: bool,
    exclude: tuple[str, ...],
) -> ConfigBase:
    new: Any
    if isinstance(replacement, ConfigBase):
        new = replacement.clone()
    elif isinstance(replacement, type) and hasattr(replacement, "default_config"):
        new = replacement.default_config()  # A Configurable class.
    elif callable(replacement):
        new = replacement(old, path)
        if isinstance(new, ConfigBase) and new is not old:
            new = new.clone()  # The callable may return one shared config for every match.
    else:
        raise ConfigError(
            f"replace_config: replacement must be a config, a Configurable class or a "
            f"callable, got {replacement!r}"
        )
    if not isinstance(new, ConfigBase):
        raise ConfigError(f"replace_config: replacement for '{path}' is not a config: {new!r}")
    if carry_over and new is not old:
        try:
            carry_over_fields(old, new, exclude)
        except ConfigTypeError as e:
            raise ConfigTypeError(f"replace_config: carrying fields to '{path}': {e}") from None
    return new


def _rebuilt(container: Any, changed: dict[Any, Any], path: str) -> Any:
    """`container` with the items in `changed` replaced; configs are set in place (validated
    against the field annotations), other containers are copied."""
    if not isinstance(container, ConfigBase):
        try:
            return with_items(container, changed)
        except TypeError:
            raise ConfigError(f"replace_config: cannot rebuild '{path}'") from None
    for key, value in changed.items():
        try:
            setattr(container, key, value)
        except ConfigTypeError as e:
            raise ConfigTypeError(f"replace_config: at '{join_path(path, [key])}': {e}") from None
    return container
