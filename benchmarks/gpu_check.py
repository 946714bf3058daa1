"""GPU readiness check: the megatron backend and the real Trainer on one device, with a JSON report.

Run through `benchmarks/gpu_check.sh` (which installs the carried megatron-core wheel on a GPU box
first); `--size tiny --device cpu` is the same code at toy size on a CPU (CI runs it, so it cannot rot).

What it does, each heavy part in its own subprocess (a crash or hang in one still leaves a report):
  1. environment: python / torch / megatron-core / transformers versions, the device, on CUDA a bf16
     matmul probe (what the card sustains here, beside the nominal peak the MFU uses);
  2. random Qwen2-shaped HF models (student seed 0, teacher seed 1; ~0.5B at `--size 0.5b`: hidden
     1024, 24 layers, 16 heads, 2 KV heads, FFN 2816, vocabulary 151936) with the byte tokenizer, and
     the builtin arithmetic prompts;
  3. `model` worker: megatron-core GPTModel forward + backward on random tokens, timed: the backend
     alone (NCCL/gloo world of one, the model dtype), independent of the trainer; on CUDA again with FP8;
  4. `ckpt` worker: the student converted to torch_dist on the CPU (local spec, CUDA hidden), loaded into
     the model this device builds, logits against HF (a CPU-written checkpoint must load into TE);
  5. one worker per preset (default stable_opd, then opd): the real `Trainer` (megatron student,
     reference and teacher, local rollout engine, weight sync), `--warmup` untimed steps then
     `--steps` timed ones, each step's metrics appended to a JSONL file as it finishes; on CUDA the first
     preset again with FP8.

Every phase builds what a user's run builds on this device: `--layer-spec auto` is Transformer Engine on
CUDA and the local spec on CPU (as `model.layer_spec=auto`); `--fp8 auto` is the `delayed` recipe on CUDA
and none on CPU. A phase that cannot build (no TE, FP8 unsupported) fails: nothing is skipped.
`--dry-run` prints the phases it would run (for `--device cuda` too, on a machine without one) and exits.

The report (`--out`) is rewritten after every phase: a run cut short still says how far it got.
Numbers: step time = `time/step_s`; tokens/s = trained tokens (prompt + response of every sequence,
rollouts and golden, times ppo_epochs) per second of `time/train_s`; MFU = 6 * params_for_flops *
trained tokens / train_s / peak FLOP/s, params_for_flops = all student parameters except the input
embedding table (the output layer is counted), the student's forward + backward only (train_s also
holds the reference's logits for the full-vocabulary KL, not counted: MFU is a lower bound there);
weight sync = `time/sync_s`; score_s = `time/score_s` (pi_old / teacher / reference scoring; from a
trainer without that metric, step - rollout - train - sync). The rollout engine is the trainer's own
(the factory puts the local engine on CUDA when available, in the student's dtype): its device and
dtype are recorded per preset. Peak memory: torch.cuda.max_memory_allocated on CUDA (and the host VmHWM everywhere).

    python benchmarks/gpu_check.py --size tiny --device cpu --out /tmp/gpu_check.json
    python benchmarks/gpu_check.py --device cuda --dry-run      # the phases, as JSON
    python benchmarks/gpu_check.py --size 0.5b --device cuda --out $OUT/gpu_check.json --time-limit 460
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, proc_status_kb, step_overrides  # noqa: E402 - the scripts' shared helpers
T0 = float(os.environ.get("GPU_CHECK_T0") or time.time())  # workers count from the orchestrator's start

# Nominal dense bf16 peak FLOP/s by device name (first match wins). H200 and H100 SXM: 989 TFLOP/s.
PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12))

SIZES: dict[str, dict[str, Any]] = {
    # model dims (Qwen2-shaped, untied embeddings) and run defaults per size
    "tiny": dict(model=dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=2048, vocab_size=None),
                 prompts_per_step=2, samples_per_prompt=2, max_new_tokens=8, micro_batch_size=4,
                 warmup=1, steps=2, model_batch=2, model_seq=64),
    "0.5b": dict(model=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                            num_key_value_heads=2, max_position_embeddings=4096, vocab_size=151936),
                 prompts_per_step=16, samples_per_prompt=4, max_new_tokens=256, micro_batch_size=8,
                 warmup=1, steps=3, model_batch=8, model_seq=1024),
}
# Metrics copied from each trainer step into the report (when present).
STEP_KEYS = ("time/step_s", "time/rollout_s", "time/score_s", "time/train_s", "time/sync_s", "loss/total_loss",
             "loss/pg_loss", "loss/kl", "loss/golden_loss", "loss/update_skipped", "rollout/response_len_mean",
             "rollout/truncation_rate", "rollout/num_samples", "rollout/num_golden", "logp/student_mean",
             "logp/teacher_mean", "rollout/engine_trainer_logp_absdiff")


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {msg}", flush=True)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _mib(n: Optional[float]) -> Optional[float]:
    return None if n is None else round(n / 2**20, 1)


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _version(dist: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _on_sigterm(signum: int, _frame: Any) -> None:  # `timeout` sends TERM: unwind so finally blocks write
    raise KeyboardInterrupt(f"signal {signum}")


# ------------------------------------------------------------------------------------------ setup

def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "megatron_core": _version("megatron-core"), "transformers": _version("transformers"),
        "host": platform.node(), "cpu_count": os.cpu_count(), "device": device,
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, device_count=torch.cuda.device_count(),
                   device_memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=getattr(props, "multi_processor_count", None))
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001 - informational only
            env["nccl"] = f"unknown ({type(e).__name__}: {e})"
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def matmul_probe(n: int = 8192, iters: int = 10) -> float:
    """Sustained bf16 TFLOP/s of an n x n x n matmul on this GPU (mean of `iters` after 3 warm-ups)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / iters
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / dt / 1e12


