"""`megatron-opd check-reproduction RUN_DIR...`: does a set of runs show OPD's length inflation and its cure?

The criteria are fixed here and in docs/reproduction.md before any run is judged (issue 22); they are never
tuned to results. Runs are grouped by `algo.preset` (opd, opd_kl, stable_opd) and paired across presets by
their seeds (`train.seed`, `rollout.seed`). "3-step" values are trailing means over the current and two
previous logged steps; B is a run's mean truncation over steps 1-5.

1. **valid start** (every run): B <= 0.3 and the mean repetition over steps 1-5 <= 0.05.
2. **plain OPD inflates** in at least 2 of its seeds (and at least 2/3 of them): a run inflates when for
   >= 10 consecutive steps the 3-step truncation >= max(0.6, B + 0.35), the 3-step repetition >= 0.3 and the
   3-step mean length >= 0.8 x the budget (`rollout.max_new_tokens`). Its onset is the window's first step.
3. **mechanism** (every inflating opd run): the advantage on repetitive tokens exceeds the others' in >= 80%
   of the steps that have repetitive tokens; across the onset (mean of the 5 steps from it minus the 5
   before its first inflated step: the onset's 3-step window may hold up to 2 inflated steps before it) the
   teacher's mean log-prob rises more than the student's.
4. **the cure** (every stable_opd run whose seeds an inflating opd run has): 3-step truncation <= B + 0.15 at
   every step, 3-step repetition <= 0.1 at every step, final held-out accuracy >= its peak - 0.1.

A run's rows are read from step 0 on: the trainer logs the held-out evaluation of the initial model as
step 0 (no rollout there), and it counts towards the peak accuracy of criterion 4.

Exit status 0 iff every criterion holds; each prints its value and PASS/FAIL.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_opd.config import ConfigError, read_yaml_mapping
from megatron_opd.metrics.runlog import read_metrics

START_STEPS = 5
B_MAX, START_REP_MAX = 0.3, 0.05
TRUNC_FLOOR, TRUNC_RISE, REP_MIN, LEN_FRAC, MIN_RUN = 0.6, 0.35, 0.3, 0.8, 10
MIN_INFLATING = 2
ADV_SHARE = 0.8
ONSET_SPAN = 5
CURE_TRUNC, CURE_REP, ACC_DROP = 0.15, 0.1, 0.1

TRUNC, REP, LEN = "rollout/truncation_rate", "rollout/repetition_rate", "rollout/response_len_mean"
ADV_REP, ADV_OTHER, REP_SHARE = "adv/repetitive_mean", "adv/other_mean", "adv/repetitive_token_share"
LOGP_T, LOGP_S, ACC = "logp/teacher_mean", "logp/student_mean", "eval/accuracy"


class RunError(ValueError):
    """A run directory that cannot be judged: names the directory and what is missing."""


@dataclass
class Run:
    path: Path
    preset: str
    seeds: tuple[int, int]
    budget: int
    rows: list[dict[str, Any]]

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of every row from step 0 on (step 0: the initial model's held-out evaluation)."""
        return [(r["step"], float(r[key])) for r in self.rows
                if isinstance(r.get("step"), int) and r["step"] >= 0
                and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]

    @property
    def name(self) -> str:
        return f"{self.preset}[seed {self.seeds[0]}/{self.seeds[1]}] {self.path}"


@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str


def load_run(path: Path) -> Run:
    cfg_file, path = Path(path) / "config.yaml", Path(path)
    if not cfg_file.is_file():
        raise RunError(f"{path}: no config.yaml (is it a run directory?)")
    try:
        cfg = read_yaml_mapping(cfg_file)
    except ConfigError as e:
        raise RunError(str(e)) from e
    try:
        rows = read_metrics(path)
    except (FileNotFoundError, ValueError) as e:
        raise RunError(str(e)) from e
    try:
        preset = str(cfg["algo"]["preset"])
        seeds = (int(cfg["train"]["seed"]), int(cfg["rollout"]["seed"]))
        budget = int(cfg["rollout"]["max_new_tokens"])
    except (KeyError, TypeError, ValueError) as e:
        raise RunError(f"{cfg_file}: needs algo.preset, train.seed, rollout.seed and rollout.max_new_tokens") from e
    return Run(path, preset, seeds, budget, rows)


def trailing(values: list[tuple[int, float]], width: int = 3) -> list[tuple[int, float]]:
    out = []
    for i, (step, _) in enumerate(values):
        window = [v for _, v in values[max(0, i - width + 1):i + 1]]
        out.append((step, sum(window) / len(window)))
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _shift(d: dict[int, float], before: Any, after: Any) -> float:
    """Mean of `d` over the steps `after` minus its mean over the steps `before` (steps missing from `d` skipped)."""
    return _mean([d[s] for s in after if s in d]) - _mean([d[s] for s in before if s in d])


