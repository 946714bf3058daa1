"""Issue 8 section 5: objective and batching bugs.

- golden_loss=fkl_topk with the in-process megatron teacher (top-k from the megatron teacher),
- rollout temperature applied to the trainer's log-probs; truncated sampling rejected unless opted in,
- adv_normalize whitens with whole-minibatch statistics (micro-batch / DP independent),
- non-finite logits on one rank skip the update on every rank,
- golden samples: spread over the step's prompts, end with the rollout's stop id, truncated when cut.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _dist import run_distributed
from _tiny import tiny_setup, train_to_end
from megatron_opd.algo.objective import stable_opd_loss, term_masks
from megatron_opd.algo.ref_kl import full_kl, full_kl_reference
from megatron_opd.config import AlgoConfig, ConfigError, load_config
from megatron_opd.trainer.logger import read_metrics
from megatron_opd.trainer.policy import MegatronPolicy, _mean_stats

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("objective"))


def _overrides(setup, out: Path, preset: str, steps: int, *extra: str) -> list[str]:
    _root, student, teacher, data = setup
    return [f"algo.preset={preset}", f"model.hf_path={student}", f"teacher.hf_path={teacher}",
            f"data.train_path={data['train']}", f"train.steps={steps}", "train.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=12", "optim.lr=1e-3",
            f"logging.out_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
            "checkpoint.save_every=100", *extra]


def _train(overrides: list[str]):
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


# -- 1. fkl_topk with the megatron teacher ----------------------------------------------------------


def test_fkl_topk_golden_loss_with_megatron_teacher_matches_hf_teacher(setup, tmp_path):
    """teacher.backend=megatron now produces the teacher's top-k for golden rows; the golden loss is
    finite, positive and equals the HF-teacher run on the same models (rel 1e-4: both teachers are fp32
    on CPU, they differ only in summation order)."""
    rows = {}
    for backend in ("megatron", "hf"):
        out = tmp_path / backend
        _train(_overrides(setup, out, "stable_opd", 2, f"teacher.backend={backend}", "algo.golden_loss=fkl_topk",
                          "teacher.top_k=5"))
        rows[backend] = read_metrics(out)
    for rm, rh in zip(rows["megatron"], rows["hf"]):
        assert rm["rollout/num_golden"] >= 1
        assert torch.isfinite(torch.tensor(rm["loss/golden_loss"])) and rm["loss/golden_loss"] > 0
        assert rm["loss/update_skipped"] == 0.0
        for key in ("loss/golden_loss", "loss/pg_loss", "loss/total_loss", "loss/grad_norm"):
            assert rm[key] == pytest.approx(rh[key], rel=1e-4, abs=1e-6), (rm["step"], key)


def test_megatron_teacher_topk_matches_full_softmax_and_skips_non_golden_rows(setup):
    """MegatronPolicy.score_topk against a plain log_softmax/topk of the same model's logits."""
    from megatron_opd.trainer.batch import SequenceItem, build_batch
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(load_config(None, _overrides(setup, setup[0] / "topk_unit", "stable_opd", 1,
                                                   "teacher.backend=megatron")))
    try:
        batch = build_batch([SequenceItem([5, 6, 7], [8, 9, 2]), SequenceItem([5, 6], [7, 2], is_golden=True)],
                            trainer.pad_id)
        ids, lps = trainer.teacher_policy.score_topk(batch, 4, batch.is_golden, micro_batch_size=1)
        assert ids.shape == (2, 3, 4) and lps.shape == (2, 3, 4)
        assert (ids[0] == 0).all() and (lps[0] == 0).all()  # not a golden row
        logp, _ = trainer.teacher_policy.score(batch)
        # the teacher's log-prob of the golden token is consistent with its top-k log-probs
        assert int(ids.max()) < trainer.teacher_policy.vocab_size
        assert (lps[1, :2, 0] >= logp[1, :2] - 1e-5).all()
        assert (lps[1, :2, :-1] >= lps[1, :2, 1:]).all()  # sorted
    finally:
        trainer.close()