def make_models(root: Path, size: str) -> dict[str, Any]:
    """Student (seed 0) and teacher (seed 1) HF directories with the byte tokenizer; reused if present."""
    from megatron_opd.data.toy_tokenizer import byte_tokenizer
    from megatron_opd.models.tiny import make_tiny_hf_model

    tok = byte_tokenizer()
    dims = dict(SIZES[size]["model"])
    # The byte tokenizer has 259 ids; a larger model vocabulary (0.5b: Qwen2.5's 151936, so the logits
    # cost what they cost at that scale) only adds ids the model can sample and the tokenizer decodes to "".
    dims["vocab_size"] = dims["vocab_size"] or len(tok)
    out = {}
    for name, seed in (("student", 0), ("teacher", 1)):
        d = root / f"{size}-{name}"
        if not (d / "config.json").is_file() or not list(d.glob("*.safetensors")):
            log(f"building random {size} {name} (seed {seed}) in {d}")
            make_tiny_hf_model("qwen2", d, seed=seed, eos_token_id=2, pad_token_id=0, bos_token_id=1, **dims)  # freed
            tok.save_pretrained(str(d))
            gc = d / "generation_config.json"
            g = json.loads(gc.read_text()) if gc.is_file() else {}
            g["eos_token_id"] = 2
            gc.write_text(json.dumps(g))
        out[name] = d
    return out


def count_params(hf_dir: Path) -> dict[str, int]:
    """Parameter counts from the safetensors headers: total, input embedding, and those that cost FLOPs."""
    from safetensors import safe_open

    total = emb = 0
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = math.prod(st.get_slice(k).get_shape())
                total += n
                if k.endswith("embed_tokens.weight"):
                    emb += n
    cfg = json.loads((hf_dir / "config.json").read_text())
    if cfg.get("tie_word_embeddings"):  # the tied table is also the output layer: it costs FLOPs
        emb = 0
    return {"params_total": total, "params_input_embedding": emb, "params_for_flops": total - emb}


def peak_flops(device: str, env: dict[str, Any], override_tflops: Optional[float]) -> tuple[Optional[float], str]:
    if override_tflops:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops}"
    if device != "cuda":
        return None, "none: MFU is reported for CUDA devices only"
    name = str(env.get("device_name", ""))
    for key, val in PEAK_BF16:
        if key in name:
            return val, f"nominal dense bf16 peak of {key} ({val / 1e12:.0f} TFLOP/s)"
    return None, f"unknown device {name!r}: pass --peak-tflops"


# ---------------------------------------------------------------------------------------- workers

def _worker_env(device: str) -> None:
    """Single-process world for init_parallel (no torchrun): rank 0 of 1 on a free local port."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: the CPU path even on a GPU box


def _check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
    if device == "cpu" and torch.cuda.is_available():
        raise RuntimeError("--device cpu but CUDA is visible (CUDA_VISIBLE_DEVICES was not honoured)")


def _memory(device: str) -> dict[str, Any]:
    import torch

    hwm = proc_status_kb("VmHWM")
    out: dict[str, Any] = {"host_peak_rss_mib": _mib(hwm * 1024) if hwm is not None else None}
    if device == "cuda":
        out["cuda_max_allocated_mib"] = _mib(torch.cuda.max_memory_allocated())
        out["cuda_max_reserved_mib"] = _mib(torch.cuda.max_memory_reserved())
    return out


class _Events:
    """Worker -> orchestrator: one JSON object per line, flushed at once (survives a kill)."""

    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)

    def __call__(self, **event: Any) -> None:
        self.f.write(json.dumps(event, default=str) + "\n")
        self.f.flush()


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The phases in order, each {name, worker, layer_spec, dtype, fp8[, preset]}: what --dry-run prints."""
    common = {"layer_spec": args.layer_spec, "dtype": args.dtype}
    phases: list[dict[str, Any]] = []
    if not args.no_model_check:
        phases.append({"name": "model", "worker": "model", **common, "fp8": None})
        if args.fp8:
            phases.append({"name": f"model-fp8-{args.fp8}", "worker": "model", **common, "fp8": args.fp8})
    if not args.no_packed_check:
        phases.append({"name": "packed", "worker": "packed", **common, "fp8": None})
    if not args.no_ckpt_check:
        phases.append({"name": "ckpt", "worker": "ckpt", "layer_spec": args.layer_spec, "dtype": "float32",
                       "fp8": None, "written_by": "cpu, local spec (megatron-opd convert hf-to-mcore)"})
    for preset in args.presets:
        phases.append({"name": preset, "worker": "preset", "preset": preset, **common, "fp8": None})
    if args.fp8 and args.presets:
        phases.append({"name": f"{args.presets[0]}-fp8-{args.fp8}", "worker": "preset", "preset": args.presets[0],
                       **common, "fp8": args.fp8})
    return phases


