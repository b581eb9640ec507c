"""The FFI kernels' parallel-for (`csrc/pool_for.h`), whose helpers may linger for the next
job: a chain of packed matmuls gives the same bits with the spin on
(JAXLEARN_POOL_SPIN_US=100 in fresh processes and this one, see conftest.py) as with it
off, also when `set_pool_spin_us` turns it off or on in a running process; the setting
reaches every opened library, and one opened later, unless the environment names one; two
threads running chains at once (spin on) each get what they get alone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.kernels import (
    PackedWeights,
    mkl,
    native,
    packed_matmul,
    paged_native,
    pool_spin_us,
    set_pool_spin_us,
)

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or platform.machine() not in ("x86_64", "AMD64"),
    reason="the packed GEMM runs on x86-64 CPU backends only")

# A chain of 12 layers (x -> x + x @ w_i, in bf16), as a decode step hands GEMMs to the pool
# with one-core XLA ops between them; prints a digest of the result's bits.
_CHAIN = """
import hashlib, sys
import jax, jax.numpy as jnp, numpy as np
from jaxlearn.kernels import PackedWeights, mkl, packed_matmul

def chain(seed, rows, owner):
    rng = np.random.default_rng(seed)
    ws = [rng.normal(size=(96, 96)).astype(np.float32) / 10 for _ in range(12)]
    ids = jnp.asarray([owner.pack(jnp.asarray(w, jnp.bfloat16)) for w in ws], jnp.int32)
    def body(x, wid):
        return (x + packed_matmul(x, wid, 96).astype(x.dtype)) * 0.5, None
    run = jax.jit(lambda x: jax.lax.scan(body, x, ids)[0])
    x = jnp.asarray(rng.normal(size=(rows, 96)), jnp.bfloat16)
    return hashlib.sha256(np.asarray(jax.device_get(run(x))).tobytes()).hexdigest()

if __name__ == "__main__":
    if len(sys.argv) > 3:  # A spin set in the process, before any library opened.
        from jaxlearn.kernels import set_pool_spin_us
        set_pool_spin_us(int(sys.argv[3]))
    print(chain(int(sys.argv[1]), int(sys.argv[2]), PackedWeights(backend="avx512"
          if mkl.avx512_runs("bfloat16") else "onemkl")))
    if len(sys.argv) > 3:  # The opened library took the setting.
        from jaxlearn.kernels import native
        assert [lib.jl_pool_spin_us() for lib in native._opened] == [int(sys.argv[3])]
"""


def _chain_module() -> dict:
    scope: dict = {"__name__": "pool_for_chain"}
    exec(compile(_CHAIN, "pool_for_chain", "exec"), scope)
    return scope


def _owner() -> PackedWeights:
    return PackedWeights(backend="avx512" if mkl.avx512_runs("bfloat16") else "onemkl")


def _digests(script, spin: str, set_us: str = "") -> list[str]:
    env = dict(os.environ, JAXLEARN_POOL_SPIN_US=spin,
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if set_us:
        del env["JAXLEARN_POOL_SPIN_US"]
    out = []
    for seed, rows in ((0, 1), (1, 8), (2, 32)):
        argv = [sys.executable, str(script), str(seed), str(rows)] + ([set_us] if set_us else [])
        run = subprocess.run(argv, env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        out.append(run.stdout.split()[-1])
    return out


def test_the_spin_changes_no_bit(tmp_path) -> None:
    script = tmp_path / "chain.py"
    script.write_text(_CHAIN)
    off = _digests(script, "0")
    assert _digests(script, "100") == off
    owner = _owner()
    chain = _chain_module()["chain"]
    assert [chain(seed, rows, owner) for seed, rows in ((0, 1), (1, 8), (2, 32))] == off
    assert _digests(script, "", set_us="100") == off
    set_pool_spin_us(0, over_env=True)
    try:
        assert [chain(seed, rows, owner) for seed, rows in ((0, 1), (1, 8), (2, 32))] == off
    finally:
        set_pool_spin_us(int(os.environ["JAXLEARN_POOL_SPIN_US"]), over_env=True)


def test_the_setting_reaches_every_library_and_the_environment_wins(monkeypatch) -> None:
    assert mkl.library() is not None and paged_native.unavailable_reason() is None
    env = int(os.environ["JAXLEARN_POOL_SPIN_US"])  # conftest.py's default, or the caller's.
    try:
        assert set_pool_spin_us(env + 7) == env  # The environment's value stays.
        assert set_pool_spin_us(7, over_env=True) == 7 == pool_spin_us()
        assert [lib.jl_pool_spin_us() for lib in native._opened] == [7] * len(native._opened)
        monkeypatch.delenv("JAXLEARN_POOL_SPIN_US")
        assert set_pool_spin_us(0) == 0 == pool_spin_us()
        assert [lib.jl_pool_spin_us() for lib in native._opened] == [0] * len(native._opened)
        with pytest.raises(ValueError, match="us must be an int >= 0, got -1"):
            set_pool_spin_us(-1)
    finally:
        set_pool_spin_us(env, over_env=True)


def test_two_threads_at_once_get_what_each_gets_alone() -> None:
    rng = np.random.default_rng(5)
    owner = _owner()
    ws = [jnp.asarray(rng.normal(size=(64, 64)) / 8, jnp.bfloat16) for _ in range(8)]
    ids = jnp.asarray([owner.pack(w) for w in ws], jnp.int32)

    def body(x: jax.Array, wid: jax.Array) -> tuple[jax.Array, None]:
        return (x + packed_matmul(x, wid, 64).astype(x.dtype)) * 0.5, None

    run = jax.jit(lambda x: jax.lax.scan(body, x, ids)[0])
    xs = [jnp.asarray(rng.normal(size=(rows, 64)), jnp.bfloat16) for rows in (3, 17)]
    alone = [np.asarray(run(x)) for x in xs]
    got: dict[int, list[np.ndarray]] = {0: [], 1: []}

    def worker(i: int) -> None:
        for _ in range(20):
            got[i].append(np.asarray(run(xs[i])))

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    for i in (0, 1):
        assert len(got[i]) == 20
        for out in got[i]:
            np.testing.assert_array_equal(out, alone[i])
