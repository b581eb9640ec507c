"""Resilience building blocks on their own: watchdog, supervisor (with stand-in children),
SDC compare/flip/repair, health checks, elastic microbatching, fault specs, goodput."""

import json
import logging
import os
import signal
import sys
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.resilience import faults, goodput, health, sdc
from jaxlearn.resilience.elastic import ElasticError, fit_microbatches
from jaxlearn.resilience.failures import (
    EXIT_HANG,
    HealthCheckError,
    SdcError,
    describe_exit,
)
from jaxlearn.resilience.supervisor import Supervisor, child_argv
from jaxlearn.resilience.watchdog import Watchdog

# ---- watchdog ---------------------------------------------------------------------------------


def _stuck_in_a_recognisable_function(event):
    event.wait(10)


def test_watchdog_fires_with_stacks_and_exit_code(tmp_path, caplog):
    exits = []
    fired = threading.Event()

    def exit_fn(code):
        exits.append(code)
        fired.set()

    wd = Watchdog.default_config().set(timeout_s=0.3, first_step_timeout_s=5.0,
                                       exit_on_hang=True, poll_interval_s=0.05).instantiate(
        output_dir=str(tmp_path), exit_fn=exit_fn)
    release = threading.Event()
    worker = threading.Thread(target=_stuck_in_a_recognisable_function, args=(release,),
                              name="stuck-worker")
    worker.start()
    with caplog.at_level(logging.ERROR, logger="jaxlearn.watchdog"):
        wd.start()
        wd.beat(3)
        wd.set_metrics({"loss": 1.5})
        t0 = time.monotonic()
        assert fired.wait(5)
        elapsed = time.monotonic() - t0
        wd.stop()
    release.set()
    worker.join()
    assert exits == [EXIT_HANG]
    assert 0.3 <= elapsed < 2.0
    text = caplog.text
    assert "no progress" in text and "after step 3" in text and "'loss': 1.5" in text
    assert "stuck-worker" in text and "_stuck_in_a_recognisable_function" in text
    dump = (tmp_path / "watchdog" / f"hang_step3_pid{os.getpid()}.txt").read_text()
    assert "_stuck_in_a_recognisable_function" in dump


def test_watchdog_quiet_while_beating_and_first_step_limit():
    exits = []
    wd = Watchdog.default_config().set(timeout_s=0.2, first_step_timeout_s=1.0,
                                       poll_interval_s=0.02).instantiate(exit_fn=exits.append)
    wd.start()
    time.sleep(0.5)  # Before the first step: the longer limit applies.
    assert not wd.fired
    for step in range(1, 8):
        wd.beat(step)
        time.sleep(0.05)
    assert not wd.fired
    time.sleep(0.5)
    wd.stop()
    assert len(wd.fired) == 1 and wd.fired[0]["step"] == 7 and exits == []  # No exit asked.


def test_watchdog_off_and_bad_config():
    assert not Watchdog.default_config().instantiate().start().enabled
    with pytest.raises(Exception, match="timeout_s must be > 0"):
        Watchdog.default_config().set(timeout_s=0).instantiate()


# ---- supervisor with stand-in children ----------------------------------------------------------

_CHILD = """
import os, signal, sys, time
codes = [int(c) for c in sys.argv[1].split(",")]
attempt = int(os.environ["JAXLEARN_ATTEMPT"])
os.makedirs(sys.argv[2], exist_ok=True)
with open(os.path.join(sys.argv[2], "devices.txt"), "a") as f:
    f.write(os.environ.get("JAX_NUM_CPU_DEVICES", "-") + "\\n")
code = codes[min(attempt, len(codes) - 1)]
if code < 0:
    os.kill(os.getpid(), -code)
    time.sleep(10)
sys.exit(code)
"""


def _supervise(tmp_path, codes, **kw):
    out = tmp_path / "out"
    sleeps = []
    sup = Supervisor([sys.executable, "-c", _CHILD, ",".join(map(str, codes)), str(out)],
                     output_dir=str(out), sleep=sleeps.append, **kw)
    return sup, sup.run(), sleeps, out


