"""Pipeline parallelism for the scanned transformer stack (GPipe and circular schedules).

`PipelineStack` is a drop-in for `ScanStack` (same `num_layers` and `layer`) whose layer
parameters are stacked `[stage, layers_per_stage, ...]` with logical axes
`("stage", "layers", ...)`; the mesh rule `("stage", "pipeline")` shards the stage axis
over the `pipeline` mesh axis. The schedule is plain JAX (the MaxText/praxis "shift
register"): a state buffer `[stage, microbatch, seq, embed]` (logical axes
`("stage", "batch", "seq", "embed")`) holds what every stage works on; each iteration runs
the stage function vmapped over stages, then rotates the buffer one stage forward with
`jnp.roll`, which the SPMD partitioner turns into a collective-permute when the stage axis
is sharded. Nothing names a physical axis, so the other axes (data, fsdp, model, expert,
seq) shard exactly as in `ScanStack` and compose with it.

Layouts. With S stages, R repeats and K layers per stage per repeat (L = S * R * K):
global layer `l = (r * S + s) * K + k` lives at `params[s, r * K + k]`
(`to_stage_layout` / `from_stage_layout` convert `[L, ...] <-> [S, R * K, ...]`).

Schedules (M microbatches, strided: microbatch m holds batch rows m, m + M, ...):
  * "gpipe" (R = 1): stage s runs layers [s*K, (s+1)*K) on microbatch t - s at iteration
    t, for M + S - 1 iterations (bubble fraction (S-1)/(M+S-1)).
  * "circular" (interleaved / virtual stages, R = num_repeats, default L // S so K = 1):
    stage s runs work unit u = t - s = (repeat r, microbatch m) = divmod(u, M), i.e.
    microbatches circle the ring R times, for M * R + S - 1 iterations (bubble
    (S-1)/(M*R+S-1)). The last stage's output of (m, r) waits in the microbatch buffer
    until stage 0 takes it for (m, r + 1), which needs M >= S.
Both are forward schedules; the backward pass is the reverse-mode transpose of the scan
(all forwards, then all backwards, as GPipe). 1F1B is not implemented.

Numerics: equal to `ScanStack` on the same weights (init gives the same weights for the
same key, restacked). Per-layer module outputs and summaries (e.g. MoE `aux_loss`) are the
mean over microbatches, recorded `[num_layers, ...]` under `layer` as in `ScanStack`; they
equal ScanStack's exactly when they are token means (router z-loss) and differ slightly
when they are not (the MoE load-balance loss is a product of means: the same semantics as
gradient accumulation). State updates inside the pipelined layer are not supported.

Decoding (`init_states`, `prefill`, `extend_step`) is not pipelined: it scans all layers in
global order over the same parameters (read `[L, ...]` through `from_stage_layout`), with
the same `[layers, ...]` caches as `ScanStack`. Under a pipeline-sharded mesh that scan
gathers each stage's weights as it reaches them; serve pipelined checkpoints on a mesh
without a pipeline axis when latency matters.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxlearn.config import REQUIRED, ConfigBase, replace_config
from jaxlearn.layers.transformer import ScanStack, StackedDecode
from jaxlearn.module import (
    Module,
    ModuleError,
    OutputCollection,
    ParameterSpec,
    child_key,
    remat,
    spec_tree_map,
    stack_spec,
    with_logical_constraint,
)
from jaxlearn.module.context import InvocationContext, fold_in_name, push_context

Array = jax.Array
SCHEDULES = ("gpipe", "circular")
_STAGE_AXES = ("stage", "batch", "seq", "embed")
_MICRO_AXES = (None, "batch", "seq", "embed")

__all__ = [
    "SCHEDULES",
    "PipelineConfigError",
    "PipelineStack",
    "StageLayout",
    "from_stage_layout",
    "pipeline_config",
    "use_pipeline",
    "to_stage_layout",
]


class PipelineConfigError(ValueError):
    """An invalid PipelineStack config or input; the message names the config path."""


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """S stages x R repeats x K layers per stage and repeat (num_layers = S * R * K)."""

    num_stages: int
    num_repeats: int
    layers_per_repeat: int

    @property
    def num_layers(self) -> int:
        return self.num_stages * self.num_repeats * self.layers_per_repeat

    @property
    def layers_per_stage(self) -> int:
        """Length of the "layers" axis of the stage params (R * K)."""
        return self.num_repeats * self.layers_per_repeat

    def global_layer(self, stage: int, index: int) -> int:
        """The global layer held at `params[stage, index]`."""
        r, k = divmod(index, self.layers_per_repeat)
        return (r * self.num_stages + stage) * self.layers_per_repeat + k


def to_stage_layout(tree: Any, num_stages: int, num_repeats: int = 1) -> Any:
    """Leaves `[num_layers, ...]` (ScanStack order) -> `[num_stages, R * K, ...]`."""
    s, r = num_stages, num_repeats

    def one(a: Any) -> Any:
        k = a.shape[0] // (s * r)
        if k * s * r != a.shape[0]:
            raise PipelineConfigError(
                f"to_stage_layout: {a.shape[0]} layers do not split into {s} stages x "
                f"{r} repeats"
            )
        rest = a.shape[1:]
        return jnp.swapaxes(a.reshape(r, s, k, *rest), 0, 1).reshape(s, r * k, *rest)

    return jax.tree.map(one, tree)


def from_stage_layout(tree: Any, num_stages: int, num_repeats: int = 1) -> Any:
    """Leaves `[num_stages, R * K, ...]` -> `[num_layers, ...]` (ScanStack order)."""
    s, r = num_stages, num_repeats

    def one(a: Any) -> Any:
        if a.shape[0] != s or a.shape[1] % r:
            raise PipelineConfigError(
                f"from_stage_layout: shape {a.shape} is not [{s}, {r} * K, ...]"
            )
        k, rest = a.shape[1] // r, a.shape[2:]
        return jnp.swapaxes(a.reshape(s, r, k, *rest), 0, 1).reshape(s * r * k, *rest)

    return jax.tree.map(one, tree)


# step(layer_state, key, carry, x) -> ((carry, y), OutputCollection)
_Step = Callable[[Any, Any, Any, Any], tuple[tuple[Any, Any], OutputCollection]]


class PipelineStack(StackedDecode):
    """`num_layers` copies of `layer` run as a pipeline over `num_stages` stages (see the
    module docstring). Params `{"layer": [stage, layers_per_stage, ...]}`.

    num_microbatches: None means num_stages; must divide the batch.
    schedule: "gpipe" | "circular".
    num_repeats: circular only; None means num_layers // num_stages (one layer per virtual
        stage). gpipe always has one repeat.
    """

    class Config(StackedDecode.Config):
        num_stages: int = REQUIRED
        num_microbatches: Optional[int] = None
        schedule: str = "gpipe"
        num_repeats: Optional[int] = None

    def __init__(self, cfg: "PipelineStack.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        where = self.path()

        def bad(field: str, why: str) -> PipelineConfigError:
            return PipelineConfigError(f"{where}.{field}={getattr(c, field)!r}: {why}")

        if c.schedule not in SCHEDULES:
            raise bad("schedule", f"must be one of {SCHEDULES}")
        if not isinstance(c.num_stages, int) or c.num_stages < 1:
            raise bad("num_stages", "must be an int >= 1")
        if c.num_layers % c.num_stages:
            raise bad("num_stages", f"must divide num_layers={c.num_layers}")
        if c.num_microbatches is not None and c.num_microbatches < 1:
            raise bad("num_microbatches", "must be >= 1 (or None: num_stages)")
        if c.schedule == "gpipe":
            if c.num_repeats not in (None, 1):
                raise bad("num_repeats", "the gpipe schedule has one repeat; use 'circular'")
            repeats = 1
        else:
            repeats = c.num_repeats or c.num_layers // c.num_stages
            if c.num_layers % (c.num_stages * repeats):
                raise bad(
                    "num_repeats",
                    f"num_stages * num_repeats must divide num_layers={c.num_layers}",
                )
            if repeats > 1 and self.num_microbatches < c.num_stages:
                raise PipelineConfigError(
                    f"{where}: the circular schedule needs num_microbatches >= num_stages "
                    f"(got {self.num_microbatches} < {c.num_stages})"
                )
        self._layout = StageLayout(c.num_stages, repeats, c.num_layers // (c.num_stages * repeats))
        self._add_child("layer", c.layer.clone(input_dim=c.input_dim))

    @property
    def layout(self) -> StageLayout:
        return self._layout

    @property
    def num_microbatches(self) -> int:
        c = self.config
        return c.num_microbatches if c.num_microbatches is not None else c.num_stages

    def create_parameter_specs_recursively(self) -> dict[str, Any]:
        lo = self._layout
        specs: dict[str, Any] = super().create_parameter_specs_recursively()
        if "layer" in specs:
            specs["layer"] = spec_tree_map(
                lambda s: stack_spec(stack_spec(s, lo.layers_per_stage), lo.num_stages, "stage")
                if isinstance(s, ParameterSpec)
                else s,
                specs["layer"],
            )
        return specs

    def initialize_parameters_recursively(self, prng_key: Array) -> dict[str, Any]:
        """The ScanStack initial params for the same key, in the stage layout."""
        layer = self.children["layer"]
        keys = jax.random.split(fold_in_name(prng_key, "layer"), self.config.num_layers)
        params = jax.vmap(layer.initialize_parameters_recursively)(keys)
        if not params:
            return {}
        return {"layer": to_stage_layout(params, self._layout.num_stages, self._layout.num_repeats)}

    def _step(self, ctx: InvocationContext, fn: Callable[[Module, Any, Any], Any]) -> _Step:
        """One layer call `fn(layer, carry, x) -> (carry, y)` in the layer's context, given
        its state and key; rematerialised with the layer's `remat_spec` in training."""
        child = self.children["layer"]

        def step(state: Any, key: Any, carry: Any, x: Any) -> tuple[Any, OutputCollection]:
            oc = OutputCollection()
            sub = InvocationContext(child.name, ctx, child, state, oc, ctx.is_training, key)
            with push_context(sub):
                return fn(child, carry, x), oc

        spec = child.config.remat_spec
        if ctx.is_training and spec is not None:
            step = remat(step, spec)
        return step

    @staticmethod
    def _scan(step: _Step, states: Any, keys: Any, carry: Any, xs: Any, n: int) -> tuple:
        def body(carry: Any, inp: Any) -> tuple[Any, Any]:
            state, key, x = inp
            (carry, y), oc = step(state, key, carry, x)
            return carry, (y, oc)

        carry, (ys, oc) = lax.scan(body, carry, (states, keys, xs), length=n)
        return carry, ys, oc

    def _layer_keys(self, ctx: InvocationContext) -> Optional[Array]:
        """Layer l's key, as ScanStack derives it (`[num_layers]` keys, or None)."""
        base = child_key(ctx.prng_key, "layer", "scan")
        return None if base is None else jax.random.split(base, self.config.num_layers)

    def _record(self, ctx: InvocationContext, oc: OutputCollection) -> None:
        if jax.tree.leaves(oc.state_updates):
            raise ModuleError(
                f"{self.path()}: state updates inside a pipelined layer are not supported"
            )
        out = ctx.child_collection("layer")
        out.summaries.update(oc.summaries)
        out.module_outputs.update(oc.module_outputs)

    def forward(
        self, x: Array, positions: Optional[Array] = None, segment_ids: Optional[Array] = None
    ) -> Array:
        """x [batch, seq, embed] -> [batch, seq, embed] through the pipeline schedule."""
        ctx = self._context()
        lo, m_count = self._layout, self.num_microbatches
        s_count, r_count, k_count = lo.num_stages, lo.num_repeats, lo.layers_per_repeat
        batch = x.shape[0]
        if batch % m_count:
            raise PipelineConfigError(
                f"{self.path()}: batch size {batch} is not divisible by "
                f"num_microbatches={m_count}"
            )
        mb = batch // m_count
        pos_mb, seg_mb = _to_micro(positions, m_count), _to_micro(segment_ids, m_count)
        buf = with_logical_constraint(_to_micro(x, m_count), _MICRO_AXES)  # type: ignore[arg-type]
        params = self.parameters.get("layer", {})
        keys = self._layer_keys(ctx)
        stage_keys = None if keys is None else to_stage_layout(keys, s_count, r_count)

        def call(layer: Module, carry: Any, _: Any) -> tuple[Any, None]:
            h, pos, seg = carry
            return (layer(h, pos, seg), pos, seg), None

        step = self._step(ctx, call)

        def stage_fn(state: Any, skeys: Any, h: Array, pos: Any, seg: Any) -> tuple:
            (h, _, _), _, oc = self._scan(step, state, skeys, (h, pos, seg), None, k_count)
            return h, oc

        stage_ids = jnp.arange(s_count)
        units = m_count * r_count

        def iteration(carry: tuple[Array, Array], t: Array) -> tuple[tuple, tuple]:
            prev, buf = carry
            u = t - stage_ids
            valid = (u >= 0) & (u < units)
            u = jnp.clip(u, 0, units - 1)
            m, r = u % m_count, u // m_count
            first = lax.dynamic_index_in_dim(buf, t % m_count, 0, keepdims=True)
            h = jnp.where((stage_ids == 0)[:, None, None, None], first, jnp.roll(prev, 1, 0))
            h = with_logical_constraint(h, _STAGE_AXES)
            pos = None if pos_mb is None else pos_mb[m]
            seg = None if seg_mb is None else seg_mb[m]
            skeys = _select_repeat(stage_keys, r, r_count, k_count)
            if skeys is not None and m_count > 1:  # Layer keys differ per microbatch.
                fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))
                skeys = jax.vmap(fold)(skeys, m)
            out, oc = jax.vmap(stage_fn)(_select_repeat(params, r, r_count, k_count), skeys,
                                         h, pos, seg)
            out = with_logical_constraint(out, _STAGE_AXES)
            # The last stage hands its microbatch back to the buffer (stage 0 takes it up
            # again on the next repeat; after the last repeat it is the output).
            last_m = m[-1]
            kept = lax.dynamic_index_in_dim(buf, last_m, 0, keepdims=False)
            new = jnp.where(valid[-1], out[-1], kept)
            buf = lax.dynamic_update_index_in_dim(buf, new, last_m, 0)
            buf = with_logical_constraint(buf, _MICRO_AXES)
            return (out, buf), (oc, valid, r)

        state0 = with_logical_constraint(
            jnp.zeros((s_count, mb, *x.shape[1:]), x.dtype), _STAGE_AXES
        )
        num_iterations = units + s_count - 1
        (_, buf), (oc, valid, rep) = lax.scan(iteration, (state0, buf), jnp.arange(num_iterations))
        self._record(ctx, _per_layer_means(oc, valid, rep, lo, m_count))
        y = jnp.swapaxes(buf, 0, 1).reshape(x.shape)
        return with_logical_constraint(y, ("batch", "seq", "embed"))

    def _scan_layers(self, fn: Callable[[Module, Any, Any], Any], carry: Any, xs: Any) -> tuple:
        """Every layer in order over the whole batch (decoding is not pipelined: module
        docstring); the decode API is `StackedDecode`'s."""
        ctx = self._context()
        lo = self._layout
        states = from_stage_layout(self.parameters.get("layer", {}), lo.num_stages, lo.num_repeats)
        carry, ys, oc = self._scan(
            self._step(ctx, fn), states, self._layer_keys(ctx), carry, xs, lo.num_layers
        )
        self._record(ctx, oc)
        return carry, ys


