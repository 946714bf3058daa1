"""Benchmark registry/loading, pass@k / avg@k, and the runner.

The engine here is a fake that stands in for *generation only* (it returns fixed response texts through
the real rollout contract); tokenization, answer extraction, math-verify grading, metrics and the
written tables are all real.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest

from megatron_opd.config import DataConfig
from megatron_opd.data.toy_tokenizer import byte_tokenizer
from megatron_opd.eval.benchmarks import (BENCHMARKS, evaluate, load_benchmark, pass_at_k, results_markdown,
                                          summarize)
from megatron_opd.rollout.base import Sample, SamplingParams


class FakeEngine:
    """Rollout-contract engine returning scripted texts: responses[problem][j] for sample j."""

    def __init__(self, tokenizer, responses: dict[str, list[str]], truncate: frozenset = frozenset()):
        self.tok, self.responses, self.truncate = tokenizer, responses, truncate
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.weight_version = 0
        self.calls: list[tuple[int, SamplingParams]] = []

    def generate(self, prompts, sampling):
        self.calls.append((len(prompts), sampling))
        out = []
        for i, ids in enumerate(prompts):
            text = self.tok.decode(ids)
            problem = next(p for p in self.responses if p in text)
            for j in range(sampling.n):
                resp = self.responses[problem][j]
                cut = (problem, j) in self.truncate
                rid = self.tok(resp, add_special_tokens=False)["input_ids"] + ([] if cut else self.eos_token_ids)
                out.append(Sample(i, list(ids), rid, [0.0] * len(rid), "length" if cut else "stop"))
        return out

    def update_weights(self, named_tensors, version, last_bucket=True):
        raise NotImplementedError

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_pass_at_k_matches_brute_force():
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert math.isclose(pass_at_k(n, c, k), brute, rel_tol=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_summarize_closed_form():
    m = summarize([[True, True, False, False], [False, True, False, False], [False] * 4])
    assert m["avg@4"] == pytest.approx((0.5 + 0.25 + 0) / 3)
    assert m["pass@1"] == pytest.approx(1 / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        summarize([[True], [True, False]])


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_registry_field_variants(tmp_path, tok):
    assert set(BENCHMARKS) >= {"math500", "minerva", "olympiadbench", "amc23", "aime24", "aime25"}
    ob = write(tmp_path / "ob.jsonl", [{"question": "Find x.", "final_answer": ["$\\frac{1}{2}$"]},
                                        {"question": "no answer"}])
    ps = load_benchmark("olympiadbench", ob, tok)
    assert len(ps) == 1 and ps[0].answer == "\\frac{1}{2}" and "Find x." in ps[0].prompt
    assert "missing field: none of ['final_answer', 'answer']" in ps.bad[0] and ps.bad[0].startswith(f"{ob}:2:")
    mi = write(tmp_path / "mi.jsonl", [{"problem": "Compute.", "solution": "so $\\boxed{3\\times 10^{8}}$ m/s"}])
    assert load_benchmark("minerva", mi, tok)[0].answer == "3\\times 10^{8}"
    ai = write(tmp_path / "ai.jsonl", [{"Problem": "AIME?", "Answer": 204}])
    assert load_benchmark("aime24", ai, tok)[0].answer == "204"
    with pytest.raises(KeyError, match="unknown benchmark 'gsm9k'"):
        load_benchmark("gsm9k", ai, tok)


def test_evaluate_end_to_end_metrics_and_files(tmp_path, tok):
    rows = [{"id": "p1", "problem": "What is half of one?", "answer": "\\frac{1}{2}"},
            {"id": "p2", "problem": "What is 2+2?", "answer": "4"},
            {"id": "p3", "problem": "Interval?", "answer": "[2,5)"}]
    path = write(tmp_path / "aime24.jsonl", rows)
    responses = {
        "half of one": ["It is \\boxed{0.5}.", "So $\\boxed{\\frac{2}{4}}$"],  # both correct (math-verify)
        "2+2": ["\\boxed{5}", "2+2 = 4. The answer is 4."],                   # wrong, then correct
        "Interval": ["I do not know.", "\\boxed{(2,5)}"],                     # no answer, wrong (open)
    }
    engine = FakeEngine(tok, responses, truncate=frozenset({("Interval", 0)}))
    sp = SamplingParams(max_new_tokens=64, temperature=0.7, seed=3)
    res = evaluate(engine, tok, {"aime24": path}, k=2, sampling=sp, out_dir=tmp_path / "out",
                   data_cfg=DataConfig(max_prompt_tokens=512), batch_size=2)
    assert [n for n, _ in engine.calls] == [2, 1]  # batched prompts
    assert all(s.n == 2 and s.temperature == 0.7 and s.seed == 3 for _, s in engine.calls)
    assert sp.n == 1  # caller's params untouched
    (r,) = res
    assert r.metrics["avg@2"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert r.metrics["pass@1"] == pytest.approx(1 / 3)
    assert r.metrics["pass@2"] == pytest.approx(2 / 3)
    lengths = [len(t.encode()) + (0 if (p, j) == ("Interval", 0) else 1)
               for p, ts in responses.items() for j, t in enumerate(ts)]
    assert r.metrics["mean_response_tokens"] == pytest.approx(sum(lengths) / 6)
    assert r.metrics["truncation_rate"] == pytest.approx(1 / 6)
    assert r.metrics["no_answer_rate"] == pytest.approx(1 / 6)  # "I do not know." has no number at all
    assert [s["status"] for s in r.samples] == ["correct", "correct", "incorrect", "correct", "no_answer", "incorrect"]
    assert r.metrics["grader_errors"] == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["results"]["aime24"]["avg@2"] == pytest.approx(r.metrics["avg@2"])
    assert saved["k"] == {"aime24": 2} and saved["results"]["aime24"]["k"] == 2 and "n" not in saved["sampling"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| aime24 | 3 | 2 | 50.0 | 33.3 | 66.7 |" in md
    lines = (tmp_path / "out" / "samples_aime24.jsonl").read_text().splitlines()
    assert len(lines) == 6 and json.loads(lines[0])["extracted"] == "0.5"


def test_engine_breaking_contract_is_reported(tmp_path, tok):
    class Short(FakeEngine):
        def generate(self, prompts, sampling):
            return super().generate(prompts, sampling)[:-1]

    path = write(tmp_path / "a.jsonl", [{"problem": "What is 2+2?", "answer": "4"}])
    with pytest.raises(RuntimeError, match="rollout contract"):
        evaluate(Short(tok, {"2+2": ["4", "4"]}), tok, {"aime25": path}, k=2)


def test_markdown_table_lists_each_benchmark(tok, tmp_path):
    path = write(tmp_path / "a.jsonl", [{"problem": "What is 2+2?", "answer": "4"}])
    res = evaluate(FakeEngine(tok, {"2+2": ["\\boxed{4}"]}), tok, {"amc23": path, "aime25": path}, k=1)
    md = results_markdown(res)
    assert md.count("| 100.0 |") == 2 and "| amc23 | 1 | 1 |" in md and "| aime25 | 1 | 1 |" in md
