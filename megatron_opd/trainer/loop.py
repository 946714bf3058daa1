"""The Stable-OPD training loop.

One step: student rollouts (n per prompt) with golden solutions mixed in (rollouts.py) -> teacher,
pi_old and reference log-probs (scoring.py, learner.py) -> PPO epochs over minibatches of the Stable-OPD
objective (learner.py) -> weight sync to the rollout engine -> metrics (step_metrics.py), the collapse
guard (guard.py) -> periodic eval -> checkpoint (state.py).

Rank roles: global rank 0 is the controller: it drives the rollout engine and an external (HF / SGLang)
teacher and broadcasts the step's sequences; every rank then scores and trains its data-parallel slice
with megatron (docs/design.md).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer

from megatron_opd.config import Config, dump_config
from megatron_opd.data.prompts import load_prompts, route_teachers
from megatron_opd.data.sampler import PromptSampler
from megatron_opd.eval.benchmarks import load_benchmark
from megatron_opd.inputs import check_inputs, eval_set_name
from megatron_opd.models.dtype import resolve_dtype, settle_auto_dtype
from megatron_opd.models.hf_config import check_family
from megatron_opd.models.parallel import (broadcast_object, data_parallel_rank_size, global_rank, init_parallel,
                                          is_pipeline_last_stage, tensor_parallel_rank)
from megatron_opd.models.weight_mapping import load_hf_state_dict
from megatron_opd.trainer import state
from megatron_opd.trainer.batch import SequenceItem, build_batch
from megatron_opd.trainer.checkpoint import CheckpointManager
from megatron_opd.trainer.guard import Guard, TrainingStopped
from megatron_opd.trainer.hostmem import host_memory_gb, release_freed_memory
from megatron_opd.trainer.learner import Learner
from megatron_opd.trainer.logger import RunLogger
from megatron_opd.trainer.mixture import (balance_rows, golden_count, golden_prompt_picks, golden_response,
                                          spread_rows)
from megatron_opd.trainer.policy import MegatronPolicy
from megatron_opd.trainer.preempt import Preempted, PreemptionWatch
from megatron_opd.trainer.rollouts import Rollouts, check_engine_parity
from megatron_opd.trainer.scoring import Scorer, preflight
from megatron_opd.trainer.step_metrics import sample_rows, step_metrics

logger = logging.getLogger("megatron_opd.trainer")

__all__ = ["Trainer", "TrainingStopped", "golden_count", "golden_prompt_picks", "golden_response"]


class Trainer:
    """Builds the parts from one Config and runs the loop; `train_step` is one step of the algorithm."""

    def __init__(self, cfg: Config):
        check_inputs(cfg)
        self.cfg = cfg
        p = cfg.parallel
        init_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.backend, seed=cfg.train.seed)
        self.rank = global_rank()
        settle_auto_dtype(broadcast_object, is_source=self.rank == 0)  # rank 0's `auto` on every rank
        self.dp_rank, self.dp_size = data_parallel_rank_size()
        self.is_last_stage = is_pipeline_last_stage()
        self.reports_metrics = self.is_last_stage and tensor_parallel_rank() == 0
        self.out_dir = Path(cfg.logging.out_dir)
        self.beta_kl = cfg.algo.beta_kl
        self.step = 0
        self.skipped_steps = 0

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.hf_config = AutoConfig.from_pretrained(cfg.model.hf_path)
        check_family(cfg.model.family, self.hf_config, cfg.model.hf_path)
        preflight(cfg, self.rank)
        # read in the student's dtype when the reference (built from the same tensors) takes no more precision
        m = cfg.model
        same = m.ref_params_dtype in ("same", m.params_dtype) or resolve_dtype(m.ref_params_dtype).itemsize <= \
            resolve_dtype(m.params_dtype).itemsize
        student_sd = load_hf_state_dict(cfg.model.hf_path, dtype=resolve_dtype(m.params_dtype) if same else None)
        steps = max(cfg.train.steps, 1) * cfg.algo.ppo_epochs * cfg.algo.num_minibatches
        self.student = MegatronPolicy(self.hf_config, student_sd, cfg, trainable=True, total_steps=steps)
        self.scorer = Scorer(cfg, rank=self.rank, student=self.student, tokenizer=self.tokenizer, pad_id=self.pad_id,
                             hf_config=self.hf_config, student_state=student_sd, beta_kl=self.beta_kl,
                             out_dir=self.out_dir)
        del student_sd
        self.learner = Learner(cfg, self.student, dp_size=self.dp_size, is_last_stage=self.is_last_stage)
        self.prompts = load_prompts(cfg.data.train_path, cfg.data, self.tokenizer,
                                    require_solution=cfg.algo.mixture_ratio > 0)
        route_teachers(self.prompts, cfg.teacher_route, [t.name for t in cfg.all_teachers()])
        self.sampler = PromptSampler(self.prompts.records, seed=cfg.train.seed, shuffle=cfg.data.shuffle,
                                     batch_size=cfg.train.prompts_per_step)
        self.eval_sets = {name: load_benchmark(name, path, self.tokenizer, cfg.data, limit=cfg.data.eval_limit)
                          for name, path in map(eval_set_name, cfg.data.eval_paths)}
        self.guard = Guard(cfg, self.rank)
        self.rollouts = Rollouts(cfg, rank=self.rank, dp_parts=self.dp_size, tokenizer=self.tokenizer,
                                 pad_id=self.pad_id, sampler=self.sampler, student=self.student, out_dir=self.out_dir,
                                 controller_scores=self.scorer.controller_scores)
        root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.out_dir / "checkpoints"
        world = dist.get_world_size() if dist.is_initialized() else 1
        layout = {"tp": cfg.parallel.tensor_model_parallel_size, "pp": cfg.parallel.pipeline_model_parallel_size,
                  "dp": self.dp_size}
        self.ckpt = CheckpointManager(root, cfg.checkpoint.keep_last, self.rank, world,
                                      barrier=dist.barrier if world > 1 else None, layout=layout)
        self.log = RunLogger(self.out_dir, cfg.logging.tensorboard, cfg.logging.jsonl, enabled=self.rank == 0)
        self._last_payload: Optional[dict[str, Any]] = None
        if self.rank == 0:
            dump_config(cfg, self.out_dir / "config.yaml")
        if cfg.checkpoint.resume == "auto":
            # Rank 0 decides and every rank loads that step: ranks reading `latest` on their own could
            # disagree (shared-filesystem caching, a fallback) and deadlock in resume's collectives.
            step = broadcast_object(self.ckpt.latest_step() if self.rank == 0 else None)
            if step is not None:
                self.resume(step)
        self.preempt = PreemptionWatch(self.out_dir, self.rank)
        release_freed_memory()  # the HF checkpoints read at startup

    # the parts' objects, under the names users and tests know
    engine = property(lambda self: self.rollouts.engine)
    weight_version = property(lambda self: self.rollouts.weight_version)
    engine_shared_bytes = property(lambda self: self.rollouts.shared_bytes)
    ref = property(lambda self: self.scorer.ref)
    teacher = property(lambda self: self.scorer.teacher)
    teacher_policy = property(lambda self: self.scorer.teacher_policy)
    layout_teacher = property(lambda self: self.scorer.layout_teacher)
    detector = property(lambda self: self.guard.detector)

    def set_beta_kl(self, beta_kl: float) -> None:
        self.beta_kl = beta_kl
        self.scorer.ensure_ref(beta_kl)

    # -- one step ------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        cfg, t0 = self.cfg, time.time()
        payload = self._last_payload = self.rollouts.next_payload(self.step)
        self.rollouts.start_next(self.step)
        release_freed_memory()
        t_rollout = time.time() - t0

        t1 = time.time()
        self.scorer.score_payload(payload)  # a megatron teacher in its own layout scores every sequence
        items = payload["items"]
        rows = self.my_rows(items)
        batch = build_batch([items[i] for i in rows], self.pad_id, pad_to_multiple=self.student.seq_multiple)
        self.scorer.attach(batch, payload, rows)
        off_policy = payload.get("weight_version", self.weight_version) != self.weight_version
        full_kl = self.beta_kl > 0 and cfg.algo.kl_estimator == "full"
        old_logp = self.learner.old_logp(batch, off_policy, full_kl_ref=full_kl and self.ref is not None)
        self.scorer.score_batch(batch, with_ref_logp=not full_kl)
        self.learner.set_old_logp(batch, old_logp)
        release_freed_memory()

        t2 = time.time()
        train_stats = self.learner.update(batch, self.beta_kl, self.ref)
        release_freed_memory()

        t3 = time.time()
        self.rollouts.finish_next()
        t_wait = time.time() - t3
        self.rollouts.sync()
        t_sync = time.time() - t3 - t_wait

        metrics = step_metrics(batch, payload, train_stats, reports=self.reports_metrics, rank=self.rank,
                               off_policy=off_policy, config=cfg.train.health, tokens=self.learner.tokens)
        metrics.update({"time/rollout_s": t_rollout, "time/score_s": t2 - t1, "time/train_s": t3 - t2,
                        "time/sync_s": t_sync, "time/rollout_wait_s": t_wait,
                        "rollout/staleness": float(self.weight_version - 1 - payload.get("weight_version", 0)),
                        "time/step_s": time.time() - t0, "train/beta_kl": self.beta_kl,
                        "train/weight_version": float(self.weight_version), **host_memory_gb()})
        self.step += 1
        check_engine_parity(cfg.rollout, self.step, metrics, self.rank)
        return metrics

    def my_rows(self, items: list[SequenceItem]) -> list[int]:
        """This data-parallel rank's rows of the step: an even share of rows and of golden rows, dealt by
        tokens when micro-batches are formed by tokens (train.max_tokens_per_microbatch)."""
        golden = [it.is_golden for it in items]
        if self.cfg.train.max_tokens_per_microbatch:
            lengths = [len(it.prompt_ids) + len(it.response_ids) for it in items]
            return balance_rows(range(len(items)), golden, lengths, self.dp_size)[self.dp_rank]
        return spread_rows(range(len(items)), golden, self.dp_size)[self.dp_rank]

    def evaluate(self) -> dict[str, float]:
        return self.rollouts.evaluate(self.eval_sets, self.step, self.out_dir)

    # -- the loop --------------------------------------------------------------------------------

    def train(self, stop_after: Optional[int] = None) -> dict[str, float]:
        """Run to train.steps, or return early after `stop_after` steps of this call (a time-limited
        job slice; the last step is checkpointed so the next call resumes from it). Steps re-trained
        after a rollback count towards `stop_after`, so a slice never overruns its time limit."""
        cfg, ran, last = self.cfg, 0, {}
        bar = tqdm(total=cfg.train.steps, initial=self.step, desc=cfg.algo.preset, dynamic_ncols=True) if (
            self.rank == 0 and cfg.logging.progress_bar) else None
        if cfg.train.eval_every and cfg.train.eval_before_train and self.step == 0 and cfg.train.steps > 0:
            start = self.evaluate()
            if start:
                self.log.log(0, start)
                if self.rank == 0:
                    self.guard.detector.observe_eval(start, step=0)
        try:
            while self.step < cfg.train.steps and (stop_after is None or ran < stop_after):
                metrics = self.train_step()
                ran += 1
                self.skipped_steps += metrics.get("loss/update_skipped", 0.0) > 0
                metrics["train/skipped_steps"] = float(self.skipped_steps)
                if cfg.train.eval_every and (self.step % cfg.train.eval_every == 0 or self.step == cfg.train.steps):
                    metrics.update(self.evaluate())
                action = self.guard.judge(metrics, self.step)
                if self.step % cfg.logging.log_every == 0 or self.step == cfg.train.steps:
                    self.log.log(self.step, metrics)
                every = cfg.logging.sample_every
                if self.rank == 0 and every and self.step % every == 1 % every:
                    self.log.log_samples(self.step, sample_rows(self._last_payload))
                last = metrics
                if action is not None and self.guard.apply(action, self):  # rolled back: steps re-trained
                    if bar is not None:
                        bar.n = self.step
                        bar.refresh()
                    continue
                saved = self.step % cfg.checkpoint.save_every == 0 or self.step == cfg.train.steps or ran == stop_after
                if saved:
                    self.save()
                reason = self.preempt.requested()
                if reason:
                    if not saved:
                        self.save()
                    self.preempt.mark(self.step, reason)
                    raise Preempted(self.step, reason)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3g}" for k in (
                        "rollout/response_len_mean", "rollout/truncation_rate", "loss/total_loss", "loss/kl")
                        if k in metrics and metrics[k] == metrics[k]})
            # rank 0 decides (export is collective; out_dir need not be shared): after training, or when a
            # finished run was killed before its export
            if cfg.checkpoint.export_hf and self.step >= cfg.train.steps and broadcast_object(
                    bool(ran) or not self.hf_dir.is_dir()):
                self.export_hf()
        finally:
            if bar is not None:
                bar.close()
        return last

    # -- state -------------------------------------------------------------------------------------

    @property
    def hf_dir(self) -> Path:
        return self.out_dir / "hf"

    def export_hf(self, out: Optional[Path] = None) -> Path:
        return state.export_hf(self, Path(out) if out is not None else self.hf_dir)

    def save(self) -> None:
        state.save(self)

    def resume(self, step: Optional[int] = None) -> None:
        """Restore the checkpoint of `step` (default: the one rank 0 finds as latest, agreed by all ranks)."""
        if step is None:
            step = broadcast_object(self.ckpt.latest_step() if self.rank == 0 else None)
            if step is None:
                raise FileNotFoundError(f"no checkpoint under {self.ckpt.root}")
        self.restore(step, rollback=False)

    def restore(self, step: int, rollback: bool) -> tuple[int, list[int]]:
        return state.restore(self, step, rollback)

    def restore_initial(self) -> None:
        state.restore_initial(self)

    def close(self) -> None:
        if getattr(self, "preempt", None) is not None:
            self.preempt.close()
        self.rollouts.close()
        self.log.close()
        self.scorer.close()
