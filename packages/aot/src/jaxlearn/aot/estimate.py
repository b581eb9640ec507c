"""Analytic per-device memory and step time of a layout, for ranking layouts before
compiling any (`jaxlearn.aot.plan`).

    shape = model_shape(cfg)                      # widths, depth, tokens; None parts: unknown
    est = estimate(shape, sizes, rules, target, remat="nothing_saveable", attention="blockwise",
                   microbatches=1, calibration=cal)

Memory per device = the sharded state (exact: every parameter's shard from its logical axes
and the mesh rules, times `1 + optimizer state per param byte` from a compiled baseline, 3
for Adam's two f32 moments by default) + gradients (one params shard) + the activations the
backward keeps (per layer and token: the layer input always; the matmul outputs with a dots
policy or no remat; the named ones with `save_names:` (none on device with
`offload_names:`); the [heads, seq] attention weights with no remat and einsum attention)
+ temporaries, a line (fixed + per token of a microbatch over the model shards) fitted
to what compiled layouts needed beyond the rest (0 until a compile measured it).

Time = max(compute, communication): compute = 6 x params x tokens (+ causal attention)
x the remat recompute factor / devices, stretched by the pipeline bubble;
communication = FSDP all-gathers (forward, backward) and gradient reduce-scatter per
microbatch, the data-parallel gradient all-reduce, and the tensor-parallel activation
all-reduces (4 per layer), each over the slower link when its mesh axis spans hosts.

These are estimates for ranking: the planner compiles the best of them and reports the
compiler's figures.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional, Sequence

from jaxlearn.config import ConfigBase, visit
from jaxlearn.mesh import logical_to_partition_spec

_KEEPS_DOTS = re.compile(r"dots.*")
# Extra forward passes a remat policy recomputes in the backward, in forward-pass units.
_RECOMPUTE = {"none": 0.0, "everything_saveable": 0.0, "dots_saveable": 0.1,
              "dots_with_no_batch_dims_saveable": 0.15, "nothing_saveable": 1.0}
# Axis order of the mesh, outermost (slowest link) first.
_ORDER = ("pipeline", "data", "fsdp", "expert", "seq", "model")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: parameters and, for a transformer stack, its
    widths (0 when the config has none)."""

    param_specs: tuple[Any, ...]
    param_bytes: int  # Bytes of one parameter element (master copy).
    compute_bytes: int  # Bytes of one activation element.
    global_batch: int
    seq_len: int
    num_layers: int = 0
    dim: int = 0
    heads: int = 0
    q_width: int = 0
    kv_width: int = 0
    mlp_width: int = 0  # Sum of the FFN input projections' widths.
    mlp_hidden: int = 0

    @property
    def num_params(self) -> int:
        return sum(math.prod(s.shape) for s in self.param_specs)


@dataclasses.dataclass
class Calibration:
    """Figures measured on compiled layouts that the formulas cannot know."""

    opt_bytes_per_param_byte: float = 2.0
    # (tokens per device and microbatch / model shards, temporaries measured) per compile.
    temp_points: list[tuple[int, float]] = dataclasses.field(default_factory=list)

    def temp_bytes(self, tokens: float) -> int:
        """Temporaries for `tokens`: a line fixed + per-token through the measured points
        (least squares, both terms >= 0); through the origin with one point; 0 with none."""
        pts = self.temp_points
        if not pts:
            return 0
        xs = [float(t) for t, _ in pts]
        ys = [max(0.0, r) for _, r in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var == 0:
            slope, fixed = my / mx if mx else 0.0, 0.0
        else:
            slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var)
            fixed = max(0.0, my - slope * mx)
        return int(fixed + slope * tokens)


