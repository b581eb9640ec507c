"""Runtime checks of values against field annotations (no third-party imports)."""

from __future__ import annotations

import collections.abc
import re
import sys
import types
import typing
from typing import Any, TypeVar, Union

from jaxlearn.config.errors import REQUIRED

_CLASSVAR_TEXT = re.compile(r"^\s*(typing\.)?ClassVar\b")


def is_unresolved(hint: Any) -> bool:
    """Whether `hint` is an annotation that could not be turned into a type."""
    return isinstance(hint, (str, TypeVar, typing.ForwardRef))


def is_classvar(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return _CLASSVAR_TEXT.match(annotation) is not None
    return annotation is typing.ClassVar or typing.get_origin(annotation) is typing.ClassVar


def resolve_annotation(annotation: Any, module: str, localns: dict[str, Any]) -> Any:
    """Evaluates one (string) annotation in `module`; returns it unchanged if it cannot."""
    if not isinstance(annotation, str):
        return annotation
    mod = sys.modules.get(module)
    globalns = dict(vars(mod)) if mod is not None else {}
    holder = types.SimpleNamespace(__annotations__={"x": annotation})
    try:
        return typing.get_type_hints(holder, globalns=globalns, localns=localns)["x"]
    except Exception:  # A forward reference that does not resolve (yet): accept any value.
        return annotation


def type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def type_matches(value: Any, hint: Any) -> bool:
    """Whether `value` conforms to the annotation `hint` (containers are checked per item)."""
    if value is REQUIRED or hint is Any:
        return True
    if is_unresolved(hint):
        return True  # Unresolvable annotation: accept rather than guess.
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        return any(type_matches(value, a) for a in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin is type:
        return isinstance(value, type) and (
            not args or not isinstance(args[0], type) or issubclass(value, args[0])
        )
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return callable(value)
    if origin is not None:
        return _generic_matches(value, origin, args)
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


def _generic_matches(obj: object, origin: Any, args: tuple[Any, ...]) -> bool:
    if not isinstance(origin, type) or not isinstance(obj, origin):
        return False
    value: Any = obj
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return all(type_matches(v, args[0]) for v in value)
        if args == ((),):  # tuple[()]
            return len(value) == 0
        return len(args) == len(value) and all(type_matches(v, a) for v, a in zip(value, args))
    if issubclass(origin, collections.abc.Mapping) and len(args) == 2:
        return all(type_matches(k, args[0]) and type_matches(v, args[1]) for k, v in value.items())
    if issubclass(origin, collections.abc.Iterable) and len(args) == 1:
        return all(type_matches(v, args[0]) for v in value)
    return True


def element_hint(hint: Any, key: Any) -> Any:
    """The annotation of item `key` inside a container annotated `hint` (Any if unknown)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        inner = [element_hint(a, key) for a in args if a is not type(None)]
        return inner[0] if len(inner) == 1 else Any
    if origin is None or not isinstance(origin, type):
        return Any
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
        return args[key] if isinstance(key, int) and -len(args) <= key < len(args) else Any
    if issubclass(origin, collections.abc.Mapping) and len(args) == 2:
        return args[1]
    if issubclass(origin, collections.abc.Sequence) and len(args) == 1:
        return args[0]
    return Any
