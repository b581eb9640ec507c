"""Where training metrics go: TensorBoard, a JSON-lines file, and a terminal progress line.

Numbers on the terminal are plain (`11.6k tok/s`, `loss 2.346`, `MFU 31% of cpu bf16 peak
...`), never in exponent form; log records and other lines never land on the progress line.

Only process 0 writes (files and terminal); other processes get a no-op writer.

A run resumed at step S (`resumed_at=S`) first drops every record with step > S from
`metrics.jsonl` (rewritten atomically) and opens TensorBoard with `purge_step=S + 1`, so
steps redone after a restart appear once.

`output_dir` may be an object-store URI (`s3://`, `gs://`): TensorBoard events go through
tensorboardX's own S3/GCS writers (boto3 / google-cloud-storage), and `metrics.jsonl` is
kept in memory and PUT whole (one atomic object) at most every `FLUSH_SECS`, before each
checkpoint (`flush()`) and at close, since objects cannot be appended to.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
import uuid
from typing import Any, Optional, TextIO

import numpy as np

from jaxlearn.checkpoint import storage
from jaxlearn.config import Configurable

# TensorBoard's flush period, and how often an object-store metrics.jsonl is PUT.
FLUSH_SECS = 10
# What tensorboardX's own writer of each object store imports.
_TB_PACKAGES = {"s3": ("boto3", "boto3"), "gs": ("google.cloud.storage", "google-cloud-storage")}


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

    _jsonl: Optional[Any]  # A local file, or an object's `_ObjectText`.

    def __init__(
        self,
        cfg: "SummaryWriter.Config",
        *,
        output_dir: str,
        max_step: int,
        enabled: bool = True,
        stream: Optional[TextIO] = None,
        mfu_peak: Optional[str] = None,
        resumed_at: int = 0,
    ):
        """`mfu_peak`: what MFU is measured against, printed after it on the progress line
        (e.g. `cpu bf16 peak 1.2 TFLOP/s per device (catalogue)`). `resumed_at`: the
        restored step (0: a fresh run); later steps' records are purged."""
        super().__init__(cfg)
        self._enabled = enabled
        self._max_step = max_step
        self._stream = stream or sys.stderr
        self._tb: Any = None
        self._jsonl = None
        self._t0 = time.monotonic()
        self._first_step: Optional[int] = None
        self._mfu_peak = mfu_peak
        self._dangling = False  # A progress line without its newline is on the terminal.
        self._filtered: list[logging.Handler] = []
        if not enabled:
            return
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter as TBWriter

            _check_tensorboard_backend(output_dir)
            # tensorboardX names the file by the second and the host; on an object store a
            # resumed writer within the same second would overwrite the first one's events.
            self._tb = TBWriter(storage.join(output_dir, "tensorboard"),
                                flush_secs=FLUSH_SECS, filename_suffix=f".{uuid.uuid4().hex[:8]}",
                                purge_step=resumed_at + 1 if resumed_at else None)
        if cfg.jsonl:
            path = storage.join(output_dir, "metrics.jsonl")
            if resumed_at:
                purge_jsonl(path, resumed_at)
            self._jsonl = (_ObjectText(path, FLUSH_SECS) if storage.is_remote(path)
                           else open(path, "a"))

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
        """One status line with ETA. On a terminal it is rewritten in place, and ended with
        a newline before any log record or other line is written, so none lands on it."""
        if not (self._enabled and self.config.progress):
            return
        if self._first_step is None:
            self._first_step, self._t0 = step, time.monotonic()
        done = step - self._first_step
        elapsed = time.monotonic() - self._t0
        eta = elapsed / done * (self._max_step - step) if done > 0 else math.nan
        line = progress_line(step, self._max_step, scalars, eta, self._mfu_peak)
        if self._stream.isatty():
            self._stream.write("\r" + line[:200].ljust(120))
            self._start_dangling()
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def info(self, line: str) -> None:
        """A whole line on the terminal (process 0; after ending any progress line)."""
        if not self._enabled:
            return
        self._end_line()
        self._stream.write(line + "\n")
        self._stream.flush()

    def evaluation(self, step: int, metrics: dict[str, float]) -> None:
        """The eval line: `eval at step 100: loss 2.501, perplexity 12.19`."""
        parts = [f"{k} {format_number(metrics[k])}" for k in ("loss", "perplexity")
                 if k in metrics]
        if parts:
            self.info(f"eval at step {step}: " + ", ".join(parts))

    def _start_dangling(self) -> None:
        if self._dangling:
            return
        self._dangling = True
        self._filtered = [h for h in logging.getLogger().handlers if self not in h.filters]
        for handler in self._filtered:
            handler.addFilter(self)

    def _end_line(self) -> None:
        if self._dangling:
            self._dangling = False
            self._stream.write("\n")
            self._stream.flush()
        for handler in self._filtered:
            handler.removeFilter(self)
        self._filtered = []

    def filter(self, record: logging.LogRecord) -> bool:
        """A logging filter on the root handlers while a progress line is open: ends it."""
        self._end_line()
        return True

    def flush(self) -> None:
        """Makes every record written so far durable (an object store's metrics.jsonl is
        PUT now, not at the next period); the trainer calls it before each checkpoint."""
        if isinstance(self._jsonl, _ObjectText):
            self._jsonl.flush(force=True)
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        self._end_line()