def test_supervisor_restarts_with_backoff_and_causes(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="jaxlearn.supervisor"):
        sup, rc, sleeps, out = _supervise(tmp_path, [-signal.SIGKILL, EXIT_HANG, 43, 0],
                                          max_restarts=5, backoff_s=0.5, max_backoff_s=1.5)
    assert rc == 0
    assert [a.returncode for a in sup.attempts] == [-signal.SIGKILL, EXIT_HANG, 43, 0]
    assert sleeps == [0.5, 1.0, 1.5]
    assert "killed by signal SIGKILL" in caplog.text
    assert "watchdog: no step progress (hang)" in caplog.text
    assert "silent data corruption" in caplog.text
    records = json.loads((out / "supervisor.json").read_text())
    assert [a["cause"] for a in records["attempts"]][-1] == "finished"
    assert (out / "goodput.json").exists()


def test_supervisor_budget_and_usage_errors(tmp_path):
    sup, rc, sleeps, _ = _supervise(tmp_path, [1], max_restarts=2, backoff_s=0)
    assert rc == 1 and len(sup.attempts) == 3
    sup, rc, sleeps, out = _supervise(tmp_path / "u", [2], max_restarts=5)
    assert rc == 2 and len(sup.attempts) == 1 and sleeps == []
    assert not (out / "supervisor.json").exists()  # Usage errors leave no records.


def test_supervisor_elastic_device_counts(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxlearn.supervisor"):
        sup, rc, _, out = _supervise(tmp_path, [1, 0], max_restarts=1, backoff_s=0,
                                     devices_for_attempt=lambda k: 8 if k == 0 else 4)
    assert rc == 0
    assert (out / "devices.txt").read_text().split() == ["8", "4"]
    assert "gets 4 device(s) (attempt 0 had 8): elastic restart" in caplog.text


def test_supervisor_bad_arguments_and_child_argv():
    with pytest.raises(ValueError, match="max_restarts"):
        Supervisor(["true"], output_dir="/nonexistent", max_restarts=-1)
    argv = ["--experiment", "x", "--supervise", "--max_restarts", "3", "--restart_backoff_s=2",
            "--set", "a=1"]
    drop = {"--supervise": False, "--max_restarts": True, "--restart_backoff_s": True}
    assert child_argv(argv, drop) == ["--experiment", "x", "--set", "a=1"]


def test_describe_exit():
    assert describe_exit(-9) == "killed by signal SIGKILL"
    assert describe_exit(134).startswith("aborted")
    assert describe_exit(2).startswith("usage error")
    assert describe_exit(7) == "exit status 7"


# ---- SDC: compare, flip, repair -----------------------------------------------------------------


def _replicated(shape=(4, 6)):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "model"))), x


def test_flip_bit_detected_on_the_right_device_and_repaired():
    a, host = _replicated()
    tree = {"params": {"w": a}, "step": jax.device_put(np.int32(3))}
    assert sdc.compare_replicas(tree) == []
    bad = sdc.flip_bit_in_tree(tree, "params/w", device_id=5, flat_index=2, bit=30)
    changed = np.asarray(bad["params"]["w"].addressable_shards[5].data)
    assert not np.array_equal(changed, np.asarray(a.addressable_shards[5].data))
    mismatches = sdc.compare_replicas(bad)
    assert len(mismatches) == 1
    m = mismatches[0]
    assert m.path == "params/w" and [d.id for d in m.bad_devices] == [5]
    assert sorted(d.id for d in m.good_devices) == [1, 3, 7]  # The other holders of that slice.
    assert "cpu:5" in m.describe()
    fixed = sdc.repair_replicas(bad, mismatches)
    assert sdc.compare_replicas(fixed) == []
    np.testing.assert_array_equal(np.asarray(fixed["params"]["w"]), host)


def test_checker_policies_and_recompute_naming():
    a, _ = _replicated()
    bad = {"w": sdc.flip_bit(a, 2)}
    stop = sdc.SdcChecker.default_config().set(every_n_steps=2).instantiate()
    with pytest.raises(SdcError, match="cpu:2"):
        stop.check_replicas(bad, step=4)
    log_only = sdc.SdcChecker.default_config().set(every_n_steps=2, on_mismatch="log")
    assert log_only.instantiate().check_replicas(bad, step=4) is bad
    assert stop.due(4) and not stop.due(3)
    diff = sdc.compare_trees({"w": a}, bad)
    assert [m.bad_devices[0].id for m in diff] == [2]


