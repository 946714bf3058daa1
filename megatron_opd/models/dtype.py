"""What `params_dtype: auto` means on this machine: bf16 on a GPU; on a CPU, bf16 only where its bf16 GEMMs
are measured faster than fp32 ones.

Why measured: the hosts we run on differ between sessions. With AMX a bf16 GEMM ran 6.4x faster than fp32 (2.1
vs 0.33 TFLOP/s on 2 cores); with avx512_bf16 about 2x; on an AVX2-only EPYC oneDNN emulates bf16 and it is
slower than fp32. The CPU flags say what the instructions are, not what torch's kernels make of them, so the
choice is a probe: a training-shaped GEMM in each dtype, timed here, once per process (~0.2 s). bf16 "auto"
means megatron's mixed precision for a trainable model: bf16 weights and compute, fp32 main weights, gradients
and Adam; every log-softmax, loss and behaviour log-prob stays fp32.

`MEGATRON_OPD_AUTO_DTYPE=float32|bfloat16` fixes the answer without a probe: runs that must not depend on the
host (the test suite, a comparison across machines) set it.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

logger = logging.getLogger("megatron_opd.dtype")

ENV = "MEGATRON_OPD_AUTO_DTYPE"
# bf16 must beat fp32 by this much to be picked: bf16 costs a weight copy (mixed precision) and precision
MIN_SPEEDUP = 1.3
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "avx_vnni_bf16", "avxneconvert")


@dataclass(frozen=True)
class AutoDtype:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).replace("torch.", "")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def gemm_gflops(dtype: torch.dtype, m: int = 512, k: int = 1024, n: int = 1024, repeats: int = 5) -> float:
    """GFLOP/s of an [m, k] x [k, n] GEMM in `dtype` on the CPU (best of `repeats`, after one warm-up)."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best / 1e9


def probe_cpu() -> AutoDtype:
    """bf16 when this CPU's bf16 GEMM runs >= MIN_SPEEDUP x its fp32 GEMM, else fp32; the reason names both."""
    have = sorted(cpu_flags() & set(BF16_FLAGS)) or ["no bf16 GEMM flags"]
    f32, b16 = gemm_gflops(torch.float32), gemm_gflops(torch.bfloat16)
    facts = f"bf16 GEMM {b16:.0f} vs fp32 {f32:.0f} GFLOP/s here ({b16 / f32:.2f}x; {', '.join(have)})"
    if b16 >= MIN_SPEEDUP * f32:
        return AutoDtype(torch.bfloat16, facts)
    return AutoDtype(torch.float32, f"{facts}: below the {MIN_SPEEDUP}x that pays for mixed precision")


_settled: list[AutoDtype] = []  # set by `settle_auto_dtype`: the pick every rank of a job shares


def settle_auto_dtype(share: Callable[[Any], Any], is_source: bool = True) -> AutoDtype:
    """Every rank of a job takes the source rank's pick: `share` returns the source's object on every rank
    (the trainer passes `models.parallel.broadcast_object` and rank 0 as the source, right after the process
    group starts). The probe is a timing: two ranks on one loaded host can measure either side of
    MIN_SPEEDUP, and ranks of one model in different dtypes do not train together. Settled anew for each
    job (a process may run several)."""
    _settled.clear()
    auto_dtype.cache_clear()
    pick = share(auto_dtype() if is_source else None)
    _settled[:] = [pick]
    auto_dtype.cache_clear()
    return pick


@functools.lru_cache(maxsize=None)
def auto_dtype() -> AutoDtype:
    """The dtype `auto` resolves to in this process (logged once, with why)."""
    if _settled:
        return _settled[0]
    forced = os.environ.get(ENV, "").strip()
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"{ENV}={forced!r}: must be float32 or bfloat16")
        pick = AutoDtype(getattr(torch, forced), f"{ENV}={forced}")
    elif torch.cuda.is_available():
        pick = AutoDtype(torch.bfloat16, "on a GPU")
    else:
        pick = probe_cpu()
    logger.info("dtype auto: %s (%s)", pick.name, pick.reason)
    return pick


def resolve_dtype(name: str) -> torch.dtype:
    """A config dtype name (`auto`, float32, bfloat16, float16) as a torch dtype."""
    if name == "auto":
        return auto_dtype().dtype
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"dtype: unknown {name!r} (auto, float32, bfloat16, float16)") from None


__all__ = ["AutoDtype", "auto_dtype", "cpu_flags", "gemm_gflops", "probe_cpu", "resolve_dtype", "settle_auto_dtype"]
