"""Pre-norm transformer layer and layer stacks.

- `TransformerLayer`: x + attn(norm(x)), then x + ffn(norm(x)); with `post_norm` (Gemma 2/3)
  x + post_norm(attn(norm(x))), then x + post_norm(ffn(norm(x))). `feed_forward` is any
  config with `input_dim` and `forward(x [batch, seq, embed])`, so MoE drops in.
- `LoopStack`: a Python loop over children `layer0..layerN-1` (params per layer; `layers`
  may list differing configs, e.g. dense / MoE); fastest CPU steps. `ScanStack`: one child
  `layer`, params stacked [layers, ...], run by `lax.scan` (compiles like one layer); its
  `layer` may be a `LoopStack` group, a repeating pattern (`stack_config`). `swapped_stack`:
  one form as the other. Each has `forward`, `init_states`, `prefill`, `extend_step`.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.config import REQUIRED, InstantiableConfig
from jaxlearn.layers.attention import Attention
from jaxlearn.layers.ffn import FeedForward
from jaxlearn.layers.norm import RMSNorm
from jaxlearn.module import (
    Module,
    ParameterSpec,
    scan_child,
    spec_tree_map,
    stack_spec,
    with_logical_constraint,
)
from jaxlearn.module.context import fold_in_name

Array = jax.Array
_AXES = ("batch", "seq", "embed")
# Activations a layer tags for 'save_names:' / 'offload_names:' remat policies.
ACTIVATION_NAMES = ("q_proj", "k_proj", "v_proj", "context", "ffn_hidden", "ffn_activation",
                    "residual")


class TransformerLayer(Module):
    """Pre-norm block. x [batch, seq, embed] -> [batch, seq, embed].

    Children: attention_norm, self_attention, ffn_norm, feed_forward (+ post_attention_norm,
    post_ffn_norm with `post_norm`).
    """

    class Config(Module.Config):
        input_dim: int = REQUIRED  # Set by the parent stack.
        norm: InstantiableConfig = RMSNorm.default_config()
        self_attention: InstantiableConfig = Attention.default_config()
        feed_forward: InstantiableConfig = FeedForward.default_config()
        # Norm of the attention and FFN outputs before each residual add (Gemma 2/3's
        # "sandwich" norms); None: off.
        post_norm: Optional[InstantiableConfig] = None

    def __init__(self, cfg: "TransformerLayer.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        dim = c.input_dim
        self._add_child("attention_norm", c.norm.clone(input_dim=dim))
        self._add_child("self_attention", c.self_attention.clone(input_dim=dim))
        self._add_child("ffn_norm", c.norm.clone(input_dim=dim))
        self._add_child("feed_forward", c.feed_forward.clone(input_dim=dim))
        if c.post_norm is not None:
            self._add_child("post_attention_norm", c.post_norm.clone(input_dim=dim))
            self._add_child("post_ffn_norm", c.post_norm.clone(input_dim=dim))

    def _block(self, x: Array, attend: Any) -> tuple[Any, Array]:
        post = self.config.post_norm is not None
        x = with_logical_constraint(x, _AXES)
        out = attend(self.attention_norm(x))
        cache, h = out if isinstance(out, tuple) else (None, out)
        if post:
            h = self.post_attention_norm(h)
        x = self.checkpoint_name(x + h.astype(x.dtype), "residual")
        f = self.feed_forward(self.ffn_norm(x))
        if post:
            f = self.post_ffn_norm(f)
        x = x + f.astype(x.dtype)
        return cache, with_logical_constraint(x, _AXES)

    def forward(
        self, x: Array, positions: Optional[Array] = None, segment_ids: Optional[Array] = None
    ) -> Array:
        return self._block(x, lambda h: self.self_attention(h, positions, segment_ids))[1]

    def init_states(self, batch_size: int, max_len: int) -> Any:
        return {"self_attention": self.self_attention.init_states(batch_size, max_len)}

    def init_paged_states(self, num_pages: int, page_size: int) -> Any:
        return {"self_attention": self.self_attention.init_paged_states(num_pages, page_size)}

    def prefill(
        self,
        cache: Any,
        x: Array,
        positions: Optional[Array] = None,
        segment_ids: Optional[Array] = None,
    ) -> tuple[Any, Array]:
        attn = self.self_attention
        kv, x = self._block(
            x, lambda h: attn.prefill(cache["self_attention"], h, positions, segment_ids)
        )
        return {"self_attention": kv}, x

    def extend_step(
        self,
        cache: Any,
        x: Array,
        time_step: Array,
        positions: Optional[Array] = None,
        page_table: Optional[Array] = None,
        layer_index: Optional[Array] = None,
    ) -> tuple[Any, Array]:
        """(cache, x); `page_table` / `layer_index`: a paged cache (see `paged`)."""
        attn = self.self_attention
        kv, x = self._block(
            x,
            lambda h: attn.extend_step(
                cache["self_attention"], h, time_step, positions, page_table, layer_index
            ),
        )
        return {"self_attention": kv}, x


def paged_scan(
    scan: Any, pools: Any, x: Array, time_step: Array, positions: Any, page_table: Array
) -> tuple[Any, Array]:
    """A scanned stack's paged extend_step: `scan(fn, carry, xs)` over the layers with the
    stacked pools in the carry and the layer index as xs."""
    num_layers = jax.tree.leaves(pools)[0].shape[0]

    def step(layer: Module, carry: Any, index: Array) -> tuple[Any, None]:
        h, pools = carry
        pools, h = layer.extend_step(pools, h, time_step, positions, page_table, index)
        return (h, pools), None

    (x, pools), _ = scan(step, (x, pools), jnp.arange(num_layers))
    return pools, x


def stacked(tree: Any, num_layers: int) -> Any:
    """Every leaf of one layer's decode state broadcast to [num_layers, ...]."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (num_layers, *a.shape)), tree)


