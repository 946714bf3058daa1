"""Built-in arithmetic problems: deterministic, distinct, disjoint splits, golden solutions grade correct."""

from __future__ import annotations

import re

from megatron_opd.config import DataConfig
from megatron_opd.data.builtin import builtin_splits, make_arithmetic_problems, write_builtin_jsonl
from megatron_opd.data.prompts import load_prompts
from megatron_opd.data.toy_tokenizer import byte_tokenizer
from megatron_opd.eval.grading import grade_response


def _eval_worked_steps(solution: str) -> None:
    """Every 'a op b = c' in the worked solution must be true arithmetic."""
    for a, op, b, c in re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", solution):
        a, b, c = int(a), int(b), int(c)
        assert {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op] == c, solution


def test_deterministic_distinct_and_correct():
    rows = make_arithmetic_problems(300, seed=11)
    assert rows == make_arithmetic_problems(300, seed=11)
    assert rows != make_arithmetic_problems(300, seed=12)
    assert len({r["problem"] for r in rows}) == 300
    kinds = {r["kind"] for r in rows}
    assert kinds == {"add", "sub", "mul", "div", "two_step"}
    for r in rows:
        _eval_worked_steps(r["solution"])
        last = re.findall(r"= (\d+)", r["solution"])[-1]
        assert last == r["answer"] and int(r["answer"]) >= 0
        assert r["solution"].endswith(f"\\boxed{{{r['answer']}}}$.")
        assert len(r["problem"]) < 160  # short enough for a 135M teacher on CPU


def test_splits_disjoint_and_golden_solutions_grade_correct(tmp_path):
    train, evals = builtin_splits(200, 50, seed=0)
    assert len(train) == 200 and len(evals) == 50
    assert not {r["problem"] for r in train} & {r["problem"] for r in evals}
    assert all(grade_response(r["solution"], r["answer"]).correct for r in evals)
    paths = write_builtin_jsonl(tmp_path, 200, 50, seed=0)
    tok = byte_tokenizer()
    ps = load_prompts(paths["train"], DataConfig(max_prompt_tokens=512), tok, require_solution=True)
    assert len(ps) == 200 and ps.bad == [] and all(r.has_solution for r in ps)
    assert [r.id for r in load_prompts(paths["eval"], DataConfig(max_prompt_tokens=512), tok)] == \
        [r["id"] for r in evals]
