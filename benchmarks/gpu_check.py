"""GPU readiness check: the megatron backend and the real Trainer on one device, with a JSON report.

Run through `benchmarks/gpu_check.sh` (which installs the carried megatron-core wheel on a GPU box
first); `--size tiny --device cpu` is the same code at toy size on a CPU (CI runs it, so it cannot rot).

What it does, each heavy part in its own subprocess (a crash or hang in one still leaves a report):
  1. environment: python / torch / megatron-core / transformers versions, the device, on CUDA a bf16
     matmul probe (what the card sustains here, beside the nominal peak the MFU uses);
  2. random Qwen2-shaped HF models (student seed 0, teacher seed 1; ~0.5B at `--size 0.5b`: hidden
     1024, 24 layers, 16 heads, 2 KV heads, FFN 2816, vocabulary 151936) with the byte tokenizer, and
     the builtin arithmetic prompts;
  3. the phases (`--dry-run` lists each with what it checks and its pass criterion), in this order:
     `model` (megatron-core GPTModel forward + backward alone, timed; on CUDA again with FP8), `packed`
     (rows packed into one sequence score as alone), `ckpt` (a CPU-written torch_dist checkpoint loads into
     this device's model), `rng` (trainer/checkpoint.py's rng_state / set_rng_state through a checkpoint
     file: torch.cuda's and megatron's tracker streams draw the same again), `resume` (a trainer run saves,
     is SIGKILLed, resumes: the resumed step's metrics equal the uninterrupted run's; on CUDA with TE
     through TE's FusedAdam), `dynbatch` (dynamic batching + packing (THD on TE) vs fixed micro-batches:
     the same step's losses and grad norm), one trainer run per preset (default stable_opd, then opd;
     `--warmup` untimed steps then `--steps` timed ones; on CUDA the first preset again with FP8),
     `memplan` (no process of its own: `megatron_opd.plan`'s predicted peak against the allocator peak
     of every trainer run above) and `sglang` (when sglang is importable, on CUDA: generation, weight sync
     over update_weights_from_distributed, prefill scoring against the megatron teacher; otherwise
     "sglang: not installed, not run", which is no failure).

Every phase builds what a user's run builds on this device: `--layer-spec auto` is Transformer Engine on
CUDA and the local spec on CPU (as `model.layer_spec=auto`); `--fp8 auto` is the `delayed` recipe on CUDA
and none on CPU. A phase that cannot build (no TE, FP8 unsupported) fails: only `sglang` is optional.
`--dry-run` prints the phases it would run (for `--device cuda` too, on a machine without one) and exits.
Each phase gets a share of the time left in proportion to its `cost` (unused time passes on).

The report (`--out`) is rewritten after every phase: a run cut short still says how far it got.
Numbers: step time = `time/step_s`; tokens/s = trained tokens (prompt + response of every sequence,
rollouts and golden, times ppo_epochs) per second of `time/train_s`; MFU = 6 * params_for_flops *
trained tokens / train_s / peak FLOP/s, params_for_flops = all student parameters except the input
embedding table (the output layer is counted), the student's forward + backward only (train_s also
holds the reference's logits for the full-vocabulary KL, not counted: MFU is a lower bound there);
weight sync = `time/sync_s`; score_s = `time/score_s` (pi_old / teacher / reference scoring; from a
trainer without that metric, step - rollout - train - sync). The rollout engine is the trainer's own
(the factory puts the local engine on CUDA when available, in the student's dtype): its device and
dtype are recorded per preset. Peak memory: torch.cuda.max_memory_allocated on CUDA (and the host VmHWM
everywhere); memory in GB is 1e9 bytes, as the planner counts.

    python benchmarks/gpu_check.py --size tiny --device cpu --out /tmp/gpu_check.json
    python benchmarks/gpu_check.py --device cuda --dry-run      # the phases and their criteria, as JSON
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
    # model dims (Qwen2-shaped, untied embeddings) and run defaults per size; "check": the smaller stable_opd
    # workload of the resume and dynbatch phases (their point is equality, not throughput), token_budget being
    # dynbatch's train.max_tokens_per_microbatch (rows here are ~180 prompt tokens + the new ones: 2 per group)
    "tiny": dict(model=dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=2048, vocab_size=None),
                 prompts_per_step=2, samples_per_prompt=2, max_new_tokens=8, micro_batch_size=4,
                 warmup=1, steps=2, model_batch=2, model_seq=64,
                 check=dict(prompts=2, samples=2, new_tokens=8, micro_batch_size=4, token_budget=512)),
    "0.5b": dict(model=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                            num_key_value_heads=2, max_position_embeddings=4096, vocab_size=151936),
                 prompts_per_step=16, samples_per_prompt=4, max_new_tokens=256, micro_batch_size=8,
                 warmup=1, steps=2, model_batch=8, model_seq=1024,
                 check=dict(prompts=4, samples=2, new_tokens=64, micro_batch_size=4, token_budget=512)),
}
# Metrics copied from each trainer step into the report (when present).
STEP_KEYS = ("time/step_s", "time/rollout_s", "time/score_s", "time/train_s", "time/sync_s", "loss/total_loss",
             "loss/pg_loss", "loss/kl", "loss/golden_loss", "loss/update_skipped", "rollout/response_len_mean",
             "rollout/truncation_rate", "rollout/num_samples", "rollout/num_golden", "logp/student_mean",
             "logp/teacher_mean", "rollout/engine_trainer_logp_absdiff")

# resume: the metrics tests/test_trainer_preempt.py compares between a resumed and an uninterrupted run, and its
# tolerance (pytest.approx(rel=1e-5, abs=1e-7): |resumed - uninterrupted| <= max(rel * |uninterrupted|, abs))
RESUME_KEYS = ("rollout/response_len_mean", "loss/total_loss", "loss/pg_loss", "loss/kl", "loss/golden_loss",
               "logp/student_mean", "logp/teacher_mean", "loss/grad_norm")
RESUME_TOL = (1e-5, 1e-7)
# The killed run checkpoints after step RESUME_SAVE_AT, computes the steps up to RESUME_STEPS (the uninterrupted
# trajectory) and is SIGKILLed before its next save; the resumed run redoes those steps from the checkpoint. The first
# of them reads the restored weights and RNGs, the second also the restored Adam moments and step count (the update
# between them): TE FusedAdam keeps its step in the param groups, the state megatron's load must rebuild.
RESUME_SAVE_AT = 2
RESUME_STEPS = 4
# The resume runs' GPU kernels made run-to-run deterministic (cuBLAS workspace, TE's deterministic attention
# backward): the comparison is of the resume, not of atomics' summation order.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}

# dynbatch: the keys tests/test_trainer_e2e.py::test_micro_batches_accumulate_to_the_whole_minibatch compares, and
# (rel, abs) per dtype: fp32 as that test; bf16 rounds each GEMM's output, and the packed / regrouped rows go
# through GEMMs and attention of other shapes (other tilings, other summation orders). The bf16 pair is a stated
# bound, not a measured one: per-token noise of ~1e-2 nats averages to ~1e-3 in a step's means, while a wrong
# loss normalisation or a dropped or misplaced row moves them by far more (docs/scaling.md says what it misses).
DYN_KEYS = ("loss/total_loss", "loss/pg_loss", "loss/kl", "loss/golden_loss", "loss/grad_norm",
            "rollout/response_len_mean", "logp/teacher_mean", "logp/ref_mean")
DYN_TOL = {"float32": (1e-4, 1e-7), "bfloat16": (5e-3, 5e-3)}

# memplan: predicted / measured peak outside this band is a finding (reported, not a failure: see plan_phase_info)
MEMPLAN_BAND = (0.85, 1.15)
MEMPLAN_MIN_CONFIGS = 3
# plan components the allocator's peak (torch.cuda.max_memory_allocated) does not see
NOT_ALLOCATED = ("CUDA context + NCCL", "allocator slack")

# sglang: max |SGLang - megatron| token log-prob (both sides in the check's dtype, temperature 1)
SGLANG_TOL = {"float32": 1e-3, "bfloat16": 0.1}
SGLANG_NOT_INSTALLED = "not installed, not run"


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
    """The phases in order, each {name, worker, layer_spec, dtype, fp8[, preset], checks, criterion, cost}: what
    --dry-run prints. `cost` weighs the phase's share of the time left (a trainer init counts ~1); worker "derived"
    runs no process (it reads the other phases' numbers)."""
    common = {"layer_spec": args.layer_spec, "dtype": args.dtype}
    cuda = args.device == "cuda"
    dtype = args.dtype
    phases: list[dict[str, Any]] = []
    model_checks = ("megatron-core GPTModel forward + backward on random tokens, timed (the backend alone, "
                    f"{args.layer_spec} spec)")
    if not args.no_model_check:
        phases.append({"name": "model", "worker": "model", **common, "fp8": None, "checks": model_checks,
                       "criterion": "builds and runs every iteration (finite loss); times and memory recorded",
                       "cost": 1.0})
        if args.fp8:
            phases.append({"name": f"model-fp8-{args.fp8}", "worker": "model", **common, "fp8": args.fp8,
                           "checks": model_checks + f" under FP8 ({args.fp8} recipe)",
                           "criterion": "builds and runs every iteration under FP8", "cost": 1.0})
    if not args.no_packed_check:
        phases.append({"name": "packed", "worker": "packed", **common, "fp8": None,
                       "checks": "5 rows of different lengths packed into one sequence (THD PackedSeqParams on TE, "
                                 "the block-diagonal mask on the local spec) vs each row alone",
                       "criterion": f"max |log-prob diff| <= {PACKED_TOL[dtype]:g} ({dtype})", "cost": 1.0})
    if not args.no_ckpt_check:
        phases.append({"name": "ckpt", "worker": "ckpt", "layer_spec": args.layer_spec, "dtype": "float32",
                       "fp8": None, "written_by": "cpu, local spec (megatron-opd convert hf-to-mcore)",
                       "checks": "the student converted to torch_dist on the CPU (local spec), loaded into this "
                                 "device's model, logits against HF",
                       "criterion": "verify_checkpoint's logit tolerance (fp32)", "cost": 1.5})
    if not args.no_rng_check:
        phases.append({"name": "rng", "worker": "rng", **common, "fp8": None,
                       "checks": "trainer/checkpoint.py rng_state() written and read back by the trainer's "
                                 "CheckpointManager, set_rng_state(), the draws repeated: "
                                 + ("torch.cuda (the current device's CUDA state) and megatron's CUDA RNG tracker "
                                    "fork 'model-parallel-rng'" if cuda else
                                    "CPU stand-in: no torch.cuda; the tracker's 'model-parallel-rng' fork is "
                                    "cpu_compat's, over the CPU generator") + ", plus torch CPU, python, numpy",
                       "criterion": "every stream draws exactly the same after the restore, and differently without "
                                    "it" + ("; the state holds the CUDA state and tracker states saved on cuda"
                                           if cuda else ""), "cost": 0.5})
    if not args.no_resume_check:
        phases.append({"name": "resume", "worker": "resume", **common, "fp8": None, "preset": "stable_opd",
                       "checks": f"a stable_opd trainer run checkpoints at step {RESUME_SAVE_AT}, computes steps "
                                 f"{RESUME_SAVE_AT + 1}-{RESUME_STEPS}, is SIGKILLed; a new process resumes from the "
                                 f"checkpoint and redoes steps {RESUME_SAVE_AT + 1}-{RESUME_STEPS} (the second one "
                                 "after an optimizer step on the restored Adam state)"
                                 + (" (megatron's DistributedOptimizer over TE's FusedAdam: the KeyError 'step' "
                                    "path)" if cuda else " (torch's Adam here: no TE on CPU)"),
                       "criterion": f"both resumed steps' {', '.join(RESUME_KEYS)} equal the uninterrupted run's "
                                    f"(rel {RESUME_TOL[0]:g}, abs {RESUME_TOL[1]:g}, as tests/test_trainer_preempt.py)"
                                    + ("; with TE importable, the inner optimizer is TE's FusedAdam" if cuda else ""),
                       "cost": 2.5})
    if not args.no_dynbatch_check:
        rel, ab = DYN_TOL[dtype]
        fmt = "THD" if args.layer_spec == "te" else "block-mask"
        phases.append({"name": "dynbatch", "worker": "dynbatch", **common, "fp8": None, "preset": "stable_opd",
                       "checks": f"one stable_opd step at train.max_tokens_per_microbatch="
                                 f"{SIZES[args.size]['check']['token_budget']} + train.pack_sequences ({fmt} packing) "
                                 "vs the same step at fixed micro-batches (same rollouts)",
                       "criterion": f"{', '.join(DYN_KEYS)} within rel {rel:g} / abs {ab:g} ({dtype}); the same "
                                    "rollouts; the packed run pads nothing", "cost": 2.0})
    for preset in args.presets:
        phases.append({"name": preset, "worker": "preset", "preset": preset, **common, "fp8": None,
                       "checks": f"the real Trainer ({preset}): {args.warmup} warm-up + {args.steps} timed steps; "
                                 "step time split, tokens/s, MFU, weight sync, memory",
                       "criterion": "every step runs, at least one timed step, finite losses", "cost": 2.5})
    if args.fp8 and args.presets:
        phases.append({"name": f"{args.presets[0]}-fp8-{args.fp8}", "worker": "preset", "preset": args.presets[0],
                       **common, "fp8": args.fp8,
                       "checks": f"the {args.presets[0]} trainer run again under FP8 ({args.fp8} recipe)",
                       "criterion": "every step runs, finite losses", "cost": 2.5})
    if not args.no_memplan_check:
        lo, hi = MEMPLAN_BAND
        phases.append({"name": "memplan", "worker": "derived", **common, "fp8": None,
                       "checks": "megatron_opd.plan (plan_run on default_cluster, as `megatron-opd plan`): predicted "
                                 "peak (held + the largest phase the run went through, less the CUDA context, NCCL "
                                 "and allocator slack) vs torch.cuda.max_memory_allocated of the same run, for every "
                                 "trainer run above (presets, dynbatch's two runs, resume's killed run)",
                       "criterion": (f"at least {MEMPLAN_MIN_CONFIGS} runs measured; a ratio predicted/measured "
                                     f"outside [{lo}, {hi}] is a finding in the report, not a failure"
                                     if cuda else "CPU stand-in: the predictions only (no CUDA allocator peak)"),
                       "cost": 0.0})
    if not args.no_sglang_check:
        tol = SGLANG_TOL[dtype]
        phases.append({"name": "sglang", "worker": "sglang", **common, "fp8": None, "optional": True,
                       "runs_if": "sglang importable and --device cuda (else: 'sglang: " + SGLANG_NOT_INSTALLED
                                  + "' / GPU-only, a JSON entry, not a failure)",
                       "checks": "an SGLang server (rollout.sglang_mode=server) on the student: generation with "
                                 "behaviour log-probs; weight sync of the teacher's weights over "
                                 "update_weights_from_distributed (NCCL with a second GPU for SGLang; on one GPU "
                                 "over gloo, as NCCL refuses two ranks on one device); teacher.backend=sglang "
                                 "prefill scoring (top-3) against MegatronTeacher on the same tokens, before and "
                                 "after the sync",
                       "criterion": f"max |log-prob diff| <= {tol:g} ({dtype}) for generation, prefill and top-k "
                                    "before the sync and prefill after it; top-k ids equal in fp32 (bf16: the "
                                    "fraction reported); weight version 1 and the served scores moved away from "
                                    "the student's after the sync", "cost": 3.0})
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


def trainer_overrides(args: argparse.Namespace, preset: str, run_dir: Path, *, steps: int, prompts: int,
                      samples: int, new_tokens: int, micro_batch_size: int, fp8: Optional[str]) -> list[str]:
    """A trainer config at this phase's spec, dtype, FP8 and backend: the step benchmark's (benchmarks/_common.py)."""
    return [
        *step_overrides(preset, args.student, args.teacher, args.data, run_dir, steps=steps, prompts=prompts,
                        samples=samples, new_tokens=new_tokens, micro_batch_size=micro_batch_size),
        f"model.layer_spec={args.layer_spec}", f"model.params_dtype={args.dtype}",
        *([f"model.fp8={fp8}"] if fp8 else []),
        f"parallel.backend={'nccl' if args.device == 'cuda' else 'gloo'}",
    ]


def preset_overrides(args: argparse.Namespace) -> list[str]:
    """The trainer config of a preset worker: the step benchmark's work at this phase's spec, dtype and FP8,
    then the user's --override values."""
    run_dir = Path(args.workdir) / f"run-{args.preset}{'-fp8' if args.fp8 else ''}"
    return [*trainer_overrides(args, args.preset, run_dir, steps=args.warmup + args.steps,
                               prompts=args.prompts_per_step, samples=args.samples_per_prompt,
                               new_tokens=args.max_new_tokens, micro_batch_size=args.micro_batch_size, fp8=args.fp8),
            *args.override]


def check_overrides(args: argparse.Namespace, run_dir: Path, steps: int, *extra: str) -> list[str]:
    """The resume and dynbatch runs: stable_opd at the size's small "check" workload (no --override: the
    comparisons need exactly these settings), then `extra`."""
    c = SIZES[args.size]["check"]
    return [*trainer_overrides(args, "stable_opd", run_dir, steps=steps, prompts=c["prompts"], samples=c["samples"],
                               new_tokens=c["new_tokens"], micro_batch_size=c["micro_batch_size"], fp8=None),
            "checkpoint.export_hf=false", *extra]


def planned_peak(components: list[dict[str, Any]], phases: tuple[str, ...]) -> dict[str, Any]:
    """The planner's peak as the allocator sees it, for a run that went through `phases`: the components held
    throughout plus the largest of those phases' own (plan.py's RankPlan.peak, restricted to the phases the run
    had), less NOT_ALLOCATED (the CUDA context and NCCL buffers are not tensors; the slack is reserved, not
    allocated). A plan whose components carry no phase counts them all as held."""
    held = sum(c["gb"] for c in components if not c.get("phase") and c["name"] not in NOT_ALLOCATED)
    per_phase = {ph: sum(c["gb"] for c in components if c.get("phase") == ph) for ph in phases}
    worst = max(per_phase, key=per_phase.get, default=None)
    extra = per_phase[worst] if worst else 0.0
    return {"predicted_gb": held + extra, "held_gb": held, "worst_phase": worst if extra > 0 else None,
            "phase_gb": per_phase, "phases": list(phases),
            "not_allocated_gb": {c["name"]: c["gb"] for c in components if c["name"] in NOT_ALLOCATED},
            "components": {c["name"]: round(c["gb"], 4) for c in components}}


def memory_plan(cfg: Any, device: str, phases: tuple[str, ...]) -> dict[str, Any]:
    """`megatron-opd plan`'s prediction for this config on this device (plan.py's main: default_cluster, the
    student and teacher Arch, plan_run), one node of one GPU of this one's memory; the trainer rank's peak over
    `phases` (planned_peak). On the CPU the plan's CPU mode (device="cpu")."""
    from megatron_opd.plan import GPUS, arch_from, default_cluster, gpu_from_name, plan_run

    if device == "cuda":
        import torch

        gpu = gpu_from_name(f"{torch.cuda.get_device_properties(0).total_memory / 1e9:.0f}")
    else:
        gpu = GPUS["h100-80gb"]
    cluster = default_cluster(cfg, gpu, 1, 1, None, None)
    student = arch_from(cfg.model.hf_path, "model.hf_path")
    teacher = arch_from(cfg.teacher.hf_path, "teacher.hf_path") if cfg.teacher.hf_path else None
    p = plan_run(cfg, cluster, student, teacher, device="cuda" if device == "cuda" else "cpu")
    return {"gpu": gpu.name, **planned_peak(p["ranks"][0]["components"], phases)}


def _measured_gb(memory: Optional[dict[str, Any]]) -> Optional[float]:
    """torch.cuda.max_memory_allocated of a memory record (MiB) in GB (1e9 bytes, the planner's unit)."""
    mib = (memory or {}).get("cuda_max_allocated_mib")
    return mib * 2**20 / 1e9 if _finite(mib) else None


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _worst_excess(cmp: dict[str, Any]) -> float:
    """The largest |difference| / allowed difference of a compare_metrics result (> 1: out of tolerance)."""
    return max((v.get("of_allowed", math.inf if not v["ok"] else 0.0) for v in cmp["keys"].values()), default=0.0)


def compare_metrics(want: dict[str, float], got: dict[str, float], keys: tuple[str, ...], rel: float,
                    ab: float) -> dict[str, Any]:
    """Each key of `keys` that `want` holds: |got - want| <= max(rel * |want|, ab) (pytest.approx's rule; equal
    non-finite values match). A key `got` lacks fails. Returns per-key diffs, the worst key and ok."""
    rows, ok, worst, worst_ratio = {}, True, None, 0.0
    for k in keys:
        if k not in want:
            continue
        a, b = want[k], got.get(k)
        if b is None:
            rows[k] = {"want": a, "got": None, "ok": False}
            ok, worst, worst_ratio = False, k, math.inf
            continue
        same = a == b or (math.isnan(a) and math.isnan(b))
        diff = 0.0 if same else abs(b - a)
        allowed = max(rel * abs(a), ab) if math.isfinite(a) else 0.0
        good = same or (math.isfinite(diff) and diff <= allowed)
        ratio = 0.0 if same else (diff / allowed if allowed > 0 and math.isfinite(diff) else math.inf)
        rows[k] = {"want": a, "got": b, "abs_diff": diff, "rel_diff": diff / abs(a) if a and math.isfinite(a) else None,
                   "of_allowed": ratio, "ok": good}
        ok = ok and good
        if ratio > worst_ratio:
            worst, worst_ratio = k, ratio
    return {"keys": rows, "ok": ok and bool(rows), "worst_key": worst, "tol": {"rel": rel, "abs": ab}}


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
    _plan_event(ev, cfg, args.device, ("rollout", "training"), args.preset)
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


def _plan_event(ev: _Events, cfg: Any, device: str, phases: tuple[str, ...], run: str) -> None:
    """The planner's prediction for this run as a `plan` event; a planner error is recorded there (memplan then
    fails), it does not stop the run."""
    try:
        ev(event="plan", run=run, **memory_plan(cfg, device, phases))
    except Exception as e:  # noqa: BLE001 - the planner's failure is memplan's finding, not this run's
        ev(event="plan", run=run, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])