def test_vocab_parallel_topk_never_returns_padding_ids():
    from megatron_opd.teacher.megatron import vocab_parallel_topk

    logits = torch.randn(5, 12)
    logits[:, 10:] = 1e4  # megatron's vocab padding columns, with (garbage) huge values
    ids, lps = vocab_parallel_topk(logits, 10, 10, None)
    assert int(ids.max()) < 10 and torch.isfinite(lps).all()
    torch.testing.assert_close(lps, torch.log_softmax(logits[:, :10], -1).topk(10, -1).values)
    with pytest.raises(ValueError, match="top_k"):
        vocab_parallel_topk(logits, 11, 10, None)


# -- 2. rollout temperature, truncated sampling ---------------------------------------------------


def test_rollout_temperature_applies_to_pi_old(setup, tmp_path):
    """With rollout.temperature=0.7 the trainer's pi_old on the rollout tokens equals the engine's
    behaviour log-probs (after temperature); the KL to the reference is 0 at step 1 (both at T)."""
    out = tmp_path / "t07"
    _train(_overrides(setup, out, "opd_kl", 1, "teacher.backend=hf", "rollout.temperature=0.7"))
    row = read_metrics(out)[0]
    assert row["rollout/engine_trainer_logp_absdiff"] < 1e-3
    assert row["loss/kl"] == pytest.approx(0.0, abs=1e-5)


def test_policy_log_probs_use_the_rollout_temperature_teacher_stays_at_one(setup, tmp_path):
    from megatron_opd.trainer.batch import SequenceItem, build_batch
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(load_config(None, _overrides(setup, tmp_path / "tunit", "opd_kl", 1, "teacher.backend=megatron",
                                                   "rollout.temperature=0.5")))
    try:
        assert trainer.student.temperature == 0.5 and trainer.ref.temperature == 0.5
        assert trainer.teacher_policy.temperature == 1.0
        batch = build_batch([SequenceItem([5, 6, 7], [8, 9, 2])], trainer.pad_id)
        hot, _ = trainer.student.score(batch)
        trainer.student.temperature = 1.0
        cold, _ = trainer.student.score(batch)
        assert (hot - cold).abs().max() > 1e-3
    finally:
        trainer.close()


def test_tempered_bf16_logits_for_the_full_kl_are_divided_in_fp32():
    """bf16 response logits at rollout.temperature=0.7: the full KL from `response_logits` is the fp32 one
    of the same logits, not that of a bf16 quotient (rounded by up to 2^-9 of each logit)."""
    g = torch.Generator().manual_seed(4)
    z, w = (torch.randn(16, 512, generator=g).mul(6).bfloat16() for _ in range(2))
    stub = SimpleNamespace(temperature=0.7, vocab_size=512, tp_group=None, _rows=lambda logits, _batch: logits)
    zt, wt = (MegatronPolicy.response_logits(stub, x, None) for x in (z, w))
    exact = full_kl_reference(z.double() / 0.7, w.double() / 0.7)
    torch.testing.assert_close(full_kl(zt, wt).double(), exact, rtol=1e-5, atol=1e-6)
    bf16_quotient = full_kl(z / 0.7, w / 0.7).double()  # the old path
    assert (bf16_quotient - exact).abs().max() > 1e-4


@pytest.mark.parametrize("override,key", [("rollout.top_p=0.9", "rollout.top_p"), ("rollout.top_k=20", "rollout.top_k")])
def test_truncated_sampling_is_rejected_unless_allowed(override, key, caplog):
    with pytest.raises(ConfigError, match=f"^{key}: .*allow_truncated_sampling"):
        load_config(None, [override])
    with caplog.at_level(logging.WARNING, logger="megatron_opd.config"):
        cfg = load_config(None, [override, "rollout.allow_truncated_sampling=true"])
    assert cfg.rollout.allow_truncated_sampling
    assert any(key in r.getMessage() for r in caplog.records)
    load_config(None, ["rollout.temperature=0.6"])  # temperature alone is reproduced exactly


# -- 3. adv_normalize over the whole minibatch ----------------------------------------------------


