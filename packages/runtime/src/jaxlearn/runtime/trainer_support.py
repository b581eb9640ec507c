"""Pieces of the trainer that need no `Trainer` instance: what one run carries between
its phases and what it returns, pytree key paths, device choice for small meshes,
state-update merging, merged input states for an elastic resume, the MFU peak, the
schedule-length check on a resume, and compiling a step on a background thread."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional

import jax
import numpy as np

log = logging.getLogger("jaxlearn.trainer")


@dataclasses.dataclass
class Run:
    """What one `Trainer.run` carries between its phases."""

    is_main: bool
    guard: Any  # jaxlearn.resilience.manager.Resilience
    data: Any = None
    checkpointer: Any = None
    writer: Any = None
    state: Any = None
    step: int = 0
    summaries: Any = None
    last: dict[str, float] = dataclasses.field(default_factory=dict)
    profiling: bool = False
    keep_input: bool = False  # The state of the last step is being saved: do not donate.
    tokens_per_step: int = 0
    t_last: float = dataclasses.field(default_factory=time.monotonic)
    steps_since: int = 0
    rollout_scalars: dict[str, float] = dataclasses.field(default_factory=dict)
    rollout_s: float = 0.0  # RL: seconds spent making batches since the last log.


@contextlib.contextmanager
def untimed_compile(run: Run) -> Iterator[None]:
    """A "compile" span of the guard, left out of the logged step time (and only it: an RL
    step's rollout, made before its batch's shape was known, stays in)."""
    t0 = time.monotonic()
    with run.guard.span("compile"):
        yield
    run.t_last += time.monotonic() - t0


def step_timing(run: Run, flops: Optional[float],
                peak: Optional[tuple[float, str]]) -> dict[str, float]:
    """Per step since the last log: `step_time` (wall), and over the training part alone
    (the step less an RL rollout, whose time is `rollout_time`) `tokens_per_sec` and `mfu`
    (the compiled step's `flops` per device against `peak` FLOP/s per device)."""
    now, steps = time.monotonic(), max(run.steps_since, 1)
    dt = (now - run.t_last) / steps
    train = max(dt - run.rollout_s / steps, 1e-9)
    out = {"step_time": dt, "tokens_per_sec": run.tokens_per_step / train}
    if run.rollout_s:
        out["rollout_time"] = run.rollout_s / steps
    if flops and peak is not None and peak[0]:
        out["mfu"] = flops / train / peak[0]
    run.t_last, run.steps_since, run.rollout_s = now, 0, 0.0
    return out


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What `Trainer.run` returns: the final train state (`state["step"] == step`), the last
    scalars logged (`metrics`), and the run's `Resilience` (its `nonfinite.skipped_steps`,
    `goodput.steps`, `sdc.reports`: what the guard saw)."""

    state: Any
    step: int
    metrics: dict[str, float]
    resilience: Any  # jaxlearn.resilience.manager.Resilience


def merged_iterator_state(checkpointer: Any, step: int, saved_processes: int) -> Any:
    """The input states of all `saved_processes` of `step`, merged so that this process
    count can resume them (elastic restart with fewer or more hosts)."""
    from jaxlearn.runtime.input_pipeline import merge_states

    states = [checkpointer.read_metadata(step, process_index=i).data_iterator_state
              for i in range(saved_processes)]
    if any(s is None for s in states):
        return None
    log.warning("step %d was saved by %d process(es), resuming on %d: merging their input "
                "states", step, saved_processes, jax.process_count())
    return merge_states(states)


def dict_keys(keypath: Any) -> tuple[str, ...]:
    """The dict-key names along a pytree key path (attribute/index entries dropped)."""
    return tuple(str(k.key) for k in keypath if isinstance(k, jax.tree_util.DictKey))


def devices_for(mesh_shape: Any) -> Optional[list]:
    """A fully specified flat shape smaller than the device count uses the first devices
    (e.g. a single-device reference run on a multi-device host)."""
    if isinstance(mesh_shape, tuple) and all(d > 0 for d in mesh_shape):
        n = int(np.prod(mesh_shape))
        if n < jax.device_count() and jax.process_count() == 1:
            return jax.devices()[:n]
    return None


def merge_updates(params: Any, updates: Any) -> Any:
    """Overwrites params with non-empty state updates of the same path (e.g. batch stats)."""
    if not isinstance(updates, dict) or not updates:
        return params
    out = dict(params)
    for k, v in updates.items():
        if isinstance(v, dict):
            if v and k in out and isinstance(out[k], dict):
                out[k] = merge_updates(out[k], v)
        elif k in out:
            out[k] = v
    return out


def peak_flops(peak: Optional[float], devices: list) -> Optional[tuple[float, str]]:
    """(peak FLOP/s per device, what it is) for MFU: `peak` (the config's), else the
    hardware catalogue's bf16 peak for `devices`; None when neither is known."""
    from jaxlearn.runtime.summary import format_flops

    if peak is not None:
        return peak, f"peak_flops_per_device {format_flops(peak)}/s (config)"
    try:
        from jaxlearn.mesh import detect_hardware

        spec = detect_hardware(devices)
    except Exception:
        return None
    return spec.peak_bf16_flops, (f"{spec.kind} bf16 peak "
                                  f"{format_flops(spec.peak_bf16_flops)}/s per device "
                                  "(catalogue)")


def _flat_value(config_text: str, key: str) -> Optional[str]:
    for line in config_text.splitlines():
        name, sep, value = line.partition(": ")
        if sep and name == key:
            return value.strip()
    return None


def schedule_steps(config_text: str) -> Optional[int]:
    """The learning-rate schedule length of the run whose flat config is `config_text`:
    `learner.total_steps`, else `max_step` (None when the text names neither)."""
    for key in ("learner.total_steps", "max_step"):
        value = _flat_value(config_text, key)
        if value is not None and value.isdigit() and int(value) > 0:
            return int(value)
    return None


def warn_if_schedule_changed(checkpointer: Any, step: int, max_step: int,
                             total_steps: Optional[int]) -> Optional[str]:
    """On a resume from `step` (> 0): one warning (returned) when the checkpoint's run
    had another schedule length than this one (`total_steps`, else `max_step`). The
    schedule follows the new length from `step` on; `learner.total_steps` keeps the old."""
    if not step or checkpointer is None:
        return None
    try:
        saved = checkpointer.read_metadata(step, process_index=jax.process_index()).config_text
    except Exception:
        return None
    old = schedule_steps(saved) if saved else None
    new = total_steps or max_step
    if old is None or old == new:
        return None
    line = (f"resumed at step {step} with a learning-rate schedule of {new} steps; the "
            f"checkpoint's run scheduled {old}, so the learning rate from step {step} on "
            f"follows the {new}-step schedule (set learner.total_steps={old} to keep the "
            "original one)")
    log.warning(line)
    return line


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a tree of arrays, e.g. a global batch."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


class BackgroundCompile:
    """`compile(abstract)` run on a daemon thread: `start` begins it, `get` waits for (or
    starts and waits for) the result and re-raises the thread's error, `join` waits."""

    def __init__(self, compile: Callable[[Any], Any]):
        self._compile = compile
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def start(self, abstract: Any) -> None:
        def work() -> None:
            try:
                self._result = self._compile(abstract)
            except BaseException as e:  # Raised on the caller's thread by get().
                self._error = e

        self._thread = threading.Thread(target=work, name="compile-keep-step", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def get(self, abstract: Any) -> Any:
        if self._result is None and self._thread is None and self._error is None:
            self.start(abstract)
        self.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._result


def batch_target_weight(local: dict[str, Any]) -> Optional[float]:
    """The total `target_weights` of the global batch whose rows on this process are
    `local` (summed over every process: a small all-gather when there are several); None
    when the batch has no `target_weights`."""
    weights = local.get("target_weights")
    if weights is None:
        return None
    total = np.float32(np.sum(weights, dtype=np.float64))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        total = np.sum(multihost_utils.process_allgather(total), dtype=np.float64)
    return float(total)
