"""C++ kernels for XLA:CPU behind XLA FFI calls: the one place that compiles and opens
them.

A kernel's source (`csrc/*.cc`, with the shared headers `csrc/*.h`) is compiled on first
use with the system C++ compiler against the FFI headers jaxlib ships
(`jax.ffi.include_dir()`), into `kernel_cache_dir()`, keyed by the source, the headers, the
jax version, the flags and (for `-march=native` builds) the host's CPU flags, so a cache
shared between hosts never hands one host another's code. `NativeLibrary` opens a built
library once per process and registers its FFI targets, or keeps the one-line reason it
cannot.

The libraries run their blocks on XLA's intra-op pool through `csrc/pool_for.h`, whose
helpers can linger for the next job (`set_pool_spin_us`): one setting for the process,
applied to every library opened now or later.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

import jax

__all__ = ["NativeLibrary", "build", "kernel_cache_dir", "pool_spin_us", "set_pool_spin_us"]

SPIN_ENV = "JAXLEARN_POOL_SPIN_US"
_spin_lock = threading.Lock()
_spin_us: Optional[int] = None  # Set by set_pool_spin_us; None: the environment's.
_opened: list[ctypes.CDLL] = []  # Every library opened, for set_pool_spin_us.


def kernel_cache_dir() -> Path:
    """Where compiled kernels go: $JAXLEARN_KERNEL_CACHE, else ~/.cache/jaxlearn/kernels."""
    env = os.environ.get("JAXLEARN_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "jaxlearn" / "kernels"


def _cpu_flags() -> bytes:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    return b""


def build(source: Path, flags: tuple[str, ...] = ("-O2",), libs: tuple[str, ...] = ()) -> Path:
    """The shared library built from `source` with `flags` (cached; module doc).

    Raises RuntimeError (one line) when there is no compiler or the build fails."""
    headers = sorted(source.parent.glob("*.h"))
    key_src = b"".join(p.read_bytes() for p in [source, *headers])
    key_src += jax.__version__.encode() + " ".join(flags).encode()
    if "-march=native" in flags:
        key_src += _cpu_flags()
    key = hashlib.sha256(key_src).hexdigest()[:16]
    cache = kernel_cache_dir()
    out = cache / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError(f"no C++ compiler (c++ / g++ / $CXX) to build {source.name}")
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    cmd = [cxx, *flags, "-std=c++17", "-shared", "-fPIC", "-w",
           f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp, *libs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building {source.name} failed: {proc.stderr.strip()[-400:]}")
    os.replace(tmp, out)  # Atomic: concurrent builders each write their own tmp.
    return out


class NativeLibrary:
    """One FFI kernel library, opened at most once per process (`get`).

    `check()` gives a reason it cannot run here before anything is built (None: go on);
    `prepare(lib)` readies the opened library and raises RuntimeError (one line) when it
    cannot; `targets` maps FFI target names to the handler symbols registered on CPU.
    Either failure, a non-CPU backend or a failed build is kept as `unavailable_reason()`.
    """

    def __init__(self, source: Path, *, flags: tuple[str, ...], libs: tuple[str, ...],
                 targets: dict[str, str], check: Optional[Callable[[], Optional[str]]] = None,
                 prepare: Optional[Callable[[ctypes.CDLL], None]] = None):
        self.source, self.flags, self.libs, self.targets = source, flags, libs, targets
        self._check, self._prepare = check, prepare
        self._lock = threading.Lock()
        self._lib: Optional[ctypes.CDLL] = None
        self._reason: Optional[str] = None

    def get(self) -> Optional[ctypes.CDLL]:
        """The opened library with its targets registered, or None (`unavailable_reason`)."""
        with self._lock:
            if self._lib is None and self._reason is None:
                try:
                    self._lib = self._open()
                except (RuntimeError, OSError) as e:
                    self._reason = str(e)
            return self._lib

    def unavailable_reason(self) -> Optional[str]:
        """None when the library runs here, else why not (one line)."""
        self.get()
        return self._reason

    def _open(self) -> ctypes.CDLL:
        if jax.default_backend() != "cpu":
            raise RuntimeError(f"the backend is {jax.default_backend()}, not cpu")
        if self._check is not None and (why := self._check()) is not None:
            raise RuntimeError(why)
        lib = ctypes.CDLL(str(build(self.source, self.flags, self.libs)))
        if self._prepare is not None:
            self._prepare(lib)
        for name, symbol in self.targets.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
        lib.jl_set_pool_spin_us.argtypes = [ctypes.c_int64]
        lib.jl_pool_spin_us.restype = ctypes.c_int64
        with _spin_lock:
            _opened.append(lib)
            if _spin_us is not None:
                lib.jl_set_pool_spin_us(_spin_us)
        return lib


def set_pool_spin_us(us: int, *, over_env: bool = False) -> int:
    """Sets how long (us; 0: off) a helper of the kernels' pool lingers for the next job,
    and a caller for its last blocks (`csrc/pool_for.h`), in every library of this process,
    opened now or later. A set JAXLEARN_POOL_SPIN_US (the user's) wins unless `over_env`.
    Returns the setting in force."""
    global _spin_us
    if not isinstance(us, int) or us < 0:
        raise ValueError(f"set_pool_spin_us: us must be an int >= 0, got {us!r}")
    with _spin_lock:
        if over_env or os.environ.get(SPIN_ENV) is None:
            _spin_us = us
            for lib in _opened:
                lib.jl_set_pool_spin_us(us)
    return pool_spin_us()


def pool_spin_us() -> int:
    """The spin in force (us): what the opened libraries read, else what one opened now
    would (`set_pool_spin_us`, else JAXLEARN_POOL_SPIN_US, else 0)."""
    with _spin_lock:
        if _opened:  # A negative JAXLEARN_POOL_SPIN_US is off, as the library reads it.
            return max(int(_opened[0].jl_pool_spin_us()), 0)
        if _spin_us is not None:
            return _spin_us
    try:  # The library's reading (atoll): a malformed value is 0.
        return max(int(os.environ.get(SPIN_ENV, "0")), 0)
    except ValueError:
        return 0