def test_whitening_with_global_stats_equals_whitening_the_union():
    from megatron_opd.algo.advantages import compute_advantages, whitening_stats

    g = torch.Generator().manual_seed(0)
    tl, ol = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    gold = torch.tensor([False, False, True, False, False, False])
    trunc = torch.zeros(6, dtype=torch.bool)
    whole, m = compute_advantages(tl, ol, mask, gold, trunc, normalize=True)
    raw, _ = compute_advantages(tl, ol, mask, gold, trunc)
    stats = tuple(float(v) for v in whitening_stats(raw, m))
    parts = [compute_advantages(tl[s], ol[s], mask[s], gold[s], trunc[s], normalize=True, norm_stats=stats)[0]
             for s in (slice(0, 2), slice(2, 3), slice(3, 6))]
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-6, rtol=0)
    local = compute_advantages(tl[:2], ol[:2], mask[:2], gold[:2], trunc[:2], normalize=True)[0]
    assert (local - whole[:2]).abs().max() > 1e-3  # per-part whitening (the old behaviour) differs


def test_stats_of_uneven_parts_merge_to_the_whole_minibatch():
    """Micro-batches / data-parallel ranks with different token counts (one with no policy token at all):
    the merged stats equal the whole minibatch's, means and rates weighted by each part's tokens."""
    g = torch.Generator().manual_seed(3)
    B, T = 7, 6
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    gold = torch.tensor([True, False, False, False, True, False, False])
    trunc = torch.tensor([False, False, True, False, False, False, False])
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old - torch.rand(B, T, generator=g, dtype=torch.float64) * 0.6  # every ratio < 1: ratio_max < 1
    inputs = dict(logp=logp, old_logp=old, teacher_logp=-torch.rand(B, T, generator=g, dtype=torch.float64) * 3,
                  ref_logp=-torch.rand(B, T, generator=g, dtype=torch.float64) * 3, response_mask=mask,
                  is_golden=gold, truncated=trunc)
    cfg = AlgoConfig(beta_kl=0.1, kl_estimator="k3", lambda_gold=0.5, mask_truncated=True, clip_eps_low=0.1,
                     clip_eps_high=0.1)
    _, whole = stable_opd_loss(cfg, **inputs)
    counts = {k: (float(m.sum()), float((m.sum(-1) > 0).sum())) for k, m in term_masks(cfg, mask, gold, trunc).items()}
    parts = [slice(0, 1), slice(1, 5), slice(5, 7)]  # the first: one golden row, no policy token
    rows = []
    for s in parts:  # each part's unscaled shares, as Learner.loss_fn logs them
        rows.append(stable_opd_loss(cfg, **{k: v[s] for k, v in inputs.items()}, global_counts=counts)[1])
    assert rows[0]["n_pg_tokens"] == 0 and whole["ratio_max"] < 1 and whole["clipfrac"] > 0
    merged = _mean_stats(rows)
    assert merged.keys() == whole.keys()
    for k, v in whole.items():
        assert merged[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


@pytest.mark.dist
def test_adv_normalize_dp2_matches_single_process(setup, tmp_path):
    _root, student, teacher, data = setup
    base = [f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=megatron",
            f"data.train_path={data['train']}", "train.steps=1", "train.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=10", "optim.lr=1e-3",
            "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.save_every=5",
            "algo.mixture_ratio=0.34", "algo.adv_normalize=true"]
    single, multi = tmp_path / "single", tmp_path / "multi"
    assert run_distributed(train_to_end, 1, base + [f"logging.out_dir={single}"]) == [1]
    assert run_distributed(train_to_end, 2, base + [f"logging.out_dir={multi}"]) == [1, 1]
    a, b = read_metrics(single)[0], read_metrics(multi)[0]
    for key in ("loss/pg_loss", "loss/total_loss", "loss/grad_norm", "loss/golden_loss"):
        assert b[key] == pytest.approx(a[key], rel=2e-4, abs=1e-6), key


def _uneven_rank_stats(rank, world_size, overrides):
    """DP=2, rank 0 with 4 response tokens and rank 1 with 1: train_minibatch's stats of one minibatch."""
    from megatron_opd.trainer.batch import SequenceItem, build_batch
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        items = [SequenceItem([5, 6, 7], [8, 9, 10, 2])] if rank == 0 else [SequenceItem([5, 7], [2])]
        batch = build_batch(items, trainer.pad_id)
        seen = []

        def loss_fn(logp, _logits, b, _full):
            lp = logp[b.response_mask]
            seen.append((float(lp.sum()), lp.numel()))
            return -lp.sum() / 5.0, {"adv_raw_mean": float(lp.mean()), "n_pg_tokens": float(lp.numel())}

        return {"stats": trainer.student.train_minibatch([batch], loss_fn, False), "seen": seen}
    finally:
        trainer.close()


@pytest.mark.dist
def test_train_stats_are_over_the_tokens_of_every_rank(setup, tmp_path):
    _root, student, teacher, data = setup
    overrides = [f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=hf",
                 f"data.train_path={data['train']}", "algo.preset=opd", "train.steps=1",
                 "rollout.max_new_tokens=8", f"logging.out_dir={tmp_path / 'out'}", "logging.progress_bar=false",
                 "logging.tensorboard=false"]
    res = run_distributed(_uneven_rank_stats, 2, overrides, timeout=300)
    (s0, n0), (s1, n1) = res[0]["seen"][0], res[1]["seen"][0]
    assert (n0, n1) == (4, 1)
    for r in res:  # every rank: the token mean over both ranks, not the mean of the two ranks' means
        assert r["stats"]["adv_raw_mean"] == pytest.approx((s0 + s1) / 5, rel=1e-6)
        assert r["stats"]["n_pg_tokens"] == 5.0


def _uneven_micro_batch_stats(rank, world_size, overrides):
    """DP=2, rank 0's rows (20 and 8 tokens) as 2 micro-batches and rank 1's (6 and 6) as 1, under a
    budget of 20 tokens with dynamic batching and with packing: `Learner.update`'s logged stats of the
    minibatch, and the per-token inputs of the loss (pi_theta = pi_old + noise; lr 0 keeps the weights)."""
    from dataclasses import replace

    from megatron_opd.trainer.batch import SequenceItem, build_batch
    from megatron_opd.trainer.loop import Trainer

    cfg = load_config(None, overrides)
    trainer = Trainer(cfg)
    try:
        if rank == 0:
            items = [SequenceItem([5, 6, 7, 8], [9 + i % 7 for i in range(16)], truncated=True),
                     SequenceItem([5, 6], [7, 8, 9, 10, 11, 2], is_golden=True)]
        else:
            items = [SequenceItem([5, 7], [8, 9, 10, 2]), SequenceItem([5, 6, 7], [12, 13, 2])]
        batch = build_batch(items, trainer.pad_id)
        g = torch.Generator().manual_seed(7 + rank)
        logp = trainer.student.score(batch)[0]
        noise = lambda: torch.rand(logp.shape, generator=g)  # noqa: E731
        batch.extras.update(old_logp=logp + noise() - 0.5, teacher_logp=logp - noise(),
                            ref_logp=logp - 0.5 * noise())
        counts, stats = {}, {}
        for name, pack in (("dynamic", False), ("packed", True)):
            trainer.learner.cfg = replace(cfg, train=replace(cfg.train, pack_sequences=pack))
            counts[name] = len(trainer.learner.micro_batches(batch, list(range(batch.batch_size))))
            stats[name] = trainer.learner.update(batch, cfg.algo.beta_kl, None)
        inputs = dict(logp=logp, old_logp=batch.extras["old_logp"], teacher_logp=batch.extras["teacher_logp"],
                      ref_logp=batch.extras["ref_logp"], response_mask=batch.response_mask,
                      is_golden=batch.is_golden, truncated=batch.truncated)
        return {"counts": counts, "stats": stats, "inputs": inputs}
    finally:
        trainer.close()


@pytest.mark.dist
def test_logged_losses_equal_the_whole_minibatch_when_ranks_hold_different_micro_batch_counts(setup, tmp_path):
    """Regression: each micro-batch's loss share was scaled by dp x its own rank's micro-batch count and the
    parts then averaged plainly, so with 2 micro-batches on one rank and 1 on the other the logged
    total_loss / pg_loss / kl / golden_loss were (4a + 4b + 2c) / 3 instead of a + b + c (the gradients
    were right). Now they equal the loss computed on the whole minibatch in one piece."""
    from dataclasses import replace

    _root, student, teacher, data = setup
    overrides = [f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=hf",
                 f"data.train_path={data['train']}", "algo.preset=stable_opd", "algo.kl_estimator=k3",
                 "algo.beta_kl=0.1", "algo.lambda_gold=0.5", "train.steps=1", "optim.lr=0",
                 "train.max_tokens_per_microbatch=20", "rollout.max_new_tokens=16",
                 f"logging.out_dir={tmp_path / 'out'}", "logging.progress_bar=false", "logging.tensorboard=false"]
    res = run_distributed(_uneven_micro_batch_stats, 2, overrides, timeout=300)
    assert [r["counts"] for r in res] == [{"dynamic": 2, "packed": 2}, {"dynamic": 1, "packed": 1}]
    parts = [r["inputs"] for r in res]
    T = max(p["response_mask"].shape[1] for p in parts)
    whole = {k: torch.cat([torch.nn.functional.pad(p[k], (0, T - p[k].shape[1])) if p[k].dim() == 2 else p[k]
                           for p in parts]) for k in parts[0]}
    cfg = load_config(None, overrides)
    algo = replace(cfg.algo, loss_agg_constant=float(cfg.rollout.max_new_tokens))
    _, expected = stable_opd_loss(algo, **whole)
    assert expected["golden_loss"] > 0 and expected["kl"] > 0 and expected["clipfrac"] > 0
    for r in res:
        for name in ("dynamic", "packed"):
            [got] = r["stats"][name]
            for k in ("total_loss", "pg_loss", "kl", "golden_loss", "n_pg_tokens"):
                assert got[k] == pytest.approx(expected[k], rel=1e-5, abs=1e-7), (name, k)


# -- 4. KL estimators in the objective -----------------------------------------------------------


def test_objective_k3_plus_logs_k3_and_trains_with_the_k2_gradient():
    from megatron_opd.algo.objective import stable_opd_loss
    from megatron_opd.config import AlgoConfig

    g = torch.Generator().manual_seed(2)
    mask = torch.ones(2, 4, dtype=torch.bool)
    base = dict(old_logp=-torch.rand(2, 4, generator=g), teacher_logp=-torch.rand(2, 4, generator=g),
                ref_logp=-torch.rand(2, 4, generator=g), response_mask=mask,
                is_golden=torch.zeros(2, dtype=torch.bool), truncated=torch.zeros(2, dtype=torch.bool))
    logp0 = -torch.rand(2, 4, generator=g, dtype=torch.float64)
    out = {}
    for est in ("k2", "k3", "k3+"):
        logp = logp0.clone().requires_grad_()
        _, stats = stable_opd_loss(AlgoConfig(beta_kl=1.0, kl_estimator=est, lambda_gold=0.0, clip_eps_low=0.0,
                                              clip_eps_high=0.0), logp=logp, **base)
        loss, _ = stable_opd_loss(AlgoConfig(beta_kl=1.0, kl_estimator=est, lambda_gold=0.0), logp=logp, **base)
        (grad,) = torch.autograd.grad(loss, logp)
        out[est] = (stats["kl"], grad)
    assert out["k3+"][0] == pytest.approx(out["k3"][0])
    torch.testing.assert_close(out["k3+"][1], out["k2"][1])


# -- 5. non-finite logits on one rank -------------------------------------------------------------


def _nan_rank(rank, world_size, overrides):
    """DP=2: rank 1's micro-batch hits NaN logits (a poisoned embedding row only rank 1's batch uses), or
    rank 1's pi_old is NaN; every rank must skip, keep its weights, and then train normally."""
    from megatron_opd.config import load_config
    from megatron_opd.models.optimizer import unwrap
    from megatron_opd.trainer.batch import SequenceItem, build_batch
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        policy = trainer.student
        model = unwrap(policy.model)
        emb = model.embedding.word_embeddings.weight
        poison = 40  # token id only rank 1's batch contains
        items = [SequenceItem([5, 6, 7], [8, 9, 2])] if rank == 0 else [SequenceItem([5, poison, 7], [8, 2])]
        batch = build_batch(items, trainer.pad_id)
        batch.extras["old_logp"] = torch.zeros(batch.response_mask.shape)

        def loss_fn(logp, _logits, b, _full):
            return -logp[b.response_mask].sum() / 5.0, {}

        def state():
            return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}

        before = state()
        saved = emb.data[poison].clone()
        if rank == 1:
            emb.data[poison] = float("nan")
        s1 = policy.train_minibatch([batch], loss_fn, False)
        emb.data[poison] = saved
        after1 = state()
        if rank == 1:
            batch.extras["old_logp"][0, 0] = float("nan")
        s2 = policy.train_minibatch([batch], loss_fn, False)
        batch.extras["old_logp"].zero_()
        after2 = state()
        s3 = policy.train_minibatch([batch], loss_fn, False)
        after3 = state()
        unchanged = all(torch.equal(after1[k], v) and torch.equal(after2[k], v) for k, v in before.items())
        moved = any(not torch.equal(after3[k], v) for k, v in before.items())

        # The whole step: rank 1's pi_old scoring gives NaN at step 1 only. Both ranks skip, count it, go on.
        if rank == 1:
            real_score = policy.score

            def nan_once(b, *args, **kwargs):
                del policy.score  # back to the real method after this call
                lp, lg = real_score(b, *args, **kwargs)
                lp = lp.clone()
                lp[0, 0] = float("nan")
                return lp, lg

            policy.score = nan_once
        pre = state()
        trainer.train(stop_after=1)
        step1_unchanged = all(torch.equal(state()[k], v) for k, v in pre.items())
        trainer.train(stop_after=1)
        step2_moved = any(not torch.equal(state()[k], v) for k, v in pre.items())
        return {"s1": s1, "s2": s2, "s3": s3, "unchanged": unchanged, "moved": moved, "w": state(),
                "step1_unchanged": step1_unchanged, "step2_moved": step2_moved, "step": trainer.step}
    finally:
        trainer.close()


