"""The guard: the collapse detector's verdict on every step, and train.collapse_action.

A verdict of the detector (train.collapse.*) triggers train.collapse_action after the step's metrics
are logged:
  warn           log a warning; `health/collapsed` = 1 in the step's metrics.
  stop           checkpoint the step, raise TrainingStopped (the CLI exits with status 3).
  raise_beta_kl  beta_kl <- max(2 * beta_kl, 0.01) from the next step on (pi_ref is built if it was not).
                 The detector keeps its history, so it still sees the collapse; the action is held for
                 `train.collapse.window` steps (the raised beta_kl needs a window of steps to show in the
                 rollouts) and acts again after that if the collapse goes on.
  rollback       restore the newest checkpoint from before the detector's evidence (its good_step, one
                 step earlier under rollout.overlap, whose rollouts come from the weights one step
                 older; else the oldest kept one; with none, the initial student at step 0 with a fresh
                 optimizer) and re-train from it with the raised beta_kl. Restored:
                 policy weights and optimizer, step, skipped-step count. Not restored, on purpose: the
                 prompt sampler and the RNGs continue, so the re-trained steps see new prompts rather than
                 replaying the batches that led into the collapse. The weight version keeps increasing
                 (the rollout engine only accepts newer versions). The rolled-back state is saved at once
                 under its step (`latest` points at it) and the abandoned newer checkpoints are deleted,
                 so a resume continues the rolled-back run. The detector restarts its history there.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from megatron_opd.metrics.collapse import CollapseDetector
from megatron_opd.models.parallel import broadcast_object

logger = logging.getLogger("megatron_opd.trainer")


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (collapse with collapse_action=stop)."""


def raised(beta_kl: float) -> float:
    return max(2 * beta_kl, 0.01)


class Guard:
    def __init__(self, cfg: Any, rank: int):
        self.cfg, self.rank = cfg, rank
        self.detector = CollapseDetector(cfg.train.collapse)
        self.collapse_events = 0
        self.rollbacks = 0
        self.hold_until = 0  # no raise_beta_kl before this step (the last raise's window)
        self.reasons, self.good_step = "", None

    def judge(self, metrics: dict[str, float], step: int) -> Optional[str]:
        """Collective: judge step `step`; sets metrics['health/collapsed'] and 'health/collapse_events' and
        returns the action to apply, else None."""
        verdict = self.detector.update(metrics, step=step) if self.rank == 0 else None
        flag, reasons, good = broadcast_object((bool(verdict.collapsed), "; ".join(verdict.reasons),
                                                verdict.good_step) if verdict is not None else (False, "", None))
        metrics["health/collapsed"] = float(flag)
        action = self.cfg.train.collapse_action
        held = flag and action == "raise_beta_kl" and step < self.hold_until
        if flag and not held:
            self.collapse_events += 1
        metrics["health/collapse_events"] = float(self.collapse_events)
        if not flag or held:
            return None
        self.reasons = reasons
        self.good_step = None if good is None else good - (1 if self.cfg.rollout.overlap else 0)
        if self.rank == 0:
            logger.warning("step %d: collapse detected (%s); action=%s", step, reasons, action)
        return action

    def apply(self, action: str, trainer: Any) -> bool:
        """Apply `action` to the trainer; True when the run was rolled back (the step's state is abandoned)."""
        if action == "warn":
            return False
        if action == "stop":
            trainer.save()
            raise TrainingStopped(f"collapse detected at step {trainer.step}: {self.reasons}")
        if action == "rollback":
            if self.rollbacks >= self.cfg.train.max_rollbacks:
                trainer.save()
                raise TrainingStopped(f"collapse detected at step {trainer.step} after {self.rollbacks} rollback(s) "
                                      f"(train.max_rollbacks={self.cfg.train.max_rollbacks}): {self.reasons}")
            self.rollbacks += 1
            self.rollback(trainer, self.rollback_target(trainer))
            return True
        trainer.set_beta_kl(raised(trainer.beta_kl))
        self.hold_until = trainer.step + self.cfg.train.collapse.window
        if self.rank == 0:
            logger.warning("step %d: beta_kl raised to %g", trainer.step, trainer.beta_kl)
        return False

    def rollback_target(self, trainer: Any) -> Optional[int]:
        """Collective: the newest complete checkpoint from before the detector's evidence, else the oldest
        kept one."""
        steps = [s for s in trainer.ckpt.steps() if s < trainer.step] if self.rank == 0 else []
        good = self.good_step if self.good_step is not None else trainer.step
        before = [s for s in steps if s <= good]
        return broadcast_object(before[-1] if before else (steps[0] if steps else None))

    def rollback(self, trainer: Any, target: Optional[int]) -> None:
        """Restore checkpoint `target` (None: none is older than the collapse -- the initial student)."""
        collapsed_at, beta_at_collapse = trainer.step, trainer.beta_kl
        if target is None:
            trainer.restore_initial()
            step, dropped = 0, []
        else:
            step, dropped = trainer.restore(target, rollback=True)
        trainer.set_beta_kl(raised(max(beta_at_collapse, trainer.beta_kl)))
        self.detector.reset(keep_best_accuracy=True)
        self.hold_until = 0
        if target is not None:
            trainer.save()  # `latest` -> the rolled-back state, with its raised beta_kl; prunes the newer ones
        if self.rank == 0:
            logger.warning("step %d: rolled back to the checkpoint of step %d; beta_kl %g -> %g; weight version "
                           "%d; discarded checkpoints %s", collapsed_at, step, beta_at_collapse, trainer.beta_kl,
                           trainer.rollouts.weight_version, dropped or "none")

    def state_dict(self) -> dict[str, Any]:
        state = {"collapse_events": self.collapse_events, "rollbacks": self.rollbacks, "hold_until": self.hold_until}
        if self.rank == 0:
            state["detector"] = self.detector.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collapse_events = int(state.get("collapse_events", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.hold_until = int(state.get("hold_until", 0))
        if "detector" in state:
            try:
                self.detector.load_state_dict(state["detector"])
            except ValueError as e:  # train.collapse windows changed since the checkpoint
                logger.warning("collapse detector restarts its history: %s", e)
