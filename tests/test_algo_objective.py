"""stable_opd_loss against a brute-force per-token re-implementation, plus the edge cases."""

import math

import pytest
import torch

from megatron_opd.algo.golden import forward_kl_topk
from megatron_opd.algo.objective import stable_opd_loss
from megatron_opd.config import AlgoConfig

B, T = 5, 6
LENGTHS = [6, 4, 5, 0, 1]  # sample 3: empty response; sample 4: a single token
GOLD = [False, False, True, False, False]
TRUNC = [True, False, False, False, False]


def _batch(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda: -torch.rand(B, T, generator=g, dtype=dtype) * 2 - 0.05  # noqa: E731
    mask = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    old = r()
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)).requires_grad_(True)
    return dict(logp=logp, old_logp=old, teacher_logp=r(), ref_logp=r(), response_mask=mask,
                is_golden=torch.tensor(GOLD), truncated=torch.tensor(TRUNC))


def _agg(terms, mode, C):
    """terms: {b: [per-token values]} for the sequences in the term's token set."""
    seqs = {b: v for b, v in terms.items() if v}
    if not seqs:
        return 0.0
    if mode == "token_mean":
        return sum(sum(v) for v in seqs.values()) / sum(len(v) for v in seqs.values())
    if mode == "seq_mean_token_mean":
        return sum(sum(v) / len(v) for v in seqs.values()) / len(seqs)
    return sum(sum(v) for v in seqs.values()) / (C * len(seqs))


