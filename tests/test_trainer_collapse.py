"""Collapse actions end to end in the trainer (tiny real-architecture models on CPU), each followed by a
resume, and a SIGKILL of the trainer process in the middle of a checkpoint re-save.

The detector is driven into a verdict through its config (`train.collapse.*`): it watches
`train/weight_version` as its "length" metric with window = baseline_window = 1 and length_ratio 1.9.
The version rises by one per step, so the verdict step is known exactly: version v against the first
one (1) exceeds 1.9x from v = 2 on. After an action resets the detector, the new baseline is the next
version and v / baseline stays below 1.9, so there is exactly one verdict (with patience 1) per run.
raise_beta_kl keeps the detector's history (it must not blind it): the collapse goes on, so it acts
again once its hold of `window` steps has passed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _proc import explain, run
from _tiny import tiny_setup
from megatron_opd.config import ConfigError, load_config
from megatron_opd.models.checkpoint import read_weights, save_training_state
from megatron_opd.trainer.logger import read_metrics

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


TRIGGER = ["train.collapse.length_key=train/weight_version", "train.collapse.length_ratio=1.9",
           "train.collapse.truncation_jump=null", "train.collapse.repetition_jump=null", "train.collapse.window=1",
           "train.collapse.baseline_window=1", "train.collapse.min_steps=1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("collapse"))


def _overrides(setup, out: Path, action: str, steps: int, *extra: str) -> list[str]:
    _root, student, teacher, data = setup
    return [
        "algo.preset=opd", f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=hf",
        f"data.train_path={data['train']}", f"train.steps={steps}", "train.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=8", "optim.lr=1e-3",
        f"logging.out_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
        "logging.sample_every=0", "checkpoint.save_every=1", "checkpoint.keep_last=3",
        f"train.collapse_action={action}", "train.collapse.patience=1", *TRIGGER, *extra]


def _trainer(setup, out, action, steps, *extra, cls=None):
    from megatron_opd.trainer.loop import Trainer

    return (cls or Trainer)(load_config(None, _overrides(setup, out, action, steps, *extra)))


def _run(trainer, stop_after=None):
    try:
        trainer.train(stop_after=stop_after)
    finally:
        trainer.close()
    return trainer


def _raw_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _scripted_evals(*accuracies: float):
    """A Trainer whose `evaluate` returns these held-out accuracies in turn (the tiny random models score 0 on
    anything; the real evaluation path is covered by tests/test_demo.py and tests/test_eval_cli.py)."""
    from megatron_opd.trainer.loop import Trainer

    script = iter(accuracies)

    class Scripted(Trainer):
        def evaluate(self) -> dict[str, float]:
            return {"eval/accuracy": next(script)}

    return Scripted


def _weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return read_weights(out / "checkpoints" / f"step_{step:08d}" / "shared")


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        torch.testing.assert_close(b[k], v, rtol=1e-5, atol=1e-6, msg=k)


def _assert_same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in ("rollout/response_len_mean", "loss/pg_loss", "loss/kl", "logp/student_mean", "loss/grad_norm",
                    "train/beta_kl", "train/weight_version", "health/collapsed"):
            if key in ra or key in rb:
                assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)


def _kl_logged(row: dict) -> bool:
    return row.get("loss/kl") is not None and row["loss/kl"] == row["loss/kl"]


# -- warn ------------------------------------------------------------------------------------------


def test_warn_logs_and_flags_then_resume_keeps_the_detector_history(setup, tmp_path, caplog):
    out = tmp_path / "warn"
    with caplog.at_level(logging.WARNING, logger="megatron_opd.trainer"):
        t = _run(_trainer(setup, out, "warn", 3))
    assert "collapse detected" in caplog.text and "action=warn" in caplog.text
    rows = read_metrics(out)
    assert [r["health/collapsed"] for r in rows] == [0.0, 1.0, 1.0]  # v=2, 3 against the baseline 1
    assert [r["health/collapse_events"] for r in rows] == [0.0, 1.0, 2.0]
    assert all(r["train/beta_kl"] == 0.0 for r in rows) and t.beta_kl == 0.0 and t.ref is None
    resumed = _run(_trainer(setup, out, "warn", 4))
    row = read_metrics(out)[-1]
    assert resumed.step == 4 and row["step"] == 4
    # the restored detector still holds the baseline of step 1: a fresh one could not judge yet
    assert row["health/collapsed"] == 1.0 and row["health/collapse_events"] == 3.0


# -- stop ------------------------------------------------------------------------------------------


def test_stop_checkpoints_logs_and_raises_then_resume_continues(setup, tmp_path):
    from megatron_opd.trainer.loop import TrainingStopped

    out = tmp_path / "stop"
    t = _trainer(setup, out, "stop", 4)
    with pytest.raises(TrainingStopped, match="collapse detected at step 2"):
        _run(t)
    assert t.step == 2 and t.ckpt.latest_step() == 2
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["health/collapsed"] == 1.0  # the stopping step is logged
    # the user looks at the run, then continues it (here: only warning from now on)
    resumed = _run(_trainer(setup, out, "warn", 3))
    assert resumed.step == 3 and [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert read_metrics(out)[-1]["train/weight_version"] == 3.0


# -- raise_beta_kl ---------------------------------------------------------------------------------


def test_raise_beta_kl_builds_the_reference_and_a_resume_keeps_it(setup, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    t = _run(_trainer(setup, full, "raise_beta_kl", 3))
    rows = read_metrics(full)
    # the verdict holds at step 3 too (the detector was not reset): raised again one window (1 step) later;
    # before the fix the reset detector needed baseline_window + window fresh steps to see it again
    assert [r["health/collapsed"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["health/collapse_events"] for r in rows] == [0.0, 1.0, 2.0]
    assert [r["train/beta_kl"] for r in rows] == [0.0, 0.0, 0.01]  # raised after step 2, used from step 3
    assert t.ref is not None and not _kl_logged(rows[0]) and rows[2]["loss/kl"] > 0
    meta = [json.loads((full / "checkpoints" / f"step_0000000{s}" / "meta.json").read_text()) for s in (2, 3)]
    assert [m["beta_kl"] for m in meta] == [0.01, 0.02] and t.beta_kl == 0.02
    # stop right after the raise, resume in a new trainer whose config still says beta_kl = 0
    _run(_trainer(setup, part, "raise_beta_kl", 3), stop_after=2)
    resumed = _trainer(setup, part, "raise_beta_kl", 3)
    assert resumed.cfg.algo.beta_kl == 0.0 and resumed.beta_kl == 0.01 and resumed.ref is not None
    _run(resumed)
    _assert_same_rows(rows, read_metrics(part))
    _assert_same_weights(_weights(full, 3), _weights(part, 3))


# -- rollback --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rollback_run(setup, tmp_path_factory):
    """An uninterrupted rollback run: with patience 2 the verdict comes at step 3 (versions 2 and 3 both
    above 1.9x the baseline), so the rollback target is step 3 - window - patience + 1 = 1 and the
    checkpoint of step 2 belongs to the abandoned trajectory."""
    from megatron_opd.trainer.loop import Trainer

    class Spy(Trainer):
        def __init__(self, cfg):
            super().__init__(cfg)
            rollback = self.guard.rollback

            def spy(trainer, target):
                self.spy_target = target
                self.spy_checkpoint = _weights(self.ckpt.root.parent, target)
                self.spy_dirs_before = sorted(p.name for p in self.ckpt.root.glob("step_*"))
                rollback(trainer, target)
                live = self.ckpt.root.parent / "restored-weights"  # the live model in the checkpoint's key space
                live.mkdir()
                save_training_state(self.student.model, None, live)
                self.spy_restored = read_weights(live)
                self.spy_dirs_after = sorted(p.name for p in self.ckpt.root.glob("step_*"))

            self.guard.rollback = spy

    out = tmp_path_factory.mktemp("rollback") / "run"
    t = _run(_trainer(setup, out, "rollback", 4, "train.collapse.patience=2", cls=Spy))
    return out, t


def test_rollback_restores_the_checkpoint_and_continues_with_fresh_versions(setup, rollback_run):
    out, t = rollback_run
    raw = _raw_rows(out)
    assert [r["step"] for r in raw] == [1, 2, 3, 2, 3, 4]
    assert [r["health/collapsed"] for r in raw] == [0, 0, 1, 0, 0, 0]
    # versions pushed to the engine only ever increase (the rollback pushed version 4)
    assert [r["train/weight_version"] for r in raw] == [1, 2, 3, 5, 6, 7]
    assert [r["train/beta_kl"] for r in raw] == [0, 0, 0, 0.01, 0.01, 0.01]
    assert not any(_kl_logged(r) for r in raw[:3]) and all(r["loss/kl"] > 0 for r in raw[4:])
    # rollouts after the rollback come from the restored weights held by the engine
    assert all(r["rollout/engine_trainer_logp_absdiff"] < 1e-3 for r in raw)
    assert t.spy_target == 1
    _assert_same_weights(t.spy_checkpoint, t.spy_restored)
    assert t.spy_dirs_before == ["step_00000001", "step_00000002"]
    assert t.spy_dirs_after == ["step_00000001"]  # the abandoned step 2 is gone, latest -> 1
    assert t.step == 4 and t.ref is not None
    assert json.loads((out / "checkpoints" / "step_00000004" / "meta.json").read_text())["beta_kl"] == 0.01
    # resume after the rollback: the raised beta_kl and the reference come back, versions keep rising
    resumed = _run(_trainer(setup, out, "rollback", 5, "train.collapse.patience=2"))
    row = read_metrics(out)[-1]
    assert resumed.step == 5 and resumed.ref is not None
    assert row["step"] == 5 and row["train/beta_kl"] == 0.01 and row["loss/kl"] > 0
    assert row["train/weight_version"] == 8.0


def test_rollback_without_a_checkpoint_restarts_from_the_initial_student(setup, tmp_path):
    """No checkpoint before the verdict (save_every beyond it): the rollback restores the initial student at
    step 0 -- model.hf_path's weights and a fresh optimizer -- and re-trains with the raised beta_kl (before:
    it only raised beta_kl and trained on from the collapsed weights)."""
    from megatron_opd.models.optimizer import unwrap

    def model_weights(policy):  # a fresh optimizer has no state_dict yet: the model's tensors only
        return {k: v.clone() for k, v in unwrap(policy.model).state_dict().items() if isinstance(v, torch.Tensor)}

    out = tmp_path / "rb0"
    t = _trainer(setup, out, "rollback", 3, "checkpoint.save_every=100")
    initial = model_weights(t.student)
    seen = {}
    rollback = t.guard.rollback

    def spy(trainer, target):
        before = model_weights(trainer.student)
        rollback(trainer, target)
        seen.update(target=target, step=trainer.step, before=before, after=model_weights(trainer.student))

    t.guard.rollback = spy
    _run(t)
    assert seen["target"] is None and seen["step"] == 0 and t.guard.rollbacks == 1
    assert any(not torch.equal(seen["before"][k], v) for k, v in initial.items())  # it had trained
    _assert_same_weights(initial, seen["after"])
    raw = _raw_rows(out)
    assert [r["step"] for r in raw] == [1, 2, 1, 2, 3]
    assert [r["train/beta_kl"] for r in raw] == [0, 0, 0.01, 0.01, 0.01] and raw[-1]["loss/kl"] > 0
    assert [r["health/collapsed"] for r in raw] == [0, 1, 0, 0, 0] and t.step == 3


_DRIVER = """
import json, sys
from megatron_opd.config import ConfigError, load_config
from megatron_opd.trainer.loop import Trainer

