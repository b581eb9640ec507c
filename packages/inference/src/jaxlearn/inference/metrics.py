"""Thread-safe counters, gauges and histograms rendered in the Prometheus text format."""

from __future__ import annotations

import bisect
import math
import threading
from typing import Any, Callable, Optional

Labels = tuple[tuple[str, str], ...]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in labels
    )
    return "{" + inner + "}"


class Metrics:
    """A registry: `inc(name, value, **labels)`, `observe(name, seconds)`, `gauge(name, fn)`.

    Every name gets the prefix `jaxlearn_`; help texts are declared with `describe`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[Labels, float]] = {}
        self._hist: dict[str, tuple[tuple[float, ...], list[int], list[float]]] = {}
        self._gauges: dict[str, Callable[[], float]] = {}
        self._help: dict[str, str] = {}

    def describe(self, name: str, text: str) -> None:
        self._help[name] = text

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters.setdefault(name, {})
            series[key] = series.get(key, 0.0) + value

    def observe(
        self, name: str, value: float, buckets: tuple[float, ...] = LATENCY_BUCKETS
    ) -> None:
        with self._lock:
            bounds, counts, total = self._hist.setdefault(
                name, (buckets, [0] * (len(buckets) + 1), [0.0])
            )
            counts[bisect.bisect_left(bounds, value)] += 1
            total[0] += value

    def gauge(self, name: str, fn: Callable[[], float]) -> None:
        self._gauges[name] = fn

    def counter_value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._counters.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> str:
        """The exposition text (version 0.0.4)."""
        lines: list[str] = []

        def head(name: str, kind: str) -> str:
            full = f"jaxlearn_{name}"
            if name in self._help:
                lines.append(f"# HELP {full} {self._help[name]}")
            lines.append(f"# TYPE {full} {kind}")
            return full

        with self._lock:
            counters = {k: dict(v) for k, v in self._counters.items()}
            hist = {k: (b, list(c), t[0]) for k, (b, c, t) in self._hist.items()}
        for name in sorted(counters):
            full = head(name, "counter")
            for labels, value in sorted(counters[name].items()):
                lines.append(f"{full}{_labels(labels)} {_num(value)}")
        for name in sorted(self._gauges):
            full = head(name, "gauge")
            lines.append(f"{full} {_num(self._gauges[name]())}")
        for name in sorted(hist):
            bounds, counts, total = hist[name]
            full = head(name, "histogram")
            acc = 0
            for bound, count in zip(bounds, counts):
                acc += count
                lines.append(f'{full}_bucket{{le="{_num(bound)}"}} {acc}')
            acc += counts[-1]
            lines.append(f'{full}_bucket{{le="+Inf"}} {acc}')
            lines.append(f"{full}_sum {_num(total)}")
            lines.append(f"{full}_count {acc}")
        return "\n".join(lines) + "\n"


def _num(x: Optional[float]) -> str:
    if x is None or math.isnan(x):
        return "NaN"
    if float(x).is_integer():
        return str(int(x))
    return repr(float(x))


def scheduler_metrics(m: Metrics, sched: Any) -> None:
    """Declares the counters of a `Scheduler` and registers its gauges (queue, slots, KV
    pages) in `m`."""
    m.describe("requests_total", "Requests finished, by finish reason.")
    m.describe("prompt_tokens_total", "Prompt tokens prefilled (recomputation included).")
    m.describe("prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache.")
    m.describe("generation_tokens_total", "Tokens generated.")
    m.describe("preemptions_total", "Running requests sent back to the queue (pool full).")
    m.describe("time_to_first_token_seconds", "Arrival to first token.")
    m.describe("request_latency_seconds", "Arrival to last token.")
    m.describe("step_seconds", "Duration of one scheduler step.")
    m.describe("step_part_seconds_total",
               "Scheduler step time by part: prefill / decode calls (device work and the "
               "copy of their results), a draft model's proposals (draft) and host "
               "(scheduling, detokenization, sinks).")
    m.describe("decode_calls_total",
               "Decode calls, by fused steps per call (\"verify\": speculative).")
    m.describe("speculative_draft_tokens_total", "Draft tokens verified.")
    m.describe("speculative_accepted_tokens_total", "Draft tokens accepted.")
    m.describe("prefill_calls_total", "Prefill calls.")
    m.describe("prefill_padded_tokens_total",
               "Token positions computed by prefill calls, padding included (rows x bucket).")
    m.describe("programs_compiled", "Prefill / decode programs compiled (warm-up included).")
    m.describe("programs_compiled_late", "Programs compiled after warm-up, while serving.")
    m.gauge("requests_running", lambda: float(sched.num_running))
    m.gauge("requests_waiting", lambda: float(sched.num_waiting))
    m.gauge("slots_total", lambda: float(sched.max_batch))
    m.gauge("kv_cache_bytes", lambda: float(sched.runner.cache_bytes()))
    m.gauge("programs_compiled", lambda: float(len(sched.runner.programs)))
    m.gauge("programs_compiled_late", lambda: float(sched.runner.compiled_late))
    m.gauge("kv_pages_total", lambda: float(sched.pages.num_pages - 1))
    m.gauge("kv_pages_used", lambda: float(sched.pages.num_used))
    m.gauge("kv_pages_cached", lambda: float(sched.pages.num_cached))
    m.gauge("kv_page_evictions", lambda: float(sched.pages.evictions))
