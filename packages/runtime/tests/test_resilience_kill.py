"""Fault injection across processes: SIGKILL at seeded random points (during a step, an
async save, an eval), a hang caught by the watchdog, an elastic restart on fewer devices;
the supervisor restarts each time and the run must end exactly where an uninterrupted run
ends (bit for bit, except after an elastic restart: there up to reassociation)."""

import json
import os
import random
import signal
import sys

import numpy as np
import pytest
from resilience_child import HERE, child_config, flat_params

from jaxlearn.checkpoint import Checkpointer
from jaxlearn.resilience.failures import EXIT_HANG
from jaxlearn.resilience.supervisor import Supervisor

CHILD = [sys.executable, os.path.join(HERE, "resilience_child.py")]
MAX_STEP, SAVES, EVALS = 12, (3, 6, 9, 12), (4, 8, 12)


def kill_plan(seed: int, per_phase: dict[str, int]) -> list[str]:
    """Distinct seeded kill points, `per_phase[phase]` of each: a step (1..12), a delay
    after entering the phase (so the kill lands anywhere in it, or past it)."""
    rng = random.Random(seed)
    steps = {"step": range(1, MAX_STEP + 1), "save": SAVES, "eval": EVALS}
    delays = {"step": [0, 0, 3, 15], "save": [0, 5, 25, 80], "eval": [0, 5, 30]}
    out = []
    for phase, n in per_phase.items():
        for step in rng.sample(list(steps[phase]), n):
            delay = 0 if step == MAX_STEP else rng.choice(delays[phase])
            out.append(f"kill@{step}:{phase}" + (f"+{delay}" if delay else ""))
    return out


def _env(devices: int = 8) -> dict:
    return dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices))


def _final(out) -> tuple[dict, dict]:
    with np.load(os.path.join(out, "final_params.npz")) as z:
        params = {k: z[k] for k in z.files}
    ckpt = Checkpointer.default_config().set(directory=os.path.join(out, "checkpoints"))
    meta = ckpt.instantiate().read_metadata(MAX_STEP)
    return params, {p: r.digest for p, r in meta.arrays.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process (same XLA, same 8 devices)."""
    out = tmp_path_factory.mktemp("reference")
    s = child_config(str(out)).instantiate().run().state
    np.savez(out / "final_params.npz",
             **flat_params({"params": s["params"], "opt_state": s["opt_state"]}))
    return _final(out)


def _supervise(out, faults, *, restarts, devices_for_attempt=None, args=()):
    sup = Supervisor([*CHILD, str(out), "--set", f"resilience.faults={faults}", *args],
                     output_dir=str(out), max_restarts=restarts,
                     backoff_s=0.0, env=_env(), log_path=str(out) + ".log",
                     devices_for_attempt=devices_for_attempt)
    rc = sup.run()
    log = open(str(out) + ".log").read()
    assert rc == 0, log[-3000:]
    return sup, log


def _assert_bit_exact(out, reference, context):
    params, digests = _final(out)
    ref_params, ref_digests = reference
    assert digests == ref_digests, context  # Params, optimizer state, PRNG key, step.
    assert params.keys() == ref_params.keys()
    for k in params:
        assert params[k].tobytes() == ref_params[k].tobytes(), (k, context)


@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_at_random_points_resumes_bit_exact(tmp_path, reference, seed):
    plan = kill_plan(seed, {"step": 2, "save": 2, "eval": 1})
    out = tmp_path / f"chain{seed}"
    sup, log = _supervise(out, ",".join(plan), restarts=len(plan) + 1)
    killed = [a for a in sup.attempts if a.returncode == -signal.SIGKILL]
    assert len(killed) == len(plan), (plan, [a.cause for a in sup.attempts])
    assert len(os.listdir(out / "faults_fired")) == len(plan)
    _assert_bit_exact(out, reference, plan)
    # No interrupted save ever became visible, and every visible step verifies.
    ckpt = Checkpointer.default_config().set(directory=str(out / "checkpoints")).instantiate()
    for step in ckpt.steps():
        assert ckpt.read_metadata(step).step == step
    summary = json.loads((out / "goodput.json").read_text())
    assert summary["restarts"] == len(plan) and summary["steps"]["step"] == MAX_STEP


def test_hang_watchdog_fires_supervisor_restarts(tmp_path, reference):
    out = tmp_path / "hang"
    # Long enough that no real step of the toy job takes it on a loaded 2-core machine
    # (the restarted attempt must not be taken for a hang), short next to the fault's
    # forever.
    timeout = 8.0
    sup, log = _supervise(out, "hang@5", restarts=2, args=[
        "--set", f"resilience.watchdog.timeout_s={timeout}",
        "--set", "resilience.watchdog.first_step_timeout_s=300.0",
        "--set", "resilience.watchdog.poll_interval_s=0.2",
        "--set", "resilience.watchdog.exit_on_hang=True"])
    first = sup.attempts[0]
    assert first.returncode == EXIT_HANG and first.cause.startswith("watchdog")
    assert len(sup.attempts) == 2 and sup.attempts[1].returncode == 0
    assert "watchdog: no progress" in log and "after step 4" in log
    assert "in before_step" in log  # The hung frame is in the dump.
    hung_at = float((out / "faults_fired" / "hang_5").read_text())
    assert first.end_time - hung_at < timeout + 0.2 + 5.0  # Timeout, poll, process exit.
    assert list((out / "watchdog").glob("hang_step4_pid*.txt"))
    _assert_bit_exact(out, reference, "hang")


def test_elastic_restart_on_fewer_devices(tmp_path, reference):
    out = tmp_path / "elastic"
    sup, log = _supervise(out, "kill@7:step", restarts=1, args=["--elastic"],
                          devices_for_attempt=lambda k: 8 if k == 0 else 4)
    assert [a.devices for a in sup.attempts] == [8, 4]
    assert "child: 8 devices" in log and "num_microbatches 1" in log
    assert "elastic restart: 4 device(s) (the run started on 8)" in log
    assert "learner.num_microbatches 1 -> 2 keeps the global batch 8" in log
    assert "'data': 4" in log and "resumed from step" in log
    params, _ = _final(out)
    ref_params, _ = reference
    for k in params:  # Same batch, same data order; sums reassociated over 4 devices.
        np.testing.assert_allclose(params[k], ref_params[k], rtol=2e-5, atol=1e-6, err_msg=k)
