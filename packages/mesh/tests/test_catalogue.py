"""Hardware catalogue: selectors, per-device figures, detection."""

from __future__ import annotations

import dataclasses

import pytest

from jaxlearn.mesh import (
    HARDWARE,
    UnknownHardwareError,
    current_selector,
    detect_hardware,
    get_hardware,
    hardware_for_selector,
    parse_selector,
    peak_flops,
    selector_num_devices,
)


@pytest.mark.parametrize(
    "selector, kind, num_devices",
    [
        ("tpu-v5p-256", "tpu-v5p", 128),  # Cloud TPU v5p names count TensorCores
        ("tpu-v4-8", "tpu-v4", 4),
        ("tpu-v5e-16", "tpu-v5e", 16),
        ("tpu-v5litepod-256", "tpu-v5e", 256),
        ("tpu-v6e-8", "tpu-v6e", 8),
        ("gpu-h100-8x4", "gpu-h100", 32),
        ("gpu-h200-1", "gpu-h200", 1),
        ("gpu-b200-8x2", "gpu-b200", 16),
        ("trn2-16", "trn2", 64),  # 16 chips x 4 logical NeuronCores (LNC=2)
        ("cpu-8", "cpu", 8),
    ],
)
def test_parse_selector(selector, kind, num_devices):
    assert parse_selector(selector) == (kind, num_devices)
    assert selector_num_devices(selector) == num_devices
    assert hardware_for_selector(selector).kind == kind


@pytest.mark.parametrize(
    "selector, match",
    [
        ("tpu-v9-8", "Unknown hardware kind 'tpu-v9'"),
        ("cpu", "Malformed mesh selector"),
        ("gpu-h100-8x", "Malformed mesh selector"),
        ("tpu-v5p-3", "not a whole number"),
    ],
)
def test_bad_selectors(selector, match):
    with pytest.raises(UnknownHardwareError, match=match):
        parse_selector(selector)


def test_required_kinds_and_sane_figures():
    required = {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "gpu-h100", "gpu-h200", "gpu-b200",
                "trn2", "cpu"}
    assert required <= set(HARDWARE)
    for spec in HARDWARE.values():
        assert spec.hbm_bytes >= 2**30 and spec.peak_bf16_flops > 0, spec.kind
        assert spec.fast_link_bytes_per_s >= spec.dcn_bytes_per_s > 0, spec.kind
        assert spec.fast_domain in ("slice", "host") and spec.source
    assert get_hardware("tpu-v5p").peak_bf16_flops == 459e12
    assert get_hardware("gpu-h100").hbm_bytes == 80 * 2**30
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_hardware("cpu").hbm_bytes = 1  # type: ignore[misc]


def test_peak_flops():
    assert peak_flops("tpu-v5p-256") == 128 * 459e12
    assert peak_flops("gpu-h100", 16) == 16 * 989e12


@dataclasses.dataclass
class FakeDevice:
    platform: str
    device_kind: str


@pytest.mark.parametrize(
    "platform, device_kind, kind",
    [
        ("tpu", "TPU v4", "tpu-v4"),
        ("tpu", "TPU v5 lite", "tpu-v5e"),
        ("tpu", "TPU v5", "tpu-v5p"),
        ("tpu", "TPU v5p", "tpu-v5p"),
        ("tpu", "TPU v6 lite", "tpu-v6e"),
        ("gpu", "NVIDIA H100 80GB HBM3", "gpu-h100"),
        ("cuda", "NVIDIA H200", "gpu-h200"),
        ("gpu", "NVIDIA B200", "gpu-b200"),
    ],
)
def test_detect(platform, device_kind, kind):
    assert detect_hardware([FakeDevice(platform, device_kind)]).kind == kind


def test_current_selector_on_fake_cpus():
    assert current_selector() == "cpu-8"
    assert current_selector([FakeDevice("tpu", "TPU v5p")] * 64) == "tpu-v5p-128"
    with pytest.raises(UnknownHardwareError, match="No catalogue entry"):
        detect_hardware([FakeDevice("gpu", "NVIDIA A100")])
