"""The rollout stage of a step: the engine, its weights, and the step payload every rank trains on.

Global rank 0 is the controller: it owns the rollout engine (local, SGLang in-process or a server),
samples the step's prompts, generates n rollouts per prompt, mixes in golden solutions
(trainer/mixture.py), has an external teacher (HF / SGLang, `controller_scores`) score them, and
broadcasts the payload. With `rollout.overlap` the next step's payload is generated on a background
thread with the current weights while this step trains (one step off-policy), and joined before the
weight sync, so the engine never changes weights mid-generation.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_opd.config import Config
from megatron_opd.eval.benchmarks import evaluate
from megatron_opd.models.parallel import broadcast_object
from megatron_opd.rollout import make_rollout_engine, release_engine_memory, sync_weights
from megatron_opd.rollout.base import SamplingParams, assert_fresh
from megatron_opd.rollout.local import LocalEngine
from megatron_opd.teacher.fidelity import PairMismatchError
from megatron_opd.trainer.batch import SequenceItem
from megatron_opd.trainer.mixture import golden_count, golden_prompt_picks, golden_response
from megatron_opd.trainer.policy import resolve_dtype

logger = logging.getLogger("megatron_opd.trainer")

Payload = dict[str, Any]


def payload_state(payload: Payload) -> dict[str, Any]:
    """A step payload as plain containers (checkpoints load with weights_only=True)."""
    return {**payload, "items": [asdict(it) for it in payload["items"]]}


def payload_from_state(state: dict[str, Any]) -> Payload:
    return {**state, "items": [SequenceItem(**it) for it in state["items"]]}


def check_engine_parity(r: Any, step: int, metrics: dict[str, float], rank: int) -> None:
    """After step 1: the engine's behaviour log-probs against the trainer's pi_old on the same tokens
    (rollout.parity_check, rollout.max_engine_logp_absdiff)."""
    gap = metrics.get("rollout/engine_trainer_logp_absdiff")
    if step != 1 or gap is None or not math.isfinite(gap) or r.parity_check == "off":
        return
    worst = metrics.get("rollout/engine_trainer_logp_absdiff_max", float("nan"))
    msg = (f"rollout engine vs trainer log-probs at step 1: mean |diff| {gap:.3g}, max {worst:.3g} "
           f"(rollout.max_engine_logp_absdiff={r.max_engine_logp_absdiff})")
    if gap <= r.max_engine_logp_absdiff:
        if rank == 0:
            logger.info("%s: ok", msg)
        return
    if r.parity_check == "error":
        raise PairMismatchError(f"{msg}: the engine samples from another policy than the one trained "
                                "(dtype, weights not synced, sampling settings?)")
    if rank == 0:
        logger.warning("%s", msg)


class Rollouts:
    """Rank 0 holds the engine; every rank calls the collective methods (`next_payload`, `sync`,
    `push_restored`) at the same point of the step."""

    def __init__(self, cfg: Config, *, rank: int, dp_parts: int, tokenizer: Any, pad_id: int, sampler: Any,
                 student: Any, out_dir: Path,
                 controller_scores: Optional[Callable[[list[SequenceItem]], Optional[dict]]] = None):
        self.cfg, self.rank, self.dp_parts = cfg, rank, dp_parts
        self.tokenizer, self.sampler, self.student = tokenizer, sampler, student
        self.controller_scores = controller_scores
        self.weight_version = 0
        self.engine = make_rollout_engine(
            cfg.rollout, cfg.model.hf_path, pad_token_id=pad_id, log_path=str(out_dir / "logs" / "sglang_rollout.log"),
            dtype=student.dtype if cfg.rollout.dtype == "auto" else resolve_dtype(cfg.rollout.dtype),
        ) if rank == 0 else None
        self.shared_bytes = self._share_weights()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._future: Optional[Future] = None
        self.pending: Any = None  # the next step's payload, or the error generating it

    def _share_weights(self) -> int:
        """A local engine beside a TP=PP=1 student of its dtype decodes from the student's own parameter
        storage (`LocalEngine.share_weights`) rather than a second copy of the weights; only q/k/v, which
        megatron stores fused, are still copied at each sync. Not with rollout.overlap: that generates while
        the optimizer updates the weights."""
        p = self.cfg.parallel
        if (not isinstance(self.engine, LocalEngine) or self.cfg.rollout.overlap
                or p.tensor_model_parallel_size * p.pipeline_model_parallel_size != 1):
            return 0
        engine_dtype = next(self.engine.model.parameters()).dtype
        storages = {q.untyped_storage().data_ptr() for q in self.student.model.parameters()}
        views = [(n, t) for n, t in self.student.iter_hf_weights()
                 if t.dtype == engine_dtype and t.untyped_storage().data_ptr() in storages]
        shared = self.engine.share_weights(views)
        if shared:
            logger.info("rollout engine shares %.0f MB of weights with the student (no second copy)", shared / 2**20)
        return shared

    # -- the payload -------------------------------------------------------------------------------

    def generate(self, step: int, version: int) -> Payload:
        """Controller: prompts -> rollouts + golden -> external teacher scores, for training step `step`
        with the engine at weight version `version`."""
        cfg = self.cfg
        records = self.sampler.next_batch()
        items: list[SequenceItem] = []
        texts: list[str] = []
        prompt_texts: list[str] = []
        if cfg.algo.mixture_ratio < 1:
            r = cfg.rollout
            sp = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, n=r.n_samples_per_prompt, seed=r.seed + step)
            samples = self.engine.generate([rec.prompt_ids for rec in records], sp)
            assert_fresh(samples, version)
            for s in samples:
                items.append(SequenceItem(s.prompt_ids, s.response_ids, truncated=s.truncated,
                                          behaviour_logprobs=s.logprobs, prompt_index=s.prompt_index,
                                          teacher=records[s.prompt_index].teacher))
                texts.append(self.tokenizer.decode(s.response_ids, skip_special_tokens=True))
                prompt_texts.append(records[s.prompt_index].prompt)
        items = self._with_golden(items, records, step)
        teacher = self.controller_scores(items) if self.controller_scores is not None else None
        return {"items": items, "teacher": teacher, "texts": texts, "prompt_texts": prompt_texts,
                "records": [rec.id for rec in records], "weight_version": version}

    def _with_golden(self, items: list[SequenceItem], records: list[Any], step: int) -> list[SequenceItem]:
        """The rollouts plus the step's golden rows, trimmed to a multiple of the data-parallel size (golden
        rows go first) and ordered by prompt."""
        cfg = self.cfg
        dp = self.dp_parts
        with_gold = [i for i, rec in enumerate(records) if rec.has_solution]
        n_gold = golden_count(len(items), cfg.algo.mixture_ratio, len(records),
                              parts=dp * max(1, cfg.algo.num_minibatches)) if with_gold else 0
        stop_ids = list(self.engine.eos_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        items = list(items)
        for j in golden_prompt_picks(len(with_gold), n_gold, step):
            i = with_gold[j]
            sol, cut = golden_response(records[i].solution_ids, stop_ids, cfg.rollout.max_new_tokens,
                                       eos_id=eos if isinstance(eos, int) else None)
            items.append(SequenceItem(records[i].prompt_ids, sol, is_golden=True, truncated=cut, prompt_index=i,
                                      teacher=records[i].teacher))
        excess = len(items) % dp
        golden_idx = [i for i, it in enumerate(items) if it.is_golden]
        if excess > len(golden_idx):
            raise RuntimeError(f"step {step}: {len(items)} sequences cannot be split evenly over "
                               f"{dp} data-parallel ranks; make train.prompts_per_step * "
                               "rollout.n_samples_per_prompt a multiple of the data-parallel size")
        drop = set(golden_idx[len(golden_idx) - excess:]) if excess else set()
        items = [it for i, it in enumerate(items) if i not in drop]
        items.sort(key=lambda it: (it.prompt_index, it.is_golden))
        return items

    def next_payload(self, step: int) -> Payload:
        """Collective: this step's payload on every rank -- the one generated in the background during the
        previous step (rollout.overlap), else a fresh on-policy rollout."""
        payload = None
        if self.rank == 0:
            ready, self.pending = self.pending, None
            if isinstance(ready, BaseException):  # raised where a synchronous rollout would have raised
                raise ready
            payload = ready if ready is not None else self.generate(step, self.weight_version)
        return broadcast_object(payload)

    # -- one-step off-policy overlap (rollout.overlap) ----------------------------------------------

    def start_next(self, step: int) -> None:
        """After step `step`'s payload: generate step `step + 1`'s on a background thread with the current
        (not yet updated) weights, unless this is the last step. Otherwise free a colocated engine's
        accelerator memory while the trainer works."""
        if self.cfg.rollout.overlap and self.rank == 0 and step + 1 < self.cfg.train.steps:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout")
            self._future = self._executor.submit(self.generate, step + 1, self.weight_version)
            return
        if self.rank == 0:
            release_engine_memory(self.engine, self.cfg.rollout)

    def finish_next(self) -> None:
        future, self._future = self._future, None
        if future is not None:
            error = future.exception()
            self.pending = error if error is not None else future.result()

    def drop_next(self) -> None:
        """A rollback: rollouts of the abandoned weights must not train the restored ones."""
        self.finish_next()
        self.pending = None

    # -- weights ----------------------------------------------------------------------------------

    def sync(self, version: Optional[int] = None) -> None:
        """Collective: the student's weights to the engine as `version` (default: the next one); tensor or
        distributed path per rollout.colocate (rollout.sync_weights)."""
        self.weight_version = self.weight_version + 1 if version is None else version
        weights = self.student.iter_hf_weights()
        if self.rank == 0:
            sync_weights(self.engine, weights, self.weight_version, self.cfg.rollout, self.cfg.parallel.backend)
        else:
            for _ in weights:
                pass

    def push_restored(self, restored_version: int) -> None:
        """Collective: push restored weights under a version the engine accepts: the restored one when it is
        newer than the engine's (a fresh engine on resume: unchanged numbering), else the engine's + 1 (a
        rollback, or a long-lived server that already holds a later version)."""
        engine_version = broadcast_object(int(getattr(self.engine, "weight_version", 0)) if self.rank == 0 else None)
        self.sync(max(restored_version, engine_version + 1))

    def evaluate(self, eval_sets: dict[str, Any], step: int, out_dir: Path) -> dict[str, float]:
        """Greedy pass@1 on the held-out sets with the engine's current weights (rank 0; {} elsewhere)."""
        if self.rank != 0 or not eval_sets:
            return {}
        sp = SamplingParams(max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=0.0, seed=0)
        results = evaluate(self.engine, self.tokenizer, eval_sets, k=1, sampling=sp,
                           out_dir=out_dir / "eval" / f"step_{step:06d}")
        out = {f"eval/{r.name}/{k}": v for r in results for k, v in r.metrics.items()}
        accs = [r.metrics.get("pass@1", float("nan")) for r in results]
        out["eval/accuracy"] = sum(accs) / len(accs)
        return out

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        if self.engine is not None:
            self.engine.shutdown()
