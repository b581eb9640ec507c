"""Flax adapters: a Flax linen or NNX module hosted as a child of a jaxlearn module.

    cfg.set(encoder=LinenAdapter.default_config().set(
        module=linen_config(MyLinenMLP, hidden=64), input_shapes=[(1, 32)], train_kwarg="train"))

The hosted module's variables live in our state tree under the adapter, grouped by Flax
collection (`{"params": ..., "batch_stats": ...}`), with one `ParameterSpec` per leaf
(shape/dtype from `jax.eval_shape` of the Flax init, logical axes from `nn.Partitioned` /
`nnx.with_partitioning(..., eager_sharding=False)` names, else None; non-"params"
collections get `weight_decay_scale=0`). Randomness comes from our context key; mutable
collections come back as state updates at the same paths, so
`merge_state_updates(state, collection.state_updates)` writes them back.

This file imports flax; `jaxlearn.module` itself does not, so import it explicitly:
`from jaxlearn.module.flax_adapters import LinenAdapter, NNXAdapter`.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterable, Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.core import meta, unfreeze

from jaxlearn.config import REQUIRED, ClassConfigBase, InstantiableConfig, config_for_class
from jaxlearn.module.context import ModuleError, Nested, fold_in_name
from jaxlearn.module.module import Module
from jaxlearn.module.param import Initializer, ParameterSpec

Path = tuple[Any, ...]


class AdapterInit(Initializer):
    """Marks a parameter that its Flax adapter initialises, together with its siblings,
    by running the Flax module's own initialisers (`initialize_parameters_recursively`)."""

    class Config(Initializer.Config):
        adapter: str = ""  # Path of the owning adapter, for error messages.

    def init(self, key: jax.Array, spec: ParameterSpec) -> jax.Array:
        raise ModuleError(
            f"{self.config.adapter}: a Flax adapter's parameters are initialised together by "
            f"its initialize_parameters_recursively(), not one spec at a time"
        )


def linen_config(klass: type, **kwargs: Any) -> ClassConfigBase:
    """`config_for_class(klass, ...)` for a linen module, with `parent=None` (a detached
    top-level module) so that the config has a text form."""
    return config_for_class(klass, parent=None, **kwargs)


def _instantiate(cfg: InstantiableConfig, **runtime: Any) -> Any:
    """`cfg.instantiate(**runtime)`, where `runtime` may supply fields left REQUIRED (e.g.
    an NNX module's `rngs`): PRNG streams are runtime objects, not config data."""
    cfg = cfg.clone()
    for name in runtime:
        if name in cfg and getattr(cfg, name) is REQUIRED:
            object.__setattr__(cfg, name, None)  # Replaced by instantiate(**runtime).
    return cfg.instantiate(**runtime)


def _leaf_spec(
    value: Any, names: Optional[Iterable[Any]], collection: str, init: Initializer.Config
) -> ParameterSpec:
    shape = tuple(int(d) for d in value.shape)
    axes = tuple(names) if names is not None else ()
    if len(axes) != len(shape):
        axes = (None,) * len(shape)
    return ParameterSpec(
        shape=shape,
        mesh_axes=axes,
        dtype=jnp.dtype(value.dtype),
        initializer=init,
        weight_decay_scale=1.0 if collection == "params" else 0.0,
    )


def _set_path(tree: Nested, path: Iterable[str], value: Any) -> None:
    *parents, last = path
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[last] = value


def _get_path(tree: Nested, path: Iterable[str], where: str) -> Any:
    node: Any = tree
    for key in path:
        if not isinstance(node, dict) or key not in node:
            raise ModuleError(f"{where}: state has no entry {'/'.join(path)}")
        node = node[key]
    return node


