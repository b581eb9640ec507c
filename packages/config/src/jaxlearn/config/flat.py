"""The flat text form: one sorted `path: value` line per leaf.

It is deterministic across runs and machines (no object ids, no hash order), so it is
the basis of golden configs and of `config-diff`.
"""

from __future__ import annotations

import difflib
import enum
import functools
import re
import types
from typing import Any

from jaxlearn.config.base import ConfigError
from jaxlearn.config.traverse import leaves


def format_value(value: Any, path: str = "") -> str:
    """A deterministic, human-readable rendering of a leaf value."""
    if isinstance(value, enum.Enum):  # An importable dotted path, so overrides can use it.
        return f"{type(value).__module__}.{type(value).__qualname__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, (set, frozenset)):  # Hash order differs between runs: sort.
        items = ", ".join(sorted(format_value(v, path) for v in value))
        body = f"{{{items}}}" if value else ""
        if not isinstance(value, frozenset):
            return body or "set()"
        return f"{type(value).__name__}({body})"
    if isinstance(value, functools.partial):
        args = [format_value(a, path) for a in value.args]
        args += [f"{k}={format_value(v, path)}" for k, v in sorted(value.keywords.items())]
        return f"partial({format_value(value.func, path)}{''.join(', ' + a for a in args)})"
    owner = getattr(value, "__self__", None)
    if isinstance(value, (types.MethodType, types.BuiltinMethodType)) and not isinstance(
        owner, (type, types.ModuleType, type(None))
    ):
        raise ConfigError(
            f"{path or 'value'}: the bound method {value!r} has no deterministic text form; "
            "use a function, a class, or a config instead"
        )
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)) or (
        hasattr(value, "__qualname__") and hasattr(value, "__module__") and callable(value)
    ):
        return f"{value.__module__}.{value.__qualname__}"
    if type(value).__module__.startswith("numpy") and type(value).__name__.endswith("DType"):
        return f"dtype:{value.name}"  # numpy dtype objects
    if isinstance(value, (list, tuple, dict)) and not value:
        return repr(value)
    text = repr(value)
    if " at 0x" in text:
        raise ConfigError(
            f"{path or 'value'}: {type(value).__qualname__} has no deterministic text form "
            f"({text}); use a config, a function, or a literal instead"
        )
    return text


def path_sort_key(path: str) -> tuple[Any, ...]:
    """Natural order of paths: `layers[2]` sorts before `layers[10]`."""
    parts = re.split(r"(\d+)", path)
    return tuple((int(p), p) if i % 2 else p for i, p in enumerate(parts))


def to_flat_dict(cfg: Any) -> dict[str, str]:
    """{path: formatted value} for every leaf, in natural path order (`path_sort_key`).
    Lists/tuples of plain literals print on one line as their repr."""
    out: dict[str, str] = {}
    items = leaves(cfg, literal_sequences=True)
    for path, value in sorted(items, key=lambda kv: path_sort_key(kv[0])):
        if path in out:
            raise ConfigError(f"Two leaves share the path '{path}' (dict keys that format alike)")
        out[path] = format_value(value, path)
    return out


def to_flat_text(cfg: Any) -> str:
    """The golden form: `path: value` lines in natural path order, newline-terminated."""
    return "".join(f"{k}: {v}\n" for k, v in to_flat_dict(cfg).items())


def diff_flat_texts(a: str, b: str, name_a: str = "a", name_b: str = "b") -> str:
    """A unified diff of two flat texts ('' when equal)."""
    return "".join(
        difflib.unified_diff(
            a.splitlines(keepends=True), b.splitlines(keepends=True), name_a, name_b, n=0
        )
    )


def diff_configs(a: Any, b: Any) -> str:
    """Changed, added and removed paths between two configs, one per line.

    ~ model.decoder.transformer.num_layers: 2 -> 4
    + model.decoder.layer.feed_forward.num_experts: 8
    - model.decoder.layer.feed_forward.hidden_dim: 1376
    """
    fa, fb = to_flat_dict(a), to_flat_dict(b)
    lines = []
    for path in sorted(set(fa) | set(fb)):
        if path not in fb:
            lines.append(f"- {path}: {fa[path]}")
        elif path not in fa:
            lines.append(f"+ {path}: {fb[path]}")
        elif fa[path] != fb[path]:
            lines.append(f"~ {path}: {fa[path]} -> {fb[path]}")
    return "\n".join(lines)
