"""oneMKL behind XLA FFI calls: the one place that builds `csrc/mkl_gemm.cc`, opens oneMKL
from the `mkl` wheel and registers the FFI target of `packed_gemm`.

oneMKL is opened with `dlopen` (nothing is imported), LP64, sequential: each call splits
its work into one block per thread of XLA's intra-op pool, and the calling thread claims
blocks too, so concurrent calls cannot deadlock.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import platform
import threading
from pathlib import Path
from typing import Optional

import jax

from jaxlearn.kernels.native import build

__all__ = ["PACKED_TARGET", "host_has_bf16", "library", "unavailable_reason"]

_SOURCE = Path(__file__).parent / "csrc" / "mkl_gemm.cc"
PACKED_TARGET = "jaxlearn_packed_matmul"
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_reason: Optional[str] = None


def host_has_bf16() -> bool:
    """Whether this CPU has native bf16 dot instructions (AVX512_BF16 or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def _mkl_rt() -> Optional[str]:
    try:
        dist = importlib.metadata.distribution("mkl")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if Path(str(f)).name.startswith("libmkl_rt.so"):
            path = Path(str(dist.locate_file(f))).resolve()
            if path.exists():
                return str(path)
    return None


def library() -> Optional[ctypes.CDLL]:
    """The initialised library (FFI targets registered), or None (`unavailable_reason`)."""
    global _lib, _reason
    with _lock:
        if _lib is not None or _reason is not None:
            return _lib
        if jax.default_backend() != "cpu":
            _reason = f"the backend is {jax.default_backend()}, not cpu"
        elif platform.machine() not in ("x86_64", "AMD64"):
            _reason = f"oneMKL needs x86-64, this is {platform.machine()}"
        elif (mkl := _mkl_rt()) is None:
            _reason = "the `mkl` wheel (oneMKL's libmkl_rt) is not installed"
        else:
            try:
                lib = ctypes.CDLL(str(build(_SOURCE, ("-O2",), ("-ldl", "-lpthread"))))
            except (RuntimeError, OSError) as e:
                _reason = str(e)
                return None
            err = ctypes.create_string_buffer(512)
            if lib.jl_init(mkl.encode(), err, len(err)) != 0:
                _reason = f"opening {mkl}: {err.value.decode(errors='replace')}"
                return None
            lib.jl_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_int, ctypes.c_int]
            lib.jl_pack.restype = ctypes.c_int
            lib.jl_free.argtypes = [ctypes.c_int]
            lib.jl_bytes.argtypes = [ctypes.c_int]
            lib.jl_bytes.restype = ctypes.c_int64
            jax.ffi.register_ffi_target(PACKED_TARGET, jax.ffi.pycapsule(lib.JlPackedMatmul),
                                        platform="cpu")
            _lib = lib
        return _lib


def unavailable_reason() -> Optional[str]:
    """None when the oneMKL kernels run here, else why not (one line)."""
    library()
    return _reason
