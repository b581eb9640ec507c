"""The roll call: a bounded, explained join before `jax.distributed.initialize`.

JAX aborts the process (SIGABRT, not an exception) when a peer does not register within
`initialization_timeout` or stops sending heartbeats, and its message names no process. So
before JAX starts, `distributed.initialize` runs a roll call on the coordinator port:
process 0 listens, every other process reports its id, process 0 answers when all n are
there, or after `timeout` names the missing ones (to everyone who did join), and every
process raises `DistributedInitError` - a Python exception with a one-line message, not an
abort. It also rejects duplicate process ids and disagreeing process counts (the usual
scheduler misconfigurations). After the roll call process 0 closes the port and JAX's
coordination service binds it.

    roll_call(spec, timeout=300)     # returns when all spec.num_processes are up

The protocol, one line each way: a peer sends `JAXLEARN-ROLLCALL/1 <id> <n> <host>`;
process 0 answers `OK`, or `FAIL <problem>`.
"""

from __future__ import annotations

import re
import select
import socket
import time
from typing import Optional, Sequence

from jaxlearn.launch.cluster import (
    ClusterConfigError,
    ClusterSpec,
    DistributedError,
    split_address,
)


class DistributedInitError(DistributedError):
    """The processes did not all join within the initialization timeout.

    `missing`: the process ids that never joined (empty when unknown, e.g. the coordinator
    itself was unreachable)."""

    def __init__(self, message: str, missing: Sequence[int] = ()):
        super().__init__(message)
        self.missing = tuple(missing)



_HELLO = "JAXLEARN-ROLLCALL/1"


def format_ids(ids: Sequence[int]) -> str:
    """[3, 1, 2] -> "1, 2, 3"."""
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
    """A server socket on `port` of every interface (IPv6 and IPv4 where possible)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def _roll_call_coordinator(spec: ClusterSpec, timeout: float) -> None:
    assert spec.coordinator_address is not None
    _, port = split_address(spec.coordinator_address)
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
    host, port = split_address(spec.coordinator_address)
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


__all__ = ["DistributedInitError", "format_ids", "listen", "roll_call"]
