"""Multi-process start: scheduler detection (real Slurm / Open MPI / Kubernetes variable
names), the roll call that bounds and explains a failed join, and the local launcher that
fails fast. Multi-process cases run as subprocesses (2 x 4 CPU devices, gloo): JAX aborts
the process on a failed peer, so only an outside observer can check what happened."""

import io
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jaxlearn.launch.cluster import (
    ClusterConfigError,
    ClusterSpec,
    detect_cluster,
    expand_hostlist,
    resolve_cluster,
)
from jaxlearn.launch.local import free_port, launch_local, local_process_env
from jaxlearn.launch.rollcall import DistributedInitError, roll_call


def _detect(env):
    """detect_cluster, asserting that it found a cluster."""
    spec = detect_cluster(env)
    assert spec is not None
    return spec

# ---- hostlists ------------------------------------------------------------------------------


@pytest.mark.parametrize("hostlist,hosts", [
    ("node001", ["node001"]),
    ("node001,login2", ["node001", "login2"]),
    ("gpu[003-005,9]", ["gpu003", "gpu004", "gpu005", "gpu9"]),
    ("gpu[08-10],cpu[1-2]", ["gpu08", "gpu09", "gpu10", "cpu1", "cpu2"]),
    ("a[1-2]b", ["a1b", "a2b"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("10.0.0.[7-8]", ["10.0.0.7", "10.0.0.8"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["gpu[1-", "gpu[3-1]", "gpu[a-b]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(ClusterConfigError, match="hostlist"):
        expand_hostlist(bad)


# ---- detection ------------------------------------------------------------------------------


def _slurm(**extra):
    # What slurmstepd exports to task 5 of an `srun` step on 4 nodes x 2 tasks.
    env = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_NTASKS": "8",
           "SLURM_STEP_NUM_TASKS": "8", "SLURM_NNODES": "4", "SLURM_STEP_NUM_NODES": "4",
           "SLURM_JOB_NODELIST": "gpu[007-010]", "SLURM_STEP_NODELIST": "gpu[007-010]",
           "SLURM_TASKS_PER_NODE": "2(x4)", "SLURMD_NODENAME": "gpu009"}
    env.update(extra)
    return env


def test_detect_slurm():
    spec = _detect(_slurm())
    # Port: JAX's rule, job id mod 4096 in the top 4096 ports.
    assert spec == ClusterSpec("slurm", f"gpu007:{123456 % 4096 + 61440}", 8, 5,
                               local_process_id=1)


def test_detect_slurm_step_smaller_than_job_and_port_override():
    env = _slurm(SLURM_NTASKS="16", SLURM_STEP_NUM_TASKS="8", SLURM_STEP_NODELIST="gpu[009-010]",
                 JAXLEARN_COORDINATOR_PORT="7777")
    spec = _detect(env)
    assert (spec.num_processes, spec.coordinator_address) == (8, "gpu009:7777")


def test_detect_slurm_job_nodelist_fallback_and_explicit_address():
    env = _slurm()
    del env["SLURM_STEP_NODELIST"], env["SLURM_STEP_NUM_TASKS"]
    assert _detect(env).coordinator_address.startswith("gpu007:")
    env["JAXLEARN_COORDINATOR_ADDRESS"] = "10.1.2.3:9999"
    assert _detect(env).coordinator_address == "10.1.2.3:9999"
    del env["SLURM_JOB_NODELIST"], env["JAXLEARN_COORDINATOR_ADDRESS"]
    with pytest.raises(ClusterConfigError, match="SLURM_STEP_NODELIST"):
        _detect(env)


def test_detect_slurm_single_task_needs_no_coordinator():
    spec = _detect({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (spec.num_processes, spec.is_multi_process) == (1, False)


def test_detect_ompi():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"}
    spec = _detect(env)
    port = (1531576320 // 4096) % 4096 + 61440
    assert spec == ClusterSpec("ompi", f"10.96.0.1:{port}", 4, 3, local_process_id=1)
    env["OMPI_MCA_orte_hnp_uri"] = "1314521088.0;tcp6://[fe80::b9b:ac5d,2620:10d::2]:43370"
    assert _detect(env).coordinator_address.startswith("[fe80::b9b:ac5d]:")
    del env["OMPI_MCA_orte_hnp_uri"]  # Open MPI 5 (PRRTE): no launcher URI to parse.
    with pytest.raises(ClusterConfigError, match="JAXLEARN_COORDINATOR_ADDRESS"):
        _detect(env)
    env["JAXLEARN_COORDINATOR_ADDRESS"] = "head:8476"
    assert _detect(env).coordinator_address == "head:8476"


def _jobset_pod(**extra):
    # A pod of JobSet "train", replicated job "workers", job 1 of 2, pod 2 of 4: Kubernetes
    # sets JOB_COMPLETION_INDEX; the rest comes from the pod annotations (downward API) and
    # the literal values `jaxlearn launch k8s` writes.
    env = {"JOB_COMPLETION_INDEX": "2", "JOBSET_NAME": "train",
           "REPLICATED_JOB_NAME": "workers", "JOB_INDEX": "1", "JOB_GLOBAL_INDEX": "1",
           "JAXLEARN_NUM_PROCESSES": "8", "JAXLEARN_PROCESSES_PER_JOB": "4",
           "HOSTNAME": "train-workers-1-2", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    env.update(extra)
    return env


def test_detect_jobset_dns_coordinator():
    spec = _detect(_jobset_pod())
    assert spec == ClusterSpec("jobset", "train-workers-0-0.train:8476", 8, 6)
    spec = _detect(_jobset_pod(JAXLEARN_K8S_SUBDOMAIN="svc",
                                      JAXLEARN_COORDINATOR_PORT="1234"))
    assert spec.coordinator_address == "train-workers-0-0.svc:1234"


def test_detect_plain_indexed_job_and_errors():
    env = {"JOB_COMPLETION_INDEX": "1", "JAXLEARN_NUM_PROCESSES": "2",
           "JAXLEARN_COORDINATOR_ADDRESS": "job-0.svc:8476"}
    assert _detect(env) == ClusterSpec("kubernetes", "job-0.svc:8476", 2, 1)
    with pytest.raises(ClusterConfigError, match="JAXLEARN_NUM_PROCESSES"):
        _detect({"JOB_COMPLETION_INDEX": "1"})
    with pytest.raises(ClusterConfigError, match="coordinator"):
        _detect({"JOB_COMPLETION_INDEX": "1", "JAXLEARN_NUM_PROCESSES": "2"})
    with pytest.raises(ClusterConfigError, match=r"process id 9 is not in \[0, 8\)"):
        _detect(_jobset_pod(JOB_COMPLETION_INDEX="5", JOB_GLOBAL_INDEX="1"))


def test_detect_explicit_and_precedence():
    explicit = {"JAXLEARN_COORDINATOR_ADDRESS": "127.0.0.1:5000", "JAXLEARN_NUM_PROCESSES": "2",
                "JAXLEARN_PROCESS_ID": "1"}
    assert _detect(explicit) == ClusterSpec("jaxlearn", "127.0.0.1:5000", 2, 1)
    assert _detect({**explicit, "JAXLEARN_LAUNCHER": "local"}).source == "local"
    # `launch local` inside an allocation: the explicit variables win.
    assert _detect({**_slurm(), **explicit}).source == "jaxlearn"
    # mpirun inside an allocation: every rank sees the batch step's SLURM_PROCID=0.
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
            "JAXLEARN_COORDINATOR_ADDRESS": "h:1"}
    assert _detect({**_slurm(SLURM_PROCID="0"), **ompi}).process_id == 1
    assert detect_cluster({"PATH": "/bin", "HOSTNAME": "laptop"}) is None
    with pytest.raises(ClusterConfigError, match="not an integer"):
        _detect(_slurm(SLURM_PROCID="x"))
    assert _detect({**explicit, "JAXLEARN_LOCAL_DEVICE_IDS": "0,1"}).local_device_ids \
        == (0, 1)


def test_resolve_cluster_flags_override_detection():
    spec = resolve_cluster("h:1", 2, 0, environ={})
    assert (spec.source, spec.num_processes) == ("flags", 2)
    spec = resolve_cluster(process_id=3, environ=_slurm())  # One field overridden.
    assert (spec.source, spec.process_id, spec.num_processes) == ("slurm", 3, 8)
    assert resolve_cluster(environ={}) == ClusterSpec("single", None, 1, 0)
    with pytest.raises(ClusterConfigError, match="no coordinator_address or process_id"):
        resolve_cluster(num_processes=2, environ={})
    with pytest.raises(ClusterConfigError, match="not host:port"):
        resolve_cluster("nohost", 2, 0, environ={})


def test_local_process_env_uses_real_names_and_scrubs_inherited():
    base = {"PATH": "/bin", "SLURM_PROCID": "7", "OMPI_COMM_WORLD_RANK": "3",
            "JAXLEARN_PROCESS_ID": "9", "JOB_COMPLETION_INDEX": "4"}
    for style, source in (("jaxlearn", "local"), ("slurm", "slurm"), ("k8s", "jobset"),
                          ("ompi", "ompi")):
        env = local_process_env(1, 2, 5555, devices_per_process=4, style=style, base=base)
        spec = _detect(env)
        assert (spec.source, spec.process_id, spec.num_processes) == (source, 1, 2), style
        assert spec.coordinator_address.endswith(":5555")
        assert env["JAX_NUM_CPU_DEVICES"] == "4" and env["PATH"] == "/bin"


# ---- the roll call (threads in this process: pure sockets) ----------------------------------


def _run_roll_call(n, present, timeout, specs=None):
    port = free_port()
    errors, elapsed = {}, {}

    def member(i):
        spec = (specs or {}).get(i) or ClusterSpec("test", f"127.0.0.1:{port}", n, i)
        t0 = time.monotonic()
        try:
            roll_call(spec, timeout)
        except DistributedInitError as e:
            errors[i] = e
        elapsed[i] = time.monotonic() - t0

    threads = [threading.Thread(target=member, args=(i,)) for i in present]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout * 3 + 10)
    return errors, elapsed


def test_roll_call_all_present():
    errors, _ = _run_roll_call(4, [3, 1, 0, 2], timeout=10)
    assert errors == {}


def test_roll_call_names_the_missing_to_everyone():
    errors, elapsed = _run_roll_call(4, [0, 2], timeout=1.5)
    assert set(errors) == {0, 2}
    assert "process(es) 1, 3 of 4 did not join within 1.5s (joined: 0, 2)" in str(errors[0])
    assert errors[0].missing == (1, 3) and errors[2].missing == (1, 3)
    assert "reported by process 0" in str(errors[2])
    assert max(elapsed.values()) < 6


def test_roll_call_without_coordinator():
    errors, elapsed = _run_roll_call(2, [1], timeout=1.0)
    assert "the coordinator (process 0) at 127.0.0.1:" in str(errors[1])
    assert "did not answer within 1s" in str(errors[1]) and errors[1].missing == (0,)
    assert elapsed[1] < 5


def test_roll_call_rejects_duplicate_ids_and_count_mismatch():
    port = free_port()
    dup = {2: ClusterSpec("test", f"127.0.0.1:{port}", 3, 1)}  # "2" thinks it is 1.

    def run(specs, present):
        errors = {}

        def member(i):
            spec = specs.get(i) or ClusterSpec("test", f"127.0.0.1:{port}", 3, i)
            try:
                roll_call(spec, 5)
            except DistributedInitError as e:
                errors[i] = e
        threads = [threading.Thread(target=member, args=(i,)) for i in present]
        for t in threads:
            t.start()
            time.sleep(0.2)
        for t in threads:
            t.join(timeout=30)
        return errors

    errors = run(dup, [0, 1, 2])
    assert "two processes claim process id 1" in str(errors[0])
    port = free_port()
    errors = run({1: ClusterSpec("test", f"127.0.0.1:{port}", 4, 1)}, [0, 1])
    assert "process 1 on" in str(errors[0]) and "expects 4 processes" in str(errors[0])


# ---- real processes -------------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from jaxlearn.launch import distributed
    mode = os.environ.get("TEST_MODE", "")
    spec = distributed.resolve_cluster()
    if mode == "hang" and spec.process_id == 1:
        time.sleep(600)                       # Alive, but never joins.
    if mode == "crash_early" and spec.process_id == 1:
        sys.exit(3)
    try:
        distributed.initialize(initialization_timeout=float(os.environ.get("TEST_INIT", 20)),
                               heartbeat_timeout=float(os.environ.get("TEST_BEAT", 20)))
    except distributed.DistributedInitError as e:
        print("INIT-ERROR", e, file=sys.stderr, flush=True)
        sys.exit(4)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    if mode == "crash_late" and spec.process_id == 1:
        os._exit(9)                           # Dies after joining, without a goodbye.
    mesh = jax.make_mesh((jax.device_count(),), ("d",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    local = np.full(jax.local_device_count(), spec.process_id + 1.0, np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(x)
    print("RESULT", spec.source, jax.process_index(), jax.process_count(),
          jax.local_device_count(), jax.device_count(), float(total), flush=True)
    if mode == "crash_late":
        from jax.experimental import multihost_utils
        for i in range(600):
            multihost_utils.sync_global_devices(f"tick{i}")
            time.sleep(0.1)
""")


@pytest.fixture
def worker(tmp_path, monkeypatch):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    return [sys.executable, str(path)]


def _launch(worker, style="jaxlearn", **kw):
    out, err = io.StringIO(), io.StringIO()
    result = launch_local(worker, 2, devices_per_process=4, style=style, stdout=out,
                          stderr=err, **kw)
    return result, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("style,source", [("slurm", "slurm"), ("k8s", "jobset"),
                                          ("ompi", "ompi"), ("jaxlearn", "local")])
def test_two_processes_four_devices_each(worker, style, source):
    result, out, err = _launch(worker, style)
    assert result.returncode == 0, err[-3000:]
    # Global sum over 8 devices: 4 x 1.0 (process 0) + 4 x 2.0 (process 1).
    for i in (0, 1):
        assert f"[{i}] RESULT {source} {i} 2 4 8 12.0" in out, out
        assert f"[{i}] jaxlearn: process {i} of 2 joined ({source}" in err
    assert all(p.joined and not p.stopped for p in result.processes)


def test_missing_peer_is_named_and_bounded(worker, monkeypatch):
    """Process 1 is alive but never joins: process 0 gives up after the initialization
    timeout with a Python error naming process 1; the launcher stops process 1."""
    monkeypatch.setenv("TEST_MODE", "hang")
    monkeypatch.setenv("TEST_INIT", "4")
    t0 = time.monotonic()
    result, out, err = _launch(worker)
    elapsed = time.monotonic() - t0
    assert result.returncode == 4 and result.failed == 0, err[-3000:]
    assert "[0] INIT-ERROR process 0 of 2: distributed initialization failed: process(es) 1 " \
           "of 2 did not join within 4s (joined: 0)" in err
    assert "process 0 failed (exit status 4, before joining)" in result.message
    assert "never joined: 1" in result.message and "stopped: 1" in result.message
    assert result.processes[1].stopped and result.processes[1].returncode is not None
    assert elapsed < 4 + 40, elapsed  # Timeout + interpreter/JAX start-up under load.


def test_peer_crash_before_joining_stops_the_others_at_once(worker, monkeypatch):
    monkeypatch.setenv("TEST_MODE", "crash_early")
    result, out, err = _launch(worker)
    assert result.returncode == 3 and result.failed == 1
    assert "process 1 failed (exit status 3, before joining)" in result.message
    assert "stopped: 0" in result.message and result.processes[0].stopped
    assert result.seconds < 30, result.seconds  # Not the 20 s initialization timeout.


def test_peer_death_after_joining_stops_the_survivor_promptly(worker, monkeypatch):
    """A peer dies mid-run: without a supervisor the survivor would block in a collective
    until JAX's heartbeat timeout aborts it; the launcher stops it at once."""
    monkeypatch.setenv("TEST_MODE", "crash_late")
    monkeypatch.setenv("TEST_BEAT", "60")
    result, out, err = _launch(worker, kill_grace=1.0)
    assert result.returncode == 9 and result.failed == 1, err[-3000:]
    assert "process 1 failed (exit status 9) after" in result.message
    assert result.processes[0].stopped and result.processes[0].joined
    assert result.seconds < 45, result.seconds  # Well under the 60 s heartbeat timeout.


def test_heartbeat_timeout_bounds_a_survivor_without_supervisor(worker, monkeypatch):
    """Without a launcher, JAX aborts the survivor after `heartbeat_timeout` (SIGABRT)."""
    port = free_port()
    env = dict(os.environ, TEST_MODE="crash_late", TEST_BEAT="5")
    procs = [subprocess.Popen(worker, env=local_process_env(i, 2, port, devices_per_process=4,
                                                            base=env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    t0 = time.monotonic()
    try:
        _, err0 = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[1].returncode == 9
    assert procs[0].returncode == -6, err0[-2000:]  # SIGABRT from JAX's runtime.
    assert "unhealthy (stopped sending heartbeats)" in err0, err0[-2000:]
    assert time.monotonic() - t0 < 90


def test_coordinator_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ClusterConfigError,
                           match=f"cannot listen on the coordinator port {port}"):
            roll_call(ClusterSpec("test", f"127.0.0.1:{port}", 2, 0), 1)
