"""AOT compilation for targets we do not have: memory, FLOPs, collectives, verdicts.

Runs on the 8 fake CPU devices of conftest; targets of up to 8 devices."""

# ruff: noqa: E501  (the HLO fixture below has long lines)
from __future__ import annotations

import dataclasses
import json

import pytest
from aot_toys import matmul_flops_per_step, mlp_trainer_config

from jaxlearn.aot.compile import AOTError, aot_compile, format_report, resolve_target
from jaxlearn.aot.hlo import analyze_hlo, shape_bytes
from jaxlearn.aot.target import target_mesh_shape, tpu_topology_name


def test_report_on_8_devices_memory_flops_collectives():
    cfg = mlp_trainer_config(fsdp=-1)
    report = aot_compile(cfg, resolve_target("cpu-8", topology="fake"))
    t = report.train
    assert report.num_devices == 8 and report.backend == "fake-cpu"
    assert report.mesh["fsdp"] == 8
    # Arguments are the state shard plus this device's slice of the batch (3 int32/f32
    # features of 8 x 16 over 8 devices); donation aliases the state.
    batch_per_device = 3 * 8 * 16 * 4 // 8
    assert t.state_bytes is not None
    assert t.state_bytes <= t.argument_bytes <= t.state_bytes + batch_per_device + 1024
    assert t.alias_bytes >= 0.9 * t.state_bytes
    assert t.required_bytes >= t.argument_bytes
    params = (128 * 64 + 64 * 128 + 128 * 64 + 64 * 128) * 4
    assert t.state_breakdown["params"] == params // 8
    # FLOPs per device: the matmuls dominate; the rest (softmax, optimizer) adds little.
    expected = matmul_flops_per_step(cfg) / 8
    assert expected <= t.flops <= 1.6 * expected, (t.flops, expected)
    assert t.compute_seconds == pytest.approx(
        t.flops / (report.peak_flops_per_device * report.mfu))
    # FSDP gathers parameters and reduces gradients; all on one host: no DCN bytes.
    counts = t.collective_counts
    assert counts["all-gather"] + counts["all-reduce"] + counts["reduce-scatter"] > 0
    assert t.collective_bytes_fast_link > 0 and t.collective_bytes_dcn == 0
    assert t.step_seconds == max(t.compute_seconds, t.comm_seconds)
    assert report.fits
    text = format_report(report)
    assert "FITS" in text and "train_step" in text and "all-gather" in text
    assert "not compiled" in report.inference
    json.loads(json.dumps(report.to_dict()))


def test_does_not_fit_with_tiny_hbm():
    cfg = mlp_trainer_config(data=-1)
    report = aot_compile(cfg, resolve_target("cpu-8", hbm_bytes=64 * 1024))
    assert not report.fits
    assert "DOES NOT FIT" in format_report(report)
    assert report.to_dict()["fits"] is False


def test_grad_accumulation_flops_counted_per_microbatch():
    """cost_analysis counts a loop body once; the report counts every iteration."""
    cfg = mlp_trainer_config(fsdp=-1)
    cfg.input.global_batch_size = 32
    one = aot_compile(cfg, resolve_target("cpu-8")).train
    cfg.learner.num_microbatches = 4
    four = aot_compile(cfg, resolve_target("cpu-8")).train
    assert four.flops_xla < 0.6 * one.flops_xla
    assert four.flops == pytest.approx(one.flops, rel=0.25)


