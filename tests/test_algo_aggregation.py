"""Aggregation modes: closed-form values and how each weighs long vs short sequences."""

import pytest
import torch

from megatron_opd.algo.aggregation import aggregate_loss, aggregation_weights


def _mask(lengths, T):
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def test_token_mean_closed_form():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = _mask([3, 1], 4)
    assert aggregate_loss(loss, mask, "token_mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)


def test_seq_mean_token_mean_closed_form():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = _mask([3, 1], 4)
    assert aggregate_loss(loss, mask, "seq_mean_token_mean").item() == pytest.approx((2.0 + 4.0) / 2)


def test_seq_sum_const_closed_form_default_and_explicit_constant():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = _mask([3, 1], 4)
    assert aggregate_loss(loss, mask, "seq_sum_const").item() == pytest.approx((6 + 4) / 4 / 2)
    assert aggregate_loss(loss, mask, "seq_sum_const", constant=10.0).item() == pytest.approx((6 + 4) / 10 / 2)


def test_length_weighting_of_each_mode():
    """One long (8) and one short (2) sequence: total weight each sequence receives."""
    mask = _mask([8, 2], 8)
    seq_w = {m: aggregation_weights(mask, m).sum(-1) for m in ("token_mean", "seq_mean_token_mean", "seq_sum_const")}
    # token_mean: proportional to length -> the long sequence gets 4x the short one.
    assert torch.allclose(seq_w["token_mean"], torch.tensor([0.8, 0.2], dtype=torch.float64))
    # seq_mean_token_mean: every sequence weighs the same -> each short token counts 4x a long token.
    assert torch.allclose(seq_w["seq_mean_token_mean"], torch.tensor([0.5, 0.5], dtype=torch.float64))
    tok_w = aggregation_weights(mask, "seq_mean_token_mean")
    assert tok_w[1, 0] / tok_w[0, 0] == pytest.approx(4.0)
    # seq_sum_const: per-token weight 1/(B*C) for every token, sequence weight proportional to length.
    assert torch.allclose(seq_w["seq_sum_const"], torch.tensor([8 / 16, 2 / 16], dtype=torch.float64))


def test_seq_sum_const_token_weight_does_not_depend_on_batch_lengths():
    """Dr.GRPO's point: a token's weight is fixed by (B, C), not by how long the other samples are."""
    w_a = aggregation_weights(_mask([8, 2], 8), "seq_sum_const")
    w_b = aggregation_weights(_mask([8, 8], 8), "seq_sum_const")
    assert w_a[0, 0] == w_b[0, 0]
    t_a = aggregation_weights(_mask([8, 2], 8), "token_mean")
    t_b = aggregation_weights(_mask([8, 8], 8), "token_mean")
    assert t_a[0, 0] > t_b[0, 0]


def test_empty_sequences_do_not_count_and_empty_mask_is_zero_with_grad():
    loss = torch.tensor([[1.0, 3.0], [float("nan"), float("nan")]], requires_grad=True)
    mask = torch.tensor([[True, True], [False, False]])
    for mode, expect in (("token_mean", 2.0), ("seq_mean_token_mean", 2.0), ("seq_sum_const", 4.0 / 2)):
        assert aggregate_loss(loss, mask, mode).item() == pytest.approx(expect)
    empty = aggregate_loss(loss, torch.zeros(2, 2, dtype=torch.bool), "token_mean")
    assert empty.item() == 0.0
    empty.backward()
    assert torch.equal(loss.grad, torch.zeros(2, 2))


def test_padding_nan_ignored_and_gradient_equals_weights():
    loss = torch.randn(3, 5, requires_grad=True)
    mask = _mask([5, 3, 1], 5)
    with torch.no_grad():
        loss[~mask] = float("nan")
    for mode in ("token_mean", "seq_mean_token_mean", "seq_sum_const"):
        loss.grad = None
        out = aggregate_loss(loss, mask, mode)
        out.backward()
        assert torch.isfinite(out)
        assert torch.allclose(loss.grad, aggregation_weights(mask, mode).float())


def test_global_count_overrides():
    loss = torch.ones(2, 3)
    mask = _mask([3, 1], 3)
    assert aggregate_loss(loss, mask, "token_mean", num_tokens=8).item() == pytest.approx(4 / 8)
    assert aggregate_loss(loss, mask, "seq_mean_token_mean", num_seqs=4).item() == pytest.approx(2 / 4)


def test_bad_mode_and_shape_raise():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), "sum")
    with pytest.raises(ValueError, match="loss: expected shape"):
        aggregate_loss(torch.ones(1, 3), torch.ones(1, 2, dtype=torch.bool), "token_mean")
    with pytest.raises(ValueError, match="mask"):
        aggregate_loss(torch.ones(1, 2), torch.tensor([[0, 2]]), "token_mean")