def worker_rng(args: argparse.Namespace, ev: _Events) -> None:
    """trainer/checkpoint.py's rng_state() through a checkpoint file and back with set_rng_state(): every RNG a
    step consumes draws the same numbers again. The draws: torch CPU, python, numpy, on CUDA torch.cuda (the
    current device's generator) and megatron's CUDA RNG tracker fork 'model-parallel-rng' (on the CPU the tracker is
    cpu_compat's, forking the CPU generator). A third set, drawn without the restore, must differ (the generators
    moved: an equality that holds anyway proves nothing)."""
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    from megatron_opd.models.parallel import destroy_parallel, init_parallel
    from megatron_opd.trainer import checkpoint as tckpt

    _check_device(args.device)
    cuda = args.device == "cuda"
    init_parallel(1, 1, "nccl" if cuda else "gloo", seed=1234)
    tracker = tensor_parallel.get_cuda_rng_tracker()

    def draw() -> dict[str, Any]:
        out = {"torch_cpu": torch.randn(256), "python": torch.tensor([random.random() for _ in range(16)]),
               "numpy": torch.from_numpy(np.random.rand(16))}
        if cuda:
            out["torch_cuda"] = torch.randn(4096, device="cuda").cpu()
        with tracker.fork("model-parallel-rng"):
            out["tracker:model-parallel-rng"] = torch.randn(4096, device="cuda" if cuda else "cpu").cpu()
        return out

    draw()  # off the seeded start: the saved state is one the run reached, not init_parallel's seed
    mgr = tckpt.CheckpointManager(Path(args.workdir) / "rng-checkpoint", keep_last=1)
    saved = tckpt.rng_state()
    mgr.save(1, {"rng": saved})
    first = draw()
    moved = draw()
    _step, state, _shared = mgr.load(1)
    tckpt.set_rng_state(state["rng"])
    again = draw()
    streams = {k: {"restored_equal": bool(torch.equal(first[k], again[k])),
                   "advanced": not torch.equal(first[k], moved[k])} for k in first}
    info = {"cuda_state_saved": "cuda" in state["rng"], "tracker_kind": state["rng"].get("tracker_kind"),
            "tracker_states": sorted(state["rng"].get("tracker") or {}),
            "current_device": torch.cuda.current_device() if cuda else None}
    problems = [f"{k}: {'differs after the restore' if not v['restored_equal'] else 'did not advance'}"
                for k, v in streams.items() if not (v["restored_equal"] and v["advanced"])]
    if cuda and not info["cuda_state_saved"]:
        problems.append("rng_state() holds no CUDA state")
    if cuda and info["tracker_kind"] != "cuda":
        problems.append(f"tracker states saved as {info['tracker_kind']!r}, not 'cuda'")
    if "model-parallel-rng" not in info["tracker_states"]:
        problems.append("rng_state() holds no 'model-parallel-rng' tracker state")
    ev(event="rng", streams=streams, problems=problems, ok=not problems, **info)
    log(f"rng: {len(streams)} streams restored through a checkpoint file: "
        + ("all equal" if not problems else "; ".join(problems)))
    destroy_parallel()
    if problems:
        raise RuntimeError("RNG restore: " + "; ".join(problems))
    ev(event="done", memory=_memory(args.device))


