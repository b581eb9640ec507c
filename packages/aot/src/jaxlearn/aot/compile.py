"""Ahead-of-time compilation of the real train step for a hardware target you do not have.

    ensure_cpu_devices(selector_num_devices("gpu-h100-8x4"))   # before JAX initialises
    target = resolve_target("gpu-h100-8x4")
    report = aot_compile(trainer_cfg, target)                 # AOTReport
    print(format_report(report)); report.to_dict()            # human table / JSON

Devices. A TPU selector (`tpu-v5p-256`) uses a mock topology from
`jax.experimental.topologies.get_topology_desc` when the optional `libtpu` package is
importable (`pip install "jax[tpu]"`): the real TPU compiler then reports real TPU memory
figures. Every other target (GPU, Trainium, CPU, or TPU without libtpu) compiles on a fake
CPU mesh with the target's device count (`jax_num_cpu_devices`, which must be set before JAX
initialises its backends: `ensure_cpu_devices`, or `JAX_NUM_CPU_DEVICES=N`). Multi-host
targets (GPU/Trainium with more devices than one host holds) are laid out as on the real
machine: the mesh is split into per-host granules (`split_for_granules` for flat shapes,
DCN axes of a `HybridMeshShape`), contiguous fake devices standing in for a host.

What a fake CPU mesh tells you: the partitioning (shardings, collectives, per-device state)
is that of the target; per-device memory and FLOPs come from the CPU compiler, whose fusion,
layout and buffer reuse differ from the TPU/GPU compilers (temp memory in particular is an
estimate, usually on the high side). The report says which backend produced it.

Figures, per device:
- memory (`compiled.memory_analysis()`): arguments (the sharded state and batch), outputs,
  aliased (donated) bytes, temporaries, code; `required = max(peak, args + outputs - alias +
  temp + code)` is checked against `hbm_utilization * HBM` from the hardware catalogue (or
  `hbm_bytes` given to `resolve_target`);
- FLOPs: `cost_analysis()["flops"]` times the ratio of per-step to static FLOPs that
  `jaxlearn.aot.hlo` counts in the HLO (cost_analysis counts a `while` body once, so a
  scanned layer stack or gradient accumulation would look `trip count` times cheaper);
- collectives: counts and bytes sent from `compiled.as_text()` (`jaxlearn.aot.hlo`);
- time model: `t_compute = flops / (peak_bf16_flops * mfu)`, `t_comm = bytes_fast_link /
  fast_link_bytes_per_s + bytes_dcn / dcn_bytes_per_s` (ring-algorithm bytes, each
  collective on its slowest link, no hierarchical algorithms), and the predicted step time
  `max(t_compute, t_comm)` (communication overlapped with compute, as XLA's async
  collectives aim for); `t_compute + t_comm` is the no-overlap bound.

Inference: `aot_compile(..., inference_steps=fn)` also analyses what `fn(trainer)` returns
(`{"prefill": compiled, "decode": compiled}`); the runtime package cannot import
`jaxlearn.inference`, so the caller (the CLI) supplies the hook once an engine exists.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import numpy as np

from jaxlearn.aot.hlo import HloStats, analyze_hlo, granule_lookup
from jaxlearn.config import ConfigBase
from jaxlearn.mesh import (
    HardwareSpec,
    HybridMeshShape,
    MeshShape,
    as_mesh_shape,
    get_hardware,
    infer_hybrid_mesh_shape,
    infer_mesh_shape,
    parse_selector,
    split_for_granules,
)

GiB = 2**30
DEFAULT_MFU = 0.5
DEFAULT_HBM_UTILIZATION = 0.95

# Catalogue kind -> (mock topology prefix, number of physical dimensions).
_TPU_TOPOLOGIES = {"tpu-v4": ("v4", 3), "tpu-v5p": ("v5p", 3), "tpu-v5e": ("v5e", 2),
                   "tpu-v6e": ("v6e", 2)}

InferenceSteps = Callable[[Any], Mapping[str, Any]]


class AOTError(RuntimeError):
    """A target or config that cannot be AOT-compiled (says what and why)."""


# ---- targets ------------------------------------------------------------------------------


def tpu_topology_name(kind: str, num_chips: int) -> Optional[str]:
    """The mock-topology name of a TPU slice, e.g. ("tpu-v5p", 128) -> "v5p:4x4x8",
    ("tpu-v5e", 256) -> "v5e:16x16"; None for unknown kinds or non-power-of-two counts.

    Shapes follow Cloud TPU's slice shapes: 3D tori (v4, v5p) grow 2x2x1, 2x2x2, 2x2x4,
    2x4x4, 4x4x4, 4x4x8, ...; 2D (v5e, v6e) 1x1, 1x2, 2x2, 2x4, 4x4, 4x8, ...
    """
    if kind not in _TPU_TOPOLOGIES or num_chips < 1 or num_chips & (num_chips - 1):
        return None
    prefix, ndim = _TPU_TOPOLOGIES[kind]
    dims = [1] * ndim
    while math.prod(dims) < num_chips:
        if ndim == 2:
            i = 1 if dims[0] == dims[1] else 0
        elif 1 in dims:
            i = dims.index(1)
        elif len(set(dims)) == 1:
            i = 2
        else:
            i = max(j for j in range(3) if dims[j] < max(dims))
        dims[i] *= 2
    return f"{prefix}:{'x'.join(map(str, dims))}"


def libtpu_available() -> bool:
    """Whether the optional `libtpu` package (mock TPU topologies) is importable."""
    return importlib.util.find_spec("libtpu") is not None


def ensure_cpu_devices(num_devices: int) -> bool:
    """Asks for `num_devices` fake CPU devices; True if that many will be there.

    Must run before JAX initialises its backends (the first JAX operation); afterwards the
    count is fixed and this only reports whether it suffices. Initialises the backends.
    """
    try:
        jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:
        pass  # Backends already up: the count is what it is.
    return len(jax.devices("cpu")) >= num_devices


@dataclasses.dataclass(frozen=True)
class Target:
    """A hardware target resolved to devices that a compiler can target from this machine.

    Attributes:
        selector: the mesh selector, e.g. "tpu-v5p-256".
        hardware: its catalogue entry.
        num_devices: JAX devices of the target.
        num_granules: hosts/slices the fast link does not span (DCN between them).
        hbm_bytes: memory per device to check against (catalogue, or an override).
        backend: "tpu-topology" (mock TPU, real TPU compiler) or "fake-cpu".
        topology: the mock topology name, if any.
        devices: the devices to build meshes from.
        notes: what was substituted or assumed.
    """

    selector: str
    hardware: HardwareSpec
    num_devices: int
    num_granules: int
    hbm_bytes: int
    backend: str
    topology: Optional[str]
    devices: tuple[Any, ...]
    notes: tuple[str, ...] = ()

    def granule_of_device(self, device: Any) -> int:
        if self.backend == "tpu-topology":
            return int(getattr(device, "slice_index", 0) or 0)
        per = self.num_devices // self.num_granules
        return self._positions()[device.id] // per

    def _positions(self) -> dict[int, int]:
        return {d.id: i for i, d in enumerate(self.devices)}

    def describe(self) -> str:
        where = (f"mock TPU topology {self.topology}" if self.backend == "tpu-topology"
                 else f"{self.num_devices} fake CPU devices")
        return (f"{self.selector}: {self.num_devices} x {self.hardware.kind}, "
                f"{self.num_granules} {self.hardware.fast_domain}(s); compiled on {where}")


def _num_granules(hw: HardwareSpec, num_devices: int) -> int:
    per = hw.devices_per_host
    if hw.fast_domain == "host" and per and num_devices > per and num_devices % per == 0:
        return num_devices // per
    return 1  # One TPU slice per selector; CPU: one host.


def resolve_target(
    selector: str,
    *,
    hbm_bytes: Optional[int] = None,
    topology: str = "auto",
    devices: Optional[Sequence[Any]] = None,
) -> Target:
    """Devices and figures for `selector`.

    Args:
        selector: e.g. "tpu-v5p-256", "gpu-h100-8x4", "trn2-16", "cpu-8".
        hbm_bytes: overrides the catalogue's memory per device (what-if checks, tests).
        topology: "auto" (mock TPU topology for TPU targets when libtpu is importable, else
            fake CPU), "tpu" (require the mock topology) or "fake" (always fake CPU).
        devices: use these devices as they are (no substitution).
    """
    if topology not in ("auto", "tpu", "fake"):
        raise AOTError(f"topology must be 'auto', 'tpu' or 'fake', got {topology!r}")
    try:
        kind, n = parse_selector(selector)
    except ValueError as e:
        raise AOTError(str(e)) from None
    hw = get_hardware(kind)
    granules = _num_granules(hw, n)
    hbm = int(hbm_bytes) if hbm_bytes is not None else hw.hbm_bytes
    notes: list[str] = []
    if hbm_bytes is not None:
        notes.append(f"HBM per device overridden: {hbm_bytes} bytes")
    if devices is not None:
        devs = tuple(devices)
        if len(devs) != n:
            raise AOTError(f"{selector} has {n} devices but {len(devs)} were given")
        backend = "tpu-topology" if devs[0].platform == "tpu" else "fake-cpu"
        return Target(selector, hw, n, granules, hbm, backend, None, devs, tuple(notes))
    if hw.platform == "tpu" and topology != "fake":
        name = tpu_topology_name(kind, n)
        problem = None
        if not libtpu_available():
            problem = "libtpu is not installed (pip install 'jax[tpu]' for mock TPU topologies)"
        elif name is None:
            problem = f"no mock topology shape for {n} {kind} chips"
        else:
            try:
                from jax.experimental import topologies

                topo = topologies.get_topology_desc(topology_name=name, platform="tpu")
                devs = tuple(topo.devices)
                if len(devs) == n:
                    return Target(selector, hw, n, granules, hbm, "tpu-topology", name, devs,
                                  tuple(notes))
                problem = (f"mock topology {name} has {len(devs)} devices, the catalogue "
                           f"counts {n} for {selector}")
            except Exception as e:  # noqa: BLE001 - libtpu raises assorted errors
                problem = f"mock topology {name} failed: {type(e).__name__}: {e}"
        if topology == "tpu":
            raise AOTError(f"{selector}: {problem}")
        notes.append(f"{problem}; using a fake CPU mesh of {n} devices")
    cpu = jax.devices("cpu")
    if len(cpu) < n:
        raise AOTError(
            f"{selector} needs {n} fake CPU devices but this process has {len(cpu)}; set "
            f"JAX_NUM_CPU_DEVICES={n} (or call ensure_cpu_devices({n}) before any JAX "
            f"operation)"
        )
    return Target(selector, hw, n, granules, hbm, "fake-cpu", None, tuple(cpu[:n]),
                  tuple(notes))


def target_mesh_shape(shape: Any, target: Target) -> MeshShape:
    """The config's mesh shape made concrete for the target: -1s inferred, and on a
    multi-host target split into per-host (ICI) and across-host (DCN) parts as
    `jaxlearn.mesh.make_mesh` does on the real machine."""
    shape = as_mesh_shape(shape)
    n, g = target.num_devices, target.num_granules
    try:
        if isinstance(shape, HybridMeshShape):
            hybrid = infer_hybrid_mesh_shape(shape, n, g)
            # One granule: flat, so that make_mesh does not read hosts of a mock TPU
            # topology (whose devices have no slice_index) as granules of the DCN part.
            return hybrid if g > 1 else hybrid.full_shape
        flat = infer_mesh_shape(shape, n)
        return split_for_granules(flat, g) if g > 1 else flat
    except ValueError as e:
        raise AOTError(f"mesh_shape {shape} on {target.selector}: {e}") from None


# ---- reports ------------------------------------------------------------------------------


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


def _memory(compiled: Any) -> dict[str, int]:
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


def _xla_flops(compiled: Any) -> float:
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
    mem = _memory(compiled)
    total = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["code"]
    required = max(mem["peak"], total)
    usable = int(target.hbm_bytes * hbm_utilization)
    granule = granule_lookup(list(mesh_devices), target.granule_of_device)
    stats: HloStats = analyze_hlo(compiled.as_text(), len(mesh_devices),
                                  granule if target.num_granules > 1 else None)
    xla = _xla_flops(compiled)
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


# ---- compiling ----------------------------------------------------------------------------


def batch_shapes(cfg: ConfigBase) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{feature: (global shape, dtype)} of a trainer config's input: from the input's
    `batch_shapes()` when it has one (no data is read), else from one batch."""
    inp = cfg.input.instantiate()
    if hasattr(inp, "batch_shapes"):
        return {k: (tuple(s), np.dtype(d)) for k, (s, d) in inp.batch_shapes(1).items()}
    first = next(inp.iterator(0, 1))
    return {k: (tuple(np.shape(v)), np.asarray(v).dtype) for k, v in first.items()}


