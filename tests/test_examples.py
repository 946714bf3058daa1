"""The example configs in examples/: all load, the ablation rows differ only in the objective, and the
declared model shapes match the models they name."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from megatron_opd.config import PRESETS, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
ABLATION = {p: ROOT / "examples" / f"qwen2.5-math-1.5b_{p}.yaml" for p in ("opd", "opd_kl", "stable_opd")}


def test_expected_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {f.name for f in ABLATION.values()} <= names
    assert {"qwen2.5-math-7b_stable_opd.yaml", "llama-3.1-8b_70b-teacher_stable_opd.yaml", "cpu_tiny.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads(path: Path):
    cfg = load_config(path)
    raw = yaml.safe_load(path.read_text())
    # every key written in the file survived loading (no silently ignored section)
    def check(obj, values: dict, where: str) -> None:
        for key, value in values.items():
            got = getattr(obj, key)
            if isinstance(value, dict) and not isinstance(got, dict):  # a nested section (train.health)
                check(got, value, f"{where}.{key}")
                continue
            if isinstance(value, str) and value.startswith("~"):
                value = os.path.expanduser(value)
            assert got == value or (isinstance(value, int) and got == float(value)), f"{path.name}: {where}.{key}"

    for section, values in raw.items():
        check(getattr(cfg, section), values, section)
    # TP / PP divide the declared student shape (validate() also checks; this pins the declaration)
    m, p = cfg.model, cfg.parallel
    assert m.num_attention_heads is not None and m.num_query_groups is not None and m.num_layers is not None
    assert m.num_attention_heads % p.tensor_model_parallel_size == 0
    assert m.num_query_groups % p.tensor_model_parallel_size == 0
    assert m.num_layers % p.pipeline_model_parallel_size == 0
    assert cfg.rollout.temperature == 1.0, "on-policy sampling: the student's own distribution"


def test_ablation_rows_differ_only_in_objective():
    loaded = {p: yaml.safe_load(f.read_text()) for p, f in ABLATION.items()}
    base = loaded["stable_opd"]
    for preset, raw in loaded.items():
        assert set(raw) == set(base)
        for section in raw:
            if section in ("algo", "logging"):
                continue
            assert raw[section] == base[section], f"{preset}: section {section} differs from stable_opd"
        assert raw["logging"]["out_dir"].endswith(preset), "each row needs its own output dir"
        assert raw["algo"]["preset"] == preset
        cfg = load_config(ABLATION[preset])
        # the explicit values agree with what the preset itself would fill in
        for key, value in PRESETS[preset].items():
            assert getattr(cfg.algo, key) == value, f"{preset}: algo.{key}"


def test_paper_settings():
    for path in [*ABLATION.values(), ROOT / "examples" / "qwen2.5-math-7b_stable_opd.yaml"]:
        cfg = load_config(path)
        assert cfg.optim.lr == 1e-6
        assert cfg.rollout.max_new_tokens == 8192
        assert 4 <= cfg.rollout.n_samples_per_prompt <= 8
        assert cfg.model.family == "qwen2" and "Qwen2.5-Math" in cfg.model.hf_path
    cfg = load_config(ABLATION["stable_opd"])
    assert (cfg.algo.lambda_gold, cfg.algo.mixture_ratio) == (1.0, 0.25)
    assert 0.01 <= cfg.algo.beta_kl <= 0.05


def test_70b_teacher_layout_divides_the_model():
    cfg = load_config(ROOT / "examples" / "llama-3.1-8b_70b-teacher_stable_opd.yaml")
    t = cfg.teacher
    # Llama-3.3-70B: 64 heads, 8 KV groups, 80 layers
    assert 64 % t.tensor_model_parallel_size == 0 and 8 % t.tensor_model_parallel_size == 0
    assert 80 % t.pipeline_model_parallel_size == 0
    assert t.tensor_model_parallel_size * t.pipeline_model_parallel_size == 16  # two 8-GPU nodes
    assert cfg.model.family == "llama", "the teacher's tokenizer must be the student's"


@pytest.mark.megatron
def test_cpu_tiny_runs_as_its_header_says(tmp_path, monkeypatch):
    """examples/cpu_tiny.yaml's two commands, from a repository-like working directory: the demo writes the
    tiny inputs where the YAML reads them, and `megatron-opd train --config examples/cpu_tiny.yaml` trains,
    evaluates and exports. (Before, its model paths were made by no documented command.)"""
    from megatron_opd import demo
    from megatron_opd.trainer import cli
    from megatron_opd.trainer.logger import read_metrics

    header = [l[1:].strip() for l in (ROOT / "examples" / "cpu_tiny.yaml").read_text().splitlines()
              if l.startswith("#   megatron-opd")]
    assert [h.split("#")[0].split() for h in header] == [
        ["megatron-opd", "demo", "--tiny", "--inputs-only", "--out", "runs/cpu_tiny"],
        ["megatron-opd", "train", "--config", "examples/cpu_tiny.yaml"]]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "cpu_tiny.yaml", tmp_path / "examples")
    assert demo.main(["--tiny", "--inputs-only", "--out", "runs/cpu_tiny", "--cache", str(tmp_path / "cache")]) == 0
    cfg = load_config("examples/cpu_tiny.yaml")
    hf = json.loads((Path(cfg.model.hf_path) / "config.json").read_text())
    assert (cfg.model.num_attention_heads, cfg.model.num_query_groups, cfg.model.num_layers) == (
        hf["num_attention_heads"], hf["num_key_value_heads"], hf["num_hidden_layers"])
    assert cfg.parallel.backend == "gloo" and cfg.model.layer_spec == "local"
    assert cfg.train.steps * cfg.train.prompts_per_step * cfg.rollout.n_samples_per_prompt <= 16, "keep it tiny"
    assert cli.main(["--config", "examples/cpu_tiny.yaml"]) == 0
    rows = read_metrics("runs/cpu_tiny/run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["rollout/num_golden"] >= 1 and "eval/accuracy" in rows[-1]
    assert (tmp_path / "runs/cpu_tiny/run/hf/model.safetensors").is_file()


@pytest.mark.parametrize("script", sorted((ROOT / "scripts" / "slurm").glob("*.sbatch")), ids=lambda p: p.name)
def test_sbatch_default_config_exists_and_loads(script: Path):
    match = re.search(r'^CONFIG="\$\{CONFIG:-([^}]+)\}"', script.read_text(), re.M)
    assert match, f"{script.name}: no CONFIG default"
    cfg = load_config(ROOT / match.group(1))
    assert cfg.rollout.backend == "sglang" and cfg.teacher.backend == "sglang"
