"""The trainer's parts on their own (trainer/mixture.py, learner.py, guard.py, step_metrics.py, scoring.py,
rollouts.py), each against a case whose answer is known; the whole loop is tested in test_trainer_*.py."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
import torch

from _tiny import tiny_setup
from megatron_opd.config import ConfigError, load_config
from megatron_opd.metrics.health import rollout_health
from megatron_opd.teacher.fidelity import PairMismatchError
from megatron_opd.trainer.batch import SequenceItem, build_batch
from megatron_opd.trainer.guard import Guard
from megatron_opd.trainer.learner import Learner
from megatron_opd.trainer.mixture import balance_rows, golden_count, spread_rows
from megatron_opd.trainer.rollouts import check_engine_parity
from megatron_opd.trainer.scoring import preflight
from megatron_opd.trainer.step_metrics import _concat, _rows, batch_metrics


# -- mixture: golden rows in every part ----------------------------------------------------------------


def test_spread_rows_keeps_every_row_and_gives_each_part_its_share_of_golden_rows():
    rng = random.Random(0)
    for n in range(1, 25):
        for parts in range(1, 6):
            for n_gold in range(0, n + 1):
                golden = [True] * n_gold + [False] * (n - n_gold)
                rng.shuffle(golden)
                out = spread_rows(list(range(n)), golden, parts)
                assert sorted(r for part in out for r in part) == list(range(n))
                assert [len(p) for p in out] == [round((j + 1) * n / parts) - round(j * n / parts)
                                                 for j in range(parts)]
                per_part = [sum(golden[r] for r in part) for part in out]  # each part's share, within one row
                assert all(abs(g - len(p) * n_gold / n) < 1 for g, p in zip(per_part, out)), (n, parts, golden)
                assert all(part == sorted(part) for part in out)


def test_balance_rows_keeps_the_split_and_evens_out_tokens():
    """Dealt by tokens: every row once, the same group sizes and golden rows per group as `spread_rows`, and
    the heaviest group often lighter than spread_rows' and never heavier by more than one row."""
    rng = random.Random(1)
    lighter = 0
    for trial in range(300):
        n, parts = rng.randint(1, 24), rng.randint(1, 5)
        golden = [rng.random() < 0.25 for _ in range(n)]
        lengths = [rng.choice([40, 60, 80, 300]) for _ in range(n)]
        even, dealt = spread_rows(list(range(n)), golden, parts), balance_rows(list(range(n)), golden, lengths, parts)
        assert sorted(r for g in dealt for r in g) == list(range(n))
        assert [len(g) for g in dealt] == [len(g) for g in even]
        assert [sum(golden[r] for r in g) for g in dealt] == [sum(golden[r] for r in g) for g in even]
        assert all(g == sorted(g) for g in dealt)
        heavy = lambda groups: max(sum(lengths[r] for r in g) for g in groups)  # noqa: E731
        assert heavy(dealt) <= heavy(even) + 300  # within one longest row of the best, never far off
        lighter += heavy(dealt) < heavy(even)
    assert lighter > 50
    # the skew of an inflating step: the long rows first in prompt order -> all on rank 0 by count
    lengths = [300, 300, 300, 300, 40, 40, 40, 40]
    assert spread_rows(list(range(8)), [False] * 8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert balance_rows(list(range(8)), [False] * 8, lengths, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_minibatches_each_hold_their_share_of_golden_rows():
    """12 rows whose two golden rows sit side by side (rows 8 and 9, as after sorting by prompt): the old
    contiguous split put both in the second of 2 minibatches, leaving the first without golden rows."""
    golden = [False] * 8 + [True, True] + [False] * 2
    items = [SequenceItem([1], [2, 3], is_golden=g) for g in golden]
    batch = build_batch(items, 0)
    fake = SimpleNamespace(cfg=SimpleNamespace(algo=SimpleNamespace(num_minibatches=2)))
    mbs = Learner.minibatches(fake, batch)
    assert [sum(golden[r] for r in mb) for mb in mbs] == [1, 1]  # the contiguous split: [0, 2]
    assert sorted(r for mb in mbs for r in mb) == list(range(12)) and [len(mb) for mb in mbs] == [6, 6]
    fake.cfg.algo.num_minibatches = 1
    assert Learner.minibatches(fake, batch) == [list(range(12))]


def test_golden_count_gives_every_part_its_share():
    assert golden_count(16, 0.2, 4) == 4  # g / (g + 16) = 0.2
    assert golden_count(16, 0.2, 4, parts=4) == 4  # one per part of 4 rollouts
    assert golden_count(8, 0.1, 4, parts=4) == 4  # at least one per part (was 1 for the whole step)
    assert golden_count(16, 0.0, 4, parts=4) == 0 and golden_count(16, 1.0, 4, parts=4) == 4


# -- guard ---------------------------------------------------------------------------------------------


def _guard(*extra):
    cfg = load_config(None, ["train.collapse.length_key=x", "train.collapse.length_ratio=1.9",
                             "train.collapse.truncation_jump=null", "train.collapse.truncation_ratio=null",
                             "train.collapse.repetition_jump=null", "train.collapse.window=2",
                             "train.collapse.baseline_window=1", "train.collapse.min_steps=1",
                             "train.collapse.patience=1", *extra])
    return Guard(cfg, rank=0)


def _feed(guard, values):
    return [guard.judge({"x": v}, step) for step, v in enumerate(values, start=1)]


def test_rollback_target_is_one_step_earlier_under_overlap():
    """Verdict at step 4 (window 2: steps 3-4 average 2.0 > 1.9 x 1): the evidence's rollouts came from the
    weights after step 2 on-policy, after step 1 with overlap (one step stale)."""
    values = [1.0, 1.0, 2.0, 2.0]
    on, off = _guard(), _guard("rollout.overlap=true")
    assert _feed(on, values)[-1] == "warn" and _feed(off, values)[-1] == "warn"
    assert on.good_step == 4 - 2 - 1 + 1 == 2 and off.good_step == 1
    trainer = SimpleNamespace(step=4, ckpt=SimpleNamespace(steps=lambda: [1, 2, 3]))
    assert on.rollback_target(trainer) == 2 and off.rollback_target(trainer) == 1


def test_raise_beta_kl_does_not_blind_the_detector():
    """After a raise the detector keeps its history: a collapse that goes on is acted on again one window
    later (before: the detector was reset and needed baseline_window + window fresh steps)."""
    guard = _guard("train.collapse_action=raise_beta_kl")
    trainer = SimpleNamespace(step=0, beta_kl=0.0, set_beta_kl=lambda b: setattr(trainer, "beta_kl", b))
    acted = []
    for step, v in enumerate([1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0], start=1):
        trainer.step = step
        metrics = {"x": v}
        action = guard.judge(metrics, step)
        assert metrics["health/collapsed"] == float(step >= 4)  # the verdict is reported every step
        if action is not None:
            guard.apply(action, trainer)
            acted.append(step)
    assert acted == [4, 6, 8] and trainer.beta_kl == 0.04
    assert guard.collapse_events == 3


# -- step metrics over uneven data-parallel ranks ----------------------------------------------------


def _rank_batch(lengths, golden, seed):
    g = torch.Generator().manual_seed(seed)
    items = [SequenceItem([1, 2], torch.randint(3, 9, (n,), generator=g).tolist(), is_golden=gd,
                          truncated=n >= 6) for n, gd in zip(lengths, golden)]
    batch = build_batch(items, 0)
    B, T = batch.response_mask.shape
    batch.extras["old_logp"] = -torch.rand(B, T, generator=g)
    batch.extras["teacher_logp"] = -torch.rand(B, T, generator=g)
    batch.behaviour_logp = batch.extras["old_logp"] + 0.01 * torch.rand(B, T, generator=g)
    return batch, items


def test_health_metrics_of_uneven_ranks_equal_the_whole_batch_on_one_rank():
    """Rank 0 holds one long response, rank 1 three short ones: the step's metrics are the whole batch's,
    not the mean of the two ranks' means (which weighs rank 0's one response like rank 1's three)."""
    a, items_a = _rank_batch([7], [False], 0)
    b, items_b = _rank_batch([2, 3, 2], [False, False, True], 1)
    merged = batch_metrics(_concat([_rows(a, True), _rows(b, True)]), None)
    whole = build_batch(items_a + items_b, 0)
    T = whole.response_mask.shape[1]
    for k in ("old_logp", "teacher_logp"):
        whole.extras[k] = torch.cat([a.extras[k], torch.nn.functional.pad(b.extras[k], (0, T - b.extras[k].shape[1]))])
    adv = (whole.extras["teacher_logp"] - whole.extras["old_logp"]) * (~whole.is_golden[:, None])
    one = rollout_health(whole.response_mask, token_ids=whole.response_ids, truncated=whole.truncated,
                         advantages=adv, logp=whole.extras["old_logp"], teacher_logp=whole.extras["teacher_logp"],
                         is_golden=whole.is_golden)
    for k, v in one.items():
        assert merged[k] == pytest.approx(v, nan_ok=True), k
    assert merged["rollout/num_samples"] == 3 and merged["rollout/response_len_mean"] == pytest.approx(12 / 3)
    per_rank = [batch_metrics(_rows(x, True), None)["rollout/response_len_mean"] for x in (a, b)]
    assert sum(per_rank) / 2 != pytest.approx(merged["rollout/response_len_mean"])  # what the old merge logged


def test_engine_gap_is_not_logged_on_off_policy_steps():
    a, _ = _rank_batch([4, 5], [False, False], 0)
    assert 0 < batch_metrics(_rows(a, True), None)["rollout/engine_trainer_logp_absdiff"] < 0.011
    assert "rollout/engine_trainer_logp_absdiff" not in batch_metrics(_rows(a, False), None)


def test_engine_parity_check_levels(caplog):
    r = load_config(None, ["rollout.max_engine_logp_absdiff=0.1"]).rollout
    check_engine_parity(r, 1, {"rollout/engine_trainer_logp_absdiff": 0.05}, 0)
    check_engine_parity(r, 2, {"rollout/engine_trainer_logp_absdiff": 5.0}, 0)  # only step 1 is checked
    with pytest.raises(PairMismatchError, match="mean \\|diff\\| 0.5"):
        check_engine_parity(r, 1, {"rollout/engine_trainer_logp_absdiff": 0.5}, 0)


# -- preflight of a teacher given only by URL ---------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("parts"), n_train=4, n_eval=1)


def _url_teacher_cfg(student, *extra):
    return load_config(None, [f"model.hf_path={student}", "teacher.backend=sglang",
                              "teacher.server_url=http://127.0.0.1:9", *extra])  # nothing listens on port 9


def test_a_url_only_teacher_is_preflighted(pair, tmp_path, caplog):
    """Before: a teacher without teacher.hf_path skipped the preflight. Now it is checked against
    teacher.tokenizer_path, and with nothing to check against, preflight=error refuses to start."""
    import json
    import shutil

    _, student, teacher, _ = pair
    with pytest.raises(ConfigError, match="teacher.tokenizer_path"):
        preflight(_url_teacher_cfg(student), rank=0)
    with caplog.at_level(logging.WARNING, logger="megatron_opd.trainer"):
        preflight(_url_teacher_cfg(student, "teacher.preflight=warn"), rank=0)
    assert "nothing to check the teacher" in caplog.text
    preflight(_url_teacher_cfg(student, f"teacher.tokenizer_path={teacher}"), rank=0)  # a matching pair
    bad = shutil.copytree(teacher, tmp_path / "bad")
    for name in ("config.json", "generation_config.json"):
        data = json.loads((bad / name).read_text())
        data["eos_token_id"] = 0
        (bad / name).write_text(json.dumps(data))
    with pytest.raises(PairMismatchError, match="eos"):
        preflight(_url_teacher_cfg(student, f"teacher.tokenizer_path={bad}"), rank=0)
