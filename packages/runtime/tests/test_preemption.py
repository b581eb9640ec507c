"""Preemption across processes: SIGTERM/SIGINT at seeded points save and commit the current
step and exit 46, the rerun ends bit for bit where an uninterrupted run ends; a second
signal exits at once and a grace period that runs out exits 47, both leaving the previous
committed step intact; metrics are not repeated and goodput counts redone steps as rework
after a kill; a resume with another max_step warns that the schedule changes."""

import json
import logging
import os
import random
import re
import subprocess
import sys

import pytest
from resilience_child import HERE, child_config, flat_params
from test_resilience_kill import _assert_bit_exact, _final

from jaxlearn.checkpoint import Checkpointer
from jaxlearn.resilience.failures import EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED

CHILD = [sys.executable, os.path.join(HERE, "resilience_child.py")]
MAX_STEP = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process (same XLA, same 8 devices)."""
    import numpy as np

    out = tmp_path_factory.mktemp("reference")
    s = child_config(str(out)).instantiate().run().state
    np.savez(out / "final_params.npz",
             **flat_params({"params": s["params"], "opt_state": s["opt_state"]}))
    return _final(out)


def _child(out, *overrides):
    args = [*CHILD, str(out)]
    for o in overrides:
        args += ["--set", o]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8")
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stderr


def _steps(out):
    ckpt = Checkpointer.default_config().set(directory=str(out / "checkpoints")).instantiate()
    return ckpt.steps()


# The save of whichever step the signal's flag reaches is stalled: under load the watcher
# thread that reads the signal can see it a few (millisecond) steps after it was sent.
STALLS = ",".join(f"stall@{s}+120000" for s in range(5, MAX_STEP))


def _assert_intact_before(out, step):
    """Only steps saved before `step` are visible (step 4 of `save_every_n_steps=4`, once
    its async commit is done), and each verifies; no trace of `step` but a `.tmp` dir."""
    ckpt = Checkpointer.default_config().set(directory=str(out / "checkpoints")).instantiate()
    assert set(ckpt.steps()) <= {4}, ckpt.steps()
    for s in ckpt.steps():
        assert ckpt.read_metadata(s).step == s
    names = [p.name for p in (out / "checkpoints").glob(f"step_{step:08d}*")]
    assert set(names) <= {f"step_{step:08d}.tmp"}, names


def _train_rows(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["split"] == "train"]


def signal_points(seed):
    """Two seeded preemption points, the second after the first's saved step: (signal,
    step, phase, delay ms); phase `step` lands while the step computes, `eval` during an
    evaluation (steps 4, 8), `save` while the async save of a step (3, 6, 9) is in flight."""
    rng = random.Random(seed)
    first = rng.choice([("step", s) for s in range(1, 6)] + [("eval", 4), ("save", 3)])
    later = [p for p in [("step", s) for s in range(7, 12)] + [("eval", 8), ("save", 9)]
             if p[1] > first[1]]
    second = rng.choice(later)
    return [("sigterm", first[1], first[0], rng.choice([0, 5])),
            ("sigint", second[1], second[0], rng.choice([0, 5]))]


@pytest.mark.parametrize("seed", [0])
def test_signals_save_current_step_and_resume_bit_exact(tmp_path, reference, seed):
    out = tmp_path / "pre"
    plan = signal_points(seed)
    faults = ",".join(f"{k}@{s}:{p}" + (f"+{d}" if d else "") for k, s, p, d in plan)
    name = {"sigterm": "SIGTERM", "sigint": "SIGINT"}
    for kind, step, _, _ in plan:
        rc, err = _child(out, f"resilience.faults={faults}")
        assert rc == EXIT_PREEMPTED, err[-3000:]
        # The step in flight when the signal came (or the next, for a delayed signal)
        # is the newest committed step, and the log says so in one line.
        saved = _steps(out)[-1]
        assert step <= saved <= step + 1, (plan, saved, err[-2000:])
        line = [x for x in err.splitlines()
                if "jaxlearn.resilience: preemption:" in x and "saved and committed" in x]
        assert len(line) == 1 and f"{name[kind]}: saved and committed step {saved} " in line[0]
        assert f"exiting with status {EXIT_PREEMPTED}" in line[0]
    rc, err = _child(out, f"resilience.faults={faults}")
    assert rc == 0, err[-3000:]
    assert f"from step {saved}" in err
    _assert_bit_exact(out, reference, plan)
    assert sorted(_train_rows(out)) == list(range(1, MAX_STEP + 1))  # Each step once.
    summary = json.loads((out / "goodput.json").read_text())
    assert summary["steps"] == {"step": MAX_STEP, "rework": 0, "skipped": 0}


def test_second_signal_exits_at_once_keeping_previous_commit(tmp_path, reference):
    """Two SIGTERMs 1.5 s apart, the first during step 5, while the save (of step 5, or a
    later one when the flag missed step 5's boundary) is stalled: the second ends the run
    during the save (the grace period, 20 s, has not run out)."""
    out = tmp_path / "twice"
    faults = f"resilience.faults=sigterm@5:step:2,{STALLS}"
    rc, err = _child(out, faults, "save_every_n_steps=4")
    assert rc == 128 + 15, err[-3000:]
    saving = re.search(r"second signal \(SIGTERM\) while saving step (\d+): exiting at once "
                       "with status 143", err)
    assert saving and int(saving[1]) >= 5, err[-3000:]
    _assert_intact_before(out, int(saving[1]))
    rc, err = _child(out, faults, "save_every_n_steps=4")
    assert rc == 0, err[-3000:]
    _assert_bit_exact(out, reference, "second signal")


def test_grace_period_out_exits_47_keeping_previous_commit(tmp_path):
    out = tmp_path / "slow"
    rc, err = _child(out, f"resilience.faults=sigterm@5:step,{STALLS}",
                     "resilience.preemption.grace_s=5.0", "save_every_n_steps=4")
    assert rc == EXIT_PREEMPTED_UNSAVED, err[-3000:]
    saving = re.search(r"grace period of 5 s after SIGTERM ran out while saving step (\d+)",
                       err)
    assert saving and int(saving[1]) >= 5, err[-3000:]
    _assert_intact_before(out, int(saving[1]))


def test_kill_resume_metrics_once_and_rework_counted(tmp_path, reference):
    """SIGKILL during step 8 (steps 1..7 done), goodput records flushed only at the first
    step: every step from the newest commit (6, or earlier while its async commit was
    unfinished) to 7 is rework on the rerun; each metrics step appears once."""
    out = tmp_path / "kill"
    flush = "resilience.goodput_flush_every_s=1000.0"
    rc, _ = _child(out, "resilience.faults=kill@8:step", flush, "eval_every_n_steps=0")
    assert rc == -9
    assert sorted(_train_rows(out)) == list(range(1, 8))
    resumed = max(_steps(out), default=0)
    rc, err = _child(out, "resilience.faults=kill@8:step", flush, "eval_every_n_steps=0")
    assert rc == 0, err[-3000:]
    assert sorted(_train_rows(out)) == list(range(1, MAX_STEP + 1))
    summary = json.loads((out / "goodput.json").read_text())
    assert summary["steps"] == {"step": MAX_STEP, "rework": 7 - resumed, "skipped": 0}
    assert summary["steps_lost"] == 7 - resumed
    assert f"steps {resumed + 1}..7 are rework lost to the restart" in err


def test_resume_with_other_max_step_warns_schedule_changes(tmp_path, caplog):
    out = str(tmp_path / "sched")
    child_config(out, ["max_step=3", "learner.total_steps=None", "eval_every_n_steps=0"]
                 ).instantiate().run()
    with caplog.at_level(logging.WARNING, logger="jaxlearn.trainer"):
        child_config(out, ["max_step=4", "learner.total_steps=None", "eval_every_n_steps=0"]
                     ).instantiate().run()
    warned = [r.message for r in caplog.records if "learning-rate schedule" in r.message]
    assert warned == ["resumed at step 3 with a learning-rate schedule of 4 steps; the "
                      "checkpoint's run scheduled 3, so the learning rate from step 3 on "
                      "follows the 4-step schedule (set learner.total_steps=3 to keep the "
                      "original one)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxlearn.trainer"):
        child_config(out, ["max_step=5", "learner.total_steps=4", "eval_every_n_steps=0"]
                     ).instantiate().run()
    assert not [r for r in caplog.records if "learning-rate schedule" in r.message]


def _two_processes(out, faults_on_1=""):
    """The child as 2 processes x 4 CPU devices; `faults_on_1`: process 1's faults."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="4")
    env.pop("XLA_FLAGS", None)
    procs = []
    for pid in (0, 1):
        args = [*CHILD, str(out), "--distributed", str(port), str(pid), "2",
                "--set", "eval_every_n_steps=0"]
        if pid == 1 and faults_on_1:
            args += ["--set", f"resilience.faults={faults_on_1}"]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [p.returncode for p in procs], outs


def test_two_processes_save_the_same_step_when_one_is_signalled(tmp_path):
    """SIGTERM reaches process 1 only, during step 5: both processes stop at the step
    the vote agreed on (one boundary later), save it together and exit 46; the rerun
    ends bit for bit where an uninterrupted 2-process run ends."""
    ref = tmp_path / "ref"
    rcs, outs = _two_processes(ref)
    assert rcs == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    out = tmp_path / "pre"
    rcs, outs = _two_processes(out, "sigterm@5:step")
    assert rcs == [EXIT_PREEMPTED] * 2, outs[0][-2000:] + outs[1][-2000:]
    saved = _steps(out)[-1]
    assert saved in (6, 7), saved
    assert f"a preemption signal to another process: saved and committed step {saved} " \
        in outs[0]
    assert f"SIGTERM: saved and committed step {saved} " in outs[1]
    rcs, outs = _two_processes(out, "sigterm@5:step")
    assert rcs == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert f"from step {saved}" in outs[0]
    _assert_bit_exact(out, _final(ref), "two processes")
