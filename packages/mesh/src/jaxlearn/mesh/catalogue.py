"""Hardware catalogue: per target kind, what one JAX device has and how it is connected.

Every figure is per JAX device (what `jax.devices()` lists), so per-device memory checks of
AOT-compiled steps and MFU = achieved FLOP/s / (num_devices * peak) need no conversions.
A JAX device is a chip for TPU v4/v5p (megacore), v5e, v6e and GPUs, and a logical
NeuronCore for Trainium2 (LNC=2: 4 per chip, 64 per trn2.48xlarge).

Mesh selectors (`tpu-v5p-256`, `gpu-h100-8x4`, `trn2-16`, `cpu-8`) count in the unit the
vendor uses: TensorCores for TPU v4/v5p (Cloud TPU names: v5p-256 = 128 chips = 128
devices), chips for TPU v5e/v6e and Trainium2, GPUs, and CPU devices. `AxB` counts are
multiplied (`gpu-h100-8x4` = 32 GPUs).

Figures are public peak numbers (dense bf16, no sparsity); bandwidths are per device,
bidirectional for the fast link (ICI/NVLink/NeuronLink) and the NIC share for DCN.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Any, NamedTuple, Optional, Sequence

from jaxlearn.mesh.errors import UnknownHardwareError

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """What one JAX device of a target kind offers.

    Attributes:
        kind: catalogue key, e.g. "tpu-v5p"; the selector prefix.
        platform: the JAX platform name ("tpu", "gpu", "neuron", "cpu").
        devices_per_host: JAX devices per host (process); None for CPU (any number).
        hbm_bytes: accelerator memory per device.
        peak_bf16_flops: dense bf16 peak FLOP/s per device.
        fast_link: name of the scale-up interconnect ("ICI", "NVLink", "NeuronLink", "none").
        fast_link_bytes_per_s: its bidirectional bandwidth per device.
        dcn_bytes_per_s: data-center network bandwidth per device (NIC share).
        fast_domain: what the fast link spans, i.e. the DCN granule: "slice" or "host".
        devices_per_selector_unit: JAX devices per unit counted in a selector.
        device_kind_pattern: regex searched in `jax.Device.device_kind` to detect the kind.
        source: where the figures come from.
    """

    kind: str
    platform: str
    devices_per_host: Optional[int]
    hbm_bytes: int
    peak_bf16_flops: float
    fast_link: str
    fast_link_bytes_per_s: float
    dcn_bytes_per_s: float
    fast_domain: str
    devices_per_selector_unit: Fraction
    device_kind_pattern: str
    source: str


_ONE = Fraction(1)

HARDWARE: dict[str, HardwareSpec] = {
    spec.kind: spec
    for spec in (
        # cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2, 2 TensorCores/chip,
        # 4 chips/host. ICI 2400 Gbps/chip (one direction) per Google's v5p launch comparison;
        # DCN per chip is not published for v4: 50 Gbps assumed (as v5p).
        HardwareSpec(
            "tpu-v4", "tpu", 4, 32 * GiB, 275e12, "ICI", 600e9, 6.25e9, "slice",
            Fraction(1, 2), r"TPU v4", "cloud.google.com/tpu/docs/v4",
        ),
        # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM, bidirectional ICI
        # 400 GB/s/chip, 2x100 Gbps NICs per 8-chip host. Multi-host slices use 4-chip VMs.
        HardwareSpec(
            "tpu-v5e", "tpu", 4, 16 * GiB, 197e12, "ICI", 400e9, 3.125e9, "slice",
            _ONE, r"TPU v5 ?lite|TPU v5e", "cloud.google.com/tpu/docs/v5e",
        ),
        # cloud.google.com/tpu/docs/v5p-training: 459 TFLOP/s bf16, 95 GiB HBM2e,
        # bidirectional ICI 1200 GB/s/chip, DCN 50 Gbps/chip, 4 chips (8 cores) per VM.
        HardwareSpec(
            "tpu-v5p", "tpu", 4, 95 * GiB, 459e12, "ICI", 1200e9, 6.25e9, "slice",
            Fraction(1, 2), r"TPU v5p?$", "cloud.google.com/tpu/docs/v5p",
        ),
        # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM, bidirectional ICI
        # 800 GB/s/chip; 4x200 Gbps NICs per 8-chip host. Multi-host slices use 4-chip VMs.
        HardwareSpec(
            "tpu-v6e", "tpu", 4, 32 * GiB, 918e12, "ICI", 800e9, 12.5e9, "slice",
            _ONE, r"TPU v6", "cloud.google.com/tpu/docs/v6e",
        ),
        # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16 (1979 with sparsity), 80 GB
        # HBM3, NVLink 900 GB/s; DGX H100: 8 GPUs, 8x400 Gb/s ConnectX-7 (50 GB/s per GPU).
        HardwareSpec(
            "gpu-h100", "gpu", 8, 80 * GiB, 989e12, "NVLink", 900e9, 50e9, "host",
            _ONE, r"H100", "nvidia.com/en-us/data-center/h100 (datasheet); DGX H100 guide",
        ),
        # NVIDIA H200 SXM datasheet: 989 TFLOP/s dense bf16, 141 GB HBM3e, NVLink 900 GB/s;
        # DGX H200: 8 GPUs, 8x400 Gb/s ConnectX-7.
        HardwareSpec(
            "gpu-h200", "gpu", 8, 141 * 10**9, 989e12, "NVLink", 900e9, 50e9, "host",
            _ONE, r"H200", "nvidia.com/en-us/data-center/h200 (datasheet)",
        ),
        # NVIDIA DGX/HGX B200: 8 GPUs, 1440 GB HBM3e total (180 GB each), 72 PFLOP/s FP8
        # training per 8 GPUs with sparsity -> 2.25 PFLOP/s dense bf16 per GPU, NVLink 5
        # 1.8 TB/s per GPU, 8x400 Gb/s ConnectX-7.
        HardwareSpec(
            "gpu-b200", "gpu", 8, 180 * 10**9, 2.25e15, "NVLink", 1.8e12, 50e9, "host",
            _ONE, r"B200", "nvidia.com/en-us/data-center/dgx-b200 (datasheet)",
        ),
        # awsdocs-neuron: Trainium2 chip = 8 NeuronCore-v3, 667 TFLOP/s bf16, 96 GiB HBM,
        # NeuronLink-v3 1.28 TB/s per chip; trn2.48xlarge = 16 chips, EFAv3 3.2 Tbps.
        # Per JAX device (LNC=2 logical core, 4 per chip): a quarter of each.
        HardwareSpec(
            "trn2", "neuron", 64, 24 * GiB, 667e12 / 4, "NeuronLink", 1.28e12 / 4,
            25e9 / 4, "host", Fraction(4), r"(?i)trn2|trainium2|NC_v3",
            "awsdocs-neuron .../arch/neuron-hardware/trainium2.html, trn2-arch.html",
        ),
        # CPU (fake devices in tests): nominal figures so AOT/MFU code paths run; the fake
        # devices share the host's RAM and cores.
        HardwareSpec(
            "cpu", "cpu", None, 16 * GiB, 1e11, "none", 10e9, 1e9, "host",
            _ONE, r"(?i)cpu", "nominal (not a measurement)",
        ),
    )
}

_ALIASES = {"tpu-v5litepod": "tpu-v5e", "tpu-v5lite": "tpu-v5e", "neuron-trn2": "trn2"}
_SELECTOR = re.compile(r"(?P<kind>[a-z][a-z0-9-]*?)-(?P<count>\d+(?:x\d+)*)")


class ParsedSelector(NamedTuple):
    """A mesh selector split into its catalogue kind and its number of JAX devices."""

    kind: str
    num_devices: int


def get_hardware(kind: str) -> HardwareSpec:
    """The catalogue entry for `kind` (e.g. "tpu-v5p", "gpu-h100", "trn2", "cpu")."""
    kind = _ALIASES.get(kind, kind)
    if kind not in HARDWARE:
        raise UnknownHardwareError(f"Unknown hardware kind {kind!r}; known: {sorted(HARDWARE)}")
    return HARDWARE[kind]


def parse_selector(selector: str) -> ParsedSelector:
    """`"tpu-v5p-256"` -> ("tpu-v5p", 128); `"gpu-h100-8x4"` -> ("gpu-h100", 32)."""
    m = _SELECTOR.fullmatch(selector)
    if not m:
        raise UnknownHardwareError(
            f"Malformed mesh selector {selector!r}; expected KIND-COUNT such as "
            f"'tpu-v5p-256', 'gpu-h100-8x4', 'trn2-16' or 'cpu-8'"
        )
    spec = get_hardware(m["kind"])
    count = 1
    for part in m["count"].split("x"):
        count *= int(part)
    devices = count * spec.devices_per_selector_unit
    if devices.denominator != 1 or devices < 1:
        raise UnknownHardwareError(
            f"Mesh selector {selector!r}: {count} is not a whole number of {spec.kind} devices "
            f"({spec.devices_per_selector_unit} device(s) per unit)"
        )
    return ParsedSelector(spec.kind, int(devices))


def selector_num_devices(selector: str) -> int:
    """Number of JAX devices a selector denotes (`tpu-v5p-256` -> 128)."""
    return parse_selector(selector).num_devices


def hardware_for_selector(selector: str) -> HardwareSpec:
    """The catalogue entry for a selector's kind."""
    return get_hardware(parse_selector(selector).kind)


