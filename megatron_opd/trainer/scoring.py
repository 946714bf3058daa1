"""The scoring stage of a step: the teacher (one of four placements) and the reference pi_ref.

Teacher placements (docs/design.md, "Teacher placement"):
- ``hf`` / ``sglang``: an external teacher on the controller (rank 0), asked from the rollout stage
  (`controller_scores`), so with rollout.overlap it scores in the background too;
- ``megatron`` in the student's TP/PP layout: a frozen `MegatronPolicy` that scores each rank's slice;
- ``megatron`` in its own layout: scores every broadcast sequence, shared over its replicas.
The reference is the initial student, frozen; built at start when beta_kl > 0, or later when a collapse
action raises beta_kl from 0.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from transformers import AutoConfig

from megatron_opd.config import Config, ConfigError
from megatron_opd.models.offload import WeightOffloader
from megatron_opd.models.parallel import free_port, make_layout
from megatron_opd.models.weight_mapping import load_hf_state_dict
from megatron_opd.rollout.base import eos_ids_from
from megatron_opd.rollout.server import (ServerError, ServerProcess, api_key_from_env, http_json, sglang_cli_args,
                                         sglang_server_cmd)
from megatron_opd.teacher.fidelity import check_pair, topk_id_limit
from megatron_opd.teacher.hf import HFTeacher
from megatron_opd.teacher.megatron import MegatronTeacher
from megatron_opd.teacher.sglang import SGLangTeacher
from megatron_opd.trainer.batch import SequenceItem, TrainBatch
from megatron_opd.trainer.policy import MegatronPolicy, resolve_dtype

logger = logging.getLogger("megatron_opd.trainer")


def served_model_files(url: str, api_key: Optional[str] = None) -> Optional[Path]:
    """The tokenizer/config directory a teacher server reports (`/get_model_info`), when it is readable
    here (a shared filesystem); None otherwise."""
    try:
        info = http_json(url.rstrip("/") + "/get_model_info", timeout=10.0, api_key=api_key)
    except (ServerError, OSError, ValueError):
        return None
    for key in ("tokenizer_path", "model_path"):
        path = info.get(key) if isinstance(info, dict) else None
        if path and (Path(path) / "config.json").is_file():
            return Path(path)
    return None


def preflight(cfg: Config, rank: int) -> None:
    """teacher/fidelity.py checks of the student/teacher pair before any model loads (teacher.preflight).
    A teacher given only by URL is checked against teacher.tokenizer_path, else the directory the server
    reports when it is readable here; with neither, preflight=error refuses to start."""
    t = cfg.teacher
    if t.preflight == "off" or t.backend == "hf" and t.hf_path is None:
        return
    files = t.hf_path or t.tokenizer_path
    if files is None and t.server_url:
        files = served_model_files(t.server_url, api_key_from_env(t.api_key_env))
    if files is None:
        msg = (f"teacher.preflight: nothing to check the teacher at teacher.server_url={t.server_url} against "
               "(no teacher.hf_path, no teacher.tokenizer_path, and the server's model directory is not "
               "readable here); set teacher.tokenizer_path to a local copy of the teacher's tokenizer and "
               "config files, or teacher.preflight=warn/off")
        if t.preflight == "error":
            raise ConfigError(msg)
        if rank == 0:
            logger.warning("%s", msg)
        return
    report = check_pair(cfg.model.hf_path, files, chat_template=cfg.data.apply_chat_template)
    if rank == 0:
        logger.info("student/teacher preflight (%s vs %s):\n%s", cfg.model.hf_path, files, report.render())
    if report.errors and t.preflight == "error":
        report.raise_for_errors()
    for f in report.errors if rank == 0 else []:
        logger.warning("teacher.preflight=warn: %s: %s", f.check, f.message)


class Scorer:
    def __init__(self, cfg: Config, *, rank: int, student: MegatronPolicy, tokenizer: Any, pad_id: int,
                 hf_config: Any, student_state: Optional[dict[str, torch.Tensor]], beta_kl: float, out_dir: Path):
        self.cfg, self.rank, self.student, self.tokenizer, self.pad_id = cfg, rank, student, tokenizer, pad_id
        self.out_dir = out_dir
        self.ref: Optional[MegatronPolicy] = self.build_ref(hf_config, student_state) if beta_kl > 0 else None
        self.teacher_policy: Optional[MegatronPolicy] = None  # megatron, the student's layout
        self.teacher: Any = None  # hf / sglang on the controller
        self.layout_teacher: Any = None  # megatron in its own TP/PP (teacher/megatron.py)
        self.teacher_server: Optional[ServerProcess] = None
        self._build_teacher()
        self._offloader = None
        frozen = self.layout_teacher.model if self.layout_teacher is not None else (
            self.teacher_policy.model if self.teacher_policy is not None else None)
        if cfg.teacher.offload and frozen is not None:
            self._offloader = WeightOffloader(frozen)
            self._offloader.offload()

    # -- construction --------------------------------------------------------------------------

    def build_ref(self, hf_config: Any = None, state_dict: Optional[dict[str, torch.Tensor]] = None) -> MegatronPolicy:
        """pi_ref, the initial student (model.hf_path), frozen."""
        path = self.cfg.model.hf_path
        hf_config = hf_config if hf_config is not None else AutoConfig.from_pretrained(path)
        state_dict = state_dict if state_dict is not None else load_hf_state_dict(path)
        dtype = self.cfg.model.ref_params_dtype
        return MegatronPolicy(hf_config, state_dict, self.cfg, trainable=False,
                              params_dtype=None if dtype == "same" else dtype)

    def ensure_ref(self, beta_kl: float) -> None:
        """Build pi_ref once beta_kl becomes > 0 (raised by a collapse action, or restored from a checkpoint
        written after such a raise)."""
        if beta_kl > 0 and self.ref is None:
            self.ref = self.build_ref()

    def topk_limit(self, teacher_vocab: int) -> int:
        return topk_id_limit(self.student.vocab_size, teacher_vocab, len(self.tokenizer))

    def _build_teacher(self) -> None:
        t, p = self.cfg.teacher, self.cfg.parallel
        if t.backend == "megatron":
            if t.hf_path is None:
                raise ValueError("teacher.hf_path: required for teacher.backend=megatron")
            if (t.tensor_model_parallel_size, t.pipeline_model_parallel_size) != (
                    p.tensor_model_parallel_size, p.pipeline_model_parallel_size):
                self._build_layout_teacher()
                return
            self.teacher_policy = MegatronPolicy(AutoConfig.from_pretrained(t.hf_path), load_hf_state_dict(t.hf_path),
                                                 self.cfg, trainable=False, params_dtype=t.params_dtype,
                                                 temperature=1.0)  # the teacher's own distribution
        elif self.rank == 0 and t.backend == "hf":
            self.teacher = HFTeacher.from_pretrained(
                t.hf_path, dtype=resolve_dtype(t.params_dtype),
                device=f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu",
                micro_batch_size=t.micro_batch_size or 8)
            self.teacher.topk_id_limit = self.topk_limit(self.teacher.vocab_size)
        elif self.rank == 0:
            eos = eos_ids_from(self.cfg.model.hf_path)
            # the served model's config.vocab_size (SGLang labels its last id as 0: teacher/sglang.py)
            vocab = AutoConfig.from_pretrained(t.hf_path or t.tokenizer_path or self.cfg.model.hf_path).vocab_size
            self.teacher = SGLangTeacher(t.server_url or self.launch_teacher_server(), eos_token_ids=eos,
                                         micro_batch_size=t.micro_batch_size or 8, retries=t.retries,
                                         api_key=api_key_from_env(t.api_key_env), vocab_size=vocab)

    def _build_layout_teacher(self) -> None:
        """An in-process megatron teacher laid out teacher.tensor_model_parallel_size x
        pipeline_model_parallel_size over the same ranks as the student, through its own process groups."""
        t = self.cfg.teacher
        world = dist.get_world_size() if dist.is_initialized() else 1
        size = t.tensor_model_parallel_size * t.pipeline_model_parallel_size
        if world % size:
            raise ConfigError(f"teacher.tensor_model_parallel_size x pipeline_model_parallel_size = {size} does not "
                              f"divide the {world} ranks the teacher shares with the student")
        self.layout_teacher = MegatronTeacher.from_hf(
            t.hf_path, micro_batch_size=t.micro_batch_size or 8, layer_spec=self.cfg.model.layer_spec,
            params_dtype=resolve_dtype(t.params_dtype), pad_token_id=self.pad_id,
            layout=make_layout(t.tensor_model_parallel_size, t.pipeline_model_parallel_size),
            max_tokens=self.cfg.train.max_tokens_per_microbatch, pack=self.cfg.train.pack_sequences)
        self.layout_teacher.topk_id_limit = self.topk_limit(self.layout_teacher.vocab_size)

    def launch_teacher_server(self) -> ServerProcess:
        """teacher.backend=sglang without teacher.server_url: serve teacher.hf_path on a free loopback port,
        with a per-run --api-key (the key of $teacher.api_key_env if set, else a generated one)."""
        port = free_port()
        key = api_key_from_env(self.cfg.teacher.api_key_env) or secrets.token_hex(24)
        self.teacher_server = ServerProcess(
            sglang_server_cmd(self.cfg.teacher.hf_path, "127.0.0.1", port,
                              sglang_cli_args(self.cfg.teacher.sglang_args)),
            port=port, log_path=self.out_dir / "logs" / "sglang_teacher.log", api_key=key, pass_key=True).start()
        return self.teacher_server

    # -- scoring -------------------------------------------------------------------------------

    @property
    def wants_gold_topk(self) -> bool:
        algo = self.cfg.algo
        return algo.golden_loss == "fkl_topk" and algo.lambda_gold > 0

    def controller_scores(self, items: list[SequenceItem]) -> Optional[dict[Any, Any]]:
        """Controller: the external teacher's log-probs of every rollout row ({row: [T]}) and, for the
        forward-KL golden loss, its top-k on the golden rows (under "topk"). None without such a teacher."""
        if self.teacher is None:
            return None
        roll = [i for i, it in enumerate(items) if not it.is_golden]
        scores = self.teacher.score([items[i].prompt_ids for i in roll], [items[i].response_ids for i in roll])
        out: dict[Any, Any] = {i: s.logprobs.tolist() for i, s in zip(roll, scores)}
        gold = [i for i, it in enumerate(items) if it.is_golden]
        if gold and self.wants_gold_topk:
            k = self.cfg.teacher.top_k
            gs = self.teacher.score([items[i].prompt_ids for i in gold], [items[i].response_ids for i in gold], top_k=k)
            limit = self.topk_limit(getattr(self.teacher, "vocab_size", None) or self.student.vocab_size)
            worst = max((int(s.topk_ids.max()) for s in gs if s.topk_ids is not None and s.topk_ids.numel()),
                        default=-1)
            if worst >= limit:
                raise ValueError(f"teacher top-{k}: id {worst} is outside the ids the student "
                                 f"has (< {limit}); serve a teacher whose vocab matches (teacher/fidelity.py)")
            out["topk"] = {i: (s.topk_ids, s.topk_logprobs) for i, s in zip(gold, gs)}
        return out

    @contextlib.contextmanager
    def _teacher_weights(self) -> Iterator[None]:
        """The in-process teacher's weights on their device for a scoring phase, parked in host memory
        after it when teacher.offload is set (models/offload.py)."""
        if self._offloader is not None:
            self._offloader.restore()
        try:
            yield
        finally:
            if self._offloader is not None:
                self._offloader.offload()

    def score_payload(self, payload: dict[str, Any]) -> None:
        """Collective, layout teacher only: payload["teacher"] for every sequence of the step on every rank.
        Each teacher replica (a TP x PP group) scores a contiguous share; the shares are gathered."""
        if self.layout_teacher is None:
            return
        with self._teacher_weights():
            payload["teacher"] = self._score_with_layout_teacher(payload["items"])

    def _score_with_layout_teacher(self, items: list[SequenceItem]) -> dict[Any, Any]:
        teacher = self.layout_teacher
        lay = teacher.layout
        roll = [i for i, it in enumerate(items) if not it.is_golden]
        gold = [i for i, it in enumerate(items) if it.is_golden] if self.wants_gold_topk else []

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

    def attach(self, batch: TrainBatch, payload: dict[str, Any], rows: list[int]) -> None:
        """The payload's teacher scores (controller or layout teacher) of this rank's `rows` as [B, T]
        teacher_logp and [B, T, K] teacher_topk_ids / teacher_topk_logp in `batch.extras`."""
        scores = payload["teacher"]
        if scores is None:
            return
        B, T = batch.response_mask.shape
        tl = torch.zeros((B, T))
        for b, i in enumerate(rows):
            lp = scores.get(i)
            if lp is not None:
                tl[b, : len(lp)] = torch.tensor(lp)
        batch.extras["teacher_logp"] = tl
        topk = scores.get("topk")
        if topk:
            K = self.cfg.teacher.top_k
            ids, lps = torch.zeros((B, T, K), dtype=torch.long), torch.zeros((B, T, K))
            for b, i in enumerate(rows):
                if i in topk:
                    t_ids, t_lp = topk[i]
                    ids[b, : t_ids.shape[0]], lps[b, : t_lp.shape[0]] = t_ids, t_lp
            batch.extras["teacher_topk_ids"], batch.extras["teacher_topk_logp"] = ids, lps

    def teacher_micro_batch_size(self) -> int:
        """The megatron teacher in the student's layout: teacher.micro_batch_size, else train.micro_batch_size."""
        return self.cfg.teacher.micro_batch_size or self.cfg.train.micro_batch_size

    def score_batch(self, batch: TrainBatch, with_ref_logp: bool) -> None:
        """Collective: the in-layout teacher's log-probs (and top-k on golden rows) and, unless the full KL
        computes them from its per-micro-batch logits, the reference's log-probs, into `batch.extras`."""
        if self.teacher_policy is not None:
            with self._teacher_weights():
                teacher_logp, _ = self.teacher_policy.score(
                    batch, micro_batch_size=self.teacher_micro_batch_size(),
                    max_tokens=self.cfg.train.max_tokens_per_microbatch, pack=self.cfg.train.pack_sequences)
                if teacher_logp is not None:  # None before the last pipeline stage (`Learner.set_old_logp`)
                    batch.extras["teacher_logp"] = teacher_logp
                if self.wants_gold_topk and bool(batch.is_golden.any()):
                    ids, lps = self.teacher_policy.score_topk(
                        batch, self.cfg.teacher.top_k, batch.is_golden, micro_batch_size=self.teacher_micro_batch_size(),
                        id_limit=self.topk_limit(self.teacher_policy.vocab_size))
                    batch.extras["teacher_topk_ids"], batch.extras["teacher_topk_logp"] = ids, lps
        if self.ref is not None and with_ref_logp:
            ref_logp, _ = self.ref.score(batch, micro_batch_size=self.cfg.train.micro_batch_size,
                                         max_tokens=self.cfg.train.max_tokens_per_microbatch,
                                         pack=self.cfg.train.pack_sequences)
            if ref_logp is not None:
                batch.extras["ref_logp"] = ref_logp

    def close(self) -> None:
        if self.teacher_server is not None:
            self.teacher_server.shutdown()
