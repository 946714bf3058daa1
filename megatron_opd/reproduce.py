"""`megatron-opd demo --reproduce`: the length-inflation setting of docs/reproduction.md, run and judged.

The pair is the analogue of the paper's (a short-answer student under a teacher whose own solutions are
longer and complete): the student is SmolLM2-135M-Instruct fine-tuned on one-line solutions (the demo's
teacher), the teacher the same base model fine-tuned on solutions that plan, work and check by the inverse
operation (`CHECKED_TEACHER_RECIPE`). Neither is shaped to reward repetition. Each arm (opd, opd_kl,
stable_opd) runs per seed with `train.seed` and `rollout.seed` both varied; the end is the pair probe's
verdict, the checker's verdict (eval/reproduction.py), a figure in the paper's layout and a table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from transformers import AutoTokenizer

from megatron_opd.data.builtin.arithmetic import write_builtin_jsonl
from megatron_opd.eval.probe import load_probe_prompts, probe, render
from megatron_opd.eval.reproduction import main as check_main
from megatron_opd.rollout.local import LocalEngine
from megatron_opd.teacher.hf import HFTeacher
from megatron_opd.trainer.plot import REPRODUCTION_PANELS, plot_runs

ARMS = ("opd", "opd_kl", "stable_opd")
SEEDS = (0, 1, 2)
ROLLOUT_SEED_BASE = 1234
# Fixed before their runs (docs/reproduction.md, "The reproduction's setting" and "Setting B"): steps, budget,
# eval cadence, and what a setting sets on top of the demo's common setting.
SETTINGS = {
    # SmolLM2 fine-tuned on one-line solutions, under SmolLM2 fine-tuned on checked ones
    "smollm2": {"steps": 50, "budget": 256, "eval_every": 10, "overrides": []},
    # byte-level models trained from scratch (demo.prepare_byte_pair): cheap steps, so more of them and more room
    "bytes": {"steps": 200, "budget": 512, "eval_every": 10,
              "overrides": ["train.prompts_per_step=8", "optim.lr=1e-4"]},
    # the bytes pair fine-tuned further, the teacher on a quarter one-line solutions (demo.prepare_support_pair)
    "bytes-support": {"steps": 100, "budget": 512, "eval_every": 10,
                      "overrides": ["train.prompts_per_step=8", "optim.lr=1e-4"]},
}
TINY_SETTING = {"steps": 4, "budget": 32, "eval_every": 2, "overrides": []}  # the demo's tiny budget


def arm_overrides(seed: int, setting: dict, text_threshold: float) -> list[str]:
    """What a reproduction arm sets on top of the demo's setting (demo_overrides). Runs take hours here, so each
    arm checkpoints every 5 steps and resumes: `demo --reproduce` again continues where it was stopped (a
    finished arm resumes at its last step and runs nothing)."""
    return [f"train.seed={seed}", f"rollout.seed={ROLLOUT_SEED_BASE + seed}", f"train.eval_every={setting['eval_every']}",
            f"train.health.text_threshold={text_threshold:.2f}", f"checkpoint.save_every={min(5, setting['steps'])}",
            "checkpoint.resume=auto", "checkpoint.keep_last=2"]


def probe_pair(student: Path, teacher: Path, budget: int, n: int, out: Path) -> dict:
    """The pair probe at the run's budget (cached in `out`); its teacher p99 zlib ratio is the runs' repetition
    threshold, so it is measured before any run and written down."""
    f = out / "probe.json"
    if f.is_file():
        return json.loads(f.read_text())
    tok = AutoTokenizer.from_pretrained(str(student))
    engine = LocalEngine.from_pretrained(student)
    scorer = HFTeacher(engine.model, eos_token_ids=engine.eos_token_ids, pad_token_id=engine.pad_token_id)
    teacher_scorer = HFTeacher.from_pretrained(teacher)
    report = probe(engine, scorer, teacher_scorer, tok, load_probe_prompts(None, tok, n, use_chat=True), n=n,
                   budget=budget, copies=4, seed=0, teacher_engine=LocalEngine(teacher_scorer.model))
    print(render(report), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    data = {"student_path": str(student), "teacher_path": str(teacher), **report.to_json()}
    f.write_text(json.dumps(data, indent=1) + "\n")
    return data


def reproduce(out: Path, student: Path, teacher: Path, tiny: bool, seeds: tuple[int, ...], overrides: list[str],
              run_preset: Callable[..., dict], compare_table: Callable[[list[Path]], str], n_train: int,
              n_eval: int, arms: tuple[str, ...] = ARMS, setting: dict | None = None) -> int:
    """Probe, then every (seed, arm) run, then the figure, the table and the checker's verdict (its exit code).
    `setting` is one of SETTINGS (default: the SmolLM2 pair's, or TINY_SETTING with `tiny`), with the setting's
    own overrides applied over the arm's and under the user's.

    Only `arms` are run; another arm's run directory that already holds metrics (a finished run, or one
    copied from docs/reproduction/) is still judged, so one arm can be added to a reproduction without
    re-running the others."""
    t0 = time.time()
    if setting is None:
        setting = TINY_SETTING if tiny else SETTINGS["smollm2"]
    data = write_builtin_jsonl(out / "data", n_train=n_train, n_eval=n_eval)
    report = probe_pair(student, teacher, setting["budget"], 8 if tiny else 32, out)
    threshold = max(1.0, report["teacher"]["zlib_ratio"]["p99"])
    print(f"[reproduce] pair: {report['verdict']}\n[reproduce] repetition threshold (teacher's p99 zlib ratio): "
          f"{threshold:.2f}", flush=True)
    runs = []
    for seed in seeds:
        for arm in ARMS:
            run = out / f"{arm}-seed{seed}"
            if arm in arms:
                run_preset(arm, run, student, teacher, data, setting["steps"], tiny,
                           arm_overrides(seed, setting, threshold) + setting["overrides"] + list(overrides),
                           setting["budget"])
            elif not (run / "metrics.jsonl").is_file():
                print(f"[reproduce] {run.name}: not run (not in --arms) and no metrics there", flush=True)
                continue
            runs.append(run)
    png = plot_runs(runs, out / "reproduction.png", REPRODUCTION_PANELS)
    table = compare_table(runs)
    (out / "table.md").write_text(table)
    print(f"\n[reproduce] {len(runs)} runs in {time.time() - t0:.0f} s\n\n{table}\n[reproduce] figure: {png}\n"
          f"[reproduce] the checker (megatron-opd check-reproduction{' --single-seed' if len(seeds) == 1 else ''} "
          f"{out}/*-seed*):", flush=True)
    return check_main([str(r) for r in runs] + (["--single-seed"] if len(seeds) == 1 else []))
