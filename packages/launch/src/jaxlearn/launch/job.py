"""What a cluster job runs, and the settings every cluster launcher shares.

    target = JobTarget(name=job_name("jaxlearn-tiny-llama"), experiment="tiny-llama",
                       selector="gpu-h100-8x4", kind="gpu-h100", platform="gpu",
                       devices=32, devices_per_host=8, argv=("train", ...))
    slurm.slurm_script(slurm.SlurmOptions(...), target)      # sbatch script text
    k8s.jobset_manifest(k8s.K8sOptions(image=...), target)   # JobSet as a dict

The hardware facts (`platform`, `devices`, `devices_per_host`) come from the caller (the CLI
reads them from `jaxlearn.mesh`'s catalogue): this package only turns them into scheduler
requests. Errors are `JobSpecError`, one line naming the option (by its `jaxlearn launch`
flag) and what is wrong.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
from typing import Mapping, Optional

DEFAULT_ENTRYPOINT = "python3 -m jaxlearn.cli"


class JobSpecError(ValueError):
    """Options and a target that cannot make a job (says which option and why)."""


def job_name(name: str) -> str:
    """`name` lower-cased with runs of other characters turned into '-'; 1-40 characters
    so that pod host names `<name>-workers-J-P` stay within 63."""
    clean = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not clean or len(clean) > 40:
        raise JobSpecError(f"--name {name!r}: need 1-40 characters of a-z, 0-9 and '-' (pod "
                           "host names <name>-workers-J-P must stay within 63)")
    return clean


def same_jaxlearn(argv0: str, environ: Mapping[str, str], executable: str,
                  checkout: Optional[str] = None) -> str:
    """How a node sharing this machine's filesystem runs the `jaxlearn` this process runs:
    shell words with absolute paths, fixed at generation time. First that applies:

    1. `$JAXLEARN_ENTRYPOINT` (the checkout's `tools/jaxlearn` sets it to itself);
    2. an installed console script: `argv0` named `jaxlearn` (looked up on PATH when bare);
    3. the checkout's `tools/jaxlearn` (`checkout`: the source tree this code runs from);
    4. this interpreter: `<executable> -m jaxlearn.cli`.
    """
    given = environ.get("JAXLEARN_ENTRYPOINT", "").strip()
    if given:
        return given
    if os.path.basename(argv0) == "jaxlearn":
        found = argv0 if os.sep in argv0 else shutil.which(argv0, path=environ.get("PATH"))
        if found and os.path.isfile(found) and os.access(found, os.X_OK):
            return shlex.quote(os.path.abspath(found))
    if checkout is not None:
        script = os.path.join(checkout, "tools", "jaxlearn")
        if os.path.isfile(script) and os.access(script, os.X_OK):
            return shlex.quote(os.path.abspath(script))
    return shlex.join([os.path.abspath(executable), "-m", "jaxlearn.cli"])


@dataclasses.dataclass(frozen=True)
class JobTarget:
    """What a cluster job runs: a `jaxlearn train` command line and its hardware.

    Attributes:
        name: the job name (`job_name`-clean).
        experiment: the experiment the command trains (for comments and labels).
        selector: its mesh selector, e.g. "gpu-h100-8x4".
        kind: the hardware kind, e.g. "gpu-h100", "tpu-v5p", "cpu".
        platform: "gpu", "tpu", "neuron" or "cpu".
        devices: accelerators (or CPU devices) of the whole job.
        devices_per_host: accelerators per host (None: unknown, one host holds all).
        argv: the jaxlearn command line, e.g. ("train", "--experiment", ...).
    """

    name: str
    experiment: str
    selector: str
    kind: str
    platform: str
    devices: int
    devices_per_host: Optional[int]
    argv: tuple[str, ...]

    def command(self, entrypoint: str, cpu_devices: Optional[int]) -> list[str]:
        """The process's argv: `entrypoint` (shell words) + `argv`, plus
        `--num_cpu_devices N` for CPU targets unless the command sets it."""
        argv = list(self.argv)
        if cpu_devices is not None and "--num_cpu_devices" not in argv:
            argv += ["--num_cpu_devices", str(cpu_devices)]
        return [*shlex.split(entrypoint), *argv]


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobOptions:
    """Settings of every cluster job.

    Attributes:
        env: (KEY, VALUE) pairs set for every process.
        coordinator_port: process 0's port (None: the scheduler's default).
        initialization_timeout: seconds for all processes to join (None: 300).
        heartbeat_timeout: seconds of silence after which a process is dead (None: 100).
        entrypoint: how the cluster runs jaxlearn.
    """

    env: tuple[tuple[str, str], ...] = ()
    coordinator_port: Optional[int] = None
    initialization_timeout: Optional[float] = None
    heartbeat_timeout: Optional[float] = None
    entrypoint: str = DEFAULT_ENTRYPOINT

    def timeout_env(self) -> list[tuple[str, str]]:
        """The timeouts as the variables `distributed.initialize` reads."""
        out = []
        if self.initialization_timeout is not None:
            out.append(("JAXLEARN_INITIALIZATION_TIMEOUT", f"{self.initialization_timeout:g}"))
        if self.heartbeat_timeout is not None:
            out.append(("JAXLEARN_HEARTBEAT_TIMEOUT", f"{self.heartbeat_timeout:g}"))
        return out


__all__ = ["DEFAULT_ENTRYPOINT", "JobOptions", "JobSpecError", "JobTarget", "job_name",
           "same_jaxlearn"]
