"""Per-token OPD advantages: the reverse-KL reward A_t = log pi_teacher(y_t|.) - log pi_old(y_t|.).

Summed over the sampled tokens this is minus a Monte-Carlo estimate of KL(pi_old || pi_teacher), so
maximising it with a policy gradient is reverse-KL distillation. Golden (off-policy) samples carry no
advantage: their loss is the separate mixture-distillation term (golden.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_opd.algo._checks import acc, as_bool_mask, check_finite, check_float, check_shape, zero_padding


def rollout_token_mask(
    response_mask: torch.Tensor,
    is_golden: torch.Tensor,
    truncated: Optional[torch.Tensor] = None,
    *,
    mask_truncated: bool = False,
    eos_pos: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Bool [B, T]: on-policy tokens that take part in the policy loss.

    `eos_pos[b]` is the response index of sample b's EOS token (negative: no EOS); tokens after it are
    dropped even if `response_mask` still marks them. With `mask_truncated`, samples flagged
    `truncated` (no EOS within the budget) are dropped entirely.
    """
    mask = as_bool_mask("response_mask", response_mask)
    if mask.dim() != 2:
        raise ValueError(f"response_mask: expected shape [B, T], got {tuple(mask.shape)}")
    B, T = mask.shape
    gold = as_bool_mask("is_golden", is_golden)
    check_shape("is_golden", gold, (B,))
    keep = mask & ~gold[:, None]
    if eos_pos is not None:
        check_shape("eos_pos", eos_pos, (B,))
        if eos_pos.is_floating_point():
            raise ValueError(f"eos_pos: expected an integer tensor, got {eos_pos.dtype}")
        pos = torch.arange(T, device=mask.device)[None, :]
        last = torch.where(eos_pos < 0, torch.full_like(eos_pos, T - 1), eos_pos)
        keep = keep & (pos <= last[:, None])
    if mask_truncated:
        if truncated is None:
            raise ValueError("truncated: required when mask_truncated=True")
        trunc = as_bool_mask("truncated", truncated)
        check_shape("truncated", trunc, (B,))
        keep = keep & ~trunc[:, None]
    return keep


def discounted_reverse_cumsum(x: torch.Tensor, gamma: float, block: int = 128) -> torch.Tensor:
    """out[b, t] = sum_{k >= t} gamma^(k - t) * x[b, k], computed blockwise.

    A per-position Python loop would cost T steps; one [T, T] matrix would cost T^2 memory; blocks of
    `block` positions use a small Toeplitz matrix of gamma powers plus a carry between blocks.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"adv_gamma: must be in [0, 1], got {gamma}")
    B, T = x.shape
    out = torch.empty_like(x)
    idx = torch.arange(block, device=x.device, dtype=x.dtype)
    expo = idx[None, :] - idx[:, None]
    g = torch.tensor(gamma, dtype=x.dtype, device=x.device)
    tri = torch.where(expo >= 0, g.pow(expo.clamp(min=0)), torch.zeros((), dtype=x.dtype, device=x.device))
    carry = torch.zeros(B, dtype=x.dtype, device=x.device)
    end = T
    while end > 0:
        start = max(0, end - block)
        n = end - start
        ob = x[:, start:end] @ tri[:n, :n].T
        ob = ob + carry[:, None] * g.pow(n - idx[:n])
        out[:, start:end] = ob
        carry = ob[:, 0]
        end = start
    return out


@torch.no_grad()
def compute_advantages(
    teacher_logp: torch.Tensor,
    old_logp: torch.Tensor,
    response_mask: torch.Tensor,
    is_golden: torch.Tensor,
    truncated: Optional[torch.Tensor] = None,
    *,
    clip: Optional[float] = None,
    normalize: bool = False,
    gamma: Optional[float] = None,
    mask_truncated: bool = False,
    eos_pos: Optional[torch.Tensor] = None,
    eps: float = 1e-8,
    norm_stats: Optional[tuple[float, float, float]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (advantages [B, T] float32, detached; policy-token mask [B, T] bool).

    Order: A = teacher_logp - old_logp on policy tokens (0 elsewhere) -> clamp to [-clip, clip]
    (per-token, bounding single outlier log-ratios) -> discounted sum of future A with `gamma`
    -> whiten (subtract mean, divide by population std + eps over policy tokens) -> 0 off-mask.

    `norm_stats` = (sum, sum of squares, count) of the pre-whitening advantage over a larger token set
    (the whole minibatch on all data-parallel ranks, see `whitening_stats`): whitening then uses that
    set's mean and population std instead of this batch's, so splitting a minibatch into micro-batches
    or data-parallel shares does not change the advantages.
    """
    mask = rollout_token_mask(response_mask, is_golden, truncated, mask_truncated=mask_truncated, eos_pos=eos_pos)
    for name, x in (("teacher_logp", teacher_logp), ("old_logp", old_logp)):
        check_shape(name, x, mask.shape)
        check_float(name, x)
        check_finite(name, x, mask)
    adv = zero_padding(acc(teacher_logp.detach()) - acc(old_logp.detach()), mask)
    if clip is not None:
        if clip <= 0:
            raise ValueError(f"adv_clip: must be > 0, got {clip}")
        adv = adv.clamp(-clip, clip)
    if gamma is not None:
        adv = discounted_reverse_cumsum(adv, float(gamma))
        adv = zero_padding(adv, mask)
    if normalize:
        if norm_stats is not None:
            total, total_sq, count = (float(v) for v in norm_stats)
            count = max(count, 1.0)
            mean_f = total / count
            var_f = max(total_sq / count - mean_f * mean_f, 0.0)
            mean = torch.tensor(mean_f, dtype=adv.dtype, device=adv.device)
            var = torch.tensor(var_f, dtype=adv.dtype, device=adv.device)
        else:
            n = mask.sum().clamp(min=1)
            mean = adv.sum() / n
            var = zero_padding((adv - mean) ** 2, mask).sum() / n
        adv = (adv - mean) / (var.sqrt() + eps)
    return zero_padding(adv, mask), mask


def whitening_stats(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 [sum, sum of squares, count] of `adv` over `mask`: add these over micro-batches / ranks
    (e.g. all-reduce) and pass them as `compute_advantages(norm_stats=...)`."""
    a = adv.detach().double()[mask]
    return torch.stack([a.sum(), (a * a).sum(), torch.tensor(float(a.numel()), dtype=torch.float64)])


__all__ = ["compute_advantages", "discounted_reverse_cumsum", "rollout_token_mask", "whitening_stats"]
