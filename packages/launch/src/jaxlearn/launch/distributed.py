"""Multi-process start: who am I, who is the coordinator, and a bounded, explained join.

    spec = detect_cluster(os.environ)        # pure: ClusterSpec, or None outside a cluster
    spec = initialize()                      # detect + roll call + jax.distributed.initialize
    spec = initialize("10.0.0.1:8476", num_processes=4, process_id=2)   # explicit

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

Why not `jax.distributed.initialize()` with no arguments: its Slurm detection counts
SLURM_NTASKS (wrong inside a smaller `srun` step), parses only the first hostlist range, and
any detected scheduler pins `local_device_ids=[local rank]` even when one process drives all
the GPUs of its node. Here detection is a pure, tested function and JAX's own detection is
switched off (`cluster_detection_method="deactivate"`) so nothing else is guessed.

Failures. JAX aborts the process (SIGABRT, not an exception) when a peer does not register
within `initialization_timeout` or stops sending heartbeats, and its message names no
process. So before JAX starts, `initialize` runs a *roll call* on the coordinator port:
process 0 listens, every other process reports its id, process 0 answers when all n are
there, or after `initialization_timeout` names the missing ones (to everyone who did join),
and every process raises `DistributedInitError` - a Python exception with a one-line
message, not an abort. It also rejects duplicate process ids and disagreeing process counts
(the usual scheduler misconfigurations). After the roll call process 0 closes the port and
JAX's coordination service binds it. Every process then prints
`jaxlearn: process I of N joined (...)` on stderr, which `launch_local` watches for.
Failures after the join (a peer dies mid-step) still abort in JAX after
`heartbeat_timeout`; a supervisor outside the processes (`launch_local`, `srun
--kill-on-bad-exit`, a JobSet failure policy) stops the others promptly instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import select
import socket
import sys
import time
from typing import Any, Mapping, Optional, Sequence

log = logging.getLogger("jaxlearn.distributed")

DEFAULT_INITIALIZATION_TIMEOUT = 300
DEFAULT_HEARTBEAT_TIMEOUT = 100
DEFAULT_K8S_PORT = 8476
JOINED_RE = re.compile(r"jaxlearn: process (\d+) of (\d+) joined")

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


class DistributedInitError(DistributedError):
    """The processes did not all join within the initialization timeout.

    `missing`: the process ids that never joined (empty when unknown, e.g. the coordinator
    itself was unreachable)."""

    def __init__(self, message: str, missing: Sequence[int] = ()):
        super().__init__(message)
        self.missing = tuple(missing)


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
        _split_address(spec.coordinator_address)


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


def _split_address(address: str) -> tuple[str, int]:
    m = re.fullmatch(r"\[?([^\[\]]+?)\]?:(\d+)", address.strip())
    if not m:
        raise ClusterConfigError(f"coordinator address {address!r} is not host:port")
    return m.group(1), int(m.group(2))


# ---- the roll call --------------------------------------------------------------------------

_HELLO = "JAXLEARN-ROLLCALL/1"


def format_ids(ids: Sequence[int]) -> str:
    ids = sorted(ids)
    return ", ".join(str(i) for i in ids)


def roll_call(spec: ClusterSpec, timeout: float) -> None:
    """Blocks until all `spec.num_processes` processes are up (see the module doc), at most
    about `timeout` seconds; raises DistributedInitError naming who is missing."""
    if not spec.is_multi_process:
        return
    assert spec.coordinator_address is not None
    if spec.process_id == 0:
        _roll_call_coordinator(spec, timeout)
    else:
        _roll_call_peer(spec, timeout)


def listen(port: int) -> socket.socket:
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def _roll_call_coordinator(spec: ClusterSpec, timeout: float) -> None:
    assert spec.coordinator_address is not None
    _, port = _split_address(spec.coordinator_address)
    try:
        server = listen(port)
    except OSError as e:
        raise ClusterConfigError(
            f"process 0 of {spec.num_processes}: cannot listen on the coordinator port {port} "
            f"({e.strerror or e}); is another job using it? Set JAXLEARN_COORDINATOR_PORT"
        ) from None
    deadline = time.monotonic() + timeout
    joined: dict[int, tuple[socket.socket, str]] = {}
    pending: dict[socket.socket, bytes] = {}
    problem: Optional[str] = None
    try:
        server.setblocking(False)
        while len(joined) < spec.num_processes - 1 and problem is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            readable, _, _ = select.select([server, *pending], [], [], min(left, 1.0))
            for sock in readable:
                if sock is server:
                    try:
                        conn, _ = server.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    pending[conn] = b""
                    continue
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    pending.pop(sock, None)
                    sock.close()
                    continue
                pending[sock] += data
                if b"\n" not in pending[sock]:
                    continue
                line = pending.pop(sock).split(b"\n", 1)[0].decode("utf-8", "replace")
                problem = _admit(spec, line, sock, joined)
        missing = sorted(set(range(1, spec.num_processes)) - set(joined))
        if problem is None and not missing:
            _broadcast(joined, "OK")
            return
        if problem is None:
            problem = (f"process(es) {format_ids(missing)} of {spec.num_processes} did not join "
                       f"within {timeout:g}s (joined: {format_ids([0, *joined])})")
        _broadcast(joined, "FAIL " + problem)
        raise DistributedInitError(
            f"process 0 of {spec.num_processes}: distributed initialization failed: {problem}; "
            f"coordinator {spec.coordinator_address}, {spec.source}{_hint(spec)}",
            missing=missing)
    finally:
        for sock in pending:
            sock.close()
        for sock, _ in joined.values():
            sock.close()
        server.close()


def _admit(spec: ClusterSpec, line: str, sock: socket.socket,
           joined: dict[int, tuple[socket.socket, str]]) -> Optional[str]:
    """Records one hello; returns a problem that stops the roll call, if any."""
    parts = line.split()
    if len(parts) < 4 or parts[0] != _HELLO:
        sock.close()  # Not ours (a port scanner, a stale client): ignore it.
        return None
    try:
        pid, count = int(parts[1]), int(parts[2])
    except ValueError:
        sock.close()
        return None
    host = parts[3]
    if count != spec.num_processes:
        _send(sock, f"FAIL process {pid} on {host} expects {count} processes, "
                    f"process 0 expects {spec.num_processes}")
        sock.close()
        return (f"process {pid} on {host} expects {count} processes but process 0 expects "
                f"{spec.num_processes}: the processes were started with different settings")
    if not 1 <= pid < spec.num_processes or pid in joined:
        where = "is this process (0)" if pid == 0 else (
            f"already joined from {joined[pid][1]}" if pid in joined else "is out of range")
        _send(sock, f"FAIL duplicate or invalid process id {pid}: {where}")
        sock.close()
        return (f"two processes claim process id {pid} ({host}; {where}): the scheduler "
                "variables give the same rank to several processes")
    joined[pid] = (sock, host)
    return None


def _send(sock: socket.socket, message: str) -> None:
    try:
        sock.setblocking(True)
        sock.settimeout(2.0)
        sock.sendall((message + "\n").encode("utf-8"))
    except OSError:
        pass


def _broadcast(joined: dict[int, tuple[socket.socket, str]], message: str) -> None:
    for sock, _ in joined.values():
        _send(sock, message)


def _roll_call_peer(spec: ClusterSpec, timeout: float) -> None:
    assert spec.coordinator_address is not None
    host, port = _split_address(spec.coordinator_address)
    deadline = time.monotonic() + timeout
    hello = f"{_HELLO} {spec.process_id} {spec.num_processes} {socket.gethostname()}\n"
    where = f"process {spec.process_id} of {spec.num_processes}"
    last_error = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DistributedInitError(
                f"{where}: distributed initialization failed: the coordinator (process 0) at "
                f"{spec.coordinator_address} did not answer within {timeout:g}s ({last_error}): "
                f"process 0 has not started, has failed, or is unreachable from here "
                f"({spec.source}{_hint(spec)})", missing=[0])
        try:
            sock = socket.create_connection((host, port), timeout=min(left, 5.0))
        except OSError as e:
            last_error = f"last error: {e.strerror or e}"
            time.sleep(min(0.25, max(deadline - time.monotonic(), 0)))
            continue
        try:
            sock.sendall(hello.encode("utf-8"))
            # Process 0 is the judge: wait for its verdict past our own deadline (it may
            # have started later than us), but not forever.
            sock.settimeout(max(deadline - time.monotonic(), 0) + min(timeout, 30.0) + 5.0)
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        except socket.timeout:
            raise DistributedInitError(
                f"{where}: distributed initialization failed: joined the coordinator at "
                f"{spec.coordinator_address} but it gave no answer within {timeout:g}s"
            ) from None
        except OSError as e:
            last_error = f"last error: {e.strerror or e}"
            sock.close()
            time.sleep(0.25)
            continue
        finally:
            sock.close()
        text = reply.decode("utf-8", "replace").strip()
        if text == "OK":
            return
        if text.startswith("FAIL "):
            problem = text[5:]
            m = re.search(r"process\(es\) ([\d, ]+) of", problem)
            missing = [int(x) for x in m.group(1).split(",")] if m else []
            raise DistributedInitError(
                f"{where}: distributed initialization failed (reported by process 0): "
                f"{problem}", missing=missing)
        # Connection closed without a verdict (process 0 died or restarted): try again.
        last_error = "the coordinator closed the connection"
        time.sleep(0.25)


def _hint(spec: ClusterSpec) -> str:
    if spec.source == "slurm":
        return ("; under Slurm start every task with srun (a plain command in an sbatch "
                "script is one task)")
    if spec.source in ("jobset", "kubernetes"):
        return "; check that all pods are scheduled (kubectl get pods) and DNS resolves"
    return ""


# ---- initialize -----------------------------------------------------------------------------

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
    "ClusterConfigError",
    "ClusterSpec",
    "DistributedError",
    "DistributedInitError",
    "detect_cluster",
    "expand_hostlist",
    "initialize",
    "resolve_cluster",
    "roll_call",
]