def abstract_batch(trainer: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch as ShapeDtypeStructs with the trainer's batch sharding."""
    return {k: jax.ShapeDtypeStruct(s, d, sharding=trainer.batch_sharding)
            for k, (s, d) in batch_shapes(trainer.config).items()}


def remat_settings(cfg: ConfigBase) -> dict[str, str]:
    """{config path: remat policy} of every module config with a `remat_spec` set."""
    from jaxlearn.config import visit

    found: dict[str, str] = {}

    def enter(path: str, value: Any) -> bool:
        if isinstance(value, ConfigBase) and "remat_spec" in value:
            spec = value.remat_spec
            if spec is not None:
                found[path] = str(getattr(spec, "policy", spec))
        return False

    visit(cfg, enter)
    return found


def build_trainer(cfg: ConfigBase, target: Target) -> Any:
    """The trainer of `cfg` with its mesh on the target's devices."""
    cfg = cfg.clone()
    cfg.mesh_shape = target_mesh_shape(cfg.mesh_shape, target)
    try:
        return cfg.instantiate(devices=list(target.devices))
    except (ValueError, RuntimeError, TypeError) as e:  # ConfigError, TrainerError, ...
        raise AOTError(f"{target.selector}: cannot build the trainer on mesh "
                       f"{cfg.mesh_shape}: {type(e).__name__}: {e}") from e


def aot_compile(
    cfg: ConfigBase,
    target: Target,
    *,
    mfu: float = DEFAULT_MFU,
    hbm_utilization: float = DEFAULT_HBM_UTILIZATION,
    batch: Optional[Mapping[str, jax.ShapeDtypeStruct]] = None,
    inference_steps: Optional[InferenceSteps] = None,
) -> AOTReport:
    """Compiles the train step of trainer config `cfg` for `target` and reports on it.

    Args:
        cfg: a trainer config with its mesh rule and overrides applied.
        target: from `resolve_target`.
        mfu: model FLOPs utilisation assumed for the predicted step time.
        hbm_utilization: the share of HBM a step may use.
        batch: the global batch as ShapeDtypeStructs (default: from the input config);
            its shardings are replaced by the trainer's batch sharding.
        inference_steps: fn(trainer) -> {name: compiled} for inference steps (a hook for
            the inference engine; None: not compiled, said in the report).
    Raises:
        AOTError: the mesh does not fit the target or the step does not compile.
    """
    trainer = build_trainer(cfg, target)
    if batch is None:
        abstract = abstract_batch(trainer)
    else:
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
                    for k, v in batch.items()}
    for k, v in abstract.items():
        try:
            trainer.batch_sharding.shard_shape(v.shape)
        except ValueError:
            raise AOTError(
                f"{target.selector}: batch feature {k!r} of shape {tuple(v.shape)} cannot be "
                f"split over the batch axes {trainer.batch_sharding.spec[0]} of mesh "
                f"{dict(trainer.mesh.shape)}; change the global batch size or the mesh"
            ) from None
    mesh_devices = list(trainer.mesh.devices.flat)
    state = trainer.abstract_state()
    t0 = time.monotonic()
    try:
        compiled = trainer.compile_train_step(abstract)
    except Exception as e:
        raise AOTError(f"{target.selector}: the train step does not compile on mesh "
                       f"{dict(trainer.mesh.shape)}: {type(e).__name__}: {e}") from e
    steps = {
        "train_step": analyze_compiled(
            "train_step", compiled, target, mesh_devices, mfu=mfu,
            hbm_utilization=hbm_utilization, compile_seconds=time.monotonic() - t0,
            abstract_state=state,
        )
    }
    if inference_steps is None:
        inference = ("not compiled: no inference engine is registered (hook: "
                     "aot_compile(inference_steps=fn), fn(trainer) -> {name: compiled})")
    else:
        t0 = time.monotonic()
        for name, comp in inference_steps(trainer).items():
            steps[name] = analyze_compiled(name, comp, target, mesh_devices, mfu=mfu,
                                           hbm_utilization=hbm_utilization,
                                           compile_seconds=time.monotonic() - t0)
            t0 = time.monotonic()
        inference = "compiled: " + ", ".join(k for k in steps if k != "train_step")
    c = trainer.config
    return AOTReport(
        selector=target.selector,
        hardware=target.hardware.kind,
        backend=target.backend,
        topology=target.topology,
        num_devices=target.num_devices,
        num_granules=target.num_granules,
        hbm_bytes=target.hbm_bytes,
        peak_flops_per_device=target.hardware.peak_bf16_flops,
        fast_link_bytes_per_s=target.hardware.fast_link_bytes_per_s,
        dcn_bytes_per_s=target.hardware.dcn_bytes_per_s,
        mfu=mfu,
        hbm_utilization=hbm_utilization,
        mesh_axis_names=tuple(c.mesh_axis_names),
        mesh_shape=c.mesh_shape,
        mesh={k: int(v) for k, v in trainer.mesh.shape.items()},
        num_microbatches=int(c.learner.num_microbatches),
        remat=remat_settings(c),
        batch={k: (list(v.shape), str(v.dtype)) for k, v in abstract.items()},
        steps=steps,
        inference=inference,
        notes=list(target.notes),
    )


# ---- printing -----------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def human_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def format_table(rows: Sequence[Sequence[str]]) -> str:
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
    "AOTError",
    "AOTReport",
    "StepReport",
    "Target",
    "abstract_batch",
    "aot_compile",
    "batch_shapes",
    "analyze_compiled",
    "build_trainer",
    "ensure_cpu_devices",
    "format_report",
    "libtpu_available",
    "remat_settings",
    "resolve_target",
    "state_breakdown",
    "state_bytes_per_device",
    "target_mesh_shape",
    "tpu_topology_name",
]