@pytest.mark.dist
def test_nan_logits_on_one_rank_skip_the_update_on_every_rank(setup, tmp_path):
    _root, student, teacher, data = setup
    out = tmp_path / "nan"
    overrides = [f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=hf",
                 f"data.train_path={data['train']}", "algo.preset=opd", "train.steps=2", "optim.lr=1e-2",
                 "train.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=8",
                 "checkpoint.save_every=5", f"logging.out_dir={out}", "logging.progress_bar=false",
                 "logging.tensorboard=false", "train.reuse_old_logp=false",  # a separate pi_old pass to poison
                 "rollout.parity_check=off"]  # the poisoned pi_old is far from the engine's log-probs on purpose
    res = run_distributed(_nan_rank, 2, overrides, timeout=300)
    for r in res:
        assert r["s1"]["update_skipped"] == 1.0 and r["s1"]["nonfinite_loss"] == 1.0
        assert r["s2"]["update_skipped"] == 1.0 and r["s2"]["nonfinite_loss"] == 1.0
        assert r["unchanged"], "a skipped step changed the weights"
        assert r["s3"]["update_skipped"] == 0.0 and r["moved"], "training did not continue"
        assert r["step1_unchanged"] and r["step2_moved"] and r["step"] == 2
    for k, v in res[0]["w"].items():  # replicas still agree
        torch.testing.assert_close(res[1]["w"][k], v)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss/update_skipped"] == 1.0 and rows[0]["train/skipped_steps"] == 1.0
    assert rows[1]["loss/update_skipped"] == 0.0 and rows[1]["train/skipped_steps"] == 1.0


