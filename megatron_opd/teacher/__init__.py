"""Teacher log-prob scoring (HF, Megatron, SGLang server) behind the contract in base.py."""

from __future__ import annotations

from typing import Any, Optional

from transformers import AutoConfig

from megatron_opd.rollout.base import eos_ids_from
from megatron_opd.rollout.server import api_key_from_env
from megatron_opd.teacher.base import Teacher, TeacherScore, TeacherScoreError, validate_scores
from megatron_opd.teacher.hf import HFTeacher
from megatron_opd.teacher.megatron import MegatronTeacher
from megatron_opd.teacher.sglang import SGLangTeacher


def make_teacher(cfg: Any, eos_token_ids: Optional[list[int]] = None) -> Teacher:
    """Teacher for a `TeacherConfig`. backend=megatron needs init_parallel(teacher TP, PP) done first;
    backend=sglang talks to cfg.server_url (an already running SGLang server)."""
    if cfg.backend == "hf":
        return HFTeacher.from_pretrained(cfg.hf_path, micro_batch_size=cfg.micro_batch_size or 8)
    if cfg.backend == "megatron":
        return MegatronTeacher.from_hf(cfg.hf_path, micro_batch_size=cfg.micro_batch_size or 8)
    if cfg.backend == "sglang":
        if cfg.server_url is None:
            raise ValueError("teacher.server_url: required for teacher.backend=sglang (start the server first)")
        ids = eos_token_ids if eos_token_ids is not None else eos_ids_from(cfg.hf_path)
        # the served model's vocab size lets the client undo SGLang's last-id label bug (teacher/sglang.py)
        vocab = AutoConfig.from_pretrained(cfg.hf_path).vocab_size if cfg.hf_path else None
        return SGLangTeacher(cfg.server_url, eos_token_ids=ids, micro_batch_size=cfg.micro_batch_size or 8,
                             retries=cfg.retries, api_key=api_key_from_env(cfg.api_key_env), vocab_size=vocab)
    raise ValueError(f"teacher.backend: unknown {cfg.backend!r} (expected megatron, sglang or hf)")


__all__ = ["Teacher", "TeacherScore", "TeacherScoreError", "make_teacher", "validate_scores"]
