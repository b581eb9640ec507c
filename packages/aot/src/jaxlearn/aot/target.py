"""Hardware targets a compiler can aim at from this machine.

    ensure_cpu_devices(selector_num_devices("gpu-h100-8x4"))   # before JAX initialises
    target = resolve_target("gpu-h100-8x4")                   # Target: devices + figures
    shape = target_mesh_shape(cfg.mesh_shape, target)          # -1s inferred, hosts split

A TPU selector (`tpu-v5p-256`) uses a mock topology from
`jax.experimental.topologies.get_topology_desc` when the optional `libtpu` package is
importable (`pip install "jax[tpu]"`): the real TPU compiler then reports real TPU memory
figures. Every other target (GPU, Trainium, CPU, or TPU without libtpu) compiles on a fake
CPU mesh with the target's device count (`jax_num_cpu_devices`, which must be set before JAX
initialises its backends: `ensure_cpu_devices`, or `JAX_NUM_CPU_DEVICES=N`). Multi-host
targets (GPU/Trainium with more devices than one host holds) are laid out as on the real
machine: the mesh is split into per-host granules (`split_for_granules` for flat shapes,
DCN axes of a `HybridMeshShape`), contiguous fake devices standing in for a host.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any, Optional, Sequence

import jax

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

# Catalogue kind -> (mock topology prefix, number of physical dimensions).
_TPU_TOPOLOGIES = {"tpu-v4": ("v4", 3), "tpu-v5p": ("v5p", 3), "tpu-v5e": ("v5e", 2),
                   "tpu-v6e": ("v6e", 2)}


class AOTError(RuntimeError):
    """A target or config that cannot be AOT-compiled (says what and why)."""


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


__all__ = [
    "AOTError",
    "Target",
    "ensure_cpu_devices",
    "libtpu_available",
    "resolve_target",
    "target_mesh_shape",
    "tpu_topology_name",
]