def optimizer_info(trainer: Any) -> dict[str, Any]:
    """The student's optimizer as megatron built it: the wrapper(s) and the inner torch optimizer class(es)."""
    opt = trainer.student.setup.optimizer
    parts = list(getattr(opt, "chained_optimizers", [opt]))
    inner = [getattr(o, "optimizer", None) for o in parts]
    return {"wrapper": [type(o).__name__ for o in parts],
            "inner": [f"{type(i).__module__}.{type(i).__qualname__}" for i in inner if i is not None]}


def _te_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


class _LastStep(Exception):
    """The resumed run has computed the last compared step."""


def worker_trainrun(args: argparse.Namespace, ev: _Events) -> None:
    """One trainer process of the resume phase, Trainer.train() with a checkpoint every RESUME_SAVE_AT steps.
    --role killed: a fresh run that, once step RESUME_STEPS has been computed (after step RESUME_SAVE_AT's
    checkpoint, before the final one), reports the step and waits for the parent's SIGKILL. --role resumed: the
    same config in a new process, which must resume from step RESUME_SAVE_AT's checkpoint
    (checkpoint.resume=auto) and then runs to RESUME_STEPS."""
    import torch

    from megatron_opd.config import load_config
    from megatron_opd.trainer.loop import Trainer

    _check_device(args.device)
    cfg = load_config(None, check_overrides(args, Path(args.run_dir), RESUME_STEPS,
                                            f"checkpoint.save_every={RESUME_SAVE_AT}",
                                            "checkpoint.keep_last=2", "checkpoint.resume=auto"))
    t = time.time()
    trainer = Trainer(cfg)
    ev(event="init", role=args.role, step=trainer.step, init_s=time.time() - t, optimizer=optimizer_info(trainer),
       memory=_memory(args.device))
    want = 0 if args.role == "killed" else RESUME_SAVE_AT
    if trainer.step != want:
        trainer.close()
        raise RuntimeError(f"resume ({args.role}): the trainer starts at step {trainer.step}, expected {want}"
                           + (" (did not resume from the checkpoint)" if args.role == "resumed" else ""))
    if args.role == "killed":  # its allocator peak spans its steps and the checkpoint save between them
        _plan_event(ev, cfg, args.device, ("rollout", "training", "save"), "resume (killed run)")
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    real = trainer.train_step

    def step() -> dict[str, float]:
        m = real()
        ev(event="step", role=args.role, step=trainer.step, metrics=_floats(m), memory=_memory(args.device))
        if trainer.step == RESUME_STEPS and args.role == "killed":
            ev(event="awaiting_kill", latest=trainer.ckpt.latest_step())
            while True:  # the parent's SIGKILL ends this process here
                time.sleep(60)
        if trainer.step == RESUME_STEPS:  # resumed: its final save is not this phase's (and rewrites the whole
            raise _LastStep()  # optimizer state: ~8 GB at 0.5B)
        return m

    trainer.train_step = step
    try:
        trainer.train()
    except _LastStep:
        pass
    finally:
        trainer.close()
    ev(event="done", memory=_memory(args.device))


