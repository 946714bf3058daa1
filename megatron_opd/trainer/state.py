"""The trainer's state on disk: save, restore (resume or rollback), and the HF export.

A checkpoint (trainer/checkpoint.py: atomic; the student's weights and optimizer as one torch_dist
checkpoint that any layout can resume, the rest in one small file per rank) holds the schedule, the RNGs, the step, the weight version, beta_kl (a collapse action may have raised it), the prompt
sampler, the guard (detector history, counters) and, under rollout.overlap, the next step's payload for
an exact resume.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from megatron_opd.models.checkpoint import commit_partial, prepare_partial, write_hf_dir
from megatron_opd.models.weight_mapping import load_hf_state_dict
from megatron_opd.trainer.checkpoint import rng_state, set_rng_state
from megatron_opd.trainer.rollouts import payload_from_state, payload_state

logger = logging.getLogger("megatron_opd.trainer")

EXPORT_META = "opd_meta.json"


def save(trainer: Any) -> None:
    """Collective: checkpoint the trainer at its current step."""
    state = {"scheduler": trainer.student.scheduler_state(), "rng": rng_state(), "step": trainer.step,
             "weight_version": trainer.weight_version, "beta_kl": trainer.beta_kl,
             "skipped_steps": trainer.skipped_steps, "sampler": trainer.sampler.state_dict(),
             **trainer.guard.state_dict()}
    pending = trainer.rollouts.pending
    if trainer.rank == 0 and isinstance(pending, dict):  # rollout.overlap: the next step's rollouts
        state["next_payload"] = payload_state(pending)
    trainer.ckpt.save(trainer.step, state, meta={"beta_kl": trainer.beta_kl}, write_shared=trainer.student.save_shared)


def restore(trainer: Any, step: int, rollback: bool) -> tuple[int, list[int]]:
    """Collective: load the checkpoint of `step`. A resume restores everything; a rollback only the policy,
    the step and the skipped-step count (the sampler and RNGs go on, so the re-trained steps see new
    prompts) and drops the pending overlapped rollouts of the abandoned weights. Returns the step and the
    newer checkpoints a rollback abandons."""
    if rollback:
        trainer.rollouts.drop_next()
    step, state, shared = trainer.ckpt.load(step)
    if shared is not None:
        trainer.student.load_shared(shared)
        trainer.student.load_scheduler_state(state["scheduler"])
    else:
        trainer.student.load_state_dict(state["policy"], source=f"of step {step} under {trainer.ckpt.root}")
    trainer.step, trainer.skipped_steps = int(state["step"]), int(state["skipped_steps"])
    trainer.beta_kl = float(state["beta_kl"])  # may exceed algo.beta_kl after raise_beta_kl / rollback
    dropped: list[int] = []
    if rollback:
        dropped = [s for s in trainer.ckpt.steps() if s > trainer.step] if trainer.rank == 0 else []
    else:
        if trainer.beta_kl != trainer.cfg.algo.beta_kl and trainer.rank == 0:
            logger.warning("resuming with the checkpoint's beta_kl=%g, not algo.beta_kl=%g (a collapse action "
                           "raised it, or the config changed since)", trainer.beta_kl, trainer.cfg.algo.beta_kl)
        trainer.guard.load_state_dict(state)
        trainer.scorer.ensure_ref(trainer.beta_kl)  # before the RNGs are restored: building a model may draw
        set_rng_state(state["rng"])
        trainer.sampler.load_state_dict(state["sampler"])
        if state.get("next_payload") is not None:
            trainer.rollouts.pending = payload_from_state(state["next_payload"])
    trainer.rollouts.push_restored(int(state["weight_version"]))
    if trainer.rank == 0 and not rollback:
        logger.info("resumed from %s at step %d", trainer.ckpt.root, step)
    return step, dropped


def restore_initial(trainer: Any) -> None:
    """Collective: a rollback to step 0 when no checkpoint is older than the collapse: the initial student
    (model.hf_path) with a fresh optimizer and schedule, step 0, the pending overlapped rollouts dropped.
    Nothing is saved (a step-0 checkpoint would hold no optimizer state); the next save is the new
    trajectory's."""
    trainer.rollouts.drop_next()
    trainer.student.reset_to(load_hf_state_dict(trainer.cfg.model.hf_path))
    trainer.step, trainer.skipped_steps = 0, 0
    trainer.rollouts.push_restored(0)


def export_hf(trainer: Any, out: Path) -> Path:
    """Collective: the student as an HF directory (replaced atomically): safetensors, config and the
    tokenizer files of model.hf_path, plus `opd_meta.json` (step, preset, source)."""
    cfg = trainer.cfg
    meta = {"source_model": str(cfg.model.hf_path), "step": trainer.step, "preset": cfg.algo.preset,
            "weight_version": trainer.weight_version, "run": str(trainer.out_dir), "made_by": "megatron-opd train"}
    tmp = prepare_partial(out, overwrite=True)
    write_hf_dir(trainer.student.iter_hf_weights(), trainer.hf_config, cfg.model.hf_path, tmp, EXPORT_META, meta)
    commit_partial(out)
    if trainer.rank == 0:
        logger.info("wrote the student at step %d as an HF directory: %s", trainer.step, out)
    return out
