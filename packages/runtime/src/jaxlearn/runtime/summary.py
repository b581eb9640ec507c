"""Where training metrics go: TensorBoard, a JSON-lines file, and a terminal progress line.

Only process 0 writes (files and terminal); other processes get a no-op writer.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Optional, TextIO

import numpy as np

from jaxlearn.config import Configurable


def _scalar(value: Any) -> Optional[float]:
    try:
        arr = np.asarray(value)
    except Exception:
        return None
    if arr.size != 1 or not np.issubdtype(arr.dtype, np.number):
        return None
    return float(arr.reshape(()))


class SummaryWriter(Configurable):
    """Writes scalars to `<dir>/tensorboard`, `<dir>/metrics.jsonl` and a progress line."""

    class Config(Configurable.Config):
        tensorboard: bool = True
        jsonl: bool = True
        progress: bool = True

    def __init__(
        self,
        cfg: "SummaryWriter.Config",
        *,
        output_dir: str,
        max_step: int,
        enabled: bool = True,
        stream: Optional[TextIO] = None,
    ):
        super().__init__(cfg)
        self._enabled = enabled
        self._max_step = max_step
        self._stream = stream or sys.stderr
        self._tb: Any = None
        self._jsonl: Optional[TextIO] = None
        self._t0 = time.monotonic()
        self._first_step: Optional[int] = None
        if not enabled:
            return
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter as TBWriter

            self._tb = TBWriter(os.path.join(output_dir, "tensorboard"), flush_secs=10)
        if cfg.jsonl:
            self._jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a")

    def write(self, step: int, metrics: dict[str, Any], prefix: str = "train") -> dict[str, float]:
        """Writes every scalar in `metrics` at `step`; returns the scalars written."""
        scalars = {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
        if not self._enabled:
            return scalars
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(f"{prefix}/{k}", v, step)
        if self._jsonl is not None:
            record = {"step": step, "split": prefix, "time": round(time.time(), 3), **scalars}
            self._jsonl.write(json.dumps(record, allow_nan=True) + "\n")
            self._jsonl.flush()
        return scalars

    def progress(self, step: int, scalars: dict[str, float]) -> None:
        """A one-line status with ETA (rewritten in place on a terminal)."""
        if not (self._enabled and self.config.progress):
            return
        if self._first_step is None:
            self._first_step, self._t0 = step, time.monotonic()
        done = step - self._first_step
        elapsed = time.monotonic() - self._t0
        eta = elapsed / done * (self._max_step - step) if done > 0 else math.nan
        frac = step / max(self._max_step, 1)
        bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
        parts = [f"step {step}/{self._max_step} [{bar}]"]
        for key in ("loss", "eval_loss", "grad_norm", "tokens_per_sec", "mfu"):
            if key in scalars:
                parts.append(f"{key} {scalars[key]:.4g}")
        parts.append(f"ETA {_fmt_time(eta)}")
        line = "  ".join(parts)
        if self._stream.isatty():
            self._stream.write("\r" + line[:200].ljust(120))
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._enabled and self.config.progress and self._stream.isatty():
            self._stream.write("\n")


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
