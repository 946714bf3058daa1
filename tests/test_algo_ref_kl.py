"""Reference KL: chunked exact full-vocab KL (values, gradients, sharded reduce, memory) and k1/k2/k3."""

import threading

import pytest
import torch
import torch.nn.functional as F

from megatron_opd.algo.ref_kl import full_kl, full_kl_reference, kl_estimator


def _naive_kl(z, w):
    """KL(softmax(z) || softmax(w)) via F.kl_div(input=log q, target=log p)."""
    return F.kl_div(F.log_softmax(w, -1), F.log_softmax(z, -1), log_target=True, reduction="none").sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_full_kl_matches_kl_div(chunk):
    torch.manual_seed(0)
    z, w = torch.randn(10, 50) * 3, torch.randn(10, 50) * 3
    assert torch.allclose(full_kl(z, w, chunk_size=chunk), _naive_kl(z, w), atol=1e-5)
    assert torch.allclose(full_kl_reference(z, w), _naive_kl(z, w), atol=1e-5)


def test_full_kl_gradients_match_autograd_reference():
    torch.manual_seed(1)
    z = (torch.randn(9, 40, dtype=torch.float64) * 2).requires_grad_(True)
    w = (torch.randn(9, 40, dtype=torch.float64) * 2).requires_grad_(True)
    g = torch.randn(9, dtype=torch.float64)
    (full_kl(z, w, chunk_size=4) * g).sum().backward()
    gz, gw = z.grad.clone(), w.grad.clone()
    z.grad = w.grad = None
    (_naive_kl(z, w) * g).sum().backward()
    assert torch.allclose(gz, z.grad, atol=1e-10) and torch.allclose(gw, w.grad, atol=1e-10)
    # the analytic form the module documents
    p, lp, lq = z.softmax(-1), z.log_softmax(-1), w.log_softmax(-1)
    kl = (p * (lp - lq)).sum(-1, keepdim=True)
    assert torch.allclose(gz, g[:, None] * p * (lp - lq - kl), atol=1e-10)


def test_gradcheck_float64_with_row_mask():
    torch.manual_seed(2)
    z = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([True, False, True, True, False])
    assert torch.autograd.gradcheck(lambda a, b: full_kl(a, b, chunk_size=2), (z, w))
    assert torch.autograd.gradcheck(lambda a, b: full_kl(a, b, chunk_size=2, row_mask=rows), (z, w))
    out = full_kl(z, w, chunk_size=2, row_mask=rows)
    assert torch.all(out[~rows] == 0) and torch.allclose(out[rows], _naive_kl(z, w)[rows])


def test_bf16_inputs_fp32_accumulation():
    torch.manual_seed(3)
    z = (torch.randn(6, 300) * 2).bfloat16().requires_grad_(True)
    w = (torch.randn(6, 300) * 2).bfloat16()
    out = full_kl(z, w, chunk_size=4)
    assert out.dtype == torch.float32
    assert torch.allclose(out, _naive_kl(z.float(), w.float()), atol=1e-5)
    out.sum().backward()
    assert z.grad.dtype == torch.bfloat16
    zf = z.detach().float().requires_grad_(True)
    _naive_kl(zf, w.float()).sum().backward()
    assert torch.allclose(z.grad.float(), zf.grad, rtol=1e-2, atol=1e-3)  # bf16 rounding of the grad


def test_saved_tensors_are_only_inputs_plus_per_row_stats():
    """Backward must not keep [N, V] fp32 intermediates alive: count what autograd saves."""
    N, V = 16, 100
    z = torch.randn(N, V, requires_grad=True)
    w = torch.randn(N, V)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        full_kl(z, w, chunk_size=4)
    assert sum(saved) <= 2 * N * V + 3 * N
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        full_kl_reference(z, w)
    assert sum(saved) > 3 * N * V  # what the chunked version avoids


class _ThreadAllReduce:
    """An in-process all-reduce across `world` threads: each rank deposits, all combine the same way."""

    def __init__(self, world):
        self.slots = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)

    def for_rank(self, rank):
        def reduce(t, op):
            self.slots[rank] = t.detach().clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            out = stacked.sum(0) if op == "sum" else stacked.amax(0)
            self.barrier.wait()
            return out
        return reduce


def _run_sharded(z, w, chunk, row_mask=None, world=2):
    zs, ws = z.detach().chunk(world, dim=-1), w.detach().chunk(world, dim=-1)
    ar = _ThreadAllReduce(world)
    results, errors = [None] * world, []
    g = torch.linspace(0.5, 1.5, z.shape[0], dtype=z.dtype)

    def rank_fn(r):
        try:
            zl = zs[r].clone().requires_grad_(True)
            wl = ws[r].clone().requires_grad_(True)
            kl = full_kl(zl, wl, chunk_size=chunk, reduce=ar.for_rank(r), row_mask=row_mask)
            (kl * g).sum().backward()
            results[r] = (kl.detach(), zl.grad, wl.grad)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            ar.barrier.abort()

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, g


