"""The Stable-OPD training loop.

One step: sample prompts -> student rollouts (n per prompt) -> golden solutions mixed in ->
teacher, behaviour (pi_old) and reference log-probs -> PPO epochs over minibatches of the
Stable-OPD objective -> weight sync to the rollout engine -> health metrics, collapse check ->
periodic eval -> checkpoint.

Rank roles: global rank 0 is the controller: it samples prompts, drives the rollout engine and an
external (HF / SGLang) teacher, and broadcasts the step's sequences; every rank then scores and
trains its data-parallel slice with megatron. A megatron teacher runs in-process on the student's
TP/PP layout (a teacher with another layout is served by SGLang).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_opd.config import Config, dump_config
from megatron_opd.trainer.batch import SequenceItem, TrainBatch, build_batch
from megatron_opd.trainer.checkpoint import CheckpointManager, rng_state, set_rng_state
from megatron_opd.trainer.logger import RunLogger, gpu_stats
from megatron_opd.models.weight_mapping import load_hf_state_dict
from megatron_opd.trainer.policy import MegatronPolicy

logger = logging.getLogger("megatron_opd.trainer")


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (collapse with collapse_action=stop)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def golden_count(n_rollouts: int, mixture_ratio: float, n_prompts: int) -> int:
    """Golden samples so that they are `mixture_ratio` of the minibatch: g / (g + n_rollouts) = ratio."""
    if mixture_ratio <= 0:
        return 0
    if mixture_ratio >= 1:
        return n_prompts
    return max(1, round(mixture_ratio * n_rollouts / (1.0 - mixture_ratio)))


class Trainer:
    def __init__(self, cfg: Config):
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig, AutoTokenizer

        from megatron_opd.data.prompts import load_prompts
        from megatron_opd.data.sampler import PromptSampler
        from megatron_opd.metrics.collapse import CollapseDetector
        from megatron_opd.models.parallel import init_parallel

        if cfg.model.hf_path is None:
            raise ValueError("model.hf_path: required (an HF directory with config.json and *.safetensors)")
        if cfg.data.train_path is None:
            raise ValueError("data.train_path: required (JSONL / Parquet / HF dataset directory of prompts)")
        self.cfg = cfg
        p = cfg.parallel
        init_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.backend, seed=cfg.train.seed)
        self.rank = _rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.reports_metrics = self.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
        self.out_dir = Path(cfg.logging.out_dir)
        self.beta_kl = cfg.algo.beta_kl

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        hf_config = AutoConfig.from_pretrained(cfg.model.hf_path)
        student_sd = load_hf_state_dict(cfg.model.hf_path)
        steps = max(cfg.train.steps, 1) * cfg.algo.ppo_epochs * cfg.algo.num_minibatches
        self.student = MegatronPolicy(hf_config, student_sd, cfg, trainable=True, total_steps=steps)
        self.ref = MegatronPolicy(hf_config, student_sd, cfg, trainable=False) if self.beta_kl > 0 else None
        del student_sd
        self.teacher_policy: Optional[MegatronPolicy] = None
        self.teacher = None
        self._build_teacher()

        self.prompts = load_prompts(cfg.data.train_path, cfg.data, self.tokenizer,
                                    require_solution=cfg.algo.mixture_ratio > 0)
        self.sampler = PromptSampler(self.prompts.records, seed=cfg.train.seed, shuffle=cfg.data.shuffle,
                                     batch_size=cfg.train.prompts_per_step)
        self.eval_sets = self._load_eval_sets()
        self.detector = CollapseDetector()
        self.collapse_events = 0
        self.engine = self._build_engine() if self.rank == 0 else None
        self.weight_version = 0
        self.step = 0
        self.skipped_steps = 0
        root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.out_dir / "checkpoints"
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.ckpt = CheckpointManager(root, cfg.checkpoint.keep_last, self.rank, world,
                                      barrier=dist.barrier if world > 1 else None)
        self.log = RunLogger(self.out_dir, cfg.logging.tensorboard, cfg.logging.jsonl, enabled=self.rank == 0)
        if self.rank == 0:
            dump_config(cfg, self.out_dir / "config.yaml")
        if cfg.checkpoint.resume == "auto" and self.ckpt.latest_step() is not None:
            self.resume()

    # -- construction --------------------------------------------------------------------------

    def _build_teacher(self) -> None:
        from transformers import AutoConfig

        from megatron_opd.rollout.base import check_eos_compat

        t = self.cfg.teacher
        if t.backend == "megatron":
            if t.hf_path is None:
                raise ValueError("teacher.hf_path: required for teacher.backend=megatron")
            p = self.cfg.parallel
            if (t.tensor_model_parallel_size, t.pipeline_model_parallel_size) != (
                    p.tensor_model_parallel_size, p.pipeline_model_parallel_size):
                raise ValueError("teacher.tensor_model_parallel_size/pipeline_model_parallel_size: an in-process "
                                 "megatron teacher shares the student's layout; serve a differently laid out "
                                 "teacher with teacher.backend=sglang")
            check_eos_compat(self.cfg.model.hf_path, t.hf_path)
            self.teacher_policy = MegatronPolicy(AutoConfig.from_pretrained(t.hf_path), load_hf_state_dict(t.hf_path),
                                                 replace(self.cfg, model=replace(self.cfg.model, params_dtype="auto")),
                                                 trainable=False)
        elif self.rank == 0:
            if t.backend == "hf":
                from megatron_opd.teacher.hf import HFTeacher

                check_eos_compat(self.cfg.model.hf_path, t.hf_path)
                self.teacher = HFTeacher.from_pretrained(t.hf_path, micro_batch_size=t.micro_batch_size)
            else:
                from megatron_opd.rollout.base import eos_ids_from
                from megatron_opd.teacher.sglang import SGLangTeacher

                eos = eos_ids_from(self.cfg.model.hf_path)
                if t.hf_path is not None:
                    check_eos_compat(self.cfg.model.hf_path, t.hf_path)
                self.teacher = SGLangTeacher(t.server_url, eos_token_ids=eos, micro_batch_size=t.micro_batch_size)

    def _build_engine(self) -> Any:
        r = self.cfg.rollout
        if r.backend == "local":
            from megatron_opd.rollout.local import LocalEngine

            return LocalEngine.from_pretrained(self.cfg.model.hf_path, pad_token_id=self.pad_id)
        from megatron_opd.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(self.cfg.model.hf_path, mode=r.sglang_mode)

    def _load_eval_sets(self) -> dict[str, Any]:
        from megatron_opd.eval.benchmarks import load_benchmark

        sets = {}
        for item in self.cfg.data.eval_paths:
            name, _, path = item.partition("=") if "=" in item else (Path(item).stem, "", item)
            sets[name] = load_benchmark(name, path, self.tokenizer, self.cfg.data)
        return sets

    # -- one step ------------------------------------------------------------------------------

    def _rollout(self) -> dict[str, Any]:
        """Controller (rank 0): prompts -> rollouts + golden -> teacher scores. Returns the payload all
        ranks train on."""
        from megatron_opd.rollout.base import SamplingParams, assert_fresh

        cfg = self.cfg
        records = self.sampler.next_batch()
        n = cfg.rollout.n_samples_per_prompt
        items: list[SequenceItem] = []
        texts: list[str] = []
        prompt_texts: list[str] = []
        if cfg.algo.mixture_ratio < 1:
            sp = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, n=n,
                                seed=cfg.rollout.seed + self.step)
            samples = self.engine.generate([r.prompt_ids for r in records], sp)
            assert_fresh(samples, self.weight_version)
            for s in samples:
                items.append(SequenceItem(s.prompt_ids, s.response_ids, truncated=s.truncated,
                                          behaviour_logprobs=s.logprobs, prompt_index=s.prompt_index))
                texts.append(self.tokenizer.decode(s.response_ids, skip_special_tokens=True))
                prompt_texts.append(records[s.prompt_index].prompt)
        with_gold = [i for i, r in enumerate(records) if r.has_solution]
        n_gold = golden_count(len(items), cfg.algo.mixture_ratio, len(records)) if with_gold else 0
        for j in range(n_gold):
            i = with_gold[j % len(with_gold)]
            sol = records[i].solution_ids[: cfg.rollout.max_new_tokens]
            items.append(SequenceItem(records[i].prompt_ids, sol, is_golden=True, prompt_index=i))
        excess = len(items) % self.dp_size
        golden_idx = [i for i, it in enumerate(items) if it.is_golden]
        if excess > len(golden_idx):
            raise RuntimeError(f"step {self.step}: {len(items)} sequences cannot be split evenly over "
                               f"{self.dp_size} data-parallel ranks; make train.prompts_per_step * "
                               "rollout.n_samples_per_prompt a multiple of the data-parallel size")
        drop = set(golden_idx[len(golden_idx) - excess:]) if excess else set()
        items = [it for i, it in enumerate(items) if i not in drop]
        items.sort(key=lambda it: (it.prompt_index, it.is_golden))
        teacher = None
        if self.teacher is not None:
            roll = [i for i, it in enumerate(items) if not it.is_golden]
            scores = self.teacher.score([items[i].prompt_ids for i in roll], [items[i].response_ids for i in roll])
            teacher = {i: s.logprobs.tolist() for i, s in zip(roll, scores)}
            gold = [i for i, it in enumerate(items) if it.is_golden]
            if gold and cfg.algo.golden_loss == "fkl_topk" and cfg.algo.lambda_gold > 0:
                gs = self.teacher.score([items[i].prompt_ids for i in gold], [items[i].response_ids for i in gold],
                                        top_k=cfg.teacher.top_k)
                teacher["topk"] = {i: (s.topk_ids, s.topk_logprobs) for i, s in zip(gold, gs)}
        return {"items": items, "teacher": teacher, "texts": texts, "prompt_texts": prompt_texts,
                "records": [r.id for r in records]}

    def _attach_scores(self, batch: TrainBatch, payload: dict[str, Any], rows: list[int]) -> None:
        B, T = batch.response_mask.shape
        if payload["teacher"] is not None:
            tl = torch.zeros((B, T))
            for b, i in enumerate(rows):
                lp = payload["teacher"].get(i)
                if lp is not None:
                    tl[b, : len(lp)] = torch.tensor(lp)
            batch.extras["teacher_logp"] = tl
            topk = payload["teacher"].get("topk")
            if topk:
                K = self.cfg.teacher.top_k
                ids, lps = torch.zeros((B, T, K), dtype=torch.long), torch.zeros((B, T, K))
                for b, i in enumerate(rows):
                    if i in topk:
                        t_ids, t_lp = topk[i]
                        ids[b, : t_ids.shape[0]], lps[b, : t_lp.shape[0]] = t_ids, t_lp
                batch.extras["teacher_topk_ids"], batch.extras["teacher_topk_logp"] = ids, lps

    def _global_counts(self, mb: TrainBatch, algo: Any) -> dict[str, tuple[float, float]]:
        """Token and sequence counts of each loss term summed over data-parallel ranks, so every rank
        normalises by the whole minibatch (DDP then averages the shares; the loss is scaled by dp)."""
        from megatron.core import parallel_state as ps

        from megatron_opd.algo.objective import term_masks

        masks = term_masks(algo, mb.response_mask, mb.is_golden, mb.truncated)
        names = sorted(masks)
        local = torch.tensor([[float(masks[k].sum()), float((masks[k].sum(-1) > 0).sum())] for k in names],
                             dtype=torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(local, group=ps.get_data_parallel_group(with_context_parallel=False))
        return {k: (float(local[i, 0]), float(local[i, 1])) for i, k in enumerate(names)}

    def _micro_batches(self, batch: TrainBatch, rows: list[int], ref_rows: Optional[tuple[torch.Tensor, ...]]
                       ) -> list[TrainBatch]:
        """Split a minibatch's rows into train.micro_batch_size micro-batches of one shape (the last
        padded with masked rows), each carrying its rows' reference logits."""
        from megatron_opd.trainer.batch import pad_batch

        size = min(self.cfg.train.micro_batch_size, len(rows))
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
        parts = [batch.select(c) for c in chunks]
        length = max(p.tokens.shape[1] for p in parts)
        out = []
        for c, part in zip(chunks, parts):
            part = pad_batch(part, size, length)
            if ref_rows is not None:
                part.ref_logits = torch.cat([ref_rows[r] for r in c], 0)
            out.append(part)
        return out

    def _loss_fn(self, mb: TrainBatch, n_micro: int = 1):
        """The loss closure for one minibatch `mb` (all its micro-batches). Every term is normalised by
        whole-minibatch counts, so micro-batch and data-parallel shares add up to the minibatch loss;
        megatron averages over micro-batches and DDP over ranks, hence the `dp * n_micro` scale."""
        from megatron_opd.algo.objective import stable_opd_loss

        algo = replace(self.cfg.algo, beta_kl=self.beta_kl,
                       loss_agg_constant=self.cfg.algo.loss_agg_constant or float(self.cfg.rollout.max_new_tokens))
        full_kl = self.beta_kl > 0 and algo.kl_estimator == "full"
        counts = self._global_counts(mb, algo)
        scale = self.dp_size * n_micro

        def loss_fn(logp, resp_logits, batch, logits):
            student_topk = None
            if "teacher_topk_ids" in batch.extras:
                student_topk = self.student.topk_logp(logits, batch, batch.extras["teacher_topk_ids"])
            loss, stats = stable_opd_loss(
                algo, logp=logp, old_logp=batch.extras["old_logp"], teacher_logp=batch.extras["teacher_logp"],
                response_mask=batch.response_mask, is_golden=batch.is_golden, truncated=batch.truncated,
                ref_logp=batch.extras.get("ref_logp"), student_logits=resp_logits if full_kl else None,
                ref_logits=batch.ref_logits if full_kl else None,
                teacher_topk_logp=batch.extras.get("teacher_topk_logp"), student_topk_logp=student_topk,
                reduce=self.student.reduce, global_counts=counts)
            for k in ("total_loss", "pg_loss", "kl", "golden_loss"):  # shares -> whole-minibatch values
                if k in stats:
                    stats[k] *= scale
            return loss * scale, stats

        return loss_fn, full_kl

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.time()
        payload = _broadcast(self._rollout() if self.rank == 0 else None)
        self._last_payload = payload
        t_rollout = time.time() - t0
        items = payload["items"]
        per_rank = len(items) // self.dp_size
        rows = list(range(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank))
        batch = build_batch([items[i] for i in rows], self.pad_id)
        self._attach_scores(batch, payload, rows)
        mbs = cfg.train.micro_batch_size
        old_logp, _ = self.student.score(batch, micro_batch_size=mbs)
        if self.teacher_policy is not None:
            batch.extras["teacher_logp"], _ = self.teacher_policy.score(batch, micro_batch_size=mbs)
        full_kl = self.beta_kl > 0 and cfg.algo.kl_estimator == "full"
        ref_logits = None
        if self.ref is not None:
            ref_logp, ref_logits = self.ref.score(batch, want_logits=full_kl, micro_batch_size=mbs)
            if ref_logp is not None:
                batch.extras["ref_logp"] = ref_logp
        if self.is_last_stage:
            batch.extras["old_logp"] = old_logp
        else:  # non-last stages only run the model body; the loss lives on the last stage
            batch.extras["old_logp"] = torch.zeros(batch.response_mask.shape)
            batch.extras.setdefault("teacher_logp", torch.zeros(batch.response_mask.shape))

        t1 = time.time()
        train_stats: list[dict[str, float]] = []
        n_mb = min(cfg.algo.num_minibatches, batch.batch_size)
        bounds = [round(i * batch.batch_size / n_mb) for i in range(n_mb + 1)]
        ref_rows = None if ref_logits is None else torch.split(ref_logits, batch.response_mask.sum(1).tolist())
        for _epoch in range(cfg.algo.ppo_epochs):
            for a, b in zip(bounds[:-1], bounds[1:]):
                rows = list(range(a, b))
                micro = self._micro_batches(batch, rows, ref_rows)
                loss_fn, want_logits = self._loss_fn(batch.select(rows), len(micro))
                train_stats.append(self.student.train_minibatch(micro, loss_fn, want_logits))
        t_train = time.time() - t1

        t2 = time.time()
        self.weight_version += 1
        self._sync_weights()
        t_sync = time.time() - t2

        metrics = self._metrics(batch, payload, rows, train_stats)
        metrics.update({"time/rollout_s": t_rollout, "time/train_s": t_train, "time/sync_s": t_sync,
                        "time/step_s": time.time() - t0, "train/beta_kl": self.beta_kl,
                        "train/weight_version": float(self.weight_version)})
        self.step += 1
        return metrics

    def _sync_weights(self) -> None:
        from megatron_opd.rollout.base import push_weights

        weights = self.student.iter_hf_weights()
        if self.rank == 0:
            push_weights(self.engine, weights, self.weight_version, bucket_mb=self.cfg.rollout.sync_bucket_mb)
        else:
            for _ in weights:
                pass

    def _metrics(self, batch: TrainBatch, payload: dict[str, Any], rows: list[int],
                 train_stats: list[dict[str, float]]) -> dict[str, float]:
        from megatron_opd.metrics.health import rollout_health

        local: dict[str, float] = {}
        if self.reports_metrics:
            adv = None
            if "teacher_logp" in batch.extras:
                adv = (batch.extras["teacher_logp"] - batch.extras["old_logp"]) * (~batch.is_golden[:, None])
            local = rollout_health(batch.response_mask, token_ids=batch.response_ids, truncated=batch.truncated,
                                   advantages=adv, logp=batch.extras["old_logp"],
                                   teacher_logp=batch.extras.get("teacher_logp"),
                                   ref_logp=batch.extras.get("ref_logp"), is_golden=batch.is_golden)
            keys = sorted({k for s in train_stats for k in s})
            for k in keys:
                vals = [s[k] for s in train_stats if k in s and s[k] is not None and math.isfinite(s[k])]
                local[f"loss/{k}"] = sum(vals) / len(vals) if vals else float("nan")
            if batch.behaviour_logp is not None:
                roll = batch.response_mask & ~batch.is_golden[:, None]
                if roll.any():
                    diff = (batch.behaviour_logp - batch.extras["old_logp"]).abs()[roll]
                    local["rollout/engine_trainer_logp_absdiff"] = float(diff.mean())
        gathered = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        merged: dict[str, float] = {}
        reporters = [g for g in gathered if g]
        for k in sorted({k for g in reporters for k in g}):
            vals = [g[k] for g in reporters if k in g and g[k] is not None and math.isfinite(g[k])]
            merged[k] = sum(vals) / len(vals) if vals else float("nan")
        if self.rank == 0:  # text-level metrics over the whole step (every rollout, all DP ranks)
            texts = payload["texts"]
            text_metrics = rollout_health(
                torch.ones((len(texts), 1), dtype=torch.bool), response_texts=texts,
                truncated=[it.truncated for it in payload["items"] if not it.is_golden][: len(texts)]) if texts else {}
            for k in ("rollout/repetition_rate", "rollout/truncation_rate"):
                if k in text_metrics:
                    merged[k] = text_metrics[k]
            merged.update(gpu_stats())
        return merged

    # -- the loop --------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        from megatron_opd.eval.benchmarks import evaluate
        from megatron_opd.rollout.base import SamplingParams

        if self.rank != 0 or not self.eval_sets:
            return {}
        sp = SamplingParams(max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=0.0, seed=0)
        results = evaluate(self.engine, self.tokenizer, self.eval_sets, k=1, sampling=sp,
                           out_dir=self.out_dir / "eval" / f"step_{self.step:06d}")
        out = {}
        for r in results:
            for k, v in r.metrics.items():
                out[f"eval/{r.name}/{k}"] = v
        accs = [r.metrics.get("pass@1", float("nan")) for r in results]
        out["eval/accuracy"] = sum(accs) / len(accs)
        return out

    def _handle_collapse(self, metrics: dict[str, float]) -> None:
        verdict = self.detector.update(metrics, step=self.step) if self.rank == 0 else None
        verdict_flag = _broadcast(bool(verdict.collapsed) if verdict is not None else False)
        metrics["health/collapsed"] = float(verdict_flag)
        if not verdict_flag:
            return
        self.collapse_events += 1
        action = self.cfg.train.collapse_action
        if self.rank == 0:
            logger.warning("step %d: length-inflation collapse detected (%s); action=%s", self.step,
                           "; ".join(verdict.reasons), action)
        if action == "stop":
            self.save()
            raise TrainingStopped(f"collapse detected at step {self.step}: {'; '.join(verdict.reasons) if verdict else ''}")
        if action in ("raise_beta_kl", "rollback"):
            if action == "rollback" and self.ckpt.latest_step() is not None:
                self.resume()
            self.beta_kl = max(2 * self.beta_kl, 0.01)
            if self.ref is None:
                from transformers import AutoConfig

                self.ref = MegatronPolicy(AutoConfig.from_pretrained(self.cfg.model.hf_path),
                                          load_hf_state_dict(self.cfg.model.hf_path), self.cfg, trainable=False)
            if self.rank == 0:
                self.detector.reset()

    def train(self, stop_after: Optional[int] = None) -> dict[str, float]:
        """Run to train.steps, or return early after `stop_after` steps of this call (a time-limited
        job slice; the last step is checkpointed so the next call resumes from it)."""
        cfg = self.cfg
        end = cfg.train.steps if stop_after is None else min(cfg.train.steps, self.step + stop_after)
        bar = None
        if self.rank == 0 and cfg.logging.progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.train.steps, initial=self.step, desc=cfg.algo.preset, dynamic_ncols=True)
        last: dict[str, float] = {}
        try:
            while self.step < end:
                metrics = self.train_step()
                if metrics.get("loss/update_skipped", 0.0) > 0:
                    self.skipped_steps += 1
                metrics["train/skipped_steps"] = float(self.skipped_steps)
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                    metrics.update(self.evaluate())
                self._handle_collapse(metrics)
                if self.step % cfg.logging.log_every == 0 or self.step == cfg.train.steps:
                    self.log.log(self.step, metrics)
                if self.rank == 0 and cfg.logging.sample_every and self.step % cfg.logging.sample_every == 1 % cfg.logging.sample_every:
                    self._log_samples()
                if self.step % cfg.checkpoint.save_every == 0 or self.step in (cfg.train.steps, end):
                    self.save()
                last = metrics
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3g}" for k in (
                        "rollout/response_len_mean", "rollout/truncation_rate", "loss/total_loss", "loss/kl")
                        if k in metrics and metrics[k] == metrics[k]})
        finally:
            if bar is not None:
                bar.close()
        return last

    def _log_samples(self, k: int = 4) -> None:
        payload = getattr(self, "_last_payload", None)
        if not payload or not payload["texts"]:
            return
        rolls = [it for it in payload["items"] if not it.is_golden]
        self.log.log_samples(self.step, [
            {"prompt": payload["prompt_texts"][i], "response": payload["texts"][i],
             "truncated": rolls[i].truncated, "length": len(rolls[i].response_ids)}
            for i in range(min(k, len(payload["texts"])))])

    def close(self) -> None:
        self.log.close()
        if self.engine is not None:
            self.engine.shutdown()

    # -- checkpoint --------------------------------------------------------------------------------

    def save(self) -> None:
        state = {"policy": self.student.state_dict(), "rng": rng_state(), "step": self.step,
                 "weight_version": self.weight_version, "beta_kl": self.beta_kl, "skipped_steps": self.skipped_steps,
                 "sampler": self.sampler.state_dict()}
        if self.rank == 0:
            state["detector"] = self.detector.state_dict()
        self.ckpt.save(self.step, state, meta={"beta_kl": self.beta_kl})

    def resume(self) -> None:
        step, state = self.ckpt.load()
        self.student.load_state_dict(state["policy"])
        set_rng_state(state["rng"])
        self.step, self.weight_version = int(state["step"]), int(state["weight_version"])
        self.beta_kl, self.skipped_steps = float(state["beta_kl"]), int(state["skipped_steps"])
        self.sampler.load_state_dict(state["sampler"])
        if "detector" in state:
            self.detector.load_state_dict(state["detector"])
        self._sync_weights()
        if self.rank == 0:
            logger.info("resumed from %s at step %d", self.ckpt.root, step)
