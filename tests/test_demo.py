"""`megatron-opd demo` at tiny size (seconds): the teacher is made from the student by `megatron-opd sft`
and cached, the held-out problems never reach its training data, and the whole command runs, evaluating
the student before its first step and at the end. The real-model demo runs in `.ci/run`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_opd import demo

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


def test_tiny_teacher_is_the_student_fine_tuned_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file

    from megatron_opd.data.builtin.arithmetic import builtin_splits

    student, teacher = demo.prepare_models(tmp_path, tiny=True, log=lambda _: None)
    meta = json.loads((teacher / "sft_meta.json").read_text())
    assert meta["recipe"] == demo.TINY_TEACHER_RECIPE and meta["source_model"] == str(student)
    assert meta["nll_last"] < meta["nll_first"]
    a, b = load_file(str(student / "model.safetensors")), load_file(str(teacher / "model.safetensors"))
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    assert (teacher / "tokenizer.json").read_text() == (student / "tokenizer.json").read_text()
    assert not list(tmp_path.glob(".*.data.jsonl"))  # its training file is not left behind

    # cached: a second call trains nothing; a different recipe makes a different teacher
    def refuse(*_a, **_k):
        raise AssertionError("the cached teacher was re-made")

    monkeypatch.setattr("megatron_opd.demo.run_sft", refuse)
    assert demo.prepare_models(tmp_path, tiny=True, log=lambda _: None) == (student, teacher)
    with pytest.raises(AssertionError, match="re-made"):
        demo.prepare_teacher(student, tmp_path, {**demo.TINY_TEACHER_RECIPE, "steps": 3})

    # none of the demo's held-out problems is among the teacher's training problems
    seen: list[dict] = []
    monkeypatch.setattr("megatron_opd.demo.run_sft",
                        lambda cfg, *a, **k: seen.extend(json.loads(l) for l in Path(cfg.data.train_path).open()))
    demo.prepare_teacher(student, tmp_path, {**demo.TINY_TEACHER_RECIPE, "problems": 2000})
    _, held_out = builtin_splits(demo.N_TRAIN, demo.N_EVAL, 0)
    assert len(seen) > 1900 and not {r["problem"] for r in held_out} & {r["problem"] for r in seen}


def test_tiny_demo_runs_and_evaluates_before_and_after(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    assert demo.main(["--tiny", "--steps", "2", "--out", str(out), "--cache", str(tmp_path / "cache"),
                      "logging.progress_bar=false"]) == 0
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2] and "eval/accuracy" not in rows[1]
    assert "rollout/response_len_mean" not in rows[0]  # step 0 is the initial student's evaluation only
    assert (out / "dynamics.png").is_file() and (out / "checkpoints" / "latest").is_file()
    printed = capsys.readouterr().out
    assert "held-out greedy accuracy" in printed and "arith-teacher" in printed


def test_tiny_demo_compare_runs_every_preset_into_one_figure_and_table(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cmp"
    assert demo.main(["--tiny", "--compare", "--steps", "2", "--out", str(out), "--cache", str(tmp_path / "cache"),
                      "logging.progress_bar=false"]) == 0
    for preset in demo.COMPARE_PRESETS:
        rows = [json.loads(l) for l in (out / preset / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == 2
        assert (rows[-1].get("loss/kl") is not None) == (preset != "opd")
    table = (out / "table.md").read_text()
    assert [l.split("|")[1].strip() for l in table.splitlines() if l.startswith("| ") and "preset" not in l] == \
        list(demo.COMPARE_PRESETS)
    assert (out / "dynamics.png").is_file() and "collapse flagged" in capsys.readouterr().out


@pytest.mark.slow  # 30 s together: the default suite's budget (docs/testing.md); CI's slow leg runs them
def test_tiny_demo_reproduce_probes_runs_every_arm_and_ends_with_the_checker(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    """`demo --reproduce --tiny`: the pair (short-solution student, checked-solution teacher) is made, probed,
    and each arm runs with the seed's train.seed and rollout.seed and the probe's repetition threshold; the
    checker's verdict is the exit code (tiny random models cannot show inflation: it fails, and says why)."""
    import yaml

    from megatron_opd.reproduce import ARMS, ROLLOUT_SEED_BASE, TINY_SETTING

    out, cache = tmp_path / "repro", tmp_path / "cache"
    rc = demo.main(["--reproduce", "--tiny", "--seed", "5", "--out", str(out), "--cache", str(cache),
                    "logging.progress_bar=false"])
    printed = capsys.readouterr().out
    assert rc == 1 and "reproduction (one seed): FAIL" in printed and "[FAIL] plain OPD inflates" in printed
    probe = json.loads((out / "probe.json").read_text())
    assert probe["budget"] == TINY_SETTING["budget"] and probe["teacher"]["n"] == 8
    student, teacher = Path(probe["student_path"]), Path(probe["teacher_path"])
    meta_s, meta_t = (json.loads((d / "sft_meta.json").read_text()) for d in (student, teacher))
    assert "style" not in meta_s["recipe"] and meta_t["recipe"]["style"] == "checked"
    threshold = max(1.0, probe["teacher"]["zlib_ratio"]["p99"])
    for arm in ARMS:
        cfg = yaml.safe_load((out / f"{arm}-seed5" / "config.yaml").read_text())
        assert (cfg["algo"]["preset"], cfg["train"]["seed"], cfg["rollout"]["seed"]) == (arm, 5, ROLLOUT_SEED_BASE + 5)
        assert cfg["train"]["health"]["text_threshold"] == pytest.approx(threshold, abs=0.006)
        rows = [json.loads(l) for l in (out / f"{arm}-seed5" / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == TINY_SETTING["steps"]
    assert (out / "reproduction.png").is_file() and (out / "table.md").is_file()
    # stopped or finished, the same command continues: every arm resumes at its last checkpoint
    files = [out / f"{arm}-seed5" / "metrics.jsonl" for arm in ARMS]
    before = [(f.read_text(), f.stat().st_mtime_ns) for f in files]
    assert demo.main(["--reproduce", "--tiny", "--seed", "5", "--out", str(out), "--cache", str(cache),
                      "logging.progress_bar=false"]) == 1
    assert [(f.read_text(), f.stat().st_mtime_ns) for f in files] == before  # nothing re-trained or re-logged
    # one arm added to the others' runs: only it trains; all three are judged
    shutil.rmtree(out / "stable_opd-seed5")
    assert demo.main(["--reproduce", "--tiny", "--seed", "5", "--arms", "stable_opd", "--out", str(out),
                      "--cache", str(cache), "logging.progress_bar=false"]) == 1
    assert [(f.read_text(), f.stat().st_mtime_ns) for f in files[:2]] == before[:2]
    assert json.loads(files[2].read_text().splitlines()[-1])["step"] == TINY_SETTING["steps"]
    table = (out / "table.md").read_text()
    assert all(f"| {arm}-seed5 |" in table for arm in ARMS), table
    with pytest.raises(SystemExit):
        demo.main(["--reproduce", "--tiny", "--arms", "stable,opd", "--out", str(out), "--cache", str(cache)])
    with pytest.raises(SystemExit):
        demo.main(["--reproduce", "--tiny", "--steps", "3", "--out", str(out), "--cache", str(cache)])


@pytest.mark.slow  # see above
@pytest.mark.parametrize("setting", ["bytes", "bytes-support"])
def test_tiny_reproduce_bytes_settings_train_their_pair_from_scratch_and_apply_their_overrides(
        setting: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`demo --reproduce --setting bytes|bytes-support --tiny`: the setting-B pair is built at its real sizes with
    the byte tokenizer, trained from scratch (2 SFT steps here) on short and on checked solutions; setting C
    fine-tunes each further for its SUPPORT_STAGES (new problems; the teacher's data mixes in one-line
    solutions). The pair that is probed and run is the setting's, and the arm runs with the setting's own
    overrides (8 prompts a step, lr 1e-4) at the tiny budget."""
    import yaml

    from megatron_opd.reproduce import SETTINGS, TINY_SETTING

    out, cache = tmp_path / "repro", tmp_path / "cache"
    rc = demo.main(["--reproduce", "--tiny", "--setting", setting, "--arms", "opd", "--seed", "3", "--out", str(out),
                    "--cache", str(cache), "logging.progress_bar=false"])
    printed = capsys.readouterr().out
    assert rc == 1 and "opd_kl-seed3: not run" in printed
    probe = json.loads((out / "probe.json").read_text())
    for role in ("student", "teacher"):
        d = Path(probe[f"{role}_path"])
        assert d.parent == cache and d.name.startswith(f"bytes-{role}-")
        cfg = json.loads((d / "config.json").read_text())
        assert {k: cfg[k] for k in demo.BYTE_MODELS[role]} == demo.BYTE_MODELS[role] and cfg["vocab_size"] == 259
        meta = json.loads((d / "sft_meta.json").read_text())
        b_recipe = {**demo.TINY_BYTE_RECIPE, "style": "short" if role == "student" else "checked"}
        if setting == "bytes":
            assert meta["recipe"] == b_recipe
        else:
            assert meta["recipe"] == {**demo.TINY_BYTE_RECIPE, **demo.SUPPORT_STAGES[role],
                                      "steps": demo.TINY_BYTE_RECIPE["steps"]}
            b_model = Path(meta["source_model"])
            assert b_model.parent == cache and json.loads((b_model / "sft_meta.json").read_text())["recipe"] == b_recipe
    cfg = yaml.safe_load((out / "opd-seed3" / "config.yaml").read_text())
    assert cfg["train"]["prompts_per_step"] == 8 and cfg["optim"]["lr"] == pytest.approx(1e-4)
    assert cfg["rollout"]["max_new_tokens"] == TINY_SETTING["budget"] and cfg["train"]["steps"] == TINY_SETTING["steps"]
    assert SETTINGS["bytes"]["budget"] == SETTINGS["bytes-support"]["budget"] == 512
    assert (SETTINGS["bytes"]["steps"], SETTINGS["bytes-support"]["steps"]) == (200, 100)
    assert not (out / "stable_opd-seed3").exists()


def test_sft_rows_mix_one_line_solutions_into_a_teachers_data_at_the_recipes_fraction() -> None:
    """Setting C's teacher data: the same problems in the same order, each problem's one-line solution with
    probability `short_fraction` and its checked one otherwise; a fraction outside [0, 1] names the field."""
    recipe = {"problems": 400, "data_seed": 2, "style": "checked"}
    checked, short = demo.sft_rows(recipe), demo.sft_rows({**recipe, "style": "short"})
    mixed = demo.sft_rows({**recipe, "short_fraction": 0.25})
    assert [r["problem"] for r in mixed] == [r["problem"] for r in checked]
    is_short = [m["solution"] == s["solution"] for m, s in zip(mixed, short)]
    assert all(short or m["solution"] == c["solution"] for short, m, c in zip(is_short, mixed, checked))
    assert 0.18 < sum(is_short) / len(mixed) < 0.32
    assert demo.sft_rows({**recipe, "short_fraction": 0.0}) == checked
    with pytest.raises(ValueError, match="short_fraction"):
        demo.sft_rows({**recipe, "short_fraction": 1.5})


def test_compare_table_and_figure_show_the_detector_verdict(tmp_path: Path) -> None:
    from megatron_opd.trainer.plot import plot_runs

    runs = []
    for name, flag_at in (("opd", 3), ("stable_opd", None)):
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": 0, "eval/accuracy": 0.3}] + [
            {"step": s, "rollout/response_len_mean": 10.0 * s, "rollout/truncation_rate": 0.1, "rollout/repetition_rate": 0.0,
             "adv/repetitive_mean": 2.0, "adv/other_mean": 0.5, "health/collapsed": float(s == flag_at),
             **({"eval/accuracy": 0.1} if s == 4 else {})}
            for s in (1, 2, 3, 4)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(d)
    table = demo.compare_table(runs)
    opd_row, stable_row = [l for l in table.splitlines() if l.startswith("| opd") or l.startswith("| stable")]
    assert "step 3" in opd_row and stable_row.rstrip(" |").endswith("no")
    assert "0.3 -> 0.3 (0) -> 0.1" in opd_row and "10 / 40 / 40" in opd_row and "2 vs 0.5 (4)" in opd_row
    assert plot_runs(runs, tmp_path / "fig.png").stat().st_size > 1000


def test_compare_table_counts_a_collapse_whose_step_a_rollback_re_trained(tmp_path: Path) -> None:
    """After a rollback the re-trained step's row replaces the flagged one; the event count still shows it.
    A NaN evaluation (a foreign log) is not taken for the peak."""
    d = tmp_path / "opd"
    d.mkdir()
    rows = [{"step": 0, "eval/accuracy": float("nan")}, {"step": 1, "eval/accuracy": 0.4},
            {"step": 2, "rollout/response_len_mean": 9.0, "health/collapsed": 1.0, "health/collapse_events": 1.0},
            {"step": 2, "rollout/response_len_mean": 8.0, "health/collapsed": 0.0, "health/collapse_events": 1.0,
             "eval/accuracy": 0.2}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = demo.compare_table([d]).splitlines()[-1]
    assert "1 event(s), re-trained after a rollback" in row and "0.4 -> 0.4 (1) -> 0.2" in row


_PREPARE = """
import sys
from pathlib import Path
from megatron_opd import demo
student, teacher = demo.prepare_models(Path(sys.argv[1]), tiny=True, log=lambda m: print(m, flush=True))
print("PAIR", student, teacher)
"""


def test_two_processes_preparing_one_cache_make_each_entry_once(tmp_path: Path) -> None:
    """The cache under ~/.cache/megatron-opd is shared by the demo and by tests that may run side by side: two
    processes that prepare the same (empty) cache at once both get a complete pair, the teacher is fine-tuned
    once (the second waits on the entry's lock and finds it made), and no partial directory is left."""
    import subprocess
    import sys

    from _proc import explain

    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", _PREPARE, str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        res = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        assert p.returncode == 0, explain(res)
        outs.append(out)
    pairs = {line for o in outs for line in o.splitlines() if line.startswith("PAIR ")}
    assert len(pairs) == 1, outs
    made = [o.count("making the teacher") for o in outs]
    assert sorted(made) == [0, 1], outs
    student, teacher = pairs.pop().split()[1:]
    assert demo.read_sft_meta(Path(teacher)) is not None and (Path(student) / "model.safetensors").is_file()
    leftovers = [p.name for p in cache.rglob("*") if ".tmp" in p.name or p.name.endswith(".partial")]
    assert not leftovers, leftovers
