"""The Stable-OPD loss: PPO on the reverse-KL advantage + beta_kl * KL(pi_theta || pi_ref) + lambda_gold * golden loss.

    total = agg(pg_t over policy tokens)
          + beta_kl     * agg(kl_t over rollout tokens)
          + lambda_gold * agg(golden_t over golden tokens)

with `agg` = cfg.loss_agg_mode applied to each term over its own token set. Policy tokens are rollout
tokens minus truncated samples when `mask_truncated`; the KL term covers every rollout token (a
truncated, length-inflated sample is exactly where the anchor to the reference should act).
Formulas: docs/algorithm.md.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from megatron_opd.algo._checks import acc, as_bool_mask, check_finite, check_float, check_shape, zero_padding
from megatron_opd.algo.advantages import compute_advantages, rollout_token_mask
from megatron_opd.algo.aggregation import aggregate_loss, masked_mean
from megatron_opd.algo.golden import forward_kl_topk, sft_nll
from megatron_opd.algo.policy_loss import ppo_policy_loss
from megatron_opd.algo.ref_kl import Reduce, full_kl, kl_estimator
from megatron_opd.config import AlgoConfig


def _kl_per_token(
    cfg: AlgoConfig,
    logp: torch.Tensor,
    response_mask: torch.Tensor,
    kl_mask: torch.Tensor,
    ref_logp: Optional[torch.Tensor],
    student_logits: Optional[torch.Tensor],
    ref_logits: Optional[torch.Tensor],
    reduce: Optional[Reduce],
) -> torch.Tensor:
    if cfg.kl_estimator == "full":
        if student_logits is None or ref_logits is None:
            raise ValueError("student_logits/ref_logits: required for kl_estimator='full' (logits of the N valid response tokens)")
        n_valid = int(response_mask.sum())
        if student_logits.dim() != 2 or student_logits.shape[0] != n_valid:
            raise ValueError(
                f"student_logits: expected [N, V_local] with N = response_mask.sum() = {n_valid} "
                f"(valid tokens in row-major order), got {tuple(student_logits.shape)}"
            )
        rows = full_kl(student_logits, ref_logits, chunk_size=cfg.kl_chunk_size, reduce=reduce,
                       row_mask=kl_mask[response_mask])
        return torch.zeros(response_mask.shape, dtype=rows.dtype, device=rows.device).masked_scatter(response_mask, rows)
    if ref_logp is None:
        raise ValueError(f"ref_logp: required for kl_estimator={cfg.kl_estimator!r}")
    check_shape("ref_logp", ref_logp, response_mask.shape)
    check_float("ref_logp", ref_logp)
    check_finite("ref_logp", ref_logp, kl_mask)
    return kl_estimator(zero_padding(logp, kl_mask), zero_padding(ref_logp, kl_mask), cfg.kl_estimator, clamp=cfg.kl_clamp)


def _golden_per_token(
    cfg: AlgoConfig,
    logp: torch.Tensor,
    gold_mask: torch.Tensor,
    teacher_topk_logp: Optional[torch.Tensor],
    student_topk_logp: Optional[torch.Tensor],
) -> torch.Tensor:
    if cfg.golden_loss == "sft":
        return sft_nll(zero_padding(logp, gold_mask))
    if cfg.golden_loss != "fkl_topk":
        raise ValueError(f"golden_loss: must be 'sft' or 'fkl_topk', got {cfg.golden_loss!r}")
    if teacher_topk_logp is None or student_topk_logp is None:
        raise ValueError("teacher_topk_logp/student_topk_logp: required for golden_loss='fkl_topk'")
    B, T = gold_mask.shape
    if teacher_topk_logp.dim() != 3 or tuple(teacher_topk_logp.shape[:2]) != (B, T):
        raise ValueError(f"teacher_topk_logp: expected [B, T, K] = [{B}, {T}, K], got {tuple(teacher_topk_logp.shape)}")
    check_shape("student_topk_logp", student_topk_logp, teacher_topk_logp.shape)
    check_finite("teacher_topk_logp", teacher_topk_logp, gold_mask)
    check_finite("student_topk_logp", student_topk_logp, gold_mask)
    m = gold_mask[..., None]
    return forward_kl_topk(zero_padding(teacher_topk_logp, m), zero_padding(student_topk_logp, m))


def term_masks(cfg: AlgoConfig, response_mask: torch.Tensor, is_golden: torch.Tensor, truncated: torch.Tensor,
               eos_pos: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """The token sets of the three terms (keys of `stable_opd_loss`'s `global_counts`)."""
    mask = as_bool_mask("response_mask", response_mask)
    gold = as_bool_mask("is_golden", is_golden)
    trunc = as_bool_mask("truncated", truncated)
    return {"pg": rollout_token_mask(mask, gold, trunc, mask_truncated=cfg.mask_truncated, eos_pos=eos_pos),
            "rollout": rollout_token_mask(mask, gold, trunc, mask_truncated=False, eos_pos=eos_pos),
            "golden": mask & gold[:, None]}


def stable_opd_loss(
    cfg: AlgoConfig,
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    response_mask: torch.Tensor,
    is_golden: torch.Tensor,
    truncated: torch.Tensor,
    ref_logp: Optional[torch.Tensor] = None,
    student_logits: Optional[torch.Tensor] = None,
    ref_logits: Optional[torch.Tensor] = None,
    teacher_topk_logp: Optional[torch.Tensor] = None,
    student_topk_logp: Optional[torch.Tensor] = None,
    eos_pos: Optional[torch.Tensor] = None,
    reduce: Optional[Reduce] = None,
    global_counts: Optional[Mapping[str, tuple[float, float]]] = None,
    adv_stats: Optional[tuple[float, float, float]] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (total loss scalar with grad, float terms for logging).

    Tensors are padded [B, T] over response positions (docs/design.md). Values at positions a term
    does not use (padding; teacher/old log-probs on golden samples) are ignored, NaN included.
    `student_logits`/`ref_logits` [N, V_local]: logits of the N = response_mask.sum() valid tokens in
    row-major order (only for kl_estimator='full'); `reduce` combines vocab shards. The KL term is
    computed for logging (without grad) when beta_kl == 0 but its inputs are given; the "kl" key is
    absent when it was not computed at all.
    `global_counts` {"pg" | "rollout" | "golden": (num_tokens, num_seqs)} replaces a term's local
    counts in its normaliser: when a batch is split over data-parallel ranks, each rank's loss is then
    its exact share of the whole-batch loss (see `term_masks`).
    `adv_stats` (sum, sum of squares, count) of the pre-whitening advantage over the whole minibatch
    on all data-parallel ranks: with adv_normalize, whitening uses them instead of this batch's own.
    """
    if not isinstance(cfg, AlgoConfig):
        raise ValueError(f"cfg: expected an AlgoConfig, got {type(cfg).__name__}")
    mask = as_bool_mask("response_mask", response_mask)
    if mask.dim() != 2:
        raise ValueError(f"response_mask: expected shape [B, T], got {tuple(mask.shape)}")
    B, T = mask.shape
    gold = as_bool_mask("is_golden", is_golden)
    check_shape("is_golden", gold, (B,))
    trunc = as_bool_mask("truncated", truncated)
    check_shape("truncated", trunc, (B,))
    for name, x in (("logp", logp), ("old_logp", old_logp), ("teacher_logp", teacher_logp)):
        check_shape(name, x, (B, T))
        check_float(name, x)
    check_finite("logp", logp, mask)

    sets = term_masks(cfg, mask, gold, trunc, eos_pos)  # the same sets the trainer counts for global_counts
    rollout_mask, gold_mask = sets["rollout"], sets["golden"]
    adv, pg_mask = compute_advantages(
        teacher_logp, old_logp, mask, gold, trunc, clip=cfg.adv_clip, normalize=cfg.adv_normalize,
        gamma=cfg.adv_gamma, mask_truncated=cfg.mask_truncated, eos_pos=eos_pos, norm_stats=adv_stats,
    )
    agg = dict(mode=cfg.loss_agg_mode, constant=cfg.loss_agg_constant)
    counts = dict(global_counts or {})

    def term(name: str) -> dict:
        if name not in counts:
            return agg
        num_tokens, num_seqs = counts[name]
        return {**agg, "num_tokens": num_tokens, "num_seqs": num_seqs}

    pg = ppo_policy_loss(zero_padding(logp, pg_mask), zero_padding(old_logp, pg_mask), adv, pg_mask,
                         clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high, dual_clip_c=cfg.dual_clip_c)
    pg_loss = aggregate_loss(pg.loss, pg_mask, **term("pg"))
    # Anchor the graph to logp so an all-empty batch still yields a 0 loss with a (zero) gradient path.
    total = pg_loss + 0.0 * zero_padding(acc(logp), mask).sum()

    kl_value: Optional[torch.Tensor] = None
    have_kl_inputs = (ref_logp is not None) if cfg.kl_estimator != "full" else (student_logits is not None and ref_logits is not None)
    if cfg.beta_kl > 0 or have_kl_inputs:
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.beta_kl > 0):
            kl_tok = _kl_per_token(cfg, logp, mask, rollout_mask, ref_logp, student_logits, ref_logits, reduce)
            kl_value = aggregate_loss(kl_tok, rollout_mask, **term("rollout"))
        if cfg.beta_kl > 0:
            total = total + cfg.beta_kl * kl_value

    golden_value: Optional[torch.Tensor] = None
    if cfg.lambda_gold > 0 and bool(gold_mask.any()):
        golden_value = aggregate_loss(_golden_per_token(cfg, logp, gold_mask, teacher_topk_logp, student_topk_logp),
                                      gold_mask, **term("golden"))
        total = total + cfg.lambda_gold * golden_value

    raw_adv = zero_padding(acc(teacher_logp.detach()) - acc(old_logp.detach()), pg_mask)
    adv_mean = masked_mean(adv, pg_mask)
    stats = {
        "total_loss": float(total.detach()),
        "pg_loss": float(pg_loss.detach()),
        "golden_loss": float(golden_value.detach()) if golden_value is not None else 0.0,
        "clipfrac": float(pg.clipfrac),
        "clipfrac_lower": float(pg.clipfrac_lower),
        "ratio_mean": float(masked_mean(pg.ratio, pg_mask)),
        "ratio_max": float(pg.ratio[pg_mask].max()) if bool(pg_mask.any()) else 1.0,
        "approx_kl_old": float(pg.approx_kl),
        "adv_mean": float(adv_mean),
        "adv_std": float(masked_mean((adv - adv_mean) ** 2, pg_mask).sqrt()),
        "adv_raw_mean": float(masked_mean(raw_adv, pg_mask)),
        "n_pg_tokens": float(pg_mask.sum()),
        "n_rollout_tokens": float(rollout_mask.sum()),
        "n_golden_tokens": float(gold_mask.sum()),
    }
    if kl_value is not None:
        stats["kl"] = float(kl_value.detach())
    return total, stats


__all__ = ["stable_opd_loss", "term_masks"]