def worker_ckpt(args: argparse.Namespace, ev: _Events) -> None:
    """The student written to torch_dist on the CPU (local spec), loaded into this device's model, vs HF."""
    from megatron_opd.convert.checkpoint import verify_checkpoint

    _check_device(args.device)
    ckpt = Path(args.workdir) / "ckpt-cpu-written"
    t = time.time()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, "-m", "megatron_opd.cli", "convert", "hf-to-mcore", "--hf", args.student,
                          "--out", str(ckpt), "--tp", "1", "--pp", "1", "--overwrite"],
                         env=env, cwd=str(REPO), capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"CPU conversion failed (exit {res.returncode}): {(res.stdout + res.stderr)[-2000:]}")
    ev(event="written", write_s=time.time() - t, ckpt=str(ckpt))
    t = time.time()
    report = verify_checkpoint(args.student, ckpt, dtype="float32",
                               backend="nccl" if args.device == "cuda" else "gloo", layer_spec=args.layer_spec)
    ev(event="loaded", load_verify_s=time.time() - t, **report)
    log(f"ckpt: CPU-written checkpoint into the {args.layer_spec} model: max |logit diff| "
        f"{report['max_abs_logit_diff']:.3g} (tol {report['tol']:g})")
    if not report["ok"]:
        raise RuntimeError(f"the CPU-written checkpoint loads into the {args.layer_spec} model with logits "
                           f"{report['max_abs_logit_diff']:.3g} from HF's (tol {report['tol']:g})")
    ev(event="done", memory=_memory(args.device))


# max |log-prob diff| between a row scored alone and inside a packed sequence: fp32 agrees to rounding;
# bf16 differs by the order of its reductions (the packed row's GEMMs and attention tile differently)
PACKED_TOL = {"float32": 1e-3, "bfloat16": 0.1}


def worker_packed(args: argparse.Namespace, ev: _Events) -> None:
    """Rows of different lengths packed into one sequence (THD `PackedSeqParams` on TE, the block-diagonal
    mask on the local spec: `train.pack_sequences`) get the log-probs they get alone."""
    import torch
    from transformers import AutoConfig

    from megatron_opd.models.gpt import build_forward_only_model, resolve_layer_spec
    from megatron_opd.models.logprobs import forward_logits
    from megatron_opd.models.packing import packed_inputs
    from megatron_opd.models.parallel import destroy_parallel, init_parallel

    _check_device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    init_parallel(1, 1, "nccl" if args.device == "cuda" else "gloo", seed=1234)
    hf_config = AutoConfig.from_pretrained(args.student)
    model = build_forward_only_model(hf_config, layer_spec=args.layer_spec, params_dtype=dtype)
    dev = next(model.parameters()).device
    thd = resolve_layer_spec(args.layer_spec) == "te"
    vocab = int(hf_config.vocab_size)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, vocab, (n,), generator=g) for n in (37, 120, 64, 5, 200)]
    with torch.no_grad():
        alone = [torch.log_softmax(forward_logits(model, r[None].to(dev)).float()[0, :, :vocab], -1) for r in rows]
        ids = torch.cat(rows)[None].to(dev)
        seg = torch.cat([torch.full((len(r),), i) for i, r in enumerate(rows)])[None].to(dev)
        pos = torch.cat([torch.arange(len(r)) for r in rows])[None].to(dev)
        extra = packed_inputs(seg, thd)
        packed = torch.log_softmax(forward_logits(model, ids, pos, extra.get("attention_mask"),
                                                  extra.get("packed_seq_params")).float()[0, :, :vocab], -1)
    diff, at = 0.0, 0
    for r, lp in zip(rows, alone):
        diff = max(diff, float((packed[at:at + len(r)] - lp).abs().max()))
        at += len(r)
    tol = PACKED_TOL[args.dtype]
    ev(event="packed", format="thd" if thd else "mask", rows=[len(r) for r in rows], max_abs_logp_diff=diff, tol=tol,
       ok=diff <= tol)
    log(f"packed ({'THD' if thd else 'block mask'}): max |log-prob diff| vs alone {diff:.3g} (tol {tol:g})")
    if diff > tol:
        raise RuntimeError(f"packed rows score {diff:.3g} away from the same rows alone (tol {tol:g})")
    ev(event="done", memory=_memory(args.device))
    del model
    destroy_parallel()


