"""benchmarks/gpu_check.sh + gpu_check.py (the GPU readiness check) at toy size on this CPU: the same
code path the device runs (wheel selection and install, megatron model check, the real Trainer for both
presets, the RNG restore, the SIGKILL + resume, dynamic batching + packing, the planner table, the JSON
report), the summary arithmetic and pass/fail rules on synthetic events, the phase plan a GPU would run
(--dry-run), and a worker failure's report. Nothing here has CUDA, Transformer Engine or SGLang: their
branches are listed by the dry run, and the sglang phase's "not installed" path runs for real."""

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


@pytest.mark.slow
@pytest.mark.megatron
def test_cpu_tiny_end_to_end(tmp_path: Path):
    """`gpu_check.sh --cpu-tiny`, every phase that runs on a CPU (the CPU stand-ins: local spec, torch's Adam,
    cpu_compat's RNG tracker, no allocator peak), with a wheel dir exercising each selection rule."""
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
    assert [p["name"] for p in report["plan"]] == ["model", "packed", "ckpt", "rng", "resume", "dynbatch",
                                                   "stable_opd", "opd", "memplan", "sglang"]  # no FP8 on CPU

    rng = report["phases"]["rng"]  # through a checkpoint file and back: every stream draws the same again
    assert rng["status"] == "ok" and rng["tracker_kind"] == "cpu" and not rng["cuda_state_saved"]
    assert set(rng["streams"]) == {"torch_cpu", "python", "numpy", "tracker:model-parallel-rng"}
    assert all(v["restored_equal"] and v["advanced"] for v in rng["streams"].values())

    resume = report["phases"]["resume"]  # SIGKILLed after step 4, resumed from step 2's checkpoint
    assert resume["status"] == "ok", resume.get("error")
    assert resume["killed_returncode"] == -9 and resume["checkpoint"] == "step_00000002"
    assert resume["resumed_at_step"] == 2 and resume["compared_steps"] == [3, 4]
    assert resume["optimizer"]["inner"] == ["torch.optim.adamw.AdamW"] and resume["te_fused_adam"] is False
    for step in ("3", "4"):
        keys = resume["steps"][step]["keys"]
        assert set(keys) >= {"loss/grad_norm", "loss/pg_loss", "logp/teacher_mean"}
        assert all(v["ok"] for v in keys.values())

    dyn = report["phases"]["dynbatch"]
    assert dyn["status"] == "ok", dyn.get("error")
    assert dyn["format"] == "mask" and dyn["same_rollouts"] and dyn["padding_fraction"]["packed"] == 0.0
    assert dyn["keys"]["loss/grad_norm"]["ok"] and dyn["tol"] == {"rel": 1e-4, "abs": 1e-7}

    memplan = report["phases"]["memplan"]  # on CPU the predictions only, one row per trainer run
    assert memplan["status"] == "ok" and "CPU stand-in" in memplan["note"]
    runs = {(c["phase"], c["run"]) for c in memplan["configs"]}
    assert runs == {("resume", "resume (killed run)"), ("dynbatch", "dynbatch (fixed)"),
                    ("dynbatch", "dynbatch (packed)"), ("stable_opd", "stable_opd"), ("opd", "opd")}
    assert all(c["predicted_gb"] > 0 and c["measured_gb"] is None for c in memplan["configs"])
    assert report["summary"]["memplan"]["configs"] and report["findings"] == []

    sglang = report["phases"]["sglang"]  # not importable here: reported, not a failure
    assert sglang == {"status": "not installed, not run", "ran": False}
    assert "sglang: not installed, not run" in log and report["not_run"] == {"sglang": "not installed, not run"}


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


