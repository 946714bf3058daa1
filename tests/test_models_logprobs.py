"""Vocab-parallel token log-probs, vocab padding and the `reduce` contract, against brute force.

Single-rank checks run in-process (no torch.distributed); the TP=2 check shards one random
logits tensor over two gloo ranks and compares values and gradients with the unsharded answer.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_distributed
from megatron_opd.algo.ref_kl import full_kl, full_kl_reference
from megatron_opd.models.logprobs import (iter_logit_chunks, mask_vocab_padding, vocab_parallel_reduce,
                                          vocab_parallel_token_logprobs)

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


def _naive(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1).gather(-1, target[..., None]).squeeze(-1)


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_single_rank_matches_log_softmax_value_and_grad(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 17, generator=g, dtype=torch.float64) * 3).requires_grad_()
    target = torch.randint(0, 17, (2, 5), generator=g)
    w = torch.randn(2, 5, generator=g, dtype=torch.float64)
    got = vocab_parallel_token_logprobs(logits, target, chunk_size=chunk)
    (gg,) = torch.autograd.grad((got * w).sum(), logits)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = _naive(ref_logits, target)
    (rg,) = torch.autograd.grad((ref * w).sum(), ref_logits)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(gg, rg, atol=1e-12, rtol=0)


def test_fp32_and_bf16_inputs_accumulate_in_fp32() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=g) * 5
    target = torch.randint(0, 40, (6,), generator=g)
    ref = _naive(logits, target)
    torch.testing.assert_close(vocab_parallel_token_logprobs(logits, target, chunk_size=4).double(), ref,
                               atol=1e-5, rtol=0)
    bf = logits.bfloat16()
    got = vocab_parallel_token_logprobs(bf, target)
    assert got.dtype == torch.float32  # not rounded back to bf16 (~1e-2 error on a log-prob)
    torch.testing.assert_close(got.double(), _naive(bf.float(), target), atol=1e-5, rtol=0)


def test_vocab_padding_is_excluded_and_gets_no_gradient() -> None:
    g = torch.Generator().manual_seed(2)
    real = torch.randn(4, 9, generator=g, dtype=torch.float64)
    padded = torch.cat([real, torch.full((4, 3), 5.0, dtype=torch.float64)], -1).requires_grad_()
    target = torch.randint(0, 9, (4,), generator=g)
    got = vocab_parallel_token_logprobs(padded, target, vocab_size=9, chunk_size=3)
    torch.testing.assert_close(got, _naive(real, target), atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad(got.sum(), padded)
    assert torch.count_nonzero(grad[:, 9:]) == 0
    with pytest.raises(ValueError, match="target_ids"):
        vocab_parallel_token_logprobs(padded, torch.tensor([0, 1, 9, 2]), vocab_size=9)


def test_bad_inputs_are_named() -> None:
    logits = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="target_ids: shape"):
        vocab_parallel_token_logprobs(logits, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target_ids: values must be in \[0, 4\)"):
        vocab_parallel_token_logprobs(logits, torch.tensor([0, -1, 2]))
    bad = logits.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite token log-prob at flat position 1"):
        vocab_parallel_token_logprobs(bad, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_token_logprobs(logits, torch.tensor([0, 1, 2]), chunk_size=0)


def test_masked_padding_leaves_full_kl_unchanged_and_chunks_cover_rows() -> None:
    g = torch.Generator().manual_seed(3)
    z, w = torch.randn(7, 10, generator=g), torch.randn(7, 10, generator=g)
    pad = torch.zeros(7, 2)
    zp, wp = torch.cat([z, pad], -1), torch.cat([w, pad], -1)
    assert mask_vocab_padding(z, 10) is z
    kl = full_kl(mask_vocab_padding(zp, 10), mask_vocab_padding(wp, 10), chunk_size=3)
    torch.testing.assert_close(kl, full_kl_reference(z, w), atol=1e-6, rtol=1e-5)
    seen = []
    for s, e, chunk in iter_logit_chunks(zp.reshape(7, 1, 12), 3, vocab_size=10):
        assert chunk.shape == (e - s, 12)
        assert bool((chunk[:, 10:] < -1e29).all())
        torch.testing.assert_close(chunk[:, :10], z[s:e])
        seen.extend(range(s, e))
    assert seen == list(range(7))


def test_single_rank_reduce_is_identity_and_checks_op() -> None:
    reduce = vocab_parallel_reduce(None)
    t = torch.tensor([1.0, 2.0])
    assert reduce(t, "sum") is t and reduce(t, "max") is t
    with pytest.raises(ValueError, match="'sum' or 'max'"):
        reduce(t, "mean")


N, V_REAL, V_PAD = 10, 11, 12  # the 12th column is padding; each of 2 ranks holds 6 columns


def _full_problem():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(N, V_PAD, generator=g, dtype=torch.float64) * 2
    ref = torch.randn(N, V_PAD, generator=g, dtype=torch.float64)
    target = torch.randint(0, V_REAL, (N,), generator=g)
    weight = torch.randn(N, generator=g, dtype=torch.float64)
    return logits, ref, target, weight


def _tp_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        logits, ref, target, weight = _full_problem()
        width = V_PAD // world
        shard = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_()
        ref_shard = ref[:, rank * width:(rank + 1) * width]
        logp = vocab_parallel_token_logprobs(shard, target, group, vocab_size=V_REAL, chunk_size=4)
        (grad,) = torch.autograd.grad((logp * weight).sum(), shard)
        reduce = vocab_parallel_reduce(group)
        kl_in = mask_vocab_padding(shard.detach().float().clone().requires_grad_(), V_REAL, group)
        kl = full_kl(kl_in, mask_vocab_padding(ref_shard.float(), V_REAL, group), chunk_size=3, reduce=reduce)
        mx = reduce(shard.detach().max(-1).values, "max")
        return {"logp": logp.detach().numpy().copy(), "grad": grad.numpy().copy(), "kl": kl.detach().numpy().copy(),
                "max": mx.numpy().copy()}
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_tp2_logprobs_grad_and_kl_match_unsharded() -> None:
    r0, r1 = run_distributed(_tp_worker, 2)
    logits, ref, target, weight = _full_problem()
    full = logits.clone().requires_grad_()
    want = _naive(full[:, :V_REAL], target)
    (want_grad,) = torch.autograd.grad((want * weight).sum(), full)
    for r in (r0, r1):
        torch.testing.assert_close(torch.from_numpy(r["logp"]), want, atol=1e-12, rtol=0)
        torch.testing.assert_close(torch.from_numpy(r["max"]), logits.max(-1).values)
        torch.testing.assert_close(torch.from_numpy(r["kl"]),
                                   full_kl_reference(logits[:, :V_REAL].float(), ref[:, :V_REAL].float()),
                                   atol=1e-5, rtol=1e-4)
    got_grad = torch.cat([torch.from_numpy(r0["grad"]), torch.from_numpy(r1["grad"])], -1)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-12, rtol=0)
    assert torch.count_nonzero(got_grad[:, V_REAL:]) == 0


@pytest.mark.parametrize("chunk", [1, 1024])
def test_temperature_scales_logits_in_value_and_grad(chunk: int) -> None:
    """log softmax(z / T)[y] and its gradient, without a scaled copy of the logits; padding still excluded."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 4, 12, generator=g, dtype=torch.float64) * 2).requires_grad_()
    target = torch.randint(0, 10, (3, 4), generator=g)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    got = vocab_parallel_token_logprobs(logits, target, vocab_size=10, chunk_size=chunk, temperature=0.7)
    (gg,) = torch.autograd.grad((got * w).sum(), logits)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = _naive(ref_logits[..., :10] / 0.7, target)
    (rg,) = torch.autograd.grad((ref * w).sum(), ref_logits)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(gg, rg, atol=1e-12, rtol=0)
    assert gg[..., 10:].abs().max() == 0
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_token_logprobs(logits, target, temperature=0.0)