def worker_model(args: argparse.Namespace, ev: _Events) -> None:
    """megatron-core GPTModel forward + backward on random tokens: the backend alone."""
    import torch

    from megatron_opd.models.gpt import build_gpt_model
    from megatron_opd.models.logprobs import forward_logits
    from megatron_opd.models.parallel import destroy_parallel, init_parallel
    from transformers import AutoConfig

    _check_device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    init_parallel(1, 1, "nccl" if args.device == "cuda" else "gloo", seed=1234)
    hf_config = AutoConfig.from_pretrained(args.student)
    t = time.time()
    model = build_gpt_model(hf_config, layer_spec=args.layer_spec, params_dtype=dtype, fp8=args.fp8)
    dev = next(model.parameters()).device
    ev(event="built", build_s=time.time() - t, layer_spec=args.layer_spec, fp8=args.fp8, param_device=str(dev),
       param_dtype=str(next(model.parameters()).dtype),
       megatron_params=sum(p.numel() for p in model.parameters()))
    log(f"model: GPTModel built on {dev} in {time.time() - t:.1f}s")
    b, s, vocab = args.model_batch, args.model_seq, int(hf_config.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (b, s + 1), generator=g).to(dev)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(s, device=dev).expand(b, s)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        model.zero_grad(set_to_none=True)
        sync()
        t = time.perf_counter()
        logits = forward_logits(model, inputs, pos)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1])[:, :vocab],
                                                 targets.reshape(-1))
        loss.backward()
        sync()
        dt = time.perf_counter() - t
        del logits
        value = loss.item()
        del loss
        losses.append(value)
        if i >= args.warmup:
            times.append(dt)
        ev(event="iter", i=i, warmup=i < args.warmup, fwd_bwd_s=dt, loss=value)
        log(f"model: iter {i} ({'warm-up' if i < args.warmup else 'timed'}) fwd+bwd {dt:.3f}s loss {value:.4f}")
    ev(event="done", tokens_per_iter=b * s, fwd_bwd_s=times, losses=losses, memory=_memory(args.device))
    del model
    destroy_parallel()


def preset_overrides(args: argparse.Namespace) -> list[str]:
    """The trainer config of a preset worker: the step benchmark's work at this phase's spec, dtype and FP8."""
    run_dir = Path(args.workdir) / f"run-{args.preset}{'-fp8' if args.fp8 else ''}"
    return [
        *step_overrides(args.preset, args.student, args.teacher, args.data, run_dir, steps=args.warmup + args.steps,
                        prompts=args.prompts_per_step, samples=args.samples_per_prompt,
                        new_tokens=args.max_new_tokens, micro_batch_size=args.micro_batch_size),
        f"model.layer_spec={args.layer_spec}", f"model.params_dtype={args.dtype}",
        *([f"model.fp8={args.fp8}"] if args.fp8 else []),
        f"parallel.backend={'nccl' if args.device == 'cuda' else 'gloo'}", *args.override,
    ]


def plan_tensors_gb(cfg: Any, device: str) -> dict[str, Any]:
    """`megatron-opd plan`'s trainer-rank tensors for this config on this device (CUDA: this GPU's memory,
    without the stated CUDA-context / NCCL constants, which the allocator's peak does not see), to print
    beside the measured peak of the steps."""
    from megatron_opd.plan import GPUS, Cluster, arch_from, gpu_from_name, plan_run

    if device == "cuda":
        import torch

        gpu = gpu_from_name(f"{torch.cuda.get_device_properties(0).total_memory / 1e9:.0f}")
    else:
        gpu = GPUS["h100-80gb"]
    plan = plan_run(cfg, Cluster(gpu, trainer=1), arch_from(cfg.model.hf_path, "model"),
                    arch_from(cfg.teacher.hf_path, "teacher"), device="cpu" if device != "cuda" else "cuda")
    comps = plan["ranks"][0]["components"]
    return {"predicted_gb": sum(c["gb"] for c in comps if c["name"] != "CUDA context + NCCL"),
            "components": {c["name"]: round(c["gb"], 4) for c in comps}}


