"""`megatron-opd plan`: its formulas against real models and a measured run, the verdict, the CLI on every
example config, and bad input. The whole validation table is benchmarks/bench_plan.py's (docs/scaling.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_opd.config import load_config
from megatron_opd.plan import (GPUS, Arch, Cluster, activation_bytes, arch_from, gpu_from_name, plan_run,
                               stage_params, _layout)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _plan(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_opd.cli", "plan", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO))


def test_parameter_counts_equal_the_models(tmp_path):
    """Arch.params equals the HF model's parameter count; stage_params at TP1/PP1 equals megatron's."""
    from transformers import AutoModelForCausalLM

    from megatron_opd.models.gpt import build_gpt_model
    from megatron_opd.models.parallel import destroy_parallel, init_parallel
    from megatron_opd.models.tiny import make_tiny_hf_model

    for family, tied in (("qwen2", False), ("llama", True)):
        d = tmp_path / family
        make_tiny_hf_model(family, d, num_hidden_layers=3, tie_word_embeddings=tied)
        arch = arch_from(str(d), "model")
        hf = AutoModelForCausalLM.from_pretrained(str(d))
        assert arch.params == sum(p.numel() for p in hf.parameters()), family
        init_parallel(1, 1, "gloo")
        try:
            m = build_gpt_model(hf.config, layer_spec="local", params_dtype=torch.float32)
            vocab_pad = m.vocab_size - arch.vocab  # megatron pads the vocabulary; the plan counts the real one
            assert stage_params(arch, 1, 1) == sum(p.numel() for p in m.parameters()) - vocab_pad * arch.hidden * (
                1 if tied else 2)
        finally:
            destroy_parallel()


def test_activation_formula_matches_the_saved_tensors():
    """Per layer, what autograd saves in megatron's local spec (counted with saved-tensor hooks, one layer's
    difference) is the formula's 13·h + 4·ffn values per token plus the attention probabilities, within 5%."""
    from megatron_opd.models.gpt import build_gpt_model
    from megatron_opd.models.logprobs import forward_logits
    from megatron_opd.models.parallel import destroy_parallel, init_parallel
    from megatron_opd.models.tiny import tiny_hf_config

    def saved(layers: int, b: int, s: int) -> int:
        cfg = tiny_hf_config("llama", hidden_size=192, num_attention_heads=6, num_key_value_heads=2,
                             intermediate_size=512, num_hidden_layers=layers, vocab_size=256, head_dim=32)
        m = build_gpt_model(cfg, layer_spec="local", params_dtype=torch.float32)
        seen: dict[int, int] = {}

        def pack(t):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward_logits(m, torch.randint(0, 256, (b, s))).float().sum().backward()
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        return sum(v for k, v in seen.items() if k not in params)

    init_parallel(1, 1, "gloo")
    try:
        arch = Arch("t", 1, 192, 6, 2, 32, 512, 256, False)
        lay = _layout(load_config(None, []), 1)
        for b, s in ((1, 96), (2, 64)):
            measured = saved(3, b, s) - saved(2, b, s)
            predicted, _ = activation_bytes(arch, b * s, s, lay, 4, flash=False)
            assert predicted == pytest.approx(measured, rel=0.05), (b, s)
    finally:
        destroy_parallel()


def test_a_measured_tiny_run_is_within_15_percent():
    """One row of the validation table, measured here: a tiny opd run's allocator high-water mark."""
    import tempfile

    sys.path.insert(0, str(REPO / "benchmarks"))  # importable by name: its ranks are spawned processes
    import bench_plan

    with tempfile.TemporaryDirectory() as tmp:
        rows = bench_plan.run_config("tiny-opd", Path(tmp), timeout=600)
    assert len(rows) == 1 and rows[0]["measured_gb"] > 0.3
    assert abs(rows[0]["error"]) <= 0.15, rows[0]