# -- 6. golden samples ---------------------------------------------------------------------------


def test_golden_prompt_picks_are_spread_and_rotate():
    from megatron_opd.trainer.mixture import golden_prompt_picks

    assert golden_prompt_picks(4, 2, 0) == [0, 2]
    assert golden_prompt_picks(4, 2, 1) == [1, 3]
    assert golden_prompt_picks(3, 6, 0) == [0, 0, 1, 1, 2, 2]
    seen = {i for step in range(8) for i in golden_prompt_picks(8, 1, step)}
    assert seen == set(range(8))  # over steps every prompt position gets a golden sample
    assert golden_prompt_picks(0, 2, 0) == [] and golden_prompt_picks(3, 0, 0) == []


def test_golden_response_ends_with_the_stop_id_or_is_truncated():
    from megatron_opd.trainer.mixture import golden_response

    assert golden_response([4, 5, 3], [3, 9], 10, eos_id=3) == ([4, 5, 3], False)  # already a stop id
    assert golden_response([4, 5, 3], [9], 10, eos_id=3) == ([4, 5, 9], False)  # tokenizer EOS -> engine's
    assert golden_response([4, 5], [9], 10, eos_id=3) == ([4, 5, 9], False)  # no EOS at all
    assert golden_response([4, 5, 6, 3], [3], 3, eos_id=3) == ([4, 5, 6], True)  # cut by max_new_tokens
    assert golden_response([4, 5, 3], [3], 3, eos_id=3) == ([4, 5, 3], False)  # fits exactly