class BaseStack(Module):
    """Common config of stacks: `num_layers` copies of `layer` (input_dim set here)."""

    class Config(Module.Config):
        input_dim: int = REQUIRED  # Set by the decoder.
        num_layers: int = REQUIRED
        layer: InstantiableConfig = TransformerLayer.default_config()


class LoopStack(BaseStack):
    """Python loop over children layer0..layer{n-1}; params {"layer0": ..., ...}.

    `layers`, when set, lists one config per layer (heterogeneous stacks; `num_layers` may
    be left None); otherwise `layer` is repeated `num_layers` times.
    """

    class Config(BaseStack.Config):
        num_layers: Optional[int] = None  # type: ignore[assignment]  # None: len(layers).
        layers: Optional[list[InstantiableConfig]] = None

    def __init__(self, cfg: "LoopStack.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        if c.layers is None and c.num_layers is None:
            raise ValueError(f"{self.path()}: set num_layers (or layers)")
        cfgs = c.layers if c.layers is not None else [c.layer] * c.num_layers
        if c.num_layers is not None and len(cfgs) != c.num_layers:
            raise ValueError(f"{self.path()}: num_layers={c.num_layers} but {len(cfgs)} layers")
        self._layers = [
            self._add_child(f"layer{i}", lc.clone(input_dim=c.input_dim))
            for i, lc in enumerate(cfgs)
        ]

    def forward(
        self, x: Array, positions: Optional[Array] = None, segment_ids: Optional[Array] = None
    ) -> Array:
        for layer in self._layers:
            x = layer(x, positions, segment_ids)
        return x

    def init_states(self, batch_size: int, max_len: int) -> Any:
        return {layer.name: layer.init_states(batch_size, max_len) for layer in self._layers}

    def init_paged_states(self, num_pages: int, page_size: int) -> Any:
        return {layer.name: layer.init_paged_states(num_pages, page_size) for layer in self._layers}

    def prefill(
        self,
        cache: Any,
        x: Array,
        positions: Optional[Array] = None,
        segment_ids: Optional[Array] = None,
    ) -> tuple[Any, Array]:
        out = {}
        for layer in self._layers:
            out[layer.name], x = layer.prefill(cache[layer.name], x, positions, segment_ids)
        return out, x

    def extend_step(
        self,
        cache: Any,
        x: Array,
        time_step: Array,
        positions: Optional[Array] = None,
        page_table: Optional[Array] = None,
        layer_index: Optional[Array] = None,
    ) -> tuple[Any, Array]:
        """(cache, x); `layer_index`: this stack is one group of a `ScanStack` whose pools
        are stacked [groups, ...] (see `paged_scan`)."""
        out = {}
        for layer in self._layers:
            extra = () if layer_index is None else (layer_index,)
            out[layer.name], x = layer.extend_step(
                cache[layer.name], x, time_step, positions, page_table, *extra
            )
        return out, x


class StackedDecode(BaseStack):
    """The decode API of a stack whose per-layer caches are stacked [layers, ...] (global
    layer order) and run layer by layer in one scan: subclasses give `_scan_layers(fn,
    carry, xs)` (fn(layer, carry, x) -> (carry, y) over every layer, ys stacked)."""

    def _scan_layers(self, fn: Any, carry: Any, xs: Any) -> tuple[Any, Any]:
        raise NotImplementedError(type(self).__name__)

    def init_states(self, batch_size: int, max_len: int) -> Any:
        return stacked(self.layer.init_states(batch_size, max_len), self.config.num_layers)

    def init_paged_states(self, num_pages: int, page_size: int) -> Any:
        return stacked(self.layer.init_paged_states(num_pages, page_size), self.config.num_layers)

    def prefill(
        self,
        cache: Any,
        x: Array,
        positions: Optional[Array] = None,
        segment_ids: Optional[Array] = None,
    ) -> tuple[Any, Array]:
        def step(layer: Module, h: Array, layer_cache: Any) -> tuple[Array, Any]:
            new_cache, h = layer.prefill(layer_cache, h, positions, segment_ids)
            return h, new_cache

        x, cache = self._scan_layers(step, x, cache)
        return cache, x

    def extend_step(
        self,
        cache: Any,
        x: Array,
        time_step: Array,
        positions: Optional[Array] = None,
        page_table: Optional[Array] = None,
    ) -> tuple[Any, Array]:
        """(cache, x). With `page_table` the stacked pools ride in the scan carry and each
        layer writes / reads its own `layer_index` (see `jaxlearn.kernels.paged`)."""
        if page_table is not None:
            return paged_scan(self._scan_layers, cache, x, time_step, positions, page_table)

        def step(layer: Module, h: Array, layer_cache: Any) -> tuple[Array, Any]:
            new_cache, h = layer.extend_step(layer_cache, h, time_step, positions)
            return h, new_cache

        x, cache = self._scan_layers(step, x, cache)
        return cache, x


class ScanStack(StackedDecode):
    """`lax.scan` over one child `layer` with params stacked [layers, ...] (logical axis
    "layers"); the layer's `remat_spec` rematerialises each iteration in training. Decode
    caches are stacked [layers, ...] too. `unroll` is passed to `lax.scan`."""

    class Config(StackedDecode.Config):
        unroll: int = 1

    def __init__(self, cfg: "ScanStack.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        self._add_child("layer", c.layer.clone(input_dim=c.input_dim))

    def create_parameter_specs_recursively(self) -> dict[str, Any]:
        n = self.config.num_layers
        specs: dict[str, Any] = super().create_parameter_specs_recursively()
        if "layer" in specs:
            specs["layer"] = spec_tree_map(
                lambda s: stack_spec(s, n) if isinstance(s, ParameterSpec) else s, specs["layer"]
            )
        return specs

    def initialize_parameters_recursively(self, prng_key: Array) -> dict[str, Any]:
        layer = self.children["layer"]
        keys = jax.random.split(fold_in_name(prng_key, "layer"), self.config.num_layers)
        params = jax.vmap(layer.initialize_parameters_recursively)(keys)
        return {"layer": params} if params else {}

    def _scan(self, fn: Any, carry: Any, xs: Any = None) -> tuple[Any, Any]:
        c = self.config
        return scan_child(
            self, self.layer, fn, carry, xs, num_iterations=c.num_layers, unroll=c.unroll
        )

    def forward(
        self, x: Array, positions: Optional[Array] = None, segment_ids: Optional[Array] = None
    ) -> Array:
        x, _ = self._scan(lambda layer, h, _: (layer(h, positions, segment_ids), None), x)
        return x

    def _scan_layers(self, fn: Any, carry: Any, xs: Any) -> tuple[Any, Any]:
        return self._scan(fn, carry, xs)


def stack_config(layers: list[InstantiableConfig], stack: str, *, unroll: int = 1) -> Any:
    """The stack config running `layers` (one config per layer) in order.

    stack "loop": a `LoopStack` of them. "scan": a `ScanStack` of `layer` when all are
    equal; else of the shortest group of p layers that repeats exactly (layer i ==
    layer i % p, p dividing the count): `ScanStack(num_layers=n // p, layer=LoopStack(
    layers=group))`, whose params are stacked [n // p, ...] under `layer.layer{k}` for the
    layers k, k + p, ...; a stack without such a group is a `LoopStack`.
    """
    if stack not in ("scan", "loop"):
        raise ValueError(f"stack_config: stack must be 'scan' or 'loop', got {stack!r}")
    n = len(layers)
    if n == 0:
        raise ValueError("stack_config: no layers")
    loop = LoopStack.default_config().set(num_layers=n, layers=list(layers))
    if stack == "loop":
        return loop
    for p in range(1, n // 2 + 1):
        if n % p == 0 and all(layers[i] == layers[i % p] for i in range(n)):
            one = layers[0] if p == 1 else LoopStack.default_config().set(
                num_layers=p, layers=list(layers[:p])
            )
            return ScanStack.default_config().set(num_layers=n // p, layer=one, unroll=unroll)
    return loop if n > 1 else ScanStack.default_config().set(num_layers=1, layer=layers[0])


def swapped_stack(cfg: Any, params: Any = None) -> tuple[Any, Any]:
    """A stack of one repeated layer in its other form, the same model: a `ScanStack`
    (params {"layer": [n, ...]}) as the `LoopStack` of its layer ({"layer0": ...,
    "layer{n-1}"}) and back, fields carried over, `params` (the stack's; None: config
    only) laid out to match. (None, None) for a scanned group or a list of layers."""
    klass, n = getattr(cfg, "klass", None), int(getattr(cfg, "num_layers", None) or 0)
    if klass is ScanStack and getattr(cfg.layer, "klass", None) is not LoopStack:
        out: Any = LoopStack.default_config()
    elif klass is LoopStack and cfg.layers is None and n:
        out = ScanStack.default_config()
    else:
        return None, None
    src = cfg.clone()  # No sub-config shared with `cfg`.
    for key in (k for k in out.keys() if k != "klass" and k in src):
        setattr(out, key, getattr(src, key))
    if params is None:
        return out, None
    if klass is ScanStack:
        return out, {f"layer{i}": jax.tree.map(lambda a, i=i: a[i], params["layer"])
                     for i in range(n)}
    xp = np if isinstance(jax.tree.leaves(params)[0], np.ndarray) else jnp
    return out, {"layer": jax.tree.map(lambda *a: xp.stack(a),
                                       *[params[f"layer{i}"] for i in range(n)])}
