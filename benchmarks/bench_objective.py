"""Throughput and peak memory of the Stable-OPD loss fwd+bwd with the exact full-vocab reference KL:
chunked autograd.Function (megatron_opd.algo.ref_kl.full_kl) vs the naive autograd log_softmax version.

    python benchmarks/bench_objective.py --quick          # 1024 tokens x 32000 vocab
    python benchmarks/bench_objective.py                  # 8192 tokens x 152064 vocab (the issue's size)

How memory is measured, and why: tracemalloc only sees Python allocations, not torch's C++ allocator,
and psutil is not installed. Each configuration runs in a fresh subprocess that reads the Linux
high-water mark `resource.getrusage(RUSAGE_SELF).ru_maxrss` twice: after building its inputs
(baseline: interpreter + torch + the two logits tensors) and after one fwd+bwd. The delta is the
extra peak resident memory of the loss computation (including the [N, V] gradient it returns);
it is exact for what the process touched, and cannot under-count freed temporaries because the
high-water mark keeps them. Configurations whose estimated peak exceeds --mem-budget-gb are
skipped rather than risking the OOM killer on a shared machine.

The per-token log-probs (logp/old/teacher/ref) are separate [B, T] tensors here: the benchmark times
the objective given logits, not the LM head that produces them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _fill_randn(t, scale: float, gen, rows: int = 256) -> None:
    """Fill a (possibly bf16) tensor with N(0, scale) in row blocks, avoiding a full fp32 temporary."""
    import torch

    for s in range(0, t.shape[0], rows):
        blk = torch.randn(min(rows, t.shape[0] - s), t.shape[1], generator=gen) * scale
        t[s:s + rows].copy_(blk)


def run_one(impl: str, tokens: int, vocab: int, chunk: int, dtype_name: str, seq_len: int, threads: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from megatron_opd.algo.aggregation import aggregate_loss
    from megatron_opd.algo.objective import stable_opd_loss
    from megatron_opd.algo.ref_kl import full_kl_reference
    from megatron_opd.config import AlgoConfig

    torch.set_num_threads(threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    gen = torch.Generator().manual_seed(0)
    B = tokens // seq_len
    N = B * seq_len
    z = torch.empty(N, vocab, dtype=dtype)
    w = torch.empty(N, vocab, dtype=dtype)
    _fill_randn(z, 2.0, gen)
    _fill_randn(w, 2.0, gen)
    z.requires_grad_(True)
    old = -torch.rand(B, seq_len, generator=gen) * 3
    batch = dict(
        logp=(old + 0.1 * torch.randn(B, seq_len, generator=gen)).requires_grad_(True),
        old_logp=old,
        teacher_logp=-torch.rand(B, seq_len, generator=gen) * 3,
        response_mask=torch.ones(B, seq_len, dtype=torch.bool),
        is_golden=torch.zeros(B, dtype=torch.bool),
        truncated=torch.zeros(B, dtype=torch.bool),
    )
    cfg = AlgoConfig(kl_estimator="full", beta_kl=0.01, lambda_gold=0.0, kl_chunk_size=chunk)
    base = _maxrss_bytes()
    t0 = time.perf_counter()
    if impl == "chunked":
        loss, _ = stable_opd_loss(cfg, **batch, student_logits=z, ref_logits=w)
    else:
        cfg0 = AlgoConfig(kl_estimator="full", beta_kl=0.0, lambda_gold=0.0)
        pg, _ = stable_opd_loss(cfg0, **batch)
        kl_tok = full_kl_reference(z, w).view(B, seq_len)
        loss = pg + cfg.beta_kl * aggregate_loss(kl_tok, batch["response_mask"], cfg.loss_agg_mode)
    t_fwd = time.perf_counter() - t0
    loss.backward()
    t_total = time.perf_counter() - t0
    peak = _maxrss_bytes()
    return dict(impl=impl, tokens=N, vocab=vocab, chunk=chunk if impl == "chunked" else None, dtype=dtype_name,
                fwd_s=t_fwd, fwd_bwd_s=t_total, tokens_per_s=N / t_total, base_rss_gb=base / 2**30,
                peak_rss_gb=peak / 2**30, delta_gb=(peak - base) / 2**30, loss=float(loss),
                grad_abs_sum=float(z.grad.float().abs().sum()))


def estimate_peak_gb(impl: str, tokens: int, vocab: int, chunk: int, dtype_name: str) -> float:
    """Rough upper estimate used only to skip configs that would not fit: inputs + grad + working set."""
    el = 2 if dtype_name == "bf16" else 4
    nv = tokens * vocab
    inputs = 3 * nv * el  # student, reference, student grad
    work = 3 * chunk * vocab * 4 if impl == "chunked" else 5 * nv * 4  # chunked: 3 fp32 buffers; naive: ~4 [N, V] measured
    return (inputs + work) / 2**30 + 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--seq-len", type=int, default=1024, help="response length per sample (tokens = B * seq_len)")
    ap.add_argument("--chunk-size", type=int, default=64,
                    help="kl_chunk_size for the chunked impl (64: its fp32 buffers stay small on CPU)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="logits dtype (bf16 as from a bf16 LM head)")
    ap.add_argument("--impls", default="chunked,naive")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mem-budget-gb", type=float, default=12.0)
    ap.add_argument("--quick", action="store_true", help="1024 tokens x 32000 vocab")
    ap.add_argument("--json", type=str, default=None, help="also write the rows to this JSON file")
    ap.add_argument("--_child", type=str, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        print(json.dumps(run_one(**json.loads(args._child))))
        return
    if args.quick:
        args.tokens, args.vocab = 1024, 32000
    seq_len = min(args.seq_len, args.tokens)
    if args.tokens % seq_len:
        raise SystemExit(f"--tokens {args.tokens} must be a multiple of --seq-len {seq_len}")
    rows = []
    for impl in args.impls.split(","):
        est = estimate_peak_gb(impl, args.tokens, args.vocab, args.chunk_size, args.dtype)
        if est > args.mem_budget_gb:
            rows.append(dict(impl=impl, skipped=f"estimated peak {est:.1f} GiB > --mem-budget-gb {args.mem_budget_gb}"))
            continue
        spec = dict(impl=impl, tokens=args.tokens, vocab=args.vocab, chunk=args.chunk_size, dtype_name=args.dtype,
                    seq_len=seq_len, threads=args.threads)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run([sys.executable, __file__, "--_child", json.dumps(spec)], capture_output=True,
                              text=True, env=env)
        if proc.returncode != 0:
            rows.append(dict(impl=impl, skipped=f"child failed (rc {proc.returncode}): {proc.stderr.strip()[-300:]}"))
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"Stable-OPD loss fwd+bwd, exact full-vocab KL: tokens={args.tokens} vocab={args.vocab} "
          f"dtype={args.dtype} threads={args.threads}")
    hdr = f"{'impl':<8} {'chunk':>6} {'fwd s':>8} {'fwd+bwd s':>10} {'tokens/s':>10} {'base GiB':>8} {'peak GiB':>8} {'delta GiB':>9}  loss"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "skipped" in r:
            print(f"{r['impl']:<8} skipped: {r['skipped']}")
            continue
        print(f"{r['impl']:<8} {str(r['chunk'] or '-'):>6} {r['fwd_s']:>8.2f} {r['fwd_bwd_s']:>10.2f} "
              f"{r['tokens_per_s']:>10.0f} {r['base_rss_gb']:>8.2f} {r['peak_rss_gb']:>8.2f} {r['delta_gb']:>9.2f}  "
              f"{r['loss']:.6f}")
    done = [r for r in rows if "skipped" not in r]
    if len(done) == 2:
        a, b = done
        print(f"loss |diff| = {abs(a['loss'] - b['loss']):.2e}, grad |sum| rel diff = "
              f"{abs(a['grad_abs_sum'] - b['grad_abs_sum']) / max(b['grad_abs_sum'], 1e-30):.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