@pytest.mark.parametrize("row_mask", [None, torch.tensor([True, False, True, True, True, False, True])])
def test_two_vocab_shards_equal_unsharded(row_mask):
    torch.manual_seed(4)
    z = torch.randn(7, 64, dtype=torch.float64) * 3
    w = torch.randn(7, 64, dtype=torch.float64) * 3
    z[0, 40] = 20.0  # the max of row 0 lives in shard 1 only: the max-reduce matters
    results, g = _run_sharded(z, w, chunk=3, row_mask=row_mask)
    zf, wf = z.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = full_kl(zf, wf, chunk_size=3, row_mask=row_mask)
    (ref * g).sum().backward()
    for kl, _, _ in results:
        assert torch.allclose(kl, ref.detach(), atol=1e-12)
    assert torch.allclose(torch.cat([r[1] for r in results], -1), zf.grad, atol=1e-12)
    assert torch.allclose(torch.cat([r[2] for r in results], -1), wf.grad, atol=1e-12)
    assert torch.allclose(ref.detach()[row_mask if row_mask is not None else slice(None)],
                          _naive_kl(z, w)[row_mask if row_mask is not None else slice(None)], atol=1e-12)


def _gloo_rank(rank, world, z, w):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

        def reduce(t, op):
            t = t.clone()
            dist.all_reduce(t, op=ops[op])
            return t

        zl = z.chunk(world, -1)[rank].clone().requires_grad_(True)
        kl = full_kl(zl, w.chunk(world, -1)[rank].clone(), chunk_size=2, reduce=reduce)
        kl.sum().backward()
        # plain numpy: torch tensors are shared by file descriptor, which can vanish when the rank exits
        return kl.detach().numpy(), zl.grad.numpy()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.dist
def test_two_gloo_ranks_equal_unsharded():
    from _dist import run_distributed

    torch.manual_seed(5)
    z, w = torch.randn(5, 32, dtype=torch.float64), torch.randn(5, 32, dtype=torch.float64)
    out = run_distributed(_gloo_rank, 2, z, w, timeout=120)
    zf = z.clone().requires_grad_(True)
    ref = full_kl(zf, w)
    ref.sum().backward()
    for kl, _ in out:
        assert torch.allclose(torch.from_numpy(kl), ref.detach(), atol=1e-12)
    assert torch.allclose(torch.cat([torch.from_numpy(g) for _, g in out], -1), zf.grad, atol=1e-12)


def test_full_kl_rejects_non_finite_and_bad_shapes():
    z, w = torch.randn(4, 8), torch.randn(4, 8)
    z[2, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite KL at row 2"):
        full_kl(z, w, chunk_size=3)
    with pytest.raises(ValueError, match="ref_logits: expected shape"):
        full_kl(torch.randn(4, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="kl_chunk_size"):
        full_kl(torch.randn(4, 8), torch.randn(4, 8), chunk_size=0)


def test_full_kl_empty_rows():
    z = torch.zeros(0, 8, requires_grad=True)
    out = full_kl(z, torch.zeros(0, 8))
    out.sum().backward()
    assert out.shape == (0,) and z.grad.shape == (0, 8)


def test_estimators_closed_form_values():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = logp - ref
    assert torch.allclose(kl_estimator(logp, ref, "k1"), d)
    assert torch.allclose(kl_estimator(logp, ref, "k2"), 0.5 * d**2)
    assert torch.allclose(kl_estimator(logp, ref, "k3"), torch.exp(-d) + d - 1)
    # clamp of the log-ratio ref - logp to [-c, c]
    big = kl_estimator(torch.tensor([0.0]), torch.tensor([-50.0]), "k3", clamp=2.0)
    assert big.item() == pytest.approx(torch.exp(torch.tensor(-2.0)).item() + 2.0 - 1.0)


def test_k1_k3_unbiased_in_expectation_k2_nonnegative():
    """E_{y ~ p}[k(y)] over a small vocab, enumerated exactly, against the exact KL(p || q)."""
    torch.manual_seed(6)
    z, w = torch.randn(3, 12, dtype=torch.float64), torch.randn(3, 12, dtype=torch.float64)
    lp, lq = z.log_softmax(-1), w.log_softmax(-1)
    p = lp.exp()
    exact = _naive_kl(z, w)
    for kind in ("k1", "k3"):
        est = (p * kl_estimator(lp, lq, kind, clamp=50.0).double()).sum(-1)
        assert torch.allclose(est, exact, atol=1e-6), kind
    assert (kl_estimator(lp, lq, "k2") >= 0).all()


def test_estimator_gradients_closed_form():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -9.0], dtype=torch.float64, requires_grad=True)
    for kind, expect in (
        ("k1", lambda d: torch.ones_like(d)),
        ("k2", lambda d: d),
        ("k3", lambda d: 1 - torch.exp(-d).where(d.abs() <= 3, torch.zeros_like(d))),
    ):
        logp.grad = None
        kl_estimator(logp, ref, kind, clamp=3.0).sum().backward()
        d = (logp - ref).detach()
        got = logp.grad
        if kind == "k3":
            # inside the clamp: 1 - exp(-d); outside: the clamped term is constant, only -d' ... -1 path
            inside = d.abs() <= 3
            assert torch.allclose(got[inside], (1 - torch.exp(-d))[inside])
            assert torch.allclose(got[~inside], torch.zeros_like(got[~inside]))
        else:
            assert torch.allclose(got, expect(d)), kind
        assert ref.grad is None  # ref log-probs are a frozen target