class LinenAdapter(Module):
    """Hosts a Flax linen module; `forward(*args, **kwargs)` is its `apply`.

    RNG: each name in `rng_collections` gets `fold_in_name(context_key, name)` (also at
    init, where "params" gets the key itself). Mutable collections (default: every
    collection but "params" present after init) are recorded as state updates.
    """

    class Config(Module.Config):
        # Builds the linen module: linen_config(klass, ...), config_for_class, or any
        # InstantiableConfig whose instantiate() returns an nn.Module.
        module: InstantiableConfig = REQUIRED
        # Shapes of example positional inputs for init (zeros of these are passed).
        input_shapes: list[tuple[int, ...]] = REQUIRED
        # Their dtypes (default: float32 each).
        input_dtypes: Optional[list[str]] = None
        # Static keyword arguments of the init call.
        init_kwargs: dict[str, Any] = {}
        # If set, this keyword receives `is_training` in forward (False at init).
        train_kwarg: Optional[str] = None
        # RNG collections the module draws from (e.g. "dropout").
        rng_collections: list[str] = ["dropout"]
        # Mutable collections at apply; None: all but "params".
        mutable: Optional[list[str]] = None
        # The module method to apply (None: __call__).
        method: Optional[str] = None

    def __init__(self, cfg: "LinenAdapter.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        linen = self.config.module.instantiate()
        if not isinstance(linen, nn.Module):
            raise ModuleError(
                f"{self.path()}.module: expected a flax.linen Module, got {type(linen).__name__}"
            )
        self._linen = linen

    def _rngs(self, key: Optional[jax.Array]) -> dict[str, jax.Array]:
        if key is None:
            return {}
        return {name: fold_in_name(key, name) for name in self.config.rng_collections}

    def _init_variables(self, prng_key: jax.Array) -> Nested:
        """The linen variables (boxed, as Flax returns them) initialised from `prng_key`."""
        cfg = self.config
        dtypes = cfg.input_dtypes or ["float32"] * len(cfg.input_shapes)
        if len(dtypes) != len(cfg.input_shapes):
            raise ModuleError(f"{self.path()}: {len(dtypes)} input_dtypes for "
                              f"{len(cfg.input_shapes)} input_shapes")
        inputs = [jnp.zeros(s, d) for s, d in zip(cfg.input_shapes, dtypes)]
        kwargs = dict(cfg.init_kwargs)
        if cfg.train_kwarg:
            kwargs.setdefault(cfg.train_kwarg, False)
        rngs = {**self._rngs(prng_key), "params": prng_key}
        variables = self._linen.init(rngs, *inputs, method=cfg.method, **kwargs)
        return unfreeze(variables)

    @functools.cached_property
    def _abstract_variables(self) -> Nested:
        return jax.eval_shape(self._init_variables, jax.random.key(0))

    def create_parameter_specs_recursively(self) -> Nested:
        """One ParameterSpec per linen variable, grouped by collection."""
        init = AdapterInit.default_config().set(adapter=self.path())
        specs: Nested = {}
        for collection, tree in self._abstract_variables.items():
            leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_box)
            out = []
            for leaf in leaves:
                names = leaf.names if isinstance(leaf, nn.Partitioned) else None
                value = leaf.unbox() if _is_box(leaf) else leaf
                out.append(_leaf_spec(value, names, collection, init))
            specs[collection] = jax.tree.unflatten(treedef, out)
        return specs

    def initialize_parameters_recursively(self, prng_key: jax.Array) -> Nested:
        """The linen module's own init, unboxed to plain arrays."""
        return meta.unbox(self._init_variables(prng_key))

    def _mutable(self) -> list[str]:
        if self.config.mutable is not None:
            return list(self.config.mutable)
        return sorted(c for c in self._abstract_variables if c != "params")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cfg = self.config
        if cfg.train_kwarg:
            kwargs.setdefault(cfg.train_kwarg, self.is_training)
        rngs = self._rngs(self._context().prng_key)
        variables = dict(self.state)
        mutable = self._mutable()
        if not mutable:
            return self._linen.apply(variables, *args, rngs=rngs, method=cfg.method, **kwargs)
        out, updated = self._linen.apply(
            variables, *args, rngs=rngs, method=cfg.method, mutable=mutable, **kwargs
        )
        for collection in mutable:
            if collection in updated:
                self.add_state_update(collection, unfreeze(updated[collection]))
        return out


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def _collection(var: Any) -> str:
    """Linen-style collection name of an NNX variable: Param -> "params",
    BatchStat -> "batch_stats", MyCache -> "my_cache"."""
    if isinstance(var, nnx.Param):
        return "params"
    if isinstance(var, nnx.BatchStat):
        return "batch_stats"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(var).__name__).lower()