class _FakeEngine:
    eos_token_ids = [7]

    def generate(self, prompts, sp):
        from megatron_opd.rollout.base import Sample

        return [Sample(prompt_index=i, prompt_ids=list(p), response_ids=[11, 7], logprobs=[-1.0, -1.0],
                       finish_reason="stop") for i, p in enumerate(prompts) for _ in range(sp.n)]


def _fake_rollouts(records, max_new_tokens: int):
    """The rollout stage without an engine process: the attributes `Rollouts.generate` reads."""
    from megatron_opd.trainer.rollouts import Rollouts

    r = Rollouts.__new__(Rollouts)
    r.cfg = load_config(None, ["algo.preset=stable_opd", "algo.mixture_ratio=0.34", "rollout.n_samples_per_prompt=1",
                               f"rollout.max_new_tokens={max_new_tokens}"])
    r.sampler = SimpleNamespace(next_batch=lambda: records)
    r.engine, r.controller_scores, r.dp_parts, r.weight_version = _FakeEngine(), None, 1, 0
    r.tokenizer = SimpleNamespace(eos_token_id=3, decode=lambda ids, skip_special_tokens=True: "x")
    return r


def test_trainer_golden_samples_spread_end_with_stop_id_and_mark_truncation():
    from megatron_opd.data.prompts import PromptRecord

    records = [PromptRecord(id=str(i), problem="p", prompt="p", prompt_ids=[20 + i], solution="s",
                            solution_ids=[30 + i] * (2 + i) + [3]) for i in range(4)]
    picked = []
    for step in range(2):
        payload = _fake_rollouts(records, 12).generate(step, 0)
        gold = [it for it in payload["items"] if it.is_golden]
        assert len(gold) == 2
        picked.append(sorted(it.prompt_index for it in gold))
        for it in gold:
            assert it.response_ids[-1] == 7 and not it.truncated  # the engine's stop id, not the tokenizer's 3
    assert picked == [[0, 2], [1, 3]]  # spread over the prompts and rotating (was [0, 1] every step)
    payload = _fake_rollouts(records, 3).generate(0, 0)
    gold = {it.prompt_index: it for it in payload["items"] if it.is_golden}
    assert gold[0].response_ids == [30, 30, 7] and not gold[0].truncated
    assert gold[2].response_ids == [32, 32, 32] and gold[2].truncated  # cut by max_new_tokens: truncated