def test_estimator_errors():
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimator(torch.zeros(2), torch.zeros(2), "full")
    with pytest.raises(ValueError, match="ref_logp: expected shape"):
        kl_estimator(torch.zeros(2), torch.zeros(3), "k1")


def _expected_estimator_grad(z: torch.Tensor, w: torch.Tensor, kind: str) -> torch.Tensor:
    """E_{y ~ pi}[d k(y) / d z] over a small vocab, enumerated exactly: the estimator is used as a loss on
    sampled tokens, so the sampling distribution pi = softmax(z) is not differentiated (weights detached)."""
    z = z.clone().requires_grad_()
    lp, lq = z.log_softmax(-1), w.log_softmax(-1)
    k = kl_estimator(lp, lq, kind, clamp=50.0).double()
    (g,) = torch.autograd.grad((lp.exp().detach() * k).sum(), z)
    return g


def _exact_kl_grad(z: torch.Tensor, w: torch.Tensor, reverse: bool) -> torch.Tensor:
    z = z.clone().requires_grad_()
    lp, lq = z.log_softmax(-1), w.log_softmax(-1)
    kl = (lq.exp() * (lq - lp)).sum() if reverse else (lp.exp() * (lp - lq)).sum()
    (g,) = torch.autograd.grad(kl, z)
    return g


def test_estimator_expected_gradients_are_the_documented_ones():
    """k1: 0; k2 and k3+: grad KL(pi || ref); k3: grad KL(ref || pi) (docs/algorithm.md)."""
    torch.manual_seed(11)
    z, w = torch.randn(4, 7, dtype=torch.float64), torch.randn(4, 7, dtype=torch.float64)
    fwd, rev = _exact_kl_grad(z, w, reverse=False), _exact_kl_grad(z, w, reverse=True)
    assert fwd.abs().max() > 1e-2 and (fwd - rev).abs().max() > 1e-2  # the two directions differ here
    torch.testing.assert_close(_expected_estimator_grad(z, w, "k1"), torch.zeros_like(z), atol=1e-12, rtol=0)
    torch.testing.assert_close(_expected_estimator_grad(z, w, "k2"), fwd, atol=1e-12, rtol=0)
    torch.testing.assert_close(_expected_estimator_grad(z, w, "k3"), rev, atol=1e-12, rtol=0)
    torch.testing.assert_close(_expected_estimator_grad(z, w, "k3+"), fwd, atol=1e-12, rtol=0)


def test_k3_plus_has_the_value_of_k3_and_the_gradient_of_k2():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    val = kl_estimator(logp, ref, "k3+")
    torch.testing.assert_close(val.detach(), kl_estimator(logp.detach(), ref, "k3"))
    (g,) = torch.autograd.grad(val.sum(), logp)
    torch.testing.assert_close(g, (logp - ref).detach())


def test_k3_plus_monte_carlo_gradient_matches_exact_kl_gradient():
    """Sampled tokens, as in training: the mean k3+ loss over y ~ pi has the gradient of KL(pi || ref)."""
    g = torch.Generator().manual_seed(3)
    z, w = torch.randn(6, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    y = torch.multinomial(z.softmax(-1), 200_000, replacement=True, generator=g)
    zz = z.clone().requires_grad_()
    lp = zz.log_softmax(-1)[y]
    lq = w.log_softmax(-1)[y]
    (mc,) = torch.autograd.grad(kl_estimator(lp, lq, "k3+").mean(), zz)
    torch.testing.assert_close(mc, _exact_kl_grad(z, w, reverse=False), atol=1e-2, rtol=0)