@pytest.mark.slow
@pytest.mark.megatron
def test_worker_failure_is_reported(tmp_path: Path):
    """A preset worker that fails (here: an invalid override, rejected by load_config) gives exit 1 and a
    report naming the phase and carrying the error text."""
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    skip = ["--no-model-check", "--no-packed-check", "--no-ckpt-check", "--no-rng-check", "--no-resume-check",
            "--no-dynbatch-check", "--no-memplan-check", "--no-sglang-check"]
    run([sys.executable, ROOT / "benchmarks" / "gpu_check.py", "--size", "tiny", "--device", "cpu", "--presets", "opd",
         *skip, "--override", "train.micro_batch_size=-1", "--workdir", tmp_path / "work", "--out", out],
        cwd=tmp_path, env=env, timeout=180, expect=1)
    report = json.loads(out.read_text())
    assert report["status"] == "failed: opd"
    ph = report["phases"]["opd"]
    assert ph["status"] == "failed (exit 1)"
    assert "micro_batch_size" in ph["error"] and "ConfigError" in ph["error"] and ph["traceback"]
    assert report["summary"]["opd"]["error"] == ph["error"] and report["summary"]["status"] == report["status"]
    assert list(report["phases"]) == ["opd"]


def test_help_and_usage():
    res = run(["bash", SCRIPT, "--help"], timeout=30)
    assert "--fetch-wheels" in res.stdout and 'carry=[".whl"]' in res.stdout, explain(res)
    res = run(["bash", SCRIPT, "--fetch-wheels", "extra"], timeout=30, expect=2)
    assert "takes no arguments" in res.stderr, explain(res)


