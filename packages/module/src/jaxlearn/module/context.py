"""The invocation context: what a module call sees while it runs.

A context holds the module being called, its state (the parameter subtree of that module),
a PRNG key, `is_training`, and an output collection (summaries, state updates, module
outputs). Contexts form a stack per thread; calling a child module pushes a child context
whose state is the child's subtree and whose key is `fold_in(parent_key, crc32(name))`.

The root context (`functional(..., side_inputs=...)`) may also carry side inputs: per-call
values any module of the call reads by name (`side_input`) without every method on the
way taking them as an argument (e.g. the per-row adapter slots of a serving call, read by
`layers.MultiLoraLinear`).
"""

from __future__ import annotations

import dataclasses
import threading
import zlib
from typing import TYPE_CHECKING, Any, Iterator, Optional, overload

import jax

if TYPE_CHECKING:
    from jaxlearn.module.module import Module

Nested = dict[str, Any]


class ModuleError(RuntimeError):
    """Misuse of the module system (calls outside a context, repeated child calls, ...)."""


def stable_hash(name: str) -> int:
    """A process-independent 31-bit hash of `name` (Python's hash() is salted)."""
    return zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


@overload
def fold_in_name(key: jax.Array, name: str) -> jax.Array: ...


@overload
def fold_in_name(key: None, name: str) -> None: ...


def fold_in_name(key: Optional[jax.Array], name: str) -> Optional[jax.Array]:
    """`fold_in(key, stable_hash(name))`; None stays None (calls without randomness)."""
    return None if key is None else jax.random.fold_in(key, stable_hash(name))


def labelled_name(name: str, label: str = "") -> str:
    """Where a call's outputs are recorded: `name`, or `name@label` for a labelled call
    (`invoke_child`, `scan_child(label=...)`), so repeated calls never collide."""
    return f"{name}@{label}" if label else name


@overload
def child_key(key: jax.Array, name: str, method: str = ..., label: str = ...) -> jax.Array: ...


@overload
def child_key(key: None, name: str, method: str = ..., label: str = ...) -> None: ...


def child_key(
    key: Optional[jax.Array], name: str, method: str = "forward", label: str = ""
) -> Optional[jax.Array]:
    """The key of a call to child `name`: folded with the name, then with the method name
    unless it is `forward`, then with `label` if given (`invoke_child`). Two different
    calls into one child therefore never share random bits."""
    key = fold_in_name(key, name)
    if method != "forward":
        key = fold_in_name(key, method)
    if label:
        key = fold_in_name(key, label)
    return key


@dataclasses.dataclass
class OutputCollection:
    """Outputs recorded during a call, each a nested dict keyed by child name.

    summaries: scalars/histograms for TensorBoard.
    state_updates: new values for non-trainable state (e.g. batch statistics, KV caches).
    module_outputs: auxiliary values (e.g. MoE `aux_loss`) that ancestors may collect.
    """

    summaries: Nested = dataclasses.field(default_factory=dict)
    state_updates: Nested = dataclasses.field(default_factory=dict)
    module_outputs: Nested = dataclasses.field(default_factory=dict)

    def child(self, name: str) -> "OutputCollection":
        """The sub-collection of child `name` (created on first use, shared thereafter)."""
        return OutputCollection(
            summaries=self.summaries.setdefault(name, {}),
            state_updates=self.state_updates.setdefault(name, {}),
            module_outputs=self.module_outputs.setdefault(name, {}),
        )


jax.tree_util.register_dataclass(
    OutputCollection, data_fields=["summaries", "state_updates", "module_outputs"], meta_fields=[]
)