def _wait_for_event(path: Path, proc: subprocess.Popen, kind: str, timeout: float) -> dict[str, Any]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for e in _read_events(path):
            if e.get("event") == kind:
                return e
            if e.get("event") == "error":
                raise RuntimeError(f"the trainer process failed: {e.get('error')}\n{e.get('traceback', '')[-3000:]}")
        if proc.poll() is not None:
            raise RuntimeError(f"the trainer process exited ({proc.returncode}) before its {kind!r} event")
        time.sleep(0.2)
    raise RuntimeError(f"no {kind!r} event from the trainer process within {timeout:.0f}s")


def _child_cmd(args: argparse.Namespace, role: str, events: Path, run_dir: Path) -> list[str]:
    phase = {"worker": "trainrun", "dtype": args.dtype, "layer_spec": args.layer_spec, "fp8": None}
    models = {"student": Path(args.student), "teacher": Path(args.teacher)}
    return [*worker_cmd(args, phase, events, models, Path(args.data)), "--role", role, "--run-dir", str(run_dir)]


def worker_resume(args: argparse.Namespace, ev: _Events) -> None:
    """Preemption by SIGKILL after a checkpoint, then resume (trainer/checkpoint.py, models/checkpoint.py): the
    killed run computes step 2 straight after step 1's save (the uninterrupted trajectory), the resumed process
    recomputes it from the checkpoint; the two step-2 metric sets must agree (RESUME_KEYS, RESUME_TOL). On CUDA
    with Transformer Engine, megatron's DistributedOptimizer runs TE's FusedAdam, whose state_dict raised
    KeyError: 'step' on every resume before 486d65b; the resumed run reports its optimizer class."""
    import shutil

    _check_device(args.device)
    run_dir = Path(args.workdir) / "run-resume"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, **DETERMINISTIC_ENV, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    files = {role: Path(args.workdir) / f"resume-{role}.events.jsonl" for role in ("killed", "resumed")}
    for f in files.values():
        f.unlink(missing_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        t = time.time()
        killed = subprocess.Popen(_child_cmd(args, "killed", files["killed"], run_dir), env=env, cwd=str(REPO))
        procs.append(killed)
        waiting = _wait_for_event(files["killed"], killed, "awaiting_kill", timeout=1800)
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        os.kill(killed.pid, signal.SIGKILL)
        rc = killed.wait(timeout=60)
        ev(event="killed", returncode=rc, latest=latest, latest_step=waiting.get("latest"), killed_s=time.time() - t)
        log(f"resume: SIGKILLed the run after step {RESUME_STEPS} (exit {rc}; last checkpoint {latest})")
        if rc != -signal.SIGKILL:
            raise RuntimeError(f"the killed run exited with {rc}, not by SIGKILL")
        if latest != f"step_{RESUME_SAVE_AT:08d}":
            raise RuntimeError(f"the killed run's checkpoint pointer names {latest!r}, expected "
                               f"step_{RESUME_SAVE_AT:08d}")
        t = time.time()
        resumed = subprocess.Popen(_child_cmd(args, "resumed", files["resumed"], run_dir), env=env, cwd=str(REPO))
        procs.append(resumed)
        rc = resumed.wait(timeout=1800)
        if rc != 0:
            err = next((e for e in _read_events(files["resumed"]) if e.get("event") == "error"), {})
            raise RuntimeError(f"the resumed run exited with {rc}: {err.get('error')}\n"
                               f"{err.get('traceback', '')[-4000:]}")
        ev(event="resumed_run", resumed_s=time.time() - t)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    evs = {role: _read_events(f) for role, f in files.items()}
    for role, es in evs.items():
        for e in es:
            if e.get("event") in ("init", "plan"):
                ev(**{**e, "event": f"{role}_{e['event']}"})
    step_of = {role: {e["step"]: e for e in es if e.get("event") == "step"} for role, es in evs.items()}
    compared = list(range(RESUME_SAVE_AT + 1, RESUME_STEPS + 1))
    missing = [(role, k) for k in compared for role in step_of if k not in step_of[role]]
    if missing:
        raise RuntimeError(f"metrics missing for (run, step) {missing}")
    steps = {k: compare_metrics(step_of["killed"][k]["metrics"], step_of["resumed"][k]["metrics"], RESUME_KEYS,
                                *RESUME_TOL) for k in compared}
    ok = all(c["ok"] for c in steps.values())
    init = next(e for e in evs["resumed"] if e.get("event") == "init")
    inner = init["optimizer"]["inner"]
    te_adam = any(n.startswith("transformer_engine.") and n.endswith("FusedAdam") for n in inner)
    need_te = args.device == "cuda" and _te_importable()
    worst_step = max(compared, key=lambda k: _worst_excess(steps[k]))
    ev(event="resume", compared_steps=compared, resumed_at_step=init["step"], optimizer=init["optimizer"],
       te_fused_adam=te_adam, deterministic_env=DETERMINISTIC_ENV, ok=ok, tol=steps[compared[0]]["tol"],
       steps={str(k): {"keys": c["keys"], "ok": c["ok"], "worst_key": c["worst_key"]} for k, c in steps.items()},
       worst_step=worst_step, worst_key=steps[worst_step]["worst_key"],
       killed_peak_gb=_measured_gb(step_of["killed"][RESUME_STEPS].get("memory")))
    for k, c in steps.items():
        w = c["keys"].get(c["worst_key"] or "", {})
        log(f"resume: step {k} resumed vs uninterrupted: " + ("identical" if c["worst_key"] is None else
            f"{'equal' if c['ok'] else 'DIFFERENT'} within rel {RESUME_TOL[0]:g} (largest difference "
            f"{c['worst_key']}: {w.get('want')} vs {w.get('got')})"))
    log(f"resume: optimizer {init['optimizer']}")
    if not ok:
        bad = {k: [n for n, v in c["keys"].items() if not v["ok"]] for k, c in steps.items() if not c["ok"]}
        raise RuntimeError(f"resumed steps differ from the uninterrupted run's: {bad}")
    if need_te and not te_adam:
        raise RuntimeError(f"Transformer Engine is importable but the optimizer is {inner}, not TE's FusedAdam: "
                           "this phase did not exercise the FusedAdam resume")
    ev(event="done", memory=_memory(args.device))


def worker_dynbatch(args: argparse.Namespace, ev: _Events) -> None:
    """One stable_opd step twice in this process, same seed and weights: fixed micro-batches
    (train.micro_batch_size), then dynamic batching + packing (train.max_tokens_per_microbatch +
    train.pack_sequences: THD on TE, the block mask on the local spec). The loss is normalised by whole-minibatch
    counts either way, so the losses and the gradient norm must agree (DYN_KEYS, DYN_TOL)."""
    import gc

    import torch

    from megatron_opd.config import load_config
    from megatron_opd.models.parallel import destroy_parallel
    from megatron_opd.trainer.loop import Trainer

    _check_device(args.device)
    budget = SIZES[args.size]["check"]["token_budget"]
    runs = {}
    for name, extra in (("fixed", ()), ("packed", (f"train.max_tokens_per_microbatch={budget}",
                                                   "train.pack_sequences=true"))):
        cfg = load_config(None, check_overrides(args, Path(args.workdir) / f"run-dynbatch-{name}", 1,
                                                "checkpoint.save_every=100000", "checkpoint.resume=never", *extra))
        _plan_event(ev, cfg, args.device, ("rollout", "training"), f"dynbatch ({name})")
        # what the first run left allocated (none, when its close freed everything) is not the second run's
        before = torch.cuda.memory_allocated() if args.device == "cuda" else 0
        t = time.time()
        trainer = Trainer(cfg)
        thd = bool(getattr(trainer.student, "thd", False))
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            m = _floats(trainer.train_step())
        finally:
            trainer.close()
        runs[name] = m
        ev(event="step", run=name, metrics=m, thd=thd, wall_s=time.time() - t, memory=_memory(args.device),
           allocated_before_init_gb=before / 1e9)
        log(f"dynbatch ({name}): loss {m.get('loss/total_loss')} grad norm {m.get('loss/grad_norm')} padding "
            f"{m.get('batch/padding_fraction')}")
        del trainer
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    rel, ab = DYN_TOL[args.dtype]
    cmp = compare_metrics(runs["fixed"], runs["packed"], DYN_KEYS, rel, ab)
    same_rollouts = all(runs["fixed"].get(k) == runs["packed"].get(k)
                        for k in ("rollout/num_samples", "rollout/num_golden", "rollout/response_len_mean"))
    pad = {k: runs[k].get("batch/padding_fraction") for k in runs}
    problems = []
    if not same_rollouts:
        problems.append("the two runs trained different rollouts (the comparison needs the same step)")
    if not cmp["ok"]:
        problems.append("differ in " + ", ".join(k for k, v in cmp["keys"].items() if not v["ok"]))
    if pad["packed"] != 0.0:
        problems.append(f"the packed run padded {pad['packed']} of its tokens (expected 0: were rows packed?)")
    ev(event="dynbatch", token_budget=budget, format="thd" if args.layer_spec == "te" else "mask",
       padding_fraction=pad, same_rollouts=same_rollouts, problems=problems, **{**cmp, "ok": not problems})
    destroy_parallel()
    if problems:
        raise RuntimeError("dynamic batching + packing vs fixed micro-batches: " + "; ".join(problems))
    ev(event="done", memory=_memory(args.device))


def sglang_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def worker_sglang(args: argparse.Namespace, ev: _Events) -> None:
    """SGLang on this GPU, through the project's clients: an SGLang server (rollout.sglang_mode=server, launched by
    make_rollout_engine) serving the student generates with behaviour log-probs; teacher.backend=sglang's client
    (SGLangTeacher: prefill log-probs, top-3) scores those tokens; MegatronTeacher scores the same tokens as the
    reference. Then the teacher's weights go to the server over update_weights_from_distributed (sync_weights with
    rollout.colocate=false: NCCL when a second GPU holds SGLang; with one GPU over gloo, since NCCL refuses two
    ranks on one device) and the served prefill scores must match MegatronTeacher on the teacher."""
    import torch
    from transformers import AutoConfig

    from megatron_opd.config import RolloutConfig
    from megatron_opd.models.parallel import destroy_parallel, init_parallel
    from megatron_opd.models.weight_mapping import load_hf_state_dict
    from megatron_opd.rollout import make_rollout_engine, sync_weights
    from megatron_opd.rollout.base import SamplingParams
    from megatron_opd.teacher.megatron import MegatronTeacher
    from megatron_opd.teacher.sglang import SGLangTeacher

    _check_device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    sgl_args: dict[str, Any] = {"dtype": args.dtype, "disable_cuda_graph": True}  # a check, not a benchmark
    if gpus >= 2:
        sgl_args["base_gpu_id"] = 1
    cfg = RolloutConfig(backend="sglang", sglang_mode="server", port=free_port(), colocate=False,
                        mem_fraction_static=0.3 if gpus < 2 else 0.8, sglang_args=sgl_args, sync_bucket_mb=256)
    vocab = int(AutoConfig.from_pretrained(args.student).vocab_size)
    tol = SGLANG_TOL[args.dtype]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (5, 17, 40, 9)]
    init_parallel(1, 1, "nccl", seed=1234)
    t = time.time()
    server = make_rollout_engine(cfg, args.student, log_path=str(Path(args.workdir) / "sglang-server.log"))
    try:
        ev(event="server", startup_s=time.time() - t, url=server.url, gpus=gpus, weight_sync_backend=backend,
           sglang=_version("sglang"), sglang_args=sgl_args)
        log(f"sglang: server up in {time.time() - t:.1f}s ({server.url}); weight sync over {backend}")
        t = time.time()
        samples = server.generate(prompts, SamplingParams(max_new_tokens=32, temperature=1.0, n=2))
        gen_s = time.time() - t
        problems = []
        if len(samples) != 2 * len(prompts):
            problems.append(f"{len(samples)} samples for {len(prompts)} prompts x 2")
        for s in samples:
            if not 1 <= len(s.response_ids) <= 32 or len(s.logprobs) != len(s.response_ids):
                problems.append(f"sample of prompt {s.prompt_index}: {len(s.response_ids)} tokens, "
                                f"{len(s.logprobs)} log-probs")
        ps, rs = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
        client = SGLangTeacher(server.server, eos_token_ids=server.eos_token_ids, vocab_size=vocab,
                               micro_batch_size=8)

        def megatron_scores(path: str) -> list[Any]:
            mt = MegatronTeacher.from_hf(path, micro_batch_size=8, layer_spec=args.layer_spec, params_dtype=dtype)
            try:
                return mt.score(ps, rs, top_k=3)
            finally:
                del mt
                torch.cuda.empty_cache()

        def gap(a: list[Any], b: list[Any], attr: str = "logprobs") -> float:
            return max(float((getattr(x, attr).float() - getattr(y, attr).float()).abs().max()) for x, y in zip(a, b))

        want = megatron_scores(args.student)
        gen_gap = max(float((torch.tensor(s.logprobs) - w.logprobs).abs().max()) for s, w in zip(samples, want))
        got = client.score(ps, rs, top_k=3)
        prefill_gap, top_gap = gap(got, want), gap(got, want, "topk_logprobs")
        ids_same = (sum(int((x.topk_ids == y.topk_ids).all(-1).sum()) for x, y in zip(got, want))
                    / sum(len(r) for r in rs))
        t = time.time()
        weights = [(k, v.to(dtype)) for k, v in load_hf_state_dict(args.teacher).items()]
        buckets = sync_weights(server, weights, 1, cfg, parallel_backend=backend)
        sync_s = time.time() - t
        del weights
        want_t = megatron_scores(args.teacher)
        got_t = client.score(ps, rs, top_k=3)
        synced_gap, moved = gap(got_t, want_t), gap(got_t, got)
        nums = {"generation_gap": gen_gap, "prefill_gap": prefill_gap, "topk_gap": top_gap,
                "topk_ids_same_fraction": ids_same, "synced_gap": synced_gap, "moved_by_sync": moved,
                "weight_version": server.weight_version,
                "sync_buckets": buckets, "sync_s": sync_s, "generate_s": gen_s, "samples": len(samples), "tol": tol}
        for name in ("generation_gap", "prefill_gap", "topk_gap", "synced_gap"):
            if not nums[name] <= tol:
                problems.append(f"{name} {nums[name]:.3g} > {tol:g}")
        if args.dtype == "float32" and ids_same < 1:  # bf16: near-ties of a random model's logits may swap ids
            problems.append(f"top-3 ids differ from the megatron teacher's at {1 - ids_same:.1%} of the positions")
        if not moved > tol:
            problems.append(f"the served scores moved only {moved:.3g} after the sync (weights not loaded?)")
        if server.weight_version != 1:
            problems.append(f"weight version {server.weight_version} after the sync, expected 1")
        ev(event="sglang", problems=problems, ok=not problems, **nums)
        log(f"sglang: generation gap {gen_gap:.3g}, prefill {prefill_gap:.3g} (top-3 {top_gap:.3g}), after the "
            f"{backend} sync {synced_gap:.3g} (moved {moved:.3g}); tol {tol:g}")
    finally:
        server.shutdown()
        destroy_parallel()
    if problems:
        raise RuntimeError("sglang: " + "; ".join(problems))
    ev(event="done", memory=_memory(args.device))