trainer = Trainer(load_config(None, json.loads(sys.argv[1])))
try:
    trainer.train()
finally:
    trainer.close()
"""


@pytest.mark.slow  # > 15 s each: the slow CI leg runs both
@pytest.mark.parametrize("patience", [1, 2])
def test_sigkill_during_a_checkpoint_resave_then_resume_matches_the_uninterrupted_run(setup, tmp_path, patience):
    """The rollback re-saves the checkpoint of step 1; the trainer process is SIGKILLed after the old copy
    was moved aside and before the new one is in place. patience=1: the verdict comes at step 2, `latest`
    names step 1, so the kill leaves it naming a missing directory and the new process resumes from the
    aside copy. patience=2: the verdict comes at step 3 and `latest` still names step 2, so the new process
    redoes step 3, and its rollback finds step 1 only as the aside copy. Either way it ends exactly where
    an uninterrupted run ends."""
    from megatron_opd.trainer import checkpoint as ck

    extra = f"train.collapse.patience={patience}"
    ref_out = tmp_path / "uninterrupted"
    _run(_trainer(setup, ref_out, "rollback", 4, extra))
    out = tmp_path / "killed"
    args = json.dumps(_overrides(setup, out, "rollback", 4, extra))
    marker = tmp_path / "paused"
    env = {k: v for k, v in os.environ.items()  # this process's rendezvous port is taken: let the child pick
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({ck.PAUSE_ENV: "moved_aside:1", ck.PAUSE_FILE_ENV: str(marker),
                "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER, args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "the trainer never reached the re-save"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{patience:08d}"
    assert not (ckpts / "step_00000001").exists() and (ckpts / ".old_step_00000001").is_dir()

    env.pop(ck.PAUSE_ENV)
    done = run([sys.executable, "-c", _DRIVER, args], env=env, timeout=600)
    if patience == 1:  # the fallback to the aside copy was announced
        assert "names 'step_00000001', which is missing or incomplete" in done.stderr, explain(done)
    assert "rolled back to the checkpoint of step 1" in done.stderr, explain(done)
    _assert_same_rows(read_metrics(ref_out), read_metrics(out))
    _assert_same_weights(_weights(ref_out, 4), _weights(out, 4))
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002", "step_00000003", "step_00000004"]


def test_health_thresholds_from_the_config_reach_the_logged_metrics(setup, tmp_path: Path) -> None:
    """`train.health.*` sets the repetition detectors the trainer logs with (short budgets need scaled
    thresholds): at the paper's defaults no 8-token rollout is repetitive; with every threshold near zero,
    every rollout is."""
    rates = {}
    for name, extra in (("default", ()), ("scaled", ("train.health.text_threshold=0.01",
                                                       "train.health.token_threshold=0.01"))):
        _run(_trainer(setup, tmp_path / name, "warn", 1, *extra))
        [row] = [r for r in _raw_rows(tmp_path / name) if r.get("step") == 1]
        rates[name] = (row["rollout/repetition_rate"], row["rollout/repetition_rate_tokens"])
    assert rates == {"default": (0.0, 0.0), "scaled": (1.0, 1.0)}


def test_accuracy_drop_is_judged_from_the_trainers_evaluations(setup, tmp_path: Path) -> None:
    """The step-0 evaluation is the accuracy rule's first baseline and each periodic evaluation is judged."""
    out = tmp_path / "acc"
    _run(_trainer(setup, out, "warn", 3, "train.eval_every=1", "train.collapse.length_ratio=null",
                  cls=_scripted_evals(0.5, 0.45, 0.3, 0.2)))
    rows = {r["step"]: r for r in _raw_rows(out)}
    assert rows[0]["eval/accuracy"] == 0.5 and "health/collapsed" not in rows[0]
    assert [rows[s]["health/collapsed"] for s in (1, 2, 3)] == [0.0, 0.0, 1.0]  # 0.2 < half of the step-0 0.5