def _bruteforce(cfg, d):
    """Per-token Python re-implementation of docs/algorithm.md (no clip/gamma/normalize here)."""
    lp, old, te, ref = d["logp"], d["old_logp"], d["teacher_logp"], d["ref_logp"]
    pg, kl, gold = {}, {}, {}
    C = cfg.loss_agg_constant or T
    for b in range(B):
        n = LENGTHS[b]
        if GOLD[b]:
            gold[b] = [-lp[b, t] for t in range(n)]
            continue
        kl[b] = []
        for t in range(n):
            diff = lp[b, t] - ref[b, t]
            if cfg.kl_estimator == "k1":
                kl[b].append(diff)
            elif cfg.kl_estimator == "k2":
                kl[b].append(0.5 * diff**2)
            else:
                x = torch.clamp(-diff, -cfg.kl_clamp, cfg.kl_clamp)
                kl[b].append(torch.exp(x) - x - 1)
        if cfg.mask_truncated and TRUNC[b]:
            continue
        pg[b] = []
        for t in range(n):
            a = float(te[b, t] - old[b, t])
            r = torch.exp(lp[b, t] - old[b, t])
            l = torch.maximum(-a * r, -a * torch.clamp(r, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high))
            if cfg.dual_clip_c is not None and a < 0:
                l = torch.minimum(l, torch.tensor(-a * cfg.dual_clip_c, dtype=l.dtype))
            pg[b].append(l)
    m = cfg.loss_agg_mode
    return _agg(pg, m, C) + cfg.beta_kl * _agg(kl, m, C) + cfg.lambda_gold * _agg(gold, m, C)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_sum_const"])
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_total_loss_and_grad_match_bruteforce(mode, est):
    cfg = AlgoConfig(loss_agg_mode=mode, kl_estimator=est, beta_kl=0.3, lambda_gold=0.7, clip_eps_low=0.1,
                     clip_eps_high=0.25, dual_clip_c=2.0, mask_truncated=True, kl_clamp=0.5,
                     loss_agg_constant=8.0 if mode == "seq_sum_const" else None)
    d = _batch()
    total, stats = stable_opd_loss(cfg, **d)
    (g_ours,) = torch.autograd.grad(total, d["logp"])
    expect = _bruteforce(cfg, d)
    (g_ref,) = torch.autograd.grad(expect, d["logp"])
    assert total.item() == pytest.approx(expect.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(g_ours.double(), g_ref, atol=1e-7)
    assert stats["total_loss"] == pytest.approx(total.item())
    assert stats["total_loss"] == pytest.approx(stats["pg_loss"] + 0.3 * stats["kl"] + 0.7 * stats["golden_loss"])
    assert stats["n_pg_tokens"] == 4 + 1 and stats["n_rollout_tokens"] == 6 + 4 + 1 and stats["n_golden_tokens"] == 5


def test_stats_values():
    cfg = AlgoConfig(beta_kl=0.0, lambda_gold=0.0, clip_eps_low=0.2, clip_eps_high=0.2)
    d = _batch(1)
    _, stats = stable_opd_loss(cfg, **d)
    m = d["response_mask"] & ~d["is_golden"][:, None]
    adv = (d["teacher_logp"] - d["old_logp"])[m]
    ratio = torch.exp(d["logp"].detach() - d["old_logp"])[m]
    assert stats["adv_mean"] == pytest.approx(adv.mean().item(), rel=1e-6)
    assert stats["adv_std"] == pytest.approx(adv.std(unbiased=False).item(), rel=1e-5)
    assert stats["ratio_mean"] == pytest.approx(ratio.mean().item(), rel=1e-6)
    assert stats["ratio_max"] == pytest.approx(ratio.max().item(), rel=1e-6)
    clipped = ((ratio > 1.2) & (adv > 0)) | ((ratio < 0.8) & (adv < 0))
    assert stats["clipfrac"] == pytest.approx(clipped.double().mean().item())
    assert "kl" not in stats  # default estimator "full" and no logits given: nothing to log
    assert stats["golden_loss"] == 0.0


def test_beta_zero_logs_kl_without_gradient_contribution():
    d = _batch(2)
    with_ref, s1 = stable_opd_loss(AlgoConfig(beta_kl=0.0, lambda_gold=0.0, kl_estimator="k1"), **d)
    d2 = dict(d)
    d2.pop("ref_logp")
    without, s2 = stable_opd_loss(AlgoConfig(beta_kl=0.0, lambda_gold=0.0, kl_estimator="k1"), **d2)
    m = d["response_mask"] & ~d["is_golden"][:, None]
    assert s1["kl"] == pytest.approx((d["logp"].detach() - d["ref_logp"])[m].mean().item())
    assert "kl" not in s2
    assert with_ref.item() == without.item()


def test_full_estimator_uses_logits_of_valid_tokens():
    torch.manual_seed(3)
    d = _batch(3, dtype=torch.float32)
    N, V = int(d["response_mask"].sum()), 11
    z = torch.randn(N, V, requires_grad=True)
    w = torch.randn(N, V)
    cfg = AlgoConfig(kl_estimator="full", beta_kl=0.5, lambda_gold=0.0, kl_chunk_size=4, loss_agg_mode="token_mean")
    d.pop("ref_logp")
    total, stats = stable_opd_loss(cfg, **d, student_logits=z, ref_logits=w)
    rows_rollout = (~d["is_golden"][:, None]).expand(B, T)[d["response_mask"]]
    kl_rows = (z.softmax(-1) * (z.log_softmax(-1) - w.log_softmax(-1))).sum(-1)
    expect_kl = kl_rows[rows_rollout].mean()
    assert stats["kl"] == pytest.approx(expect_kl.item(), rel=1e-5)
    (gz,) = torch.autograd.grad(total, z)
    (gz_ref,) = torch.autograd.grad(0.5 * expect_kl, z)
    assert torch.allclose(gz, gz_ref, atol=1e-6)
    assert gz[~rows_rollout].abs().sum() == 0  # golden rows carry no KL
    with pytest.raises(ValueError, match=r"student_logits: expected \[N, V_local\] with N = response_mask.sum\(\)"):
        stable_opd_loss(cfg, **d, student_logits=z[:-1], ref_logits=w[:-1])
    with pytest.raises(ValueError, match="student_logits/ref_logits: required"):
        stable_opd_loss(cfg, **d)


def test_golden_fkl_topk_through_objective():
    d = _batch(4)
    K = 3
    g = torch.Generator().manual_seed(0)
    tk = torch.randn(B, T, K, generator=g, dtype=torch.float64).log_softmax(-1)
    sk = torch.randn(B, T, K, generator=g, dtype=torch.float64)
    tk[~d["response_mask"]] = float("nan")  # padding ignored
    cfg = AlgoConfig(lambda_gold=2.0, golden_loss="fkl_topk", loss_agg_mode="seq_mean_token_mean")
    _, stats = stable_opd_loss(cfg, **d, teacher_topk_logp=tk, student_topk_logp=sk)
    expect = forward_kl_topk(tk[2, :LENGTHS[2]], sk[2, :LENGTHS[2]]).mean()
    assert stats["golden_loss"] == pytest.approx(expect.item(), rel=1e-9)
    with pytest.raises(ValueError, match="teacher_topk_logp/student_topk_logp: required"):
        stable_opd_loss(cfg, **d)


def test_padding_values_ignored():
    cfg = AlgoConfig(beta_kl=0.1, lambda_gold=1.0, kl_estimator="k3")
    d = _batch(5)
    clean, _ = stable_opd_loss(cfg, **d)
    dirty = {k: (v.detach().clone() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}
    pad = ~d["response_mask"]
    for k in ("logp", "old_logp", "teacher_logp", "ref_logp"):
        dirty[k][pad] = float("nan")
    dirty["teacher_logp"][2] = float("inf")  # golden sample: teacher/old not used
    dirty["old_logp"][2] = float("nan")
    dirty["logp"].requires_grad_(True)
    got, _ = stable_opd_loss(cfg, **dirty)
    got.backward()
    assert got.item() == pytest.approx(clean.item(), rel=1e-12)
    assert torch.isfinite(dirty["logp"].grad).all() and dirty["logp"].grad[pad].abs().sum() == 0


@pytest.mark.parametrize("name", ["logp", "old_logp", "teacher_logp", "ref_logp"])
def test_non_finite_rejected_with_name(name):
    d = _batch(6)
    d[name] = d[name].detach().clone()
    d[name][1, 2] = float("nan") if name != "teacher_logp" else float("-inf")
    with pytest.raises(ValueError, match=rf"{name}: 1 non-finite"):
        stable_opd_loss(AlgoConfig(beta_kl=0.1, kl_estimator="k2", lambda_gold=1.0), **d)


def test_non_finite_logits_rejected():
    d = _batch(6, dtype=torch.float32)
    N = int(d["response_mask"].sum())
    z, w = torch.randn(N, 5), torch.randn(N, 5)
    w[0, 1] = float("inf")
    with pytest.raises(ValueError, match="non-finite KL at row 0"):
        stable_opd_loss(AlgoConfig(beta_kl=0.1, kl_estimator="full"), **d, student_logits=z, ref_logits=w)


def test_shape_mismatch_names_tensor():
    d = _batch(7)
    for name, bad in (("teacher_logp", torch.zeros(B, T + 1)), ("is_golden", torch.zeros(B + 1, dtype=torch.bool)),
                      ("truncated", torch.zeros(B, 1, dtype=torch.bool)), ("ref_logp", torch.zeros(B, T - 1))):
        dd = dict(d)
        dd[name] = bad
        with pytest.raises(ValueError, match=rf"^{name}: expected shape"):
            stable_opd_loss(AlgoConfig(beta_kl=0.1, kl_estimator="k1"), **dd)
    with pytest.raises(ValueError, match="cfg: expected an AlgoConfig"):
        stable_opd_loss({"beta_kl": 0.1}, **d)


def _assert_zero_with_grad(total, logp):
    assert total.item() == 0.0 and total.requires_grad
    (g,) = torch.autograd.grad(total, logp)
    assert torch.equal(g, torch.zeros_like(g))


def test_empty_batch_gives_zero_loss_with_grad_path():
    d = _batch(8)
    d["response_mask"] = torch.zeros(B, T, dtype=torch.bool)
    for k in ("old_logp", "teacher_logp", "ref_logp"):
        d[k] = torch.full((B, T), float("nan"), dtype=torch.float64)
    total, stats = stable_opd_loss(AlgoConfig(beta_kl=0.1, lambda_gold=1.0, kl_estimator="k3"), **d)
    assert all(math.isfinite(v) for v in stats.values())
    _assert_zero_with_grad(total, d["logp"])


def test_all_truncated_with_mask_truncated():
    d = _batch(9)
    d["truncated"] = torch.ones(B, dtype=torch.bool)
    d["is_golden"] = torch.zeros(B, dtype=torch.bool)
    total, stats = stable_opd_loss(AlgoConfig(mask_truncated=True, beta_kl=0.0, lambda_gold=0.0), **d)
    assert stats["pg_loss"] == 0.0 and stats["n_pg_tokens"] == 0
    _assert_zero_with_grad(total, d["logp"])
    # the KL anchor still acts on truncated rollouts
    total, stats = stable_opd_loss(AlgoConfig(mask_truncated=True, beta_kl=1.0, kl_estimator="k1", lambda_gold=0.0), **d)
    m = d["response_mask"]
    assert total.item() == pytest.approx((d["logp"].detach() - d["ref_logp"])[m].mean().item())


def test_single_token_batch():
    logp = torch.tensor([[-0.5]], dtype=torch.float64, requires_grad=True)
    old, te = torch.tensor([[-0.6]], dtype=torch.float64), torch.tensor([[-0.1]], dtype=torch.float64)
    total, _ = stable_opd_loss(AlgoConfig(beta_kl=0.0, lambda_gold=0.0, adv_normalize=False), logp=logp, old_logp=old,
                               teacher_logp=te, response_mask=torch.tensor([[True]]), is_golden=torch.tensor([False]),
                               truncated=torch.tensor([False]))
    a, r = 0.5, math.exp(0.1)
    assert total.item() == pytest.approx(-a * min(r, 1.2))
    # normalised single-token advantage is 0 (no NaN from a zero std)
    total, _ = stable_opd_loss(AlgoConfig(beta_kl=0.0, lambda_gold=0.0, adv_normalize=True), logp=logp, old_logp=old,
                               teacher_logp=te, response_mask=torch.tensor([[True]]), is_golden=torch.tensor([False]),
                               truncated=torch.tensor([False]))
    assert total.item() == 0.0


def test_golden_only_batch():
    d = _batch(10)
    d["is_golden"] = torch.ones(B, dtype=torch.bool)
    d["teacher_logp"] = torch.full((B, T), float("nan"), dtype=torch.float64)  # never scored by the teacher
    total, stats = stable_opd_loss(AlgoConfig(beta_kl=0.1, lambda_gold=1.0, kl_estimator="k1"), **d)
    m = d["response_mask"]
    assert stats["pg_loss"] == 0.0 and stats["kl"] == 0.0
    assert total.item() == pytest.approx(-d["logp"].detach()[m].mean().item())
    (g,) = torch.autograd.grad(total, d["logp"])
    assert torch.allclose(g[m], torch.full_like(g[m], -1.0 / m.sum()))


def test_rollout_only_batch():
    d = _batch(11)
    d["is_golden"] = torch.zeros(B, dtype=torch.bool)
    cfg = AlgoConfig(beta_kl=0.0, lambda_gold=1.0, clip_eps_low=0.2, clip_eps_high=0.2)
    total, stats = stable_opd_loss(cfg, **d)
    assert stats["golden_loss"] == 0.0 and stats["n_golden_tokens"] == 0
    m = d["response_mask"]
    a = (d["teacher_logp"] - d["old_logp"])[m]
    r = torch.exp(d["logp"].detach() - d["old_logp"])[m]
    expect = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2)).mean()
    assert total.item() == pytest.approx(expect.item(), rel=1e-9)


