"""What a compiled step costs per device, and the printed report.

    step = analyze_compiled("train_step", compiled, target, mesh_devices)   # StepReport
    print(format_report(report))                                           # AOTReport

Figures, per device:
- memory (`compiled.memory_analysis()`, `memory_figures`): arguments (the sharded state and
  batch), outputs, aliased (donated) bytes, temporaries, code; `required = max(peak, args +
  outputs - alias + temp + code)` is checked against `hbm_utilization * HBM` from the
  hardware catalogue (or `hbm_bytes` given to `resolve_target`);
- FLOPs: `cost_analysis()["flops"]` times the ratio of per-step to static FLOPs that
  `jaxlearn.aot.hlo` counts in the HLO (cost_analysis counts a `while` body once, so a
  scanned layer stack or gradient accumulation would look `trip count` times cheaper);
- collectives: counts and bytes sent from `compiled.as_text()` (`jaxlearn.aot.hlo`);
- time model: `t_compute = flops / (peak_bf16_flops * mfu)`, `t_comm = bytes_fast_link /
  fast_link_bytes_per_s + bytes_dcn / dcn_bytes_per_s` (ring-algorithm bytes, each
  collective on its slowest link, no hierarchical algorithms), and the predicted step time
  `max(t_compute, t_comm)` (communication overlapped with compute, as XLA's async
  collectives aim for); `t_compute + t_comm` is the no-overlap bound.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np

from jaxlearn.aot.hlo import HloStats, analyze_hlo, granule_lookup
from jaxlearn.aot.target import Target
from jaxlearn.mesh import HybridMeshShape

GiB = 2**30
DEFAULT_MFU = 0.5
DEFAULT_HBM_UTILIZATION = 0.95


@dataclasses.dataclass
class StepReport:
    """Per-device figures of one compiled step."""

    name: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    peak_bytes: int
    required_bytes: int
    hbm_bytes: int
    usable_hbm_bytes: int
    fits: bool
    flops_xla: float
    flops: float
    compute_seconds: float
    comm_seconds: float
    step_seconds: float
    step_seconds_no_overlap: float
    collectives: dict[str, Any]
    collective_bytes_fast_link: float
    collective_bytes_dcn: float
    compile_seconds: float
    state_bytes: Optional[int] = None
    state_breakdown: dict[str, int] = dataclasses.field(default_factory=dict)
    unknown_trip_counts: int = 0

    @property
    def collective_counts(self) -> dict[str, int]:
        return {k: int(v["count"]) for k, v in self.collectives.items()}


@dataclasses.dataclass
class AOTReport:
    """What `aot_compile` found; `to_dict()` is the `--json` form."""

    selector: str
    hardware: str
    backend: str
    topology: Optional[str]
    num_devices: int
    num_granules: int
    hbm_bytes: int
    peak_flops_per_device: float
    fast_link_bytes_per_s: float
    dcn_bytes_per_s: float
    mfu: float
    hbm_utilization: float
    mesh_axis_names: tuple[str, ...]
    mesh_shape: Any
    mesh: dict[str, int]
    num_microbatches: int
    remat: dict[str, str]
    batch: dict[str, tuple[list[int], str]]
    steps: dict[str, StepReport]
    inference: str
    notes: list[str]

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.steps.values())

    @property
    def train(self) -> StepReport:
        return self.steps["train_step"]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if isinstance(self.mesh_shape, HybridMeshShape):
            out["mesh_shape"] = {"ici_mesh_shape": list(self.mesh_shape.ici_mesh_shape),
                                 "dcn_mesh_shape": list(self.mesh_shape.dcn_mesh_shape)}
        else:
            out["mesh_shape"] = list(self.mesh_shape)
        out["fits"] = self.fits
        return out


def memory_figures(compiled: Any) -> dict[str, int]:
    """Per-device bytes of a compiled step from `memory_analysis()`: {"argument", "output",
    "alias", "temp", "code", "peak"} (0 where the backend does not say)."""
    ma = compiled.memory_analysis()
    if isinstance(ma, (list, tuple)):
        ma = ma[0]
    get = (lambda k: int(getattr(ma, k, 0) or 0)) if ma is not None else (lambda k: 0)
    return {
        "argument": get("argument_size_in_bytes"),
        "output": get("output_size_in_bytes"),
        "alias": get("alias_size_in_bytes"),
        "temp": get("temp_size_in_bytes"),
        "code": get("generated_code_size_in_bytes"),
        "peak": get("peak_memory_in_bytes"),
    }


def xla_flops(compiled: Any) -> float:
    """FLOPs of a compiled step by `cost_analysis()` (a `while` body counted once)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0) or 0.0)


def state_bytes_per_device(abstract_state: Any) -> int:
    """Bytes of one device's shard of a tree of sharded ShapeDtypeStructs."""
    total = 0
    for leaf in jax.tree.leaves(abstract_state):
        shape = leaf.shape
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def state_breakdown(abstract_state: Any) -> dict[str, int]:
    """`state_bytes_per_device` per top-level entry (params, opt_state, ...)."""
    if not isinstance(abstract_state, Mapping):
        return {"state": state_bytes_per_device(abstract_state)}
    return {str(k): state_bytes_per_device(v) for k, v in abstract_state.items()}


