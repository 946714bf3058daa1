"""Mixture distillation on golden samples (reference solutions placed in the same minibatch).

Golden tokens are off-policy: there is no sampled-token advantage for them. Two per-token losses:

- "sft" (default): NLL, l_t = -log pi_theta(y_t | prefix).
- "fkl_topk": forward KL to the teacher restricted to the teacher's top-k ids S_t at the golden prefix,
  both distributions renormalised over S_t:
      q_k = exp(tl_k - logsumexp_{j in S_t} tl_j)           (teacher, from teacher_topk_logp)
      s_k = sl_k - logsumexp_{j in S_t} sl_j                (student, log, renormalised)
      l_t = sum_{k in S_t} q_k * (log q_k - s_k)
  `sl` may be the student's log-probs or raw logits at those ids: the renormalisation cancels the
  full-vocab normaliser, so the loss (and its gradient) only involve the k logits. Consequence:
  it pulls the student's *shape* over S_t toward the teacher's and does not push down mass outside S_t.
"""

from __future__ import annotations

import torch

from megatron_opd.algo._checks import acc, check_shape


def sft_nll(logp: torch.Tensor) -> torch.Tensor:
    """Per-token NLL of the golden tokens: -logp."""
    return -acc(logp)


def forward_kl_topk(teacher_topk_logp: torch.Tensor, student_topk_logp: torch.Tensor) -> torch.Tensor:
    """Per-token forward KL over the teacher's top-k ids, both sides renormalised: [..., K] -> [...]."""
    check_shape("student_topk_logp", student_topk_logp, teacher_topk_logp.shape)
    tl = acc(teacher_topk_logp.detach())
    log_q = tl - torch.logsumexp(tl, dim=-1, keepdim=True)
    sl = acc(student_topk_logp)
    log_s = sl - torch.logsumexp(sl, dim=-1, keepdim=True)
    return (log_q.exp() * (log_q - log_s)).sum(dim=-1)


def gather_at_ids(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """values [..., V] at ids [..., K] -> [..., K] (e.g. student logits at the teacher's top-k ids).

    Rejects out-of-range and repeated ids, since a repeated id would be counted twice in the KL.
    """
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"teacher_topk_ids: expected an integer tensor, got {ids.dtype}")
    if ids.shape[:-1] != values.shape[:-1]:
        raise ValueError(f"teacher_topk_ids: leading shape {tuple(ids.shape[:-1])} != values' {tuple(values.shape[:-1])}")
    V = values.shape[-1]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"teacher_topk_ids: ids must be in [0, {V}), got range [{int(ids.min())}, {int(ids.max())}]")
    srt = ids.sort(dim=-1).values
    if ids.shape[-1] > 1 and bool((srt[..., 1:] == srt[..., :-1]).any()):
        raise ValueError("teacher_topk_ids: repeated id within one position's top-k")
    return torch.gather(values, -1, ids.long())


__all__ = ["forward_kl_topk", "gather_at_ids", "sft_nll"]
