"""Who am I in the process group, and who is the coordinator: pure functions of the
environment, no sockets and no JAX.

    spec = detect_cluster(os.environ)        # ClusterSpec, or None outside a cluster
    spec = resolve_cluster("10.0.0.1:8476", num_processes=4, process_id=2)  # flags win

Where the process facts come from, first match wins (explicit arguments override any
field of what is detected):

    source      variables read
    ----------  -------------------------------------------------------------------------
    jaxlearn    JAXLEARN_COORDINATOR_ADDRESS + JAXLEARN_NUM_PROCESSES + JAXLEARN_PROCESS_ID
    (local)     ... the same, set by `jaxlearn launch local` (JAXLEARN_LAUNCHER=local)
    ompi        OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK; coordinator from
                JAXLEARN_COORDINATOR_ADDRESS, else the mpirun host in OMPI_MCA_orte_hnp_uri
    slurm       SLURM_PROCID, SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), SLURM_LOCALID;
                coordinator = first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST,
                SLURM_NODELIST), hostlist syntax expanded (`gpu[003-005,9],login1`)
    jobset /    JOB_COMPLETION_INDEX (Indexed Job), JOB_GLOBAL_INDEX or JOB_INDEX (JobSet,
    kubernetes  from the pod annotations), JAXLEARN_NUM_PROCESSES, JAXLEARN_PROCESSES_PER_JOB;
                coordinator from JAXLEARN_COORDINATOR_ADDRESS, else the JobSet DNS name
                `<JOBSET_NAME>-<REPLICATED_JOB_NAME>-0-0.<subdomain>`

OMPI is checked before Slurm (an `mpirun` inside an allocation sees both) and explicit
JAXLEARN_* before everything (`jaxlearn launch local` inside an allocation). The coordinator
port, where it is not given, is JAXLEARN_COORDINATOR_PORT / JAX_COORDINATOR_PORT, else
derived from the job id as JAX does (Slurm, Open MPI) or 8476 (Kubernetes).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from typing import Mapping, Optional, Sequence

DEFAULT_K8S_PORT = 8476

# Variables the launcher strips from the parent's environment before setting its own, so a
# `launch local` inside a Slurm allocation or a pod is not mistaken for that scheduler.
SCHEDULER_VARS = re.compile(
    r"(SLURM_.*|OMPI_.*|PMIX_.*|PMI_.*|JOB_COMPLETION_INDEX|JOB_INDEX|JOB_GLOBAL_INDEX|"
    r"JOBSET_NAME|REPLICATED_JOB_NAME|REPLICATED_JOB_REPLICAS|GLOBAL_REPLICAS|"
    r"JAXLEARN_(COORDINATOR_ADDRESS|COORDINATOR_PORT|NUM_PROCESSES|PROCESS_ID|"
    r"PROCESSES_PER_JOB|LAUNCHER|LOCAL_DEVICE_IDS|K8S_SUBDOMAIN)|"
    r"JAX_COORDINATOR_ADDRESS|JAX_COORDINATOR_PORT|JAX_LOCAL_DEVICE_IDS)"
)


class DistributedError(RuntimeError):
    """Multi-process start failed; the message says which process and why."""


class ClusterConfigError(DistributedError):
    """The environment or flags describe an impossible or incomplete process group."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """One process's place in the process group.

    Attributes:
        source: where it came from: "flags", "jaxlearn", "local", "ompi", "slurm",
            "jobset", "kubernetes", or "single" (no cluster: one process).
        coordinator_address: "host:port" of process 0's coordination service.
        num_processes: processes in the group.
        process_id: this process, in [0, num_processes).
        local_process_id: this process's index on its host, where the scheduler says.
        local_device_ids: restrict this process to these local accelerators (None: all).
    """

    source: str
    coordinator_address: Optional[str]
    num_processes: int
    process_id: int
    local_process_id: Optional[int] = None
    local_device_ids: Optional[tuple[int, ...]] = None

    @property
    def is_multi_process(self) -> bool:
        return self.num_processes > 1

    def describe(self) -> str:
        return (f"process {self.process_id} of {self.num_processes} ({self.source}, "
                f"coordinator {self.coordinator_address})")


# ---- Slurm hostlists -------------------------------------------------------------------------


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm hostlist -> host names: `"gpu[001-003,7],login-a[1-2]b"` -> gpu001, gpu002,
    gpu003, gpu7, login-a1b, login-a2b. Several bracket groups in one name multiply
    (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2); ranges keep the zero padding of their start."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        if not item:
            continue
        parts: list[list[str]] = []
        for literal, ranges in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", item):
            if literal:
                parts.append([literal])
            if ranges:
                parts.append(_expand_ranges(ranges, hostlist))
        if "[" in item and item.count("[") != item.count("]"):
            raise ClusterConfigError(f"malformed Slurm hostlist {hostlist!r}")
        hosts.extend("".join(p) for p in itertools.product(*parts))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for r in ranges.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", r)
        if not m:
            raise ClusterConfigError(f"malformed range [{ranges}] in Slurm hostlist {hostlist!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ClusterConfigError(f"descending range {r!r} in Slurm hostlist {hostlist!r}")
        width = len(lo)
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


# ---- detection ------------------------------------------------------------------------------


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ClusterConfigError(f"{name}={value!r} is not an integer") from None


def _port(env: Mapping[str, str], default: Optional[int]) -> Optional[int]:
    for name in ("JAXLEARN_COORDINATOR_PORT", "JAX_COORDINATOR_PORT"):
        port = _int(env, name)
        if port is not None:
            return port
    return default


def _device_ids(env: Mapping[str, str]) -> Optional[tuple[int, ...]]:
    for name in ("JAXLEARN_LOCAL_DEVICE_IDS", "JAX_LOCAL_DEVICE_IDS"):
        value = env.get(name)
        if value:
            try:
                return tuple(int(v) for v in value.split(","))
            except ValueError:
                raise ClusterConfigError(f"{name}={value!r} is not a comma-separated "
                                         "list of integers") from None
    return None


def _explicit_address(env: Mapping[str, str]) -> Optional[str]:
    return env.get("JAXLEARN_COORDINATOR_ADDRESS") or env.get("JAX_COORDINATOR_ADDRESS") or None


def _detect_slurm(env: Mapping[str, str]) -> Optional[ClusterSpec]:
    process_id = _int(env, "SLURM_PROCID")
    count = _int(env, "SLURM_STEP_NUM_TASKS")
    if count is None:
        count = _int(env, "SLURM_NTASKS")
    if process_id is None or count is None:
        return None
    address = _explicit_address(env)
    if address is None and count > 1:
        nodelist = next((env[v] for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                          "SLURM_NODELIST") if env.get(v)), None)
        if nodelist is None:
            raise ClusterConfigError(
                "Slurm task (SLURM_PROCID set) without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: "
                "cannot find the coordinator; set JAXLEARN_COORDINATOR_ADDRESS")
        hosts = expand_hostlist(nodelist)
        job_id = _int(env, "SLURM_JOB_ID") or 0
        # JAX's choice: a port in the ephemeral range [61440, 65535] derived from the job id.
        port = _port(env, job_id % 2**12 + (65535 - 2**12 + 1))
        address = f"{hosts[0]}:{port}"
    return ClusterSpec("slurm", address, count, process_id,
                       local_process_id=_int(env, "SLURM_LOCALID"))


def _detect_ompi(env: Mapping[str, str]) -> Optional[ClusterSpec]:
    process_id = _int(env, "OMPI_COMM_WORLD_RANK")
    count = _int(env, "OMPI_COMM_WORLD_SIZE")
    if process_id is None or count is None:
        return None
    address = _explicit_address(env)
    if address is None and count > 1:
        uri = env.get("OMPI_MCA_orte_hnp_uri")
        # Open MPI <= 4: "<jobid>.<vpid>;tcp://10.0.0.1,10.0.0.2:45678" names mpirun's host.
        m = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri or "")
        if uri is None or m is None:
            raise ClusterConfigError(
                "Open MPI rank without a coordinator: set JAXLEARN_COORDINATOR_ADDRESS=host:port "
                "(e.g. mpirun -x JAXLEARN_COORDINATOR_ADDRESS=$(hostname):8476 ...); "
                "OMPI_MCA_orte_hnp_uri (Open MPI <= 4) is absent or unparsable")
        host = next(g for g in m.groups() if g is not None)
        job_id = int(uri.split(".", 1)[0]) // 2**12 if uri.split(".", 1)[0].isdigit() else 0
        port = _port(env, job_id % 2**12 + (65535 - 2**12 + 1))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return ClusterSpec("ompi", address, count, process_id,
                       local_process_id=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"))


def _detect_kubernetes(env: Mapping[str, str]) -> Optional[ClusterSpec]:
    completion = _int(env, "JOB_COMPLETION_INDEX")
    if completion is None:
        return None
    jobset = env.get("JOBSET_NAME")
    source = "jobset" if jobset else "kubernetes"
    count = _int(env, "JAXLEARN_NUM_PROCESSES")
    if count is None:
        raise ClusterConfigError(
            f"Kubernetes Indexed Job pod (JOB_COMPLETION_INDEX={completion}) but the number of "
            "processes is unknown: set JAXLEARN_NUM_PROCESSES (`jaxlearn launch k8s` does)")
    job = _int(env, "JOB_GLOBAL_INDEX")
    if job is None:
        job = _int(env, "JOB_INDEX") or 0
    per_job = _int(env, "JAXLEARN_PROCESSES_PER_JOB") or count
    process_id = _int(env, "JAXLEARN_PROCESS_ID")
    if process_id is None:
        process_id = job * per_job + completion
    address = _explicit_address(env)
    if address is None:
        rjob = env.get("REPLICATED_JOB_NAME")
        if not (jobset and rjob):
            raise ClusterConfigError(
                "Kubernetes pod without a coordinator: set JAXLEARN_COORDINATOR_ADDRESS, or "
                "run under a JobSet with JOBSET_NAME and REPLICATED_JOB_NAME in the env")
        subdomain = env.get("JAXLEARN_K8S_SUBDOMAIN") or jobset
        address = f"{jobset}-{rjob}-0-0.{subdomain}:{_port(env, DEFAULT_K8S_PORT)}"
    return ClusterSpec(source, address, count, process_id)


def _detect_jaxlearn(env: Mapping[str, str]) -> Optional[ClusterSpec]:
    names = ("JAXLEARN_COORDINATOR_ADDRESS", "JAXLEARN_NUM_PROCESSES", "JAXLEARN_PROCESS_ID")
    if not all(env.get(n) for n in names):
        return None
    count, process_id = _int(env, names[1]), _int(env, names[2])
    assert count is not None and process_id is not None
    source = "local" if env.get("JAXLEARN_LAUNCHER") == "local" else "jaxlearn"
    return ClusterSpec(source, env[names[0]], count, process_id)


def detect_cluster(environ: Mapping[str, str]) -> Optional[ClusterSpec]:
    """This process's ClusterSpec from scheduler variables in `environ`, or None if none are
    set (a plain single process). Pure: reads only `environ`. Raises ClusterConfigError for
    a half-described group (e.g. a pod index but no process count)."""
    for detect in (_detect_jaxlearn, _detect_ompi, _detect_slurm, _detect_kubernetes):
        spec = detect(environ)
        if spec is not None:
            ids = _device_ids(environ)
            if ids is not None:
                spec = dataclasses.replace(spec, local_device_ids=ids)
            _validate(spec)
            return spec
    return None


def _validate(spec: ClusterSpec) -> None:
    if spec.num_processes < 1:
        raise ClusterConfigError(f"{spec.source}: the number of processes must be >= 1, "
                                 f"got {spec.num_processes}")
    if not 0 <= spec.process_id < spec.num_processes:
        raise ClusterConfigError(f"{spec.source}: process id {spec.process_id} is not in "
                                 f"[0, {spec.num_processes})")
    if spec.num_processes > 1:
        if not spec.coordinator_address:
            raise ClusterConfigError(f"{spec.source}: {spec.num_processes} processes but no "
                                     "coordinator address")
        split_address(spec.coordinator_address)


def resolve_cluster(
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    local_device_ids: Optional[Sequence[int]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> ClusterSpec:
    """Explicit values over what `detect_cluster(environ)` finds; a single process if
    neither says otherwise."""
    env = os.environ if environ is None else environ
    explicit = (coordinator_address, num_processes, process_id)
    if all(v is not None for v in explicit):
        assert num_processes is not None and process_id is not None
        spec = ClusterSpec("flags", coordinator_address, num_processes, process_id,
                           local_device_ids=_device_ids(env))
    else:
        detected = detect_cluster(env)
        if detected is None:
            if num_processes is not None and num_processes > 1:
                missing = [n for n, v in zip(("coordinator_address", "process_id"),
                                             (coordinator_address, process_id)) if v is None]
                raise ClusterConfigError(
                    f"num_processes={num_processes} but no {' or '.join(missing)} given and "
                    "no scheduler (Slurm, Open MPI, Kubernetes) detected in the environment")
            detected = ClusterSpec("single", coordinator_address, 1, 0)
        spec = dataclasses.replace(
            detected,
            coordinator_address=coordinator_address or detected.coordinator_address,
            num_processes=detected.num_processes if num_processes is None else num_processes,
            process_id=detected.process_id if process_id is None else process_id,
        )
    if local_device_ids is not None:
        spec = dataclasses.replace(spec, local_device_ids=tuple(local_device_ids))
    _validate(spec)
    return spec


def split_address(address: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" -> (host, port)."""
    m = re.fullmatch(r"\[?([^\[\]]+?)\]?:(\d+)", address.strip())
    if not m:
        raise ClusterConfigError(f"coordinator address {address!r} is not host:port")
    return m.group(1), int(m.group(2))


__all__ = [
    "DEFAULT_K8S_PORT",
    "SCHEDULER_VARS",
    "ClusterConfigError",
    "ClusterSpec",
    "DistributedError",
    "detect_cluster",
    "expand_hostlist",
    "resolve_cluster",
    "split_address",
]
