"""A step's health and loss metrics, computed over the whole step's batch.

The health metrics (metrics/health.py: lengths, truncation, repetition, advantages on repetitive tokens,
log-probs) are rates and means whose weights are tokens or sequences. Each data-parallel rank holds a
slice, so a mean of per-rank values would weigh a rank with few tokens like one with many. Instead the
reporting ranks (last pipeline stage, tensor rank 0) send their rows' per-token tensors to every rank
and the metrics are computed once over the concatenated batch: the numbers a single rank holding the
whole step would report.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_opd.metrics.health import HealthConfig, rollout_health
from megatron_opd.trainer.batch import TrainBatch
from megatron_opd.trainer.logger import gpu_stats

_PER_TOKEN = ("old_logp", "teacher_logp", "ref_logp")


def _rows(batch: TrainBatch, measure_engine_gap: bool) -> dict[str, Any]:
    """This rank's rows as CPU tensors (what the step's metrics need)."""
    rows: dict[str, Any] = {"mask": batch.response_mask.cpu(), "ids": batch.response_ids.cpu(),
                            "truncated": batch.truncated.cpu(), "golden": batch.is_golden.cpu()}
    for k in _PER_TOKEN:
        if k in batch.extras:
            rows[k] = batch.extras[k].detach().float().cpu()
    if measure_engine_gap and batch.behaviour_logp is not None:
        rows["behaviour_logp"] = batch.behaviour_logp.detach().float().cpu()
    rows["teacher_id"] = batch.extras["teacher_id"].cpu() if "teacher_id" in batch.extras else \
        torch.zeros(batch.response_mask.shape[0], dtype=torch.long)
    return rows


def _concat(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Row-concatenate the ranks' rows, right-padding the token dimension to the longest."""
    T = max(p["mask"].shape[1] for p in parts)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return x if x.dim() == 1 or x.shape[1] == T else torch.nn.functional.pad(x, (0, T - x.shape[1]))

    keys = [k for k in parts[0] if all(k in p for p in parts)]
    return {k: torch.cat([pad(p[k]) for p in parts]) for k in keys}


def batch_metrics(rows: dict[str, Any], config: Optional[HealthConfig]) -> dict[str, float]:
    """Health metrics of the (global) rows, the loss-side inputs included when they are finite."""
    mask, golden = rows["mask"], rows["golden"]
    lps = {k: rows.get(k) for k in _PER_TOKEN}
    finite = all(v is None or bool(torch.isfinite(v[mask]).all()) for v in lps.values())
    adv = None
    if finite and lps["teacher_logp"] is not None and lps["old_logp"] is not None:
        adv = (lps["teacher_logp"] - lps["old_logp"]) * (~golden[:, None])
    if not finite:  # every rank skipped this step's update (train_minibatch); log what is still valid
        lps = {}
    out = rollout_health(mask, token_ids=rows["ids"], truncated=rows["truncated"], advantages=adv,
                         logp=lps.get("old_logp"), teacher_logp=lps.get("teacher_logp"), ref_logp=lps.get("ref_logp"),
                         is_golden=golden, config=config)
    out["health/nonfinite_logp"] = float(not finite)
    if "behaviour_logp" in rows and lps.get("old_logp") is not None:
        roll = mask & ~golden[:, None]
        if roll.any():
            diff = (rows["behaviour_logp"] - lps["old_logp"]).abs()[roll]
            out["rollout/engine_trainer_logp_absdiff"] = float(diff.mean())
            out["rollout/engine_trainer_logp_absdiff_max"] = float(diff.max())
    return out


def per_teacher(rows: dict[str, Any], names: list[str], config: Optional[HealthConfig]) -> dict[str, float]:
    """`<metric>/<teacher name>`: `batch_metrics` over the rows each teacher scored (its routed prompts'
    rollouts and golden rows), for every teacher with rows in the step."""
    out: dict[str, float] = {}
    tid = rows["teacher_id"]
    for k, name in enumerate(names):
        sel = (tid == k).nonzero().flatten()
        if sel.numel() == 0:
            continue
        sub = {key: v[sel] for key, v in rows.items()}
        out.update({f"{key}/{name}": v for key, v in batch_metrics(sub, config).items()})
    return out


