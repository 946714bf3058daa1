"""`megatron-opd check-reproduction` (eval/reproduction.py) on synthetic runs: a set that shows inflation
and its cure passes, and each criterion fails on its own when only its evidence is taken away."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest
import yaml

from megatron_opd.eval.reproduction import check, inflation_onset, load_run, main

STEPS, ONSET, BUDGET = 40, 11, 128


def _run(root: Path, preset: str, seed: int, *, inflate: bool = True, start_rep: float = 0.0,
         adv_wins: bool = True, teacher_jump: float = 1.5, late_trunc: float = 0.2, final_acc: float = 0.44,
         start_acc: Optional[float] = None, teacher_from: int = ONSET, student_jump: float = 0.3) -> Path:
    """A synthetic run: inflated from step ONSET (if `inflate`), the teacher's / student's mean log-prob up by
    `teacher_jump` / `student_jump` from `teacher_from` / ONSET; `start_acc`: a step-0 evaluation row (as the
    trainer logs the initial model's), none by default."""
    d = root / f"{preset}-{seed}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"algo": {"preset": preset}, "train": {"seed": seed},
                                                   "rollout": {"seed": seed, "max_new_tokens": BUDGET}}))
    rows = [] if start_acc is None else [{"step": 0, "eval/accuracy": start_acc}]
    for step in range(1, STEPS + 1):
        on = inflate and step >= ONSET
        row = {"step": step,
               "rollout/truncation_rate": 0.9 if on else (late_trunc if step > 20 else 0.2),
               "rollout/repetition_rate": 0.5 if on else (start_rep if step <= 5 else 0.0),
               "rollout/response_len_mean": 120.0 if on else 60.0,
               "adv/repetitive_token_share": 0.3 if on else 0.0,
               "adv/repetitive_mean": (0.5 if adv_wins else -0.5) if on else 0.0,
               "adv/other_mean": -0.2,
               "logp/teacher_mean": -2.0 + (teacher_jump if inflate and step >= teacher_from else 0.0),
               "logp/student_mean": -1.5 + (student_jump if on else 0.0)}
        if step % 10 == 0:
            row["eval/accuracy"] = {10: 0.3, 20: 0.4, 30: 0.45, 40: final_acc}[step]
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _set(root: Path, changes: Optional[dict] = None) -> list[Path]:
    """3 seeds x (opd, stable_opd); `changes` maps (preset, seed) -> keyword overrides for that run."""
    changes, dirs = changes or {}, []
    for seed in (1, 2, 3):
        dirs.append(_run(root, "opd", seed, **changes.get(("opd", seed), {})))
        dirs.append(_run(root, "stable_opd", seed, **{"inflate": False, **changes.get(("stable_opd", seed), {})}))
    return dirs


def _verdicts(dirs):
    return [v.ok for v in check([load_run(d) for d in dirs])]


def test_a_set_showing_inflation_and_its_cure_passes(tmp_path, capsys):
    dirs = _set(tmp_path)
    assert inflation_onset(load_run(dirs[0])) == ONSET + 2  # 3-step means cross every threshold two steps in
    assert inflation_onset(load_run(dirs[1])) is None
    assert _verdicts(dirs) == [True, True, True, True]
    assert main([str(d) for d in dirs]) == 0
    assert "reproduction: PASS" in capsys.readouterr().out


@pytest.mark.parametrize("changes,failing", [
    ({("opd", 2): {"start_rep": 0.2}}, 0),  # a run starts with repetition: not a valid start
    ({("opd", 2): {"inflate": False}, ("opd", 3): {"inflate": False}}, 1),  # only 1 of 3 opd runs inflates
    ({("opd", 1): {"adv_wins": False}}, 2),  # repetitive tokens not paid more
    ({("opd", 3): {"teacher_jump": 0.1}}, 2),  # the teacher's log-prob rises less than the student's
    ({("stable_opd", 2): {"late_trunc": 0.5}}, 3),  # the cure lets truncation rise
    ({("stable_opd", 1): {"final_acc": 0.3}}, 3),  # the cure ends far below its peak accuracy
    # the peak is the initial model's (step 0): 0.73 -> 0.44 is a drop of 0.29 (the checker once skipped step 0)
    ({("stable_opd", 1): {"start_acc": 0.73}}, 3),
    # the student's log-prob rises 1.0 from the first inflated step (ONSET), the teacher's 0.8 only from the
    # checker's onset (ONSET + 2): a window of 5 steps before the onset held ONSET and ONSET + 1, so the
    # student's rise looked like 0.6 and the mechanism passed
    ({("opd", 2): {"student_jump": 1.0, "teacher_jump": 0.8, "teacher_from": ONSET + 2}}, 2),
])
def test_each_criterion_fails_on_its_own(tmp_path, changes, failing):
    ok = _verdicts(_set(tmp_path, changes))
    assert ok == [i != failing for i in range(4)], ok