def start_level(run: Run) -> tuple[float, float]:
    """(B, mean repetition) over steps 1..START_STEPS."""
    trunc = [v for s, v in run.series(TRUNC) if 1 <= s <= START_STEPS]
    rep = [v for s, v in run.series(REP) if 1 <= s <= START_STEPS]
    return _mean(trunc), _mean(rep)


def _inflated(run: Run, t: dict[int, float], r: dict[int, float], n: dict[int, float], step: int) -> bool:
    """Whether `step` meets every inflation threshold in the values `t`, `r`, `n` (truncation, repetition,
    length) of `run`; a step missing from `t` does not."""
    b, _ = start_level(run)
    return (step in t and t[step] >= max(TRUNC_FLOOR, b + TRUNC_RISE) and r.get(step, 0.0) >= REP_MIN
            and n.get(step, 0.0) >= LEN_FRAC * run.budget)


def inflation_onset(run: Run) -> Optional[int]:
    """The first step of the first window of MIN_RUN consecutive inflated steps (3-step means), or None."""
    t, r, n = (dict(trailing(run.series(k))) for k in (TRUNC, REP, LEN))
    streak, first = 0, None
    for step in sorted(t):
        inflated = _inflated(run, t, r, n, step)
        if inflated:
            if streak == 0:
                first = step
            streak += 1
            if streak >= MIN_RUN:
                return first
        else:
            streak = 0
    return None


def first_inflated_step(run: Run, onset: int) -> int:
    """The first step of the onset's 3-step window whose own values (not their 3-step mean) meet every
    inflation threshold: the onset's trailing mean may pass because of up to 2 inflated steps before it,
    which must not count as "before the onset". The onset itself when none of the 2 before it is."""
    t, r, n = (dict(run.series(k)) for k in (TRUNC, REP, LEN))
    steps = sorted(t)
    at = steps.index(onset)
    return next((s for s in steps[max(0, at - 2):at] if _inflated(run, t, r, n, s)), onset)


def check(runs: list[Run], single_seed: bool = False) -> list[Verdict]:
    """The four criteria. `single_seed`: a re-run of one seed (`demo --reproduce --seed S`) is judged on that
    seed alone -- its opd run must inflate; the reproduction's verdict is the multi-seed form."""
    verdicts = []
    bad_start = []
    for run in runs:
        b, rep = start_level(run)
        if not (b <= B_MAX and rep <= START_REP_MAX):
            bad_start.append(f"{run.name}: B={b:.3f} repetition={rep:.3f}")
    verdicts.append(Verdict("valid start (B <= 0.3, repetition <= 0.05 over steps 1-5)", not bad_start,
                            "; ".join(bad_start) or f"all {len(runs)} runs"))

    opd = [r for r in runs if r.preset == "opd"]
    onsets = {r.path: inflation_onset(r) for r in opd}
    inflating = [r for r in opd if onsets[r.path] is not None]
    if single_seed and len(opd) > 1:
        raise RunError(f"--single-seed: {len(opd)} opd runs given, expected one")
    need = 1 if single_seed else max(MIN_INFLATING, math.ceil(2 * len(opd) / 3))
    verdicts.append(Verdict(f"plain OPD inflates (>= {need} of {len(opd)} opd runs)",
                            len(inflating) >= need and bool(opd),
                            ", ".join(f"{r.name}: onset {onsets[r.path]}" for r in opd) or "no opd run"))

    mech = []
    ok_mech = bool(inflating)
    for run in inflating:
        adv = [(s, v) for s, v in run.series(ADV_REP)]
        other, share = dict(run.series(ADV_OTHER)), dict(run.series(REP_SHARE))
        steps = [s for s, _ in adv if share.get(s, 0.0) > 0 and s in other]
        frac = _mean([1.0 if dict(adv)[s] > other[s] else 0.0 for s in steps]) if steps else float("nan")
        onset = onsets[run.path]
        start = first_inflated_step(run, onset)
        t, st = dict(run.series(LOGP_T)), dict(run.series(LOGP_S))

        before, after = range(start - ONSET_SPAN, start), range(onset, onset + ONSET_SPAN)
        dt, ds = _shift(t, before, after), _shift(st, before, after)
        ok = frac >= ADV_SHARE and dt > ds
        ok_mech &= ok
        mech.append(f"{run.name}: repetitive > other advantage in {frac:.0%} of {len(steps)} steps; onset "
                    f"{onset} (before: steps {start - ONSET_SPAN}-{start - 1}): teacher logp {dt:+.3f} vs "
                    f"student {ds:+.3f}")
    verdicts.append(Verdict("mechanism (repetitive advantage > other in >= 80% of steps; teacher logp rises more)",
                            ok_mech, "; ".join(mech) or "no inflating opd run"))

    cure = []
    ok_cure = True
    seeds = {r.seeds for r in inflating}
    stable = [r for r in runs if r.preset == "stable_opd" and r.seeds in seeds]
    for run in stable:
        b, _ = start_level(run)
        t_max = max((v for _, v in trailing(run.series(TRUNC))), default=float("nan"))
        r_max = max((v for _, v in trailing(run.series(REP))), default=float("nan"))
        acc = run.series(ACC)
        peak = max((v for _, v in acc), default=float("nan"))
        final = acc[-1][1] if acc else float("nan")
        ok = t_max <= b + CURE_TRUNC and r_max <= CURE_REP and final >= peak - ACC_DROP
        ok_cure &= ok
        cure.append(f"{run.name}: max 3-step truncation {t_max:.3f} (limit {b + CURE_TRUNC:.3f}), max 3-step "
                    f"repetition {r_max:.3f}, final accuracy {final:.3f} vs peak {peak:.3f}")
    ok_cure &= len(stable) == len(seeds) and bool(stable)
    verdicts.append(Verdict("stable_opd on the same seeds (truncation <= B + 0.15, repetition <= 0.1, final "
                            "accuracy >= peak - 0.1)", ok_cure,
                            "; ".join(cure)
                            or f"no stable_opd run with the seeds of an inflating opd run ({sorted(seeds)})"))
    return verdicts


