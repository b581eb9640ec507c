"""C++ kernels for XLA:CPU behind XLA FFI calls: the one place that compiles them.

A kernel's source (`csrc/*.cc`) is compiled on first use with the system C++ compiler
against the FFI headers jaxlib ships (`jax.ffi.include_dir()`), into `kernel_cache_dir()`,
keyed by the source, the jax version, the flags and (for `-march=native` builds) the
host's CPU flags, so a cache shared between hosts never hands one host another's code.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

__all__ = ["build", "kernel_cache_dir"]


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
    key_src = source.read_bytes() + jax.__version__.encode() + " ".join(flags).encode()
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
