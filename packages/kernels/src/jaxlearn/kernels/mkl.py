"""oneMKL behind XLA FFI calls: the one place that builds `csrc/mkl_gemm.cc`, opens oneMKL
from the `mkl` wheel and registers the FFI targets of `packed_gemm`, and that decides
which backend packs a weight on this host (`backend_for`).

oneMKL is opened with `dlopen` (nothing is imported), LP64, sequential: each call splits
its work into one block per thread of XLA's intra-op pool, and the calling thread claims
blocks too, so concurrent calls cannot deadlock.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Optional

from jaxlearn.kernels.native import NativeLibrary

__all__ = ["BACKENDS", "PACKED_INT8_TARGET", "PACKED_TARGET", "SGEMM_ADD_TARGET",
           "SGEMM_TARGET", "amx_runs",
           "backend_for", "host_has_bf16", "host_has_int8", "host_is_intel", "host_threads",
           "library", "unavailable_reason"]

_SOURCE = Path(__file__).parent / "csrc" / "mkl_gemm.cc"
PACKED_TARGET = "jaxlearn_packed_matmul"
PACKED_INT8_TARGET = "jaxlearn_packed_int8_matmul"
SGEMM_TARGET = "jaxlearn_sgemm"
SGEMM_ADD_TARGET = "jaxlearn_sgemm_add"
# Packed-GEMM backends: oneMKL's packed GEMMs, or the library's own AVX-512 BF16 / VNNI
# kernels (`csrc/avx512_gemm.h`, bf16 and int8 weights only).
BACKENDS = ("onemkl", "avx512")
_BACKEND_CODES = {"onemkl": 0, "avx512": 1}
_DTYPE_CODES = {"float32": 0, "bfloat16": 1, "int8": 2}


def host_has_bf16() -> bool:
    """Whether this CPU has native bf16 dot instructions (AVX512_BF16 or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def host_has_int8() -> bool:
    """Whether this CPU has int8 dot instructions the packed GEMM uses: AVX512_VNNI,
    AVX_VNNI or AMX-INT8 on an Intel CPU (oneMKL), AVX512_VNNI elsewhere (the AVX-512
    kernels, `backend_for`)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    if "GenuineIntel" not in flags:
        return " avx512_vnni" in flags and " avx512bw" in flags
    return any(f" {f}" in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def host_is_intel() -> bool:
    """Whether this CPU is Intel's (`vendor_id` GenuineIntel)."""
    try:
        return "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def backend_for(dtype: str, k: Optional[int] = None) -> str:
    """The backend that packs a weight of `dtype` ("float32", "bfloat16", "int8") with
    input dimension `k` (None: any) here.

    oneMKL on Intel CPUs, except where the CPU has AMX tiles for
    the dtype (`amx_runs`) and k fills whole tile steps (a multiple of 32 for bf16, 64 for
    int8; other weights would run the AVX-512 blocks, slower than oneMKL on Intel): oneMKL's
    packed bf16 GEMM does not use the tiles (430-670 GFLOP/s at 256-288 rows on a 2-vCPU
    Emerald Rapids Xeon, where the tile kernel reaches 700-1400; kernels README). On other
    x86 CPUs weights take the AVX-512 kernels (float32 where the CPU has AVX512F, else
    oneMKL), because oneMKL's GEMMs run a slow generic path there (measured on a 2-core AMD
    EPYC, Zen 4, AVX512_BF16 / VNNI: a SmolLM2-135M decode step with oneMKL's packed bf16
    68 ms at one row against 46 ms with XLA's bf16 dot, and int8 73 ms against 16 ms;
    oneMKL's packed f32 0.5-0.6x XLA's f32 dot at one row, the AVX-512 f32 panels 0.9-2x
    its speed at 1-16 rows, see the kernels README). `JAXLEARN_PACKED_GEMM=onemkl` or
    `=avx512` forces one (for comparisons); ValueError (one line) for another value."""
    forced = os.environ.get("JAXLEARN_PACKED_GEMM", "")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"JAXLEARN_PACKED_GEMM={forced!r}: must be one of "
                             f"{', '.join(BACKENDS)}")
        return forced
    if dtype == "float32":
        return "onemkl" if host_is_intel() or not avx512_runs(dtype) else "avx512"
    if host_is_intel():
        step = 64 if dtype == "int8" else 32
        tiles = amx_runs(dtype) and (k is None or k % step == 0)
        return "avx512" if tiles else "onemkl"
    return "avx512"


def avx512_runs(dtype: str) -> bool:
    """Whether the AVX-512 backend runs `dtype` weights on this CPU (float32: AVX512F,
    bfloat16: AVX512_BF16, int8: AVX512_VNNI; the library's own cpuid check)."""
    lib = library()
    return lib is not None and dtype in _DTYPE_CODES and bool(
        lib.jl_avx512_ok(_DTYPE_CODES[dtype]))


def amx_runs(dtype: str) -> bool:
    """Whether the avx512 backend's `dtype` ("bfloat16", "int8") matmuls run AMX tiles here
    (`csrc/amx_gemm.h`: a CPU with AMX-BF16 / AMX-INT8 whose kernel grants the tile state;
    weights whose k is a multiple of 32 / 64)."""
    lib = library()
    return lib is not None and dtype in ("bfloat16", "int8") and bool(
        lib.jl_amx_ok(_DTYPE_CODES[dtype]))


def host_threads() -> int:
    """The CPUs this process may run on: the number of blocks a call splits its work into."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def backend_code(backend: str) -> int:
    return _BACKEND_CODES[backend]


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
                            ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.jl_pack.restype = ctypes.c_int
    lib.jl_avx512_ok.argtypes = [ctypes.c_int]
    lib.jl_avx512_ok.restype = ctypes.c_int
    lib.jl_amx_ok.argtypes = [ctypes.c_int]
    lib.jl_amx_ok.restype = ctypes.c_int
    lib.jl_free.argtypes = [ctypes.c_int]
    lib.jl_bytes.argtypes = [ctypes.c_int]
    lib.jl_bytes.restype = ctypes.c_int64


_LIBRARY = NativeLibrary(_SOURCE, flags=("-O3", "-march=native"), libs=("-ldl", "-lpthread"),
                         targets={PACKED_TARGET: "JlPackedMatmul",
                                  PACKED_INT8_TARGET: "JlPackedInt8Matmul",
                                  SGEMM_TARGET: "JlSgemm", SGEMM_ADD_TARGET: "JlSgemmAdd"},
                         check=_check,
                         prepare=_prepare)


def library() -> Optional[ctypes.CDLL]:
    """The initialised library (FFI targets registered), or None (`unavailable_reason`)."""
    return _LIBRARY.get()


def unavailable_reason() -> Optional[str]:
    """None when the oneMKL kernels run here, else why not (one line)."""
    return _LIBRARY.unavailable_reason()