def test_the_last_step_is_evaluated_when_eval_every_does_not_divide_steps(setup, tmp_path: Path) -> None:
    """3 steps at eval_every=2: evaluations at 0 (initial), 2 (periodic) and 3 (the end of the run), so a run's
    final accuracy is always measured (`megatron-opd demo --steps 10` evaluates at 3, 6, 9 and 10)."""
    from megatron_opd.trainer.loop import Trainer

    seen = []

    class Recording(Trainer):
        def evaluate(self) -> dict[str, float]:
            seen.append(self.step)
            return {"eval/accuracy": 0.5}

    out = tmp_path / "last"
    _run(_trainer(setup, out, "warn", 3, "train.eval_every=2", cls=Recording))
    assert seen == [0, 2, 3]
    assert [r["step"] for r in _raw_rows(out) if "eval/accuracy" in r] == [0, 2, 3]


def test_raise_beta_kl_keeps_judging_accuracy_against_the_best(setup, tmp_path: Path) -> None:
    """Flagged at step 2 (0.2 < half of 0.5), beta_kl raised; the accuracy keeps falling (0.1 at step 3) and is
    flagged again -- the action does not reset the reference to its own degraded evaluation."""
    out = tmp_path / "beta"
    t = _run(_trainer(setup, out, "raise_beta_kl", 3, "train.eval_every=1", "train.collapse.length_ratio=null",
                      "train.collapse.min_steps=0", cls=_scripted_evals(0.5, 0.45, 0.2, 0.1)))
    rows = {r["step"]: r for r in _raw_rows(out)}
    assert [rows[s]["health/collapsed"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert t.beta_kl >= 0.02  # raised twice from the opd preset's 0


def test_rollback_after_an_accuracy_collapse_returns_to_the_best_evaluation(setup, tmp_path: Path) -> None:
    """The accuracy rule's evidence reaches back to the best evaluation (step 1 here), further than the rollout
    rules' window: the rollback restores step 1's checkpoint, not step 2's (which the old window rule chose)."""
    out = tmp_path / "rb"
    t = _trainer(setup, out, "rollback", 4, "train.eval_every=1", "train.collapse.length_ratio=null",
                 "train.collapse.min_steps=0", "checkpoint.keep_last=5",
                 cls=_scripted_evals(0.1, 0.5, 0.4, 0.2, 0.5, 0.5, 0.5))
    targets = []
    real = t.guard.rollback

    def spy(trainer, target: int) -> None:
        targets.append((trainer.step, target))
        real(trainer, target)

    t.guard.rollback = spy
    _run(t)
    assert targets == [(3, 1)]  # flagged at step 3 (0.2 < half of step 1's 0.5)


def test_eval_limit_keeps_the_first_problems_of_each_set(setup, tmp_path: Path) -> None:
    """`data.eval_limit: 3` evaluates the first 3 of the set's 4 problems, at every evaluation."""
    _root, _s, _t, data = setup
    out = tmp_path / "limit"
    _run(_trainer(setup, out, "warn", 1, "train.eval_every=1", f"data.eval_paths=[arith={data['eval']}]",
                  "data.eval_limit=3"))
    first = [json.loads(line)["id"] for line in Path(data["eval"]).read_text().splitlines()[:3]]
    dumps = sorted((out / "eval").rglob("samples_arith.jsonl"))
    assert len(dumps) == 2, dumps  # step 0 and step 1
    for f in dumps:
        assert [json.loads(line)["id"] for line in f.read_text().splitlines() if line.strip()] == first, f
    with pytest.raises(ConfigError, match="data.eval_limit"):
        load_config(None, _overrides(setup, out, "warn", 1, "data.eval_limit=0"))


@pytest.mark.parametrize("distributed,moments", [(False, "float32"), (True, "float32"), (False, "bfloat16")],
                         ids=["plain-optimizer", "distributed-optimizer", "bf16-adam-moments"])
def test_a_bf16_run_saves_and_resumes_to_the_uninterrupted_run(setup, tmp_path: Path, distributed: bool,
                                                               moments: str) -> None:
    """bf16 mixed precision saves and resumes with either optimizer. Without the distributed optimizer megatron's
    Float16OptimizerWithFloat16Params maps its state to the model through its half-precision params only, so a
    norm left in fp32 by the local spec failed the first save (the Qwen2.5 pair's run, step 5). With
    `optim.exp_avg_dtype` / `exp_avg_sq_dtype` = bfloat16 the run's Adam keeps bf16 moments through the save and
    the resume (models/lowp_adam.py)."""
    extra = ("algo.preset=stable_opd", "model.params_dtype=bfloat16", "teacher.params_dtype=bfloat16",
             f"optim.use_distributed_optimizer={str(distributed).lower()}", "train.collapse_action=warn",
             f"optim.exp_avg_dtype={moments}", f"optim.exp_avg_sq_dtype={moments}")
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    _run(_trainer(setup, ref, "warn", 3, *extra))
    _run(_trainer(setup, cut, "warn", 3, *extra), stop_after=2)
    assert (cut / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    resumed = _run(_trainer(setup, cut, "warn", 3, *extra))
    _assert_same_rows(read_metrics(ref), read_metrics(cut))
    inner = resumed.student.setup.optimizer.optimizer
    states = list(inner.state.values())
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == getattr(torch, moments) for s in states)