def worker_preset(args: argparse.Namespace, ev: _Events) -> None:
    """The real Trainer for one preset: warm-up + timed `train_step`s, each step's metrics as an event."""
    import torch

    from megatron_opd.config import load_config
    from megatron_opd.models.parallel import destroy_parallel
    from megatron_opd.trainer.loop import Trainer

    _check_device(args.device)
    steps = args.warmup + args.steps
    overrides = preset_overrides(args)
    cfg = load_config(None, overrides)
    ev(event="config", overrides=overrides, beta_kl=cfg.algo.beta_kl, lambda_gold=cfg.algo.lambda_gold,
       mixture_ratio=cfg.algo.mixture_ratio, kl_estimator=cfg.algo.kl_estimator, ppo_epochs=cfg.algo.ppo_epochs)
    ev(event="plan", **plan_tensors_gb(cfg, args.device))
    t = time.time()
    trainer = Trainer(cfg)
    init_s = time.time() - t
    # the factory builds the local engine on CUDA when available, in the student's dtype (rollout/__init__.py)
    engine = trainer.engine
    engine_model = getattr(engine, "model", None)
    engine_info = {"engine": type(engine).__name__, "device": str(getattr(engine, "_device", None)),
                   "dtype": str(getattr(engine_model, "dtype", None)), "student_dtype": str(trainer.student.dtype),
                   "num_threads": getattr(engine, "num_threads", None)}
    ev(event="init", init_s=init_s, rollout_engine=engine_info, memory=_memory(args.device))
    log(f"{args.preset}: Trainer built in {init_s:.1f}s; rollout engine {engine_info}")
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        for i in range(steps):
            m = trainer.train_step()
            payload = getattr(trainer, "_last_payload", None) or {}
            items = payload.get("items") or []
            resp = sum(len(it.response_ids) for it in items)
            tokens = sum(len(it.prompt_ids) + len(it.response_ids) for it in items) * cfg.algo.ppo_epochs
            rec = {k: float(m[k]) for k in STEP_KEYS if k in m and isinstance(m[k], (int, float))}
            score = rec.get("time/score_s")
            if score is None:  # a trainer without the metric: what the other timers leave of the step
                parts = [rec.get(k) for k in ("time/step_s", "time/rollout_s", "time/train_s", "time/sync_s")]
                score = parts[0] - sum(parts[1:]) if all(_finite(x) for x in parts) else None
            ev(event="step", i=i, warmup=i < args.warmup, metrics=rec, score_s=score, sequences=len(items),
               golden=sum(bool(it.is_golden) for it in items), trained_tokens=tokens, response_tokens=resp,
               memory=_memory(args.device))
            nan = float("nan")
            tm = {k: rec.get(f"time/{k}_s", nan) for k in ("step", "rollout", "train", "sync")}
            log(f"{args.preset}: step {i} ({'warm-up' if i < args.warmup else 'timed'}) {tm['step']:.2f}s "
                f"(rollout {tm['rollout']:.2f}, score {score if score is not None else nan:.2f}, "
                f"train {tm['train']:.2f}, sync {tm['sync']:.2f}) {len(items)} seqs {tokens} tokens "
                f"loss {rec.get('loss/total_loss', nan):.4f}")
    finally:
        trainer.close()
    ev(event="done", memory=_memory(args.device))
    destroy_parallel()


def run_worker(args: argparse.Namespace) -> int:
    ev = _Events(Path(args.events))
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        {"model": worker_model, "ckpt": worker_ckpt, "preset": worker_preset, "packed": worker_packed}[args.worker](args, ev)
        return 0
    except BaseException as e:  # noqa: BLE001 - the orchestrator needs every failure, KeyboardInterrupt too
        ev(event="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        traceback.print_exc()
        return 1


# ----------------------------------------------------------------------------------- orchestrator

def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by a kill
            pass
    return out


def worker_cmd(args: argparse.Namespace, phase: dict[str, Any], events: Path, models: dict[str, Path],
               data: Path) -> list[str]:
    """The command line of one phase's worker process."""
    preset = phase.get("preset")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", phase["worker"], "--events", str(events),
           "--device", args.device, "--dtype", phase["dtype"], "--workdir", str(args.workdir),
           "--layer-spec", phase["layer_spec"], "--fp8", phase["fp8"] or "none",
           "--student", str(models["student"]), "--teacher", str(models["teacher"]), "--data", str(data),
           "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--prompts-per-step", str(args.prompts_per_step), "--samples-per-prompt", str(args.samples_per_prompt),
           "--max-new-tokens", str(args.max_new_tokens), "--micro-batch-size", str(args.micro_batch_size),
           "--model-batch", str(args.model_batch), "--model-seq", str(args.model_seq),
           "--threads", str(args.threads or 0)]
    if preset:
        cmd += ["--preset", preset]
    for o in args.override:
        cmd += ["--override", o]
    return cmd


def _spawn(args: argparse.Namespace, phase: dict[str, Any], timeout: float,
           models: dict[str, Path], data: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    name = phase["name"]
    events = Path(args.workdir) / f"{name}.events.jsonl"
    events.unlink(missing_ok=True)
    cmd = worker_cmd(args, phase, events, models, data)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPU_CHECK_T0": repr(T0)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    log(f"{name}: starting (time limit {timeout:.0f}s)")
    t = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=str(REPO))
    status = "ok"
    try:
        rc = proc.wait(timeout=max(timeout, 1.0))
        if rc != 0:
            status = f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {timeout:.0f}s"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    evs = _read_events(events)
    err = next((e for e in evs if e.get("event") == "error"), None)
    if err and status == "ok":
        status = "failed"
    if status == "ok" and not any(e.get("event") == "done" for e in evs):
        status = "failed (no done event)"
    log(f"{name}: {status} in {time.time() - t:.1f}s")
    info = {"status": status, "wall_s": round(time.time() - t, 2)}
    if err:
        info["error"] = err.get("error")
        info["traceback"] = err.get("traceback", "")[-6000:]
    return evs, info


def _median(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if _finite(x)]
    return statistics.median(xs) if xs else None


