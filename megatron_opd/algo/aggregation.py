"""Loss aggregation: how per-token losses [B, T] become one scalar.

The choice decides how much a long sequence weighs against a short one, which the OPD paper ties to
length inflation, so every mode is written as explicit per-token weights (`aggregation_weights`) and
the scalar is simply `sum(weights * loss)`. For a sequence b with n_b valid tokens, B' sequences that
have at least one valid token, N = sum_b n_b and constant C:

- token_mean:           w_bt = 1 / N              -> a sequence weighs n_b / N (long sequences dominate)
- seq_mean_token_mean:  w_bt = 1 / (B' * n_b)     -> every sequence weighs 1 / B' (short ones' tokens count more)
- seq_sum_const:        w_bt = 1 / (B' * C)       -> per-token weight fixed by C, independent of the batch's
                                                     lengths (Dr.GRPO); C defaults to the padded length T.
"""

from __future__ import annotations

from typing import Literal, Optional, get_args

import torch

from megatron_opd.algo._checks import acc, as_bool_mask, check_shape, zero_padding

LossAggMode = Literal["token_mean", "seq_mean_token_mean", "seq_sum_const"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


def aggregation_weights(
    mask: torch.Tensor,
    mode: str,
    *,
    constant: Optional[float] = None,
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
) -> torch.Tensor:
    """Per-token weights [B, T] (float64, zero off-mask) such that the aggregate is sum(w * loss).

    `num_tokens` / `num_seqs` replace the local counts N and B' (e.g. global counts when a batch is
    split into micro-batches whose losses are summed). Zero counts are treated as 1 so an empty mask
    gives all-zero weights, never NaN.
    """
    mask = as_bool_mask("mask", mask)
    if mask.dim() != 2:
        raise ValueError(f"mask: expected shape [B, T], got {tuple(mask.shape)}")
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode: must be one of {list(LOSS_AGG_MODES)}, got {mode!r}")
    m = mask.double()  # exact counts; cast to the loss dtype by aggregate_loss
    tokens_per_seq = m.sum(-1)
    if num_seqs is None:
        num_seqs = float((tokens_per_seq > 0).sum())
    if mode == "token_mean":
        n = float(m.sum()) if num_tokens is None else float(num_tokens)
        return m / max(n, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = 1.0 / tokens_per_seq.clamp(min=1.0)
        return m * per_seq[:, None] / max(float(num_seqs), 1.0)
    c = float(mask.shape[-1]) if constant is None else float(constant)
    if c <= 0:
        raise ValueError(f"loss_agg_constant: must be > 0, got {c}")
    return m / (c * max(float(num_seqs), 1.0))


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    constant: Optional[float] = None,
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
) -> torch.Tensor:
    """Aggregate per-token `loss` [B, T] over `mask` with `mode` (see module doc).

    Off-mask entries are ignored even if NaN; the result keeps a grad path to `loss` when the mask is
    empty (it is then exactly 0).
    """
    mask = as_bool_mask("mask", mask)
    check_shape("loss", loss, mask.shape)
    w = aggregation_weights(mask, mode, constant=constant, num_tokens=num_tokens, num_seqs=num_seqs)
    loss = acc(loss)
    return (w.to(device=loss.device, dtype=loss.dtype) * zero_padding(loss, mask)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over `mask` (0 when the mask is empty); for logging statistics."""
    return zero_padding(acc(x), mask).sum() / mask.sum().clamp(min=1)


__all__ = ["LOSS_AGG_MODES", "LossAggMode", "aggregate_loss", "aggregation_weights", "masked_mean"]