def test_nonfinite_logits_raise_or_return_nan() -> None:
    logits = torch.randn(2, 3, 8)
    logits[1, 2, 5] = float("nan")
    target = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="non-finite"):
        vocab_parallel_token_logprobs(logits, target)
    out = vocab_parallel_token_logprobs(logits, target, on_nonfinite="return")
    assert torch.isnan(out[1, 2]) and torch.isfinite(out[0]).all() and torch.isfinite(out[1, :2]).all()


class _BigAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts op outputs of at least `numel` elements that own fresh storage (views excluded)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.numel() >= self.numel
                    and t.untyped_storage().data_ptr() not in inputs):
                self.count += 1
        return out


def test_fp32_logprobs_make_one_chunk_temporary_forward_and_none_backward_beyond_the_gradient() -> None:
    """Memory of the LM-head loss, the largest tensors of a step: the forward works in one fp32 copy of a
    chunk (the exp is in place); for fp32 logits the backward builds the gradient in the gradient's own
    rows, so its only [chunk, V] allocation is the gradient itself."""
    n, v = 64, 512
    logits = torch.randn(n, v, requires_grad=True)
    target = torch.randint(0, v, (n,))
    fwd = _BigAllocations(n * v)
    with fwd:
        lp = vocab_parallel_token_logprobs(logits, target, chunk_size=n)
    bwd = _BigAllocations(n * v)
    with bwd:
        lp.sum().backward()
    assert fwd.count == 1, f"forward made {fwd.count} [chunk, V] tensors"
    assert bwd.count == 1, f"backward made {bwd.count} [chunk, V] tensors (the gradient is one)"
    torch.testing.assert_close(logits.grad, torch.autograd.grad(_naive(logits, target).sum(), logits)[0].float())


def test_full_kl_gathers_masked_rows_straight_into_its_buffers() -> None:
    """Full KL over a row subset (rollout rows of a batch with golden rows): the selected rows go into the
    three reusable [chunk, V] buffers directly, no gathered [rows, V] copy on the way; backward adds only
    the student's gradient."""
    n, v = 48, 512
    student = torch.randn(n, v, requires_grad=True)
    ref = torch.randn(n, v)
    mask = torch.arange(n) % 3 != 1  # 32 rows, not one slice
    fwd = _BigAllocations(32 * v)
    with fwd:
        kl = full_kl(student, ref, chunk_size=n, row_mask=mask)
    bwd = _BigAllocations(32 * v)
    with bwd:
        kl.sum().backward()
    assert fwd.count == 3, f"forward made {fwd.count} [rows, V] tensors (3 buffers)"
    assert bwd.count == 4, f"backward made {bwd.count} [rows, V] tensors (3 buffers + the gradient)"
    want = full_kl_reference(student.detach(), ref)[mask]
    torch.testing.assert_close(kl[mask].detach(), want.float(), rtol=1e-5, atol=1e-6)
