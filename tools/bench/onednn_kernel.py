"""bf16 small-M matmuls on XLA:CPU through oneDNN, as an XLA FFI custom call (a benchmark
form of `jl_gemv.py`, not part of the library).

XLA:CPU streams a bf16 weight through a dot with few rows (decode: one row per sequence)
at a fraction of the rate it reads an f32 one (`jl_gemv.py`). oneDNN's matmul primitive
(the library PyTorch runs its CPU bf16 matmuls on) reads the same weights 1.3-2x faster
in isolation (`jl_gemv.py` forms `dnn_nn` / `dnn_nt`). `bf16_matmul` calls it from a
jitted program: `onednn_matmul.cc`, compiled on first use against jaxlib's FFI headers
and the `onednn-cpu-gomp` / `onednn-devel-cpu-gomp` wheels, cached by the digest of
everything that goes into it, and registered as the CPU target `jaxlearn_onednn_matmul`.

It is not in the library: in a whole decode step (~60M Llama, 2-vCPU AVX-512-BF16 host,
results/decode_ab.jsonl) the layers routed to it ran at 0.85-0.90x of XLA's own dots at
batch 1 / 4 / 16 (the custom call is a fusion barrier and its OpenMP threads compete with
XLA's pool). Where the library, the headers or a C++ compiler is missing,
`unavailable_reason()` says why. Environment: `JAXLEARN_KERNEL_CACHE` (where the built
library goes; default `$XDG_CACHE_HOME/jaxlearn/kernels`, else `~/.cache/jaxlearn/kernels`),
`CXX` (the compiler; default `g++`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp

__all__ = ["bf16_matmul", "unavailable_reason"]

TARGET = "jaxlearn_onednn_matmul"
_SOURCE = pathlib.Path(__file__).with_name("onednn_matmul.cc")
_LIB_DIST, _DEVEL_DIST = "onednn-cpu-gomp", "onednn-devel-cpu-gomp"


def _dist_file(dist: str, suffix: str) -> pathlib.Path:
    """The installed file of `dist` whose path ends in `suffix` (RECORD paths of a wheel's
    data files are relative to site-packages: `../../libdnnl.so.3`)."""
    for f in importlib.metadata.distribution(dist).files or ():
        if ("/" + str(f)).endswith("/" + suffix):
            return pathlib.Path(str(f.locate())).resolve()
    raise FileNotFoundError(f"{dist} has no installed file ending in {suffix}")


def _cache_dir() -> pathlib.Path:
    if os.environ.get("JAXLEARN_KERNEL_CACHE"):
        return pathlib.Path(os.environ["JAXLEARN_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or (
        os.path.join(os.environ["HOME"], ".cache") if os.environ.get("HOME") else None)
    if base is None:
        return pathlib.Path(tempfile.gettempdir()) / f"jaxlearn-kernels-{os.getuid()}"
    return pathlib.Path(base) / "jaxlearn" / "kernels"


def _build() -> pathlib.Path:
    """Compiles onednn_matmul.cc (once per distinct input) and returns the library's path."""
    lib = _dist_file(_LIB_DIST, "libdnnl.so.3")
    include = _dist_file(_DEVEL_DIST, "include/oneapi/dnnl/dnnl.hpp").parents[2]
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise FileNotFoundError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC",
           "-I", jax.ffi.include_dir(), "-I", str(include), str(_SOURCE),
           "-L", str(lib.parent), "-l:libdnnl.so.3", f"-Wl,-rpath,{lib.parent}"]
    compiler = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join([
        _SOURCE.read_text(), " ".join(cmd), compiler, jax.__version__,
        importlib.metadata.version(_LIB_DIST), importlib.metadata.version(_DEVEL_DIST),
    ]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"onednn_matmul-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name, dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE.name} failed ({cxx}): {done.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent first uses each build, one file wins
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def unavailable_reason() -> Optional[str]:
    """None once the oneDNN target is built and registered, else why it is not."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"the {_LIB_DIST} wheel is for x86_64 Linux, not {platform.machine()}"
    try:
        path = _build()
        library = ctypes.CDLL(str(path))
        capsule = jax.ffi.pycapsule(library.JaxlearnOnednnMatmul)
        jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError,
            importlib.metadata.PackageNotFoundError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def bf16_matmul(x: jax.Array, w: jax.Array, *, w_transposed: bool = False) -> jax.Array:
    """x [..., in] bf16 times w bf16 -> [..., out] f32 (f32 accumulation): w stored
    [in, out], or [out, in] with `w_transposed` (a tied embedding table as the head).
    On CPU the oneDNN call; lowered for any other platform, the same XLA dot `matmul`
    runs. Not differentiable."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"bf16_matmul: oneDNN target unavailable: {reason}")
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0] if w_transposed else w.shape[1]
    x2 = x.reshape(-1, k)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                            vmap_method="sequential")

    def xla(x2: jax.Array, w: jax.Array) -> jax.Array:
        dims = (((1,), (1 if w_transposed else 0,)), ((), ()))
        return jax.lax.dot_general(x2, w, dims, preferred_element_type=jnp.float32)

    y = jax.lax.platform_dependent(
        x2, w, cpu=lambda x2, w: call(x2, w, w_transposed=w_transposed), default=xla)
    return y.reshape(*lead, n)