def detect_hardware(devices: Optional[Sequence[Any]] = None) -> HardwareSpec:
    """The catalogue entry matching the given (default: all) JAX devices."""
    if devices is None:
        import jax

        devices = jax.devices()
    device = devices[0]
    platform = "gpu" if device.platform in ("cuda", "rocm") else device.platform
    for spec in HARDWARE.values():
        if spec.platform == platform and (
            platform == "cpu" or re.search(spec.device_kind_pattern, device.device_kind)
        ):
            return spec
    raise UnknownHardwareError(
        f"No catalogue entry for device kind {device.device_kind!r} on {device.platform!r}"
    )


def current_selector(devices: Optional[Sequence[Any]] = None) -> str:
    """The mesh selector of the given (default: all) devices, e.g. "cpu-8"."""
    if devices is None:
        import jax

        devices = jax.devices()
    spec = detect_hardware(devices)
    units = len(devices) / spec.devices_per_selector_unit
    return f"{spec.kind}-{int(units)}"


def peak_flops(selector_or_kind: str, num_devices: Optional[int] = None) -> float:
    """Aggregate dense bf16 peak FLOP/s: of a selector, or of `num_devices` of a kind."""
    if num_devices is None:
        kind, num_devices = parse_selector(selector_or_kind)
    else:
        kind = selector_or_kind
    return get_hardware(kind).peak_bf16_flops * num_devices


__all__ = [
    "HARDWARE",
    "HardwareSpec",
    "ParsedSelector",
    "current_selector",
    "detect_hardware",
    "get_hardware",
    "hardware_for_selector",
    "parse_selector",
    "peak_flops",
    "selector_num_devices",
]
