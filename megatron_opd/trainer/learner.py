"""The learning stage of a step: pi_old, minibatches, micro-batches, the loss closure, the optimizer step.

Each rank trains its data-parallel slice of the step. Every loss term is normalised by counts over the
whole minibatch (all data-parallel ranks, all micro-batches), so micro-batch and data-parallel shares add
up to the minibatch loss whatever train.micro_batch_size and the data-parallel size are.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_opd.algo.advantages import compute_advantages, whitening_stats
from megatron_opd.algo.objective import stable_opd_loss, term_masks
from megatron_opd.config import Config
from megatron_opd.models.parallel import host_group
from megatron_opd.trainer.batch import TrainBatch, plan_micro_batches, row_lengths
from megatron_opd.trainer.mixture import spread_rows
from megatron_opd.trainer.policy import MegatronPolicy


class Learner:
    def __init__(self, cfg: Config, student: MegatronPolicy, *, dp_size: int, is_last_stage: bool):
        self.cfg, self.student, self.dp_size, self.is_last_stage = cfg, student, dp_size, is_last_stage
        self._derived: dict[str, torch.Tensor] = {}
        self.tokens = (0, 0)  # (real, padded) tokens of the last update's training micro-batches

    # -- pi_old ------------------------------------------------------------------------------------

    def reuse_old_logp(self, batch_size: int) -> bool:
        """pi_old = the training forward's detached log-probs, instead of a separate scoring pass, when
        the step makes exactly one update (ppo_epochs=1, one minibatch): the policy that forward runs is
        the one that generated the rollouts' weights, so the importance ratio is exactly 1 either way.
        Not with adv_normalize (its whitening statistics need every pi_old before the first loss) nor
        with dropout (a training forward would differ from a scoring one). train.reuse_old_logp=false
        always scores pi_old separately."""
        algo = self.cfg.algo
        return (self.cfg.train.reuse_old_logp and algo.ppo_epochs == 1 and min(algo.num_minibatches, batch_size) == 1
                and not algo.adv_normalize and self.student.dropout_free)

    @staticmethod
    def off_policy_old_logp(batch: TrainBatch) -> torch.Tensor:
        """pi_old for rollouts the engine generated with older weights than the trainer's (rollout.overlap):
        the engine's behaviour log-probs, so the importance ratio pi_theta / pi_old and the advantage
        log pi_teacher - log pi_old refer to the policy that sampled the tokens."""
        if batch.behaviour_logp is None:
            raise RuntimeError("rollout.overlap: the rollout engine returned no log-probs for the off-policy "
                               "rollouts; the importance ratio needs the behaviour policy's log-probs")
        return batch.behaviour_logp.masked_fill(batch.is_golden[:, None], 0.0)

    def old_logp(self, batch: TrainBatch, off_policy: bool, full_kl_ref: bool) -> Optional[torch.Tensor]:
        """Collective: pi_old of the batch -- the behaviour log-probs off-policy, None when the training
        forward provides it (`reuse_old_logp`), else a scoring pass. Sets up the per-token tensors the loss
        closures fill in themselves (NaN until written: a skipped update leaves them non-finite)."""
        reuse = not off_policy and self.reuse_old_logp(batch.batch_size)
        self._derived = {k: torch.zeros(batch.response_mask.shape).masked_fill(batch.response_mask, float("nan"))
                         for k, on in (("old_logp", reuse), ("ref_logp", full_kl_ref)) if on}
        if off_policy:
            return self.off_policy_old_logp(batch)
        train = self.cfg.train
        return None if reuse else self.student.score(batch, micro_batch_size=train.micro_batch_size,
                                                     max_tokens=train.max_tokens_per_microbatch,
                                                     pack=train.pack_sequences)[0]

    def set_old_logp(self, batch: TrainBatch, old_logp: Optional[torch.Tensor]) -> None:
        """pi_old into the batch; stages before the last only run the model body (the loss lives on the
        last stage), so they get zeros of the right shape."""
        if not self.is_last_stage:
            batch.extras["old_logp"] = torch.zeros(batch.response_mask.shape)
            batch.extras.setdefault("teacher_logp", torch.zeros(batch.response_mask.shape))
        elif old_logp is not None:
            batch.extras["old_logp"] = old_logp

    # -- the update --------------------------------------------------------------------------------

    def minibatches(self, batch: TrainBatch) -> list[list[int]]:
        """algo.num_minibatches row groups of this rank's batch, each with its share of golden rows."""
        n_mb = min(self.cfg.algo.num_minibatches, batch.batch_size)
        return spread_rows(list(range(batch.batch_size)), batch.is_golden.tolist(), n_mb)

    def update(self, batch: TrainBatch, beta_kl: float, ref: Optional[MegatronPolicy]) -> list[dict[str, float]]:
        """Collective: algo.ppo_epochs passes over the minibatches, one optimizer step each; returns the
        per-minibatch loss statistics. The full KL recomputes the reference logits in every epoch."""
        full_kl = beta_kl > 0 and self.cfg.algo.kl_estimator == "full"
        stats: list[dict[str, float]] = []
        lengths, real, padded = row_lengths(batch), 0, 0
        for _epoch in range(self.cfg.algo.ppo_epochs):
            for rows in self.minibatches(batch):
                micro = self.micro_batches(batch, rows)
                real += sum(lengths[r] for r in rows)
                padded += sum(m.tokens.numel() for m in micro)
                loss_fn, want_logits = self.loss_fn(batch.select(rows), beta_kl, len(micro))
                source = self.ref_logits_source(ref, micro) if full_kl else None
                stats.append(self.student.train_minibatch(micro, loss_fn, want_logits, ref_logits=source))
        if self.is_last_stage:
            batch.extras.update(self._derived)
        self._derived = {}
        self.tokens = (real, padded)
        return stats

    def micro_batches(self, batch: TrainBatch, rows: list[int]) -> list[TrainBatch]:
        """train.micro_batch_size rows each, or by length up to train.max_tokens_per_microbatch tokens, or packed."""
        train = self.cfg.train
        return plan_micro_batches(batch, rows, micro_batch_size=train.micro_batch_size,
                                  max_tokens=train.max_tokens_per_microbatch, pack=train.pack_sequences,
                                  seq_multiple=self.student.seq_multiple,
                                  own_length=self.cfg.parallel.pipeline_model_parallel_size == 1)

    def ref_logits_source(self, ref: MegatronPolicy, micro: list[TrainBatch]) -> Callable | MegatronPolicy:
        """Reference logits for full-vocabulary KL, one micro-batch at a time (docs/scaling.md).

        PP=1: a callable the student's schedule runs right before each micro-batch's forward (one
        reference forward of exactly that micro-batch; the [b, S, V/tp] logits live only inside it).
        PP>1: the reference itself, which the student's 1F1B schedule runs beside the student: every
        stage forwards its reference layers on the micro-batch it is about to train, and the last stage
        gets that micro-batch's reference logits right before its loss (`MegatronPolicy.train_minibatch`).
        A separate reference pipeline pass would have to keep a whole minibatch's [N, V/tp] logits on
        the last stage (~100 GB at 8k-token responses for a 7B student at TP2 x PP2)."""
        if self.cfg.parallel.pipeline_model_parallel_size == 1:
            return ref.micro_response_logits
        return ref

    def _adv_stats(self, mb: TrainBatch, algo: Any) -> tuple[float, float, float]:
        """(sum, sum of squares, count) of the advantage before whitening over the policy tokens of the
        whole minibatch, all-reduced over data-parallel ranks: adv_normalize whitens with these, so
        the result does not depend on train.micro_batch_size or the data-parallel size."""
        finite = [torch.nan_to_num(mb.extras[k], nan=0.0, posinf=0.0, neginf=0.0)  # a NaN skips the step later
                  for k in ("teacher_logp", "old_logp")]
        adv, mask = compute_advantages(finite[0], finite[1], mb.response_mask,
                                       mb.is_golden, mb.truncated, clip=algo.adv_clip, gamma=algo.adv_gamma,
                                       mask_truncated=algo.mask_truncated)
        local = whitening_stats(adv, mask)
        if self.dp_size > 1:
            dist.all_reduce(local, group=host_group("dp"))
        return float(local[0]), float(local[1]), float(local[2])

    def _global_counts(self, mb: TrainBatch, algo: Any) -> dict[str, tuple[float, float]]:
        """Token and sequence counts of each loss term summed over data-parallel ranks, so every rank
        normalises by the whole minibatch (DDP then averages the shares; the loss is scaled by dp)."""
        masks = term_masks(algo, mb.response_mask, mb.is_golden, mb.truncated)
        names = sorted(masks)
        local = torch.tensor([[float(masks[k].sum()), float((masks[k].sum(-1) > 0).sum())] for k in names],
                             dtype=torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(local, group=host_group("dp"))
        return {k: (float(local[i, 0]), float(local[i, 1])) for i, k in enumerate(names)}

    def loss_fn(self, mb: TrainBatch, beta_kl: float, n_micro: int = 1):
        """The loss closure for one minibatch `mb` (all its micro-batches on this rank). megatron averages
        over this rank's `n_micro` micro-batches and DDP over ranks, hence the `dp * n_micro` scale of the
        loss it returns. Its stats keep the micro-batch's unscaled share of each loss term: `n_micro`
        differs between ranks under dynamic batching or packing, so `_mean_stats` sums the shares of every
        micro-batch on every rank instead (a mean of shares scaled per rank would weigh them unevenly)."""
        cfg = self.cfg
        algo = replace(cfg.algo, beta_kl=beta_kl,
                       loss_agg_constant=cfg.algo.loss_agg_constant or float(cfg.rollout.max_new_tokens))
        full_kl = beta_kl > 0 and algo.kl_estimator == "full"
        counts = self._global_counts(mb, algo)
        adv_stats = self._adv_stats(mb, algo) if algo.adv_normalize else None
        scale = self.dp_size * n_micro

        def loss_fn(logp, resp_logits, batch, logits):
            if "old_logp" not in batch.extras:  # pi_old from this forward (`reuse_old_logp`)
                batch.extras["old_logp"] = logp.detach()
                self._write_back("old_logp", batch)
            if full_kl and batch.ref_logits is not None and "ref_logp" not in batch.extras:
                # the reference's token log-probs from the logits the full KL needs anyway (no 2nd forward)
                with torch.no_grad():
                    batch.extras["ref_logp"] = self.student.rows_token_logp(batch.ref_logits.float(), batch)
                self._write_back("ref_logp", batch)
            student_topk = None
            if "teacher_topk_ids" in batch.extras:
                student_topk = self.student.topk_logp(logits, batch, batch.extras["teacher_topk_ids"])
            loss, stats = stable_opd_loss(
                algo, logp=logp, old_logp=batch.extras["old_logp"], teacher_logp=batch.extras["teacher_logp"],
                response_mask=batch.response_mask, is_golden=batch.is_golden, truncated=batch.truncated,
                ref_logp=batch.extras.get("ref_logp"), student_logits=resp_logits if full_kl else None,
                ref_logits=batch.ref_logits if full_kl else None,
                teacher_topk_logp=batch.extras.get("teacher_topk_logp"), student_topk_logp=student_topk,
                reduce=self.student.reduce, global_counts=counts, adv_stats=adv_stats)
            return loss * scale, stats

        return loss_fn, full_kl

    def _write_back(self, key: str, micro: TrainBatch) -> None:
        """Copy a micro-batch's per-token `micro.extras[key]` into the step's [B, T] tensor (the step batch's
        layout, on the CPU), so metrics see it as if it had been scored up front."""
        sink = self._derived.get(key)
        if sink is None or micro.source_rows is None:
            return
        src = micro.source_rows.cpu()
        keep = src >= 0
        vals = micro.extras[key].detach().float().cpu()[keep]
        sink[src[keep], : vals.shape[1]] = vals
