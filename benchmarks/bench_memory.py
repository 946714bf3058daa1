"""Peak host memory of one training step with the exact full-vocabulary reference KL, at two step
sizes with the same micro-batch: the reference logits are computed per micro-batch, so the peak must
not grow with the number of sequences a rank holds (issue 8; docs/scaling.md has the formula).

Each (code, step size) runs in its own process: tiny Qwen2-shaped student / reference / megatron
teacher (hidden 64, 2 layers; the teacher another random init) with a large vocabulary so the logits dominate, the real Trainer, and a
synthetic rollout (fixed-length random responses, so both step sizes see the same shapes). The
number reported is the step's resident-set high-water mark above the RSS just before it (Linux:
VmHWM reset through /proc/self/clear_refs), i.e. what the step itself adds.

    python benchmarks/bench_memory.py                         # this checkout
    python benchmarks/bench_memory.py --before HEAD           # also `git archive HEAD` in a temp dir
    python benchmarks/bench_memory.py --vocab 32768 --resp 256 --sizes 8,32 --mbs 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import proc_status_kb  # noqa: E402 - the scripts' shared helpers


def _worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.code)
    import torch

    torch.set_num_threads(1)
    from megatron_opd.config import load_config
    from megatron_opd.data.builtin.arithmetic import write_builtin_jsonl
    from megatron_opd.data.toy_tokenizer import byte_tokenizer
    from megatron_opd.models.tiny import make_tiny_hf_model
    from megatron_opd.trainer.batch import SequenceItem
    from megatron_opd.trainer.loop import Trainer

    import megatron_opd

    assert str(Path(megatron_opd.__file__).resolve()).startswith(str(Path(args.code).resolve())), megatron_opd.__file__
    root = Path(args.tmp)
    model, teacher = root / f"student_v{args.vocab}", root / f"teacher_v{args.vocab}"
    for path, seed in ((model, 0), (teacher, 1)):
        if not (path / "config.json").is_file():
            make_tiny_hf_model("qwen2", path, seed=seed, vocab_size=args.vocab, num_hidden_layers=2,
                               max_position_embeddings=4096, eos_token_id=2, pad_token_id=0, bos_token_id=1)
            byte_tokenizer().save_pretrained(str(path))
    data = write_builtin_jsonl(root / "data", n_train=64, n_eval=2)
    n_prompts = args.seqs // 2
    cfg = load_config(None, [
        "algo.preset=opd_kl", "algo.kl_estimator=full", f"algo.kl_chunk_size={args.kl_chunk}",
        f"algo.num_minibatches={args.minibatches}", f"model.hf_path={model}", f"teacher.hf_path={teacher}",
        "teacher.backend=megatron", f"data.train_path={data['train']}", "train.steps=1", "optim.lr=1e-3",
        f"train.prompts_per_step={n_prompts}", "rollout.n_samples_per_prompt=2", f"rollout.max_new_tokens={args.resp}",
        f"train.micro_batch_size={args.mbs}", f"logging.out_dir={root / 'run'}", "logging.progress_bar=false",
        "logging.tensorboard=false", "checkpoint.save_every=100", "checkpoint.resume=never"])

    trainer = Trainer(cfg)

    def synthetic(step: int, version: int) -> dict:  # fixed-length random responses: same shapes in every run
        records = trainer.sampler.next_batch()
        g = torch.Generator().manual_seed(step)
        items = [SequenceItem(r.prompt_ids, torch.randint(3, args.vocab, (args.resp,), generator=g).tolist(),
                              prompt_index=i) for i, r in enumerate(records) for _ in range(2)]
        return {"items": items, "teacher": None, "texts": [], "prompt_texts": [], "records": [r.id for r in records],
                "weight_version": version}

    trainer.rollouts.generate = synthetic
    trainer.rollouts.sync = lambda version=None: None  # the rollout engine is not used here
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = proc_status_kb("VmRSS")
    metrics = trainer.train_step()
    peak = proc_status_kb("VmHWM")
    trainer.close()
    print(json.dumps({"seqs": args.seqs, "rss_before_mb": before / 1024, "step_peak_mb": (peak - before) / 1024,
                      "kl": metrics.get("loss/kl"), "train_s": metrics.get("time/train_s")}))


def _run(code: str, seqs: int, args: argparse.Namespace, tmp: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--code", code, "--tmp", tmp, "--seqs", str(seqs),
           "--vocab", str(args.vocab), "--resp", str(args.resp), "--mbs", str(args.mbs),
           "--minibatches", str(args.minibatches), "--kl-chunk", str(args.kl_chunk)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": code}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=code)
    if out.returncode != 0:
        raise RuntimeError(f"worker failed ({code}, {seqs} seqs):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--code", default=str(REPO), help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seqs", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="8,32", help="step sizes (sequences per rank), comma separated")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--resp", type=int, default=256, help="response tokens per sequence")
    ap.add_argument("--mbs", type=int, default=2, help="train.micro_batch_size")
    ap.add_argument("--minibatches", type=int, default=2, help="algo.num_minibatches")
    ap.add_argument("--kl-chunk", type=int, default=512, help="algo.kl_chunk_size")
    ap.add_argument("--before", default=None, help="a git revision to measure too (e.g. HEAD), via git archive")
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        codes = {"after (this checkout)": str(REPO)}
        if args.before:
            old = Path(tmp) / "before"
            old.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.before], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
            codes = {f"before ({args.before})": str(old), **codes}
        rows = {name: [_run(code, n, args, tmp) for n in sizes] for name, code in codes.items()}
    print(f"V={args.vocab}, {args.resp}-token responses, micro_batch_size={args.mbs}, "
          f"num_minibatches={args.minibatches}, fp32 tiny models (hidden 64, 2 layers), 1 thread\n")
    print("| code | " + " | ".join(f"{n} seqs: step peak RSS" for n in sizes) + " | growth |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for name, rs in rows.items():
        cells = [f"{r['step_peak_mb']:.0f} MB" for r in rs]
        print(f"| {name} | " + " | ".join(cells) + f" | {rs[-1]['step_peak_mb'] - rs[0]['step_peak_mb']:+.0f} MB |")
    print("\nloss/kl per run (same data and weights: before and after should agree to float noise):",
          {name: [f"{r['kl']:.3e}" if r["kl"] is not None else None for r in rs] for name, rs in rows.items()})


if __name__ == "__main__":
    main()