def _to_micro(a: Optional[Array], num_microbatches: int) -> Optional[Array]:
    """[batch, ...] -> [M, batch / M, ...]; microbatch m = rows m, m + M, ... so that a batch
    sharding stays on the per-microbatch batch axis."""
    if a is None:
        return None
    return jnp.swapaxes(a.reshape(-1, num_microbatches, *a.shape[1:]), 0, 1)


def _select_repeat(tree: Any, r: Array, num_repeats: int, layers_per_repeat: int) -> Any:
    """Leaves [S, R * K, ...] -> the repeat r[s] of each stage s: [S, K, ...] (r: [S])."""
    if num_repeats == 1:
        return tree

    def one(a: Any) -> Any:
        def pick(a_s: Any, r_s: Array) -> Any:
            split = a_s.reshape(num_repeats, layers_per_repeat, *a_s.shape[1:])
            return lax.dynamic_index_in_dim(split, r_s, 0, keepdims=False)

        return jax.vmap(pick)(a, r)

    return jax.tree.map(one, tree)


def _per_layer_means(
    oc: OutputCollection, valid: Array, rep: Array, lo: StageLayout, num_microbatches: int
) -> OutputCollection:
    """Outputs recorded per (iteration n, stage s, layer k) -> per global layer, averaged
    over the microbatches (bubble iterations masked out)."""
    r_ids = jnp.arange(lo.num_repeats)
    sel = valid[:, :, None] & (rep[:, :, None] == r_ids)  # [N, S, R]

    def one(a: Array) -> Array:
        rest = a.shape[3:]
        mask = sel.reshape(*sel.shape, 1, *(1,) * len(rest))  # [N, S, R, 1, ...]
        v = a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.integer) else a
        total = jnp.sum(jnp.where(mask, v[:, :, None], 0), axis=0)  # [S, R, K, ...]
        mean = total / num_microbatches
        return jnp.swapaxes(mean, 0, 1).reshape(lo.num_layers, *rest).astype(a.dtype)

    return OutputCollection(
        summaries=jax.tree.map(one, oc.summaries),
        state_updates=oc.state_updates,
        module_outputs=jax.tree.map(one, oc.module_outputs),
    )


def pipeline_config(
    num_stages: int,
    num_microbatches: Optional[int] = None,
    *,
    schedule: str = "gpipe",
    num_repeats: Optional[int] = None,
) -> PipelineStack.Config:
    """A PipelineStack config to replace a ScanStack with (`replace_config` or the mesh
    package's `ReplaceConfigModifier`): `num_layers`, `layer`, `input_dim`, dtypes and
    `remat_spec` are carried over from the stack it replaces."""
    if schedule not in SCHEDULES:
        raise PipelineConfigError(f"pipeline_config: schedule must be one of {SCHEDULES}")
    return PipelineStack.default_config().set(
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule,
        num_repeats=num_repeats,
    )


def use_pipeline(
    cfg: ConfigBase,
    num_stages: int,
    num_microbatches: Optional[int] = None,
    *,
    schedule: str = "gpipe",
    num_repeats: Optional[int] = None,
    match: Any = ScanStack,
) -> ConfigBase:
    """A copy of `cfg` with every ScanStack (or whatever `match` selects, as in
    `replace_config`) turned into a PipelineStack over the same layers."""
    template = pipeline_config(
        num_stages, num_microbatches, schedule=schedule, num_repeats=num_repeats
    )
    return replace_config(cfg, match, template)
