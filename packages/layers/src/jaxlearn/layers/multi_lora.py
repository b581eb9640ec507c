"""Many LoRA adapters on one base model, chosen per batch row (serving).

`MultiLoraLinear` is a `Linear` (same `weight` / `bias` at the same paths) plus adapter
*banks*, one entry per adapter slot:

    lora_a     [slots, *in_dims, max_rank]
    lora_b     [slots, max_rank, *out_dims]
    lora_scale [slots]                       alpha / rank of the adapter in the slot

Slot 0 is "no adapter" (all zeros); an adapter of rank r < max_rank fills the first r
columns of A and rows of B and leaves the rest zero, which adds exactly nothing. Row b of
the input (its leading axis) uses slot s = rows[b]:

    y[b] = x[b] @ W (+ bias) + lora_scale[s] * (x[b] @ A[s]) @ B[s]

computed as two matmuls over all slots at once, never by merging weights: h = x @ A for
every slot ([rows, tokens, slots, r]), each row's own slot kept by a one-hot mask that
carries the scale, then h @ B summed over slots and ranks. The banks are read once per
call however many rows there are; gathering A and B per row (Punica's BGMV form) reads
them once per row, which on a CPU, where a decode step is bound by memory reads, costs
more once the rows outnumber the slots (measured: 0.79x -> 0.83x of the base model's
tok/s with 4 adapters mixed in 32 rows). Rows of different adapters share one call, and
the banks are plain arrays the engine writes into (`write_adapter`) without a
recompilation. When no row of a call has an adapter, the adapter matmuls are skipped at
run time (`lax.cond`).

The rows' slots are a side input of the call (`jaxlearn.module.side_input(ADAPTER_ROWS)`,
given to `functional(..., side_inputs={ADAPTER_ROWS: rows})` by the caller, e.g. the
inference runner): a per-row input that reaches every projection without each method
from `CausalLM.extend_step` down taking it. Without it (training, `Engine.logits`)
every row uses slot 0: the base model.

`use_multi_lora(cfg, params, slots=, max_rank=, targets=)` swaps the targeted `Linear`
children (the `use_lora` targets) for `MultiLoraLinear` and adds zero banks to the params.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlearn.config import replace_config
from jaxlearn.layers.dense import Linear
from jaxlearn.layers.lora import DEFAULT_TARGETS
from jaxlearn.module import Module, ParameterSpec, side_input, zeros

# The side input holding each row's adapter slot (int32 [rows]).
ADAPTER_ROWS = "adapter_rows"
BANKS = ("lora_a", "lora_b", "lora_scale")


class MultiLoraLinear(Linear):
    """`Linear` + per-slot LoRA banks, one slot per row (module docstring)."""

    class Config(Linear.Config):
        # Adapter slots, slot 0 (no adapter) included.
        lora_slots: int = 2
        # Largest adapter rank a slot holds (smaller ranks are zero-padded).
        lora_max_rank: int = 8

    def __init__(self, cfg: "MultiLoraLinear.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        for field, low in (("lora_slots", 2), ("lora_max_rank", 1)):
            value = getattr(c, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{self.path()}.{field}: must be an int >= {low}, got {value!r}")

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        specs = super()._create_layer_parameter_specs()
        c = self.config
        n_in = len(self.in_shape)
        axes = tuple(c.weight_axes)
        specs["lora_a"] = ParameterSpec(
            (c.lora_slots, *self.in_shape, c.lora_max_rank), (None, *axes[:n_in], None),
            initializer=zeros())
        specs["lora_b"] = ParameterSpec(
            (c.lora_slots, c.lora_max_rank, *self.out_shape), (None, None, *axes[n_in:]),
            initializer=zeros())
        specs["lora_scale"] = ParameterSpec((c.lora_slots,), (None,), dtype=jnp.float32,
                                            initializer=zeros())
        return specs

    def forward(self, x: jax.Array, *, out_dtype: Any = None) -> jax.Array:
        y = super().forward(x, out_dtype=out_dtype)
        rows = side_input(ADAPTER_ROWS)
        if rows is None:
            return y
        if rows.ndim != 1 or x.ndim < 2 or x.shape[0] != rows.shape[0]:
            raise ValueError(f"{self.path()}: adapter rows {rows.shape} do not match the "
                             f"input's leading (row) axis {x.shape}")
        c, p = self.config, self.parameters
        k, n, r = math.prod(self.in_shape), math.prod(self.out_shape), c.lora_max_rank
        lead = x.shape[: x.ndim - len(self.in_shape)]
        x3 = x.astype(self.dtype).reshape(rows.shape[0], -1, k)  # [rows, tokens, in]

        def delta(_: Any) -> jax.Array:
            # Every slot's low-rank product, then each row's own kept (a one-hot x scale
            # mask over the slots): the banks are read once per call whatever the batch,
            # where gathering A and B per row reads them once per row.
            s = c.lora_slots
            a = p["lora_a"].reshape(s, k, r).astype(self.dtype)
            b = p["lora_b"].reshape(s, r, n).astype(self.dtype)
            h = jnp.einsum("btk,skr->btsr", x3, a, preferred_element_type=jnp.float32)
            keep = (rows[:, None] == jnp.arange(s)[None, :]) * p["lora_scale"][None, :]
            h = (h * keep[:, None, :, None]).astype(self.dtype)  # [rows, tokens, slots, r]
            return jnp.einsum("btsr,srn->btn", h, b, preferred_element_type=jnp.float32)

        def none(_: Any) -> jax.Array:
            return jnp.zeros((rows.shape[0], x3.shape[1], n), jnp.float32)

        d = lax.cond(jnp.any(rows != 0), delta, none, None)
        return y + d.reshape(*lead, *self.out_shape).astype(y.dtype)


def use_multi_lora(cfg: Any, params: Any, *, slots: int, max_rank: int,
                   targets: str = DEFAULT_TARGETS) -> tuple[Any, Any]:
    """(config, params) with every plain `Linear` whose config path fully matches
    `targets` (as `use_lora`) swapped for a `MultiLoraLinear` of `slots` slots (slot 0
    included) and `max_rank`, and zero banks added to `params` (stacked [layers, ...]
    under a ScanStack, as the model's own specs say). Raises if nothing matches."""
    pattern, matched = re.compile(targets), []

    def match(path: str, c: Any) -> bool:
        hit = "klass" in c and c.klass is Linear and c.dot is None and bool(
            pattern.fullmatch(path))
        if hit:
            matched.append(path)
        return hit

    def swap(old: Any, path: str) -> Any:
        return MultiLoraLinear.default_config().set(lora_slots=slots, lora_max_rank=max_rank)

    new = replace_config(cfg, match, swap, allow_no_match=True)
    if not matched:
        raise ValueError(f"use_multi_lora: targets {targets!r} match no Linear projection "
                         f"config (e.g. 'decoder.transformer.layer.self_attention.q_proj')")
    shapes = jax.eval_shape(new.instantiate().initialize_parameters_recursively,
                            jax.random.PRNGKey(0))
    return new, _with_zero_banks(params, shapes, "params")


def _with_zero_banks(params: Any, shapes: Any, where: str) -> Any:
    if not isinstance(shapes, dict):
        return params
    if not isinstance(params, dict):
        raise ValueError(f"use_multi_lora: {where} is not a dict of params")
    out = dict(params)
    for key, shape in shapes.items():
        if isinstance(shape, dict):
            out[key] = _with_zero_banks(params.get(key, {}), shape, f"{where}/{key}")
        elif key in BANKS and key not in params:
            out[key] = jnp.zeros(shape.shape, shape.dtype)
    return out


def bank_layers(model: Module) -> list[tuple[tuple[str, ...], MultiLoraLinear]]:
    """(param path, layer) of every `MultiLoraLinear` of an instantiated model."""
    out: list[tuple[tuple[str, ...], MultiLoraLinear]] = []

    def walk(m: Module, path: tuple[str, ...]) -> None:
        if isinstance(m, MultiLoraLinear):
            out.append((path, m))
        for name, child in m.children.items():
            walk(child, (*path, name))

    walk(model, ())
    return out


def _at(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def adapter_arrays(model: Module, params: Any, adapter: Any, *, rank: int, alpha: float,
                   ) -> dict[tuple[str, ...], dict[str, np.ndarray]]:
    """The bank entries of one adapter, {layer path: {"lora_a" [*lead, *in, max_rank],
    "lora_b" [*lead, max_rank, *out], "lora_scale" [*lead]}} (host, zero-padded to
    max_rank; lead: [layers] for stacked params), from `adapter`: params in the
    `LoraLinear` layout (`.../q_proj/adapter/lora_a [*lead, *in, rank]` and `lora_b
    [*lead, rank, *out]`; base weights may be there too and are ignored). Every
    `LoraLinear` adapter must land on a `MultiLoraLinear` of `model`; layers it does not
    cover get zeros. ValueError names the offending param path."""
    layers = bank_layers(model)
    covered = set()
    out = {}
    for path, layer in layers:
        bank = _at(params, path)
        c = layer.config
        if rank > c.lora_max_rank:
            raise ValueError(f"adapter rank {rank} exceeds the engine's max rank "
                             f"{c.lora_max_rank}")
        ab = _at(adapter, (*path, "adapter"))
        n_lead = bank["lora_a"].ndim - 2 - len(layer.in_shape)
        lead = tuple(bank["lora_a"].shape[:n_lead])
        a = np.zeros((*lead, *layer.in_shape, c.lora_max_rank), np.float32)
        b = np.zeros((*lead, c.lora_max_rank, *layer.out_shape), np.float32)
        scale = np.zeros(lead, np.float32)
        if ab is not None:
            covered.add(path)
            name = "/".join((*path, "adapter"))
            la, lb = np.asarray(ab["lora_a"], np.float32), np.asarray(ab["lora_b"], np.float32)
            want_a, want_b = (*lead, *layer.in_shape, rank), (*lead, rank, *layer.out_shape)
            if la.shape != want_a or lb.shape != want_b:
                raise ValueError(f"{name}: lora_a {la.shape} / lora_b {lb.shape}, expected "
                                 f"{want_a} / {want_b} (rank {rank})")
            a[..., :rank] = la
            b[(slice(None),) * n_lead + (slice(0, rank),)] = lb
            scale[...] = float(alpha) / rank
        out[path] = {"lora_a": a, "lora_b": b, "lora_scale": scale}
    stray = sorted("/".join(p) for p in _adapter_paths(adapter, ()) if p not in covered)
    if stray:
        raise ValueError(f"adapter params {stray[0]}/adapter (and {len(stray) - 1} more) "
                         f"have no multi-LoRA layer in the engine (its lora targets)")
    return out


def _adapter_paths(tree: Any, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    if not isinstance(tree, dict):
        return []
    if isinstance(tree.get("adapter"), dict) and "lora_a" in tree["adapter"]:
        return [path]
    return [p for k, v in tree.items() for p in _adapter_paths(v, (*path, k))]


def write_adapter(params: Any, arrays: dict[tuple[str, ...], dict[str, Any]],
                  slot: int) -> Any:
    """`params` with bank entry `slot` of every layer in `arrays` (`adapter_arrays`, or
    zeros to clear a slot) replaced; new arrays of the same shapes, dtypes and shardings,
    so compiled programs taking the params run on them as they are."""
    out = dict(params)
    for path, entry in arrays.items():
        node = out
        for key in path[:-1]:
            node[key] = dict(node[key])
            node = node[key]
        layer = dict(node[path[-1]])
        index = (slice(None),) * (layer["lora_scale"].ndim - 1) + (slot,)  # [*lead, slots]
        for name, value in entry.items():
            bank = layer[name]
            new = bank.at[index].set(jnp.asarray(value, bank.dtype))
            sharding = getattr(bank, "sharding", None)
            layer[name] = jax.device_put(new, sharding) if sharding is not None else new
        node[path[-1]] = layer
    return out
