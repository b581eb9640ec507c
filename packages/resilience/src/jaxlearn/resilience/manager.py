"""The trainer's resilience hooks in one place: health checks, watchdog, non-finite and SDC
policies, goodput accounting, fault injection, checkpoint-save failures.

`Trainer.Config.resilience` holds the knobs; `Trainer.run` builds one `Resilience` per run
and calls its hooks around the loop:

    guard.start(devices)                    health checks, watchdog on
    with guard.span("restore"): ...         goodput bucket + watchdog phase
    guard.loop_started(start_step)
    local = guard.before_step(step, local)  faults: hang / crash / NaN in the batch
    state, s = guard.train_step(fn, state, batch, step)     SDC recompute on due steps
    state, s = guard.after_step(step, state, s)             non-finite flags, SDC replicas,
                                                            watchdog beat, goodput
    guard.save(checkpointer, step, state, ...)              SDC before save, clear errors
    if guard.stop_requested(step): ... guard.preempted(checkpointer, step)
                                           SIGTERM/SIGINT (preemption.py): raises Preempted
    guard.finish(); guard.close()
"""

from __future__ import annotations

import contextlib
import errno
import logging
from typing import Any, Callable, Iterator, Literal, NoReturn, Optional, Sequence

import jax

from jaxlearn.checkpoint import CheckpointSaveError
from jaxlearn.config import ConfigError, Configurable, below_minimum
from jaxlearn.resilience.failures import EXIT_PREEMPTED, Preempted
from jaxlearn.resilience.faults import FIELD as FAULTS_FIELD
from jaxlearn.resilience.faults import FaultPlan, FaultSpecError
from jaxlearn.resilience.faults import parse as parse_faults
from jaxlearn.resilience.goodput import GoodputRecorder
from jaxlearn.resilience.health import HealthCheck, describe_free_space
from jaxlearn.resilience.nonfinite import NonFiniteMonitor
from jaxlearn.resilience.preemption import Preemption, StopVote
from jaxlearn.resilience.sdc import SdcChecker
from jaxlearn.resilience.watchdog import Watchdog

log = logging.getLogger("jaxlearn.resilience")


class CheckpointSaveFailed(RuntimeError):
    """A checkpoint could not be written (e.g. the disk is full); earlier steps are intact."""


