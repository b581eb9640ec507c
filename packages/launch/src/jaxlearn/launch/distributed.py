"""Multi-process start: this process's place in the group, a bounded and explained join,
then `jax.distributed.initialize`.

    spec = initialize()                      # detect + roll call + jax.distributed.initialize
    spec = initialize("10.0.0.1:8476", num_processes=4, process_id=2)   # explicit

Where the process facts come from: `jaxlearn.launch.cluster` (`detect_cluster`, a pure
function of the environment: JAXLEARN_*, Open MPI, Slurm, Kubernetes/JobSet variables).

Why not `jax.distributed.initialize()` with no arguments: its Slurm detection counts
SLURM_NTASKS (wrong inside a smaller `srun` step), parses only the first hostlist range, and
any detected scheduler pins `local_device_ids=[local rank]` even when one process drives all
the GPUs of its node. Here detection is a pure, tested function and JAX's own detection is
switched off (`cluster_detection_method="deactivate"`) so nothing else is guessed.

Failures. Before JAX starts, `jaxlearn.launch.rollcall.roll_call` checks on the coordinator
port that all processes are up, and raises `DistributedInitError` naming the missing ones
instead of JAX's anonymous abort. Every process then prints
`jaxlearn: process I of N joined (...)` on stderr, which `launch_local` watches for.
Failures after the join (a peer dies mid-step) still abort in JAX after
`heartbeat_timeout`; a supervisor outside the processes (`launch_local`, `srun
--kill-on-bad-exit`, a JobSet failure policy) stops the others promptly instead.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any, Mapping, Optional, Sequence

from jaxlearn.launch.cluster import (
    ClusterConfigError,
    ClusterSpec,
    DistributedError,
    detect_cluster,
    resolve_cluster,
)
from jaxlearn.launch.rollcall import DistributedInitError, roll_call

DEFAULT_INITIALIZATION_TIMEOUT = 300
DEFAULT_HEARTBEAT_TIMEOUT = 100
JOINED_RE = re.compile(r"jaxlearn: process (\d+) of (\d+) joined")

_started: Optional[ClusterSpec] = None


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ClusterConfigError(f"{name}={value!r} is not a number") from None


def initialize(
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    local_device_ids: Optional[Sequence[int]] = None,
    *,
    initialization_timeout: Optional[float] = None,
    heartbeat_timeout: Optional[float] = None,
    shutdown_timeout: Optional[float] = None,
    num_cpu_devices: Optional[int] = None,
    environ: Optional[Mapping[str, str]] = None,
    roll_call_first: bool = True,
) -> ClusterSpec:
    """Starts this process's part of a multi-process JAX program; call before any JAX
    computation. Explicit arguments override detection (`resolve_cluster`); with one
    process it only applies `num_cpu_devices`. Timeouts default to
    JAXLEARN_INITIALIZATION_TIMEOUT / JAXLEARN_HEARTBEAT_TIMEOUT, else 300 s / 100 s.

    Multi-process: CPU collectives use gloo; a roll call (module doc) bounds the join and
    names missing processes (DistributedInitError); then `jax.distributed.initialize` with
    JAX's own cluster detection off. Idempotent for the same group."""
    global _started
    import jax

    spec = resolve_cluster(coordinator_address, num_processes, process_id, local_device_ids,
                           environ)
    if _started is not None:
        if (spec.num_processes, spec.process_id) != (_started.num_processes,
                                                     _started.process_id):
            raise DistributedError(f"already started as {_started.describe()}; "
                                   f"cannot restart as {spec.describe()}")
        return _started
    if num_cpu_devices is not None:
        _set_cpu_devices(num_cpu_devices)
    if not spec.is_multi_process:
        _started = spec
        return spec
    init_timeout = (initialization_timeout if initialization_timeout is not None
                    else _env_float("JAXLEARN_INITIALIZATION_TIMEOUT",
                                    DEFAULT_INITIALIZATION_TIMEOUT))
    beat_timeout = (heartbeat_timeout if heartbeat_timeout is not None
                    else _env_float("JAXLEARN_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT))
    if _backends_initialized():
        raise DistributedError(
            f"{spec.describe()}: JAX is already initialized in this process; multi-process "
            "start must come before any JAX computation")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    t0 = time.monotonic()
    if roll_call_first:
        roll_call(spec, init_timeout)
    kwargs: dict[str, Any] = {}
    if shutdown_timeout is not None:
        kwargs["shutdown_timeout_seconds"] = max(1, int(shutdown_timeout))
    jax.distributed.initialize(
        coordinator_address=spec.coordinator_address,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
        cluster_detection_method="deactivate",
        initialization_timeout=max(1, int(init_timeout)),
        heartbeat_timeout_seconds=max(1, int(beat_timeout)),
        **kwargs,
    )
    _started = spec
    print(f"jaxlearn: process {spec.process_id} of {spec.num_processes} joined "
          f"({spec.source}, coordinator {spec.coordinator_address}, "
          f"{time.monotonic() - t0:.1f}s)", file=sys.stderr, flush=True)
    return spec


def _set_cpu_devices(n: int) -> None:
    import jax

    if n < 1:
        raise ClusterConfigError(f"num_cpu_devices must be >= 1, got {n}")
    if _backends_initialized():
        if jax.local_device_count() != n and jax.default_backend() == "cpu":
            raise DistributedError(f"cannot set {n} CPU devices: JAX is already running with "
                                   f"{jax.local_device_count()}")
        return
    jax.config.update("jax_num_cpu_devices", n)


def _backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # pragma: no cover - older/newer JAX
        return False


__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_INITIALIZATION_TIMEOUT",
    "JOINED_RE",
    "ClusterConfigError",
    "ClusterSpec",
    "DistributedError",
    "DistributedInitError",
    "detect_cluster",
    "initialize",
    "resolve_cluster",
    "roll_call",
]
