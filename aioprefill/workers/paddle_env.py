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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = [
    "configure_math_libraries",
    "cpu_has_avx512f",
    "is_amd_cpu",
    "keep_freed_memory",
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
