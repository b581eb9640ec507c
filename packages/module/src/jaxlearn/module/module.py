"""`Module`: a configurable layer whose methods run inside invocation contexts.

A module declares children from child configs in `__init__` and parameters in
`_create_layer_parameter_specs`. Its public methods are wrapped so that calling a child
(`self.child(x)` or `self.child.method(x)`) runs in a child context automatically: the
child sees its own parameter subtree, a key derived from its name, and writes outputs
under its name. Everything runs as pure JAX through `functional(...)`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED, Configurable, InstantiableConfig
from jaxlearn.module.context import (
    InvocationContext,
    ModuleError,
    Nested,
    OutputCollection,
    current_context,
    fold_in_name,
    iter_collection,
    push_context,
)
from jaxlearn.module.param import ParameterSpec, VarianceScaling, is_spec, stack_spec
from jaxlearn.module.remat import RematSpec, remat, tag

_INHERITED = ("param_dtype", "dtype", "param_init")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Module(Configurable):
    """Base class of every layer. Subclasses nest `class Config(Parent.Config)`."""

    class Config(Configurable.Config):
        name: str = REQUIRED
        # Storage dtype of parameters (inherited from the parent when None; root: float32).
        param_dtype: Optional[str] = None
        # Compute dtype of activations (inherited; None means the param dtype).
        dtype: Optional[str] = None
        # Default initializer for parameters whose spec has none (inherited).
        param_init: Optional[InstantiableConfig] = None
        # Rematerialise this module's calls in training (None: no remat).
        remat_spec: Optional[RematSpec] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attr, fn in list(vars(cls).items()):
            if (
                attr.startswith("_")
                or not callable(fn)
                or isinstance(fn, (staticmethod, classmethod, type))
                or (hasattr(Module, attr) and attr != "forward")
                or getattr(fn, "_jaxlearn_wrapped", False)
            ):
                continue
            setattr(cls, attr, _wrap_method(attr, fn))

    def __init__(self, cfg: "Module.Config", *, parent: Optional["Module"] = None):
        path = f"{parent.path()}.{cfg.name}" if parent is not None else str(cfg.name)
        super().__init__(cfg, _path=path)
        self._parent = parent
        self._children: dict[str, Module] = {}
        self._stacked: dict[str, int] = {}
        if parent is None:
            c = self._config
            if c.param_dtype is None:
                c.param_dtype = "float32"
            if c.param_init is None:
                c.param_init = VarianceScaling.default_config()

    # ---- tree -----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._config.name

    @property
    def parent(self) -> Optional["Module"]:
        return self._parent

    def path(self) -> str:
        """Dotted path from the root module, e.g. 'model.decoder.layer.self_attention'."""
        return f"{self._parent.path()}.{self.name}" if self._parent is not None else self.name

    @property
    def children(self) -> dict[str, "Module"]:
        return dict(self._children)

    def _add_child(self, name: str, child_cfg: "Module.Config", **kwargs: Any) -> Any:
        """Instantiates `child_cfg` as child `name`, inheriting dtypes and initializer."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise ModuleError(
                f"{self.path()}: child name {name!r} must be a Python identifier (it becomes "
                f"a key of the state tree and a segment of dotted paths)"
            )
        if name in self._children:
            raise ModuleError(f"{self.path()}: a child named '{name}' already exists")
        if hasattr(type(self), name):
            raise ModuleError(f"{self.path()}: child name '{name}' clashes with an attribute")
        if not isinstance(child_cfg, Module.Config):
            raise ModuleError(
                f"{self.path()}.{name}: child config must be a Module.Config, "
                f"got {type(child_cfg).__qualname__}"
            )
        cfg = child_cfg.clone(name=name)
        for field in _INHERITED:
            if getattr(cfg, field) is None:
                setattr(cfg, field, getattr(self._config, field))
        child = cfg.instantiate(parent=self, **kwargs)
        self._children[name] = child
        return child

    def _add_stacked_child(
        self, name: str, child_cfg: "Module.Config", num_layers: int, **kwargs: Any
    ) -> Any:
        """Adds child `name` whose state is `num_layers` independently initialised copies
        stacked on a new leading axis (logical name "layers"); run it with `scan_child`."""
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ModuleError(f"{self.path()}.{name}: num_layers must be >= 1, got {num_layers}")
        child = self._add_child(name, child_cfg, **kwargs)
        self._stacked[name] = num_layers
        return child

    def __getattr__(self, name: str) -> Any:
        children = self.__dict__.get("_children", {})
        if name in children:
            return children[name]
        raise AttributeError(f"{type(self).__qualname__} has no attribute or child '{name}'")

    # ---- dtypes ---------------------------------------------------------------------------

    @property
    def param_dtype(self) -> jnp.dtype:
        return jnp.dtype(self._config.param_dtype or "float32")

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype (activations, matmul inputs)."""
        return jnp.dtype(self._config.dtype or self._config.param_dtype or "float32")

    # ---- parameters -----------------------------------------------------------------------

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        """This module's own parameters (not its children's). Override in layers."""
        return {}

    def _resolved_layer_specs(self) -> dict[str, ParameterSpec]:
        specs = {}
        for name, spec in self._create_layer_parameter_specs().items():
            if name in self._children:
                raise ModuleError(f"{self.path()}: parameter '{name}' clashes with a child")
            if spec.dtype is None:
                spec = _replace(spec, dtype=self.param_dtype)
            if spec.initializer is None:
                spec = _replace(spec, initializer=self._config.param_init)
            specs[name] = spec
        return specs

    def create_parameter_specs_recursively(self) -> Nested:
        """Nested dict of resolved ParameterSpecs mirroring the module tree."""
        specs: Nested = dict(self._resolved_layer_specs())
        for name, child in self._children.items():
            sub = child.create_parameter_specs_recursively()
            if sub and name in self._stacked:
                n = self._stacked[name]
                sub = jax.tree.map(lambda s: stack_spec(s, n), sub, is_leaf=is_spec)
            if sub:
                specs[name] = sub
        return specs

    def initialize_parameters_recursively(self, prng_key: jax.Array) -> Nested:
        """Initial parameters; each leaf's key is derived from its path (order-independent)."""
        params: Nested = {}
        for name, spec in sorted(self._resolved_layer_specs().items()):
            init = spec.initializer.instantiate()  # type: ignore[union-attr]
            params[name] = init.init(fold_in_name(prng_key, name), spec)
        for name, child in self._children.items():
            key = fold_in_name(prng_key, name)
            if name in self._stacked and child.has_state():
                keys = jax.random.split(key, self._stacked[name])
                sub = jax.vmap(child.initialize_parameters_recursively)(keys)
            else:
                sub = child.initialize_parameters_recursively(key)
            if sub:
                params[name] = sub
        return params

    @functools.cached_property
    def _has_state(self) -> bool:
        return bool(self.create_parameter_specs_recursively())

    def has_state(self) -> bool:
        return self._has_state

    # ---- context access -------------------------------------------------------------------

    def _context(self) -> InvocationContext:
        ctx = current_context()
        if ctx is None or ctx.module is not self:
            where = ctx.path() if ctx is not None else "no context"
            raise ModuleError(
                f"{self.path()}: context accessed outside this module's own call ({where}); "
                f"call modules through jaxlearn.module.functional(...)"
            )
        return ctx

    @property
    def parameters(self) -> Nested:
        """This module's state subtree in the current call."""
        return self._context().state

    @property
    def state(self) -> Nested:
        return self._context().state

    @property
    def prng_key(self) -> jax.Array:
        key = self._context().prng_key
        if key is None:
            raise ModuleError(f"{self.path()}: no PRNG key was given to functional()")
        return key

    @property
    def is_training(self) -> bool:
        return self._context().is_training

    def add_summary(self, name: str, value: Any) -> None:
        self._context().add("summaries", name, value)

    def add_module_output(self, name: str, value: Any) -> None:
        self._context().add("module_outputs", name, value)

    def add_state_update(self, name: str, value: Any) -> None:
        self._context().add("state_updates", name, value)

    def get_module_outputs(self, name: str) -> list[tuple[str, Any]]:
        """(path, value) of every module output called `name` recorded so far in this
        call's subtree, e.g. every MoE 'aux_loss' below a model."""
        return list(iter_collection(self._context().output_collection.module_outputs, name))

    def checkpoint_name(self, x: Any, name: str) -> Any:
        """Tags an activation for name-based remat policies."""
        return tag(x, name)

    def invoke_child(
        self, name: str, *args: Any, label: str, method: str = "forward", **kwargs: Any
    ) -> Any:
        """Calls child `name` (again) in a distinctly labelled sub-context: its key is
        further folded with `label` and its outputs are recorded under `name@label`.

        State updates recorded there are not at a state path, so `merge_state_updates`
        leaves them out; the unlabelled call (if any) owns the child's state updates."""
        if name not in self._children:
            raise ModuleError(
                f"{self.path()}: invoke_child: no child '{name}' (children: "
                f"{sorted(self._children)})"
            )
        if not label:
            raise ModuleError(f"{self.path()}: invoke_child('{name}') needs a non-empty label")
        child = self._children[name]
        ctx = self._context().child_context(child, method, label=label)
        fn = getattr(type(child), method).__wrapped__
        return child._run(ctx, fn, args, kwargs)

    def _run(self, ctx: InvocationContext, fn: Callable, args: tuple, kwargs: dict) -> Any:
        spec = self._config.remat_spec
        if not (ctx.is_training and spec is not None):
            with push_context(ctx):
                return fn(self, *args, **kwargs)
        # Remat: run the call as a pure function of (state, key, array inputs).
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dyn = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, jnp.ndarray))]

        def pure(state: Nested, key: Any, dyn_leaves: list) -> tuple[Any, OutputCollection]:
            full = list(leaves)
            for i, v in zip(dyn, dyn_leaves):
                full[i] = v
            a, kw = jax.tree.unflatten(treedef, full)
            oc = OutputCollection()
            sub = InvocationContext(ctx.name, ctx.parent, self, state, oc, True, key)
            with push_context(sub):
                return fn(self, *a, **kw), oc

        out, oc = remat(pure, spec)(ctx.state, ctx.prng_key, [leaves[i] for i in dyn])
        ctx.output_collection.summaries.update(oc.summaries)
        ctx.output_collection.state_updates.update(oc.state_updates)
        ctx.output_collection.module_outputs.update(oc.module_outputs)
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__}.forward")


def _replace(spec: ParameterSpec, **kw: Any) -> ParameterSpec:
    return dataclasses.replace(spec, **kw)


def _wrap_method(method_name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self: Module, *args: Any, **kwargs: Any) -> Any:
        ctx = current_context()
        if ctx is None:
            raise ModuleError(
                f"{self.path()}.{method_name} called outside an invocation context; "
                f"use jaxlearn.module.functional(module, prng_key, state, inputs, ...)"
            )
        if ctx.module is self:
            return fn(self, *args, **kwargs)
        if ctx.module is self._parent:
            return self._run(ctx.child_context(self, method_name), fn, args, kwargs)
        raise ModuleError(
            f"{self.path()}.{method_name} called from the context of {ctx.path()}; a module "
            f"may be called only by itself or by its parent"
        )

    wrapper._jaxlearn_wrapped = True  # type: ignore[attr-defined]
    return wrapper


# Module.forward itself is wrapped so that `child(x)` enters the child's context.
Module.forward = _wrap_method("forward", Module.forward)  # type: ignore[method-assign]