def test_flip_bit_rejects_bad_targets():
    a, _ = _replicated()
    with pytest.raises(ValueError, match="device 99"):
        sdc.flip_bit(a, 99)
    with pytest.raises(ValueError, match="outside the shard"):
        sdc.flip_bit(a, 0, flat_index=10_000)


# ---- health ---------------------------------------------------------------------------------


def test_health_checks_pass_and_name_failures(tmp_path, monkeypatch):
    # A generous timeout for the passing run (its first call compiles, on a loaded machine);
    # the wedged device below sleeps past a short one.
    relaxed = health.HealthCheck.default_config().set(min_free_bytes=0, device_timeout_s=60.0)
    report = relaxed.instantiate().run(jax.devices(), str(tmp_path))
    check = health.HealthCheck.default_config().set(min_free_bytes=0, device_timeout_s=1.0)
    assert report.num_devices == 8 and report.free_bytes > 0
    huge = health.HealthCheck.default_config().set(min_free_bytes=2**62).instantiate()
    with pytest.raises(HealthCheckError, match="less than health.min_free_bytes"):
        huge.run(jax.devices(), str(tmp_path))
    with pytest.raises(HealthCheckError, match="cannot write to the output directory"):
        check.instantiate().check_output_dir("/proc/no/such/dir")

    real = health.fetch_shard

    def wedged(shard):
        if shard.device.id == 3:
            time.sleep(5)
        return real(shard)


    monkeypatch.setattr(health, "fetch_shard", wedged)
    with pytest.raises(HealthCheckError, match=r"device cpu:3 .*did not finish within 1s"):
        check.instantiate().check_devices(jax.devices())


# ---- elastic, faults, goodput ---------------------------------------------------------------


def test_fit_microbatches():
    assert fit_microbatches(8, 8, 1) == 1
    assert fit_microbatches(8, 4, 1) == 2
    assert fit_microbatches(8, 2, 1) == 4
    assert fit_microbatches(16, 4, 2) == 2
    with pytest.raises(ElasticError, match="cannot be split"):
        fit_microbatches(8, 3, 1)


def test_fault_spec_parsing(tmp_path):
    plan = faults.parse("kill@7:save+30, hang@5,nan@3,flip@6:2:params/table,sdcstep@4:1")
    assert [(f.kind, f.step, f.arg, f.path, f.delay_ms) for f in plan] == [
        ("kill", 7, "save", None, 30.0), ("hang", 5, None, None, 0.0),
        ("nan", 3, None, None, 0.0), ("flip", 6, "2", "params/table", 0.0),
        ("sdcstep", 4, "1", None, 0.0)]
    for bad in ("kill@3", "kill@3:lunch", "boom@1", "flip@2", "nan@x"):
        with pytest.raises(faults.FaultSpecError):
            faults.parse(bad)
    once = faults.FaultPlan(faults.parse("crash@2"), str(tmp_path))
    with pytest.raises(RuntimeError, match="crash before step 2"):
        once.before_step(2, {})
    again = faults.FaultPlan(faults.parse("crash@2"), str(tmp_path))
    assert again.before_step(2, {"x": 1}) == {"x": 1}  # Fired once per output dir.
    for _ in range(2):  # A bad batch is bad on every replay of its step.
        plan = faults.FaultPlan(faults.parse("nan@2"), str(tmp_path))
        batch = plan.before_step(2, {"target_weights": np.ones((2, 3), np.float32)})
        assert np.isnan(batch["target_weights"][0, 0]) and batch["target_weights"][0, 1] == 1


