"""Answer extraction rules and math-verify grading on real cases (no mocks of math-verify)."""

from __future__ import annotations

import threading

import pytest

from megatron_opd.eval import grading
from megatron_opd.eval.grading import (answers_equivalent, extract_answer, extract_boxed, grade_answer,
                                       grade_response)


@pytest.mark.parametrize("text, expected", [
    ("so the answer is $\\boxed{3}$.", "3"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\left\\{ x \\mid x^{2} > 0 \\right\\}}", "\\left\\{ x \\mid x^{2} > 0 \\right\\}"),
    ("nested \\boxed{\\begin{pmatrix} 1 \\\\ \\sqrt{2} \\end{pmatrix}} end", "\\begin{pmatrix} 1 \\\\ \\sqrt{2} \\end{pmatrix}"),
    ("\\fbox{7}", "7"),
    ("$\\boxed 5$", "5"),
    ("ok \\boxed{4} then truncated \\boxed{\\frac{1", "4"),
    ("no box here", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, answer, method", [
    ("blah \\boxed{12} #### 13", "12", "boxed"),
    ("Janet sells 9 eggs.\n#### 1,800", "1800", "hashes"),
    ("We get 4 apples. The answer is 7.", "7", "answer_is"),
    ("So the final answer is $\\frac{3}{4}$.\n", "\\frac{3}{4}", "answer_is"),
    ("3 + 4 = 7 and then 7 * 2 = 14 apples", "14", "last_number"),
    ("the total is 1,234 dollars", "1234", "last_number"),
    ("it is -2.5 degrees", "-2.5", "last_number"),
    ("no digits at all", None, "none"),
])
def test_extract_answer_rules_and_priority(text, answer, method):
    ext = extract_answer(text)
    assert (ext.answer, ext.method) == (answer, method)


@pytest.mark.parametrize("pred, gold", [
    ("0.5", "\\frac{1}{2}"),
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{3}{4}", "3/4"),
    ("[2, 5)", "[2,5)"),
    ("(-\\infty, 3]", "(-\\infty,3]"),
    ("1+x^2", "x^2+1"),
    ("3,2,1", "1,2,3"),
    ("18.00", "18"),
    ("1000", "1{,}000"),
    ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}"),
    ("x=5", "5"),
])
def test_equivalent_answers_grade_correct(pred, gold):
    assert answers_equivalent(pred, gold)
    assert grade_answer(pred, gold).status == "correct"


@pytest.mark.parametrize("pred, gold", [
    ("(2, 5)", "[2,5)"),  # open vs half-open interval
    ("5", "4"),
    ("\\frac{1}{3}", "0.5"),
    ("x^2-1", "x^2+1"),
    ("1,2", "1,2,3"),
])
def test_wrong_answers_grade_incorrect(pred, gold):
    assert not answers_equivalent(pred, gold)
    assert grade_answer(pred, gold).status == "incorrect"


def test_grade_response_end_to_end():
    r = grade_response("Half of the pie is left, so $\\boxed{\\frac{1}{2}}$.", "0.5")
    assert r.correct and r.extracted == "\\frac{1}{2}" and r.method == "boxed"
    r = grade_response("\\boxed{3}", "3")
    assert r.correct
    r = grade_response("I think it is \\boxed{4}", "3")
    assert r.status == "incorrect" and not r.correct
    r = grade_response("", "3")
    assert r.status == "no_answer" and not r.correct


def test_grader_crash_is_incorrect_and_counted_separately(monkeypatch):
    def boom(pred, gold, timeout_s=5, **kw):
        raise RuntimeError("sympy exploded")

    monkeypatch.setattr(grading, "answers_equivalent", boom)
    r = grade_response("\\boxed{3}", "3")
    assert r.status == "error" and not r.correct and "sympy exploded" in r.error


def test_grader_timeout_exception_is_caught(monkeypatch):
    from math_verify.errors import TimeoutException  # a BaseException, not an Exception

    def slow(pred, gold, timeout_s=5, **kw):
        raise TimeoutException("Operation timed out!")

    monkeypatch.setattr(grading, "answers_equivalent", slow)
    r = grade_answer("3", "3")
    assert r.status == "error" and "TimeoutException" in r.error


def test_grading_works_off_the_main_thread():
    """math-verify's signal-based timeout only works in the main thread; we must disable it there."""
    out = {}

    def work():
        out["r"] = grade_response("\\boxed{\\frac{2}{4}}", "0.5")

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert out["r"].status == "correct"
