"""The Stable-OPD training loop.

One step: sample prompts -> student rollouts (n per prompt) -> golden solutions mixed in ->
teacher, behaviour (pi_old) and reference log-probs -> PPO epochs over minibatches of the
Stable-OPD objective -> weight sync to the rollout engine -> health metrics, collapse check ->
periodic eval -> checkpoint.

Rank roles: global rank 0 is the controller: it samples prompts, drives the rollout engine and an
external (HF / SGLang) teacher, and broadcasts the step's sequences; every rank then scores and
trains its data-parallel slice with megatron. A megatron teacher runs in-process, on the student's
TP/PP layout or on its own over the same ranks (then it scores the step's broadcast sequences, shared
over its replicas), or is served by SGLang (docs/design.md, "Teacher placement").
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_opd.config import Config, ConfigError, dump_config
from megatron_opd.inputs import check_inputs, eval_set_name
from megatron_opd.trainer.batch import SequenceItem, TrainBatch, build_batch, split_micro_batches
from megatron_opd.trainer.checkpoint import CheckpointManager, rng_state, set_rng_state
from megatron_opd.trainer.logger import RunLogger, gpu_stats
from megatron_opd.models.hf_config import check_family
from megatron_opd.models.parallel import host_group
from megatron_opd.models.weight_mapping import load_hf_state_dict
from megatron_opd.trainer.policy import MegatronPolicy, resolve_dtype
from megatron_opd.trainer.preempt import Preempted, PreemptionWatch

logger = logging.getLogger("megatron_opd.trainer")


EXPORT_META = "opd_meta.json"


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


def _payload_state(payload: dict[str, Any]) -> dict[str, Any]:
    """A step payload as plain containers (checkpoints load with weights_only=True)."""
    return {**payload, "items": [asdict(it) for it in payload["items"]]}


def _payload_from_state(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "items": [SequenceItem(**it) for it in state["items"]]}


def golden_count(n_rollouts: int, mixture_ratio: float, n_prompts: int) -> int:
    """Golden samples so that they are `mixture_ratio` of the minibatch: g / (g + n_rollouts) = ratio."""
    if mixture_ratio <= 0:
        return 0
    if mixture_ratio >= 1:
        return n_prompts
    return max(1, round(mixture_ratio * n_rollouts / (1.0 - mixture_ratio)))


def golden_prompt_picks(n_candidates: int, n_gold: int, step: int) -> list[int]:
    """Which of the step's `n_candidates` prompts (those with a solution) get the `n_gold` golden samples:
    evenly spaced over the prompts, with the start rotated by the step, so every prompt position gets
    its turn instead of always the first prompts. More golden samples than prompts wrap around."""
    if n_candidates <= 0 or n_gold <= 0:
        return []
    offset = step % n_candidates
    return [(offset + (j * n_candidates) // n_gold) % n_candidates for j in range(n_gold)]


def golden_response(solution_ids: list[int], stop_ids: list[int], max_new_tokens: int,
                    eos_id: Optional[int] = None) -> tuple[list[int], bool]:
    """A golden solution as a response the rollout engine could have produced: (ids, truncated).

    It ends with one of the rollout's stop ids `stop_ids` (the engine's EOS ids): a final `eos_id`
    (the tokenizer's EOS that `data.prompts.solution_ids` appends) that the engine does not stop on is
    replaced by `stop_ids[0]`, and a solution without a stop id gets one appended. A solution longer than
    `max_new_tokens` is cut there and marked truncated (no EOS), like a rollout that hit the budget."""
    ids = list(solution_ids)
    stops = set(stop_ids)
    if not ids or ids[-1] not in stops:
        if ids and eos_id is not None and ids[-1] == eos_id:
            ids = ids[:-1]
        ids.append(stop_ids[0])
    if len(ids) > max_new_tokens:
        return ids[:max_new_tokens], True
    return ids, False


class Trainer:
    def __init__(self, cfg: Config):
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig, AutoTokenizer

        from megatron_opd.data.prompts import load_prompts
        from megatron_opd.data.sampler import PromptSampler
        from megatron_opd.metrics.collapse import CollapseDetector
        from megatron_opd.models.parallel import init_parallel

        check_inputs(cfg)
        self.cfg = cfg
        p = cfg.parallel
        init_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.backend, seed=cfg.train.seed)
        self.rank = _rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.reports_metrics = self.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
        self.out_dir = Path(cfg.logging.out_dir)
        self.beta_kl = cfg.algo.beta_kl
        self._derived: dict[str, torch.Tensor] = {}

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        hf_config = AutoConfig.from_pretrained(cfg.model.hf_path)
        check_family(cfg.model.family, hf_config, cfg.model.hf_path)
        self._preflight()
        student_sd = load_hf_state_dict(cfg.model.hf_path)
        steps = max(cfg.train.steps, 1) * cfg.algo.ppo_epochs * cfg.algo.num_minibatches
        self.hf_config = hf_config
        self.student = MegatronPolicy(hf_config, student_sd, cfg, trainable=True, total_steps=steps)
        self.ref = self._build_ref(hf_config, student_sd) if self.beta_kl > 0 else None
        del student_sd
        self.teacher_policy: Optional[MegatronPolicy] = None
        self.teacher = None
        self.layout_teacher: Any = None  # a megatron teacher with its own TP/PP (teacher/megatron.py)
        self._build_teacher()
        self._teacher_offloader = None
        frozen_teacher = self.layout_teacher.model if self.layout_teacher is not None else (
            self.teacher_policy.model if self.teacher_policy is not None else None)
        if cfg.teacher.offload and frozen_teacher is not None:
            from megatron_opd.models.offload import WeightOffloader

            self._teacher_offloader = WeightOffloader(frozen_teacher)
            self._teacher_offloader.offload()

        self.prompts = load_prompts(cfg.data.train_path, cfg.data, self.tokenizer,
                                    require_solution=cfg.algo.mixture_ratio > 0)
        self.sampler = PromptSampler(self.prompts.records, seed=cfg.train.seed, shuffle=cfg.data.shuffle,
                                     batch_size=cfg.train.prompts_per_step)
        self.eval_sets = self._load_eval_sets()
        self.detector = CollapseDetector(cfg.train.collapse)
        self.collapse_events = 0
        self.rollbacks = 0
        self.engine = self._build_engine() if self.rank == 0 else None
        self._share_engine_weights()
        self.weight_version = 0
        self.step = 0
        self.skipped_steps = 0
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending_future: Optional[Future] = None
        self._pending_payload: Any = None  # the next step's payload, or the error generating it
        root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.out_dir / "checkpoints"
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.ckpt = CheckpointManager(root, cfg.checkpoint.keep_last, self.rank, world,
                                      barrier=dist.barrier if world > 1 else None)
        self.log = RunLogger(self.out_dir, cfg.logging.tensorboard, cfg.logging.jsonl, enabled=self.rank == 0)
        if self.rank == 0:
            dump_config(cfg, self.out_dir / "config.yaml")
        if cfg.checkpoint.resume == "auto":
            # Rank 0 decides and every rank loads that step: ranks reading `latest` on their own could
            # disagree (shared-filesystem caching, a fallback) and deadlock in resume's collectives.
            step = _broadcast(self.ckpt.latest_step() if self.rank == 0 else None)
            if step is not None:
                self.resume(step)
        self.preempt = PreemptionWatch(self.out_dir, self.rank)

    # -- construction --------------------------------------------------------------------------

    def _build_ref(self, hf_config: Any = None, state_dict: Optional[dict[str, torch.Tensor]] = None) -> MegatronPolicy:
        """pi_ref, the initial student (model.hf_path), frozen. Built at start when algo.beta_kl > 0,
        otherwise by `_ensure_ref` once beta_kl becomes > 0 (raised by a collapse action, or restored
        from a checkpoint written after such a raise)."""
        if hf_config is None:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(self.cfg.model.hf_path)
        if state_dict is None:
            state_dict = load_hf_state_dict(self.cfg.model.hf_path)
        dtype = self.cfg.model.ref_params_dtype
        return MegatronPolicy(hf_config, state_dict, self.cfg, trainable=False,
                              params_dtype=None if dtype == "same" else dtype)

    def _ensure_ref(self) -> None:
        if self.beta_kl > 0 and self.ref is None:
            self.ref = self._build_ref()

    def _preflight(self) -> None:
        """teacher/fidelity.py checks of the student/teacher pair before any model loads (teacher.preflight)."""
        from megatron_opd.teacher.fidelity import check_pair

        t = self.cfg.teacher
        if t.preflight == "off" or t.hf_path is None:
            return
        report = check_pair(self.cfg.model.hf_path, t.hf_path, chat_template=self.cfg.data.apply_chat_template)
        if self.rank == 0:
            logger.info("student/teacher preflight (%s vs %s):\n%s", self.cfg.model.hf_path, t.hf_path, report.render())
        if report.errors and t.preflight == "error":
            report.raise_for_errors()
        for f in report.errors if self.rank == 0 else []:
            logger.warning("teacher.preflight=warn: %s: %s", f.check, f.message)

    def _check_engine_parity(self, metrics: dict[str, float]) -> None:
        """Step 1: the engine's behaviour log-probs against the trainer's pi_old on the same tokens
        (rollout.parity_check, rollout.max_engine_logp_absdiff)."""
        gap = metrics.get("rollout/engine_trainer_logp_absdiff")
        r = self.cfg.rollout
        if self.step != 1 or gap is None or not math.isfinite(gap) or r.parity_check == "off":
            return
        worst = metrics.get("rollout/engine_trainer_logp_absdiff_max", float("nan"))
        msg = (f"rollout engine vs trainer log-probs at step 1: mean |diff| {gap:.3g}, max {worst:.3g} "
               f"(rollout.max_engine_logp_absdiff={r.max_engine_logp_absdiff})")
        if gap <= r.max_engine_logp_absdiff:
            if self.rank == 0:
                logger.info("%s: ok", msg)
            return
        if r.parity_check == "error":
            from megatron_opd.teacher.fidelity import PairMismatchError

            raise PairMismatchError(f"{msg}: the engine samples from another policy than the one trained "
                                    "(dtype, weights not synced, sampling settings?)")
        if self.rank == 0:
            logger.warning("%s", msg)

    def _topk_id_limit(self, teacher_vocab: int) -> int:
        from megatron_opd.teacher.fidelity import topk_id_limit

        return topk_id_limit(self.student.vocab_size, teacher_vocab, len(self.tokenizer))

    def _build_teacher(self) -> None:
        from transformers import AutoConfig

        t = self.cfg.teacher
        if t.backend == "megatron":
            if t.hf_path is None:
                raise ValueError("teacher.hf_path: required for teacher.backend=megatron")
            p = self.cfg.parallel
            if (t.tensor_model_parallel_size, t.pipeline_model_parallel_size) != (
                    p.tensor_model_parallel_size, p.pipeline_model_parallel_size):
                self._build_layout_teacher()
                return
            self.teacher_policy = MegatronPolicy(AutoConfig.from_pretrained(t.hf_path), load_hf_state_dict(t.hf_path),
                                                 self.cfg, trainable=False, params_dtype=t.params_dtype,
                                                 temperature=1.0)  # the teacher's own distribution
        elif self.rank == 0:
            if t.backend == "hf":
                from megatron_opd.teacher.hf import HFTeacher

                self.teacher = HFTeacher.from_pretrained(
                    t.hf_path, dtype=resolve_dtype(t.params_dtype),
                    device=f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu",
                    micro_batch_size=t.micro_batch_size or 8)
                self.teacher.topk_id_limit = self._topk_id_limit(self.teacher.vocab_size)
            else:
                from megatron_opd.rollout.base import eos_ids_from
                from megatron_opd.rollout.server import api_key_from_env
                from megatron_opd.teacher.sglang import SGLangTeacher

                eos = eos_ids_from(self.cfg.model.hf_path)
                # the served model's config.vocab_size (SGLang labels its last id as 0: teacher/sglang.py)
                vocab = AutoConfig.from_pretrained(t.hf_path or self.cfg.model.hf_path).vocab_size
                self.teacher = SGLangTeacher(t.server_url or self._launch_teacher_server(), eos_token_ids=eos,
                                             micro_batch_size=t.micro_batch_size or 8, retries=t.retries,
                                             api_key=api_key_from_env(t.api_key_env), vocab_size=vocab)

    @contextlib.contextmanager
    def _teacher_weights(self) -> Iterator[None]:
        """The in-process teacher's weights on their device for a scoring phase, parked in host memory
        after it when teacher.offload is set (models/offload.py)."""
        off = self._teacher_offloader
        if off is not None:
            off.restore()
        try:
            yield
        finally:
            if off is not None:
                off.offload()

    def _build_layout_teacher(self) -> None:
        """An in-process megatron teacher laid out teacher.tensor_model_parallel_size x
        pipeline_model_parallel_size over the same ranks as the student, through its own process groups.
        It scores the step's sequences after they are broadcast (`_score_with_layout_teacher`)."""
        from megatron_opd.models.parallel import make_layout
        from megatron_opd.teacher.megatron import MegatronTeacher

        t = self.cfg.teacher
        world = dist.get_world_size() if dist.is_initialized() else 1
        size = t.tensor_model_parallel_size * t.pipeline_model_parallel_size
        if world % size:
            raise ConfigError(f"teacher.tensor_model_parallel_size x pipeline_model_parallel_size = {size} does not "
                             f"divide the {world} ranks the teacher shares with the student")
        self.layout_teacher = MegatronTeacher.from_hf(
            t.hf_path, micro_batch_size=t.micro_batch_size or 8, layer_spec=self.cfg.model.layer_spec,
            params_dtype=resolve_dtype(t.params_dtype), pad_token_id=self.pad_id,
            layout=make_layout(t.tensor_model_parallel_size, t.pipeline_model_parallel_size))
        self.layout_teacher.topk_id_limit = self._topk_id_limit(self.layout_teacher.vocab_size)

    def _score_with_layout_teacher(self, items: list[SequenceItem]) -> dict[Any, Any]:
        """Teacher scores of every sequence of the step, on every rank: each teacher replica (a TP x PP
        group) scores a contiguous share, the shares are gathered over the replicas."""
        teacher, algo = self.layout_teacher, self.cfg.algo
        lay = teacher.layout
        roll = [i for i, it in enumerate(items) if not it.is_golden]
        gold = [i for i, it in enumerate(items) if it.is_golden] if (
            algo.golden_loss == "fkl_topk" and algo.lambda_gold > 0) else []

        def share(idx: list[int]) -> list[int]:
            bounds = [round(r * len(idx) / lay.dp) for r in range(lay.dp + 1)]
            return idx[bounds[lay.dp_rank]:bounds[lay.dp_rank + 1]]

        mine_roll, mine_gold = share(roll), share(gold)
        try:
            rs = teacher.score([items[i].prompt_ids for i in mine_roll], [items[i].response_ids for i in mine_roll])
            gs = teacher.score([items[i].prompt_ids for i in mine_gold], [items[i].response_ids for i in mine_gold],
                               top_k=self.cfg.teacher.top_k) if gold else []
            part: dict[str, Any] = {"logp": {i: s.logprobs.tolist() for i, s in zip(mine_roll, rs)},
                                    "topk": {i: (s.topk_ids, s.topk_logprobs) for i, s in zip(mine_gold, gs)}}
        except Exception as e:  # noqa: BLE001 - sent to the other replicas, which would wait in the gather
            if lay.replica_group is None:
                raise
            part = {"error": f"teacher replica {lay.dp_rank} (rank {self.rank}): {type(e).__name__}: {e}"}
        parts = [part]
        if lay.replica_group is not None:
            parts = [None] * lay.dp
            dist.all_gather_object(parts, part, group=lay.replica_group)
        errors = [p["error"] for p in parts if "error" in p]
        if errors:
            raise RuntimeError("teacher scoring failed: " + "; ".join(errors))
        out: dict[Any, Any] = {i: lp for p in parts for i, lp in p["logp"].items()}
        if gold:
            out["topk"] = {i: v for p in parts for i, v in p["topk"].items()}
        return out

    def _launch_teacher_server(self) -> Any:
        """teacher.backend=sglang without teacher.server_url: serve teacher.hf_path on a free loopback port,
        with a per-run --api-key (the key of $teacher.api_key_env if set, else a generated one)."""
        from megatron_opd.rollout.server import ServerProcess, api_key_from_env, sglang_cli_args, sglang_server_cmd

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        key = api_key_from_env(self.cfg.teacher.api_key_env) or secrets.token_hex(24)
        self._teacher_server = ServerProcess(
            sglang_server_cmd(self.cfg.teacher.hf_path, "127.0.0.1", port,
                              [*sglang_cli_args(self.cfg.teacher.sglang_args), "--api-key", key]), port=port,
            log_path=self.out_dir / "logs" / "sglang_teacher.log", api_key=key).start()
        return self._teacher_server

    def _build_engine(self) -> Any:
        """The rollout engine, from rollout.* through the one factory (see rollout/__init__.py)."""
        from megatron_opd.rollout import make_rollout_engine

        return make_rollout_engine(self.cfg.rollout, self.cfg.model.hf_path, pad_token_id=self.pad_id,
                                   log_path=str(self.out_dir / "logs" / "sglang_rollout.log"),
                                   dtype=self.student.dtype if self.cfg.rollout.dtype == "auto"
                                   else resolve_dtype(self.cfg.rollout.dtype))

    def _share_engine_weights(self) -> None:
        """A local engine beside a TP=PP=1 student of its dtype decodes from the student's own parameter
        storage (`LocalEngine.share_weights`) rather than a second copy of the weights; only q/k/v, which
        megatron stores fused, are still copied at each sync. Not with rollout.overlap: that generates while
        the optimizer updates the weights."""
        from megatron_opd.rollout.local import LocalEngine

        self.engine_shared_bytes = 0
        p = self.cfg.parallel
        if (not isinstance(self.engine, LocalEngine) or self.cfg.rollout.overlap
                or p.tensor_model_parallel_size * p.pipeline_model_parallel_size != 1):
            return
        engine_dtype = next(self.engine.model.parameters()).dtype
        storages = {q.untyped_storage().data_ptr() for q in self.student.model.parameters()}
        views = [(n, t) for n, t in self.student.iter_hf_weights()
                 if t.dtype == engine_dtype and t.untyped_storage().data_ptr() in storages]
        shared = self.engine.share_weights(views)
        if shared:
            logger.info("rollout engine shares %.0f MB of weights with the student (no second copy)", shared / 2**20)
        self.engine_shared_bytes = shared

    def _load_eval_sets(self) -> dict[str, Any]:
        from megatron_opd.eval.benchmarks import load_benchmark

        sets = {}
        for item in self.cfg.data.eval_paths:
            name, path = eval_set_name(item)
            sets[name] = load_benchmark(name, path, self.tokenizer, self.cfg.data)
        return sets

    # -- one step ------------------------------------------------------------------------------

    def _rollout(self, step: int, version: int) -> dict[str, Any]:
        """Controller (rank 0): prompts -> rollouts + golden -> teacher scores, for training step `step`
        with the engine at weight version `version`. Returns the payload all ranks train on."""
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
                                seed=cfg.rollout.seed + step)
            samples = self.engine.generate([r.prompt_ids for r in records], sp)
            assert_fresh(samples, version)
            for s in samples:
                items.append(SequenceItem(s.prompt_ids, s.response_ids, truncated=s.truncated,
                                          behaviour_logprobs=s.logprobs, prompt_index=s.prompt_index))
                texts.append(self.tokenizer.decode(s.response_ids, skip_special_tokens=True))
                prompt_texts.append(records[s.prompt_index].prompt)
        with_gold = [i for i, r in enumerate(records) if r.has_solution]
        n_gold = golden_count(len(items), cfg.algo.mixture_ratio, len(records)) if with_gold else 0
        stop_ids = list(self.engine.eos_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        for j in golden_prompt_picks(len(with_gold), n_gold, step):
            i = with_gold[j]
            sol, cut = golden_response(records[i].solution_ids, stop_ids, cfg.rollout.max_new_tokens,
                                       eos_id=eos if isinstance(eos, int) else None)
            items.append(SequenceItem(records[i].prompt_ids, sol, is_golden=True, truncated=cut, prompt_index=i))
        excess = len(items) % self.dp_size
        golden_idx = [i for i, it in enumerate(items) if it.is_golden]
        if excess > len(golden_idx):
            raise RuntimeError(f"step {step}: {len(items)} sequences cannot be split evenly over "
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
                limit = self._topk_id_limit(getattr(self.teacher, "vocab_size", None) or self.student.vocab_size)
                worst = max((int(s.topk_ids.max()) for s in gs if s.topk_ids is not None and s.topk_ids.numel()),
                            default=-1)
                if worst >= limit:
                    raise ValueError(f"teacher top-{cfg.teacher.top_k}: id {worst} is outside the ids the student "
                                     f"has (< {limit}); serve a teacher whose vocab matches (teacher/fidelity.py)")
                teacher["topk"] = {i: (s.topk_ids, s.topk_logprobs) for i, s in zip(gold, gs)}
        return {"items": items, "teacher": teacher, "texts": texts, "prompt_texts": prompt_texts,
                "records": [r.id for r in records], "weight_version": version}

    # -- one-step off-policy overlap (rollout.overlap) ----------------------------------------------

    def _next_payload(self) -> dict[str, Any]:
        """Rank 0: this step's payload -- the one generated in the background during the previous step
        (rollout.overlap), else a fresh on-policy rollout."""
        ready, self._pending_payload = self._pending_payload, None
        if isinstance(ready, BaseException):  # raised where a synchronous rollout would have raised
            raise ready
        return ready if ready is not None else self._rollout(self.step, self.weight_version)

    def _start_next_rollout(self) -> None:
        """rollout.overlap: generate the next step's rollouts on a background thread with the current
        (not yet updated) weights while this step trains; `_finish_next_rollout` joins it before the
        weight sync, so the engine never changes weights mid-generation."""
        if not self.cfg.rollout.overlap or self.rank != 0 or self.step + 1 >= self.cfg.train.steps:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout")
        self._pending_future = self._executor.submit(self._rollout, self.step + 1, self.weight_version)

    def _finish_next_rollout(self) -> None:
        future, self._pending_future = self._pending_future, None
        if future is not None:
            error = future.exception()
            self._pending_payload = error if error is not None else future.result()

    def _drop_next_rollout(self) -> None:
        """A rollback: rollouts of the abandoned weights must not train the restored ones."""
        self._finish_next_rollout()
        self._pending_payload = None

    def _off_policy_old_logp(self, batch: TrainBatch, payload: dict[str, Any]) -> Optional[torch.Tensor]:
        """pi_old for rollouts the engine generated with older weights than the trainer's (rollout.overlap):
        the engine's behaviour log-probs, so the importance ratio pi_theta / pi_old and the advantage
        log pi_teacher - log pi_old refer to the policy that sampled the tokens. None when on-policy."""
        if payload.get("weight_version", self.weight_version) == self.weight_version:
            return None
        if batch.behaviour_logp is None:
            raise RuntimeError("rollout.overlap: the rollout engine returned no log-probs for the off-policy "
                               "rollouts; the importance ratio needs the behaviour policy's log-probs")
        return batch.behaviour_logp.masked_fill(batch.is_golden[:, None], 0.0)

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

    def _teacher_mbs(self) -> int:
        """The megatron teacher in the student's layout: teacher.micro_batch_size, else train.micro_batch_size."""
        return self.cfg.teacher.micro_batch_size or self.cfg.train.micro_batch_size

    def _attach_teacher_topk(self, batch: TrainBatch) -> None:
        """In-process megatron teacher: its top-k ids / log-probs at the golden rows' response positions
        (teacher_topk_ids / teacher_topk_logp, zeros elsewhere) for golden_loss=fkl_topk."""
        algo = self.cfg.algo
        if not (algo.golden_loss == "fkl_topk" and algo.lambda_gold > 0 and bool(batch.is_golden.any())):
            return
        ids, lps = self.teacher_policy.score_topk(batch, self.cfg.teacher.top_k, batch.is_golden,
                                                  micro_batch_size=self._teacher_mbs(),
                                                  id_limit=self._topk_id_limit(self.teacher_policy.vocab_size))
        batch.extras["teacher_topk_ids"], batch.extras["teacher_topk_logp"] = ids, lps

    def _adv_stats(self, mb: TrainBatch, algo: Any) -> tuple[float, float, float]:
        """(sum, sum of squares, count) of the advantage before whitening over the policy tokens of the
        whole minibatch, all-reduced over data-parallel ranks: adv_normalize whitens with these, so
        the result does not depend on train.micro_batch_size or the data-parallel size."""
        from megatron_opd.algo.advantages import compute_advantages, whitening_stats

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
        from megatron_opd.algo.objective import term_masks

        masks = term_masks(algo, mb.response_mask, mb.is_golden, mb.truncated)
        names = sorted(masks)
        local = torch.tensor([[float(masks[k].sum()), float((masks[k].sum(-1) > 0).sum())] for k in names],
                             dtype=torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(local, group=host_group("dp"))
        return {k: (float(local[i, 0]), float(local[i, 1])) for i, k in enumerate(names)}

    def _micro_batches(self, batch: TrainBatch, rows: list[int]) -> list[TrainBatch]:
        return split_micro_batches(batch, rows, self.cfg.train.micro_batch_size, self.student.seq_multiple,
                                   own_length=self.cfg.parallel.pipeline_model_parallel_size == 1)

    def _ref_logits_source(self, micro: list[TrainBatch]):
        """Reference logits for full-vocabulary KL, one micro-batch at a time (docs/scaling.md).

        PP=1: a callable the student's schedule runs right before each micro-batch's forward (one
        reference forward of exactly that micro-batch; the [b, S, V/tp] logits live only inside it).
        PP>1: the loss lives on the last stage and the reference needs its own pipeline pass, which
        cannot run inside the student's 1F1B schedule: one forward-only pass over this minibatch's
        micro-batches right before it trains, keeping [N_minibatch, V/tp] in the model's dtype (a
        bounded per-minibatch cache), each micro-batch's share dropped once its loss is computed."""
        if self.cfg.parallel.pipeline_model_parallel_size == 1:
            return self.ref.micro_response_logits
        for part, logits in zip(micro, self.ref.response_logits_for(micro)):
            part.ref_logits = logits
        return None

    def _loss_fn(self, mb: TrainBatch, n_micro: int = 1):
        """The loss closure for one minibatch `mb` (all its micro-batches). Every term is normalised by
        whole-minibatch counts, so micro-batch and data-parallel shares add up to the minibatch loss;
        megatron averages over micro-batches and DDP over ranks, hence the `dp * n_micro` scale."""
        from megatron_opd.algo.objective import stable_opd_loss

        algo = replace(self.cfg.algo, beta_kl=self.beta_kl,
                       loss_agg_constant=self.cfg.algo.loss_agg_constant or float(self.cfg.rollout.max_new_tokens))
        full_kl = self.beta_kl > 0 and algo.kl_estimator == "full"
        counts = self._global_counts(mb, algo)
        adv_stats = self._adv_stats(mb, algo) if algo.adv_normalize else None
        scale = self.dp_size * n_micro

        def loss_fn(logp, resp_logits, batch, logits):
            if "old_logp" not in batch.extras:  # pi_old from this forward (`_reuse_old_logp`)
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
            for k in ("total_loss", "pg_loss", "kl", "golden_loss"):  # shares -> whole-minibatch values
                if k in stats:
                    stats[k] *= scale
            return loss * scale, stats

        return loss_fn, full_kl

    def _reuse_old_logp(self, batch_size: int) -> bool:
        """pi_old = the training forward's detached log-probs, instead of a separate scoring pass, when
        the step makes exactly one update (ppo_epochs=1, one minibatch): the policy that forward runs is
        the one that generated the rollouts' weights, so the importance ratio is exactly 1 either way.
        Not with adv_normalize (its whitening statistics need every pi_old before the first loss) nor
        with dropout (a training forward would differ from a scoring one). train.reuse_old_logp=false
        always scores pi_old separately."""
        algo = self.cfg.algo
        return (self.cfg.train.reuse_old_logp and algo.ppo_epochs == 1 and min(algo.num_minibatches, batch_size) == 1
                and not algo.adv_normalize and self.student.dropout_free)

    def _write_back(self, key: str, micro: TrainBatch) -> None:
        """Copy a micro-batch's per-token `micro.extras[key]` into this step's `self._derived[key]` [B, T]
        (the step batch's layout, on the CPU), so metrics see it as if it had been scored up front."""
        sink = self._derived.get(key)
        if sink is None or micro.source_rows is None:
            return
        src = micro.source_rows.cpu()
        keep = src >= 0
        vals = micro.extras[key].detach().float().cpu()[keep]
        sink[src[keep], : vals.shape[1]] = vals

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.time()
        payload = _broadcast(self._next_payload() if self.rank == 0 else None)
        self._last_payload = payload
        self._start_next_rollout()
        if self._pending_future is None:
            self._release_engine()
        t_rollout = time.time() - t0
        t_score0 = time.time()
        if self.layout_teacher is not None:
            with self._teacher_weights():
                payload["teacher"] = self._score_with_layout_teacher(payload["items"])
        items = payload["items"]
        per_rank = len(items) // self.dp_size
        rows = list(range(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank))
        batch = build_batch([items[i] for i in rows], self.pad_id, pad_to_multiple=self.student.seq_multiple)
        self._attach_scores(batch, payload, rows)
        mbs = cfg.train.micro_batch_size
        off_policy_old = self._off_policy_old_logp(batch, payload)
        reuse = off_policy_old is None and self._reuse_old_logp(batch.batch_size)
        full_kl = self.beta_kl > 0 and cfg.algo.kl_estimator == "full"
        # per-token inputs the loss closures fill in themselves (see _loss_fn), collected here for metrics
        # (NaN until written: a micro-batch whose update is skipped before its loss leaves them non-finite)
        self._derived = {k: torch.zeros(batch.response_mask.shape).masked_fill(batch.response_mask, float("nan"))
                         for k, on in (("old_logp", reuse), ("ref_logp", full_kl and self.ref is not None)) if on}
        old_logp = off_policy_old if off_policy_old is not None else (
            None if reuse else self.student.score(batch, micro_batch_size=mbs)[0])
        if self.teacher_policy is not None:
            with self._teacher_weights():
                batch.extras["teacher_logp"], _ = self.teacher_policy.score(
                    batch, micro_batch_size=self._teacher_mbs())
                self._attach_teacher_topk(batch)
        if self.ref is not None and not full_kl:  # full KL: ref log-probs come with its per-micro-batch logits
            ref_logp, _ = self.ref.score(batch, micro_batch_size=mbs)
            if ref_logp is not None:
                batch.extras["ref_logp"] = ref_logp
        if not self.is_last_stage:  # non-last stages only run the model body; the loss lives on the last stage
            batch.extras["old_logp"] = torch.zeros(batch.response_mask.shape)
            batch.extras.setdefault("teacher_logp", torch.zeros(batch.response_mask.shape))
        elif old_logp is not None:
            batch.extras["old_logp"] = old_logp

        t1 = time.time()
        t_score = t1 - t_score0
        train_stats: list[dict[str, float]] = []
        n_mb = min(cfg.algo.num_minibatches, batch.batch_size)
        bounds = [round(i * batch.batch_size / n_mb) for i in range(n_mb + 1)]
        for _epoch in range(cfg.algo.ppo_epochs):  # full KL recomputes reference logits in every epoch
            for a, b in zip(bounds[:-1], bounds[1:]):
                rows = list(range(a, b))
                micro = self._micro_batches(batch, rows)
                loss_fn, want_logits = self._loss_fn(batch.select(rows), len(micro))
                ref_source = self._ref_logits_source(micro) if full_kl else None
                train_stats.append(self.student.train_minibatch(micro, loss_fn, want_logits, ref_logits=ref_source))
        t_train = time.time() - t1
        if self.is_last_stage:
            batch.extras.update(self._derived)
        self._derived = {}

        t2 = time.time()
        self._finish_next_rollout()
        t_wait = time.time() - t2
        self.weight_version += 1
        self._sync_weights()
        t_sync = time.time() - t2 - t_wait

        metrics = self._metrics(batch, payload, rows, train_stats)
        metrics.update({"time/rollout_s": t_rollout, "time/score_s": t_score, "time/train_s": t_train,
                        "time/sync_s": t_sync, "time/rollout_wait_s": t_wait,
                        "rollout/staleness": float(self.weight_version - 1 - payload.get("weight_version", 0)),
                        "time/step_s": time.time() - t0, "train/beta_kl": self.beta_kl,
                        "train/weight_version": float(self.weight_version)})
        self.step += 1
        self._check_engine_parity(metrics)
        return metrics

    def _release_engine(self) -> None:
        """Colocated SGLang: free the engine's accelerator memory while the trainer works (resumed by
        _sync_weights before the next generation)."""
        from megatron_opd.rollout import release_engine_memory

        if self.rank == 0:
            release_engine_memory(self.engine, self.cfg.rollout)

    def _sync_weights(self) -> None:
        """New weights to the rollout engine: tensor or distributed path per rollout.colocate (rollout.sync_weights)."""
        from megatron_opd.rollout import sync_weights

        weights = self.student.iter_hf_weights()
        if self.rank == 0:
            sync_weights(self.engine, weights, self.weight_version, self.cfg.rollout, self.cfg.parallel.backend)
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
            lps = {k: batch.extras.get(k) for k in ("old_logp", "teacher_logp", "ref_logp")}
            finite = all(v is None or bool(torch.isfinite(v[batch.response_mask]).all()) for v in lps.values())
            if not finite:  # every rank skipped this step's update (train_minibatch); log what is still valid
                adv, lps = None, {}
            local = rollout_health(batch.response_mask, token_ids=batch.response_ids, truncated=batch.truncated,
                                   advantages=adv, logp=lps.get("old_logp"), teacher_logp=lps.get("teacher_logp"),
                                   ref_logp=lps.get("ref_logp"), is_golden=batch.is_golden,
                                   config=self.cfg.train.health)
            local["health/nonfinite_logp"] = float(not finite)
            keys = sorted({k for s in train_stats for k in s})
            for k in keys:
                vals = [s[k] for s in train_stats if k in s and s[k] is not None and math.isfinite(s[k])]
                local[f"loss/{k}"] = sum(vals) / len(vals) if vals else float("nan")
            if batch.behaviour_logp is not None:
                roll = batch.response_mask & ~batch.is_golden[:, None]
                if roll.any():
                    diff = (batch.behaviour_logp - batch.extras["old_logp"]).abs()[roll]
                    local["rollout/engine_trainer_logp_absdiff"] = float(diff.mean())
                    local["rollout/engine_trainer_logp_absdiff_max"] = float(diff.max())
        gathered = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        merged: dict[str, float] = {}
        reporters = [g for g in gathered if g]
        for k in sorted({k for g in reporters for k in g}):
            vals = [g[k] for g in reporters if k in g and g[k] is not None and math.isfinite(g[k])]
            reduce = max if k.endswith("_max") else (lambda v: sum(v) / len(v))  # a max over ranks, not a mean
            merged[k] = reduce(vals) if vals else float("nan")
        if self.rank == 0:  # text-level metrics over the whole step (every rollout, all DP ranks)
            texts = payload["texts"]
            text_metrics = rollout_health(
                torch.ones((len(texts), 1), dtype=torch.bool), response_texts=texts,
                truncated=[it.truncated for it in payload["items"] if not it.is_golden][: len(texts)],
                config=self.cfg.train.health) if texts else {}
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

    # -- collapse actions ----------------------------------------------------------------------
    #
    # A verdict of the detector (train.collapse.*) triggers train.collapse_action after the step's metrics
    # are logged:
    #   warn           log a warning; `health/collapsed` = 1 in the step's metrics.
    #   stop           checkpoint the step, raise TrainingStopped (the CLI exits with status 3).
    #   raise_beta_kl  beta_kl <- max(2 * beta_kl, 0.01) from the next step on (pi_ref is built if it was not),
    #                  the detector restarts its history; the step's checkpoint carries the new beta_kl.
    #   rollback       restore the newest checkpoint from before the detector's evidence (step <= current -
    #                  window - patience + 1; else the oldest kept one; with none, act as raise_beta_kl) and
    #                  re-train from it with the raised beta_kl. Restored: policy weights and optimizer, step,
    #                  skipped-step count. Not restored, on purpose: the prompt sampler and the RNGs continue,
    #                  so the re-trained steps see new prompts rather than replaying the batches that led
    #                  into the collapse. The weight version keeps increasing (the rollout engine only
    #                  accepts newer versions; rollouts stay checked against it). The rolled-back state is
    #                  saved at once under its step (`latest` points at it) and the abandoned newer
    #                  checkpoints are deleted, so a resume continues the rolled-back run.

    def _handle_collapse(self, metrics: dict[str, float]) -> Optional[str]:
        """Judge this step: sets metrics['health/collapsed'] and 'health/collapse_events' and returns
        train.collapse_action when a collapse is detected (applied by `_apply_collapse_action`), else None."""
        verdict = self.detector.update(metrics, step=self.step) if self.rank == 0 else None
        flag, reasons, good = _broadcast((bool(verdict.collapsed), "; ".join(verdict.reasons), verdict.good_step)
                                         if verdict is not None else (False, "", None))
        metrics["health/collapsed"] = float(flag)
        if flag:
            self.collapse_events += 1
        metrics["health/collapse_events"] = float(self.collapse_events)
        if not flag:
            return None
        self._collapse_reasons, self._collapse_good_step = reasons, good
        action = self.cfg.train.collapse_action
        if self.rank == 0:
            logger.warning("step %d: collapse detected (%s); action=%s", self.step, reasons, action)
        return action

    def _apply_collapse_action(self, action: str) -> bool:
        """Apply a collapse action; True when the run was rolled back (the step's state is abandoned)."""
        if action == "warn":
            return False
        if action == "stop":
            self.save()
            raise TrainingStopped(f"collapse detected at step {self.step}: {getattr(self, '_collapse_reasons', '')}")
        if action == "rollback":
            if self.rollbacks >= self.cfg.train.max_rollbacks:
                self.save()
                raise TrainingStopped(f"collapse detected at step {self.step} after {self.rollbacks} rollback(s) "
                                      f"(train.max_rollbacks={self.cfg.train.max_rollbacks}): "
                                      f"{getattr(self, '_collapse_reasons', '')}")
            target = self._rollback_target()
            if target is not None:
                self.rollbacks += 1
                self._rollback(target)
                return True
            if self.rank == 0:
                logger.warning("step %d: no checkpoint to roll back to; raising beta_kl instead", self.step)
        self.beta_kl = max(2 * self.beta_kl, 0.01)
        self._ensure_ref()
        self.detector.reset(keep_best_accuracy=True)
        if self.rank == 0:
            logger.warning("step %d: beta_kl raised to %g", self.step, self.beta_kl)
        return False

    def _rollback_target(self) -> Optional[int]:
        """The newest complete checkpoint from before the detector's evidence (the verdict's good_step: before
        the rollout rules' windows, at the best evaluation for the accuracy rule), else the oldest kept one."""
        steps = [s for s in self.ckpt.steps() if s < self.step] if self.rank == 0 else []
        before = [s for s in steps if s <= self._collapse_good_step]
        return _broadcast(before[-1] if before else (steps[0] if steps else None))

    def _rollback(self, target: int) -> None:
        collapsed_at, beta_at_collapse = self.step, self.beta_kl
        self._drop_next_rollout()
        step, state = self.ckpt.load(target)
        self.student.load_state_dict(state["policy"])
        self.step, self.skipped_steps = int(state["step"]), int(state["skipped_steps"])
        self.beta_kl = max(2 * max(beta_at_collapse, float(state["beta_kl"])), 0.01)
        self.detector.reset(keep_best_accuracy=True)
        self._ensure_ref()
        self._push_restored_weights(int(state["weight_version"]))
        dropped = [s for s in self.ckpt.steps() if s > self.step] if self.rank == 0 else []
        self.save()  # `latest` -> the rolled-back state, with its raised beta_kl; prunes the newer ones
        if self.rank == 0:
            logger.warning("step %d: rolled back to the checkpoint of step %d; beta_kl %g -> %g; weight version "
                           "%d; discarded checkpoints %s", collapsed_at, step, beta_at_collapse, self.beta_kl,
                           self.weight_version, dropped or "none")

    def _push_restored_weights(self, restored_version: int) -> None:
        """Push restored weights under a version the engine accepts: the restored one when it is newer than
        the engine's (a fresh engine on resume: unchanged numbering), else the engine's + 1 (a rollback, or
        a long-lived server that already holds a later version)."""
        engine_version = _broadcast(int(getattr(self.engine, "weight_version", 0)) if self.rank == 0 else None)
        self.weight_version = max(restored_version, engine_version + 1)
        self._sync_weights()

    def train(self, stop_after: Optional[int] = None) -> dict[str, float]:
        """Run to train.steps, or return early after `stop_after` steps of this call (a time-limited
        job slice; the last step is checkpointed so the next call resumes from it). Steps re-trained
        after a rollback count towards `stop_after`, so a slice never overruns its time limit."""
        cfg = self.cfg
        ran = 0
        bar = None
        if self.rank == 0 and cfg.logging.progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.train.steps, initial=self.step, desc=cfg.algo.preset, dynamic_ncols=True)
        last: dict[str, float] = {}
        if cfg.train.eval_every and cfg.train.eval_before_train and self.step == 0 and cfg.train.steps > 0:
            start = self.evaluate()
            if start:
                self.log.log(0, start)
                if self.rank == 0:
                    self.detector.observe_eval(start, step=0)
        try:
            while self.step < cfg.train.steps and (stop_after is None or ran < stop_after):
                metrics = self.train_step()
                ran += 1
                if metrics.get("loss/update_skipped", 0.0) > 0:
                    self.skipped_steps += 1
                metrics["train/skipped_steps"] = float(self.skipped_steps)
                if cfg.train.eval_every and (self.step % cfg.train.eval_every == 0 or self.step == cfg.train.steps):
                    metrics.update(self.evaluate())
                action = self._handle_collapse(metrics)
                if self.step % cfg.logging.log_every == 0 or self.step == cfg.train.steps:
                    self.log.log(self.step, metrics)
                if self.rank == 0 and cfg.logging.sample_every and self.step % cfg.logging.sample_every == 1 % cfg.logging.sample_every:
                    self._log_samples()
                if action is not None and self._apply_collapse_action(action):  # rolled back: step re-trained
                    last = metrics
                    if bar is not None:
                        bar.n = self.step
                        bar.refresh()
                    continue
                saved = (self.step % cfg.checkpoint.save_every == 0 or self.step == cfg.train.steps
                         or ran == stop_after)
                if saved:
                    self.save()
                reason = self.preempt.requested()
                if reason:
                    if not saved:
                        self.save()
                    self.preempt.mark(self.step, reason)
                    raise Preempted(self.step, reason)
                last = metrics
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3g}" for k in (
                        "rollout/response_len_mean", "rollout/truncation_rate", "loss/total_loss", "loss/kl")
                        if k in metrics and metrics[k] == metrics[k]})
            # rank 0 decides (export is collective; out_dir need not be shared): after training, or when a
            # finished run was killed before its export
            if cfg.checkpoint.export_hf and self.step >= cfg.train.steps and _broadcast(
                    bool(ran) or not self.hf_dir.is_dir()):
                self.export_hf()
        finally:
            if bar is not None:
                bar.close()
        return last

    @property
    def hf_dir(self) -> Path:
        return self.out_dir / "hf"

    def export_hf(self, out: Optional[Path] = None) -> Path:
        """The student as an HF directory (default `<logging.out_dir>/hf`, replaced atomically): safetensors,
        config and the tokenizer files of model.hf_path, plus `opd_meta.json` (step, preset, source).
        Collective: every rank calls it."""
        from megatron_opd.models.checkpoint import commit_partial, prepare_partial, write_hf_dir

        out = Path(out) if out is not None else self.hf_dir
        meta = {"source_model": str(self.cfg.model.hf_path), "step": self.step, "preset": self.cfg.algo.preset,
                "weight_version": self.weight_version, "run": str(self.out_dir), "made_by": "megatron-opd train"}
        tmp = prepare_partial(out, overwrite=True)
        write_hf_dir(self.student.iter_hf_weights(), self.hf_config, self.cfg.model.hf_path, tmp, EXPORT_META, meta)
        commit_partial(out)
        if self.rank == 0:
            logger.info("wrote the student at step %d as an HF directory: %s", self.step, out)
        return out

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
        if getattr(self, "preempt", None) is not None:
            self.preempt.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self.log.close()
        if self.engine is not None:
            self.engine.shutdown()
        if getattr(self, "_teacher_server", None) is not None:
            self._teacher_server.shutdown()

    # -- checkpoint --------------------------------------------------------------------------------

    def save(self) -> None:
        state = {"policy": self.student.state_dict(), "rng": rng_state(), "step": self.step,
                 "weight_version": self.weight_version, "beta_kl": self.beta_kl, "skipped_steps": self.skipped_steps,
                 "sampler": self.sampler.state_dict(), "collapse_events": self.collapse_events,
                 "rollbacks": self.rollbacks}
        if self.rank == 0:
            state["detector"] = self.detector.state_dict()
            if isinstance(self._pending_payload, dict):  # rollout.overlap: the next step's rollouts, for an exact resume
                state["next_payload"] = _payload_state(self._pending_payload)
        self.ckpt.save(self.step, state, meta={"beta_kl": self.beta_kl})

    def resume(self, step: Optional[int] = None) -> None:
        """Restore the checkpoint of `step` (default: the one rank 0 finds as latest, agreed by all ranks)."""
        if step is None:
            step = _broadcast(self.ckpt.latest_step() if self.rank == 0 else None)
            if step is None:
                raise FileNotFoundError(f"no checkpoint under {self.ckpt.root}")
        step, state = self.ckpt.load(step)
        self.student.load_state_dict(state["policy"])
        self.step, self.skipped_steps = int(state["step"]), int(state["skipped_steps"])
        self.beta_kl = float(state["beta_kl"])  # may exceed algo.beta_kl after raise_beta_kl / rollback
        if self.beta_kl != self.cfg.algo.beta_kl and self.rank == 0:
            logger.warning("resuming with the checkpoint's beta_kl=%g, not algo.beta_kl=%g (a collapse action "
                           "raised it, or the config changed since)", self.beta_kl, self.cfg.algo.beta_kl)
        self.collapse_events = int(state.get("collapse_events", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        self._ensure_ref()  # before the RNGs are restored: building a model may draw from them
        set_rng_state(state["rng"])
        self.sampler.load_state_dict(state["sampler"])
        if state.get("next_payload") is not None:
            self._pending_payload = _payload_from_state(state["next_payload"])
        if "detector" in state:
            try:
                self.detector.load_state_dict(state["detector"])
            except ValueError as e:  # train.collapse windows changed since the checkpoint
                logger.warning("collapse detector restarts its history: %s", e)
        self._push_restored_weights(int(state["weight_version"]))
        if self.rank == 0:
            logger.info("resumed from %s at step %d", self.ckpt.root, step)
