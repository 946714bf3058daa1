"""Forward+backward throughput of the megatron GPTModel backend (next-token NLL through the
vocab-parallel log-prob kernel), for a ~10M and a ~100M-parameter Qwen2-shaped model.

CPU: fp32, local spec. GPU: bf16 with the TE spec, plus FP8 (``--fp8 delayed`` etc.) when Transformer
Engine is installed; MFU uses ``6 * params + 12 * layers * hidden * seq`` FLOPs per token against
``--peak-tflops`` (default 989, H100/H200 dense bf16).

    python benchmarks/bench_model.py [--sizes 10m,100m] [--seq 256] [--iters 3]
"""

from __future__ import annotations

import argparse
import time

import torch

SIZES = {
    # name: (hidden, layers, heads, kv_heads, ffn, vocab)
    "10m": (256, 4, 4, 2, 704, 16384),
    "100m": (768, 8, 12, 4, 2048, 32000),
}


def _hf_config(size: str):
    from megatron_opd.models.tiny import tiny_hf_config

    h, layers, heads, kv, ffn, vocab = SIZES[size]
    return tiny_hf_config("qwen2", hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
                          max_position_embeddings=4096)


def bench(size: str, batch: int, seq: int, iters: int, dtype: torch.dtype, fp8: str | None) -> dict:
    from megatron_opd.models.gpt import build_gpt_model, num_parameters
    from megatron_opd.models.logprobs import forward_logits, model_vocab_size, vocab_parallel_token_logprobs

    cfg = _hf_config(size)
    model = build_gpt_model(cfg, params_dtype=dtype, fp8=fp8)
    n = num_parameters(model)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)

    def step() -> None:
        logits = forward_logits(model, ids)
        logp = vocab_parallel_token_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=model_vocab_size(model))
        (-logp.mean()).backward()
        model.zero_grad(set_to_none=True)

    step()  # warmup
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    tok_s = batch * seq / dt
    flops_per_tok = 6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq
    del model
    return {"size": size, "params_m": n / 1e6, "dtype": str(dtype).replace("torch.", "") + (f"+fp8:{fp8}" if fp8 else ""),
            "batch": batch, "seq": seq, "s_per_step": dt, "tok_s": tok_s, "tflops": tok_s * flops_per_tok / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10m,100m")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=0, help="0: 4 on CPU / 8 on GPU")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave default)")
    ap.add_argument("--fp8", default="delayed", help="FP8 recipe to also time on GPU with TE; 'none' to skip")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from megatron_opd.models.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    gpu = torch.cuda.is_available()
    batch = args.batch or (8 if gpu else 4)
    runs: list[tuple[torch.dtype, str | None]] = [(torch.bfloat16, None)] if gpu else [(torch.float32, None)]
    if gpu and args.fp8 != "none":
        try:
            import transformer_engine  # noqa: F401

            runs.append((torch.bfloat16, args.fp8))
        except ImportError:
            print("transformer_engine not installed: skipping FP8")
    rows = []
    for size in args.sizes.split(","):
        for dtype, fp8 in runs:
            rows.append(bench(size.strip(), batch, args.seq, args.iters, dtype, fp8))
    device = torch.cuda.get_device_name() if gpu else f"CPU ({torch.get_num_threads()} threads)"
    print(f"\nmegatron GPTModel fwd+bwd, {device}, local spec" if not gpu else
          f"\nmegatron GPTModel fwd+bwd, {device}, TE spec")
    hdr = f"{'size':>6} {'params(M)':>10} {'dtype':>18} {'batch':>5} {'seq':>5} {'s/step':>8} {'tokens/s':>10} {'TFLOP/s':>8}"
    hdr += f" {'MFU':>6}" if gpu else ""
    print(hdr)
    for r in rows:
        line = (f"{r['size']:>6} {r['params_m']:>10.1f} {r['dtype']:>18} {r['batch']:>5} {r['seq']:>5} "
                f"{r['s_per_step']:>8.3f} {r['tok_s']:>10.1f} {r['tflops']:>8.3f}")
        if gpu:
            line += f" {100 * r['tflops'] / args.peak_tflops:>5.1f}%"
        print(line)
    destroy_parallel()


if __name__ == "__main__":
    main()
