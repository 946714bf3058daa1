"""Golden-sample losses: SFT NLL and renormalised top-k forward KL to the teacher."""

import pytest
import torch

from megatron_opd.algo.golden import forward_kl_topk, gather_at_ids, sft_nll


def test_sft_nll_is_negative_logp():
    logp = torch.tensor([[-0.1, -2.0]], requires_grad=True)
    out = sft_nll(logp)
    assert torch.allclose(out, torch.tensor([[0.1, 2.0]]))
    out.sum().backward()
    assert torch.allclose(logp.grad, -torch.ones(1, 2))


def test_fkl_topk_bruteforce():
    """Enumerate the formula in docs/algorithm.md with Python floats."""
    import math

    t = [-0.2, -1.9, -3.0]
    s = [-1.0, -0.7, -2.5]
    zt = math.log(sum(math.exp(v) for v in t))
    zs = math.log(sum(math.exp(v) for v in s))
    expect = sum(math.exp(a - zt) * ((a - zt) - (b - zs)) for a, b in zip(t, s))
    got = forward_kl_topk(torch.tensor([[t]]), torch.tensor([[s]]))
    assert got.shape == (1, 1) and got.item() == pytest.approx(expect, rel=1e-5)


def test_fkl_topk_invariant_to_student_normaliser_and_zero_at_match():
    torch.manual_seed(0)
    tl = torch.randn(2, 3, 4).log_softmax(-1)
    sl = torch.randn(2, 3, 4)
    assert torch.allclose(forward_kl_topk(tl, sl), forward_kl_topk(tl, sl - 7.0), atol=1e-6)
    assert torch.allclose(forward_kl_topk(tl, tl + 3.0), torch.zeros(2, 3), atol=1e-6)
    assert (forward_kl_topk(tl, sl) >= -1e-6).all()


def test_fkl_topk_gradient_is_renormalised_s_minus_q():
    """d/d sl_k of sum_k q_k (log q_k - log s~_k) = s~_k - q_k; the teacher side gets no gradient."""
    torch.manual_seed(1)
    tl = torch.randn(5, dtype=torch.float64).requires_grad_(True)
    sl = torch.randn(5, dtype=torch.float64).requires_grad_(True)
    forward_kl_topk(tl, sl).backward()
    assert torch.allclose(sl.grad, sl.detach().softmax(-1) - tl.detach().softmax(-1))
    assert tl.grad is None


def test_gather_at_ids_equals_full_vocab_fkl_when_k_is_vocab():
    torch.manual_seed(2)
    V = 6
    logits_s, logits_t = torch.randn(3, V), torch.randn(3, V)
    ids = torch.stack([torch.randperm(V) for _ in range(3)])
    tl = gather_at_ids(logits_t.log_softmax(-1), ids)
    sl = gather_at_ids(logits_s, ids)
    full = (logits_t.softmax(-1) * (logits_t.log_softmax(-1) - logits_s.log_softmax(-1))).sum(-1)
    assert torch.allclose(forward_kl_topk(tl, sl), full, atol=1e-6)


def test_gather_rejects_bad_ids():
    with pytest.raises(ValueError, match=r"ids must be in \[0, 4\)"):
        gather_at_ids(torch.zeros(1, 4), torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="repeated id"):
        gather_at_ids(torch.zeros(1, 4), torch.tensor([[1, 1]]))
    with pytest.raises(ValueError, match="integer"):
        gather_at_ids(torch.zeros(1, 4), torch.tensor([[1.0]]))
