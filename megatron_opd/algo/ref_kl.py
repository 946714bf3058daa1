"""Reference KL(pi_theta || pi_ref) at the visited prefixes.

Two ways:
- `full_kl`: exact over the whole vocabulary from logits [N, V_local]. Materialising fp32
  softmax/log-softmax for N = 8192 tokens and V = 152064 costs ~5 GB per intermediate, and autograd
  would keep several of them for backward. `_ChunkedFullKL` processes `chunk_size` rows at a time in
  forward and again in backward, saving only the inputs plus three numbers per row (the two
  log-normalisers and the KL), and writes the analytic gradient
      dKL/dz = p * (log p - log q - KL),     dKL/dw = q - p
  (z: student logits, w: reference logits, p = softmax(z), q = softmax(w)).
  For a vocabulary sharded across tensor-parallel ranks every cross-vocab reduction goes through
  `reduce(tensor, op)`: max for the logsumexp shift, sum for the normaliser and the KL. Backward needs
  no reduction at all because the per-row statistics are saved.
- `kl_estimator`: k1/k2/k3/k3+ on the sampled tokens from token log-probs (Schulman's estimators).
  As *loss terms* (differentiated through log pi_theta(y) only, y ~ pi_theta not differentiated) their
  expected gradients differ: k1 -> 0, k2 -> grad KL(pi_theta || pi_ref), k3 -> grad KL(pi_ref || pi_theta),
  k3+ (value of k3, gradient of k2) -> grad KL(pi_theta || pi_ref). See `kl_estimator`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_opd.algo._checks import acc, check_float, check_shape

Reduce = Callable[[torch.Tensor, str], torch.Tensor]
KL_ESTIMATORS = ("full", "k1", "k2", "k3", "k3+")


def identity_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """The single-rank `reduce`: nothing to combine."""
    if op not in ("sum", "max"):
        raise ValueError(f"reduce op must be 'sum' or 'max', got {op!r}")
    return tensor


def _log_normalise_(x: torch.Tensor, tmp: torch.Tensor, reduce: Reduce) -> torch.Tensor:
    """In place x := x - logsumexp(x) over the (possibly sharded) last dim; returns the logsumexp.

    Global max shift first (reduce "max"), then the global sum of exp (reduce "sum"); `tmp` is scratch.
    """
    m = reduce(torch.amax(x, dim=-1), "max")
    x.sub_(m[:, None])
    lse = torch.log(reduce(torch.exp(x, out=tmp).sum(dim=-1), "sum"))
    x.sub_(lse[:, None])
    return m + lse


def _row_blocks(n_rows: int, row_mask: Optional[torch.Tensor], chunk_size: int, device: torch.device):
    """Yield (slice or index tensor, count) per block of up to `chunk_size` selected rows.

    Selected rows are packed into full blocks; a block of consecutive rows is a slice (no gather copy).
    """
    if row_mask is None:
        for s in range(0, n_rows, chunk_size):
            e = min(n_rows, s + chunk_size)
            yield slice(s, e), e - s
        return
    sel = row_mask.nonzero().squeeze(1)
    for s in range(0, sel.numel(), chunk_size):
        rows = sel[s:s + chunk_size]
        n = rows.numel()
        first, last = int(rows[0]), int(rows[-1])
        yield (slice(first, last + 1) if last - first + 1 == n else rows), n


def _take(x: torch.Tensor, rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _take_into(buf: torch.Tensor, x: torch.Tensor, rows) -> torch.Tensor:
    """buf := x[rows], gathering straight into the buffer when the dtypes match (no [rows, V] temporary)."""
    if isinstance(rows, slice) or x.dtype != buf.dtype:
        return buf.copy_(_take(x, rows))
    return torch.index_select(x, 0, rows, out=buf)


def _put(dst: torch.Tensor, rows, src: torch.Tensor) -> None:
    if isinstance(rows, slice):
        dst[rows].copy_(src)
    else:
        dst.index_copy_(0, rows, src.to(dst.dtype))


class _ChunkedFullKL(torch.autograd.Function):
    """Three reusable [chunk_size, V_local] buffers in the accumulation dtype; every op writes in place.

    Reusing buffers matters on CPU: a fresh multi-hundred-MB allocation per chunk is an mmap plus page
    faults each time. On GPU the caching allocator would hide that, but the buffers cost nothing.
    """

    @staticmethod
    def forward(ctx, student_logits, ref_logits, row_mask, chunk_size, reduce):  # type: ignore[override]
        N, V = student_logits.shape
        dev = student_logits.device
        acc_dt = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
        kl = torch.zeros(N, dtype=acc_dt, device=dev)
        lse_z = torch.zeros(N, dtype=acc_dt, device=dev)
        lse_w = torch.zeros(N, dtype=acc_dt, device=dev)
        rows_cap = min(chunk_size, N)
        bz, bw, bt = (torch.empty(rows_cap, V, dtype=acc_dt, device=dev) for _ in range(3))
        for rows, n in _row_blocks(N, row_mask, chunk_size, dev):
            z, w, tmp = bz[:n], bw[:n], bt[:n]
            _take_into(z, student_logits, rows)
            _take_into(w, ref_logits, rows)
            lz = _log_normalise_(z, tmp, reduce)  # z := log p
            lw = _log_normalise_(w, tmp, reduce)  # w := log q
            w.neg_().add_(z)  # log p - log q
            torch.exp(z, out=tmp).mul_(w)
            part = reduce(tmp.sum(dim=-1), "sum")
            if not bool(torch.isfinite(part).all()):
                idx = torch.arange(N, device=dev)[rows] if isinstance(rows, slice) else rows
                bad = int(idx[~torch.isfinite(part)][0])
                raise ValueError(
                    f"student_logits/ref_logits: non-finite KL at row {bad} "
                    "(NaN/inf logits; checked after the cross-shard reduce)"
                )
            _put(kl, rows, part)
            _put(lse_z, rows, lz)
            _put(lse_w, rows, lw)
        ctx.save_for_backward(student_logits, ref_logits, lse_z, lse_w, kl)
        ctx.row_mask = row_mask
        ctx.chunk_size = chunk_size
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_kl):  # type: ignore[override]
        student_logits, ref_logits, lse_z, lse_w, kl = ctx.saved_tensors
        need_z, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gz = torch.zeros_like(student_logits) if need_z else None
        gw = torch.zeros_like(ref_logits) if need_w else None
        N, V = student_logits.shape
        dev = student_logits.device
        rows_cap = min(ctx.chunk_size, N)
        bz, bw, bt = (torch.empty(rows_cap, V, dtype=lse_z.dtype, device=dev) for _ in range(3))
        for rows, n in _row_blocks(N, ctx.row_mask, ctx.chunk_size, dev):
            logp, logq, p = bz[:n], bw[:n], bt[:n]
            g = _take(grad_kl, rows).to(lse_z.dtype)[:, None]
            _take_into(logp, student_logits, rows).sub_(_take(lse_z, rows)[:, None])
            _take_into(logq, ref_logits, rows).sub_(_take(lse_w, rows)[:, None])
            torch.exp(logp, out=p)
            if need_z:
                logp.sub_(logq).sub_(_take(kl, rows)[:, None]).mul_(p).mul_(g)
                _put(gz, rows, logp)
            if need_w:
                logq.exp_().sub_(p).mul_(g)
                _put(gw, rows, logq)
        return gz, gw, None, None, None


def full_kl(
    student_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    *,
    chunk_size: int = 1024,
    reduce: Optional[Reduce] = None,
    row_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact KL(softmax(student) || softmax(ref)) per row: [N, V_local] x2 -> [N] float32.

    Rows where `row_mask` [N] is False are skipped (KL 0, gradient 0). Pass `reduce` as an all-reduce
    over the tensor-parallel group when the vocab is sharded; every rank must pass the same rows,
    chunk_size and row_mask so the reductions line up. Gradients flow to both logits tensors when
    they require grad (the reference normally does not).
    """
    if student_logits.dim() != 2:
        raise ValueError(f"student_logits: expected shape [N, V], got {tuple(student_logits.shape)}")
    check_shape("ref_logits", ref_logits, student_logits.shape)
    check_float("student_logits", student_logits)
    check_float("ref_logits", ref_logits)
    if chunk_size < 1:
        raise ValueError(f"kl_chunk_size: must be >= 1, got {chunk_size}")
    if row_mask is not None:
        check_shape("row_mask", row_mask, (student_logits.shape[0],))
        if row_mask.dtype != torch.bool:
            raise ValueError(f"row_mask: expected bool, got {row_mask.dtype}")
    return _ChunkedFullKL.apply(student_logits, ref_logits, row_mask, int(chunk_size), reduce or identity_reduce)


