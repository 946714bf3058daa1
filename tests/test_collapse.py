"""Collapse detector on synthetic histories: a jump is flagged at/after onset and never before; noise is not
flagged; slow drift is caught by the initial baseline only; state survives a JSON round trip."""

import json
import math
import random

import pytest

from megatron_opd.metrics.collapse import CollapseConfig, CollapseDetector

TR, LEN, REP = "rollout/truncation_rate", "rollout/response_len_mean", "rollout/repetition_rate"


def binom_rate(rng: random.Random, n: int, p: float) -> float:
    return sum(rng.random() < p for _ in range(n)) / n


def jump_history(k: int, steps: int, seed: int = 0) -> list[dict]:
    """Healthy until step k, then length inflation: truncation 5% -> 60%, length x2.5, repetition 2% -> 40%."""
    rng = random.Random(seed)
    hist = []
    for s in range(steps):
        bad = s >= k
        hist.append({
            "step": s,
            TR: binom_rate(rng, 64, 0.6 if bad else 0.05),
            LEN: rng.gauss(2500 if bad else 1000, 60),
            REP: binom_rate(rng, 64, 0.4 if bad else 0.02),
        })
    return hist


def run(det: CollapseDetector, hist: list[dict]) -> list:
    return [det.update(m) for m in hist]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_jump_flagged_at_or_after_onset_not_before(seed):
    k = 60
    cfg = CollapseConfig()
    verdicts = run(CollapseDetector(cfg), jump_history(k, 120, seed))
    flagged = [v.step for v in verdicts if v.collapsed]
    assert flagged, "the jump was not detected"
    first = flagged[0]
    assert k <= first <= k + cfg.window
    assert all(v.onset_step is None for v in verdicts if v.step < first)
    assert all(v.onset_step == first for v in verdicts if v.step >= first)
    reasons = " ".join(verdicts[first].reasons)
    assert "truncation_jump" in reasons and "repetition_jump" in reasons
    # the window means reported are the ones the rule used
    st = verdicts[-1].stats
    assert st[f"{TR}/current"] == pytest.approx(sum(m[TR] for m in jump_history(k, 120, seed)[-10:]) / 10)
    assert st[f"{TR}/baseline"] == pytest.approx(sum(m[TR] for m in jump_history(k, 120, seed)[:10]) / 10)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("baseline", ["initial", "trailing"])
def test_noisy_flat_history_not_flagged(seed, baseline):
    rng = random.Random(100 + seed)
    det = CollapseDetector(CollapseConfig(baseline=baseline))
    for s in range(400):
        v = det.update({TR: binom_rate(rng, 64, 0.05), LEN: rng.gauss(1000, 150), REP: binom_rate(rng, 64, 0.02)},
                       step=s)
        assert not v.collapsed, (s, v.reasons)


def test_min_steps_holds_back_early_verdicts():
    hist = jump_history(25, 80, seed=3)
    first = next(v.step for v in run(CollapseDetector(CollapseConfig(min_steps=50)), hist) if v.collapsed)
    assert first == 49  # the 50th update: the condition already holds, min_steps alone held it back
    first_default = next(v.step for v in run(CollapseDetector(CollapseConfig()), hist) if v.collapsed)
    assert 25 <= first_default < 49


def test_no_verdict_without_full_disjoint_windows():
    # a jump inside the first windows cannot be judged: the initial baseline would contain it
    det = CollapseDetector(CollapseConfig(window=5, baseline_window=5, min_steps=0, patience=1))
    for s in range(9):
        v = det.update({TR: 0.0 if s < 3 else 1.0}, step=s)
        assert not v.collapsed and v.stats == {}
    assert det.update({TR: 1.0}, step=9).stats[f"{TR}/baseline"] == pytest.approx(2 / 5)


def test_slow_drift_caught_by_initial_baseline_only():
    hist = [{LEN: 1000 * 1.005**s} for s in range(200)]  # 2.7x over 200 steps, 0.5% per step
    initial = run(CollapseDetector(CollapseConfig(baseline="initial")), hist)
    trailing = run(CollapseDetector(CollapseConfig(baseline="trailing")), hist)
    assert not any(v.collapsed for v in trailing)
    first = next(v.step for v in initial if v.collapsed)
    # closed form: window means of a geometric series; first step whose ratio > 1.5, plus patience 2
    mean = lambda a, b: sum(1000 * 1.005**i for i in range(a, b)) / (b - a)  # noqa: E731
    base = mean(0, 10)
    expected = next(s for s in range(19, 200) if mean(s - 9, s + 1) > 1.5 * base) + 1
    assert first == expected
    assert "length_ratio" in initial[first].reasons[0]


def test_patience_ignores_short_spikes():
    cfg = CollapseConfig(window=1, baseline_window=5, min_steps=0, patience=3, length_ratio=None,
                         repetition_jump=None)
    det = CollapseDetector(cfg)
    seq = [0.0] * 10 + [0.9, 0.9] + [0.0] * 5 + [0.9, 0.9, 0.9]
    flags = [det.update({TR: x}, step=s).collapsed for s, x in enumerate(seq)]
    assert flags.index(True) == 19 and sum(flags) == 1


