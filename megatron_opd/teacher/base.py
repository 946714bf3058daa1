"""Teacher scoring contract: per-token log-probs of the student's tokens under the teacher.

Every backend returns one TeacherScore per (prompt, response) pair and passes it through
`validate_scores`, so a missing, misaligned or non-finite teacher log-prob is an error at the point
it appears, never a silent zero in the advantage A_t = logp_teacher - logp_old.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch


class TeacherScoreError(RuntimeError):
    """Teacher log-probs are missing, misaligned with the response, or not finite."""


@dataclass
class TeacherScore:
    """`logprobs[t]` = log pi_teacher(response[t] | prompt, response[:t]), float32 [T].
    With top-k requested: `topk_ids` (int64) / `topk_logprobs` (float32), both [T, K], sorted by
    decreasing log-prob (full-vocab log-softmax values, not renormalised over the K)."""

    logprobs: torch.Tensor
    topk_ids: Optional[torch.Tensor] = None
    topk_logprobs: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return int(self.logprobs.shape[0])


class Teacher(Protocol):
    eos_token_ids: list[int]

    def score(self, prompts: list[list[int]], responses: list[list[int]], top_k: int = 0) -> list[TeacherScore]:
        ...


def check_score_inputs(prompts: list[list[int]], responses: list[list[int]], vocab_size: Optional[int] = None,
                       top_k: int = 0) -> None:
    """Reject inputs every backend would mis-handle, naming the offending index."""
    if len(prompts) != len(responses):
        raise ValueError(f"teacher score: {len(prompts)} prompts but {len(responses)} responses")
    if top_k < 0:
        raise ValueError(f"teacher score: top_k must be >= 0, got {top_k}")
    if vocab_size is not None and top_k > vocab_size:
        raise ValueError(f"teacher score: top_k={top_k} exceeds the teacher vocab size {vocab_size}")
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) == 0:
            raise ValueError(f"teacher score: prompts[{i}] is empty (the first response token needs a prefix)")
        if vocab_size is not None:
            bad = [t for t in list(p) + list(r) if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"teacher score: sample {i} has token ids {bad[:5]} outside the teacher "
                                 f"vocab [0, {vocab_size})")


def validate_scores(scores: list[TeacherScore], responses: list[list[int]], top_k: int = 0,
                    source: str = "teacher") -> list[TeacherScore]:
    """Fail loudly on a wrong count, a length mismatch, a wrong top-k shape or a NaN/inf/positive log-prob."""
    if len(scores) != len(responses):
        raise TeacherScoreError(f"{source}: returned {len(scores)} scores for {len(responses)} responses")
    for i, (s, r) in enumerate(zip(scores, responses)):
        lp = s.logprobs
        if lp.dim() != 1 or lp.shape[0] != len(r):
            raise TeacherScoreError(f"{source}: sample {i}: {tuple(lp.shape)} log-probs for a response of "
                                    f"{len(r)} tokens")
        if not torch.isfinite(lp).all():
            j = int((~torch.isfinite(lp)).nonzero()[0, 0])
            raise TeacherScoreError(f"{source}: sample {i}: non-finite log-prob {lp[j].item()} at token {j}")
        if (lp > 1e-4).any():
            raise TeacherScoreError(f"{source}: sample {i}: log-prob > 0 ({lp.max().item()}); not a log-prob")
        if top_k > 0:
            if s.topk_ids is None or s.topk_logprobs is None:
                raise TeacherScoreError(f"{source}: sample {i}: top-{top_k} log-probs requested but missing")
            want = (len(r), top_k)
            if tuple(s.topk_ids.shape) != want or tuple(s.topk_logprobs.shape) != want:
                raise TeacherScoreError(f"{source}: sample {i}: top-k shapes {tuple(s.topk_ids.shape)} / "
                                        f"{tuple(s.topk_logprobs.shape)}, expected {want}")
            if not torch.isfinite(s.topk_logprobs).all():
                raise TeacherScoreError(f"{source}: sample {i}: non-finite top-k log-probs")
    return scores


def scores_from_logits(logits: torch.Tensor, targets: torch.Tensor, top_k: int,
                       id_limit: Optional[int] = None) -> TeacherScore:
    """logits [T, V] predicting targets [T] -> TeacherScore (float32 log-softmax over the full vocab);
    top-k candidates are ids below `id_limit` when given (see teacher/fidelity.py)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = TeacherScore(logprobs=lp.gather(-1, targets[:, None])[:, 0].contiguous())
    if top_k > 0:
        vals, ids = torch.topk(lp[:, :id_limit] if id_limit is not None else lp, top_k, dim=-1)
        out.topk_ids, out.topk_logprobs = ids, vals
    return out