def summarise_ckpt(evs: list[dict[str, Any]], info: dict[str, Any], params: dict[str, int],
                   peak: Optional[float]) -> dict[str, Any]:
    out = dict(info)
    for e in evs:
        if e.get("event") in ("written", "loaded"):
            out.update({k: v for k, v in e.items() if k != "event"})
    if out["status"] == "ok" and not out.get("ok"):
        out["status"] = "failed (logits differ)"
    return out


def summarise_packed(evs: list[dict[str, Any]], info: dict[str, Any], params: dict[str, int],
                     peak: Optional[float]) -> dict[str, Any]:
    out = dict(info)
    for e in evs:
        if e.get("event") == "packed":
            out.update({k: v for k, v in e.items() if k != "event"})
    if out["status"] == "ok" and not out.get("ok"):
        out["status"] = "failed (packed log-probs differ)"
    return out


def summarise_model(evs: list[dict[str, Any]], info: dict[str, Any], params: dict[str, int],
                    peak: Optional[float]) -> dict[str, Any]:
    out = dict(info)
    built = next((e for e in evs if e.get("event") == "built"), {})
    out.update({k: built[k] for k in ("build_s", "param_device", "param_dtype", "megatron_params") if k in built})
    iters = [e for e in evs if e.get("event") == "iter"]
    out["iters"] = [{"fwd_bwd_s": e["fwd_bwd_s"], "loss": e["loss"], "warmup": e["warmup"]} for e in iters]
    done = next((e for e in evs if e.get("event") == "done"), None)
    timed = [e["fwd_bwd_s"] for e in iters if not e["warmup"]]
    tokens = done["tokens_per_iter"] if done else None
    med = _median(timed)
    out["tokens_per_iter"] = tokens
    out["fwd_bwd_median_s"] = med
    out["tokens_per_s"] = tokens / med if tokens and med else None
    out["mfu"] = 6 * params["params_for_flops"] * tokens / med / peak if tokens and med and peak else None
    if done:
        out["memory"] = done.get("memory")
    return out


