"""Preemption building blocks: real SIGTERM/SIGINT through the wakeup-fd watcher (a
duplicate within SAME_NOTICE_S ignored), the grace
deadline, the stop vote, the signal and stall faults, exit codes, the supervisor retrying a
preempted child, and goodput rework after a kill between flushes."""

import json
import os
import signal
import threading
import time

import pytest
from test_resilience_units import _supervise

from jaxlearn.config import ConfigError
from jaxlearn.resilience import faults, goodput
from jaxlearn.resilience.failures import (
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_UNSAVED,
    describe_exit,
)
from jaxlearn.resilience.preemption import SAME_NOTICE_S, Preemption, StopVote


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def _handler(grace_s=100.0):
    exits: list[int] = []
    p = Preemption.default_config().set(grace_s=grace_s).instantiate(exit_fn=exits.append)
    return p, exits


def test_first_signal_sets_flag_second_exits_at_once_handlers_restored():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    p, exits = _handler()
    assert p.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # The same notice again (e.g. forwarded).
        assert p.requested.wait(10) and p.signal_name == "SIGTERM"
        time.sleep(0.3)
        assert exits == []  # The loop acts on the flag; nothing exits yet.
        time.sleep(SAME_NOTICE_S)
        os.kill(os.getpid(), signal.SIGINT)
        assert _wait(lambda: exits == [128 + signal.SIGINT])
    finally:
        p.uninstall()
    assert {s: signal.getsignal(s) for s in before} == before


def test_install_only_on_the_main_thread_and_when_enabled():
    p, _ = _handler()
    results = []
    t = threading.Thread(target=lambda: results.append(p.install()))
    t.start()
    t.join()
    assert results == [False] and not p.installed
    off = Preemption.default_config().set(enabled=False).instantiate()
    assert not off.install()


def test_grace_deadline_exits_47_unless_disarmed():
    p, exits = _handler(grace_s=0.2)
    p.notify(signal.SIGTERM)
    assert _wait(lambda: exits == [EXIT_PREEMPTED_UNSAVED], timeout=5)
    q, exits_q = _handler(grace_s=0.2)
    q.notify(signal.SIGTERM)
    q.disarm()
    time.sleep(0.5)
    assert exits_q == [] and q.elapsed_s() >= 0.5


def test_grace_must_be_positive():
    with pytest.raises(ConfigError, match="grace_s: must be > 0, got 0"):
        Preemption.default_config().set(grace_s=0.0).validate()


def test_stop_vote_single_process_is_the_local_flag():
    import jax

    vote = StopVote(jax.devices())
    assert not vote.multi and vote.vote(False) is False and vote.vote(True) is True


def test_signal_and_stall_fault_specs():
    plan = faults.parse("sigterm@3:step:2+5,sigint@4:eval,stall@5+300")
    assert [(f.kind, f.step, f.arg, f.path, f.delay_ms) for f in plan] == [
        ("sigterm", 3, "step", "2", 5.0), ("sigint", 4, "eval", None, 0.0),
        ("stall", 5, None, None, 300.0)]
    for bad in ("sigterm@3", "sigint@3:lunch", "sigterm@3:step:x"):
        with pytest.raises(faults.FaultSpecError):
            faults.parse(bad)
    stall = faults.FaultPlan(faults.parse("stall@2+200"))
    t0 = time.monotonic()
    stall.stall_save(1)
    assert time.monotonic() - t0 < 0.1
    stall.stall_save(2)
    assert time.monotonic() - t0 >= 0.2


def test_exit_codes_and_supervisor_retries_a_preempted_child(tmp_path):
    assert describe_exit(EXIT_PREEMPTED) == "preempted: checkpoint of the current step saved"
    assert describe_exit(EXIT_PREEMPTED_UNSAVED).startswith("preempted: grace period")
    assert describe_exit(143) == "killed by signal SIGTERM (shell status)"
    sup, rc, _, _ = _supervise(tmp_path, [EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED, 0],
                               max_restarts=3, backoff_s=0)
    assert rc == 0 and [a.returncode for a in sup.attempts] == [46, 47, 0]


def test_goodput_counts_steps_after_the_last_flush_of_a_killed_attempt(tmp_path,
                                                                       monkeypatch):
    """Attempt 0 flushes its record at step 1 only, does steps 1..9 and is killed (the
    checkpoint at 6 survives); attempt 1 resumes at 6: steps 7..9 are rework."""
    out = str(tmp_path)
    monkeypatch.setenv(goodput.ENV_ATTEMPT, "0")
    killed = goodput.GoodputRecorder(out, flush_every_s=3600)
    killed.loop_started(0)
    for s in range(1, 10):
        killed.step_done(s)
    record = json.loads((tmp_path / "goodput" / "attempt_0000.json").read_text())
    assert record["last_step"] == 1  # Stale: the process died before its next flush.
    assert goodput.read_progress(out, 0) == 9
    monkeypatch.setenv(goodput.ENV_ATTEMPT, "1")
    resumed = goodput.GoodputRecorder(out, flush_every_s=3600)
    resumed.loop_started(6)
    for s in range(7, 13):
        resumed.step_done(s)
    resumed.close()
    assert resumed.steps == {"step": 3, "rework": 3, "skipped": 0}
    summary = json.loads((tmp_path / "goodput.json").read_text())
    assert summary["steps"] == {"step": 12, "rework": 3, "skipped": 0}
    assert summary["steps_lost"] == 3
