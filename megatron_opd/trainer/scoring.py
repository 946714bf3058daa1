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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

from megatron_opd.config import Config, ConfigError, TeacherConfig
from megatron_opd.data.prompts import has_chat_template
from megatron_opd.models.offload import WeightOffloader
from megatron_opd.models.parallel import free_port, make_layout
from megatron_opd.models.weight_mapping import SafetensorsReader, load_hf_state_dict
from megatron_opd.rollout.base import eos_ids_from
from megatron_opd.rollout.server import (ServerError, ServerProcess, api_key_from_env, http_json, sglang_cli_args,
                                         sglang_server_cmd)
from megatron_opd.teacher.cross_tokenizer import CrossTokenizerTeacher
from megatron_opd.teacher.fidelity import PairMismatchError, check_cross_pair, check_pair, topk_id_limit
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
    """teacher/fidelity.py checks of each student/teacher pair before any model loads (`<teacher>.preflight`).
    A teacher given only by URL is checked against its tokenizer_path, else the directory the server
    reports when it is readable here; with neither, preflight=error refuses to start."""
    for i, t in enumerate(cfg.all_teachers()):
        _preflight_one(cfg, t, cfg.teacher_key(i), rank)


def _preflight_one(cfg: Config, t: TeacherConfig, key: str, rank: int) -> None:
    if t.preflight == "off" or t.backend == "hf" and t.hf_path is None:
        return
    files = t.hf_path or t.tokenizer_path
    if files is None and t.server_url:
        files = served_model_files(t.server_url, api_key_from_env(t.api_key_env))
    if files is None:
        msg = (f"{key}.preflight: nothing to check the teacher at {key}.server_url={t.server_url} against "
               f"(no {key}.hf_path, no {key}.tokenizer_path, and the server's model directory is not "
               f"readable here); set {key}.tokenizer_path to a local copy of the teacher's tokenizer and "
               f"config files, or {key}.preflight=warn/off")
        if t.preflight == "error":
            raise ConfigError(msg)
        if rank == 0:
            logger.warning("%s", msg)
        return
    check = check_cross_pair if t.cross_tokenizer else check_pair
    report = check(cfg.model.hf_path, files, chat_template=cfg.data.apply_chat_template)
    if rank == 0:
        logger.info("student/teacher preflight, %s %r (%s vs %s):\n%s", key, t.name, cfg.model.hf_path, files,
                    report.render())
    if report.errors and t.preflight == "error":
        try:
            report.raise_for_errors()
        except PairMismatchError as e:  # names the teacher's key: `teacher` or `teachers[i] ('name')`
            raise PairMismatchError(f"{key}: {e}" if not cfg.teachers else f"{key} ({t.name!r}): {e}") from None
    for f in report.errors if rank == 0 else []:
        logger.warning("%s.preflight=warn: %s: %s", key, f.check, f.message)


@dataclass
class TeacherSlot:
    """One configured teacher and the object that scores for it: `policy` (megatron in the student's layout),
    `layout` (megatron in its own TP/PP) or `external` (hf / sglang on the controller; None on other ranks)."""

    index: int
    cfg: TeacherConfig
    policy: Optional[MegatronPolicy] = None
    layout: Any = None
    external: Any = None
    server: Optional[ServerProcess] = None
    offloader: Optional[WeightOffloader] = None

    @property
    def name(self) -> str:
        return self.cfg.name