@dataclasses.dataclass(frozen=True)
class Estimate:
    state_bytes: int
    gradient_bytes: int
    activation_bytes: int
    temp_bytes: int
    compute_seconds: float
    comm_seconds: float

    @property
    def required_bytes(self) -> int:
        return self.state_bytes + self.gradient_bytes + self.activation_bytes + self.temp_bytes

    @property
    def floor_bytes(self) -> int:
        """What no compiler can avoid (everything but temporaries)."""
        return self.state_bytes + self.gradient_bytes + self.activation_bytes

    @property
    def step_seconds(self) -> float:
        return max(self.compute_seconds, self.comm_seconds)


def find_int_field(cfg: Any, field: str) -> Optional[Any]:
    """The first (depth-first) config under `cfg` whose `field` is an int, or None."""
    found: list[Any] = []

    def enter(path: str, value: Any) -> bool:
        if not found and isinstance(value, ConfigBase) and field in value \
                and isinstance(getattr(value, field), int):
            found.append(value)
        return bool(found)

    visit(cfg, enter)
    return found[0] if found else None


def model_shape(cfg: ConfigBase, param_specs: Sequence[Any], global_batch: int) -> ModelShape:
    """The model of trainer config `cfg` as the estimate needs it."""
    dtype = str(getattr(cfg.model, "dtype", "float32"))
    pdtype = str(getattr(cfg.model, "param_dtype", "float32"))
    seq = int(getattr(cfg.input, "seq_len", 0) or 0)
    base = dict(param_specs=tuple(param_specs), param_bytes=2 if "16" in pdtype else 4,
                compute_bytes=2 if "16" in dtype else 4, global_batch=global_batch,
                seq_len=seq)
    stack = find_int_field(cfg, "num_layers")
    layer = getattr(stack, "layer", None)
    attn, ffn = getattr(layer, "self_attention", None), getattr(layer, "feed_forward", None)
    dim = getattr(find_int_field(cfg, "dim"), "dim", None)
    if stack is None or attn is None or ffn is None or not isinstance(dim, int):
        return ModelShape(**base)  # type: ignore[arg-type]
    head_dim = attn.head_dim or dim // attn.num_heads
    hidden = int(getattr(ffn, "hidden_dim", 0) or 0)
    gates = len(ffn.activation) if isinstance(getattr(ffn, "activation", None), tuple) else 1
    return ModelShape(num_layers=int(stack.num_layers), dim=dim, heads=int(attn.num_heads),
                      q_width=attn.num_heads * head_dim,
                      kv_width=(attn.num_kv_heads or attn.num_heads) * head_dim,
                      mlp_width=hidden * gates, mlp_hidden=hidden,
                      **base)  # type: ignore[arg-type]


