"""Goodput/badput accounting: where the wall-clock time of a training job went.

Each process-0 attempt (one start of the trainer) records seconds per bucket:

    startup    process start (when a supervisor passed JAXLEARN_SPAWN_TIME) until the
               recorder started, plus unattributed time before the first step
    health     pre-training health checks          restore   restore or fresh init
    compile    compiling the train step            data      input pipeline + host->device
    step       productive steps (goodput)          rework    steps redone after a restart
    skipped    steps whose update was dropped (non-finite values, SDC skip)
    checkpoint blocking part of saves, and waiting for the last commit
    eval       evaluation                          sdc       SDC checks
    other      the rest of a finished attempt (teardown, time between the last step and exit)

into `<output_dir>/goodput/attempt_<k>.json` (rewritten atomically every
`flush_every_s` and at exit, so a killed attempt loses at most that much of its record).
Each step also overwrites `attempt_<k>.step` in place (one `pwrite` of the last step done,
no fsync; a killed process's writes survive in the page cache), so the next attempt knows
exactly how far a killed one got: every step up to there that it computes again (from the
newest committed checkpoint on) is `rework`, and `summarize()` counts the steps a killed
attempt did after its last flush.
The supervisor adds, per attempt, `lost` (wall time of an attempt that its record does not
cover, i.e. the work since its last flush before it died) and `restart` (from one
attempt's end to the next one's start: backoff and relaunch). `summarize()` combines them:

    goodput = step / wall, wall = first spawn .. last exit (supervised) or the sum of the
    attempts' walls (unsupervised), and steps lost = rework + skipped steps.

Step time is measured between consecutive steps minus the named spans in between; the
caller blocks on the state before `checkpoint` and `eval` spans so device work of earlier
steps is not billed to them.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import time
from typing import Any, Iterator, Optional

log = logging.getLogger("jaxlearn.goodput")

BUCKETS = ("startup", "health", "restore", "compile", "data", "step", "rollout", "rework",
           "skipped", "checkpoint", "eval", "sdc", "other", "lost", "restart")
# Productive time: training steps and (RL) sampling the step's batch from the policy.
GOODPUT = ("step", "rollout")
BADPUT = tuple(b for b in BUCKETS if b not in GOODPUT)
ENV_SPAWN_TIME = "JAXLEARN_SPAWN_TIME"
ENV_ATTEMPT = "JAXLEARN_ATTEMPT"
SUPERVISOR_FILE = "supervisor.json"
SUMMARY_FILE = "goodput.json"


def _write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _attempt_files(output_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(output_dir, "goodput", "attempt_*.json")))


def _progress_path(output_dir: str, attempt: int) -> str:
    return os.path.join(output_dir, "goodput", f"attempt_{attempt:04d}.step")


def read_progress(output_dir: str, attempt: int) -> Optional[int]:
    """The last step attempt `attempt` finished, per its progress file (None: no file)."""
    try:
        with open(_progress_path(output_dir, attempt)) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


class GoodputRecorder:
    """Per-attempt bucket timer (a no-op when `enabled` is False)."""

    def __init__(self, output_dir: str, *, enabled: bool = True, flush_every_s: float = 30.0):
        self.enabled = enabled
        self._dir = os.path.join(output_dir, "goodput")
        self._output_dir = output_dir
        self.flush_every_s = flush_every_s
        now = time.time()
        self.start_time = now
        spawn = os.environ.get(ENV_SPAWN_TIME)
        self.spawn_time = float(spawn) if spawn else now
        attempt = os.environ.get(ENV_ATTEMPT)
        self.attempt = int(attempt) if attempt else len(_attempt_files(output_dir))
        self.seconds = {b: 0.0 for b in BUCKETS if b not in ("lost", "restart")}
        self.seconds["startup"] = max(0.0, now - self.spawn_time)
        self.steps = {"step": 0, "rework": 0, "skipped": 0}
        self.first_step: Optional[int] = None
        self.last_step: Optional[int] = None
        self.resumed_from = 0
        self._high_water = self._previous_high_water() if enabled else 0
        self._mark = time.monotonic()
        self._spans_since_mark = 0.0
        self._last_flush = 0.0
        self._open_spans = 0
        self.closed = False
        self._looping = False
        self._progress_fd: Optional[int] = None
        self._progress_ok = enabled

    def _previous_high_water(self) -> int:
        high = 0
        for path in _attempt_files(self._output_dir):
            try:
                with open(path) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            if rec.get("attempt") == self.attempt:
                continue
            done = read_progress(self._output_dir, int(rec["attempt"]))
            for last in (rec.get("last_step"), done):
                if last is not None:
                    high = max(high, int(last))
        return high

    # ---- recording ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def span(self, bucket: str) -> Iterator[None]:
        t0 = time.monotonic()
        self._open_spans += 1
        try:
            yield
        finally:
            self._open_spans -= 1
            dt = time.monotonic() - t0
            if self._open_spans == 0:  # Nested spans count once, in the outer bucket.
                self.seconds[bucket] += dt
                self._spans_since_mark += dt

    def loop_started(self, start_step: int) -> None:
        """The training loop starts at `start_step` (0, or the restored checkpoint's)."""
        self.resumed_from = start_step
        self._looping = True
        spans = sum(v for k, v in self.seconds.items() if k != "startup")
        self.seconds["startup"] += max(0.0, time.time() - self.start_time - spans)
        self._mark, self._spans_since_mark = time.monotonic(), 0.0
        if self._high_water > start_step:
            log.info("goodput: resumed at step %d; steps %d..%d are rework lost to the restart",
                     start_step, start_step + 1, self._high_water)

    def step_done(self, step: int, *, skipped: bool = False) -> None:
        now = time.monotonic()
        dt = max(0.0, now - self._mark - self._spans_since_mark)
        self._mark, self._spans_since_mark = now, 0.0
        bucket = "skipped" if skipped else ("rework" if step <= self._high_water else "step")
        self.seconds[bucket] += dt
        self.steps[bucket] += 1
        if self.first_step is None:
            self.first_step = step
        self.last_step = step
        if self.enabled and time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()
        self._write_progress(step)

    def _write_progress(self, step: int) -> None:
        """The last step done, overwritten in place (fixed width: one pwrite)."""
        if not self._progress_ok:
            return
        try:
            if self._progress_fd is None:
                os.makedirs(self._dir, exist_ok=True)
                self._progress_fd = os.open(_progress_path(self._output_dir, self.attempt),
                                            os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(self._progress_fd, f"{step:>20d}\n".encode(), 0)
        except OSError as e:
            log.warning("goodput: cannot write the progress file: %s", e)
            self._progress_ok = False

    def mark_skipped(self, step: int) -> None:
        """Moves one already-recorded step of `step` to the skipped bucket (the flags of
        a step are read one step late)."""
        src = "rework" if step <= self._high_water else "step"
        if self.steps[src] > 0:
            per = self.seconds[src] / self.steps[src]
            self.seconds[src] -= per
            self.steps[src] -= 1
            self.seconds["skipped"] += per
            self.steps["skipped"] += 1

    # ---- reporting ----------------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        wall = time.time() - self.spawn_time
        return {
            "attempt": self.attempt,
            "pid": os.getpid(),
            "spawn_time": self.spawn_time,
            "start_time": self.start_time,
            "end_time": time.time(),
            "wall_s": wall,
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
            "steps": dict(self.steps),
            "resumed_from": self.resumed_from,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "rework_until": self._high_water,
            "closed": self.closed,
        }

    def scalars(self) -> dict[str, float]:
        """This attempt so far: goodput fraction and seconds per bucket (for summaries)."""
        rec = self.record()
        out = {f"{k}_s": v for k, v in rec["seconds"].items()}
        out["goodput"] = (sum(rec["seconds"].get(b, 0.0) for b in GOODPUT)
                          / max(rec["wall_s"], 1e-9))
        return out

    def flush(self) -> None:
        if not self.enabled or not self._looping:  # Nothing recorded before the loop.
            return
        self._last_flush = time.monotonic()
        try:
            os.makedirs(self._dir, exist_ok=True)
            _write_json(os.path.join(self._dir, f"attempt_{self.attempt:04d}.json"), self.record())
        except OSError as e:
            log.warning("goodput: cannot write the attempt record: %s", e)

    def close(self) -> Optional[dict[str, Any]]:
        """Final flush and `<output_dir>/goodput.json` (all attempts so far)."""
        if not self.enabled or self.closed or not self._looping:
            return None
        self.closed = True
        if self._progress_fd is not None:
            os.close(self._progress_fd)
            self._progress_fd = None
        covered = sum(self.seconds.values())
        self.seconds["other"] += max(0.0, time.time() - self.spawn_time - covered)
        self.flush()
        try:
            summary = summarize(self._output_dir)
            _write_json(os.path.join(self._output_dir, SUMMARY_FILE), summary)
        except OSError as e:
            log.warning("goodput: cannot write the summary: %s", e)
            return None
        log.info("goodput: %s", format_summary(summary))
        return summary


def summarize(output_dir: str) -> dict[str, Any]:
    """Totals over every attempt recorded under `output_dir` (and the supervisor's
    records, when there are any)."""
    attempts = {}
    for path in _attempt_files(output_dir):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        attempts[int(rec["attempt"])] = rec
    supervisor: dict[str, Any] = {}
    sup_path = os.path.join(output_dir, SUPERVISOR_FILE)
    if os.path.exists(sup_path):
        try:
            with open(sup_path) as f:
                supervisor = json.load(f)
        except (OSError, ValueError):
            supervisor = {}
    totals = {b: 0.0 for b in BUCKETS}
    steps = {"step": 0, "rework": 0, "skipped": 0}
    for rec in attempts.values():
        for k, v in rec["seconds"].items():
            totals[k] = totals.get(k, 0.0) + float(v)
        for k, v in rec["steps"].items():
            steps[k] = steps.get(k, 0) + int(v)
        for k, n in _unflushed_steps(output_dir, rec).items():
            steps[k] += n
    sup_attempts = supervisor.get("attempts", [])
    if sup_attempts:
        for i, a in enumerate(sup_attempts):
            rec = attempts.get(int(a["attempt"]))
            covered = sum(rec["seconds"].values()) if rec else 0.0
            # A finished record covers its attempt; what is missing was lost with the process.
            totals["lost"] += max(0.0, float(a["end_time"]) - float(a["spawn_time"]) - covered)
            if i + 1 < len(sup_attempts):
                totals["restart"] += max(
                    0.0, float(sup_attempts[i + 1]["spawn_time"]) - float(a["end_time"]))
        wall = float(sup_attempts[-1]["end_time"]) - float(sup_attempts[0]["spawn_time"])
    else:
        wall = sum(float(r["wall_s"]) for r in attempts.values())
    wall = max(wall, 1e-9)
    return {
        "wall_s": wall,
        "seconds": {k: round(v, 4) for k, v in totals.items()},
        "fractions": {k: round(v / wall, 4) for k, v in totals.items()},
        "goodput": sum(totals[b] for b in GOODPUT) / wall,
        "badput": sum(totals[b] for b in BADPUT) / wall,
        "steps": steps,
        "steps_lost": steps["rework"] + steps["skipped"],
        "attempts": len(attempts),
        "restarts": max(len(sup_attempts), len(attempts)) - 1 if (sup_attempts or attempts)
        else 0,
        "supervisor_attempts": sup_attempts,
    }


def _unflushed_steps(output_dir: str, rec: dict[str, Any]) -> dict[str, int]:
    """Steps an attempt finished after its last flush (it was killed), per its progress
    file, split into rework (up to the steps done before it) and new steps; their
    seconds are in the supervisor's `lost`."""
    done = read_progress(output_dir, int(rec["attempt"]))
    last = rec.get("last_step")
    if done is None or last is None or done <= int(last):
        return {}
    high = int(rec.get("rework_until") or 0)
    rework = max(0, min(done, high) - int(last))
    return {"rework": rework, "step": done - int(last) - rework}


def format_summary(summary: dict[str, Any]) -> str:
    parts = [f"goodput {summary['goodput']:.1%} of {summary['wall_s']:.1f}s"]
    big = sorted(((v, k) for k, v in summary["seconds"].items() if k != "step" and v > 0),
                 reverse=True)
    parts += [f"{k} {v:.1f}s" for v, k in big[:6]]
    parts.append(f"{summary['restarts']} restart(s), {summary['steps_lost']} step(s) lost")
    return ", ".join(parts)


__all__ = ["BUCKETS", "GoodputRecorder", "format_summary", "summarize"]
