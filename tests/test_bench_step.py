"""benchmarks/bench_step.py runs end to end (tiny models: ours and TRL's DistillationTrainer, the `bench`
extra the Makefile installs) and its arithmetic is right. Speed is the benchmark's business, not a test's:
nothing here asserts a time."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from _proc import explain, run

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_step.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_step", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_and_table_arithmetic():
    b = _module()
    run = lambda walls, rss: {"steps": [{"wall_s": 99.0, "cpu_s": 99.0, "warmup": True}]  # noqa: E731
                              + [{"wall_s": w, "cpu_s": 2 * w, "warmup": False, "time/train_s": w / 2}
                                 for w in walls], "peak_rss_mb": rss, "threads": 2}
    ours = b.summarise([run([1.0, 3.0], 1000.0), run([2.0], 1500.0)])
    assert ours["step_s"] == 2.0 and ours["cpu_s"] == 4.0 and ours["peak_rss_mb"] == 1500.0
    assert ours["timed_steps"] == 3 and ours["time/train_s"] == 1.0
    trl = b.summarise([run([4.0], 3000.0)])
    text = b.table({"TRL DistillationTrainer": trl, "ours": ours, "peer gone": {"missing": "not installed"}},
                   "TRL DistillationTrainer")
    assert "| ours | 2.00 s | 4.0 | 1.46 GB | 0.50x | 0.50x |" in text
    assert "| peer gone | not installed |" in text and "ours: train 1.00 s" in text


def test_bad_arguments_are_refused():
    proc = run([sys.executable, SCRIPT, "--only", "ours,nope"], timeout=60, expect=2)
    assert "--only: unknown ['nope']" in proc.stderr, explain(proc)
    proc = run([sys.executable, SCRIPT, "--only", "before"], timeout=60, expect=2)
    assert "--before REV" in proc.stderr, explain(proc)


@pytest.mark.slow  # > 15 s: the slow CI leg runs it
@pytest.mark.timeout(300)
def test_tiny_run_ours_and_trl(tmp_path):
    """Both trainers run on the tiny pair; every row has timed steps and a peak RSS; ours has its breakdown."""
    out = tmp_path / "bench.json"
    proc = run([sys.executable, SCRIPT, "--tiny", "--steps", "1", "--warmup", "0", "--rounds", "1",
                "--seqs", "2", "--new-tokens", "8", "--presets", "opd,stable_opd",
                "--cache", tmp_path / "cache", "--json", out], timeout=280, cwd=str(REPO))
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"TRL DistillationTrainer", "megatron-opd opd", "megatron-opd stable_opd"}
    for name, r in rows.items():
        assert r["timed_steps"] == 1 and r["step_s"] > 0 and r["cpu_s"] > 0 and r["peak_rss_mb"] > 100, name
    for name in ("megatron-opd opd", "megatron-opd stable_opd"):
        assert {"time/rollout_s", "time/train_s", "time/sync_s"} <= rows[name].keys()
    assert "| TRL DistillationTrainer |" in proc.stdout and "1.00x" in proc.stdout


def test_varied_workload_shapes_every_rollout_the_same_way():
    """`--varied`: lengths drawn from VARIED_LENGTHS (scaled to the budget), the same for every run of a
    step; responses cut or extended by repeating their own tokens; one at the budget is truncated."""
    from megatron_opd.rollout.base import Sample, SamplingParams

    b = _module()
    lengths = [b.varied_length(7, row, 256) for row in range(200)]
    assert set(lengths) <= set(b.VARIED_LENGTHS) and len(set(lengths)) > 10
    assert lengths == [b.varied_length(7, row, 256) for row in range(200)]
    assert [b.varied_length(7, row, 128) for row in range(5)] == [round(n / 2) for n in lengths[:5]]

    class Engine:
        def generate(self, prompts, sampling):
            assert sampling.max_new_tokens == 3
            return [Sample(i, p, [10 + i, 20 + i, 2], [-1.0] * 3, "stop") for i, p in enumerate(prompts)]

    engine = Engine()
    b.shape_rollouts(engine, 3, 256)
    out = engine.generate([[1], [2], [3]], SamplingParams(max_new_tokens=256, temperature=1.0, seed=7))
    for row, s in enumerate(out):
        n = lengths[row]
        assert len(s.response_ids) == n == len(s.logprobs)
        assert s.response_ids == ([10 + row, 20 + row, 2] * n)[:n]
        assert s.truncated == (n == 256)


@pytest.mark.slow  # > 15 s: the slow CI leg runs it
@pytest.mark.timeout(300)
def test_tiny_varied_run_packed_has_no_padding(tmp_path):
    """The varied workload end to end: padded micro-batches pad, packed ones do not; the phases table is printed."""
    out = tmp_path / "bench.json"
    proc = run([sys.executable, SCRIPT, "--tiny", "--only", "ours", "--varied", "--steps", "1",
                "--warmup", "0", "--rounds", "1", "--seqs", "4", "--new-tokens", "32", "--gen-tokens", "4",
                "--presets", "opd,opd:train.max_tokens_per_microbatch=256:train.pack_sequences=true",
                "--cache", tmp_path / "cache", "--json", out], timeout=280, cwd=str(REPO))
    rows = json.loads(out.read_text())["rows"]
    padded, packed = rows["megatron-opd opd"], rows["megatron-opd opd:train.max_tokens_per_microbatch=256:train.pack_sequences=true"]
    assert padded["batch/padding_fraction"] > 0 and packed["batch/padding_fraction"] == 0
    assert "| run | score + train | speed-up vs first |" in proc.stdout and "1.00x" in proc.stdout
    proc = run([sys.executable, SCRIPT, "--varied"], timeout=60, expect=2)
    assert "--only ours" in proc.stderr, explain(proc)