def test_step_zero_evaluation_is_read_and_changes_nothing_else(tmp_path):
    """Every run with a step-0 evaluation row (the trainer's initial held-out evaluation): it is part of the
    accuracy series, and the other criteria, the onset and B are what they are without it."""
    dirs = _set(tmp_path, {(p, seed): {"start_acc": 0.4} for p in ("opd", "stable_opd") for seed in (1, 2, 3)})
    run = load_run(dirs[1])
    assert run.series("eval/accuracy")[0] == (0, 0.4)
    assert inflation_onset(load_run(dirs[0])) == ONSET + 2
    assert _verdicts(dirs) == [True, True, True, True]


def test_mechanism_window_ends_before_the_first_inflated_step(tmp_path, capsys):
    """The onset (ONSET + 2) is the first step whose 3-step means pass; its window holds ONSET and ONSET + 1,
    inflated already: the 5 steps "before" are ONSET - 5 .. ONSET - 1."""
    from megatron_opd.eval.reproduction import first_inflated_step

    dirs = _set(tmp_path)
    assert first_inflated_step(load_run(dirs[0]), ONSET + 2) == ONSET
    assert main([str(d) for d in dirs]) == 0
    assert f"onset {ONSET + 2} (before: steps {ONSET - 5}-{ONSET - 1})" in capsys.readouterr().out


def test_cure_needs_the_seeds_of_the_inflating_runs(tmp_path):
    dirs = [d for d in _set(tmp_path) if d.name != "stable_opd-2"]
    assert _verdicts(dirs) == [True, True, True, False]


def test_bad_run_directory_is_named(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    d = _run(tmp_path, "opd", 1)
    (d / "config.yaml").write_text("algo: {preset: opd}\n")
    assert main([str(d)]) == 2
    assert "needs algo.preset, train.seed" in capsys.readouterr().err


def test_megatron_opd_cli_has_the_subcommand(tmp_path, capsys):
    from megatron_opd.cli import main as cli

    dirs = _set(tmp_path, {("opd", 1): {"inflate": False}, ("opd", 2): {"inflate": False}})
    assert cli(["check-reproduction", *map(str, dirs)]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] plain OPD inflates" in out and "reproduction: FAIL" in out


def test_single_seed_rerun_is_judged_on_its_own_seed(tmp_path, capsys):
    """`demo --reproduce --seed S` re-runs one seed: its opd run must inflate; the multi-seed form needs >= 2."""
    one = [_run(tmp_path, "opd", 7), _run(tmp_path, "stable_opd", 7, inflate=False)]
    assert [v.ok for v in check([load_run(d) for d in one])] == [True, False, True, True]
    assert main([*map(str, one), "--single-seed"]) == 0
    assert "reproduction (one seed): PASS" in capsys.readouterr().out
    calm = _run(tmp_path / "calm", "opd", 8, inflate=False)
    assert main([str(calm), "--single-seed"]) == 1
    assert main([*map(str, _set(tmp_path / "three")), "--single-seed"]) == 2
    assert "--single-seed: 3 opd runs given" in capsys.readouterr().err


def test_describe_prints_the_mechanism_numbers_and_the_detectors_first_flag(tmp_path, capsys):
    """`--describe`: per run, the onset, the collapse detector's first flag (`health/collapsed`), the repetitive
    tokens' share and advantage against the rest, and the log-prob changes across the onset (first / last 5 steps
    without one). The verdicts printed after it are the same as without the flag."""
    opd = _run(tmp_path, "opd", 1)
    rows = [json.loads(line) for line in (opd / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["health/collapsed"] = 1.0 if r["step"] >= 9 else 0.0
    (opd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calm = _run(tmp_path, "stable_opd", 1, inflate=False)
    assert main([str(opd), str(calm), "--single-seed"]) == 0
    plain = capsys.readouterr().out
    assert main([str(opd), str(calm), "--single-seed", "--describe"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("| run | steps | onset | detector's first flag")
    inflating = next(line for line in lines if line.startswith("| opd[seed 1]"))
    cells = [c.strip() for c in inflating.strip("|").split("|")]
    # inflated from step 11, so the 3-step onset is 13; flagged at 9; 30 steps with repetitive tokens (11-40),
    # share 0.3, A +0.5 vs -0.2, all 30 won; teacher +1.5 and student +0.3 from steps 6-10 (before the first
    # inflated step) to 13-17
    assert cells[1:] == ["40", "13", "9", "30", "0.300, 0.300", "+0.500 / -0.200", "30 of 30",
                         "+1.500 / +0.300 (steps 6-10 -> 13-17)"]
    quiet = [c.strip() for c in next(line for line in lines if line.startswith("| stable_opd")).strip("|").split("|")]
    assert quiet[2:7] == ["none", "none", "0", "-, -", "- / -"]
    assert quiet[8].startswith("+0.000 / +0.000 (steps 1-5 -> 36-40)")
    assert out.endswith(plain)
