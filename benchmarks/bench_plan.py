"""`megatron-opd plan` against measured runs on this CPU: predicted vs measured peak memory per rank.

Each configuration trains a few steps of real `Trainer.train_step` (megatron-core over gloo, one process
per rank) under PyTorch's profiler with `profile_memory`: the measured peak of a rank is the CPU
allocator's high-water mark of live tensor bytes ("Total Allocated" of its memory events) during the
training steps, counted from before the models were built (baseline: the allocator's total when the
profiler started, before the trainer). The prediction is `plan_run(..., device="cpu")`: the same formulas
as on a GPU with the CPU's differences -- fp32 weights, megatron's local spec (attention probabilities
materialised), the in-process rollout engine, no CUDA context, NCCL buffers or caching allocator.

    python benchmarks/bench_plan.py                    # every row (make bench-plan); writes docs/plan_validation.json
    python benchmarks/bench_plan.py --only tiny-opd    # one row
    python benchmarks/bench_plan.py --list

The table goes into docs/scaling.md by hand; the JSON holds `config`, `rank`, `predicted_gb`,
`measured_gb` and the components of each row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port  # noqa: E402 - the scripts' shared helpers, beside them

TARGET = 0.15
STEPS = 2
SAVE = "bench.save_in_window"  # not a config key: the worker saves a checkpoint after the steps, inside the window

# name -> (model scale, world size, overrides). Rollouts at the budget (random models seldom stop early;
# the SmolLM2 benchmark student rambles), one minibatch, golden rows with stable_opd.
CONFIGS: dict[str, tuple[str, int, list[str]]] = {
    "tiny-opd": ("tiny", 1, ["algo.preset=opd"]),
    "tiny-stable_opd": ("tiny", 1, ["algo.preset=stable_opd"]),
    "tiny-stable_opd-recompute": ("tiny", 1, ["algo.preset=stable_opd", "model.recompute_activations=full"]),
    "tiny-stable_opd-tp2": ("tiny", 2, ["algo.preset=stable_opd", "parallel.tensor_model_parallel_size=2",
                                        "teacher.tensor_model_parallel_size=2"]),
    "tiny-stable_opd-pp2": ("tiny", 2, ["algo.preset=stable_opd", "parallel.pipeline_model_parallel_size=2",
                                        "teacher.pipeline_model_parallel_size=2"]),
    "tiny-stable_opd-dp2": ("tiny", 2, ["algo.preset=stable_opd"]),
    "tiny-stable_opd-tp2-teacher-own-layout": ("tiny", 2, ["algo.preset=stable_opd",
                                                           "parallel.tensor_model_parallel_size=2"]),
    "smol-opd": ("smol", 1, ["algo.preset=opd"]),
    "smol-stable_opd": ("smol", 1, ["algo.preset=stable_opd"]),
    "smol-stable_opd-recompute": ("smol", 1, ["algo.preset=stable_opd", "model.recompute_activations=full"]),
    # PP2 + the full KL over a 32k vocabulary, one row per micro-batch: the reference's logits reach the last
    # stage one micro-batch at a time (a minibatch's worth before the reference ran inside the schedule)
    "tiny32k-stable_opd-pp2": ("tiny32k", 2, ["algo.preset=stable_opd", "parallel.pipeline_model_parallel_size=2",
                                              "teacher.pipeline_model_parallel_size=2", "train.micro_batch_size=1"]),
    # a token budget below one row: every row is forwarded whole
    "tiny-stable_opd-over-budget": ("tiny", 1, ["algo.preset=stable_opd", "train.max_tokens_per_microbatch=64"]),
    # a checkpoint save inside the measured window (distributed optimizer, DP2): the gathered optimizer state
    "tiny-stable_opd-dp2-save": ("tiny", 2, ["algo.preset=stable_opd", "model.recompute_activations=full", SAVE]),
    # the real pretrained pair (`megatron-opd models export`): Qwen2.5-Coder-0.5B-Instruct in fp32 under the 1.5B
    # in bf16, a 152k vocabulary; 2 prompts x 2 rollouts so that it fits a 24 GB machine
    "qwen-opd-teacher-bf16": ("qwen", 1, ["algo.preset=opd", "teacher.params_dtype=bfloat16",
                                          "train.prompts_per_step=2", "train.micro_batch_size=2"]),
}


def tiny_models(root: Path, vocab: int = 0) -> tuple[Path, Path]:
    """A random student (8 layers, h 512) and teacher (10 layers) over the byte tokenizer: ~25M
    parameters, so that every component is tens of MB, well above allocator noise. `vocab` > 0: that many
    embedding rows instead of the tokenizer's (the logits then weigh what a real vocabulary's do; the
    rollouts sample ids the byte tokenizer decodes as nothing)."""
    from megatron_opd.data.toy_tokenizer import byte_tokenizer
    from megatron_opd.models.tiny import make_tiny_hf_model

    tok = byte_tokenizer()
    out = []
    for name, seed, layers in (("student", 0, 8), ("teacher", 1, 10)):
        d = root / name
        if not (d / "config.json").is_file():
            make_tiny_hf_model("qwen2", d, seed=seed, vocab_size=vocab or len(tok), num_hidden_layers=layers,
                               hidden_size=512,
                               intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2,
                               eos_token_id=2, pad_token_id=0, bos_token_id=1, max_position_embeddings=4096)
            tok.save_pretrained(str(d))
        out.append(d)
    return out[0], out[1]


def setting(scale: str, work: Path) -> list[str]:
    from transformers import AutoTokenizer

    from megatron_opd.config import load_config
    from megatron_opd.data.builtin.arithmetic import write_builtin_jsonl
    from megatron_opd.data.prompts import load_prompts
    from megatron_opd.demo import bench_pair
    from megatron_opd.models.pretrained import default_cache_dir

    if scale.startswith("tiny"):
        student, teacher = tiny_models(work / "models", vocab=int(scale[4:-1] or 0) * 1024)
    elif scale == "qwen":
        from megatron_opd.models.pretrained import export_chunked

        student, teacher = (export_chunked("qwen2.5-coder-0.5b-instruct"),
                            export_chunked("qwen2.5-coder-1.5b-instruct"))
    else:
        student, teacher = bench_pair(default_cache_dir())
    data = write_builtin_jsonl(work / "data", n_train=16, n_eval=2)["train"]
    cfg = load_config(None, [f"model.hf_path={student}", f"data.train_path={data}"])
    recs = load_prompts(data, cfg.data, AutoTokenizer.from_pretrained(str(student)))
    longest = max(len(r.prompt_ids) for r in recs.records)  # the plan sizes rows by data.max_prompt_tokens
    new = 48 if scale.startswith("tiny") else 64
    return [f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=megatron",
            "rollout.backend=local", f"data.train_path={data}", f"data.max_prompt_tokens={longest}",
            "data.shuffle=false", f"train.steps={STEPS}", "train.prompts_per_step=4", "rollout.n_samples_per_prompt=2",
            f"rollout.max_new_tokens={new}", "rollout.parity_check=off", "train.micro_batch_size=4",
            "algo.num_minibatches=1", "optim.lr=1e-5", "logging.tensorboard=false", "logging.progress_bar=false",
            "logging.sample_every=0", "checkpoint.save_every=100000", "checkpoint.resume=never",
            "checkpoint.export_hf=false"]


def _peak_gb(trace: Path) -> tuple[float, float]:
    """(peak live bytes during the steps window, allocator total at the profiler's start), GB."""
    events = json.loads(trace.read_text())["traceEvents"]
    window = [e for e in events if e.get("name") == "opd_steps" and e.get("ph") == "X"]
    if not window:
        raise RuntimeError(f"{trace}: no opd_steps range in the trace")
    t0, t1 = window[0]["ts"], window[0]["ts"] + window[0]["dur"]
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not mem:
        raise RuntimeError(f"{trace}: no memory events (profile_memory)")
    first = mem[0]["args"]
    baseline = first["Total Allocated"] - first["Bytes"]
    inside = [e["args"]["Total Allocated"] for e in mem if t0 <= e["ts"] <= t1]
    return (max(inside) - baseline) / 1e9, baseline / 1e9


def worker(rank: int, world: int, port: int, overrides: list[str], out: str, save: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1" if world > 1 else os.environ.get("OMP_NUM_THREADS", ""))
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from megatron_opd.config import load_config
    from megatron_opd.trainer.loop import Trainer

    if world > 1:
        torch.set_num_threads(1)
    cfg = load_config(None, overrides)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(cfg)
        try:
            with record_function("opd_steps"):
                for _ in range(STEPS):
                    trainer.train_step()
                if save:
                    trainer.save()
        finally:
            trainer.close()
    trace = Path(out) / f"trace{rank}.json"
    prof.export_chrome_trace(str(trace))
    peak, base = _peak_gb(trace)
    trace.unlink()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"measured_gb": peak, "baseline_gb": base}))


