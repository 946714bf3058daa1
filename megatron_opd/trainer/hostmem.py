"""Host memory the allocator keeps after the program freed it: handed back to the OS at phase ends.

Why: glibc's malloc raises its mmap threshold (up to 32 MB) each time a large mmapped block is freed, so after
the first few phases most tensors below 32 MB (every layer weight of a 0.5B model, activation chunks) come
from the heap, and a freed heap block is kept by the process. Measured on the Qwen2.5 pair
(benchmarks/bench_step.py --pair qwen): 3.2 GB kept after startup (the HF checkpoints read and cast), ~1 GB
after each training phase. That memory is still RSS, which is what a node's OOM killer and a Slurm memory
limit count. `malloc_trim(0)` returns it (tens of ms at each phase end); the step's peak is what its own
phase allocates on top of the live tensors, not what earlier phases left behind.

Also what a step reports about the host: RSS now and the process's peak (`mem/*` metrics).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Optional


@functools.lru_cache(maxsize=None)
def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None  # glibc only (not musl, macOS)


def release_freed_memory() -> bool:
    """Hand the heap memory freed so far back to the OS; False where the C library has no malloc_trim."""
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True


def proc_status_kb(key: str) -> Optional[int]:
    """A `/proc/self/status` field in kB (VmRSS, VmHWM, ...); None where /proc is not readable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def host_memory_gb() -> dict[str, float]:
    """`mem/rss_gb` (resident now) and `mem/peak_rss_gb` (the process's high-water mark), where /proc has them."""
    out = {}
    for key, name in (("VmRSS", "mem/rss_gb"), ("VmHWM", "mem/peak_rss_gb")):
        kb = proc_status_kb(key)
        if kb is not None:
            out[name] = kb / 2**20
    return out


__all__ = ["host_memory_gb", "proc_status_kb", "release_freed_memory"]