def test_verdict_flips_below_the_total_and_names_the_largest_part():
    cfg = load_config(str(REPO / "examples" / "qwen2.5-math-7b_stable_opd.yaml"), [])
    student, teacher = arch_from(cfg.model.hf_path, "m"), arch_from(cfg.teacher.hf_path, "t")
    total = plan_run(cfg, Cluster(GPUS["h100-80gb"], 8, 4, 4), student, teacher)["ranks"][0]["total_gb"]
    fits = plan_run(cfg, Cluster(gpu_from_name(f"{total + 0.5:.1f}"), 8, 4, 4), student, teacher)
    short = plan_run(cfg, Cluster(gpu_from_name(f"{total - 0.5:.1f}"), 8, 4, 4), student, teacher)
    assert fits["verdicts"][0]["fits"] and not short["verdicts"][0]["fits"]
    largest = max(short["ranks"][0]["components"], key=lambda c: c["gb"])["name"]
    assert largest == "gradients" and short["verdicts"][0]["text"].startswith("does not fit by 0.5 GB (gradients")
    # fewer data-parallel ranks shard the optimizer less: more memory per rank
    dp2 = plan_run(cfg, Cluster(GPUS["h100-80gb"], 4, 4, 4), student, teacher)["ranks"][0]["total_gb"]
    assert dp2 > total


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_plan_runs_on_every_example(example, tmp_path):
    nodes = {"qwen2.5-math-7b_stable_opd": "2", "llama-3.1-8b_70b-teacher_stable_opd": "4"}.get(example.stem, "1")
    extra: list[str] = []
    if "cpu" in example.stem:  # the CPU examples' tiny models are made at run time: plan on the same kind
        from megatron_opd.demo import _tiny_models

        student, teacher = _tiny_models(tmp_path)
        extra = [f"model.hf_path={student}", f"teacher.hf_path={teacher}"]
        missing = _plan("--config", str(example), "model.hf_path=/nowhere/student")
        assert missing.returncode == 2 and "config.json not found" in missing.stderr
    res = _plan("--config", str(example), "--nodes", nodes, "--json", "-", *extra)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["fits"] and plan["ranks"][0]["role"].startswith("trainer rank")
    assert plan["time"]["step_s"] > 0 and plan["time"]["tokens_per_s_per_gpu"] > 0
    text = _plan("--config", str(example), "--nodes", nodes, "--gpu", "h200-141gb", *extra)
    assert text.returncode == 0 and "| **total** |" in text.stdout and ": fits (" in text.stdout


def test_does_not_fit_lists_layouts_that_do_and_strict_fails(tmp_path):
    cfg = str(REPO / "examples" / "qwen2.5-math-7b_stable_opd.yaml")
    res = _plan("--config", cfg, "--nodes", "2", "--gpu", "48", "model.recompute_activations=false")
    assert res.returncode == 0 and "does not fit by" in res.stdout and "WARNING" in res.stderr
    assert "layouts that fit:" in res.stdout and "TP" in res.stdout.split("layouts that fit:")[1]
    strict = _plan("--config", cfg, "--nodes", "2", "--gpu", "48", "model.recompute_activations=false", "--strict")
    assert strict.returncode == 1


def test_bad_inputs_get_one_clear_message(tmp_path):
    cfg = str(REPO / "examples" / "qwen2.5-math-1.5b_opd.yaml")
    res = _plan("--config", cfg, "--gpu", "a100-blue")
    assert res.returncode == 2 and "--gpu: unknown GPU 'a100-blue'" in res.stderr
    res = _plan("--config", cfg, "parallel.tensor_model_parallel_size=3")
    assert res.returncode == 2 and "tensor_model_parallel_size" in res.stderr
    res = _plan("--config", cfg, "--rollout-gpus", "4", "--teacher-gpus", "4")
    assert res.returncode == 2 and "leave no trainer GPU" in res.stderr
    res = _plan("--config", cfg, "model.hf_path=/nowhere/MyModel-3B")
    assert res.returncode == 2 and "'MyModel-3B' is not a known model" in res.stderr
    broken = tmp_path / "Broken-1B"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    res = _plan("--config", cfg, f"model.hf_path={broken}")
    assert res.returncode == 2 and "config.json has no num_attention_heads" in res.stderr
    res = _plan("--config", cfg, "train.micro_batch_size=0")
    assert res.returncode == 2 and "train.micro_batch_size" in res.stderr


def test_check_config_plans_the_trainer_ranks(tmp_path):
    """`launch check-config --plan-gpu` (what the sbatch scripts run first): a warning, or with --plan-strict
    an error, when the trainer ranks do not fit."""
    cfg = str(REPO / "examples" / "qwen2.5-math-7b_stable_opd.yaml")
    run = lambda *a, world="8": subprocess.run(  # noqa: E731
        [sys.executable, "-m", "megatron_opd.launch", "check-config", "--skip-paths", *a, "--config", cfg],
        capture_output=True, text=True, timeout=120, cwd=str(REPO), env={**__import__("os").environ, "WORLD_SIZE": world})
    ok = run("--plan-gpu", "h100-80gb")
    assert ok.returncode == 0 and "plan (h100-80gb, 8 trainer ranks): trainer rank: fits" in ok.stdout
    warn = run("--plan-gpu", "40", world="2")
    assert warn.returncode == 0 and "WARNING" in warn.stderr and "does not fit" in warn.stderr
    err = run("--plan-gpu", "40", "--plan-strict", world="2")
    assert err.returncode == 2 and "ERROR" in err.stderr
