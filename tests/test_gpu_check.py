"""benchmarks/gpu_check.sh + gpu_check.py (the GPU readiness check) at toy size on this CPU: the same
code path the device runs (wheel selection and install, megatron model check, the real Trainer for both
presets, the JSON report), the summary arithmetic on synthetic events, and a worker failure's report."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import zipfile
from pathlib import Path

import pytest

from _proc import explain, run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wheel(d: Path, name: str, version: str, tags: str = "py3-none-any", module: str = "") -> Path:
    """A minimal wheel: one module (optional) and its dist-info."""
    path = d / f"{name}-{version}-{tags}.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tags}\n"}
    if module:
        files[f"{name}.py"] = module
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def test_cpu_tiny_end_to_end(tmp_path: Path):
    """`gpu_check.sh --cpu-tiny`, both presets, with a wheel dir exercising each selection rule."""
    whl = tmp_path / "whl"
    whl.mkdir()
    _wheel(whl, "gpu_check_probe", "1.0", module="VALUE = 42\n")  # absent here: installed
    _wheel(whl, "einops", "0.0.1")  # installed here and newer: kept
    _wheel(whl, "torch", "99.0")  # never carried in, whatever the version
    _wheel(whl, "gpu_check_other", "1.0", tags="cp27-cp27mu-linux_x86_64")  # another python: skipped
    out, site = tmp_path / "out", tmp_path / "site"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "GPU_CHECK_WHEELS": str(whl),
           "GPU_CHECK_SITE": str(site)}
    env.pop("PYTHONPATH", None)
    res = run(["bash", SCRIPT, "--cpu-tiny", "--workdir", tmp_path / "work"], cwd=tmp_path, env=env, timeout=300)
    log = res.stdout + res.stderr
    assert "install gpu-check-probe 1.0 (absent)" in log
    assert "keep   einops" in log and "never  torch 99.0" in log and "WARN   gpu-check-other 1.0" in log, log[:4000]
    assert (site / "gpu_check_probe.py").is_file() and not (site / "torch").exists()
    assert not (site / "einops").exists()
    assert (out / "gpu_check.log").is_file()

    report = json.loads((out / "gpu_check.json").read_text())
    assert report["status"] == "ok", report.get("error")
    assert report["args"]["device"] == "cpu" and report["args"]["size"] == "tiny"
    assert report["summary"]["status"] == "ok"
    model = report["phases"]["model"]
    assert model["status"] == "ok" and model["fwd_bwd_median_s"] > 0 and model["tokens_per_s"] > 0
    assert model["memory"]["host_peak_rss_mib"] > 0
    for preset in ("stable_opd", "opd"):
        ph = report["phases"][preset]
        assert ph["status"] == "ok", ph.get("error")
        assert ph["timed_steps"] >= 1 and ph["losses_finite"]
        assert all(math.isfinite(x) for x in ph["losses"])
        timed = [s for s in ph["steps"] if not s["warmup"]]
        assert len(timed) == ph["timed_steps"]
        for s in timed:
            assert s["step_s"] > 0 and s["train_s"] > 0 and s["trained_tokens"] > 0
            assert s["score_s"] == s["metrics"]["time/score_s"]  # the trainer's own timer, not a difference
        assert ph["step_s_median"] > 0 and ph["tokens_per_s"] > 0 and ph["mfu"] is None  # no MFU on CPU
        assert ph["memory_peak"]["host_peak_rss_mib"] > 0
        assert ph["rollout_engine"]["engine"] == "LocalEngine"
        assert ph["rollout_engine"]["device"] == "cpu" and ph["rollout_engine"]["dtype"] == "torch.float32"
        assert report["summary"][preset]["tokens_per_s"] > 0
        assert ph["plan"]["predicted_gb"] > 0 and "student weights" in ph["plan"]["components"]  # CPU: no allocator peak
        assert report["summary"][preset]["plan_vs_measured_gb"][0] > 0
    assert report["phases"]["stable_opd"]["steps"][-1]["metrics"]["rollout/num_golden"] >= 1
    ckpt = report["phases"]["ckpt"]  # a CPU-written torch_dist checkpoint loaded into this device's model
    assert ckpt["status"] == "ok" and ckpt["layer_spec"] == "local" and ckpt["max_abs_logit_diff"] <= ckpt["tol"]
    packed = report["phases"]["packed"]  # rows packed into one sequence (the block mask here) score as alone
    assert packed["status"] == "ok" and packed["format"] == "mask" and packed["max_abs_logp_diff"] <= packed["tol"]
    assert report["summary"]["packed"]["status"] == "ok"
    assert [p["name"] for p in report["plan"]] == ["model", "packed", "ckpt", "stable_opd", "opd"]  # no FP8 on CPU


def _step(i, warmup, step_s, train_s, tokens, loss=0.5, **extra):
    metrics = {"time/step_s": step_s, "time/rollout_s": 0.1, "time/score_s": 0.2, "time/train_s": train_s,
               "time/sync_s": 0.05, "loss/total_loss": loss}
    return {"event": "step", "i": i, "warmup": warmup, "metrics": metrics, "score_s": 0.2, "sequences": 8,
            "golden": 1, "trained_tokens": tokens, "response_tokens": tokens // 2, **extra}


def test_summarise_preset_arithmetic():
    gc = _gpu_check()
    params = {"params_total": 1000, "params_input_embedding": 100, "params_for_flops": 900}
    peak = 1e6
    evs = [{"event": "config", "beta_kl": 0.1},
           {"event": "init", "init_s": 3.0, "rollout_engine": {"device": "cuda:0"},
            "memory": {"host_peak_rss_mib": 10.0, "cuda_max_allocated_mib": 5.0}},
           _step(0, True, 9.0, 8.0, 111, memory={"host_peak_rss_mib": 12.0, "cuda_max_allocated_mib": 7.0}),
           _step(1, False, 2.0, 1.0, 400, memory={"host_peak_rss_mib": 11.0, "cuda_max_allocated_mib": 6.0}),
           _step(2, False, 4.0, 3.0, 800, memory={"host_peak_rss_mib": 13.0, "cuda_max_allocated_mib": 6.5}),
           {"event": "done", "memory": {"host_peak_rss_mib": 13.5}}]
    out = gc.summarise_preset(evs, {"status": "ok", "wall_s": 20.0}, params, peak)
    assert out["status"] == "ok" and out["timed_steps"] == 2 and out["beta_kl"] == 0.1 and out["init_s"] == 3.0
    assert out["trained_tokens_timed"] == 1200  # the warm-up step is not counted
    assert out["tokens_per_s"] == pytest.approx(1200 / 4.0)
    assert out["mfu"] == pytest.approx(6 * 900 * 1200 / 4.0 / peak)
    assert out["step_s_median"] == pytest.approx(3.0) and out["train_s_median"] == pytest.approx(2.0)
    assert out["score_s_median"] == pytest.approx(0.2) and out["weight_sync_s"] == pytest.approx(0.05)
    assert out["memory_peak"] == {"host_peak_rss_mib": 13.5, "cuda_max_allocated_mib": 7.0,
                                  "cuda_max_allocated_steps_mib": 7.0}
    assert gc.summarise_preset(evs, {"status": "ok"}, params, None)["mfu"] is None

    bad = gc.summarise_preset(evs[:3] + [_step(1, False, 2.0, 1.0, 400, loss=float("nan"))], {"status": "ok"},
                              params, peak)
    assert bad["status"] == "failed (non-finite loss)"
    assert gc.summarise_preset(evs[:3], {"status": "ok"}, params, peak)["status"] == "failed (no timed step)"

    model = gc.summarise_model([{"event": "iter", "i": 0, "warmup": True, "fwd_bwd_s": 5.0, "loss": 1.0},
                                *({"event": "iter", "i": i, "warmup": False, "fwd_bwd_s": s, "loss": 1.0}
                                  for i, s in ((1, 0.5), (2, 0.7), (3, 0.6))),
                                {"event": "done", "tokens_per_iter": 64, "memory": {"host_peak_rss_mib": 1.0}}],
                               {"status": "ok"}, params, peak)
    assert model["fwd_bwd_median_s"] == pytest.approx(0.6) and model["tokens_per_s"] == pytest.approx(64 / 0.6)
    assert model["mfu"] == pytest.approx(6 * 900 * 64 / 0.6 / peak)


def test_peak_flops_by_device_name():
    gc = _gpu_check()
    assert gc.peak_flops("cuda", {"device_name": "NVIDIA H200"}, None)[0] == 989e12
    assert gc.peak_flops("cuda", {"device_name": "NVIDIA H200"}, 500.0)[0] == 500e12
    assert gc.peak_flops("cuda", {"device_name": "Some GPU"}, None)[0] is None
    assert gc.peak_flops("cpu", {}, None)[0] is None


def test_worker_failure_is_reported(tmp_path: Path):
    """A preset worker that fails (here: an invalid override, rejected by load_config) gives exit 1 and a
    report naming the phase and carrying the error text."""
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    run([sys.executable, ROOT / "benchmarks" / "gpu_check.py", "--size", "tiny", "--device", "cpu", "--presets", "opd",
         "--no-model-check", "--override", "train.micro_batch_size=-1", "--workdir", tmp_path / "work", "--out", out],
        cwd=tmp_path, env=env, timeout=180, expect=1)
    report = json.loads(out.read_text())
    assert report["status"] == "failed: opd"
    ph = report["phases"]["opd"]
    assert ph["status"] == "failed (exit 1)"
    assert "micro_batch_size" in ph["error"] and "ConfigError" in ph["error"] and ph["traceback"]
    assert report["summary"]["opd"]["error"] == ph["error"] and report["summary"]["status"] == report["status"]
    assert "model" not in report["phases"]


def test_help_and_usage():
    res = run(["bash", SCRIPT, "--help"], timeout=30)
    assert "--fetch-wheels" in res.stdout and 'carry=[".whl"]' in res.stdout, explain(res)
    res = run(["bash", SCRIPT, "--fetch-wheels", "extra"], timeout=30, expect=2)
    assert "takes no arguments" in res.stderr, explain(res)


def test_dry_run_on_cuda_builds_the_default_gpu_path(tmp_path: Path):
    """What the check would run on a GPU, checked here: every phase on the Transformer Engine spec, FP8 phases
    for the model and a preset (`delayed`), the CPU-written checkpoint loaded into TE, and each phase's worker
    command and trainer config carrying that spec and recipe (the config passes the trainer's validation)."""
    from megatron_opd.config import load_config

    gc = _gpu_check()
    res = run([sys.executable, ROOT / "benchmarks" / "gpu_check.py", "--device", "cuda", "--dry-run"], timeout=60)
    planned = json.loads(res.stdout)
    phases = {p["name"]: p for p in planned["phases"]}
    assert planned["dtype"] == "bfloat16" and list(phases) == [
        "model", "model-fp8-delayed", "packed", "ckpt", "stable_opd", "opd", "stable_opd-fp8-delayed"]
    assert all(p["layer_spec"] == "te" for p in phases.values())
    assert [n for n, p in phases.items() if p["fp8"]] == ["model-fp8-delayed", "stable_opd-fp8-delayed"]
    assert phases["ckpt"]["written_by"].startswith("cpu")

    args = gc.argparse.Namespace(**{**vars(gc.argparse.Namespace()), "device": "cuda", "workdir": str(tmp_path),
                                    "warmup": 1, "steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
                                    "max_new_tokens": 8, "micro_batch_size": 4, "model_batch": 2, "model_seq": 64,
                                    "threads": 0, "override": [], "student": "S", "teacher": "T", "data": "D"})
    models = {"student": tmp_path / "s", "teacher": tmp_path / "t"}
    for p in phases.values():
        cmd = gc.worker_cmd(args, p, tmp_path / "e.jsonl", models, tmp_path / "d.jsonl")
        assert cmd[cmd.index("--layer-spec") + 1] == "te" and cmd[cmd.index("--worker") + 1] == p["worker"]
        assert cmd[cmd.index("--fp8") + 1] == (p["fp8"] or "none")
    fp8 = phases["stable_opd-fp8-delayed"]
    args.preset, args.layer_spec, args.dtype, args.fp8 = fp8["preset"], "te", "bfloat16", "delayed"
    overrides = gc.preset_overrides(args)
    assert {"model.layer_spec=te", "model.fp8=delayed", "model.params_dtype=bfloat16",
            "parallel.backend=nccl"} <= set(overrides)
    cfg = load_config(None, overrides)
    assert (cfg.model.layer_spec, cfg.model.fp8) == ("te", "delayed")

    res = run([sys.executable, ROOT / "benchmarks" / "gpu_check.py", "--device", "cpu", "--dry-run"], timeout=60)
    cpu = json.loads(res.stdout)["phases"]
    assert all(p["layer_spec"] == "local" and p["fp8"] is None for p in cpu)
    res = run([sys.executable, ROOT / "benchmarks" / "gpu_check.py", "--device", "cpu", "--fp8", "delayed",
               "--dry-run"], timeout=60, expect="nonzero")
    assert "--fp8 delayed needs the Transformer Engine layer spec" in res.stderr, explain(res)
