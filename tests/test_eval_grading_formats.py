"""The answer formats models actually write (issue 28): final-answer phrases, several boxes, named answers,
answers in prose, symmetric equivalence, inequalities vs intervals, percent in words, plain-text math --
each class with positives written here (not taken from any labelled set) and hard negatives that must stay
wrong. The symmetry test runs over every pair of this file and of tests/test_eval_grading.py."""

from __future__ import annotations

import pytest

from megatron_opd.eval.grading import answer_unit, answers_equivalent, extract_answer, grade_response

# (response, extracted answer, method)
EXTRACTION = [
    # 1. final-answer phrases (Minerva's few-shot style and relatives)
    ("Final Answer: The final answer is $4.25$. I hope it is correct.", "4.25", "answer_is"),
    ("...so the speed doubles.\n\nFinal Answer: The final answer is $\\frac{3}{7}$. I hope it is correct.",
     "\\frac{3}{7}", "answer_is"),
    ("**Final Answer:** The answer is 17", "17", "answer_is"),
    ("Final answer: the final answer is 2.5e-3.", "2.5 \\times 10^{-3}", "answer_is"),
    # 2. several boxes
    ("The roots are $\\boxed{-3}$ and $\\boxed{2}$.", "-3, 2", "boxed"),
    ("So $x=\\boxed{-3}$ or $x = \\boxed{2}$.", "-3, 2", "boxed"),
    ("$\\boxed{1}$, $\\boxed{4}$, $\\boxed{9}$", "1, 4, 9", "boxed"),
    ("Both give \\boxed{5} and again \\boxed{5}.", "5", "boxed"),
    ("First $a = \\boxed{3}$. Then the area is 12, so the perimeter is \\boxed{14}.", "14", "boxed"),
    ("We get $\\boxed{7}$ for the first part.\nFinal Answer: The final answer is 12. I hope it is correct.",
     "12", "answer_is"),
    ("Thus \\boxed{12}.\n\nThe answer is above.", "12", "boxed"),
    ("so \\boxed{24}.\n\nChallenge: Is it a coincidence that the answer is 24?", "24", "boxed"),
    # 4. answers in prose without a box
    # (extraction keeps an inequality and a name as written; grading reads them: see test_eval_grading_relations)
    ("Hence $x \\ge 3$ is the solution.", "x \\ge 3", "prose_math"),
    ("The area is $\\frac{1}{2} \\cdot 4 \\cdot 3 = 6$.", "6", "prose_math"),
    ("So the matrix is $\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}$.",
     "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "prose_math"),
    ("The only solution is (1, 2).", "(1, 2)", "prose_math"),
    ("Total is $5 \\times 3 = 15$ dollars (about $14 \\%$ more).", "15", "prose_math"),
    ("Therefore $(a, b) = (4, 1)$ works.", "(a, b) = (4, 1)", "prose_math"),
    ("She has $5$ apples and buys 3 more, so 8 in all", "8", "last_number"),
    ("Sophia gave 20 $ to Jack.\nJack now has 100 + 20 = 120$", "120", "last_number"),
    # found by review: remarks after the box do not replace it, prose spans that are not values
    ("So the total is \\boxed{7}.\n\nA common mistake is to think the answer is 6.", "7", "boxed"),
    ("\\boxed{7}\n\nNote: had we counted the empty set, the answer is 8.", "7", "boxed"),
    ("Therefore the answer is \\boxed{7}. Let me double-check: the answer is 7 in both cases.", "7", "boxed"),
    ("So \\boxed{12}.\n\nThe answer is ok.", "12", "boxed"),
    ("\\boxed{4}\n\nFinal Answer: The answer is at most 3 more than before.", "4", "boxed"),
    ("So the area is 25 $\\text{cm}^2$.", "25", "last_number"),
    ("Thus the sum is 42, which equals $S_{10}$.", "42", "last_number"),
    ("The larger root is 5, namely $x_2$.", "5", "last_number"),
    ("The minimum value of n is 5, since we need $n \\ge 5$.", "5", "last_number"),
    ("We get $x = \\left(\\frac{1}{2}\\right)^2 = \\frac{1}{4}$.", "\\frac{1}{4}", "prose_math"),
    ("(Check: here the answer is 21.)", "21", "answer_is"),
]


@pytest.mark.parametrize("text,answer,method", EXTRACTION)
def test_extraction_of_the_formats_models_write(text, answer, method):
    got = extract_answer(text)
    assert (got.answer, got.method) == (answer, method)


# (prediction, gold): graded correct in both directions
EQUIVALENT = [
    # 3. answers that name the quantity
    ("(a,b)=(4,1)", "(4,1)"),
    ("g(x)=2", "2"),
    ("y=5", "5=y"),
    ("x_1 = 7", "7"),
    ("f(x, y) = 3", "3"),
    ("(x, y) = (-1, \\frac{1}{2})", "(-1, 0.5)"),
    # 5. text wrappers, either side
    ("\\mathrm{B}", "B"),
    ("\\text{even}", "even"),
    ("\\textbf{(C)}", "(C)"),
    # 6. inequality vs interval
    ("-1 \\le x \\le 4", "x \\in [-1, 4]"),
    ("-1 \\leq x < 4", "[-1, 4)"),
    ("x > 3", "(3, \\infty)"),
    ("x \\ge 3", "[3,\\infty)"),
    ("x < -2", "(-\\infty, -2)"),
    # 7. percent in words
    ("12.5 percent", "12.5\\%"),
    ("12.5 percent", "0.125"),
    ("40 per cent", "40\\%"),
    # 8. plain-text math
    ("2 + sqrt(5)", "2+\\sqrt{5}"),
    ("sqrt 2", "\\sqrt{2}"),
    ("3*pi", "3\\pi"),
    ("2**10", "1024"),
    ("infinity", "\\infty"),
    # multi-answers, any order
    ("-3, 2", "2, -3"),
    # units: one side may omit it; spelled-out and abbreviated units agree
    ("5 cm", "5"),
    ("5 centimeters", "5 cm"),
    ("3 meters", "3\\text{ m}"),
    # found by review: equations against a bare value, \\left is not \\le, \\leqslant
    ("AB = 5", "5"),
    ("f(3) = 10", "10"),
    ("\\angle ABC = 30^\\circ", "30"),
    ("x\\left(x+1\\right)", "x(x+1)"),
    ("x \\leqslant 3", "x \\le 3"),
    ("5 \\text{ cm}^2", "5"),
]

# (prediction, gold): hard negatives, graded wrong in both directions
NOT_EQUIVALENT = [
    ("4.26", "4.25"),  # near-miss numbers
    ("4.2", "4.25"),
    ("-4.25", "4.25"),  # wrong sign
    ("(1,4)", "(4,1)"),  # a swapped tuple where order matters
    ("(a,b)=(1,4)", "(4,1)"),
    ("-3", "-3, 2"),  # a partial multi-answer
    ("-3, 2, 5", "-3, 2"),  # an extra root
    ("y=6", "5=y"),
    ("g(x)=3", "2"),
    ("\\mathrm{C}", "B"),
    ("-1 < x \\le 4", "[-1, 4]"),  # an open end where the interval is closed
    ("x > 3", "[3, \\infty)"),
    ("x \\le 3", "[3, \\infty)"),
    ("12.6 percent", "12.5\\%"),
    ("2 - sqrt(5)", "2+\\sqrt{5}"),
    ("sqrt(3)", "\\sqrt{5}"),
    ("5 cm", "5 m"),  # the right number with the wrong unit
    ("5 kg", "5 g"),
    ("5 or 6", "5"),
    ("\\text{odd}", "even"),
    # found by review: names must agree when both sides have one; words are text, not letter products
    ("y=3", "x=3"),
    ("(b,a)=(4,1)", "(a,b)=(4,1)"),
    ("P(A)=0.3", "P(B)=0.3"),
    ("y\\left(x+1\\right)", "x\\left(x+1\\right)"),
    ("\\text{no}", "\\text{on}"),
    ("\\mathrm{BA}", "\\mathrm{AB}"),
    ("\\text{listen}", "\\text{silent}"),
    # units: after a name, with \\, spacing, with exponents, after a power of ten
    ("x = 5 cm", "5 m"),
    ("5\\,\\text{cm}", "5\\,\\text{m}"),
    ("5 \\text{ cm}^2", "5 \\text{ m}^2"),
    ("2 \\times 10^{3}\\text{ m}", "2 \\times 10^{3}\\text{ km}"),
]


@pytest.mark.parametrize("pred,gold", EQUIVALENT)
def test_equivalent_forms_grade_correct(pred, gold):
    assert answers_equivalent(pred, gold) and answers_equivalent(gold, pred)


@pytest.mark.parametrize("pred,gold", NOT_EQUIVALENT)
def test_hard_negatives_grade_wrong(pred, gold):
    assert not answers_equivalent(pred, gold) and not answers_equivalent(gold, pred)


def test_whole_responses_end_to_end():
    assert grade_response("Final Answer: The final answer is $4.25$. I hope it is correct.", "4.25").correct
    assert not grade_response("Final Answer: The final answer is $4.24$. I hope it is correct.", "4.25").correct
    assert grade_response("The solutions are $\\boxed{-3}$ and $\\boxed{2}$.", "2, -3").correct
    assert not grade_response("The solutions are $\\boxed{-3}$ and $\\boxed{2}$.", "-3").correct
    assert not grade_response("So $\\boxed{2}$.", "-3, 2").correct
    assert grade_response("Hence $x \\ge 3$ is the solution.", "[3, \\infty)").correct
    assert not grade_response("Hence $x \\ge 3$ is the solution.", "3").correct
    assert grade_response("We get $\\boxed{7}$ first.\nFinal Answer: The final answer is 12.", "12").correct


def test_units():
    assert answer_unit("5 cm") == answer_unit("5 centimeters") == answer_unit("5\\text{ cm}") == "cm"
    assert answer_unit("5") is None and answer_unit("5 or 6") is None


def _corpus() -> list[tuple[str, str]]:
    """Every (pred, gold) pair parametrised in this file and in tests/test_eval_grading.py."""
    import test_eval_grading as base

    pairs = list(EQUIVALENT + NOT_EQUIVALENT)
    for module in (base,):
        for name in dir(module):
            for mark in getattr(getattr(module, name), "pytestmark", []):
                if mark.name == "parametrize" and str(mark.args[0]).replace(" ", "").startswith("pred,gold"):
                    pairs += [(v[0], v[1]) for v in mark.args[1] if isinstance(v[0], str) and isinstance(v[1], str)]
    return pairs


def test_grading_is_symmetric_over_the_test_corpus():
    pairs = _corpus()
    assert len(pairs) > 80
    asym = [(a, b) for a, b in pairs if answers_equivalent(a, b) != answers_equivalent(b, a)]
    assert asym == []


# ----------------------------------------------------------------------------- grade-audit --labelled

def _write(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_grade_audit_labelled_reports_agreement_per_category(tmp_path, capsys):
    import json

    from megatron_opd.eval.audit import main

    rows = [
        {"gold": "4.25", "response": "Final Answer: The final answer is $4.25$. I hope it is correct.",
         "label": True, "category": "phrases"},
        {"gold": "4.25", "prediction": "4.24", "label": "incorrect", "category": "phrases"},
        {"gold": "(4,1)", "prediction": "(a,b)=(4,1)", "label": 1, "category": "named"},
        # labelled correct but graded wrong (a false reject, as the labeller sees it): 5 cm vs 5 m
        {"gold": "5 m", "prediction": "5 cm", "label": True, "category": "units"},
        # labelled wrong but graded correct (a false accept): a label error the audit must surface
        {"gold": "7", "prediction": "7", "label": False, "category": "units"},
    ]
    f = _write(tmp_path / "labels.jsonl", rows)
    assert main(["--labelled", str(f), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "| phrases | 2 | 0 | 100.00% | 0 | 0 |" in out
    assert "| named | 1 | 0 | 100.00% | 0 | 0 |" in out
    assert "| units | 2 | 1 | 0.00% | 1 | 0 |" in out
    assert "| ALL | 5 | 1 | 60.00% | 1 | 0 |" in out
    assert "1 false accepts" in out and "1 false rejects" in out and '"line": 5' in out and '"line": 4' in out
    saved = json.loads((tmp_path / "out" / "labelled_audit.json").read_text())
    assert saved[-1]["category"] == "ALL" and saved[-1]["agreement"] == 0.6 and saved[-1]["seconds_max"] < 5
    assert main(["--labelled", str(f), "--min-agreement", "0.9"]) == 1
    assert main(["--labelled", str(f), "--max-false-accepts", "0"]) == 1
    assert main(["--labelled", str(f), "--max-false-accepts", "1"]) == 0


def test_grade_audit_labelled_reports_false_accepts_first_by_category(tmp_path, capsys):
    """Issue 39: a false accept inflates every reported accuracy, so the report leads with them, grouped by
    category with the category that has most first, before any false reject; the table is ordered the same
    way and puts the false accepts next to the case count."""
    from megatron_opd.eval.audit import main

    rows = [
        {"gold": "7", "prediction": "8", "label": True, "category": "aaa"},                # a false reject
        {"gold": "b - 2w = 0", "prediction": "0", "label": True, "category": "aaa"},       # a false reject
        {"gold": "5", "prediction": "5", "label": False, "category": "zzz"},                # a false accept
        {"gold": "6", "prediction": "6", "label": False, "category": "zzz"},                # a false accept
        {"gold": "x > 3", "prediction": "3 < x", "label": False, "category": "mmm"},       # a false accept
        {"gold": "x > 3", "prediction": "y > 3", "label": False, "category": "mmm"},       # agrees
    ]
    f = _write(tmp_path / "labels.jsonl", rows)
    assert main(["--labelled", str(f)]) == 0
    out = capsys.readouterr().out
    fa, fr = out.index("3 false accepts"), out.index("2 false rejects")
    assert fa < fr < out.index("| category |")
    assert fa < out.index("  zzz: 2") < out.index("  mmm: 1") < fr < out.index("  aaa: 2")
    table = out[out.index("| category |"):]
    assert table.index("| zzz | 2 | 2 |") < table.index("| mmm | 2 | 1 |") < table.index("| aaa | 2 | 0 |") \
        < table.index("| ALL | 6 | 3 |")


@pytest.mark.parametrize("row,message", [
    ({"gold": "1", "prediction": "1", "label": [True]}, "labels.jsonl:2: field 'label'"),
    ({"prediction": "1", "label": True}, "labels.jsonl:2: field 'gold'"),
    ({"gold": "1", "label": True}, "labels.jsonl:2: needs a string field 'prediction'"),
    ({"gold": "1", "prediction": "1", "label": "maybe"}, "labels.jsonl:2: field 'label'"),
    ({"gold": "1", "prediction": "1", "label": True, "abs_tol": -1}, "labels.jsonl:2: field 'abs_tol'"),
])
def test_grade_audit_labelled_bad_input_names_line_and_field(tmp_path, capsys, row, message):
    from megatron_opd.eval.audit import main

    f = _write(tmp_path / "labels.jsonl", [{"gold": "1", "prediction": "1", "label": True}, row])
    assert main(["--labelled", str(f)]) == 2
    assert message in capsys.readouterr().err


def test_grade_audit_needs_exactly_one_source(tmp_path):
    from megatron_opd.eval.audit import main

    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["--labelled", "x.jsonl", "--benchmarks", "math500"])


@pytest.mark.timeout(60, method="thread")  # a regression hangs inside re (no signal gets in): end the run loudly
def test_degenerate_text_after_an_answer_phrase_grades_in_linear_time():
    """A run's held-out eval hung here (setting C of docs/reproduction.md, step 30): the student wrote "The
    answer is" and then babble, and the number-then-unit pattern backtracked exponentially over the babble's
    letter runs (a 34-byte tail took 18 s before the fix). The run's exact response, and longer made-up ones,
    must grade at once, and units after a number still read as units."""
    import time

    hung = ("Each friend gets 15 / 5 = 5 tickers.\nThe answer is 9 matickers ar ater ivis arar 2 ster "
            "stickerstid icherlllllstid{3 arbllster iverarancerlllllllllls 10 mardststhe its 2 per")
    made_up = ["The answer is 9 " + "ab" * n + "{" for n in (20, 200)] + ["The answer is 7 " + "xy " * 300 + "}"]
    t0 = time.perf_counter()
    for text in [hung, *made_up]:
        assert extract_answer(text).method == "answer_is"
    assert time.perf_counter() - t0 < 1.0
    assert grade_response(hung, "4").status == "incorrect"
    assert extract_answer("The answer is 12 apples.").answer == "12"
    assert extract_answer("The answer is 5 m/s.").answer == "5"
    assert extract_answer("The answer is 9 cm2").answer == "9"
