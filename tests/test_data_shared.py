"""Real data beside the project (../shared/data; skipped when absent): loading at full size and
agreement between golden solutions and their reference answers under our extraction + math-verify."""

from __future__ import annotations

import json
import random

import pytest
from math_verify import parse, verify

from megatron_opd.config import DataConfig
from megatron_opd.data.prompts import iter_rows, load_prompts
from megatron_opd.data.toy_tokenizer import byte_tokenizer
from megatron_opd.eval.benchmarks import evaluate, load_benchmark
from megatron_opd.eval.grading import answers_equivalent, extract_boxed, grade_response
from megatron_opd.rollout.base import Sample

# byte tokenizer: 1 token per byte; MATH problems are up to a few thousand bytes
CFG = DataConfig(max_prompt_tokens=8192)


def test_math_train_golden_answers_verify(shared_data):
    tok = byte_tokenizer()
    path = shared_data / "math_train.jsonl"
    rows = [row for _, row in iter_rows(path)]
    assert len(rows) == 7500 and all(isinstance(r, dict) for r in rows)
    # the full pipeline (extraction + grading) on every golden solution: measured 7490/7500. The other 10
    # box several answers side by side (`\\boxed{12}` and `\\boxed{18}`), which the grader reads as one
    # multi-answer, while MATH's `answer` keeps only the last box; against all the boxes they are right
    wrong = [r for r in rows if not grade_response(r["solution"], r["answer"]).correct]
    assert len(wrong) <= 10, [r["id"] for r in wrong]
    for r in wrong:
        assert len(r.get("all_boxed", [])) >= 2, r["id"]
        assert grade_response(r["solution"], ", ".join(r["all_boxed"])).correct, r["id"]
    ps = load_prompts(path, CFG, tok, require_solution=True, limit=400)
    assert len(ps) == 400 and ps.bad == [] and all(r.solution_ids[-1] == tok.eos_token_id for r in ps)
    # math-verify itself, no exact-string shortcut, on a fixed random sample (measured 100%: 7500/7500)
    sample = random.Random(0).sample(ps.records, 150)
    ok = [answers_equivalent(extract_boxed(r.solution), r.answer, exact_shortcut=False) for r in sample]
    assert sum(ok) == len(sample)
    # math-verify's *own* extraction from the whole solution text agrees less often (measured 99.85% on
    # all 7500: it misses e.g. tuples like (8,38) and '150^\circ'); our last-\boxed rule is the reference
    gold = [verify(parse("\\boxed{" + r.answer + "}"), parse(r.solution)) for r in sample]
    assert sum(gold) / len(gold) >= 0.97


@pytest.mark.slow
def test_math_train_loads_in_full_with_solutions(shared_data):
    tok = byte_tokenizer()
    ps = load_prompts(shared_data / "math_train.jsonl", CFG, tok, require_solution=True)
    assert len(ps) == 7500 and ps.bad == [] and len({r.id for r in ps}) == 7500
    assert all(r.solution_ids[-1] == tok.eos_token_id and r.answer for r in ps)


def test_math500_golden_solutions_score_100_through_the_runner(shared_data):
    """Stand-in engine that answers each problem with its own golden solution (generation only is fake)."""
    tok = byte_tokenizer()
    ps = load_benchmark("math500", shared_data / "math500.jsonl", tok, CFG)
    assert len(ps) == 500
    solution = {r.prompt: r.solution for r in ps}

    class GoldEngine:
        eos_token_ids = [tok.eos_token_id]
        weight_version = 0

        def generate(self, prompts, sampling):
            out = []
            for i, ids in enumerate(prompts):
                rid = tok(solution[tok.decode(ids)], add_special_tokens=False)["input_ids"] + self.eos_token_ids
                out += [Sample(i, ids, rid, [0.0] * len(rid), "stop")] * sampling.n
            return out

    (res,) = evaluate(GoldEngine(), tok, {"math500": ps}, k=1, batch_size=128)
    assert res.metrics["avg@1"] == 1.0 and res.metrics["grader_errors"] == 0


def test_gsm8k_rationales_last_number_fallback(shared_data):
    """GSM8K rationales carry no box; the last-number rule recovers the answer in most of them
    (measured 97.2% on test, 1282/1319; misses end with a trailing count like 'in 40 minutes')."""
    rows = [json.loads(line) for line in (shared_data / "gsm8k_test.jsonl").read_text().splitlines()]
    assert len(rows) == 1319
    rate = sum(grade_response(r["solution_clean"], r["answer"]).correct for r in rows) / len(rows)
    assert 0.95 <= rate < 1.0


def test_grade_audit_on_math500_meets_the_acceptance_bar(shared_data):
    """Issue 13's bar on the public MATH-500 file: reference answers written as models write them graded
    correct >= 99.5%, perturbed answers graded wrong >= 99.5% (measured 100% / 100%: 968 and 1003 cases)."""
    from megatron_opd.eval.audit import audit_rows
    from megatron_opd.eval.benchmarks import read_benchmark_rows

    rows, skipped = read_benchmark_rows("math500", shared_data / "math500.jsonl")
    assert len(rows) == 500 and skipped == []
    res = audit_rows("math500", rows)
    assert res.reference_cases > 900 and res.perturbed_cases > 900
    assert res.accept_rate >= 0.995, res.false_rejects[:5]
    assert res.reject_rate >= 0.995, res.false_accepts[:5]