def test_dry_run_on_cuda_builds_the_default_gpu_path(tmp_path: Path):
    """What the check would run on a GPU, checked here: every phase on the Transformer Engine spec, FP8 phases
    for the model and a preset (`delayed`), the CPU-written checkpoint loaded into TE, the GPU-only checks (CUDA
    RNG restore, resume through TE's FusedAdam, THD packing vs fixed micro-batches, the planner against the
    allocator peak, SGLang when importable) each with what it checks and its criterion, and each phase's worker
    command and trainer config carrying that spec and recipe (the config passes the trainer's validation)."""
    from megatron_opd.config import load_config

    gc = _gpu_check()
    res = run([sys.executable, ROOT / "benchmarks" / "gpu_check.py", "--device", "cuda", "--dry-run"], timeout=60)
    planned = json.loads(res.stdout)
    phases = {p["name"]: p for p in planned["phases"]}
    assert planned["dtype"] == "bfloat16" and list(phases) == [
        "model", "model-fp8-delayed", "packed", "ckpt", "rng", "resume", "dynbatch", "stable_opd", "opd",
        "stable_opd-fp8-delayed", "memplan", "sglang"]
    assert all(p["layer_spec"] == "te" for p in phases.values())
    assert all(p["checks"] and p["criterion"] and p["cost"] >= 0 for p in phases.values())
    assert [n for n, p in phases.items() if p["fp8"]] == ["model-fp8-delayed", "stable_opd-fp8-delayed"]
    assert phases["ckpt"]["written_by"].startswith("cpu")
    # the new GPU-only phases, with their criteria
    rng = phases["rng"]
    assert "torch.cuda" in rng["checks"] and "'model-parallel-rng'" in rng["checks"]
    assert "exactly the same after the restore" in rng["criterion"] and "CUDA state" in rng["criterion"]
    resume = phases["resume"]
    assert "SIGKILL" in resume["checks"] and "TE's FusedAdam" in resume["checks"]
    assert "rel 1e-05, abs 1e-07" in resume["criterion"] and "loss/grad_norm" in resume["criterion"]
    assert "inner optimizer is TE's FusedAdam" in resume["criterion"]
    dyn = phases["dynbatch"]
    assert "train.max_tokens_per_microbatch=512" in dyn["checks"] and "THD" in dyn["checks"]
    assert "within rel 0.005 / abs 0.005 (bfloat16)" in dyn["criterion"] and "pads nothing" in dyn["criterion"]
    memplan = phases["memplan"]
    assert memplan["worker"] == "derived" and memplan["cost"] == 0
    assert "torch.cuda.max_memory_allocated" in memplan["checks"] and "plan_run" in memplan["checks"]
    assert "[0.85, 1.15]" in memplan["criterion"] and "finding" in memplan["criterion"]
    sglang = phases["sglang"]
    assert sglang["optional"] and "not installed, not run" in sglang["runs_if"]
    assert "update_weights_from_distributed" in sglang["checks"] and "NCCL" in sglang["checks"]
    assert "<= 0.1 (bfloat16)" in sglang["criterion"]

    args = gc.argparse.Namespace(**{**vars(gc.argparse.Namespace()), "device": "cuda", "workdir": str(tmp_path),
                                    "size": "tiny", "warmup": 1, "steps": 2, "prompts_per_step": 2,
                                    "samples_per_prompt": 2, "max_new_tokens": 8, "micro_batch_size": 4,
                                    "model_batch": 2, "model_seq": 64, "threads": 0, "override": [],
                                    "student": "S", "teacher": "T", "data": "D"})
    models = {"student": tmp_path / "s", "teacher": tmp_path / "t"}
    for p in phases.values():
        if p["worker"] == "derived":
            continue
        cmd = gc.worker_cmd(args, p, tmp_path / "e.jsonl", models, tmp_path / "d.jsonl")
        assert cmd[cmd.index("--layer-spec") + 1] == "te" and cmd[cmd.index("--worker") + 1] == p["worker"]
        assert cmd[cmd.index("--fp8") + 1] == (p["fp8"] or "none") and cmd[cmd.index("--size") + 1] == "tiny"
    fp8 = phases["stable_opd-fp8-delayed"]
    args.preset, args.layer_spec, args.dtype, args.fp8 = fp8["preset"], "te", "bfloat16", "delayed"
    overrides = gc.preset_overrides(args)
    assert {"model.layer_spec=te", "model.fp8=delayed", "model.params_dtype=bfloat16",
            "parallel.backend=nccl"} <= set(overrides)
    cfg = load_config(None, overrides)
    assert (cfg.model.layer_spec, cfg.model.fp8) == ("te", "delayed")
    # the resume and dynbatch runs: TE, bf16, NCCL, no FP8, and the settings their comparisons need
    args.fp8 = None
    resume_cfg = load_config(None, gc.check_overrides(args, tmp_path / "r", 4, "checkpoint.save_every=2",
                                                      "checkpoint.resume=auto"))
    assert (resume_cfg.model.layer_spec, resume_cfg.model.fp8, resume_cfg.parallel.backend) == ("te", None, "nccl")
    assert (resume_cfg.checkpoint.save_every, resume_cfg.checkpoint.resume, resume_cfg.algo.preset) == (
        2, "auto", "stable_opd")
    packed_cfg = load_config(None, gc.check_overrides(args, tmp_path / "p", 1, "train.max_tokens_per_microbatch=512",
                                                      "train.pack_sequences=true"))
    assert packed_cfg.train.pack_sequences and packed_cfg.train.max_tokens_per_microbatch == 512

    res = run([sys.executable, ROOT / "benchmarks" / "gpu_check.py", "--device", "cpu", "--dry-run"], timeout=60)
    cpu = {p["name"]: p for p in json.loads(res.stdout)["phases"]}
    assert all(p["layer_spec"] == "local" and p["fp8"] is None for p in cpu.values())
    assert "CPU stand-in" in cpu["rng"]["checks"] and "CPU stand-in" in cpu["memplan"]["criterion"]
    assert "block-mask" in cpu["dynbatch"]["checks"] and "(float32)" in cpu["dynbatch"]["criterion"]
    res = run([sys.executable, ROOT / "benchmarks" / "gpu_check.py", "--device", "cuda", "--dry-run",
               "--no-rng-check", "--no-resume-check", "--no-dynbatch-check", "--no-memplan-check",
               "--no-sglang-check"], timeout=60)
    assert [p["name"] for p in json.loads(res.stdout)["phases"]] == [
        "model", "model-fp8-delayed", "packed", "ckpt", "stable_opd", "opd", "stable_opd-fp8-delayed"]
    res = run([sys.executable, ROOT / "benchmarks" / "gpu_check.py", "--device", "cpu", "--fp8", "delayed",
               "--dry-run"], timeout=60, expect="nonzero")
    assert "--fp8 delayed needs the Transformer Engine layer spec" in res.stderr, explain(res)