WORKERS = {"model": worker_model, "ckpt": worker_ckpt, "preset": worker_preset, "packed": worker_packed,
           "rng": worker_rng, "resume": worker_resume, "trainrun": worker_trainrun, "dynbatch": worker_dynbatch,
           "sglang": worker_sglang}


def run_worker(args: argparse.Namespace) -> int:
    ev = _Events(Path(args.events))
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        WORKERS[args.worker](args, ev)
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
           "--size", args.size, "--device", args.device, "--dtype", phase["dtype"], "--workdir", str(args.workdir),
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
    # its own process group: a worker's children (the resume phase's trainer runs, a conversion, an SGLang
    # server) go with it when it is stopped
    proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), start_new_session=True)
    status = "ok"
    try:
        rc = proc.wait(timeout=max(timeout, 1.0))
        if rc != 0:
            status = f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {timeout:.0f}s"
    finally:
        if proc.poll() is None:
            proc.terminate()  # the worker unwinds (KeyboardInterrupt) and stops its children itself
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group outlived the worker
        except (ProcessLookupError, PermissionError):
            pass
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


def _fmt(x: Any, spec: str) -> str:
    return format(x, spec) if _finite(x) else str(x)


def _median(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if _finite(x)]
    return statistics.median(xs) if xs else None