def _typed_key(key: jax.Array) -> jax.Array:
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key)


class NNXAdapter(Module):
    """Hosts a Flax NNX module; `forward(*args, **kwargs)` calls it.

    Each call rebuilds the module with `nnx.merge(graphdef, state, copy=True)` (copy=True
    is required under jit/grad, see notes/jax-cpu.md section 6), sets `.train()`/`.eval()`
    from `is_training`, re-seeds every RNG stream from the context key
    (`fold_in_name(key, "<stream path>")`, count 0), and records every non-Param,
    non-RNG variable (e.g. BatchStat) as a state update.
    """

    class Config(Module.Config):
        # Builds the NNX module; instantiate() gets `<rngs_arg>=nnx.Rngs(key)`.
        module: InstantiableConfig = REQUIRED
        rngs_arg: str = "rngs"
        # Call .train() / .eval() on the merged module according to is_training.
        set_mode: bool = True
        # The module method to call (None: __call__).
        method: Optional[str] = None

    def _build(self, key: jax.Array) -> Any:
        rngs = nnx.Rngs(_typed_key(key))
        model = _instantiate(self.config.module, **{self.config.rngs_arg: rngs})
        if not isinstance(model, nnx.Module):
            raise ModuleError(
                f"{self.path()}.module: expected a flax.nnx Module, got {type(model).__name__}"
            )
        return model

    @functools.cached_property
    def _template(self) -> tuple[Any, list[tuple[Path, Any]]]:
        """(graphdef, [(path, abstract Variable)]) of the module, from nnx.eval_shape."""
        model = nnx.eval_shape(lambda: self._build(jax.random.key(0)))
        graphdef, state = nnx.split(model)
        return graphdef, list(nnx.to_flat_state(state))

    def _tree(self, flat: Iterable[tuple[Path, Any]], fn: Any) -> Nested:
        tree: Nested = {}
        for path, var in flat:
            if not isinstance(var, nnx.RngState):
                _set_path(tree, (_collection(var), *map(str, path)), fn(var))
        return tree

    def create_parameter_specs_recursively(self) -> Nested:
        """One ParameterSpec per non-RNG NNX variable, grouped by collection."""
        init = AdapterInit.default_config().set(adapter=self.path())

        def spec(var: Any) -> ParameterSpec:
            names = var.get_metadata().get("out_sharding")
            return _leaf_spec(var.get_value(), names, _collection(var), init)

        return self._tree(self._template[1], spec)

    def initialize_parameters_recursively(self, prng_key: jax.Array) -> Nested:
        """The NNX module's own init with `nnx.Rngs(prng_key)`."""
        model = self._build(prng_key)
        return self._tree(nnx.to_flat_state(nnx.state(model)), lambda v: v.get_value())

    def _merged(self) -> Any:
        graphdef, template = self._template
        key = self._context().prng_key
        key = jax.random.key(0) if key is None else _typed_key(key)
        flat = []
        for path, var in template:
            where = "/".join(map(str, path))
            if isinstance(var, nnx.RngKey):
                value = fold_in_name(key, where)
            elif isinstance(var, nnx.RngState):
                abstract = var.get_value()
                value = jnp.zeros(abstract.shape, abstract.dtype)
            else:
                value = _get_path(self.state, (_collection(var), *map(str, path)), self.path())
            flat.append((path, var.replace(value)))
        return nnx.merge(graphdef, nnx.from_flat_state(flat), copy=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cfg = self.config
        model = self._merged()
        if cfg.set_mode:
            model.train() if self.is_training else model.eval()
        fn = getattr(model, cfg.method) if cfg.method else model
        out = fn(*args, **kwargs)
        known = {path for path, _ in self._template[1]}
        flat = [
            (path, var)
            for path, var in nnx.to_flat_state(nnx.state(model))
            if path in known and not isinstance(var, nnx.Param)
        ]
        for collection, tree in self._tree(flat, lambda v: v.get_value()).items():
            self.add_state_update(collection, tree)
        return out