def test_advantage_options_flow_through():
    d = _batch(12)
    cfg = AlgoConfig(beta_kl=0.0, lambda_gold=0.0, adv_clip=0.3, adv_gamma=0.5, adv_normalize=True)
    _, stats = stable_opd_loss(cfg, **d)
    assert stats["adv_mean"] == pytest.approx(0.0, abs=1e-6)
    assert stats["adv_std"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_sum_const"])
def test_global_counts_make_split_batches_sum_to_the_whole(mode):
    """Data parallelism: halves of a batch, each normalised by whole-batch counts, add up to the
    whole-batch loss and gradient (what the trainer all-reduces)."""
    from megatron_opd.algo.objective import term_masks

    g = torch.Generator().manual_seed(3)
    B, T = 6, 7
    lengths = torch.tensor([7, 2, 5, 1, 6, 3])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    gold = torch.tensor([False, False, True, False, True, False])
    trunc = torch.tensor([True, False, False, False, False, True])
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.05 * torch.randn(B, T, generator=g)
    teacher = -torch.rand(B, T, generator=g) * 3
    ref = logp.detach() - 0.1 * torch.rand(B, T, generator=g)
    cfg = AlgoConfig(preset="custom", loss_agg_mode=mode, beta_kl=0.1, kl_estimator="k3", lambda_gold=0.5,
                     mask_truncated=True, loss_agg_constant=7.0)
    kw = dict(old_logp=old, teacher_logp=teacher, ref_logp=ref)
    full, _ = stable_opd_loss(cfg, logp=logp, response_mask=mask, is_golden=gold, truncated=trunc, **kw)
    (g_full,) = torch.autograd.grad(full, logp)
    masks = term_masks(cfg, mask, gold, trunc)
    counts = {k: (float(m.sum()), float((m.sum(-1) > 0).sum())) for k, m in masks.items()}
    total = 0.0
    for rows in ([0, 1, 2], [3, 4, 5]):
        part, _ = stable_opd_loss(cfg, logp=logp[rows], response_mask=mask[rows], is_golden=gold[rows],
                                  truncated=trunc[rows], global_counts=counts,
                                  **{k: v[rows] for k, v in kw.items()})
        total = total + part
    (g_split,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, full, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_split, g_full, rtol=1e-6, atol=1e-8)
