"""Rollout throughput and weight-sync cost, printed as a table.

  python benchmarks/bench_rollout.py [--model tiny|small|HF_DIR] [--new-tokens 64] [--threads 2]

Generation: tokens/s of LocalEngine (KV cache) at batch 1 and 8 with EOS disabled, so every row
generates exactly --new-tokens tokens; SGLang (CPU engine) too when `sglang` is importable.
Weight sync: seconds per GB for LocalEngine.update_weights over the model's full HF state dict
(bucketed like the trainer's sync, finite-check on and off).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from pathlib import Path

import torch

from megatron_opd.models.tiny import make_tiny_hf_model
from megatron_opd.rollout.base import SamplingParams, push_weights
from megatron_opd.rollout.local import LocalEngine

SIZES = {
    "tiny": {},
    "small": dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024),
}


def load_model(spec: str, out_dir: Path):
    if spec in SIZES:
        model = make_tiny_hf_model("qwen2", out_dir=out_dir, seed=0, **SIZES[spec])
        return model, out_dir
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32).eval(), Path(spec)


def bench_generate(engine, batch: int, new_tokens: int, prompt_len: int, vocab: int, reps: int) -> float:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, seed=0))  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = engine.generate(prompts, sp)
        best = min(best, time.perf_counter() - t0)
    n = sum(len(s) for s in out)
    assert n == batch * new_tokens, f"expected {batch * new_tokens} tokens, got {n}"
    return n / best


def bench_sync(engine: LocalEngine, reps: int, bucket_mb: float, check_finite: bool) -> tuple[float, float]:
    weights = [(n, t.clone()) for n, t in engine.named_hf_weights()]
    gb = sum(t.numel() * t.element_size() for _, t in weights) / 1e9
    engine.check_finite_weights = check_finite
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        push_weights(engine, weights, version=engine.weight_version + 1, bucket_mb=bucket_mb)
        best = min(best, time.perf_counter() - t0)
    return gb, best / gb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="tiny | small | path to an HF directory")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model, path = load_model(args.model, Path(tmp) / "m")
        n_params = sum(p.numel() for p in model.parameters())
        vocab = model.config.vocab_size
        engine = LocalEngine(model, eos_token_ids=[], max_batch_size=64)  # no EOS: exact lengths
        rows = []
        for b in (1, 8):
            rows.append((f"local generate batch={b}", f"{bench_generate(engine, b, args.new_tokens, args.prompt_len, vocab, args.reps):.1f} tok/s"))
        if importlib.util.find_spec("sglang") is not None:
            from megatron_opd.rollout.sglang_engine import SGLangEngine

            sg = SGLangEngine(path, mode="engine", eos_token_ids=[], engine_kwargs=dict(
                device="cpu", attention_backend="torch_native", dtype="float32", disable_cuda_graph=True,
                mem_fraction_static=0.3))
            try:
                for b in (1, 8):
                    rows.append((f"sglang generate batch={b}", f"{bench_generate(sg, b, args.new_tokens, args.prompt_len, vocab, args.reps):.1f} tok/s"))
            finally:
                sg.shutdown()
        else:
            rows.append(("sglang generate", "n/a (sglang not importable)"))
        for check in (True, False):
            gb, spg = bench_sync(engine, args.reps, args.bucket_mb, check)
            rows.append((f"local update_weights ({gb * 1e3:.1f} MB, finite-check={'on' if check else 'off'})",
                         f"{spg:.3f} s/GB"))

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (numbers scale with contention)")
    print(f"model={args.model} params={n_params / 1e6:.2f}M new_tokens={args.new_tokens} "
          f"prompt_len={args.prompt_len} threads={args.threads}")
    w = max(len(r[0]) for r in rows)
    print(f"{'measurement'.ljust(w)} | value")
    print(f"{'-' * w}-|-{'-' * 16}")
    for name, val in rows:
        print(f"{name.ljust(w)} | {val}")


if __name__ == "__main__":
    main()