def loss_metrics(train_stats: list[dict[str, float]]) -> dict[str, float]:
    """`loss/<name>`: the mean over the step's minibatch updates of each finite statistic."""
    out = {}
    for k in sorted({k for s in train_stats for k in s}):
        vals = [s[k] for s in train_stats if k in s and s[k] is not None and math.isfinite(s[k])]
        out[f"loss/{k}"] = sum(vals) / len(vals) if vals else float("nan")
    return out


def step_metrics(batch: TrainBatch, payload: dict[str, Any], train_stats: list[dict[str, float]], *,
                 reports: bool, rank: int, off_policy: bool, config: Optional[HealthConfig],
                 tokens: tuple[int, int] = (0, 0)) -> dict[str, float]:
    """Collective: the step's metrics on rank 0 (and the same numbers on every rank). `off_policy`: pi_old is
    the engine's own log-probs, so the engine-vs-trainer gap is not measured (it would read 0). `tokens`:
    this rank's (real, padded) tokens in its training micro-batches, for `batch/padding_fraction`."""
    mine = {"rows": _rows(batch, not off_policy), "loss": loss_metrics(train_stats), "tokens": tokens} if reports \
        else None
    gathered = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    reporters = [g for g in gathered if g]
    merged: dict[str, float] = {}
    if reporters:
        rows = _concat([g["rows"] for g in reporters])
        merged.update(batch_metrics(rows, config))
        if payload.get("teacher_names"):
            merged.update(per_teacher(rows, payload["teacher_names"], config))
        for k in sorted({k for g in reporters for k in g["loss"]}):  # whole-minibatch values on every rank
            vals = [g["loss"][k] for g in reporters if k in g["loss"] and math.isfinite(g["loss"][k])]
            merged[k] = sum(vals) / len(vals) if vals else float("nan")
        real, padded = (sum(g["tokens"][i] for g in reporters) for i in (0, 1))
        if padded:  # padded tokens / all tokens the training forwards ran (every epoch and minibatch)
            merged["batch/padding_fraction"] = 1.0 - real / padded
    if rank == 0:  # text-level metrics over the whole step (every rollout, all DP ranks)
        texts = payload["texts"]
        text_metrics = rollout_health(
            torch.ones((len(texts), 1), dtype=torch.bool), response_texts=texts,
            truncated=[it.truncated for it in payload["items"] if not it.is_golden][: len(texts)],
            config=config) if texts else {}
        for k in ("rollout/repetition_rate", "rollout/truncation_rate"):
            if k in text_metrics:
                merged[k] = text_metrics[k]
        rolls = [it for it in payload["items"] if not it.is_golden][: len(texts)]
        for name in payload.get("teacher_names") or []:
            mine = [j for j, it in enumerate(rolls) if it.teacher in (name, "")]
            if not mine:
                continue
            part = rollout_health(torch.ones((len(mine), 1), dtype=torch.bool), response_texts=[texts[j] for j in mine],
                                  truncated=[rolls[j].truncated for j in mine], config=config)
            for k in ("rollout/repetition_rate", "rollout/truncation_rate"):
                if k in part:
                    merged[f"{k}/{name}"] = part[k]
        for name, st in ((payload.get("teacher") or {}).get("cross") or {}).items():  # cross-tokenizer teachers
            suffix = f"/{name}" if payload.get("teacher_names") else ""
            for k in ("coverage", "student_tokens_per_chunk", "max_chunk_tokens"):
                merged[f"teacher/cross_{k}{suffix}"] = st[k]
        merged.update(gpu_stats())
    return merged


def sample_rows(payload: Optional[dict[str, Any]], k: int = 4) -> list[dict[str, Any]]:
    """The first `k` rollouts of a step as text rows for the run's sample log."""
    if not payload or not payload["texts"]:
        return []
    rolls = [it for it in payload["items"] if not it.is_golden]
    return [{"prompt": payload["prompt_texts"][i], "response": payload["texts"][i],
             "truncated": rolls[i].truncated, "length": len(rolls[i].response_ids)}
            for i in range(min(k, len(payload["texts"])))]
