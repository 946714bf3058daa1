"""Preemption (trainer/preempt.py): a SIGUSR1 or the request file stops training at the end of the current
step with a checkpoint and the preempted.json marker; the resumed run ends as the uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _proc import explain
from _tiny import tiny_setup
from megatron_opd.config import load_config
from megatron_opd.trainer.logger import read_metrics
from megatron_opd.trainer.preempt import MARKER_FILE, PREEMPTED_EXIT, REQUEST_FILE, Preempted, PreemptionWatch

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it

KEYS = ("rollout/response_len_mean", "loss/pg_loss", "loss/kl", "loss/golden_loss", "logp/student_mean",
        "logp/teacher_mean", "loss/grad_norm")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("preempt"))


def _overrides(setup, out: Path, steps: int) -> list[str]:
    _root, student, teacher, data = setup
    return [f"model.hf_path={student}", f"teacher.hf_path={teacher}", f"data.train_path={data['train']}",
            f"train.steps={steps}", "train.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=12", "optim.lr=1e-3", f"logging.out_dir={out}", "logging.progress_bar=false",
            "logging.tensorboard=false", "checkpoint.save_every=10", "checkpoint.keep_last=2",
            "teacher.backend=megatron"]


def test_watch_signal_and_file(tmp_path):
    (tmp_path / MARKER_FILE).write_text("{}")
    watch = PreemptionWatch(tmp_path, rank=0)
    try:
        assert not (tmp_path / MARKER_FILE).exists(), "the marker of the run this one resumes is removed"
        assert watch.requested() == ""
        # a request written while the trainer was still loading (the job script's USR1) is kept and honoured
        (tmp_path / REQUEST_FILE).write_text("")
        assert watch.requested() == str(tmp_path / REQUEST_FILE)
        (tmp_path / REQUEST_FILE).unlink()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watch.requested() == "SIGUSR1"
        (tmp_path / REQUEST_FILE).write_text("")
        watch.mark(7, "SIGUSR1")
        assert json.loads((tmp_path / MARKER_FILE).read_text()) == {"step": 7, "reason": "SIGUSR1"}
        assert not (tmp_path / REQUEST_FILE).exists(), "a request is consumed by the stop it caused"
    finally:
        watch.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_other_ranks_do_not_read_the_file(tmp_path):
    watch = PreemptionWatch(tmp_path, rank=1)
    try:
        (tmp_path / REQUEST_FILE).write_text("")
        assert watch.reason() == ""  # rank 0 reads it and the all-reduce tells the others
    finally:
        watch.close()


def test_request_stops_after_the_step_and_resume_matches(setup, tmp_path, monkeypatch):
    from megatron_opd.trainer.loop import Trainer

    full, part = tmp_path / "full", tmp_path / "part"
    t = Trainer(load_config(None, _overrides(setup, full, 3)))
    try:
        t.train()
    finally:
        t.close()

    t = Trainer(load_config(None, _overrides(setup, part, 3)))
    step = t.train_step

    def step_then_request():  # the request arrives while step 1 runs
        metrics = step()
        (part / REQUEST_FILE).write_text("")
        return metrics

    monkeypatch.setattr(t, "train_step", step_then_request)
    try:
        with pytest.raises(Preempted, match="checkpointed at step 1"):
            t.train()
    finally:
        t.close()
    assert json.loads((part / MARKER_FILE).read_text())["step"] == 1
    assert (part / "checkpoints" / "step_00000001").is_dir(), "save_every=10, so only the preemption saved it"
    assert not (part / "hf").exists(), "a preempted run is not finished: no export"
    monkeypatch.undo()

    t = Trainer(load_config(None, _overrides(setup, part, 3)))
    try:
        assert t.step == 1 and not (part / MARKER_FILE).exists() and not (part / REQUEST_FILE).exists()
        t.train()
    finally:
        t.close()
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in KEYS:
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    assert (part / "hf" / "config.json").is_file()


def test_cli_exit_code_on_sigusr1(setup, tmp_path):
    """`megatron-opd train` as a process: SIGUSR1 mid-run -> exit 75 (PREEMPTED_EXIT), one line on stderr."""
    out = tmp_path / "cli"
    code = ("import os, signal, sys\n"
            "from megatron_opd.trainer import loop\n"
            "step = loop.Trainer.train_step\n"
            "def hooked(self):\n"
            "    m = step(self)\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "    return m\n"
            "loop.Trainer.train_step = hooked\n"
            "from megatron_opd.cli import main\n"
            "sys.exit(main(['train'] + sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items()  # an in-process trainer of this session set its own rendezvous
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    res = subprocess.run([sys.executable, "-c", code, *_overrides(setup, out, 3)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == PREEMPTED_EXIT, explain(res)
    assert "preempted (SIGUSR1): checkpointed at step 1" in res.stderr, explain(res)
    assert [r["step"] for r in read_metrics(out)] == [1]