class Scorer:
    """Every configured teacher (`Config.all_teachers`), each scoring the rows routed to it (`SequenceItem.teacher`),
    and the reference. `teacher_policy` / `teacher` / `layout_teacher` / `teacher_server` are the first teacher's."""

    def __init__(self, cfg: Config, *, rank: int, student: MegatronPolicy, tokenizer: Any, pad_id: int,
                 hf_config: Any, student_state: Optional[dict[str, torch.Tensor]], beta_kl: float, out_dir: Path):
        self.cfg, self.rank, self.student, self.tokenizer, self.pad_id = cfg, rank, student, tokenizer, pad_id
        self.out_dir = out_dir
        self.ref: Optional[MegatronPolicy] = self.build_ref(hf_config, student_state) if beta_kl > 0 else None
        self.slots = [TeacherSlot(i, t) for i, t in enumerate(cfg.all_teachers())]
        self.names = [s.name for s in self.slots]
        for slot in self.slots:
            self._build_teacher(slot)
            frozen = slot.layout.model if slot.layout is not None else (
                slot.policy.model if slot.policy is not None else None)
            if slot.cfg.offload and frozen is not None:
                slot.offloader = WeightOffloader(frozen)
                slot.offloader.offload()
        first = self.slots[0]
        self.teacher_policy, self.teacher, self.layout_teacher = first.policy, first.external, first.layout
        self.teacher_server = first.server

    # -- construction --------------------------------------------------------------------------

    def build_ref(self, hf_config: Any = None, state_dict: Optional[dict[str, torch.Tensor]] = None) -> MegatronPolicy:
        """pi_ref, the initial student (model.hf_path), frozen."""
        path = self.cfg.model.hf_path
        hf_config = hf_config if hf_config is not None else AutoConfig.from_pretrained(path)
        dtype = self.cfg.model.ref_params_dtype
        if state_dict is None:
            state_dict = load_hf_state_dict(path, dtype=resolve_dtype(self.cfg.model.params_dtype if dtype == "same"
                                                                      else dtype))
        return MegatronPolicy(hf_config, state_dict, self.cfg, trainable=False,
                              params_dtype=None if dtype == "same" else dtype)

    def ensure_ref(self, beta_kl: float) -> None:
        """Build pi_ref once beta_kl becomes > 0 (raised by a collapse action, or restored from a checkpoint
        written after such a raise)."""
        if beta_kl > 0 and self.ref is None:
            self.ref = self.build_ref()

    def topk_limit(self, teacher_vocab: int) -> int:
        return topk_id_limit(self.student.vocab_size, teacher_vocab, len(self.tokenizer))

    def _build_teacher(self, slot: TeacherSlot) -> None:
        t, p, key = slot.cfg, self.cfg.parallel, self.cfg.teacher_key(slot.index)
        if t.backend == "megatron":
            if t.hf_path is None:
                raise ValueError(f"{key}.hf_path: required for {key}.backend=megatron")
            if (t.tensor_model_parallel_size, t.pipeline_model_parallel_size) != (
                    p.tensor_model_parallel_size, p.pipeline_model_parallel_size):
                slot.layout = self._build_layout_teacher(t, key)
                return
            slot.policy = MegatronPolicy(AutoConfig.from_pretrained(t.hf_path),
                                         SafetensorsReader(t.hf_path, dtype=resolve_dtype(t.params_dtype)),
                                         self.cfg, trainable=False, params_dtype=t.params_dtype,
                                         temperature=t.temperature, consume_state=True)  # the teacher's own distribution at T=1
        elif self.rank == 0 and t.backend == "hf":
            slot.external = HFTeacher.from_pretrained(
                t.hf_path, dtype=resolve_dtype(t.params_dtype),
                device=f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu",
                micro_batch_size=t.micro_batch_size or 8, temperature=t.temperature)
            slot.external.topk_id_limit = self.topk_limit(slot.external.vocab_size)
        elif self.rank == 0:
            eos = eos_ids_from(self.cfg.model.hf_path)
            # the served model's config.vocab_size (SGLang labels its last id as 0: teacher/sglang.py)
            vocab = AutoConfig.from_pretrained(t.hf_path or t.tokenizer_path or self.cfg.model.hf_path).vocab_size
            if t.server_url is None:
                slot.server = self.launch_teacher_server(t)
            slot.external = SGLangTeacher(t.server_url or slot.server,
                                          eos_token_ids=eos_ids_from(t.hf_path or t.tokenizer_path) if
                                          t.cross_tokenizer else eos,
                                          micro_batch_size=t.micro_batch_size or 8, retries=t.retries,
                                          api_key=api_key_from_env(t.api_key_env), vocab_size=vocab)
        if slot.external is not None and t.cross_tokenizer:
            slot.external = CrossTokenizerTeacher(
                slot.external, self.tokenizer, AutoTokenizer.from_pretrained(t.tokenizer_path or t.hf_path),
                chat_template=self.cfg.data.apply_chat_template and has_chat_template(self.tokenizer),
                student_eos_ids=eos_ids_from(self.cfg.model.hf_path))

    def _build_layout_teacher(self, t: TeacherConfig, key: str) -> MegatronTeacher:
        """An in-process megatron teacher laid out tensor_model_parallel_size x pipeline_model_parallel_size
        over the same ranks as the student, through its own process groups."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        size = t.tensor_model_parallel_size * t.pipeline_model_parallel_size
        if world % size:
            raise ConfigError(f"{key}.tensor_model_parallel_size x pipeline_model_parallel_size = {size} does not "
                              f"divide the {world} ranks the teacher shares with the student")
        teacher = MegatronTeacher.from_hf(
            t.hf_path, micro_batch_size=t.micro_batch_size or 8, layer_spec=self.cfg.model.layer_spec,
            params_dtype=resolve_dtype(t.params_dtype), pad_token_id=self.pad_id,
            layout=make_layout(t.tensor_model_parallel_size, t.pipeline_model_parallel_size),
            max_tokens=self.cfg.train.max_tokens_per_microbatch, pack=self.cfg.train.pack_sequences,
            temperature=t.temperature)
        teacher.topk_id_limit = self.topk_limit(teacher.vocab_size)
        return teacher

    def launch_teacher_server(self, t: Optional[TeacherConfig] = None) -> ServerProcess:
        """A backend=sglang teacher without server_url: serve its hf_path on a free loopback port, with a
        per-run --api-key (the key of its $api_key_env if set, else a generated one)."""
        t = t if t is not None else self.cfg.teacher
        port = free_port()
        key = api_key_from_env(t.api_key_env) or secrets.token_hex(24)
        log = "sglang_teacher.log" if t.name == "default" else f"sglang_teacher_{t.name}.log"
        server = ServerProcess(sglang_server_cmd(t.hf_path, "127.0.0.1", port, sglang_cli_args(t.sglang_args)),
                               port=port, log_path=self.out_dir / "logs" / log, api_key=key, pass_key=True).start()
        if getattr(self, "slots", None) is None:  # called on its own (tests): the one teacher's server
            self.teacher_server = server
        return server

    # -- routing -------------------------------------------------------------------------------

    def slot_of(self, item: SequenceItem) -> TeacherSlot:
        """The teacher routed to `item` (the only one when there is one)."""
        if len(self.slots) == 1 and item.teacher in ("", self.names[0]):
            return self.slots[0]
        if item.teacher not in self.names:
            raise ValueError(f"a row is routed to teacher {item.teacher!r}, not one of teachers {self.names}")
        return self.slots[self.names.index(item.teacher)]

    def _rows_by_slot(self, items: list[SequenceItem], idx: list[int]) -> list[tuple[TeacherSlot, list[int]]]:
        """`idx` split by routed teacher, each part in row order; teachers without rows left out."""
        by = {s.index: [] for s in self.slots}
        for i in idx:
            by[self.slot_of(items[i]).index].append(i)
        return [(self.slots[k], rows) for k, rows in by.items() if rows]

    # -- scoring -------------------------------------------------------------------------------

    @property
    def wants_gold_topk(self) -> bool:
        algo = self.cfg.algo
        return algo.golden_loss == "fkl_topk" and algo.lambda_gold > 0

    def controller_scores(self, items: list[SequenceItem]) -> Optional[dict[Any, Any]]:
        """Controller: the external teachers' log-probs of the rollout rows routed to them ({row: [T]}) and, for
        the forward-KL golden loss, their top-k on the golden rows routed to them (under "topk"). Each teacher
        scores its rows as one group. None without an external teacher."""
        if not any(s.external is not None for s in self.slots):
            return None
        roll = [i for i, it in enumerate(items) if not it.is_golden]
        gold = [i for i, it in enumerate(items) if it.is_golden] if self.wants_gold_topk else []
        out: dict[Any, Any] = {}
        topk: dict[int, Any] = {}
        for slot, rows in self._rows_by_slot(items, roll):
            if slot.external is not None:
                scores = slot.external.score([items[i].prompt_ids for i in rows], [items[i].response_ids for i in rows])
                out.update({i: s.logprobs.tolist() for i, s in zip(rows, scores)})
                if isinstance(slot.external, CrossTokenizerTeacher):
                    out.setdefault("cross", {})[slot.name] = dict(slot.external.last_stats)
        for slot, rows in self._rows_by_slot(items, gold):
            if slot.external is None:
                continue
            k = slot.cfg.top_k
            gs = slot.external.score([items[i].prompt_ids for i in rows], [items[i].response_ids for i in rows],
                                     top_k=k)
            limit = self.topk_limit(getattr(slot.external, "vocab_size", None) or self.student.vocab_size)
            worst = max((int(s.topk_ids.max()) for s in gs if s.topk_ids is not None and s.topk_ids.numel()),
                        default=-1)
            if worst >= limit:
                raise ValueError(f"teacher {slot.name!r} top-{k}: id {worst} is outside the ids the student "
                                 f"has (< {limit}); serve a teacher whose vocab matches (teacher/fidelity.py)")
            topk.update({i: (s.topk_ids, s.topk_logprobs) for i, s in zip(rows, gs)})
        if topk:
            out["topk"] = topk
        return out

    @contextlib.contextmanager
    def _teacher_weights(self, slot: TeacherSlot) -> Iterator[None]:
        """An in-process teacher's weights on their device for a scoring phase, parked in host memory
        after it when its offload is set (models/offload.py)."""
        if slot.offloader is not None:
            slot.offloader.restore()
        try:
            yield
        finally:
            if slot.offloader is not None:
                slot.offloader.offload()

    def score_payload(self, payload: dict[str, Any]) -> None:
        """Collective. Names the step's teachers (payload["teacher_names"], with `teachers:` configured) and,
        for each megatron teacher in its own layout, adds its routed rows' scores to payload["teacher"] on
        every rank: each teacher replica (a TP x PP group) scores a contiguous share; the shares are gathered."""
        if self.cfg.teachers:
            payload["teacher_names"] = list(self.names)
        for slot in self.slots:
            if slot.layout is None:
                continue
            items = payload["items"]
            mine = [i for i, it in enumerate(items) if self.slot_of(it) is slot]
            with self._teacher_weights(slot):
                part = self._score_with_layout_teacher(slot, items, mine)
            scores = payload.get("teacher") or {}
            topk = {**scores.get("topk", {}), **part.pop("topk", {})}
            scores.update(part)
            if topk:
                scores["topk"] = topk
            payload["teacher"] = scores

    def _score_with_layout_teacher(self, slot: TeacherSlot, items: list[SequenceItem],
                                   routed: list[int]) -> dict[Any, Any]:
        teacher = slot.layout
        lay = teacher.layout
        roll = [i for i in routed if not items[i].is_golden]
        gold = [i for i in routed if items[i].is_golden] if self.wants_gold_topk else []

        def share(idx: list[int]) -> list[int]:
            bounds = [round(r * len(idx) / lay.dp) for r in range(lay.dp + 1)]
            return idx[bounds[lay.dp_rank]:bounds[lay.dp_rank + 1]]

        mine_roll, mine_gold = share(roll), share(gold)
        try:
            rs = teacher.score([items[i].prompt_ids for i in mine_roll], [items[i].response_ids for i in mine_roll])
            gs = teacher.score([items[i].prompt_ids for i in mine_gold], [items[i].response_ids for i in mine_gold],
                               top_k=slot.cfg.top_k) if gold else []
            part: dict[str, Any] = {"logp": {i: s.logprobs.tolist() for i, s in zip(mine_roll, rs)},
                                    "topk": {i: (s.topk_ids, s.topk_logprobs) for i, s in zip(mine_gold, gs)}}
        except Exception as e:  # noqa: BLE001 - sent to the other replicas, which would wait in the gather
            if lay.replica_group is None:
                raise
            who = f"teacher {slot.name!r}" if len(self.slots) > 1 else "teacher"
            part = {"error": f"{who} replica {lay.dp_rank} (rank {self.rank}): {type(e).__name__}: {e}"}
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
        """The payload's teacher scores (controller or layout teachers) of this rank's `rows` as [B, T]
        teacher_logp and [B, T, K] teacher_topk_ids / teacher_topk_logp in `batch.extras`; with several
        teachers also each row's teacher index as [B] `teacher_id` (per-teacher metrics, in-layout scoring)."""
        items = payload["items"]
        if len(self.slots) > 1:
            batch.extras["teacher_id"] = torch.tensor([self.slot_of(items[i]).index for i in rows], dtype=torch.long)
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
            K = self.cfg.teacher.top_k  # every teacher's (config.validate)
            ids, lps = torch.zeros((B, T, K), dtype=torch.long), torch.zeros((B, T, K))
            for b, i in enumerate(rows):
                if i in topk:
                    t_ids, t_lp = topk[i]
                    ids[b, : t_ids.shape[0]], lps[b, : t_lp.shape[0]] = t_ids, t_lp
            batch.extras["teacher_topk_ids"], batch.extras["teacher_topk_logp"] = ids, lps

    def teacher_micro_batch_size(self, t: Optional[TeacherConfig] = None) -> int:
        """A megatron teacher in the student's layout: its micro_batch_size, else train.micro_batch_size."""
        t = t if t is not None else self.cfg.teacher
        return t.micro_batch_size or self.cfg.train.micro_batch_size

    def score_batch(self, batch: TrainBatch, with_ref_logp: bool) -> None:
        """Collective: each in-layout teacher's log-probs (and top-k on golden rows) of the rows routed to it
        and, unless the full KL computes them from its per-micro-batch logits, the reference's log-probs, into
        `batch.extras`. With several teachers each scores the sub-batch of its rows (`teacher_id`); the results
        go back in row order beside the rows the controller's teachers scored."""
        for slot in self.slots:
            if slot.policy is not None:
                with self._teacher_weights(slot):
                    self._score_in_layout(slot, batch)
        if self.ref is not None and with_ref_logp:
            ref_logp, _ = self.ref.score(batch, micro_batch_size=self.cfg.train.micro_batch_size,
                                         max_tokens=self.cfg.train.max_tokens_per_microbatch,
                                         pack=self.cfg.train.pack_sequences)
            if ref_logp is not None:
                batch.extras["ref_logp"] = ref_logp

    def _score_in_layout(self, slot: TeacherSlot, batch: TrainBatch) -> None:
        """The ranks of one model-parallel group hold the same rows, so a teacher with no rows here is skipped
        on all of them alike."""
        B, T = batch.response_mask.shape
        if "teacher_id" in batch.extras:
            rows = (batch.extras["teacher_id"] == slot.index).nonzero().flatten().tolist()
            if not rows:
                return
            sub = batch.select(rows) if len(rows) < B else batch
        else:
            rows, sub = list(range(B)), batch
        mbs, t = self.teacher_micro_batch_size(slot.cfg), self.cfg.train
        logp, _ = slot.policy.score(sub, micro_batch_size=mbs, max_tokens=t.max_tokens_per_microbatch,
                                    pack=t.pack_sequences)
        if logp is not None:  # None before the last pipeline stage (`Learner.set_old_logp`)
            full = batch.extras.get("teacher_logp")
            if sub is batch or full is None and len(rows) == B:
                full = logp
            else:
                full = full if full is not None else torch.zeros((B, T), dtype=logp.dtype, device=logp.device)
                full[rows, : logp.shape[1]] = logp.to(full.device, full.dtype)
            batch.extras["teacher_logp"] = full
        golden = sub.is_golden
        if self.wants_gold_topk and bool(golden.any()):
            ids, lps = slot.policy.score_topk(sub, slot.cfg.top_k, golden, micro_batch_size=mbs,
                                              id_limit=self.topk_limit(slot.policy.vocab_size))
            if sub is batch and "teacher_topk_ids" not in batch.extras:
                batch.extras["teacher_topk_ids"], batch.extras["teacher_topk_logp"] = ids, lps
            else:
                K = slot.cfg.top_k  # every teacher's (config.validate)
                fid = batch.extras.get("teacher_topk_ids")
                flp = batch.extras.get("teacher_topk_logp")
                if fid is None:
                    fid = torch.zeros((B, T, K), dtype=ids.dtype, device=ids.device)
                    flp = torch.zeros((B, T, K), dtype=lps.dtype, device=lps.device)
                fid[rows, : ids.shape[1]] = ids.to(fid.device)
                flp[rows, : lps.shape[1]] = lps.to(flp.device)
                batch.extras["teacher_topk_ids"], batch.extras["teacher_topk_logp"] = fid, flp

    def close(self) -> None:
        for slot in self.slots:
            if slot.server is not None:
                slot.server.shutdown()
