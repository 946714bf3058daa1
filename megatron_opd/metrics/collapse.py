"""Collapse (length-inflation) detector over the per-step metric history.

Why: length inflation starts abruptly: within a few dozen steps the truncation rate, the mean response length
and the repetition rate jump, and by the time the reward curve shows it the run is lost. The detector compares
the mean of the most recent `window` steps against a baseline window and flags the onset, so the trainer can
warn, stop, raise beta_KL or roll back (the actions live in the trainer).

Baseline: "initial" (default) is the first `baseline_window` observations of each metric (how the run started:
catches slow drifts too); "trailing" is the `baseline_window` observations just before the current window
(catches only abrupt changes, adapts after an intervention). Per-step noise is averaged away by the windows,
and no verdict is raised before `min_steps` updates nor while a metric lacks a full baseline and a full current
window that do not overlap. A rule must hold on `patience` consecutive updates to count.

Rules (a threshold of None disables a rule); `cur`/`base` are window means:
  truncation jump:    cur - base > truncation_jump
  truncation ratio:   cur > truncation_ratio * max(base, rate_floor)     (floor: 0 -> 1 truncation is no ratio)
  length growth:      cur > length_ratio * base                          (base > 0)
  repetition jump:    cur - base > repetition_jump
  accuracy drop:      acc < (1 - accuracy_drop) * best                   (held-out evaluations, see below)
NaN / missing metric values are skipped (a step without truncation info does not count for that metric).

The accuracy rule watches `accuracy_key` (the trainer's periodic held-out evaluation, `eval/accuracy`): a run
whose answers degrade without growing (seen at CPU scale, docs/reproduction.md) trips none of the rollout
rules. It compares each evaluation with the best earlier one (the initial student's included, fed through
`observe_eval`) once that best is at least `accuracy_floor`; evaluations are sparse, so it needs neither
windows nor patience, but like every rule it waits for `min_steps`: early in a run a student often dips
while it takes up the teacher's format, and recovers (seen in the demo at step 4 of 12).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional


@dataclass
class CollapseConfig:
    truncation_key: str = "rollout/truncation_rate"
    length_key: str = "rollout/response_len_mean"
    repetition_key: str = "rollout/repetition_rate"
    truncation_jump: Optional[float] = 0.15
    truncation_ratio: Optional[float] = None
    rate_floor: float = 0.02
    length_ratio: Optional[float] = 1.5
    repetition_jump: Optional[float] = 0.1
    window: int = 10
    baseline_window: int = 10
    baseline: Literal["initial", "trailing"] = "initial"
    min_steps: int = 20
    patience: int = 2
    accuracy_key: str = "eval/accuracy"
    accuracy_drop: Optional[float] = 0.5
    accuracy_floor: float = 0.05

    def __post_init__(self) -> None:
        for name in ("window", "baseline_window", "patience"):
            if getattr(self, name) < 1:
                raise ValueError(f"CollapseConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if self.min_steps < 0:
            raise ValueError(f"CollapseConfig.min_steps: must be >= 0, got {self.min_steps}")
        if self.baseline not in ("initial", "trailing"):
            raise ValueError(f"CollapseConfig.baseline: must be 'initial' or 'trailing', got {self.baseline!r}")
        if self.accuracy_drop is not None and not (math.isfinite(self.accuracy_drop) and 0 < self.accuracy_drop < 1):
            # 1 would mean "below 0 x the best": a rule that can never fire
            raise ValueError(f"CollapseConfig.accuracy_drop: a fraction in (0, 1) or None, got {self.accuracy_drop}")
        for name in ("truncation_jump", "truncation_ratio", "length_ratio", "repetition_jump", "rate_floor",
                     "accuracy_floor"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"CollapseConfig.{name}: must be a finite number >= 0 or None, got {v}")
        for name in ("truncation_ratio", "length_ratio"):
            v = getattr(self, name)
            if v is not None and v <= 1:
                raise ValueError(f"CollapseConfig.{name}: a growth ratio must be > 1, got {v}")


@dataclass
class CollapseVerdict:
    """collapsed: a rule held for `patience` updates at this step. onset_step: the first step ever flagged
    (sticky until `reset`). stats: window means used, e.g. 'rollout/truncation_rate/current'.
    good_step (when collapsed): the newest step the rules that fired do not implicate -- before the windows
    of the rollout rules, at the best evaluation for the accuracy rule; where a rollback should return."""

    collapsed: bool
    reasons: list[str]
    step: int
    onset_step: Optional[int] = None
    stats: dict[str, float] = field(default_factory=dict)
    good_step: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


class CollapseDetector:
    """Stateful: call `update(metrics)` once per training step; `state_dict()` / `load_state_dict()` for resume."""

    def __init__(self, config: Optional[CollapseConfig] = None) -> None:
        self.config = config or CollapseConfig()
        self.reset()

    # -- state --------------------------------------------------------------------------------

    def reset(self, keep_best_accuracy: bool = False) -> None:
        """Forget the history (e.g. after a rollback, so the restored run is judged afresh). With
        `keep_best_accuracy` the best held-out accuracy stays the accuracy rule's reference: after a collapse
        action the run must get back near its best, not merely above its first evaluation after the action."""
        c = self.config
        best = getattr(self, "_best_acc", None) if keep_best_accuracy else None
        self._num_updates = 0
        self._last_step: Optional[int] = None
        self._onset_step: Optional[int] = None
        self._streak: dict[str, int] = {}
        self._initial: dict[str, list[float]] = {}
        self._counts: dict[str, int] = {}
        self._recent: dict[str, deque[float]] = {}
        self._recent_len = c.window + (c.baseline_window if c.baseline == "trailing" else 0)
        self._best_acc: Optional[tuple[float, int]] = best  # (best held-out accuracy so far, its step)

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable state."""
        return {
            "version": 1,
            "config": dataclasses.asdict(self.config),
            "num_updates": self._num_updates,
            "last_step": self._last_step,
            "onset_step": self._onset_step,
            "streak": dict(self._streak),
            "best_accuracy": list(self._best_acc) if self._best_acc is not None else None,
            "series": {
                k: {"initial": list(self._initial[k]), "recent": list(self._recent[k]), "count": self._counts[k]}
                for k in self._recent
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`. The windows must match this detector's config (they define the
        buffers); thresholds may differ, so a resumed run can be judged with new thresholds."""
        for key in ("version", "config", "num_updates", "last_step", "onset_step", "streak", "series"):
            if key not in state:
                raise ValueError(f"collapse detector state: missing key {key!r}")
        if state["version"] != 1:
            raise ValueError(f"collapse detector state: unsupported version {state['version']!r}")
        for name in ("window", "baseline_window", "baseline"):
            saved = state["config"].get(name)
            if saved != getattr(self.config, name):
                raise ValueError(
                    f"collapse detector state: config.{name}={saved!r} does not match {getattr(self.config, name)!r}")
        self.reset()
        self._num_updates = int(state["num_updates"])
        self._last_step = state["last_step"]
        self._onset_step = state["onset_step"]
        self._streak = {str(k): int(v) for k, v in state["streak"].items()}
        best = state.get("best_accuracy")  # absent in states saved before the accuracy rule
        self._best_acc = (float(best[0]), int(best[1])) if best is not None else None
        for k, s in state["series"].items():
            self._initial[k] = [float(x) for x in s["initial"]]
            self._recent[k] = deque((float(x) for x in s["recent"]), maxlen=self._recent_len)
            self._counts[k] = int(s["count"])

    # -- update -------------------------------------------------------------------------------

    def _record(self, key: str, value: Any) -> None:
        if value is None:
            return
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metrics[{key!r}]: expected a number, got {value!r}") from None
        if not math.isfinite(v):
            return
        if key not in self._recent:
            self._initial[key] = []
            self._recent[key] = deque(maxlen=self._recent_len)
            self._counts[key] = 0
        if len(self._initial[key]) < self.config.baseline_window:
            self._initial[key].append(v)
        self._recent[key].append(v)
        self._counts[key] += 1

    def _windows(self, key: str) -> Optional[tuple[float, float]]:
        """(current mean, baseline mean) when the metric has both windows full and disjoint, else None."""
        c = self.config
        if key not in self._recent or self._counts[key] < c.window + c.baseline_window:
            return None
        recent = list(self._recent[key])
        cur = _mean(recent[-c.window:])
        base = _mean(self._initial[key]) if c.baseline == "initial" else _mean(recent[: c.baseline_window])
        return cur, base

    def _rules(self) -> list[tuple[str, str, Optional[float]]]:
        c = self.config
        return [
            ("truncation_jump", c.truncation_key, c.truncation_jump),
            ("truncation_ratio", c.truncation_key, c.truncation_ratio),
            ("length_ratio", c.length_key, c.length_ratio),
            ("repetition_jump", c.repetition_key, c.repetition_jump),
        ]

    def observe_eval(self, metrics: Mapping[str, Any], step: int = 0) -> None:
        """Record an evaluation made outside a training step (the initial student's, at step 0) as a
        baseline for the accuracy rule; judges nothing."""
        self._accuracy(metrics, step)

    def _accuracy(self, metrics: Mapping[str, Any], step: int) -> Optional[str]:
        """The accuracy rule: the reason when this evaluation fell below (1 - accuracy_drop) x the best
        earlier one; then updates the best."""
        c = self.config
        acc = metrics.get(c.accuracy_key)
        if acc is None or not math.isfinite(float(acc)):
            return None
        acc, why = float(acc), None
        if self._best_acc is not None and c.accuracy_drop is not None:
            best, at = self._best_acc
            if best >= c.accuracy_floor and acc < (1 - c.accuracy_drop) * best:
                why = (f"accuracy_drop: {c.accuracy_key} fell to {acc:.3f} from {best:.3f} at step {at} "
                       f"(more than {c.accuracy_drop:.0%} lost)")
        if self._best_acc is None or acc > self._best_acc[0]:
            self._best_acc = (acc, step)
        return why

    def update(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> CollapseVerdict:
        """Add one step's metrics and judge. `step` defaults to metrics['step'], else the update count."""
        c = self.config
        if step is None:
            step = int(metrics["step"]) if "step" in metrics else self._num_updates
        self._num_updates += 1
        self._last_step = step
        for key in dict.fromkeys((c.truncation_key, c.length_key, c.repetition_key)):
            self._record(key, metrics.get(key))

        reasons: list[str] = []
        good: list[int] = []
        stats: dict[str, float] = {}
        for rule, key, thr in self._rules():
            w = self._windows(key)
            if w is None or thr is None:
                self._streak[rule] = 0
                continue
            cur, base = w
            stats[f"{key}/current"], stats[f"{key}/baseline"] = cur, base
            if rule in ("truncation_jump", "repetition_jump"):
                hit, why = cur - base > thr, f"{key} rose by {cur - base:.3f} ({base:.3f} -> {cur:.3f}) > {thr}"
            elif rule == "truncation_ratio":
                ref = max(base, c.rate_floor)
                hit, why = cur > thr * ref, f"{key} grew {cur / ref:.2f}x ({base:.3f} -> {cur:.3f}) > {thr}x"
            else:
                hit = base > 0 and cur > thr * base
                why = f"{key} grew {cur / base if base > 0 else math.inf:.2f}x ({base:.1f} -> {cur:.1f}) > {thr}x"
            self._streak[rule] = self._streak.get(rule, 0) + 1 if hit else 0
            if hit and self._streak[rule] >= c.patience and self._num_updates >= c.min_steps:
                reasons.append(f"{rule}: {why}")
                good.append(step - c.window - c.patience + 1)

        best_before = self._best_acc
        acc_why = self._accuracy(metrics, step)
        if acc_why is not None and self._num_updates >= c.min_steps:
            reasons.append(acc_why)
            good.append(best_before[1])
        collapsed = bool(reasons)
        if collapsed and self._onset_step is None:
            self._onset_step = step
        return CollapseVerdict(collapsed, reasons, step, self._onset_step, stats, min(good) if good else None)


__all__ = ["CollapseConfig", "CollapseDetector", "CollapseVerdict"]