def full_kl_reference(student_logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Unchunked autograd version (full fp32 [N, V] intermediates); the baseline for tests and benchmarks."""
    logp = torch.log_softmax(acc(student_logits), dim=-1)
    logq = torch.log_softmax(acc(ref_logits), dim=-1)
    return (logp.exp() * (logp - logq)).sum(dim=-1)


def kl_estimator(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str, *, clamp: float = 10.0) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from the sampled token's log-probs (y ~ pi_theta).

    Values (expectation over y ~ pi_theta):
    k1 = logp - ref_logp                      (unbiased, high variance, can be negative)
    k2 = 0.5 * (logp - ref_logp)^2            (biased, low variance, >= 0)
    k3 = exp(d) - d - 1, d = clamp(ref_logp - logp, -clamp, clamp)   (unbiased before the clamp, >= 0)
    k3+ = the value of k3 with the gradient of k2 (straight-through: k3.detach() + k2 - k2.detach()),
          verl's "k3+" / "low_var_kl+"

    Gradients. Used as a loss, the estimate is differentiated through logp = log pi_theta(y) only (the
    sample y ~ pi_theta is not), so the expected gradient is E_y[d k / d theta] with g = grad logp(y):
    k1:  E[g] = 0                                    -> no gradient in expectation (only noise)
    k2:  E[(logp - ref_logp) g] = grad KL(pi_theta || pi_ref)       (the gradient of the KL we log)
    k3:  E[(1 - pi_ref/pi_theta) g] = -sum_y pi_ref(y) g(y) = grad KL(pi_ref || pi_theta)  (the reverse
         direction: mass-covering, not mode-seeking; inside the clamp)
    k3+: as k2, grad KL(pi_theta || pi_ref), while the logged value is the low-variance k3
    (tests/test_algo_ref_kl.py checks each by exact enumeration over a small vocabulary.)
    """
    if kind not in ("k1", "k2", "k3", "k3+"):
        raise ValueError(f"kl_estimator: must be one of ['k1', 'k2', 'k3', 'k3+'] here (got {kind!r}); 'full' needs logits")
    check_shape("ref_logp", ref_logp, logp.shape)
    diff = acc(logp) - acc(ref_logp.detach())
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff * diff
    if clamp <= 0:
        raise ValueError(f"kl_clamp: must be > 0, got {clamp}")
    d = (-diff).clamp(-clamp, clamp)
    k3 = torch.exp(d) - d - 1.0
    if kind == "k3":
        return k3
    k2 = 0.5 * diff * diff
    return k3.detach() + (k2 - k2.detach())


__all__ = ["KL_ESTIMATORS", "Reduce", "full_kl", "full_kl_reference", "identity_reduce", "kl_estimator"]
