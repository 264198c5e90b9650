"""Process-wide settings for a CPU worker's math, applied by `PaddleRunner`.

Two measured problems, on the 2-vCPU AMD EPYC build machine:

- Paddle's CPU wheel multiplies matrices with Intel MKL, which on AMD processors takes a
  generic code path unless `MKL_DEBUG_CPU_TYPE=5` asks for its AVX2 kernels: an fp32 GEMM ran
  2.2x faster with it (34 -> 77 GFLOPS). MKL reads the variable at its first call, so it is set
  before paddle is imported (a value already in the environment wins).
- Paddle's CPU allocator hands big tensors to glibc malloc, which serves anything over 128 KiB
  (a threshold that adapts up to 32 MiB) with a fresh mmap and unmaps it on free, so every
  activation of every op is page-faulted in again: an element-wise op on an 8 MiB tensor took
  4.4 ms instead of 0.4 ms. Raising the mmap and trim thresholds keeps freed memory in the heap
  for reuse; the cost is that the worker's resident memory stays at its high-water mark.

Which library a CPU worker multiplies with is `cpu_gemm()`: MKL (Paddle's own matmul) unless
`AIOPREFILL_CPU_GEMM` says `onednn` (oneDNN's sgemm, which the wheel also ships; see
`paddle.gemm`) or `auto` (oneDNN on an AMD CPU with AVX-512, MKL elsewhere). MKL stays the
default: on this project's Zen 4 build machine oneDNN was no faster per CPU-second on full
batches and 10-20% slower on a lone short request (docs/perf-ctranslate2.md).
`library_versions()` records both libraries' versions for benchmarks without importing paddle.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import importlib.util
import os
from pathlib import Path

__all__ = [
    "CPU_GEMM_ENV",
    "bf16_float32_gemm",
    "configure_math_libraries",
    "cpu_gemm",
    "cpu_has_avx512f",
    "is_amd_cpu",
    "keep_freed_memory",
    "library_versions",
    "onednn_library",
    "paddle_libs",
    "quiet_native_logs",
]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30


def is_amd_cpu() -> bool:
    """Whether /proc/cpuinfo names an AMD processor (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return "AuthenticAMD" in line
    except OSError:
        pass
    return False


def cpu_has_avx512f() -> bool:
    """Whether /proc/cpuinfo lists the avx512f flag (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512f" in line.split()
    except OSError:
        pass
    return False


def configure_math_libraries() -> None:
    """Select MKL's AVX2 kernels on AMD CPUs (unless the environment already decides)."""
    if "MKL_DEBUG_CPU_TYPE" not in os.environ and is_amd_cpu():
        os.environ["MKL_DEBUG_CPU_TYPE"] = "5"


def quiet_native_logs() -> None:
    """Keep Paddle's C++ INFO lines (glog: a tensor-parallel group's TCP store printing
    `tcp_store.cc ... create libuv server` and `Successfully connected` per rank) off the host's
    stderr: warnings and errors still print. glog reads the variable when paddle's library
    loads, so this runs before paddle is imported; a value already in the environment wins."""
    os.environ.setdefault("GLOG_minloglevel", "1")


def keep_freed_memory() -> bool:
    """Make glibc malloc serve blocks up to 1 GiB from its heap and keep up to 1 GiB freed;
    False where the C library is not glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) == 1
    return mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES) == 1 and ok


CPU_GEMM_ENV = "AIOPREFILL_CPU_GEMM"
_CPU_GEMMS = ("onednn", "mkl")


def cpu_gemm() -> str:
    """How a CPU worker multiplies matrices (`paddle.gemm`): `onednn` or `mkl` (Paddle's own
    matmul), from `AIOPREFILL_CPU_GEMM`; unset: `mkl`; `auto`: oneDNN on AMD CPUs with AVX-512,
    where MKL runs AVX2 kernels at best, MKL elsewhere (on Intel it has its own AVX-512
    kernels)."""
    name = os.environ.get(CPU_GEMM_ENV, "mkl").strip().lower() or "mkl"
    if name == "auto":
        return "onednn" if is_amd_cpu() and cpu_has_avx512f() else "mkl"
    if name not in _CPU_GEMMS:
        raise ValueError(
            f"{CPU_GEMM_ENV}={name!r}: expected auto or one of {', '.join(_CPU_GEMMS)}"
        )
    return name


def bf16_float32_gemm() -> str:
    """The library of a bfloat16 CPU worker's float32 products (the LM head; attention's run
    on oneDNN's sgemm anyway): `AIOPREFILL_CPU_GEMM` where it is set (`cpu_gemm`), else
    `onednn`, whose rows hold from 16 (MKL's from 56 on an AMD EPYC: a next-token batch's
    head ran 64 rows, ~46 of a lone 280-id forward's ~500 ms of CPU, 1 thread, Zen 4)."""
    return cpu_gemm() if os.environ.get(CPU_GEMM_ENV, "").strip() else "onednn"


def paddle_libs() -> Path | None:
    """The folder of native libraries in Paddle's wheel (found without importing paddle)."""
    spec = importlib.util.find_spec("paddle")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "libs"


@functools.cache
def onednn_library() -> ctypes.CDLL | None:
    """The oneDNN library Paddle's wheel ships (`libdnnl.so.3`), loaded once, or None where there
    is none. Load it after paddle (workers) or after libiomp5 (`library_versions`): its OpenMP
    calls then bind to the wheel's runtime, not to the libgomp it links."""
    libs = paddle_libs()
    if libs is None or not (libs / "libdnnl.so.3").exists():
        return None
    try:
        return ctypes.CDLL(str(libs / "libdnnl.so.3"))
    except OSError:
        return None


class _DnnlVersion(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_int),
        ("minor", ctypes.c_int),
        ("patch", ctypes.c_int),
        ("hash", ctypes.c_char_p),
        ("cpu_runtime", ctypes.c_uint),
        ("gpu_runtime", ctypes.c_uint),
    ]


def library_versions() -> dict[str, str]:
    """Which product path a CPU worker takes here and the libraries' versions (no paddle
    import: for benchmarks' records)."""
    out = {"cpu_gemm": cpu_gemm()}
    libs = paddle_libs()
    if libs is None:
        return out
    # first, as paddle loads it: oneDNN's OpenMP calls then bind to this runtime, not to the
    # libgomp it links (a second thread pool: measured 1.7x a forward's CPU time)
    with contextlib.suppress(OSError):
        ctypes.CDLL(str(libs / "libiomp5.so"), mode=ctypes.RTLD_GLOBAL)
    dnnl = onednn_library()
    with contextlib.suppress(AttributeError):
        if dnnl is not None:
            dnnl.dnnl_version.restype = ctypes.POINTER(_DnnlVersion)
            v = dnnl.dnnl_version().contents
            out["onednn"] = f"{v.major}.{v.minor}.{v.patch}"
    try:  # MKL needs its OpenMP runtime's symbols in the global scope (loaded above)
        mkl = ctypes.CDLL(str(libs / "libmklml_intel.so"))
        buf = ctypes.create_string_buffer(256)
        mkl.MKL_Get_Version_String(buf, len(buf))
        out["mkl"] = buf.value.decode(errors="replace").strip()
    except (OSError, AttributeError):
        pass
    out["mkl_debug_cpu_type"] = os.environ.get("MKL_DEBUG_CPU_TYPE", "")
    return out
