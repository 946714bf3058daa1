"""Reverse-KL advantages: masks, clip, gamma, whitening, truncation, EOS."""

import pytest
import torch

from megatron_opd.algo.advantages import compute_advantages, discounted_reverse_cumsum, rollout_token_mask


def _inputs():
    torch.manual_seed(0)
    B, T = 3, 6
    teacher = torch.randn(B, T) - 1
    old = torch.randn(B, T) - 1
    mask = torch.arange(T)[None] < torch.tensor([6, 4, 5])[:, None]
    gold = torch.tensor([False, False, True])
    trunc = torch.tensor([True, False, False])
    return teacher, old, mask, gold, trunc


def test_raw_advantage_is_teacher_minus_old_on_rollout_tokens_only():
    teacher, old, mask, gold, trunc = _inputs()
    adv, m = compute_advantages(teacher, old, mask, gold, trunc)
    expect = torch.where(mask & ~gold[:, None], teacher - old, torch.zeros(()))
    assert torch.allclose(adv, expect)
    assert torch.equal(m, mask & ~gold[:, None])
    assert not adv.requires_grad


def test_advantages_are_detached():
    teacher, old, mask, gold, trunc = _inputs()
    old.requires_grad_(True)
    adv, _ = compute_advantages(teacher, old, mask, gold, trunc)
    assert not adv.requires_grad and adv.grad_fn is None


def test_clip():
    teacher, old, mask, gold, trunc = _inputs()
    adv, m = compute_advantages(teacher, old, mask, gold, trunc, clip=0.5)
    expect = torch.where(m, (teacher - old).clamp(-0.5, 0.5), torch.zeros(()))
    assert torch.allclose(adv, expect)
    assert adv.abs().max() <= 0.5


def test_gamma_matches_bruteforce_sum_within_sample():
    teacher, old, mask, gold, trunc = _inputs()
    g = 0.9
    adv, m = compute_advantages(teacher, old, mask, gold, trunc, gamma=g)
    raw = torch.where(m, teacher - old, torch.zeros(()))
    B, T = raw.shape
    expect = torch.zeros(B, T)
    for b in range(B):
        for t in range(T):
            if m[b, t]:
                expect[b, t] = sum(g ** (k - t) * raw[b, k] for k in range(t, T) if m[b, k])
    assert torch.allclose(adv, expect, atol=1e-6)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
def test_discounted_cumsum_across_block_boundaries(gamma):
    x = torch.randn(2, 300, dtype=torch.float64)
    out = discounted_reverse_cumsum(x, gamma, block=64)
    expect = torch.zeros_like(x)
    acc = torch.zeros(2, dtype=torch.float64)
    for t in reversed(range(300)):
        acc = x[:, t] + gamma * acc
        expect[:, t] = acc
    assert torch.allclose(out, expect, atol=1e-10)


def test_normalize_whitens_over_valid_rollout_tokens():
    teacher, old, mask, gold, trunc = _inputs()
    adv, m = compute_advantages(teacher, old, mask, gold, trunc, normalize=True)
    vals = (teacher - old)[m]
    expect_vals = (vals - vals.mean()) / (vals.std(unbiased=False) + 1e-8)
    assert torch.allclose(adv[m], expect_vals, atol=1e-5)
    assert adv[~m].abs().sum() == 0
    assert adv[m].mean().abs() < 1e-5 and adv[m].std(unbiased=False) == pytest.approx(1.0, abs=1e-4)


def test_order_clip_then_gamma_then_normalize():
    teacher, old, mask, gold, trunc = _inputs()
    adv, m = compute_advantages(teacher, old, mask, gold, trunc, clip=0.7, gamma=0.8, normalize=True)
    raw = torch.where(m, (teacher - old).clamp(-0.7, 0.7), torch.zeros(()))
    disc = torch.where(m, discounted_reverse_cumsum(raw, 0.8), torch.zeros(()))
    v = disc[m]
    assert torch.allclose(adv[m], (v - v.mean()) / (v.std(unbiased=False) + 1e-8), atol=1e-5)


def test_mask_truncated_drops_truncated_samples():
    teacher, old, mask, gold, trunc = _inputs()
    adv, m = compute_advantages(teacher, old, mask, gold, trunc, mask_truncated=True)
    assert not m[0].any() and adv[0].abs().sum() == 0
    assert torch.equal(m[1], mask[1])
    with pytest.raises(ValueError, match="truncated"):
        rollout_token_mask(mask, gold, None, mask_truncated=True)


def test_tokens_after_eos_zeroed():
    teacher, old, mask, gold, trunc = _inputs()
    eos = torch.tensor([2, -1, 0])
    adv, m = compute_advantages(teacher, old, mask, gold, trunc, eos_pos=eos)
    assert m[0].tolist() == [True, True, True, False, False, False]
    assert torch.equal(m[1], mask[1])  # -1: no EOS, the response mask decides
    assert adv[0, 3:].abs().sum() == 0 and adv[0, 2] == pytest.approx(float(teacher[0, 2] - old[0, 2]))


def test_single_token_normalize_gives_zero_not_nan():
    adv, m = compute_advantages(torch.tensor([[-1.0, 0.0]]), torch.tensor([[-2.0, 0.0]]),
                                torch.tensor([[True, False]]), torch.tensor([False]), torch.tensor([False]),
                                normalize=True)
    assert torch.isfinite(adv).all() and adv.abs().sum() == 0


def test_nan_in_padding_and_golden_ignored_but_rejected_on_rollout_tokens():
    teacher, old, mask, gold, trunc = _inputs()
    teacher2 = teacher.clone()
    teacher2[~mask] = float("nan")
    teacher2[2] = float("inf")  # golden sample: the teacher need not score it
    adv, m = compute_advantages(teacher2, old, mask, gold, trunc)
    adv_ref, _ = compute_advantages(teacher, old, mask, gold, trunc)
    assert torch.equal(adv, adv_ref)
    teacher2[1, 1] = float("nan")
    with pytest.raises(ValueError, match=r"teacher_logp: 1 non-finite.*\(1, 1\)"):
        compute_advantages(teacher2, old, mask, gold, trunc)


def test_shape_mismatch_names_tensor():
    teacher, old, mask, gold, trunc = _inputs()
    with pytest.raises(ValueError, match="old_logp: expected shape"):
        compute_advantages(teacher, old[:, :-1], mask, gold, trunc)
    with pytest.raises(ValueError, match="is_golden"):
        compute_advantages(teacher, old, mask, gold[:2], trunc)