def _event(evs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next((e for e in evs if e.get("event") == kind), {})


def _fields(e: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in e.items() if k != "event"}


def memory_plan_row(plan_ev: dict[str, Any], measured_gb: Optional[float]) -> dict[str, Any]:
    """One run's prediction beside its measured allocator peak (GB); ratio = predicted / measured."""
    pred = plan_ev.get("predicted_gb")
    row = {"run": plan_ev.get("run"), "predicted_gb": pred, "measured_gb": measured_gb,
           "ratio": pred / measured_gb if _finite(pred) and measured_gb else None,
           "worst_phase": plan_ev.get("worst_phase"), "phases": plan_ev.get("phases"),
           "held_gb": plan_ev.get("held_gb"), "components": plan_ev.get("components")}
    if plan_ev.get("error"):
        row["error"] = plan_ev["error"]
    return row


def summarise_rng(evs: list[dict[str, Any]], info: dict[str, Any], params: dict[str, int],
                  peak: Optional[float]) -> dict[str, Any]:
    out = {**info, **_fields(_event(evs, "rng"))}
    if out["status"] == "ok" and not out.get("ok"):
        out["status"] = "failed (RNG not restored)"
    return out


def summarise_resume(evs: list[dict[str, Any]], info: dict[str, Any], params: dict[str, int],
                     peak: Optional[float]) -> dict[str, Any]:
    out = dict(info)
    killed = _event(evs, "killed")
    out.update(killed_returncode=killed.get("returncode"), checkpoint=killed.get("latest"),
               killed_s=killed.get("killed_s"), resumed_s=_event(evs, "resumed_run").get("resumed_s"))
    res = _event(evs, "resume")
    out.update({k: res[k] for k in ("compared_steps", "resumed_at_step", "optimizer", "te_fused_adam", "steps",
                                    "worst_step", "worst_key", "tol", "deterministic_env") if k in res})
    out["optimizer"] = out.get("optimizer") or _event(evs, "resumed_init").get("optimizer")
    plan_ev = _event(evs, "killed_plan")
    if plan_ev:
        out["memory_plans"] = [memory_plan_row(plan_ev, res.get("killed_peak_gb"))]
    if out["status"] == "ok" and not res.get("ok"):
        out["status"] = "failed (resumed steps differ)"
    return out


def summarise_dynbatch(evs: list[dict[str, Any]], info: dict[str, Any], params: dict[str, int],
                       peak: Optional[float]) -> dict[str, Any]:
    out = {**info, **_fields(_event(evs, "dynbatch"))}
    plans = {e.get("run"): e for e in evs if e.get("event") == "plan"}
    rows = []
    for e in evs:
        if e.get("event") == "step":
            label = f"dynbatch ({e['run']})"
            measured = _measured_gb(e.get("memory"))
            if label in plans:
                rows.append(memory_plan_row(plans[label], measured - e.get("allocated_before_init_gb", 0.0)
                                            if measured is not None else None))
    out["memory_plans"] = rows
    if out["status"] == "ok" and not out.get("ok"):
        out["status"] = "failed (packed step differs)"
    return out


def summarise_sglang(evs: list[dict[str, Any]], info: dict[str, Any], params: dict[str, int],
                     peak: Optional[float]) -> dict[str, Any]:
    out = {**info, **_fields(_event(evs, "server")), **_fields(_event(evs, "sglang"))}
    if out["status"] == "ok" and not out.get("ok"):
        out["status"] = "failed (SGLang differs from megatron)"
    return out


def summarise_memplan(phases: dict[str, dict[str, Any]], device: str) -> dict[str, Any]:
    """Every trainer run's plan row (memory_plans of the phases run so far) and its ratio. On CUDA: failed when
    fewer than MEMPLAN_MIN_CONFIGS runs have both numbers or the planner failed; a ratio outside MEMPLAN_BAND is a
    finding (listed, status ok): the band is the planner's calibration target, and the check's verdict is about
    the GPU paths working, not about the estimate's constants (CUDA context, allocator slack) on this card. On the
    CPU the predictions only (the allocator peak is CUDA's)."""
    lo, hi = MEMPLAN_BAND
    rows = [{"phase": name, **r} for name, ph in phases.items() for r in ph.get("memory_plans", [])]
    out: dict[str, Any] = {"status": "ok", "band": [lo, hi], "ratio": "predicted / measured", "configs": rows,
                           "findings": []}
    errors = [f"{r['phase']} ({r['run']}): {r['error']}" for r in rows if r.get("error")]
    if errors:
        out.update(status="failed (planner error)", error="; ".join(errors))
        return out
    if device != "cuda":
        out["note"] = "CPU stand-in: predictions only (torch.cuda.max_memory_allocated exists on CUDA)"
        return out
    measured = [r for r in rows if _finite(r.get("ratio"))]
    out["measured_configs"] = len(measured)
    for r in measured:
        if not lo <= r["ratio"] <= hi:
            out["findings"].append(f"{r['phase']} ({r['run']}): predicted {r['predicted_gb']:.2f} GB, measured "
                                   f"{r['measured_gb']:.2f} GB, ratio {r['ratio']:.2f} outside [{lo}, {hi}]")
    if len(measured) < MEMPLAN_MIN_CONFIGS:
        out.update(status=f"failed ({len(measured)} of {MEMPLAN_MIN_CONFIGS} runs measured)",
                   error="too few trainer runs with a prediction and a measured peak (did they fail?)")
    return out


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
        measured = _measured_gb({"cuda_max_allocated_mib": out.get("memory_peak", {}).get(
            "cuda_max_allocated_steps_mib")})
        row = memory_plan_row(plan, measured)
        out["plan"] = {k: row.get(k) for k in ("predicted_gb", "components", "measured_gb", "ratio", "error")}
        out["memory_plans"] = [row]
    if out["status"] == "ok" and (out["timed_steps"] < 1 or not out["losses_finite"]):
        out["status"] = "failed (no timed step)" if out["timed_steps"] < 1 else "failed (non-finite loss)"
    return out


def _summary_of(kind: str, ph: dict[str, Any], r: Any) -> dict[str, Any]:
    """The summary block of a correctness phase: its status and the numbers its criterion reads."""
    keep = {"rng": ("status", "cuda_state_saved", "tracker_kind", "tracker_states", "problems", "error"),
            "resume": ("status", "optimizer", "te_fused_adam", "killed_returncode", "checkpoint", "resumed_at_step",
                       "compared_steps", "worst_step", "worst_key", "tol", "error"),
            "dynbatch": ("status", "format", "token_budget", "padding_fraction", "same_rollouts", "worst_key", "tol",
                         "problems", "error"),
            "memplan": ("status", "band", "ratio", "measured_configs", "findings", "note", "error"),
            "sglang": ("status", "ran", "reason", "sglang", "weight_sync_backend", "gpus", "generation_gap",
                       "prefill_gap", "topk_gap", "topk_ids_same_fraction", "synced_gap", "moved_by_sync", "sync_s",
                       "startup_s", "tol", "problems", "error")}[kind]
    out = {k: r(ph[k]) if isinstance(ph[k], float) else ph[k] for k in keep if ph.get(k) is not None}
    if kind == "rng" and ph.get("streams"):
        out["streams_restored"] = {k: v["restored_equal"] and v["advanced"] for k, v in ph["streams"].items()}
    def diffs(keys: dict[str, Any]) -> dict[str, Any]:
        return {k: {"want": r(v.get("want"), 6), "got": r(v.get("got"), 6), "abs_diff": r(v.get("abs_diff"), 9),
                    "ok": v["ok"]} for k, v in keys.items()}

    if kind == "dynbatch" and ph.get("keys"):
        out["diffs"] = diffs(ph["keys"])
    if kind == "resume" and ph.get("steps"):
        out["diffs"] = {step: diffs(c["keys"]) for step, c in ph["steps"].items()}
    if kind == "memplan":
        out["configs"] = [{"run": f"{c['phase']}: {c['run']}", "predicted_gb": r(c.get("predicted_gb"), 3),
                           "measured_gb": r(c.get("measured_gb"), 3), "ratio": r(c.get("ratio"), 3)}
                          for c in ph.get("configs", [])]
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
        if kinds.get(name) in ("rng", "resume", "dynbatch", "derived", "sglang"):
            out[name] = _summary_of("memplan" if kinds[name] == "derived" else kinds[name], ph, r)
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


def failed_phases(phases: dict[str, dict[str, Any]]) -> list[str]:
    """The phases that fail the check: every status but "ok", except a phase deliberately not run (`ran` False:
    sglang not installed, or GPU-only on a CPU); one cut by the time limit fails."""
    return [k for k, v in phases.items() if v.get("status") != "ok" and v.get("ran", True)]


def sglang_skip(device: str) -> Optional[str]:
    """Why the sglang phase does not run here (None: it runs): sglang not importable, or not on CUDA."""
    if not sglang_importable():
        return SGLANG_NOT_INSTALLED
    if device != "cuda":
        return ("not run: GPU-only here (SGLang on a CPU needs the test suite's stand-ins: "
                "tests/test_sglang_*_real.py)")
    return None


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
    worker_only = ("worker", "events", "preset", "student", "teacher", "data", "role", "run_dir")
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
        skip = {p["name"]: why for p in jobs if p["worker"] == "sglang" and (why := sglang_skip(args.device))}
        for j, phase in enumerate(jobs):
            name = phase["name"]
            if name in skip:
                report["phases"][name] = {"status": skip[name], "ran": False}
                log(f"sglang: {skip[name]}")
                save()
                continue
            if phase["worker"] == "derived":
                report["phases"][name] = {**summarise_memplan(report["phases"], args.device),
                                          "layer_spec": phase["layer_spec"], "fp8": phase["fp8"]}
                mp = report["phases"][name]
                for c in mp["configs"]:
                    pred, meas, ratio = (c.get(k) for k in ("predicted_gb", "measured_gb", "ratio"))
                    log(f"memplan: {c['phase']} ({c['run']}): predicted {_fmt(pred, '.3f')} GB, measured "
                        f"{_fmt(meas, '.3f')} GB, predicted/measured {_fmt(ratio, '.2f')}")
                log(f"memplan: {mp['status']}; {len(mp['findings'])} finding(s)" + "".join(
                    f"\n  finding: {f}" for f in mp["findings"]))
                save()
                continue
            left = deadline - time.time() - 10
            if left < 20:
                report["phases"][name] = {"status": "not run (time limit)"}
                log(f"not running {name}: {left:.0f}s left")
                continue
            # a share of what is left by cost (the phases still to run); unused time passes on
            rest = sum(p["cost"] for p in jobs[j:] if p["name"] not in skip)
            timeout = left * phase["cost"] / rest if rest > 0 else left
            evs, info = _spawn(args, phase, timeout, models, data)
            summarise = {"model": summarise_model, "ckpt": summarise_ckpt, "preset": summarise_preset,
                         "packed": summarise_packed, "rng": summarise_rng, "resume": summarise_resume,
                         "dynbatch": summarise_dynbatch, "sglang": summarise_sglang}[phase["worker"]]
            report["phases"][name] = {**summarise(evs, info, params, peak),
                                      "layer_spec": phase["layer_spec"], "fp8": phase["fp8"]}
            save()
        bad = failed_phases(report["phases"])
        report["status"] = "ok" if not bad else f"failed: {', '.join(bad)}"
        report["not_run"] = {k: v["status"] for k, v in report["phases"].items() if v.get("ran") is False}
        report["findings"] = [f for v in report["phases"].values() for f in v.get("findings", [])]
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
    ap.add_argument("--no-rng-check", action="store_true", help="skip the RNG save/restore check")
    ap.add_argument("--no-resume-check", action="store_true", help="skip the SIGKILL + resume check")
    ap.add_argument("--no-dynbatch-check", action="store_true",
                    help="skip dynamic batching + packing vs fixed micro-batches")
    ap.add_argument("--no-memplan-check", action="store_true", help="skip the planner-vs-measured memory table")
    ap.add_argument("--no-sglang-check", action="store_true", help="skip the SGLang phase (run when importable)")
    ap.add_argument("--layer-spec", choices=["auto", "local", "te"], default="auto",
                    help="model.layer_spec of every phase (auto: Transformer Engine on CUDA, local on CPU)")
    ap.add_argument("--fp8", default="auto",
                    help="FP8 recipe of the extra FP8 phases (auto: delayed on CUDA, none on CPU; none: no FP8 phase)")
    ap.add_argument("--dry-run", action="store_true", help="print the phases this would run (JSON) and exit")
    ap.add_argument("--no-matmul-probe", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s for MFU (default: by device name)")
    ap.add_argument("--override", action="append", default=[],
                    help="extra dotted config override of the preset runs (repeatable; the resume and dynbatch "
                         "runs keep their own settings)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in workers (0: torch's default)")
    ap.add_argument("--time-limit", type=float, default=460.0, help="seconds for the whole check")
    ap.add_argument("--out", default=None, help="report path (default: $OUT/gpu_check.json, else ./gpu_check.json)")
    ap.add_argument("--workdir", default=None, help="models, data, runs (default: a fresh temp dir)")
    # worker-only
    ap.add_argument("--worker", choices=sorted(WORKERS), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--events", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--preset", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--student", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--teacher", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--role", choices=["killed", "resumed"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    args.fp8 = None if args.fp8 == "none" else args.fp8
    if args.worker:
        _worker_env(args.device)
        sys.path.insert(0, str(REPO))
        return run_worker(args)

    for key, val in SIZES[args.size].items():
        if key not in ("model", "check") and getattr(args, key, None) is None:
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