def test_truncation_ratio_uses_floor():
    cfg = CollapseConfig(window=2, baseline_window=2, min_steps=0, patience=1, truncation_jump=None,
                         truncation_ratio=2.0, rate_floor=0.02, length_ratio=None, repetition_jump=None)
    det = CollapseDetector(cfg)
    for s, x in enumerate([0.0, 0.0, 0.01, 0.03]):  # current mean 0.02 = 2 x floor, not more
        assert not det.update({TR: x}, step=s).collapsed
    assert det.update({TR: 0.07}, step=4).collapsed  # current (0.03+0.07)/2 = 0.05 > 0.04


def test_missing_and_nan_values_are_skipped():
    det = CollapseDetector(CollapseConfig(window=2, baseline_window=2, min_steps=0, patience=1))
    for s in range(10):
        det.update({TR: float("nan"), "step": s})
        det.update({LEN: 100.0}, step=s)
    sd = det.state_dict()
    assert TR not in sd["series"] and sd["series"][LEN]["count"] == 10
    with pytest.raises(ValueError, match=r"metrics\['rollout/truncation_rate'\]"):
        det.update({TR: "high"})


def test_step_defaults():
    det = CollapseDetector()
    assert det.update({}).step == 0 and det.update({}).step == 1 and det.update({"step": 17}).step == 17


def test_state_round_trip_resumes_identically():
    hist = jump_history(40, 90, seed=5)
    for cut in (30, 55):  # before and after the onset
        a = CollapseDetector()
        run(a, hist[:cut])
        b = CollapseDetector()
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        assert b.state_dict() == a.state_dict()
        va, vb = run(a, hist[cut:]), run(b, hist[cut:])
        assert [v.to_dict() for v in va] == [v.to_dict() for v in vb]
        assert any(v.collapsed for v in va)


def test_load_state_dict_rejects_mismatch():
    a = CollapseDetector(CollapseConfig(window=10))
    state = a.state_dict()
    with pytest.raises(ValueError, match="config.window"):
        CollapseDetector(CollapseConfig(window=5)).load_state_dict(state)
    del state["series"]
    with pytest.raises(ValueError, match="missing key 'series'"):
        CollapseDetector().load_state_dict(state)


def test_reset_forgets_history_and_onset():
    det = CollapseDetector()
    vs = run(det, jump_history(30, 60))
    assert vs[-1].onset_step is not None
    det.reset()
    v = det.update({TR: 0.5}, step=61)
    assert not v.collapsed and v.onset_step is None


@pytest.mark.parametrize("kw,name", [({"window": 0}, "window"), ({"patience": 0}, "patience"),
                                     ({"length_ratio": 0.9}, "length_ratio"),
                                     ({"truncation_jump": math.nan}, "truncation_jump"),
                                     ({"baseline": "median"}, "baseline"), ({"min_steps": -1}, "min_steps"),
                                     ({"accuracy_drop": 0.0}, "accuracy_drop"), ({"accuracy_drop": 1.5}, "accuracy_drop"),
                                     ({"accuracy_drop": 1.0}, "accuracy_drop"),
                                     ({"accuracy_floor": -0.1}, "accuracy_floor")])
def test_config_validation(kw, name):
    with pytest.raises(ValueError, match=f"CollapseConfig.{name}"):
        CollapseConfig(**kw)