def _check_tensorboard_backend(output_dir: str) -> None:
    if not storage.is_remote(output_dir):
        return
    scheme, _, _ = storage.split_uri(output_dir)
    module, package = _TB_PACKAGES[scheme]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # A missing parent package (google.cloud).
        found = False
    if not found:
        raise storage.StorageError(
            f"{output_dir}: TensorBoard on {scheme}:// needs the {package} package, which is "
            f"not installed (pip install {package}, or set summary_writer.tensorboard=False)")


class _ObjectText:
    """An appended text file on an object store: the text lives in memory and the whole
    object is PUT (atomically replacing the last one) at most every `flush_secs`."""

    def __init__(self, path: str, flush_secs: float):
        self._path = storage.resolve(path, check=False)
        try:
            self._text = self._path.read_text()
        except FileNotFoundError:
            self._text = ""
        self._flush_secs = flush_secs
        self._dirty = False
        self._last_put = time.monotonic()

    def write(self, text: str) -> None:
        self._text += text
        self._dirty = True

    def flush(self, *, force: bool = False) -> None:
        if self._dirty and (force or time.monotonic() - self._last_put >= self._flush_secs):
            self._path.write_text(self._text)
            self._dirty, self._last_put = False, time.monotonic()

    def close(self) -> None:
        self.flush(force=True)


def purge_jsonl(path: str, last_step: int) -> int:
    """Drops the records of `path` (a metrics.jsonl) with `step` > `last_step`, rewriting
    it atomically (a torn last line is dropped too); returns how many were dropped."""
    remote = storage.resolve(path, check=False) if storage.is_remote(path) else None
    try:
        if remote is not None:
            lines = remote.read_text().splitlines(keepends=True)
        else:
            with open(path) as f:
                lines = f.readlines()
    except FileNotFoundError:
        return 0
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) \
                and record["step"] > last_step:
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    dropped = len(lines) - len(kept)
    if dropped and remote is not None:
        remote.write_text("".join(kept))  # One PUT: atomic.
    elif dropped:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        logging.getLogger("jaxlearn.summary").info(
            "metrics.jsonl: dropped %d record(s) after step %d (redone on resume)",
            dropped, last_step)
    return dropped


def progress_line(step: int, max_step: int, scalars: dict[str, float], eta_s: float,
                  mfu_peak: Optional[str] = None) -> str:
    """`step 12/100 [##---] loss 2.346  grad_norm 0.5123  11.6k tok/s  MFU 31% of ...  ETA
    1:02` from the scalars present (loss, eval_loss, perplexity, grad_norm, the
    post-training objectives' reward figures, tokens_per_sec, mfu)."""
    frac = step / max(max_step, 1)
    filled = min(20, int(20 * frac))
    parts = [f"step {step}/{max_step} [{'#' * filled}{'-' * (20 - filled)}]"]
    for key, label in (("loss", "loss"), ("eval_loss", "eval loss"),
                       ("eval_perplexity", "eval ppl"), ("grad_norm", "grad_norm"),
                       ("reward_mean", "reward"), ("reward_margin", "reward margin"),
                       ("reward_accuracy", "reward acc")):
        if key in scalars:
            parts.append(f"{label} {format_number(scalars[key])}")
    if "tokens_per_sec" in scalars:
        parts.append(f"{format_number(scalars['tokens_per_sec'])} tok/s")
    if "mfu" in scalars:
        parts.append(f"MFU {format_percent(scalars['mfu'])}"
                     + (f" of {mfu_peak}" if mfu_peak else ""))
    parts.append(f"ETA {_fmt_time(eta_s)}")
    return "  ".join(parts)


_SUFFIXES = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))


def format_number(value: float) -> str:
    """Plain, short numbers for a terminal (never `1.161e+04`): 11610 -> `11.6k`,
    1161.4 -> `1,161`, 2.34567 -> `2.346`, 0.00015 -> `0.00015`, 3.2e9 -> `3.2B`."""
    if not math.isfinite(value):
        return str(value)
    size = abs(value)
    if size >= 1e4:
        for scale, suffix in _SUFFIXES:
            if size >= scale:
                scaled = value / scale
                if abs(scaled) >= 1000 and suffix == "T":
                    return f"{scaled:,.0f}T"
                return f"{scaled:.3g}{suffix}"
    if size >= 1:
        return f"{value:,.4g}" if size < 1e3 else f"{value:,.0f}"
    if value == 0:
        return "0"
    decimals = min(12, 3 - math.floor(math.log10(size)))
    return f"{value:.{decimals}f}".rstrip("0").rstrip(".") or "0"


def format_percent(fraction: float) -> str:
    """0.314 -> `31%`, 0.0314 -> `3.1%`, 0.00031 -> `0.031%`."""
    if not math.isfinite(fraction):
        return str(fraction)
    pct = 100 * fraction
    if abs(pct) >= 10:
        return f"{pct:.0f}%"
    if abs(pct) >= 1:
        return f"{pct:.1f}%"
    return f"{format_number(float(f'{pct:.2g}'))}%"  # Two significant digits.


def format_flops(flops: float) -> str:
    """1.2e12 -> `1.2 TFLOP`, 7.4e6 -> `7.4 MFLOP` (append `/s` or `/token` as needed)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(flops) >= scale:
            return f"{flops / scale:.3g} {prefix}FLOP"
    return f"{flops:.3g} FLOP"


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
