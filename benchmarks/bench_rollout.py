"""Rollout throughput and weight-sync cost, printed as a table.

  python benchmarks/bench_rollout.py [--model tiny|small|HF_DIR] [--new-tokens 64] [--threads 2]
  python benchmarks/bench_rollout.py --decode-variants [--model tiny|small|HF_DIR] [--dtype bfloat16] [--rounds 3]

--decode-variants: the local engine's decode step (ms, 8 rows, EOS disabled) with HF's forward or the lean
step (`rollout.lean_decode`), each packed or not (`rollout.pack_weights`), interleaved over --rounds rounds on
one model, against the roofline: the bytes a step streams (bench_step.engine_weight_bytes) at the copy
bandwidth measured in the same run (bench_step.machine_facts).

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


def decode_variants(args: argparse.Namespace) -> None:
    import statistics

    from transformers import AutoModelForCausalLM

    from bench_step import engine_weight_bytes, facts_text, machine_facts

    facts = machine_facts(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.model in SIZES:
        model = make_tiny_hf_model("qwen2", seed=0, **SIZES[args.model]).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (args.prompt_len + 17 * i,), generator=g).tolist()
               for i in range(4)]
    sp = SamplingParams(n=2, max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    variants = {"hf": (False, False), "hf + packed": (False, True), "lean": (True, False), "lean + packed": (True, True)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    roof = None
    for _ in range(args.rounds):
        for name, (lean, pack) in variants.items():
            engine = LocalEngine(model, eos_token_ids=[], pad_token_id=0, pack_weights=pack, lean_decode=lean)
            roof = roof or engine_weight_bytes(engine) / (facts["copy_gb_s"] * 1e9)
            engine.generate(prompts, sp)
            st = engine.last_stats
            times[name].append(st["decode_s"] / st["decode_steps"])
    print(facts_text(facts))
    print(f"model {args.model} in {args.dtype}, 8 rows, prompts {args.prompt_len}-{args.prompt_len + 51} tokens, "
          f"{args.new_tokens} new; roofline {roof * 1e3:.1f} ms a step; {args.rounds} rounds, interleaved")
    print("| decode | ms a step (median) | each round | x roofline | vs hf |")
    print("|---|---|---|---|---|")
    base = statistics.median(times["hf"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {' / '.join(f'{t * 1e3:.1f}' for t in ts)} | {med / roof:.2f} | "
              f"{med / base:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="tiny | small | path to an HF directory")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--decode-variants", action="store_true", help="HF vs lean decode step, packed or not")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.decode_variants:
        return decode_variants(args)

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