def test_thresholds_come_from_the_config_and_errors_name_the_key(tmp_path):
    """`train.collapse.*` is the detector's CollapseConfig: loaded, validated with the dotted key, round-tripped."""
    from megatron_opd.config import ConfigError, dump_config, load_config

    cfg = load_config(None, ["train.collapse.window=3", "train.collapse.baseline=trailing",
                             "train.collapse.length_ratio=2", "train.collapse.repetition_jump=null"])
    c = cfg.train.collapse
    assert isinstance(c, CollapseConfig) and c.window == 3 and c.baseline == "trailing"
    assert c.length_ratio == 2.0 and c.repetition_jump is None and c.patience == CollapseConfig().patience
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").train.collapse == c
    for override, key in (("train.collapse.window=0", "train.collapse.window"),
                          ("train.collapse.length_ratio=1", "train.collapse.length_ratio"),
                          ("train.collapse.truncation_jump=-0.1", "train.collapse.truncation_jump"),
                          ("train.collapse.baseline=median", "train.collapse.baseline"),
                          ("train.collapse.thresh=1", "train.collapse.thresh")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert str(e.value).split(":", 1)[0] == key, str(e.value)


ACC = "eval/accuracy"


def test_accuracy_drop_flags_the_evaluation_that_lost_half_of_the_best():
    """Answers that degrade without growing trip no rollout rule; the accuracy rule compares each held-out
    evaluation with the best earlier one (the initial student's included) and needs no windows."""
    det = CollapseDetector(CollapseConfig(min_steps=0))
    det.observe_eval({ACC: 0.25}, step=0)
    verdicts = [det.update({TR: 0.0, LEN: 30.0, **({ACC: a} if a is not None else {})}, step=s)
                for s, a in ((1, None), (10, 0.42), (11, None), (20, 0.29), (30, 0.0))]
    assert [v.collapsed for v in verdicts] == [False, False, False, False, True]
    assert verdicts[-1].onset_step == 30 and "0.420 at step 10" in verdicts[-1].reasons[0]
    flat = CollapseDetector(CollapseConfig(min_steps=0))
    flat.observe_eval({ACC: 0.25}, step=0)
    assert not any(flat.update({ACC: a}, step=s).collapsed for s, a in ((10, 0.44), (20, 0.42), (30, 0.54)))


def test_accuracy_rule_waits_for_min_steps_like_every_rule():
    """An early dip (the student taking up the teacher's format, demo seed 42 at step 4) is not a verdict."""
    det = CollapseDetector(CollapseConfig(min_steps=5))
    det.observe_eval({ACC: 0.125})
    assert not det.update({ACC: 0.02}, step=1).collapsed  # update 1 of the 5 min_steps
    for s in (2, 3, 4):
        det.update({}, step=s)
    assert not det.update({ACC: 0.3}, step=5).collapsed and det.update({ACC: 0.1}, step=6).collapsed


def test_accuracy_rule_respects_floor_threshold_and_off_switch():
    low = CollapseDetector(CollapseConfig(min_steps=0))
    low.observe_eval({ACC: 0.04})
    assert not low.update({ACC: 0.0}, step=1).collapsed  # best below accuracy_floor: noise, not a collapse
    loose = CollapseDetector(CollapseConfig(accuracy_drop=0.9, min_steps=0))
    loose.observe_eval({ACC: 0.5})
    assert not loose.update({ACC: 0.1}, step=1).collapsed and loose.update({ACC: 0.04}, step=2).collapsed
    off = CollapseDetector(CollapseConfig(accuracy_drop=None, min_steps=0))
    off.observe_eval({ACC: 0.5})
    assert not off.update({ACC: 0.0}, step=1).collapsed


def test_verdicts_name_the_newest_step_their_evidence_spares():
    """good_step is where a rollback should return: before the windows of a rollout rule, at the best
    evaluation for the accuracy rule (an evaluation 50 steps apart covers more than any window)."""
    acc = CollapseDetector(CollapseConfig(min_steps=0))
    acc.observe_eval({ACC: 0.1}, step=0)
    assert acc.update({ACC: 0.4}, step=50).good_step is None
    v = acc.update({ACC: 0.1}, step=100)
    assert v.collapsed and v.good_step == 50
    win = CollapseDetector(CollapseConfig(window=2, baseline_window=2, patience=2, min_steps=0,
                                          truncation_jump=0.3, truncation_ratio=None, length_ratio=None,
                                          repetition_jump=None))
    verdicts = [win.update({TR: t}, step=s) for s, t in enumerate([0.0, 0.0, 0.9, 0.9, 0.9], start=1)]
    assert [v.collapsed for v in verdicts] == [False, False, False, False, True]
    assert verdicts[4].good_step == 5 - 2 - 2 + 1  # the windows of steps 4 and 5 reach back to step 3


def test_reset_after_an_action_can_keep_the_best_accuracy():
    """After raise_beta_kl or a rollback the trainer keeps the best accuracy: judged against a fresh baseline,
    a run that went on degrading (0.5 -> 0.2 -> 0.04 -> 0.0) would never be flagged again (its first
    evaluation after the action, below accuracy_floor, would become the reference)."""
    for keep, flagged in ((True, [True, True]), (False, [False, False])):
        det = CollapseDetector(CollapseConfig(min_steps=0))
        det.observe_eval({ACC: 0.5}, step=0)
        assert det.update({ACC: 0.2}, step=10).collapsed
        det.reset(keep_best_accuracy=keep)
        assert [det.update({ACC: a}, step=s).collapsed for s, a in ((20, 0.04), (30, 0.0))] == flagged


def test_accuracy_best_survives_state_round_trip_and_old_states_load():
    det = CollapseDetector(CollapseConfig(min_steps=0))
    det.observe_eval({ACC: 0.6}, step=0)
    state = json.loads(json.dumps(det.state_dict()))
    resumed = CollapseDetector(CollapseConfig(min_steps=0))
    resumed.load_state_dict(state)
    assert resumed.update({ACC: 0.2}, step=5).collapsed
    del state["best_accuracy"]  # a checkpoint from before the accuracy rule
    old = CollapseDetector(CollapseConfig(min_steps=0))
    old.load_state_dict(state)
    assert not old.update({ACC: 0.2}, step=5).collapsed
