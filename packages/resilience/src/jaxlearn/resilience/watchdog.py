"""A watchdog thread: notices a run that stopped making progress and says where it hangs.

    wd = Watchdog.default_config().set(timeout_s=600, exit_on_hang=True).instantiate(
        output_dir=out)
    wd.start()
    for step in ...:
        ...
        wd.beat(step)                      # cheap: two attribute stores
    wd.stop()

No `beat()` within `timeout_s` (or within `first_step_timeout_s` before the first one, which
covers restore + compile) -> one ERROR log record with the stall, the phase, the last
metrics and the Python stack of every thread (also written to
`<output_dir>/watchdog/hang_<step>_<pid>.txt`), then, with `exit_on_hang`, the process
exits at once with `exit_code` (42) so a supervisor restarts it from the newest checkpoint.
A commit in flight is safe to abandon: an unfinished checkpoint never becomes visible.

The thread needs the GIL: a hang inside C code that holds it (rare; XLA releases it while
it waits) is invisible to it. The supervisor's own wall-clock limit covers that case.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Optional

from jaxlearn.config import ConfigError, Configurable
from jaxlearn.resilience.failures import EXIT_HANG

log = logging.getLogger("jaxlearn.watchdog")


def format_all_stacks() -> str:
    """The current Python stack of every thread, innermost call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sorted(sys._current_frames().items()):
        name = names.get(ident, "?")
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"--- thread {name} (id {ident}) ---\n{stack}")
    return "\n".join(parts)


class Watchdog(Configurable):
    """Fires when no `beat()` arrives within the timeout."""

    class Config(Configurable.Config):
        # Seconds without step progress before firing; None: the watchdog is off.
        timeout_s: Optional[float] = None
        # Limit before the first beat (restore, first compile); None: 10 x timeout_s.
        first_step_timeout_s: Optional[float] = None
        # Exit the process with `exit_code` after dumping (else log and keep waiting).
        exit_on_hang: bool = False
        exit_code: int = EXIT_HANG
        # How often the thread looks; None: min(timeout / 4, 5 s).
        poll_interval_s: Optional[float] = None

    def __init__(
        self,
        cfg: "Watchdog.Config",
        *,
        output_dir: Optional[str] = None,
        exit_fn: Callable[[int], Any] = os._exit,
    ):
        super().__init__(cfg)
        cfg = self.config
        for name in ("timeout_s", "first_step_timeout_s", "poll_interval_s"):
            value = getattr(cfg, name)
            if value is not None and value <= 0:
                raise ConfigError(f"watchdog.{name} must be > 0 or None, got {value}")
        self._output_dir = output_dir
        self._exit_fn = exit_fn
        self._last_beat = time.monotonic()
        self._step: Optional[int] = None
        self._beats = 0
        self._phase = "startup"
        self._metrics: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.fired: list[dict[str, Any]] = []  # One record per stall seen (for tests/reports).

    @property
    def enabled(self) -> bool:
        return self.config.timeout_s is not None

    # ---- called by the training loop -----------------------------------------------------

    def start(self) -> "Watchdog":
        if self.enabled and self._thread is None:
            self._last_beat = time.monotonic()
            self._thread = threading.Thread(target=self._loop, name="jaxlearn-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def beat(self, step: Optional[int] = None) -> None:
        """Progress: a step finished (or a long non-step phase did)."""
        if step is not None:
            self._step = step
        self._beats += 1
        self._last_beat = time.monotonic()

    def set_metrics(self, metrics: dict[str, float]) -> None:
        self._metrics = dict(metrics)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Names what the run is doing (shown in the dump); progress on exit."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous
            self.beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- the thread -------------------------------------------------------------------------

    def _limit(self) -> float:
        cfg = self.config
        assert cfg.timeout_s is not None
        if self._step is None:  # Nothing trained yet in this process.
            return cfg.first_step_timeout_s or 10 * cfg.timeout_s
        return cfg.timeout_s

    def _loop(self) -> None:
        cfg = self.config
        assert cfg.timeout_s is not None
        poll = cfg.poll_interval_s or min(cfg.timeout_s / 4, 5.0)
        fired_at_beat = -1
        while not self._stop.wait(poll):
            stalled = time.monotonic() - self._last_beat
            if stalled < self._limit() or fired_at_beat == self._beats:
                continue
            fired_at_beat = self._beats  # Once per stall; re-armed by the next beat.
            self._fire(stalled)

    def _fire(self, stalled: float) -> None:
        cfg = self.config
        stacks = format_all_stacks()
        record = {"step": self._step, "phase": self._phase, "stalled_s": round(stalled, 3),
                  "limit_s": self._limit(), "metrics": dict(self._metrics)}
        self.fired.append(record)
        after = "before the first step" if self._step is None else f"after step {self._step}"
        header = (f"watchdog: no progress for {stalled:.1f}s (limit {self._limit():g}s) in "
                  f"phase {self._phase!r} {after}; last metrics {self._metrics}")
        path = self._write_dump(header, stacks)
        log.error("%s\n%s%s", header, stacks,
                  f"\n(stacks also written to {path})" if path else "")
        if cfg.exit_on_hang:
            log.error("watchdog: exiting with status %d so that the run is restarted",
                      cfg.exit_code)
            for handler in logging.getLogger().handlers + log.handlers:
                with contextlib.suppress(Exception):
                    handler.flush()
            with contextlib.suppress(Exception):
                sys.stderr.flush()
                sys.stdout.flush()
            self._exit_fn(cfg.exit_code)

    def _write_dump(self, header: str, stacks: str) -> Optional[str]:
        if not self._output_dir:
            return None
        try:
            directory = os.path.join(self._output_dir, "watchdog")
            os.makedirs(directory, exist_ok=True)
            step = "init" if self._step is None else str(self._step)
            path = os.path.join(directory, f"hang_step{step}_pid{os.getpid()}.txt")
            with open(path, "w") as f:
                f.write(header + "\n\n" + stacks)
            return path
        except OSError as e:
            log.warning("watchdog: could not write the stack dump: %s", e)
            return None


__all__ = ["Watchdog", "format_all_stacks"]
