"""PPO clipped surrogate with asymmetric clip range and optional dual clip (as in verl).

Per token, with r = exp(logp - old_logp) and advantage A:
    l1 = -A * r
    l2 = -A * clamp(r, 1 - eps_low, 1 + eps_high)
    l  = max(l1, l2)
    dual clip (c > 1), only where A < 0:  l = min(l, -A * c)
The dual clip caps the loss of a negative-advantage token whose ratio exploded, which otherwise
dominates the batch gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_opd.algo._checks import acc, as_bool_mask, check_finite, check_float, check_shape, zero_padding
from megatron_opd.algo.aggregation import masked_mean


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor  # [B, T] per-token loss, 0 off-mask
    ratio: torch.Tensor  # [B, T] importance ratio (detached), 1 off-mask
    clipfrac: torch.Tensor  # scalar: fraction of mask tokens where the eps clip is active (l2 > l1)
    clipfrac_lower: torch.Tensor  # scalar: fraction of mask tokens where the dual clip is active
    approx_kl: torch.Tensor  # scalar: mean of (old_logp - logp) over the mask (k1 of old vs current)


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip_c: Optional[float] = None,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossOutput:
    """Per-token PPO loss on `mask` tokens; aggregate `.loss` with aggregation.aggregate_loss.

    The log-ratio is clamped to +-`log_ratio_clamp` before exp only to keep exp finite; the clamp
    is far outside any clip range, so the surrogate's value and gradient are unchanged where it matters.
    """
    mask = as_bool_mask("mask", mask)
    for name, x in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        check_shape(name, x, mask.shape)
        check_float(name, x)
        check_finite(name, x, mask)
    if not 0.0 <= clip_eps_low < 1.0:
        raise ValueError(f"clip_eps_low: must be in [0, 1), got {clip_eps_low}")
    if clip_eps_high < 0:
        raise ValueError(f"clip_eps_high: must be >= 0, got {clip_eps_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c: must be > 1, got {dual_clip_c}")
    adv = zero_padding(acc(advantages.detach()), mask)
    log_ratio = zero_padding(acc(logp) - acc(old_logp.detach()), mask)
    ratio = torch.exp(log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(l1, l2)
    clipfrac = masked_mean((l2 > l1).float(), mask)
    if dual_clip_c is not None:
        l3 = -adv * dual_clip_c
        dual_active = (adv < 0) & (loss > l3)
        loss = torch.where(adv < 0, torch.minimum(loss, l3), loss)
        clipfrac_lower = masked_mean(dual_active.float(), mask)
    else:
        clipfrac_lower = torch.zeros((), device=mask.device)
    return PolicyLossOutput(
        loss=zero_padding(loss, mask),
        ratio=torch.where(mask, ratio.detach(), torch.ones_like(ratio)),
        clipfrac=clipfrac.detach(),
        clipfrac_lower=clipfrac_lower.detach(),
        approx_kl=masked_mean(-log_ratio.detach(), mask),
    )


__all__ = ["PolicyLossOutput", "ppo_policy_loss"]