class Resilience(Configurable):
    """Per-run resilience state; see the module doc."""

    class Config(Configurable.Config):
        watchdog: Watchdog.Config = Watchdog.default_config()
        health: HealthCheck.Config = HealthCheck.default_config()
        sdc: SdcChecker.Config = SdcChecker.default_config()
        # SIGTERM/SIGINT: save the current step within grace_s and exit 46 (preemption.py).
        preemption: Preemption.Config = Preemption.default_config()
        # NaN/Inf in loss or gradients: skip the update, stop the run, or do nothing.
        nonfinite: Literal["skip", "stop", "off"] = "skip"
        # Stop after more than this many skipped steps in a row.
        max_consecutive_nonfinite: int = 10
        # Goodput records under <output_dir>/goodput (process 0); flushed this often.
        goodput_flush_every_s: float = 30.0
        # On a device count other than the run's first, keep the global batch by raising
        # learner.num_microbatches (`jaxlearn train --elastic`; see elastic.py).
        elastic: bool = False
        # Injected faults for resilience tests, e.g. "kill@3:step,nan@5" (see faults.py;
        # each transient fault fires once per output directory). Empty: none.
        faults: str = ""

        def _field_problems(self) -> dict[str, str]:
            problems = below_minimum(self, max_consecutive_nonfinite=0,
                                     goodput_flush_every_s=0)
            try:
                parse_faults(self.faults)
            except FaultSpecError as e:
                problems["faults"] = str(e).removeprefix(f"{FAULTS_FIELD}: ")
            return problems

    def __init__(self, cfg: "Resilience.Config", *, output_dir: str, is_main: bool = True,
                 param_paths: Sequence[str] = ()):
        super().__init__(cfg)
        cfg = self.config
        if cfg.max_consecutive_nonfinite < 0:
            raise ConfigError("resilience.max_consecutive_nonfinite must be >= 0")
        self.output_dir = output_dir
        self.watchdog: Watchdog = cfg.watchdog.instantiate(output_dir=output_dir)
        self.health: HealthCheck = cfg.health.instantiate()
        self.sdc: SdcChecker = cfg.sdc.instantiate()
        self.preemption: Preemption = cfg.preemption.instantiate()
        self._vote: Optional[StopVote] = None
        self.nonfinite = NonFiniteMonitor(cfg.nonfinite, list(param_paths),
                                          max_consecutive=cfg.max_consecutive_nonfinite)
        self.goodput = GoodputRecorder(output_dir, enabled=is_main,
                                       flush_every_s=cfg.goodput_flush_every_s)
        self.faults = FaultPlan.from_spec(cfg.faults, output_dir)
        self._checked_at: Optional[int] = None
        self._dropped: Optional[int] = None  # A step whose update SDC `skip` dropped.
        self._copy: Optional[Callable[[Any], Any]] = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, devices: Sequence[Any]) -> None:
        """Signal handlers, watchdog, health checks; `devices`: the mesh's (all processes')."""
        self.preemption.install()
        self._vote = StopVote(devices)
        self.watchdog.start()
        with self.span("health"):
            self.health.run(devices, self.output_dir)

    def loop_started(self, start_step: int) -> None:
        self.goodput.loop_started(start_step)

    def finish(self) -> None:
        """End of a normal loop: reads the last step's non-finite flags."""
        before = len(self.nonfinite.skipped_steps)
        self.nonfinite.drain()
        for s in self.nonfinite.skipped_steps[before:]:
            self.goodput.mark_skipped(s)

    def close(self) -> None:
        self.watchdog.stop()
        self.goodput.close()
        self.preemption.uninstall()

    @contextlib.contextmanager
    def span(self, bucket: str, *, step: Optional[int] = None,
             wait_for: Any = None) -> Iterator[None]:
        """Times a non-step phase (goodput `bucket`), names it for the watchdog, and fires
        kill faults for phase `bucket` of `step`. `wait_for` is blocked on first so earlier
        steps' device work is not billed to the phase."""
        if wait_for is not None:
            jax.block_until_ready(wait_for)
        with self.watchdog.phase(bucket), self.goodput.span(bucket):
            if step is not None:
                self.faults.enter_phase(bucket, step)
            yield

    # ---- the step ----------------------------------------------------------------------------

    def before_step(self, step: int, local_batch: dict[str, Any]) -> dict[str, Any]:
        return self.faults.before_step(step, local_batch)

    def train_step(self, step_fn: Callable[[Any, Any], tuple[Any, Any]], state: Any,
                   batch: Any, step: int) -> tuple[Any, Any]:
        """`step_fn(state, batch)`, twice and compared on SDC recompute steps."""
        if self.sdc.config.recompute and self.sdc.due(step):
            with self.goodput.span("sdc"):
                out = self.sdc.recompute(step_fn, self._copy_fn(), state, batch, step,
                                         corrupt=self.faults.corrupt_recompute(step))
            if not self.sdc.reports[-1].ok and self.sdc.config.on_mismatch == "skip":
                self._dropped = step
        else:
            out = step_fn(state, batch)
        self.faults.enter_phase("step", step)
        return out

    def after_step(self, step: int, state: Any, summaries: dict[str, Any]) -> tuple[Any, Any]:
        before = len(self.nonfinite.skipped_steps)
        summaries = self.nonfinite.observe(step, summaries)
        self.goodput.step_done(step, skipped=self._dropped == step)
        for s in self.nonfinite.skipped_steps[before:]:
            self.goodput.mark_skipped(s)
        state = self.faults.flip_after_step(step, state)
        if self.sdc.due(step) and self.sdc.config.replicas:
            with self.goodput.span("sdc"):
                state = self.sdc.check_replicas(state, step)
            self._checked_at = step
        self.watchdog.beat(step)
        return state, summaries

    def log(self, step: int, scalars: dict[str, float], writer: Any) -> None:
        """At logging steps: last metrics for the watchdog, goodput into the summaries."""
        self.watchdog.set_metrics(scalars)
        if self.goodput.enabled:
            writer.write(step, self.goodput.scalars(), prefix="goodput")

    def stop_requested(self, step: int) -> bool:
        """At the boundary after `step`: whether every process stops here because a
        preemption signal reached one of them (the same answer on every process)."""
        flag = self.preemption.requested.is_set()
        return self._vote.vote(flag) if self._vote is not None else flag

    def preempted(self, checkpointer: Any, step: int) -> NoReturn:
        """After a preemption signal, with `step` saved (or being saved) into
        `checkpointer`: waits for the commit (the grace deadline runs meanwhile), logs one
        line, raises Preempted (status 46). Without a checkpointer nothing is saved and
        Preempted carries status 47."""
        p = self.preemption
        cause = p.signal_name or "a preemption signal to another process"
        if checkpointer is None:
            line = (f"preemption: {cause} at step {step}; no checkpointer is configured, so "
                    "nothing was saved")
            log.warning(line)
            raise Preempted(line, step, saved=False)
        p.saving = f"while step {step}'s checkpoint was being committed"
        self.finish_saves(checkpointer)
        p.disarm()
        line = (f"preemption: {cause}: saved and committed step {step} "
                f"{p.elapsed_s():.1f} s after the signal; exiting with status "
                f"{EXIT_PREEMPTED} (a rerun resumes from step {step})")
        log.warning(line)
        raise Preempted(line, step)

    def _copy_fn(self) -> Callable[[Any], Any]:
        if self._copy is None:
            self._copy = lambda tree: jax.tree.map(lambda x: x.copy(), tree)
        return self._copy

    # ---- checkpoints --------------------------------------------------------------------------

    def save(self, checkpointer: Any, step: int, state: Any, **kwargs: Any) -> Any:
        """SDC replica check (when enabled and not already done at this step), then the
        save; a failed save raises CheckpointSaveFailed with the cause and what survives.
        Returns the (possibly repaired) state."""
        sdc = self.sdc
        if sdc.enabled and sdc.config.replicas and sdc.config.check_before_save and \
                self._checked_at != step:
            with self.goodput.span("sdc"):
                state = sdc.check_replicas(state, step)
            self._checked_at = step
        with self.span("checkpoint", wait_for=state):
            try:
                with self.faults.disk_full(step):
                    self.faults.stall_save(step)
                    checkpointer.save(step, state, **kwargs)
            except Exception as e:
                raise self._save_failure(checkpointer, step, e) from e
        self.faults.enter_phase("save", step)
        return state

    def finish_saves(self, checkpointer: Any) -> None:
        """Waits for the last commit; a failure raises CheckpointSaveFailed."""
        with self.span("checkpoint"):
            try:
                checkpointer.wait_until_finished()
            except Exception as e:
                raise self._save_failure(checkpointer, None, e) from e
            finally:
                checkpointer.close()

    def _save_failure(self, checkpointer: Any, step: Optional[int],
                      error: BaseException) -> CheckpointSaveFailed:
        root = str(getattr(checkpointer, "directory", "?"))
        cause: BaseException = error
        while cause.__cause__ is not None and not isinstance(cause, OSError):
            cause = cause.__cause__
        disk_full = isinstance(cause, OSError) and cause.errno == errno.ENOSPC
        try:
            steps = checkpointer.steps()
        except Exception:
            steps = []
        if isinstance(error, CheckpointSaveError):  # Raised for the previous save.
            which = "a background save" + (f" (seen when saving step {step})" if step else "")
        else:
            which = f"step {step}" if step is not None else "save"
        survivors = (f"the newest committed checkpoint is step {steps[-1]} and is intact"
                     if steps else "no earlier checkpoint exists")
        reason = f"the disk is full ({cause})" if disk_full else str(cause)
        return CheckpointSaveFailed(
            f"checkpoint {which} into {root} failed: {reason}; "
            f"{describe_free_space(root)}; {survivors}; the unfinished save is never used")


__all__ = ["CheckpointSaveFailed", "Resilience"]
