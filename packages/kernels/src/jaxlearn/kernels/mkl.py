"""oneMKL behind XLA FFI calls: the one place that builds `csrc/mkl_gemm.cc`, opens oneMKL
from the `mkl` wheel and registers the FFI targets of `packed_gemm`.

oneMKL is opened with `dlopen` (nothing is imported), LP64, sequential: each call splits
its work into one block per thread of XLA's intra-op pool, and the calling thread claims
blocks too, so concurrent calls cannot deadlock.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import platform
from pathlib import Path
from typing import Optional

from jaxlearn.kernels.native import NativeLibrary

__all__ = ["PACKED_INT8_TARGET", "PACKED_TARGET", "host_has_bf16", "host_has_int8", "library",
           "unavailable_reason"]

_SOURCE = Path(__file__).parent / "csrc" / "mkl_gemm.cc"
PACKED_TARGET = "jaxlearn_packed_matmul"
PACKED_INT8_TARGET = "jaxlearn_packed_int8_matmul"


def host_has_bf16() -> bool:
    """Whether this CPU has native bf16 dot instructions (AVX512_BF16 or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def host_has_int8() -> bool:
    """Whether this CPU has int8 dot instructions (AVX512_VNNI, AVX_VNNI or AMX-INT8)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f" {f}" in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


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


def _check() -> Optional[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"oneMKL needs x86-64, this is {platform.machine()}"
    if _mkl_rt() is None:
        return "the `mkl` wheel (oneMKL's libmkl_rt) is not installed"
    return None


def _prepare(lib: ctypes.CDLL) -> None:
    """Opens oneMKL in the library (LP64, sequential) and declares its C functions."""
    mkl = _mkl_rt()
    assert mkl is not None  # _check ran first.
    err = ctypes.create_string_buffer(512)
    if lib.jl_init(mkl.encode(), err, len(err)) != 0:
        raise RuntimeError(f"opening {mkl}: {err.value.decode(errors='replace')}")
    lib.jl_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                            ctypes.c_int, ctypes.c_void_p]
    lib.jl_pack.restype = ctypes.c_int
    lib.jl_free.argtypes = [ctypes.c_int]
    lib.jl_bytes.argtypes = [ctypes.c_int]
    lib.jl_bytes.restype = ctypes.c_int64


_LIBRARY = NativeLibrary(_SOURCE, flags=("-O3", "-march=native"), libs=("-ldl", "-lpthread"),
                         targets={PACKED_TARGET: "JlPackedMatmul",
                                  PACKED_INT8_TARGET: "JlPackedInt8Matmul"}, check=_check,
                         prepare=_prepare)


def library() -> Optional[ctypes.CDLL]:
    """The initialised library (FFI targets registered), or None (`unavailable_reason`)."""
    return _LIBRARY.get()


def unavailable_reason() -> Optional[str]:
    """None when the oneMKL kernels run here, else why not (one line)."""
    return _LIBRARY.unavailable_reason()