def test_compare_metrics_is_pytest_approx():
    """The resume and dynbatch comparison: |got - want| <= max(rel * |want|, abs), as pytest.approx; equal
    non-finite values match; a key the compared run lacks fails; keys the reference lacks are not compared."""
    gc = _gpu_check()
    keys = ("a", "b", "c", "d")
    out = gc.compare_metrics({"a": 1.0, "b": 0.0, "c": float("nan")},
                             {"a": 1.0 + 0.9e-5, "b": 5e-8, "c": float("nan")}, keys, 1e-5, 1e-7)
    assert out["ok"] and set(out["keys"]) == {"a", "b", "c"} and out["worst_key"] == "a"
    assert out["keys"]["a"]["of_allowed"] == pytest.approx(0.9, rel=1e-3)
    for want, got in (({"a": 1.0}, {"a": 1.0 + 2e-5}), ({"b": 0.0}, {"b": 2e-7}), ({"a": 1.0}, {"a": float("nan")}),
                      ({"a": 1.0}, {})):
        bad = gc.compare_metrics(want, got, keys, 1e-5, 1e-7)
        assert not bad["ok"] and bad["worst_key"] == next(iter(want)), (want, got)
        assert bad["ok"] == (got.get(next(iter(want))) == pytest.approx(want[next(iter(want))], rel=1e-5, abs=1e-7))
    same = gc.compare_metrics({"a": 2.0}, {"a": 2.0}, keys, 1e-5, 1e-7)
    assert same["ok"] and same["worst_key"] is None
    assert not gc.compare_metrics({}, {"a": 1.0}, keys, 1e-5, 1e-7)["ok"]  # nothing compared proves nothing


def test_planned_peak_counts_the_phases_the_run_went_through():
    """The planner's peak as torch.cuda.max_memory_allocated sees it: held components plus the largest phase the
    run had (a run without a checkpoint save never reaches the save phase), less the CUDA context / NCCL and the
    allocator slack (not tensors). A plan without phases counts every component as held."""
    gc = _gpu_check()
    comps = [{"name": "student weights", "gb": 1.0, "phase": ""},
             {"name": "activations", "gb": 2.0, "phase": "training"},
             {"name": "rollout engine KV cache", "gb": 0.5, "phase": "rollout"},
             {"name": "checkpoint save: optimizer gather buffers", "gb": 4.0, "phase": "save"},
             {"name": "allocator slack", "gb": 0.3, "phase": ""},
             {"name": "CUDA context + NCCL", "gb": 1.1, "phase": ""}]
    run_only = gc.planned_peak(comps, ("rollout", "training"))
    assert run_only["predicted_gb"] == pytest.approx(3.0) and run_only["worst_phase"] == "training"
    assert run_only["not_allocated_gb"] == {"allocator slack": 0.3, "CUDA context + NCCL": 1.1}
    with_save = gc.planned_peak(comps, ("rollout", "training", "save"))
    assert with_save["predicted_gb"] == pytest.approx(5.0) and with_save["worst_phase"] == "save"
    old = gc.planned_peak([{"name": "student weights", "gb": 1.0}, {"name": "activations", "gb": 2.0}], ("training",))
    assert old["predicted_gb"] == pytest.approx(3.0) and old["worst_phase"] is None


