"""PPO clipped loss: per-token closed form, gradients, clip fractions, dual clip."""

import math

import pytest
import torch

from megatron_opd.algo.policy_loss import ppo_policy_loss


def _scalar_ppo(logp, old, a, lo, hi, c):
    r = math.exp(logp - old)
    l = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
    if c is not None and a < 0:
        l = min(l, -a * c)
    return l


CASES = [  # (logp - old, advantage)
    (0.0, 1.0), (0.5, 1.0), (-0.5, 1.0), (0.1, 1.0),
    (0.0, -1.0), (0.5, -1.0), (-0.5, -1.0), (2.0, -1.0), (3.0, -2.0), (0.05, -0.3),
]


@pytest.mark.parametrize("dual", [None, 3.0])
def test_per_token_loss_matches_scalar_formula(dual):
    lr = torch.tensor([[d for d, _ in CASES]], dtype=torch.float64)
    adv = torch.tensor([[a for _, a in CASES]], dtype=torch.float64)
    old = torch.full_like(lr, -1.3)
    logp = old + lr
    mask = torch.ones_like(lr, dtype=torch.bool)
    out = ppo_policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=dual)
    expect = [_scalar_ppo(-1.3 + d, -1.3, a, 0.2, 0.28, dual) for d, a in CASES]
    assert torch.allclose(out.loss[0].double(), torch.tensor(expect, dtype=torch.float64), atol=1e-6)


def test_gradient_closed_form():
    """d loss / d logp = -A * r where the unclipped branch is active, else 0 (eps clip or dual clip)."""
    lr = torch.tensor([[d for d, _ in CASES]], dtype=torch.float64)
    adv = torch.tensor([[a for _, a in CASES]], dtype=torch.float64)
    old = torch.zeros_like(lr)
    logp = lr.clone().requires_grad_(True)
    out = ppo_policy_loss(logp, old, adv, torch.ones_like(lr, dtype=torch.bool),
                          clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0)
    out.loss.sum().backward()
    expect = []
    for d, a in CASES:
        r = math.exp(d)
        rc = min(max(r, 0.8), 1.2)
        eps_clipped = -a * rc > -a * r
        dual_active = a < 0 and max(-a * r, -a * rc) > -a * 3.0
        expect.append(0.0 if eps_clipped or dual_active else -a * r)
    assert torch.allclose(logp.grad[0], torch.tensor(expect, dtype=torch.float64), atol=1e-6)


def test_clipfrac_and_dual_fraction():
    # tokens: (A>0, r=e^0.5 clipped), (A>0, r=1), (A<0, r=e^-0.5 clipped), (A<0, r=e^2 dual-clipped)
    lr = torch.tensor([[0.5, 0.0, -0.5, 2.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    out = ppo_policy_loss(lr, torch.zeros_like(lr), adv, torch.ones(1, 4, dtype=torch.bool),
                          clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0)
    assert out.clipfrac.item() == pytest.approx(2 / 4)
    assert out.clipfrac_lower.item() == pytest.approx(1 / 4)
    assert out.loss[0, 3].item() == pytest.approx(3.0)
    assert out.approx_kl.item() == pytest.approx(-(0.5 + 0 - 0.5 + 2.0) / 4)
    assert torch.allclose(out.ratio, torch.exp(lr))


def test_padding_ignored_even_if_nan():
    lr = torch.tensor([[0.1, 0.3, float("nan")]])
    adv = torch.tensor([[1.0, -1.0, float("inf")]])
    mask = torch.tensor([[True, True, False]])
    out = ppo_policy_loss(lr, torch.zeros_like(lr), adv, mask)
    assert torch.isfinite(out.loss).all() and out.loss[0, 2] == 0
    assert out.ratio[0, 2] == 1.0


def test_non_finite_and_bad_params_rejected():
    x = torch.zeros(1, 2)
    m = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="logp"):
        ppo_policy_loss(torch.tensor([[0.0, float("nan")]]), x, x, m)
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_policy_loss(x, x, x, m, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="advantages: expected shape"):
        ppo_policy_loss(x, x, torch.zeros(2, 2), m)
