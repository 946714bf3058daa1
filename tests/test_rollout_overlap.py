"""rollout.overlap (one-step off-policy): step t+1's rollouts are generated on a background thread with
step t's weights while step t trains. Tiny random models on CPU, local engine, real trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _tiny import tiny_setup
from megatron_opd.config import load_config
from megatron_opd.trainer.logger import read_metrics

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("overlap"))


def _cfg(setup, out: Path, steps: int, *extra: str):
    _root, student, teacher, data = setup
    return load_config(None, [
        "algo.preset=stable_opd", f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=megatron",
        f"data.train_path={data['train']}", f"train.steps={steps}", "train.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=12", "optim.lr=1e-3", "rollout.overlap=true",
        f"logging.out_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
        "checkpoint.save_every=1", "checkpoint.keep_last=3", *extra])


def _train(cfg, stop_after=None, spy=None):
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(cfg)
    if spy is not None:
        spy(trainer)
    try:
        trainer.train(stop_after=stop_after)
    finally:
        trainer.close()
    return trainer


def test_overlap_trains_on_rollouts_one_step_stale_with_behaviour_logp_as_pi_old(setup, tmp_path):
    generated: list[tuple[int, int, bool]] = []  # (step, engine weight version, on the main thread?)

    def spy(trainer):
        import threading

        real = trainer.engine.generate

        def generate(prompts, sp):
            generated.append((sp.seed - trainer.cfg.rollout.seed, trainer.engine.weight_version,
                              threading.current_thread() is threading.main_thread()))
            return real(prompts, sp)

        trainer.engine.generate = generate

    _train(_cfg(setup, tmp_path / "run", 3), spy=spy)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # step 1 is generated on-policy up front; steps 2 and 3 in the background, each with the previous weights
    assert generated == [(0, 0, True), (1, 0, False), (2, 1, False)]
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    # on-policy step: pi_old is the trainer's (the engine matches it to float error); stale steps: pi_old is
    # exactly the engine's behaviour log-probs, so there is no gap to measure and none is logged (was 0.0)
    assert 0 < rows[0]["rollout/engine_trainer_logp_absdiff"] < 1e-3
    for r in rows[1:]:
        assert "rollout/engine_trainer_logp_absdiff" not in r and "rollout/engine_trainer_logp_absdiff_max" not in r
        assert r["loss/update_skipped"] == 0.0 and r["loss/golden_loss"] > 0
        assert torch.isfinite(torch.tensor(r["loss/pg_loss"]))


def test_overlap_off_is_on_policy(setup, tmp_path):
    _train(_cfg(setup, tmp_path / "sync", 2, "rollout.overlap=false"))
    rows = read_metrics(tmp_path / "sync")
    assert [r["rollout/staleness"] for r in rows] == [0.0, 0.0]
    assert all(0 < r["rollout/engine_trainer_logp_absdiff"] < 1e-3 for r in rows)


def test_overlap_resume_is_exact(setup, tmp_path):
    """The next step's rollouts, generated before the kill, travel in the checkpoint."""
    full, part = tmp_path / "full", tmp_path / "part"
    _train(_cfg(setup, full, 3))
    _train(_cfg(setup, part, 3), stop_after=1)
    assert _train(_cfg(setup, part, 3)).step == 3
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ("rollout/response_len_mean", "rollout/staleness", "loss/pg_loss", "loss/kl", "loss/golden_loss",
                    "loss/grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)


def test_a_failed_background_rollout_raises_at_the_step_that_needed_it(setup, tmp_path):
    class EngineDown(RuntimeError):
        pass

    def spy(trainer):
        import threading

        real = trainer.engine.generate

        def generate(prompts, sp):
            if threading.current_thread() is not threading.main_thread():
                raise EngineDown("stand-in for a crashed rollout engine")
            return real(prompts, sp)

        trainer.engine.generate = generate

    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(_cfg(setup, tmp_path / "down", 3, "checkpoint.save_every=100"))
    spy(trainer)
    try:
        with pytest.raises(EngineDown):
            trainer.train()
        assert trainer.step == 1  # step 1 trained; step 2's rollouts failed while it ran and raise now
    finally:
        trainer.close()