def analyze_compiled(
    name: str,
    compiled: Any,
    target: Target,
    mesh_devices: Sequence[Any],
    *,
    mfu: float = DEFAULT_MFU,
    hbm_utilization: float = DEFAULT_HBM_UTILIZATION,
    compile_seconds: float = 0.0,
    abstract_state: Any = None,
) -> StepReport:
    """Memory, FLOPs, collectives and predicted time of one compiled step on `target`."""
    mem = memory_figures(compiled)
    total = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["code"]
    required = max(mem["peak"], total)
    usable = int(target.hbm_bytes * hbm_utilization)
    granule = granule_lookup(list(mesh_devices), target.granule_of_device)
    stats: HloStats = analyze_hlo(compiled.as_text(), len(mesh_devices),
                                  granule if target.num_granules > 1 else None)
    xla = xla_flops(compiled)
    # Loops: scale XLA's count (bodies once) by the HLO-level per-step / static ratio.
    ratio = stats.flops_per_step / stats.flops_static if stats.flops_static > 0 else 1.0
    flops = xla * max(ratio, 1.0)
    hw = target.hardware
    compute = flops / (hw.peak_bf16_flops * mfu) if mfu > 0 else float("inf")
    comm = (stats.collective_bytes_fast / hw.fast_link_bytes_per_s
            + stats.collective_bytes_slow / hw.dcn_bytes_per_s)
    return StepReport(
        name=name,
        argument_bytes=mem["argument"],
        output_bytes=mem["output"],
        alias_bytes=mem["alias"],
        temp_bytes=mem["temp"],
        code_bytes=mem["code"],
        peak_bytes=mem["peak"],
        required_bytes=required,
        hbm_bytes=target.hbm_bytes,
        usable_hbm_bytes=usable,
        fits=required <= usable,
        flops_xla=xla,
        flops=flops,
        compute_seconds=compute,
        comm_seconds=comm,
        step_seconds=max(compute, comm),
        step_seconds_no_overlap=compute + comm,
        collectives=stats.to_dict()["collectives"],
        collective_bytes_fast_link=stats.collective_bytes_fast,
        collective_bytes_dcn=stats.collective_bytes_slow,
        compile_seconds=compile_seconds,
        state_bytes=None if abstract_state is None else state_bytes_per_device(abstract_state),
        state_breakdown={} if abstract_state is None else state_breakdown(abstract_state),
        unknown_trip_counts=stats.unknown_trip_counts,
    )


# ---- printing -----------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    """1536 -> "1.50 KiB"."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def human_seconds(s: float) -> str:
    """0.0042 -> "4.2 ms"."""
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def format_report(report: AOTReport) -> str:
    """The human-readable report."""
    r = report
    mesh = " ".join(f"{k}={v}" for k, v in r.mesh.items() if v > 1) or "single device"
    where = (f"mock TPU topology {r.topology}" if r.backend == "tpu-topology"
             else f"fake CPU mesh of {r.num_devices} devices")
    lines = [
        f"target    {r.selector}: {r.num_devices} x {r.hardware} in {r.num_granules} "
        f"granule(s), HBM {human_bytes(r.hbm_bytes)}/device, peak "
        f"{r.peak_flops_per_device / 1e12:.4g} TFLOP/s/device",
        f"compiled  on {where}",
        f"mesh      {mesh}   shape {r.mesh_shape}",
        f"layout    microbatches {r.num_microbatches}; remat "
        + (", ".join(f"{k}={v}" for k, v in r.remat.items()) or "none"),
        "batch     " + ", ".join(f"{k}{v[0]}:{v[1]}" for k, v in r.batch.items()),
        "",
    ]
    rows = [["step", "args", "outputs", "temp", "required", f"usable HBM ({r.hbm_utilization:g})",
             "fits", "GFLOP/device", f"t_compute@{r.mfu:g}MFU", "t_comm", "t_step"]]
    for s in r.steps.values():
        rows.append([
            s.name, human_bytes(s.argument_bytes), human_bytes(s.output_bytes),
            human_bytes(s.temp_bytes), human_bytes(s.required_bytes),
            human_bytes(s.usable_hbm_bytes), "yes" if s.fits else "NO",
            f"{s.flops / 1e9:.4g}", human_seconds(s.compute_seconds),
            human_seconds(s.comm_seconds), human_seconds(s.step_seconds),
        ])
    lines.append(format_table(rows))
    for s in r.steps.values():
        lines.append("")
        crow = [[f"collectives ({s.name})", "count", "executed/step", "bytes sent/device",
                 "fast link", "DCN"]]
        for kind, c in s.collectives.items():
            crow.append([kind, str(c["count"]), f"{c['executions']:g}", human_bytes(c["bytes"]),
                         human_bytes(c["bytes_fast_link"]), human_bytes(c["bytes_dcn"])])
        lines.append(format_table(crow))
        if s.state_bytes is not None:
            parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in s.state_breakdown.items())
            lines.append(f"state per device {human_bytes(s.state_bytes)} ({parts}); peak reported "
                         f"{human_bytes(s.peak_bytes)}; aliased {human_bytes(s.alias_bytes)}; "
                         f"XLA flops {s.flops_xla:.4g} (loop-corrected {s.flops:.4g})")
    lines.append("")
    lines.append(f"inference {r.inference}")
    for note in r.notes:
        lines.append(f"note      {note}")
    verdict = "FITS" if r.fits else "DOES NOT FIT"
    lines.append(f"verdict   {verdict}: requires {human_bytes(r.train.required_bytes)} of "
                 f"{human_bytes(r.train.usable_hbm_bytes)} usable per device; predicted step "
                 f"{human_seconds(r.train.step_seconds)} at {r.mfu:g} MFU")
    return "\n".join(lines)


__all__ = [
    "DEFAULT_HBM_UTILIZATION",
    "DEFAULT_MFU",
    "AOTReport",
    "StepReport",
    "analyze_compiled",
    "format_report",
    "format_table",
    "human_bytes",
    "human_seconds",
    "memory_figures",
    "state_breakdown",
    "state_bytes_per_device",
    "xla_flops",
]