def test_memory_plan_calls_the_planner(tmp_path: Path):
    """memory_plan goes through megatron_opd.plan's public API as `megatron-opd plan` does (default_cluster,
    arch_from, plan_run) and reads a trainer rank's components (only config.json files are needed)."""
    from megatron_opd.config import load_config

    gc = _gpu_check()
    for name, layers in (("s", 2), ("t", 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({
            "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 259, "tie_word_embeddings": False}))
    cfg = load_config(None, [f"model.hf_path={tmp_path / 's'}", f"teacher.hf_path={tmp_path / 't'}",
                             "teacher.backend=megatron", "rollout.max_new_tokens=8"])
    p = gc.memory_plan(cfg, "cpu", ("rollout", "training"))
    assert p["predicted_gb"] >= p["held_gb"] > 0 and p["worst_phase"] in ("rollout", "training", None)
    assert "student weights" in p["components"] and "teacher weights (in-process)" in p["components"]


def _plans(*rows):
    return [{"run": run, "predicted_gb": pred, "measured_gb": meas, "ratio": pred / meas if meas else None}
            for run, pred, meas in rows]


def test_memplan_ratio_outside_the_band_is_a_finding_not_a_failure():
    gc = _gpu_check()
    phases = {"stable_opd": {"status": "ok", "memory_plans": _plans(("stable_opd", 10.0, 10.0))},
              "opd": {"status": "ok", "memory_plans": _plans(("opd", 13.0, 10.0))},
              "dynbatch": {"status": "ok", "memory_plans": _plans(("dynbatch (fixed)", 8.0, 10.0),
                                                                  ("dynbatch (packed)", 8.6, 10.0))}}
    out = gc.summarise_memplan(phases, "cuda")
    assert out["status"] == "ok" and out["measured_configs"] == 4
    assert [f.split(":")[0] for f in out["findings"]] == ["opd (opd)", "dynbatch (dynbatch (fixed))"]
    assert "ratio 1.30 outside [0.85, 1.15]" in out["findings"][0]
    assert not gc.failed_phases({**phases, "memplan": out})

    two = gc.summarise_memplan({k: phases[k] for k in ("stable_opd", "opd")}, "cuda")
    assert two["status"].startswith("failed (2 of 3") and gc.failed_phases({"memplan": two}) == ["memplan"]
    broken = {**phases, "opd": {"memory_plans": [{"run": "opd", "error": "KeyError: 'gb'"}]}}
    assert gc.summarise_memplan(broken, "cuda")["status"] == "failed (planner error)"
    cpu = gc.summarise_memplan({"opd": {"memory_plans": _plans(("opd", 1.0, None))}}, "cpu")
    assert cpu["status"] == "ok" and cpu["findings"] == [] and "CPU stand-in" in cpu["note"]


def test_not_run_phases_and_failures():
    """sglang absent (or GPU-only on a CPU) is no failure; a phase cut by the time limit is one."""
    gc = _gpu_check()
    phases = {"model": {"status": "ok"}, "sglang": {"status": "not installed, not run", "ran": False},
              "opd": {"status": "not run (time limit)"}, "resume": {"status": "failed (exit 1)"}}
    assert gc.failed_phases(phases) == ["opd", "resume"]
    orig = gc.sglang_importable
    try:
        gc.sglang_importable = lambda: False
        assert gc.sglang_skip("cuda") == "not installed, not run" == gc.sglang_skip("cpu")
        gc.sglang_importable = lambda: True
        assert gc.sglang_skip("cuda") is None and "GPU-only" in gc.sglang_skip("cpu")
    finally:
        gc.sglang_importable = orig


def test_summaries_of_the_correctness_phases():
    """Each phase's status follows its own criterion event (a worker that exits 0 without `ok` still fails), and
    the summary block carries the numbers the criterion reads."""
    gc = _gpu_check()
    step = {"keys": {"loss/grad_norm": {"want": 1.0, "got": 1.0, "abs_diff": 0.0, "ok": True}}, "ok": True,
            "worst_key": None}
    evs = [{"event": "killed", "returncode": -9, "latest": "step_00000002", "killed_s": 5.0},
           {"event": "killed_plan", "run": "resume (killed run)", "predicted_gb": 2.0, "components": {}},
           {"event": "resumed_init", "step": 2, "optimizer": {"inner": ["x.FusedAdam"]}},
           {"event": "resume", "compared_steps": [3, 4], "resumed_at_step": 2, "ok": True, "te_fused_adam": True,
            "optimizer": {"inner": ["transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"]},
            "steps": {"3": step, "4": step}, "tol": {"rel": 1e-5, "abs": 1e-7}, "killed_peak_gb": 2.5},
           {"event": "done"}]
    out = gc.summarise_resume(evs, {"status": "ok"}, {}, None)
    assert out["status"] == "ok" and out["killed_returncode"] == -9 and out["compared_steps"] == [3, 4]
    assert out["memory_plans"][0]["ratio"] == pytest.approx(0.8)
    summ = gc._summary_of("resume", out, lambda x, n=4: x)
    assert summ["te_fused_adam"] and summ["diffs"]["4"]["loss/grad_norm"]["ok"]
    bad = [*evs[:3], {**evs[3], "ok": False}]
    assert gc.summarise_resume(bad, {"status": "ok"}, {}, None)["status"] == "failed (resumed steps differ)"

    assert gc.summarise_rng([{"event": "rng", "ok": False, "streams": {}}], {"status": "ok"}, {}, None)[
        "status"] == "failed (RNG not restored)"
    dyn = gc.summarise_dynbatch([{"event": "plan", "run": "dynbatch (fixed)", "predicted_gb": 3.0},
                                 {"event": "step", "run": "fixed", "memory": {"cuda_max_allocated_mib": 2861.0},
                                  "allocated_before_init_gb": 0.5},
                                 {"event": "dynbatch", "ok": True, "keys": {}}], {"status": "ok"}, {}, None)
    assert dyn["status"] == "ok"  # the peak less what was allocated before the run's trainer existed
    assert dyn["memory_plans"][0]["measured_gb"] == pytest.approx(2861 * 2**20 / 1e9 - 0.5)
    sg = gc.summarise_sglang([{"event": "server", "weight_sync_backend": "gloo"},
                              {"event": "sglang", "ok": False, "problems": ["prefill_gap 0.5 > 0.1"]}],
                             {"status": "ok"}, {}, None)
    assert sg["status"] == "failed (SGLang differs from megatron)" and sg["weight_sync_backend"] == "gloo"


@pytest.mark.megatron
def test_rng_phase_catches_an_incomplete_restore(tmp_path: Path, monkeypatch):
    """The rng phase in this process (CPU: cpu_compat's tracker): the trainer's set_rng_state restores every
    stream; a restore that leaves megatron's tracker out (what the pre-486d65b checkpoints did not save) fails."""
    from megatron_opd.trainer import checkpoint as tckpt

    gc = _gpu_check()
    args = gc.argparse.Namespace(device="cpu", workdir=str(tmp_path))
    ev = gc._Events(tmp_path / "e.jsonl")
    gc.worker_rng(args, ev)
    rng = next(e for e in gc._read_events(tmp_path / "e.jsonl") if e["event"] == "rng")
    assert rng["ok"] and rng["streams"]["tracker:model-parallel-rng"] == {"restored_equal": True, "advanced": True}

    real = tckpt.set_rng_state
    monkeypatch.setattr(tckpt, "set_rng_state", lambda state: real({k: v for k, v in state.items() if k != "tracker"}))
    with pytest.raises(RuntimeError, match="tracker:model-parallel-rng: differs after the restore"):
        gc.worker_rng(gc.argparse.Namespace(device="cpu", workdir=str(tmp_path / "again")), ev)
