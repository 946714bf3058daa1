"""Several teachers end to end (issue 40, part 1): a YAML with a megatron teacher and an hf teacher, prompts
routed between them by a record field; tiny real-architecture models on CPU, local rollout engine."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from _tiny import tiny_setup, train as _train
from megatron_opd.config import load_config
from megatron_opd.teacher.hf import HFTeacher
from megatron_opd.trainer.logger import read_metrics

pytestmark = pytest.mark.megatron  # builds GPTModels (student, reference, megatron teacher)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root, student, teacher, data = tiny_setup(tmp_path_factory.mktemp("mt"))
    routed = root / "data" / "routed.jsonl"
    rows = [json.loads(line) for line in data["train"].read_text().splitlines()]
    # every other prompt to each teacher: "math" by its name, "word" through teacher_route.map
    routed.write_text("".join(json.dumps({**r, "teacher": ["math", "word"][i % 2]}) + "\n" for i, r in enumerate(rows)))
    return root, student, teacher, routed


def _cfg(setup, out, steps, tmp_path, *extra, teachers=None):
    root, student, teacher, routed = setup
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump({
        # the megatron teacher is the tiny teacher; the hf one the student's own checkpoint at T=0.7, so a row
        # scored by the wrong teacher shows
        "teachers": teachers or [{"name": "math", "backend": "megatron", "hf_path": str(teacher)},
                                 {"name": "easy", "backend": "hf", "hf_path": str(student), "temperature": 0.7}],
        "teacher_route": {"field": "teacher", "map": {"word": "easy"}},
        "model": {"hf_path": str(student)}, "data": {"train_path": str(routed)}}))
    return load_config(path, [
        "algo.preset=stable_opd", f"train.steps={steps}", "train.prompts_per_step=4",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=8", "optim.lr=1e-3", "data.shuffle=false",
        f"logging.out_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
        "checkpoint.save_every=1", "checkpoint.keep_last=2", *extra])


def test_each_row_is_scored_by_its_routed_teacher(setup, tmp_path):
    """One step of a mixed batch: every rollout row's teacher_logp is its routed teacher's own score (the
    megatron teacher in the student's layout, the hf one on the controller at its temperature), and the run logs
    each teacher's metrics beside the batch-wide ones."""
    from megatron_opd.trainer.loop import Trainer

    _root, student, teacher, _routed = setup
    trainer = Trainer(_cfg(setup, tmp_path / "one", 1, tmp_path))
    seen = {}
    real = trainer.scorer.score_batch

    def capture(batch, with_ref_logp):
        real(batch, with_ref_logp)
        seen["batch"] = batch

    trainer.scorer.score_batch = capture
    try:
        assert trainer.teacher_policy is not None and trainer.scorer.slots[1].external is not None
        trainer.train()
    finally:
        trainer.close()
    items, batch = trainer._last_payload["items"], seen["batch"]
    assert {it.teacher for it in items} == {"math", "easy"}
    assert batch.extras["teacher_id"].tolist() == [["math", "easy"].index(it.teacher) for it in items]
    refs = {"math": HFTeacher.from_pretrained(teacher), "easy": HFTeacher.from_pretrained(student, temperature=0.7)}
    for name, ref in refs.items():
        rows = [i for i, it in enumerate(items) if it.teacher == name and not it.is_golden]
        assert rows
        want = ref.score([items[i].prompt_ids for i in rows], [items[i].response_ids for i in rows])
        for i, w in zip(rows, want):
            torch.testing.assert_close(batch.extras["teacher_logp"][i, :len(w)], w.logprobs, rtol=1e-4, atol=1e-4)
        other = refs["easy" if name == "math" else "math"].score([items[rows[0]].prompt_ids],
                                                                  [items[rows[0]].response_ids])[0].logprobs
        assert not torch.allclose(batch.extras["teacher_logp"][rows[0], :len(other)], other, atol=1e-3)
    row = read_metrics(tmp_path / "one")[0]
    for key in ("adv/mean", "rollout/truncation_rate", "logp/teacher_mean", "rollout/response_len_mean"):
        assert key in row and f"{key}/math" in row and f"{key}/easy" in row, key
    assert row["logp/teacher_mean/math"] != row["logp/teacher_mean/easy"]


def test_resume_of_a_two_teacher_run_equals_the_uninterrupted_run(setup, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    _train(_cfg(setup, full, 3, tmp_path))
    _train(_cfg(setup, part, 3, tmp_path), stop_after=1)  # "killed" after step 1
    resumed = _train(_cfg(setup, part, 3, tmp_path))
    assert resumed.step == 3
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ("loss/pg_loss", "loss/golden_loss", "logp/teacher_mean", "adv/mean/math", "adv/mean/easy",
                    "logp/teacher_mean/math", "logp/teacher_mean/easy", "loss/grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)


def test_golden_topk_comes_from_the_prompts_teacher(setup, tmp_path):
    """algo.golden_loss=fkl_topk with two megatron teachers in the student's layout: each golden row's top-k
    target is its prompt's routed teacher's (each teacher scores the sub-batch of its rows)."""
    from megatron_opd.trainer.loop import Trainer

    _root, student, teacher, _routed = setup
    cfg = _cfg(setup, tmp_path / "gold", 1, tmp_path, "algo.golden_loss=fkl_topk", "algo.mixture_ratio=0.5",
               teachers=[{"name": "math", "hf_path": str(teacher), "top_k": 4},
                         {"name": "easy", "hf_path": str(student), "top_k": 4}])
    trainer = Trainer(cfg)
    seen = {}
    real = trainer.scorer.score_batch

    def capture(batch, with_ref_logp):
        real(batch, with_ref_logp)
        seen["batch"] = batch

    trainer.scorer.score_batch = capture
    try:
        assert all(s.policy is not None for s in trainer.scorer.slots)
        trainer.train()
    finally:
        trainer.close()
    items, batch = trainer._last_payload["items"], seen["batch"]
    refs = {"math": HFTeacher.from_pretrained(teacher), "easy": HFTeacher.from_pretrained(student)}
    gold = [i for i, it in enumerate(items) if it.is_golden]
    assert {items[i].teacher for i in gold} == {"math", "easy"}
    for i in gold:
        want = refs[items[i].teacher].score([items[i].prompt_ids], [items[i].response_ids], top_k=4)[0]
        n = len(items[i].response_ids)
        torch.testing.assert_close(batch.extras["teacher_topk_logp"][i, :n], want.topk_logprobs, rtol=1e-4, atol=1e-4)
    assert read_metrics(tmp_path / "gold")[0]["loss/golden_loss"] > 0


def test_preflight_checks_every_teacher(setup, tmp_path):
    """The student/teacher preflight runs for each teacher: a second teacher with other EOS ids stops the run
    naming it, before any model loads."""
    import shutil

    from megatron_opd.teacher.fidelity import PairMismatchError
    from megatron_opd.trainer.scoring import preflight

    _root, _student, teacher, _routed = setup
    bad = tmp_path / "bad"
    shutil.copytree(teacher, bad)
    for f in ("generation_config.json", "config.json"):
        data = json.loads((bad / f).read_text())
        data["eos_token_id"] = 0
        (bad / f).write_text(json.dumps(data))
    cfg = _cfg(setup, tmp_path / "pre", 1, tmp_path)
    preflight(cfg, 0)  # both good
    cfg.teachers[1].hf_path = str(bad)
    with pytest.raises(PairMismatchError, match=r"^teachers\[1\] \('easy'\): student/teacher pair: eos: EOS ids"):
        preflight(cfg, 0)
    cfg.teachers[1].preflight = "warn"
    preflight(cfg, 0)