def predict(overrides: list[str], world: int, save: bool = False) -> list[dict[str, Any]]:
    """Per rank: the plan's CPU prediction over the measured window, the steps (rollout and training
    phases) and, with `save`, a checkpoint save; the startup phase is before the window. The rollout
    engine lives on rank 0 only."""
    from megatron_opd.config import load_config
    from megatron_opd.plan import GPUS, Cluster, Component, RankPlan, arch_from, dtype_bytes, plan_run

    cfg = load_config(None, overrides)
    student, teacher = arch_from(cfg.model.hf_path, "model"), arch_from(cfg.teacher.hf_path, "teacher")
    plan = plan_run(cfg, Cluster(GPUS["h100-80gb"], trainer=world), student, teacher, device="cpu")
    pp = cfg.parallel.pipeline_model_parallel_size
    phases = ("rollout", "training", "save") if save else ("rollout", "training")
    # The local engine's own copy (TP/PP > 1) is transformers' from_pretrained of the checkpoint: in the
    # checkpoint's dtype its tensors are a private mapping of the safetensors file, not the CPU allocator's,
    # so the profiler never sees them (the weight syncs make them private pages: resident, in RSS).
    engine_e = dtype_bytes(cfg.rollout.dtype if cfg.rollout.dtype != "auto" else cfg.model.params_dtype, gpu=False)
    mmapped = {"rollout engine (local, own copy)"} if engine_e == student.ckpt_bytes else set()
    out = []
    for rank in range(world):
        stage = 0 if pp == 1 else (0 if rank < world // pp else 1)  # megatron's rank order: TP, then DP... PP last
        r = plan["ranks"][stage]
        rp = RankPlan(r["role"], [Component(**c) for c in r["components"]])
        gb, phase = rp.peak(phases, rank0=rank == 0)
        comps = [c for c in rp.components if c.phase in ("", phase) and (rank == 0 or not c.rank0)]
        unseen = sum(c.gb for c in comps if c.name in mmapped)
        out.append({"rank": rank, "role": r["role"], "predicted_gb": gb - unseen, "phase": phase,
                    "not_allocated_gb": round(unseen, 4), "components": {c.name: round(c.gb, 4) for c in comps}})
    return out


def run_config(name: str, work: Path, timeout: float) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    scale, world, extra = CONFIGS[name]
    save = SAVE in extra
    extra = [e for e in extra if e != SAVE]
    overrides = setting(scale, work / scale) + extra + [f"logging.out_dir={work / 'runs' / name}"]
    out = work / "results" / name
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, overrides, str(out), save)) for r in range(world)]
    t = time.time()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=max(1.0, timeout - (time.time() - t)))
        if p.is_alive():
            p.terminate()
            raise RuntimeError(f"{name}: rank timed out after {timeout:.0f} s")
        if p.exitcode != 0:
            raise RuntimeError(f"{name}: a rank exited with {p.exitcode}")
    rows = predict(overrides, world, save)
    for row in rows:
        m = json.loads((out / f"rank{row['rank']}.json").read_text())
        row.update(config=name, measured_gb=m["measured_gb"], error=row["predicted_gb"] / m["measured_gb"] - 1)
    print(f"[bench_plan] {name}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| config | rank | predicted | measured | error |", "|---|---|---|---|---|"]
    for r in rows:
        ok = "" if abs(r["error"]) <= TARGET else " (outside +-15%)"
        lines.append(f"| {r['config']} | {r['rank']} ({r['role']}) | {r['predicted_gb']:.3f} GB | "
                     f"{r['measured_gb']:.3f} GB | {r['error']:+.1%}{ok} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma list of config names (--list)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--json", default=str(REPO / "docs" / "plan_validation.json"))
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per configuration")
    a = ap.parse_args(argv)
    if a.list:
        print("\n".join(CONFIGS))
        return 0
    names = a.only.split(",") if a.only else list(CONFIGS)
    if not a.only:
        from megatron_opd.models.pretrained import CHUNKED_MODELS, _chunk_files

        try:
            for model in CHUNKED_MODELS:
                _chunk_files(model)
        except (ImportError, FileNotFoundError) as exc:  # said, not silent: the row needs the packages
            names = [n for n in names if CONFIGS[n][0] != "qwen"]
            print(f"[bench_plan] leaving out the qwen rows: {exc}", file=sys.stderr)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--only: unknown {unknown} (--list)")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_plan_") as tmp:
        for name in names:
            rows += run_config(name, Path(tmp), a.timeout)
    print(table(rows))
    Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r for r in rows if abs(r["error"]) > TARGET]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} rows within +-{TARGET:.0%}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