def test_fsdp_parameter_memory_falls_as_one_over_n():
    params = {}
    args = {}
    for n in (1, 2, 4, 8):
        cfg = mlp_trainer_config(fsdp=n)
        t = aot_compile(cfg, resolve_target(f"cpu-{n}")).train
        params[n] = t.state_breakdown["params"]
        args[n] = t.argument_bytes
    for n in (2, 4, 8):
        assert params[n] / params[1] == pytest.approx(1 / n, rel=0.02)
        assert args[n] < args[n // 2]


def test_fsdp_state_memory_falls_as_one_over_n():
    args = {}
    for n in (1, 2, 4, 8):
        t = aot_compile(mlp_trainer_config(fsdp=n), resolve_target(f"cpu-{n}")).train
        args[n] = t.argument_bytes
    for n in (2, 4, 8):
        assert args[n] / args[1] == pytest.approx(1 / n, rel=0.1), args


def test_multi_host_target_layout_and_dcn_classification():
    """4 hosts of 2 GPUs (a made-up small target): data across hosts, fsdp inside."""
    target = dataclasses.replace(resolve_target("cpu-8"), num_granules=4)
    from jaxlearn.mesh import HybridMeshShape, hybrid_mesh_shape_from_axes, mesh_shape_from_axes

    shape = target_mesh_shape(mesh_shape_from_axes(data=-1, fsdp=2), target)
    assert isinstance(shape, HybridMeshShape)
    assert shape.dcn_mesh_shape[1] == 4 and shape.ici_mesh_shape[2] == 2
    cfg = mlp_trainer_config()
    cfg.mesh_shape = hybrid_mesh_shape_from_axes(ici={"fsdp": -1}, dcn={"data": -1})
    t = aot_compile(cfg, target).train
    # Parameter all-gathers stay inside a host (groups [[0, 1], [2, 3], ...]); what crosses
    # hosts is the gradient reduction over `data` (and the embedding's scatter-add
    # gradient, which the partitioner gathers across all devices).
    ag = t.collectives["all-gather"]
    assert ag["bytes_fast_link"] > ag["bytes_dcn"]
    assert t.collectives["all-reduce"]["bytes_dcn"] > 0


def test_resolve_target_errors_and_fallbacks():
    with pytest.raises(AOTError, match="JAX_NUM_CPU_DEVICES=16"):
        resolve_target("gpu-h100-8x2")
    with pytest.raises(AOTError, match="Malformed"):
        resolve_target("nonsense")
    t = resolve_target("tpu-v5e-8", topology="fake")
    assert t.backend == "fake-cpu" and t.num_devices == 8
    assert t.hbm_bytes == 16 * 2**30
    with pytest.raises(AOTError):
        aot_compile(mlp_trainer_config(data=3), resolve_target("cpu-8"))


def test_tpu_topology_names():
    assert tpu_topology_name("tpu-v5p", 4) == "v5p:2x2x1"
    assert tpu_topology_name("tpu-v5p", 128) == "v5p:4x4x8"
    assert tpu_topology_name("tpu-v4", 64) == "v4:4x4x4"
    assert tpu_topology_name("tpu-v5e", 8) == "v5e:2x4"
    assert tpu_topology_name("tpu-v6e", 256) == "v6e:16x16"
    assert tpu_topology_name("tpu-v5e", 6) is None
    assert tpu_topology_name("gpu-h100", 8) is None


HLO = """
HloModule m, entry_computation_layout={()->f32[]}

%body (p: (s32[], f32[64,128], f32[128,128])) -> (s32[], f32[64,128], f32[128,128]) {
  %p = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) parameter(0)
  %x = f32[64,128]{1,0} get-tuple-element(%p), index=1
  %w = f32[128,128]{1,0} get-tuple-element(%p), index=2
  %d = f32[64,128]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag = f32[64,128]{1,0} all-gather(%d), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) tuple(%i, %ag, %w)
}

%cond (q: (s32[], f32[64,128], f32[128,128])) -> pred[] {
  %q = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main () -> f32[] {
  %a = f32[64,128]{1,0} constant({...})
  %b = f32[128,128]{1,0} constant({...})
  %z = s32[] constant(0)
  %init = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) tuple(%z, %a, %b)
  %wl = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
  %r = f32[128,128]{1,0} get-tuple-element(%wl), index=2
  %ar = f32[128,128]{1,0} all-reduce(%r), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%cond
  %cp = f32[128,128]{1,0} collective-permute(%ar), channel_id=3, source_target_pairs={{0,4},{4,0}}
  ROOT %s = f32[] constant(0)
}
"""


def test_hlo_analysis_trip_counts_and_collective_bytes():
    stats = analyze_hlo(HLO, 8, granule_of=lambda i: i // 4)
    dot = 2 * 64 * 128 * 128
    assert stats.flops_static == dot and stats.flops_per_step == 10 * dot
    ag = stats.collectives["all-gather"]
    assert (ag.count, ag.executions) == (1, 10)
    # Groups [[0..3], [4..7]] stay in a granule; S=4: each device sends 3 shards.
    assert ag.bytes_fast == 10 * 3 * 64 * 128 * 4 and ag.bytes_slow == 0
    ar = stats.collectives["all-reduce"]
    assert ar.bytes_slow == pytest.approx(2 * 7 / 8 * 128 * 128 * 4)
    cp = stats.collectives["collective-permute"]
    assert cp.count == 1 and cp.bytes_slow == 128 * 128 * 4
    assert shape_bytes("(bf16[2,3]{1,0}, s8[4])") == 16
    assert stats.unknown_trip_counts == 0 and stats.while_loops == 1


TPU_STYLE = """
%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,32]{1,0} constant({...})
  %c = f32[8,32]{1,0} convolution(%x, %w), dim_labels=bf_io->bf
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %x)
}

%cond (q: (s32[], f32[8,16])) -> pred[] {
  %n = s32[]{:T(128)} constant(6)
  %q = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%q), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

ENTRY %main () -> f32[8,16] {
  %init = (s32[], f32[8,16]{1,0}) constant({...})
  %wl = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8,16]{1,0} get-tuple-element(%wl), index=1
}
"""


def test_hlo_trip_count_from_condition_and_convolution_flops():
    """What the TPU compiler emits: no known_trip_count, matmuls as convolutions."""
    stats = analyze_hlo(TPU_STYLE, 1)
    conv = 2 * 8 * 32 * 16
    assert stats.unknown_trip_counts == 0
    # (+1: the loop condition's compare.)
    assert stats.flops_static == conv + 1 and stats.flops_per_step == 6 * conv + 1
