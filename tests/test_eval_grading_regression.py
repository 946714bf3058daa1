"""Real model outputs (Qwen2.5-Coder-0.5B-Instruct on GSM8K), labelled by reading them
(tests/support/grading_regression_qwen.md): the grader agrees with every label, with no false accept."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_opd.eval.audit import audit_labelled, read_labelled
from megatron_opd.eval.audit import main as audit_main

FIXTURE = Path(__file__).parent / "support" / "grading_regression_qwen.jsonl"


def test_the_grader_agrees_with_every_read_label():
    cases = read_labelled(FIXTURE)
    assert len(cases) >= 100 and any(c.truncated for c in cases) and any(c.label for c in cases)
    total = audit_labelled(cases)[-1]
    assert total.category == "ALL" and total.cases == len(cases)
    assert not total.false_accepts, total.false_accepts[:3]
    assert not total.false_rejects, total.false_rejects[:3]


def test_a_cut_response_without_a_stated_answer_would_be_a_false_accept_if_graded_by_its_last_number(tmp_path):
    """The fixture's truncated rows read as not truncated: the last-number rule accepts at least one of them
    (what the grader did before), and grade-audit's --max-false-accepts 0 then fails."""
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]
    cut = [{**r, "truncated": False} for r in rows if r["truncated"]]
    f = tmp_path / "cut.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in cut))
    assert audit_labelled(read_labelled(f))[-1].false_accepts
    assert audit_main(["--labelled", str(f), "--max-false-accepts", "0", "--out", str(tmp_path / "a")]) == 1
    assert audit_main(["--labelled", str(FIXTURE), "--max-false-accepts", "0", "--out", str(tmp_path / "b")]) == 0


def test_truncated_responses_are_graded_only_by_a_stated_answer():
    from megatron_opd.eval.grading import grade_response

    working = "So 48 / 2 = 24 and 24 + 48 = 72.\n\nTherefore, she sold"
    assert grade_response(working, "72").status == "correct"  # a finished response: its last number
    assert grade_response(working, "72", truncated=True).status == "no_answer"
    for stated in (working + " $\\boxed{72}$ clips in all. Check: 72 - 48 =", working + " 72.\n#### 72\nMore",
                   "The answer is 72. Let me verify: 48 +"):
        assert grade_response(stated, "72", truncated=True).status == "correct", stated
    assert grade_response(working + " $\\boxed{71}$ in all, so", "72", truncated=True).status == "incorrect"


def test_a_bad_truncated_field_names_the_line(tmp_path):
    import pytest

    from megatron_opd.eval.audit import LabelledError

    f = tmp_path / "l.jsonl"
    f.write_text('{"gold": "1", "response": "1", "label": true}\n{"gold": "1", "response": "1", "label": true, '
                 '"truncated": "yes"}\n')
    with pytest.raises(LabelledError, match=r"l\.jsonl:2: field 'truncated'"):
        read_labelled(f)
