"""Input validation shared by the objective's pieces.

Every check raises ValueError naming the offending tensor, because a silent broadcast or a NaN that
reaches the optimizer is far more expensive to debug than a failed step.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def all_finite(t: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """No NaN/inf in `t`, without whole-size temporaries (isfinite of a whole tensor builds an fp32 abs and
    three bool masks of its size: ~200 MB for a 49k x 576 embedding gradient). NaN/inf anywhere makes the
    sum non-finite, so a finite sum settles it in one reduction; otherwise the exact check walks slices
    (a finite tensor whose sum overflows is not rejected)."""
    if bool(torch.isfinite(t.sum())):
        return True
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def as_bool_mask(name: str, x: torch.Tensor) -> torch.Tensor:
    """Return `x` as a bool tensor; integer/float masks must hold only 0/1."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.bool:
        return x
    if x.is_floating_point() or x.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        if x.numel() and not bool(((x == 0) | (x == 1)).all()):
            raise ValueError(f"{name}: a mask must hold only 0/1 (or be bool)")
        return x != 0
    raise ValueError(f"{name}: unsupported mask dtype {x.dtype}")


def check_shape(name: str, x: torch.Tensor, shape: Sequence[int]) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")


def check_float(name: str, x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")


def check_finite(name: str, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
    """Reject NaN/inf where `mask` is True (everywhere when mask is None); padding may hold anything."""
    bad = ~torch.isfinite(x.detach())
    if mask is not None:
        while mask.dim() < bad.dim():
            mask = mask.unsqueeze(-1)
        bad = bad & mask
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        n = int(bad.sum())
        raise ValueError(f"{name}: {n} non-finite value(s) (NaN/inf) at valid positions, first at index {first}")


def zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` with masked-out entries replaced by 0 via where (so NaN padding cannot leak into sums or grads)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def acc(x: torch.Tensor) -> torch.Tensor:
    """At least float32 for loss arithmetic (bf16/fp16 upcast); float64 stays float64 for exact tests."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