def test_micro_batches_are_balanced_and_trimmed_per_micro_batch():
    """10 rows at micro_batch_size 8 train as 5 + 5 (not 8 + 2 padded to 8 + 8), each micro-batch only as
    long as its own longest row under PP=1; under PP>1 one length for all."""
    from megatron_opd.trainer.batch import SequenceItem, build_batch
    from megatron_opd.trainer.learner import Learner

    items = [SequenceItem([1, 2], [3] * (2 if i < 5 else 9)) for i in range(10)]
    batch = build_batch(items, 0)
    fake = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(micro_batch_size=8, max_tokens_per_microbatch=None,
                                                                           pack_sequences=False),
                                               parallel=SimpleNamespace(pipeline_model_parallel_size=1)),
                           student=SimpleNamespace(seq_multiple=1))
    parts = Learner.micro_batches(fake, batch, list(range(10)))
    assert [p.batch_size for p in parts] == [5, 5]
    assert [p.tokens.shape[1] for p in parts] == [4, 11]
    assert [p.source_rows.tolist() for p in parts] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    fake.cfg.parallel.pipeline_model_parallel_size, fake.cfg.train.micro_batch_size = 2, 4
    parts = Learner.micro_batches(fake, batch, list(range(7)))  # 7 rows at 4: 4 + 3, the second padded to 4
    assert [p.batch_size for p in parts] == [4, 4] and int(parts[1].response_mask[3].sum()) == 0
    assert {p.tokens.shape[1] for p in parts} == {11}