def test_goodput_summary_combines_attempts_and_supervisor(tmp_path, monkeypatch):
    out = str(tmp_path)
    monkeypatch.setenv(goodput.ENV_ATTEMPT, "0")
    rec = goodput.GoodputRecorder(out, flush_every_s=0)
    rec.loop_started(0)
    for s in range(1, 6):
        rec.step_done(s)
    first = rec.record()
    monkeypatch.setenv(goodput.ENV_ATTEMPT, "1")
    rec2 = goodput.GoodputRecorder(out, flush_every_s=0)
    rec2.loop_started(3)  # Resumed from a checkpoint at 3: steps 4 and 5 are rework.
    for s in range(4, 9):
        rec2.step_done(s)
    rec2.mark_skipped(8)
    rec2.close()
    summary = json.loads((tmp_path / "goodput.json").read_text())
    assert summary["steps"] == {"step": 5 + 2, "rework": 2, "skipped": 1}
    assert summary["steps_lost"] == 3 and summary["attempts"] == 2
    sup = {"attempts": [
        {"attempt": 0, "spawn_time": first["spawn_time"], "end_time": first["end_time"] + 2.0},
        {"attempt": 1, "spawn_time": first["end_time"] + 3.0,
         "end_time": first["end_time"] + 3.0 + 1.0}]}
    (tmp_path / "supervisor.json").write_text(json.dumps(sup))
    summary = goodput.summarize(out)
    assert summary["seconds"]["restart"] == pytest.approx(1.0, abs=1e-3)
    assert summary["seconds"]["lost"] >= 1.9
    assert 0 <= summary["goodput"] <= 1 and summary["restarts"] == 1


class _PromptInput:  # An input config whose rows each hold a prompt and its 4 completions.
    global_batch_size = 32

    def batch_rows(self) -> int:
        return 8


def _elastic_cfg(output_dir, input_cfg, micro=1):
    from types import SimpleNamespace

    return SimpleNamespace(output_dir=str(output_dir), input=input_cfg, mesh_shape=(-1,),
                           mesh_axis_names=("data",), mesh_axis_rules=(("batch", "data"),),
                           learner=SimpleNamespace(num_microbatches=micro))


def test_elastic_restart_splits_rows_not_examples(tmp_path):
    """GRPO's 32 completions are 8 rows: on 8 devices one row each; back on 4 devices the
    rows need 2 microbatches to keep one row per device (examples would have said 8)."""
    from jaxlearn.resilience.elastic import adapt_to_devices

    devices = jax.devices()[:8]
    first = adapt_to_devices(_elastic_cfg(tmp_path, _PromptInput()), devices)
    assert (first.batch_rows, first.per_device_microbatch, first.num_microbatches) == (8, 1, 1)
    first.record()
    cfg = _elastic_cfg(tmp_path, _PromptInput())
    again = adapt_to_devices(cfg, devices[:4])
    assert again.changed and again.num_microbatches == cfg.learner.num_microbatches == 2
    assert again.per_device_microbatch == 1
    with pytest.raises(ElasticError, match=r"input.batch_rows\(\)=8 cannot be split over 3"):
        adapt_to_devices(_elastic_cfg(tmp_path, _PromptInput()), devices[:3])


# ---- non-finite step flags --------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from jaxlearn.resilience import nonfinite  # noqa: E402

_STEP_FLAGS = jax.jit(nonfinite.step_flags)


@settings(max_examples=40, deadline=None)
@given(leaf=st.integers(0, 2), pos=st.integers(0, 10**6),
       value=st.sampled_from([np.inf, -np.inf, np.nan, 3e38, -3e38, 1e-45, 0.0]),
       dtype=st.sampled_from([np.float32, jax.numpy.bfloat16]))
def test_step_flags_match_numpy_isfinite(leaf, pos, value, dtype):
    """A leaf is flagged iff one of its elements is Inf or NaN: the largest finite values
    (whose squares overflow) and denormals are not."""
    rng = np.random.default_rng(pos)
    grads = [rng.standard_normal(shape).astype(dtype) for shape in ((3, 5), (7,), (2, 3, 4))]
    flat = grads[leaf].reshape(-1)
    flat[pos % flat.size] = value
    loss = np.float32(value if leaf == 0 and pos % 7 == 0 else 1.0)
    want = [np.isfinite(loss)] + [bool(np.all(np.isfinite(g.astype(np.float32))))
                                  for g in grads]
    np.testing.assert_array_equal(np.asarray(_STEP_FLAGS(loss, grads)), want)