def summarise_preset(evs: list[dict[str, Any]], info: dict[str, Any], params: dict[str, int],
                     peak: Optional[float]) -> dict[str, Any]:
    out = dict(info)
    for kind in ("config", "init"):
        e = next((e for e in evs if e.get("event") == kind), None)
        if e:
            out.update({k: v for k, v in e.items() if k != "event"})
    steps = [e for e in evs if e.get("event") == "step"]
    out["steps"] = [{"step": e["i"], "warmup": e["warmup"], "step_s": e["metrics"].get("time/step_s"),
                     "rollout_s": e["metrics"].get("time/rollout_s"), "train_s": e["metrics"].get("time/train_s"),
                     "sync_s": e["metrics"].get("time/sync_s"), "score_s": e.get("score_s"),
                     "loss": e["metrics"].get("loss/total_loss"), "sequences": e["sequences"], "golden": e["golden"],
                     "trained_tokens": e["trained_tokens"], "response_tokens": e["response_tokens"],
                     "metrics": e["metrics"]} for e in steps]
    timed = [s for s in out["steps"] if not s["warmup"]]
    out["timed_steps"] = len(timed)
    out["losses"] = [s["loss"] for s in out["steps"]]
    out["losses_finite"] = bool(out["steps"]) and all(_finite(x) for x in out["losses"])
    for key in ("step_s", "rollout_s", "train_s", "sync_s", "score_s"):
        out[f"{key}_median"] = _median([s[key] for s in timed])
    train_s = sum(s["train_s"] for s in timed if _finite(s["train_s"]))
    tokens = sum(s["trained_tokens"] for s in timed if _finite(s["train_s"]))
    out["trained_tokens_timed"] = tokens
    out["tokens_per_s"] = tokens / train_s if timed and train_s > 0 else None
    out["mfu"] = 6 * params["params_for_flops"] * tokens / train_s / peak if peak and timed and train_s > 0 else None
    out["weight_sync_s"] = out["sync_s_median"]
    mems = [e["memory"] for e in evs if e.get("event") in ("init", "step", "done") and e.get("memory")]
    if mems:
        keys = {k for m in mems for k in m}
        out["memory_peak"] = {k: max((m[k] for m in mems if m.get(k) is not None), default=None) for k in sorted(keys)}
        steps_mem = [e["memory"] for e in steps if e.get("memory")]
        if steps_mem and "cuda_max_allocated_mib" in steps_mem[-1]:
            out["memory_peak"]["cuda_max_allocated_steps_mib"] = max(m["cuda_max_allocated_mib"] for m in steps_mem)
    plan = next((e for e in evs if e.get("event") == "plan"), None)
    if plan:
        peak_mib = out.get("memory_peak", {}).get("cuda_max_allocated_steps_mib")
        out["plan"] = {"predicted_gb": plan["predicted_gb"], "components": plan["components"],
                       "measured_gb": peak_mib / 1024 if peak_mib else None}
    if out["status"] == "ok" and (out["timed_steps"] < 1 or not out["losses_finite"]):
        out["status"] = "failed (no timed step)" if out["timed_steps"] < 1 else "failed (non-finite loss)"
    return out


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The numbers the issue asks for, per phase, in one small block (also printed at the end)."""
    env, model = report.get("environment", {}), report.get("model", {})
    out: dict[str, Any] = {"status": report.get("status"), "device": env.get("device_name"),
                           "torch": env.get("torch"), "megatron_core": env.get("megatron_core"),
                           "dtype": report["args"].get("dtype"), "params_total": model.get("params_total"),
                           "params_for_flops": model.get("params_for_flops"),
                           "mfu_peak": report.get("mfu_peak_source"),
                           "matmul_bf16_tflops": env.get("matmul_bf16_tflops")}

    def r(x: Any, n: int = 4) -> Any:
        return round(x, n) if _finite(x) else x

    kinds = {p["name"]: p["worker"] for p in report.get("plan", [])}
    for name, ph in report.get("phases", {}).items():
        if kinds.get(name) == "packed":
            out[name] = {k: ph.get(k) for k in ("status", "format", "max_abs_logp_diff", "tol", "error")
                         if ph.get(k) is not None}
            continue
        if kinds.get(name) == "ckpt":
            out[name] = {k: ph.get(k) for k in ("status", "layer_spec", "max_abs_logit_diff", "argmax_agreement",
                                                "tol", "error") if ph.get(k) is not None}
            continue
        if kinds.get(name, "model" if name == "model" else "preset") == "model":
            out["model_fwd_bwd" if name == "model" else name] = {
                                    "status": ph.get("status"), "median_s": r(ph.get("fwd_bwd_median_s")),
                                    "tokens_per_s": r(ph.get("tokens_per_s"), 1), "mfu": r(ph.get("mfu")),
                                    "memory": ph.get("memory")}
            continue
        out[name] = {"status": ph.get("status"), "step_s": [r(s["step_s"]) for s in ph.get("steps", [])],
                     "step_s_median": r(ph.get("step_s_median")), "rollout_s_median": r(ph.get("rollout_s_median")),
                     "train_s_median": r(ph.get("train_s_median")), "score_s_median": r(ph.get("score_s_median")),
                     "weight_sync_s": r(ph.get("weight_sync_s")), "tokens_per_s": r(ph.get("tokens_per_s"), 1),
                     "mfu": r(ph.get("mfu")), "losses": [r(x) for x in ph.get("losses", [])],
                     "memory_peak": ph.get("memory_peak"), "rollout_engine": ph.get("rollout_engine"),
                     "plan_vs_measured_gb": [r(ph.get("plan", {}).get("predicted_gb"), 3),
                                             r(ph.get("plan", {}).get("measured_gb"), 3)]}
        if ph.get("error"):
            out[name]["error"] = ph["error"]
    return out


def resolve_device_defaults(args: argparse.Namespace, cuda_available: bool) -> None:
    """device/dtype/layer_spec/fp8 "auto" -> what a user's run gets on this device (model.layer_spec=auto)."""
    if args.device == "auto":
        args.device = "cuda" if cuda_available else "cpu"
    cuda = args.device == "cuda"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cuda else "float32"
    if args.layer_spec == "auto":
        args.layer_spec = "te" if cuda else "local"
    if args.fp8 == "auto":
        args.fp8 = "delayed" if cuda else None
    if args.fp8 and args.layer_spec != "te":
        raise SystemExit(f"gpu_check: --fp8 {args.fp8} needs the Transformer Engine layer spec (--layer-spec te, "
                         "on CUDA)")


