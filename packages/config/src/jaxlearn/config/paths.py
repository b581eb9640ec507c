"""Config paths: `model.decoder.layers[3].feed_forward` <-> ['model', 'decoder', ...]."""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import re
from typing import Any, Sequence

from jaxlearn.config.errors import ConfigError

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
        if isinstance(key, int) and not isinstance(key, bool):
            out += f"[{key}]"
        elif isinstance(key, str) and _IDENT.match(key):
            out += f".{key}" if out else key
        else:
            out += f"[{str(key)!r}]"
    return out


def join_path(prefix: str, keys: Sequence[Any]) -> str:
    """`prefix` followed by the path of `keys`: ('model', ['a', 0]) -> 'model.a[0]'."""
    rest = format_path(keys)
    if not prefix:
        return rest
    if not rest:
        return prefix
    return prefix + rest if rest.startswith("[") else f"{prefix}.{rest}"


def with_items(container: Any, changed: dict[Any, Any]) -> Any:
    """A shallow copy of a dict, list, tuple, namedtuple or dataclass instance with the
    items in `changed` replaced. Raises TypeError for any other kind of container."""
    if isinstance(container, collections.abc.MutableMapping):
        new_map = copy.copy(container)
        new_map.update(changed)
        return new_map
    if isinstance(container, (list, tuple)):
        items = list(container)
        for key, value in changed.items():
            items[key] = value
        if isinstance(container, list):
            new_list = copy.copy(container)
            new_list[:] = items
            return new_list
        if hasattr(container, "_make"):  # namedtuple
            return type(container)._make(items)
        return type(container)(items)
    if dataclasses.is_dataclass(container) and not isinstance(container, type):
        new_dc = copy.copy(container)
        for key, value in changed.items():
            object.__setattr__(new_dc, key, value)  # Works for frozen dataclasses too.
        return new_dc
    raise TypeError(f"cannot rebuild a {type(container).__name__}")