@dataclasses.dataclass
class InvocationContext:
    """One frame of a module call. Created by `functional` and by child calls."""

    name: str
    parent: Optional["InvocationContext"]
    module: "Module"
    state: Nested
    output_collection: OutputCollection
    is_training: bool
    prng_key: Optional[jax.Array]
    _calls: set = dataclasses.field(default_factory=set)
    # Only the root's are read (`side_input`); children reach them through `parent`.
    side_inputs: Nested = dataclasses.field(default_factory=dict)

    def path(self) -> str:
        names = []
        ctx: Optional[InvocationContext] = self
        while ctx is not None:
            names.append(ctx.name)
            ctx = ctx.parent
        return ".".join(reversed(names))

    def child_context(self, child: "Module", method: str, label: str = "") -> "InvocationContext":
        """The context for calling `child.method` from this context."""
        name = child.name
        call = (name, method, label)
        if call in self._calls:
            raise ModuleError(
                f"{self.path()}: child '{name}' method '{method}' was already called in this "
                f"context; a second call would reuse its PRNG key and outputs. Use "
                f"`self.invoke_child('{name}', label=..., method='{method}', ...)` to make "
                f"a distinctly named sub-context."
            )
        if name not in self.state and child.has_state():
            raise ModuleError(
                f"{self.path()}: state has no entry for child '{name}' "
                f"(keys: {sorted(self.state)})"
            )
        self._calls.add(call)
        entry = labelled_name(name, label)
        return InvocationContext(
            name=entry,
            parent=self,
            module=child,
            state=self.state.get(name, {}),
            output_collection=self.child_collection(entry),
            is_training=self.is_training,
            prng_key=child_key(self.prng_key, name, method, label),
        )

    def child_collection(self, name: str) -> OutputCollection:
        """The output sub-collection of child `name`; raises if an output of this module
        already uses that name (outputs and children share one namespace per module)."""
        oc = self.output_collection
        for kind in _KINDS:
            existing = getattr(oc, kind).get(name)
            if existing is not None and not isinstance(existing, dict):
                raise ModuleError(
                    f"{self.path()}: child '{name}' clashes with the {kind} entry '{name}' "
                    f"recorded by this module; rename one of them"
                )
        return oc.child(name)

    def add(self, kind: str, name: str, value: Any) -> None:
        """Records `value` as output `name` of `kind` (summaries | state_updates |
        module_outputs) of this module."""
        target: Nested = getattr(self.output_collection, kind)
        if name in target:
            what = "a child's outputs" if isinstance(target[name], dict) else "an earlier output"
            raise ModuleError(
                f"{self.path()}: {kind} '{name}' recorded twice in one call (clashes with "
                f"{what} of that name)"
            )
        target[name] = value


_KINDS = ("summaries", "state_updates", "module_outputs")


class _Stack(threading.local):
    def __init__(self) -> None:
        self.frames: list[InvocationContext] = []


_STACK = _Stack()


def current_context() -> Optional[InvocationContext]:
    return _STACK.frames[-1] if _STACK.frames else None


def side_input(name: str, default: Any = None) -> Any:
    """The side input `name` of the running call (given to `functional(...,
    side_inputs=...)` at its root), or `default` outside a call or when not given. Under
    jit, scan or remat it is the traced value the root received."""
    ctx = current_context()
    while ctx is not None and ctx.parent is not None:
        ctx = ctx.parent
    return default if ctx is None else ctx.side_inputs.get(name, default)


class _Push:
    def __init__(self, ctx: InvocationContext):
        self.ctx = ctx

    def __enter__(self) -> InvocationContext:
        _STACK.frames.append(self.ctx)
        return self.ctx

    def __exit__(self, *exc: Any) -> None:
        popped = _STACK.frames.pop()
        assert popped is self.ctx


def push_context(ctx: InvocationContext) -> _Push:
    return _Push(ctx)


def iter_collection(tree: Nested, name: str, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every (path, value) whose key is `name` in a nested output dict (e.g. 'aux_loss')."""
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if key == name and not isinstance(value, dict):
            yield path, value
        elif isinstance(value, dict):
            yield from iter_collection(value, name, path)