def param_shard_bytes(shape: ModelShape, rules: Any, sizes: dict[str, int]) -> int:
    """Bytes of one device's shard of every parameter (master dtype)."""
    total = 0
    for spec in shape.param_specs:
        ps = logical_to_partition_spec(spec.mesh_axes, rules, sizes, shape=spec.shape)
        n = 1
        for dim, entry in zip(spec.shape, tuple(ps) + (None,) * len(spec.shape)):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            n *= -(-dim // math.prod(sizes.get(a, 1) for a in axes))
        total += n * shape.param_bytes
    return total


def activation_bytes(shape: ModelShape, tokens: int, model_shards: int, remat: str,
                     attention: str) -> int:
    """Bytes the backward keeps of the stack's activations for `tokens` tokens per device
    (heads / MLP split `model_shards` ways); `remat` "none" or a policy name."""
    if not shape.num_layers:
        return 0
    m = max(1, model_shards)
    dots = (shape.q_width + 2 * shape.kv_width + shape.mlp_width) // m + 2 * shape.dim
    named = {"q_proj": shape.q_width // m, "k_proj": shape.kv_width // m,
             "v_proj": shape.kv_width // m, "context": shape.q_width // m,
             "ffn_hidden": shape.mlp_width // m, "ffn_activation": shape.mlp_hidden // m,
             "residual": shape.dim}
    per_token = shape.dim  # The layer's input: every policy keeps it.
    if remat == "none" or remat == "everything_saveable" or _KEEPS_DOTS.fullmatch(remat):
        per_token += dots
    elif remat.startswith("save_names:"):
        per_token += sum(named.get(n, 0) for n in remat.partition(":")[2].split(","))
    if remat == "none" and attention == "einsum":
        per_token += shape.heads // m * shape.seq_len
    return int(shape.num_layers * tokens * per_token * shape.compute_bytes)


def _link(axis: str, sizes: dict[str, int], per_granule: int, target: Any) -> float:
    """Bandwidth of the link an axis's collectives cross (DCN when it spans hosts)."""
    inner = math.prod(sizes.get(a, 1) for a in _ORDER[_ORDER.index(axis):])
    hw = target.hardware
    return hw.dcn_bytes_per_s if inner > per_granule else hw.fast_link_bytes_per_s


def estimate(shape: ModelShape, sizes: dict[str, int], rules: Any, target: Any, *,
             remat: str, attention: str, microbatches: int, pipeline_microbatches: int = 1,
             calibration: Optional[Calibration] = None, mfu: float = 0.5) -> Estimate:
    """Per-device memory and step time of one layout (see the module doc)."""
    cal = calibration or Calibration()
    n = target.num_devices
    per_granule = n // max(1, target.num_granules)
    stages, m = sizes.get("pipeline", 1), sizes.get("model", 1)
    # A pipeline's stage axis splits the (stacked) layer parameters; counted on all.
    params = param_shard_bytes(shape, rules, {k: v for k, v in sizes.items()
                                              if k != "pipeline"}) // max(1, stages)
    batch_shards = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("expert", 1)
    tokens = shape.global_batch * shape.seq_len // max(1, batch_shards * microbatches)
    tokens //= max(1, sizes.get("seq", 1))
    acts = activation_bytes(shape, tokens, m, remat, attention) // max(1, stages)
    # Temporaries scale with the tokens of one microbatch, split over the model axis.
    temp = cal.temp_bytes(tokens / m)  # A pipeline holds all its microbatches' buffers.
    # Compute: 6 N T, causal attention 6 L T seq d, remat recompute, pipeline bubble.
    global_tokens = shape.global_batch * shape.seq_len
    flops = 6.0 * shape.num_params * global_tokens
    flops += 6 * shape.num_layers * global_tokens * shape.seq_len * shape.q_width // 2
    flops *= 1 + _RECOMPUTE.get(remat, 0.3) / 3
    bubble = (pipeline_microbatches + stages - 1) / pipeline_microbatches if stages > 1 else 1
    hw = target.hardware
    compute = flops / n * bubble / (hw.peak_bf16_flops * mfu)
    # Communication per device, bytes over each axis's link.
    gathered = params * shape.compute_bytes / shape.param_bytes  # One shard, compute dtype.
    comm = 0.0
    f, d = sizes.get("fsdp", 1), sizes.get("data", 1)
    if f > 1:
        per_mb = 3 * gathered * (f - 1)  # All-gather fwd + bwd, reduce-scatter grads.
        comm += microbatches * per_mb / _link("fsdp", sizes, per_granule, target)
    if d > 1:
        comm += 2 * params * (d - 1) / d / _link("data", sizes, per_granule, target)
    if m > 1:
        act = tokens * microbatches * shape.dim * shape.compute_bytes
        comm += 4 * shape.num_layers / stages * 2 * act * (m - 1) / m / _link(
            "model", sizes, per_granule, target)
    return Estimate(state_bytes=int(params * (1 + cal.opt_bytes_per_param_byte)),
                    gradient_bytes=params, activation_bytes=acts, temp_bytes=temp,
                    compute_seconds=compute, comm_seconds=comm)


__all__ = ["Calibration", "Estimate", "ModelShape", "activation_bytes", "estimate",
           "model_shape", "param_shard_bytes"]