def orchestrate(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    deadline = T0 + args.time_limit
    out_path = Path(args.out)
    worker_only = ("worker", "events", "preset", "student", "teacher", "data")
    report: dict[str, Any] = {"status": "running",
                              "args": {k: v for k, v in vars(args).items() if k not in worker_only},
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "phases": {}}

    def save(status: Optional[str] = None) -> None:
        if status:
            report["status"] = status
        report["elapsed_s"] = round(time.time() - T0, 1)
        _write_json(out_path, report)

    try:
        if args.device == "cpu":
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        import torch

        resolve_device_defaults(args, torch.cuda.is_available())
        report["args"].update(device=args.device, dtype=args.dtype, layer_spec=args.layer_spec, fp8=args.fp8)
        _check_device(args.device)
        env = environment(args.device)
        report["environment"] = env
        log(f"environment: {json.dumps(env)}")
        if args.device == "cuda" and not args.no_matmul_probe:
            try:
                env["matmul_bf16_tflops"] = round(matmul_probe(), 1)
                log(f"bf16 8192^3 matmul: {env['matmul_bf16_tflops']} TFLOP/s")
            except Exception as e:  # noqa: BLE001 - a probe, not the check
                env["matmul_bf16_tflops"] = f"failed ({type(e).__name__}: {e})"
        peak, peak_src = peak_flops(args.device, env, args.peak_tflops)
        report["mfu_peak_flops"], report["mfu_peak_source"] = peak, peak_src
        save()

        t = time.time()
        models = make_models(Path(args.workdir) / "models", args.size)
        from megatron_opd.data.builtin.arithmetic import write_builtin_jsonl

        data = write_builtin_jsonl(Path(args.workdir) / "data", n_train=200, n_eval=4)["train"]
        params = count_params(models["student"])
        report["model"] = {"size": args.size, "family": "qwen2", **SIZES[args.size]["model"],
                           "vocab_size": json.loads((models["student"] / "config.json").read_text())["vocab_size"],
                           **params, "student": str(models["student"]), "teacher": str(models["teacher"]),
                           "prepare_s": round(time.time() - t, 1)}
        log(f"models ready in {time.time() - t:.1f}s: {params}")
        save()

        jobs = plan(args)
        report["plan"] = jobs
        for j, phase in enumerate(jobs):
            left = deadline - time.time() - 10
            if left < 20:
                report["phases"][phase["name"]] = {"status": "not run (time limit)"}
                log(f"not running {phase['name']}: {left:.0f}s left")
                continue
            timeout = left / (len(jobs) - j)  # an equal share of what is left; unused time passes on
            evs, info = _spawn(args, phase, timeout, models, data)
            summarise = {"model": summarise_model, "ckpt": summarise_ckpt, "preset": summarise_preset,
                         "packed": summarise_packed}[phase["worker"]]
            report["phases"][phase["name"]] = {**summarise(evs, info, params, peak),
                                               "layer_spec": phase["layer_spec"], "fp8": phase["fp8"]}
            save()
        bad = [k for k, v in report["phases"].items() if v.get("status") != "ok"]
        report["status"] = "ok" if not bad else f"failed: {', '.join(bad)}"
        report["summary"] = summary(report)
        save()
        print(json.dumps(report["summary"], indent=1), flush=True)
        log(f"report: {out_path} (status {report['status']})")
        return 0 if not bad else 1
    except BaseException as e:  # noqa: BLE001 - write what we have, whatever stopped us
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()[-6000:]
        report["status"] = "failed: " + report["error"]
        try:
            report["summary"] = summary(report)
        except Exception:  # noqa: BLE001 - the error above is what matters
            pass
        save("failed: " + report["error"])
        log(f"failed: {report['error']}; report: {out_path}")
        traceback.print_exc()
        return 1


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="model.params_dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--presets", default="stable_opd,opd", help="comma-separated algo.preset values, run in turn")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default per size)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default per size)")
    ap.add_argument("--prompts-per-step", type=int, default=None)
    ap.add_argument("--samples-per-prompt", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--micro-batch-size", type=int, default=None)
    ap.add_argument("--model-batch", type=int, default=None, help="model check: sequences per forward/backward")
    ap.add_argument("--model-seq", type=int, default=None, help="model check: tokens per sequence")
    ap.add_argument("--no-model-check", action="store_true", help="skip the GPTModel-only forward/backward timing")
    ap.add_argument("--no-ckpt-check", action="store_true", help="skip loading a CPU-written checkpoint")
    ap.add_argument("--no-packed-check", action="store_true", help="skip packed-vs-alone log-probs")
    ap.add_argument("--layer-spec", choices=["auto", "local", "te"], default="auto",
                    help="model.layer_spec of every phase (auto: Transformer Engine on CUDA, local on CPU)")
    ap.add_argument("--fp8", default="auto",
                    help="FP8 recipe of the extra FP8 phases (auto: delayed on CUDA, none on CPU; none: no FP8 phase)")
    ap.add_argument("--dry-run", action="store_true", help="print the phases this would run (JSON) and exit")
    ap.add_argument("--no-matmul-probe", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s for MFU (default: by device name)")
    ap.add_argument("--override", action="append", default=[], help="extra dotted config override (repeatable)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in workers (0: torch's default)")
    ap.add_argument("--time-limit", type=float, default=460.0, help="seconds for the whole check")
    ap.add_argument("--out", default=None, help="report path (default: $OUT/gpu_check.json, else ./gpu_check.json)")
    ap.add_argument("--workdir", default=None, help="models, data, runs (default: a fresh temp dir)")
    # worker-only
    ap.add_argument("--worker", choices=["model", "ckpt", "preset", "packed"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--events", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--preset", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--student", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--teacher", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    args.fp8 = None if args.fp8 == "none" else args.fp8
    if args.worker:
        _worker_env(args.device)
        sys.path.insert(0, str(REPO))
        return run_worker(args)

    for key, val in SIZES[args.size].items():
        if key != "model" and getattr(args, key, None) is None:
            setattr(args, key, val)
    args.presets = [p for p in args.presets.split(",") if p]
    if args.dry_run:
        resolve_device_defaults(args, cuda_available=args.device == "cuda")
        print(json.dumps({"device": args.device, "dtype": args.dtype, "phases": plan(args)}, indent=1))
        return 0
    if args.out is None:
        args.out = str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"
    if args.workdir is None:
        args.workdir = tempfile.mkdtemp(prefix="gpu_check_")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    log(f"size {args.size}, device {args.device}, presets {args.presets}, warm-up {args.warmup} + {args.steps} "
        f"timed steps, workdir {args.workdir}, report {args.out}")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
