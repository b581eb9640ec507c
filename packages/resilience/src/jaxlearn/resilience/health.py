"""Health checks before training starts: devices, a collective, the output directory.

    report = HealthCheck.default_config().instantiate().run(mesh_devices, output_dir)

1. devices: every local device runs a tiny computation and returns the right answer
   within `device_timeout_s` (a dead or wedged device is named);
2. collective: a psum over every device of the mesh, across all processes, completes
   within `collective_timeout_s` and gives the right sum (the network check);
3. output dir: a probe file can be written, fsynced and removed, and the file system has
   at least `min_free_bytes` free.
A failure raises HealthCheckError (exit status 45) naming the check, the device or the
path. The timeouts run the work on a helper thread; a computation that never returns
leaves that (daemon) thread behind, and the process is expected to exit.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import shutil
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.config import ConfigError, Configurable
from jaxlearn.resilience.failures import HealthCheckError

log = logging.getLogger("jaxlearn.health")
T = TypeVar("T")


@dataclasses.dataclass
class HealthReport:
    devices_s: float = 0.0
    collective_s: float = 0.0
    free_bytes: int = 0
    num_devices: int = 0


def _with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # Re-raised on the calling thread.
            error.append(e)

    thread = threading.Thread(target=target, name=f"health-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise HealthCheckError(f"health check: {what} did not finish within {timeout_s:g}s")
    if error:
        raise HealthCheckError(f"health check: {what} failed: {error[0]}") from error[0]
    return result[0]


_PROBE = np.arange(4, dtype=np.float32)
_PROBE_ANSWER = _PROBE * 2.0 - 1.0


def probe_devices(devices: Sequence[Any]) -> list[Any]:
    """Dispatches one tiny computation (one compilation) with a shard on each device;
    returns the output shards, one per device."""
    mesh = Mesh(np.asarray(devices).reshape(len(devices)), ("local",))
    x = jax.device_put(np.tile(_PROBE, len(devices)), NamedSharding(mesh, PartitionSpec("local")))
    y = jax.jit(lambda v: v * 2.0 - 1.0)(x)
    return sorted(y.addressable_shards, key=lambda s: devices.index(s.device))


def fetch_shard(shard: Any) -> np.ndarray:
    """One device's result on the host (blocks until that device is done)."""
    return np.asarray(shard.data)


def free_bytes(path: str) -> int:
    return int(shutil.disk_usage(path).free)


def describe_free_space(path: str) -> str:
    try:
        return f"{free_bytes(path) / 2**20:.1f} MiB free on the file system of {path}"
    except OSError:
        return f"free space of {path} unknown"


class HealthCheck(Configurable):
    """Pre-training checks; see the module doc."""

    class Config(Configurable.Config):
        enabled: bool = True
        device_timeout_s: float = 120.0
        collective_timeout_s: float = 120.0
        # Minimum free space on the output directory's file system.
        min_free_bytes: int = 256 * 2**20

    def __init__(self, cfg: "HealthCheck.Config"):
        super().__init__(cfg)
        cfg = self.config
        for name in ("device_timeout_s", "collective_timeout_s"):
            if getattr(cfg, name) <= 0:
                raise ConfigError(f"health.{name} must be > 0, got {getattr(cfg, name)}")
        if cfg.min_free_bytes < 0:
            raise ConfigError(f"health.min_free_bytes must be >= 0, got {cfg.min_free_bytes}")

    def run(self, devices: Sequence[Any], output_dir: str) -> HealthReport:
        report = HealthReport(num_devices=len(devices))
        if not self.config.enabled:
            return report
        t0 = time.monotonic()
        self.check_devices(devices)
        t1 = time.monotonic()
        self.check_collective(devices)
        t2 = time.monotonic()
        report.free_bytes = self.check_output_dir(output_dir)
        report.devices_s, report.collective_s = t1 - t0, t2 - t1
        log.info("health checks passed: %d device(s) in %.2fs, collective in %.2fs, %.1f GiB "
                 "free in %s", len(devices), report.devices_s, report.collective_s,
                 report.free_bytes / 2**30, output_dir)
        return report

    def check_devices(self, devices: Sequence[Any]) -> None:
        local = [d for d in devices if d.process_index == jax.process_index()]
        shards = _with_timeout(lambda: probe_devices(local), self.config.device_timeout_s,
                               f"starting a computation on {len(local)} device(s)")
        for shard in shards:
            value = _with_timeout(functools.partial(fetch_shard, shard),
                                  self.config.device_timeout_s,
                                  f"device {shard.device} (a tiny computation)")
            if not np.array_equal(value, _PROBE_ANSWER):
                raise HealthCheckError(f"health check: device {shard.device} computed "
                                       f"{value.tolist()}, expected {_PROBE_ANSWER.tolist()}")

    def check_collective(self, devices: Sequence[Any]) -> None:
        n = len(devices)
        if n < 2:
            return
        mesh = Mesh(np.asarray(devices).reshape(n), ("all",))
        sharding = NamedSharding(mesh, PartitionSpec("all"))

        def run() -> float:
            x = jax.make_array_from_callback(
                (n,), sharding, lambda idx: np.ones((1,), np.float32))
            fn = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "all"), mesh=mesh,
                                       in_specs=PartitionSpec("all"),
                                       out_specs=PartitionSpec()))
            out = fn(x)
            return float(np.asarray(out.addressable_data(0)).reshape(-1)[0])

        value = _with_timeout(run, self.config.collective_timeout_s,
                              f"a psum over {n} devices ({jax.process_count()} process(es))")
        if value != float(n):
            raise HealthCheckError(f"health check: a psum of ones over {n} devices gave {value}")

    def check_output_dir(self, output_dir: str) -> int:
        probe = os.path.join(output_dir, f".health_probe_{os.getpid()}")
        try:
            os.makedirs(output_dir, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"jaxlearn health probe\n")
                f.flush()
                os.fsync(f.fileno())
            os.remove(probe)
        except OSError as e:
            reason = "the disk is full" if e.errno == errno.ENOSPC else e.strerror
            raise HealthCheckError(f"health check: cannot write to the output directory "
                                   f"{output_dir}: {reason}") from e
        free = free_bytes(output_dir)
        need = self.config.min_free_bytes
        if free < need:
            raise HealthCheckError(
                f"health check: the output directory {output_dir} has {free / 2**20:.1f} MiB "
                f"free, less than health.min_free_bytes={need} ({need / 2**20:.1f} MiB)")
        return free


__all__ = ["HealthCheck", "HealthReport", "describe_free_space", "fetch_shard", "free_bytes",
           "probe_devices"]