def test_token_budget_groups_rows_by_length():
    """Dynamic batching: rows grouped longest first under a padded-token budget; every row exactly once;
    under PP>1 one shape for all (as many rows as the budget allows at the longest row)."""
    from megatron_opd.trainer.batch import SequenceItem, budget_groups, budget_micro_batches, build_batch, row_lengths

    lens = [30, 5, 6, 29, 7, 50, 4, 8]
    items = [SequenceItem([1, 2], [3] * (n - 2)) for n in lens]
    batch = build_batch(items, 0)
    assert row_lengths(batch) == lens
    groups = budget_groups(lens, list(range(8)), 60)
    assert groups == [[5], [0, 3], [1, 2, 4, 6, 7]]  # 50 | 30+29 -> 2 x 30 | 8,7,6,5,4 -> 5 x 8 = 40
    assert all(len(g) * max(lens[r] for r in g) <= 60 for g in groups)
    assert budget_groups(lens, list(range(8)), 8) == [[5], [0], [3], [7], [4], [2], [1], [6]]  # each alone
    assert budget_groups(lens, [1, 6], 60, seq_multiple=16) == [[1, 6]]  # 2 x 16
    parts = budget_micro_batches(batch, list(range(8)), 60)
    assert [p.source_rows.tolist() for p in parts] == groups
    assert [tuple(p.tokens.shape) for p in parts] == [(1, 50), (2, 30), (5, 8)]
    assert sum(int(p.response_mask.sum()) for p in parts) == int(batch.response_mask.sum())
    pp = budget_micro_batches(batch, list(range(8)), 120, own_length=False)  # 120 // 50 = 2 rows each
    assert [p.batch_size for p in pp] == [2] * 4 and {p.tokens.shape[1] for p in pp} == {50}


def test_a_group_of_empty_responses_stays_within_the_token_budget():
    """Regression: rows without response tokens count as 2 tokens in the budget (`row_lengths`), but a
    micro-batch of only such rows kept the step's full length: 8 empty rows beside 40-token rows at a budget
    of 40 trained as [8, 40], 8x the budget. Now [8, 2], under dynamic batching and when packed."""
    from megatron_opd.trainer.batch import SequenceItem, budget_micro_batches, build_batch, pack_micro_batches

    items = [SequenceItem([1] * 30, [3] * 10) for _ in range(3)] + [SequenceItem([1] * 30, []) for _ in range(8)]
    batch = build_batch(items, 0)
    assert batch.tokens.shape == (11, 40)
    empty = list(range(3, 11))
    part = batch.select(empty)
    assert tuple(part.tokens.shape) == (8, 2) and tuple(part.response_mask.shape) == (8, 1)
    assert not part.response_mask.any()
    parts = budget_micro_batches(batch, list(range(11)), 40)
    assert [p.source_rows.tolist() for p in parts] == [[0], [1], [2], empty]
    assert [tuple(p.tokens.shape) for p in parts] == [(1, 40)] * 3 + [(8, 2)]
    assert all(p.tokens.numel() <= 40 for p in parts)
    assert [tuple(p.tokens.shape) for p in budget_micro_batches(batch, empty, 40, seq_multiple=16)] == [(2, 16)] * 4
    packed = pack_micro_batches(batch, list(range(11)), 40)
    assert all(p.tokens.numel() <= 40 for p in packed) and sum(len(p.source_rows) for p in packed) == 11