FLAG = "health/collapsed"
DESCRIBE_HEADER = ("| run | steps | onset | detector's first flag | steps with repetitive tokens | repetitive share "
                   "(mean, max) | A repetitive / other (mean over those steps) | repetitive > other | teacher / "
                   "student logp change |\n|---|---|---|---|---|---|---|---|---|")


def describe(run: Run) -> str:
    """One markdown row of the mechanism's numbers as the paper reports them (repetitive-token share, the
    advantage on repetitive tokens against the rest, the teacher's and the student's log-probs across the onset)
    and the collapse detector's first flag against the onset. Descriptive only: the verdicts are `check`'s.
    Without an onset the log-prob change is from the first 5 steps to the last 5."""
    steps = [s for s, _ in run.series(TRUNC)]
    onset = inflation_onset(run)
    flags = [s for s, v in run.series(FLAG) if v > 0]
    share = dict(run.series(REP_SHARE))
    adv, other = dict(run.series(ADV_REP)), dict(run.series(ADV_OTHER))
    rep_steps = [s for s in sorted(share) if share[s] > 0 and s in adv and s in other]
    shares = [share[s] for s in rep_steps]
    t, st = dict(run.series(LOGP_T)), dict(run.series(LOGP_S))
    if onset is not None:
        start = first_inflated_step(run, onset)
        before, after = range(start - ONSET_SPAN, start), range(onset, onset + ONSET_SPAN)
        span = f"steps {start - ONSET_SPAN}-{start - 1} -> {onset}-{onset + ONSET_SPAN - 1}"
    else:
        before, after = steps[:ONSET_SPAN], steps[-ONSET_SPAN:]
        span = f"steps {before[0]}-{before[-1]} -> {after[0]}-{after[-1]}" if steps else "no steps"

    def f(x: float, fmt: str = "+.3f") -> str:
        return format(x, fmt) if math.isfinite(x) else "-"

    wins = sum(adv[s] > other[s] for s in rep_steps)
    return (f"| {run.preset}[seed {run.seeds[0]}] `{run.path}` | {len(steps)} | {onset if onset is not None else 'none'}"
            f" | {flags[0] if flags else 'none'} | {len(rep_steps)} | "
            f"{f(_mean(shares), '.3f')}, {f(max(shares, default=float('nan')), '.3f')} | "
            f"{f(_mean([adv[s] for s in rep_steps]))} / {f(_mean([other[s] for s in rep_steps]))} | "
            f"{wins} of {len(rep_steps)} | {f(_shift(t, before, after))} / {f(_shift(st, before, after))} ({span}) |")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-opd check-reproduction", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (config.yaml + metrics.jsonl)")
    p.add_argument("--single-seed", action="store_true",
                   help="judge a re-run of one seed: its opd run must inflate (the reproduction needs >= 2 of 3)")
    p.add_argument("--describe", action="store_true",
                   help="also print each run's mechanism numbers (repetitive-token share, advantage on repetitive "
                        "tokens vs the rest, teacher/student log-prob change, the detector's first flag) as a "
                        "markdown table; descriptive, the verdicts are unchanged")
    args = p.parse_args(argv)
    try:
        runs = [load_run(Path(d)) for d in args.runs]
        verdicts = check(runs, args.single_seed)
    except RunError as e:
        print(f"megatron-opd check-reproduction: {e}", file=sys.stderr)
        return 2
    if args.describe:
        print(DESCRIBE_HEADER)
        for run in runs:
            print(describe(run))
        print()
    for v in verdicts:
        print(f"[{'PASS' if v.ok else 'FAIL'}] {v.name}: {v.detail}")
    ok = all(v.ok for v in verdicts)
    print("reproduction" + (" (one seed)" if args.single_seed else "") + ":", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
