"""Issue 39: equations, names, inequalities, thousands separators, prose answers and runaway responses.

Each class the held-out labelled set found is tested here with cases written for this file (none is taken from
a public grader's suite), in both directions: the answers that must be accepted and the near misses that must
stay wrong. Every pair is graded both ways round (grading is symmetric). The regular expressions added for
these rules are run on long adversarial inputs, which must finish at once."""

from __future__ import annotations

import time

import pytest

from megatron_opd.eval import grading
from megatron_opd.eval.grading import answers_equivalent, extract_answer, grade_answer, grade_response


def both_ways(pred: str, gold: str) -> bool:
    ab, ba = answers_equivalent(pred, gold), answers_equivalent(gold, pred)
    assert ab == ba, (pred, gold)
    return ab


# ------------------------------------------------------------------ 1. a name, not an equation, may be dropped

@pytest.mark.parametrize("pred, gold", [
    ("4p + q", "3 = 4p + q"),         # the equation's other side
    ("3", "3 = 4p + q"),
    ("0", "b - 2w = 0"),              # an expression (not a name) on the left
    ("2", "5u + v = 2"),              # a coefficient: 5u + v is not a name
    ("0", "x - y = 0"),               # a minus sign: x - y is not a name
    ("1234", "100m + n = 1234"),      # "find 100m + n": stated as an equation, graded as one
    ("7", "k + 1 = 7"),
    ("11", "p + q = 11"),             # a sum: "find p + q" or the line x + y = 11? Rejected
    ("\\frac{1}{2}", "2s = 1"),
])
def test_an_equation_between_expressions_is_not_its_right_hand_side(pred, gold):
    assert not both_ways(pred, gold)
    assert not grade_response(f"So the answer is $\\boxed{{{pred}}}$.", gold).correct


@pytest.mark.parametrize("pred, gold", [
    ("7", "k = 7"),                       # a variable
    ("4", "h(t) = 4"),                    # a function of a variable
    ("5", "f(2) = 5"),                    # a function at a number
    ("(2, 9)", "(p, q) = (2, 9)"),        # a tuple of names
    ("6", "PQ = 6"),                      # a segment
    ("45", "\\beta = 45^\\circ"),         # a Greek letter
    ("60", "m\\angle XYZ = 60^\\circ"),   # an angle
    ("3", "v_{max} = 3"),                 # a subscripted name
    ("15", "3 \\cdot 5 = 15"),            # a computation: its last side
    ("8", "y = 2 + 6 = 8"),               # a chain ending in a value
    ("12\\pi", "A = \\pi r^2 = 12\\pi"),
    ("9", "9 = w"),                       # the name on the right
    ("\\frac{t+1}{3}", "g^{-1}(t) = \\frac{t+1}{3}"),  # an inverse function
])
def test_an_answer_under_a_name_is_its_value(pred, gold):
    assert both_ways(pred, gold)


@pytest.mark.parametrize("pred, gold", [
    ("w = 5", "v = 5"), ("h(t) = 4", "g(t) = 4"), ("PQ = 6", "QR = 6"), ("p + q = 11", "p + r = 11"),
    ("x = 5", "y = 5"),
])
def test_different_names_are_different_answers(pred, gold):
    assert not both_ways(pred, gold)


@pytest.mark.parametrize("text, gold, answer, ok", [
    # a response's equation against a gold that is no equation: the value it ends in
    ("So $p - q = 15$.", "15", "15", True),
    ("Hence $\\boxed{100m + n = 1234}$.", "1234", "1234", True),
    ("Thus $7!=5040$.", "5040", "5040", True),                  # a factorial, not "!="
    # a gold that is an equation: the answer stays whole and is held to it
    ("So $p - q = 15$.", "q - p = -15", "p - q = 15", True),
    ("So $\\boxed{1}$.", "2x + z = 1", "1", False),
    ("So $y = 3$.", "x = 3", "y = 3", False),
    ("So $AB = 4, CD = 5$.", "4, 5", "AB = 4, CD = 5", True),  # a named list stays one
    ("So $\\boxed{AB = 4, CD = 5}$.", "5", "AB = 4, CD = 5", False),  # a boxed list is all the answer
    ("We find $a = 60, b = 750, a + b = 810$.", "810", "810", True),  # prose: found on the way, asked for last
])
def test_a_responses_equation_is_read_by_the_golds_shape(text, gold, answer, ok):
    assert extract_answer(text, gold).answer == answer
    assert grade_response(text, gold).correct is ok


# ------------------------------------------------------------------ 2. the same equation in another form

@pytest.mark.parametrize("pred, gold", [
    ("y = 3x - 2", "3x - y - 2 = 0"),
    ("2y = 4x + 6", "y = 2x + 3"),
    ("\\frac{x}{2} + \\frac{y}{3} = 1", "3x + 2y = 6"),
    ("p = 2q", "p - 2q = 0"),
    ("4 = 3s + t", "3s + t - 4 = 0"),
    ("(x - 2)^2 + y^2 = 9", "x^2 - 4x + y^2 = 5"),
    ("u = 4", "3u = 12"),
])
def test_equations_equal_up_to_a_constant_factor(pred, gold):
    assert both_ways(pred, gold)


@pytest.mark.parametrize("pred, gold", [
    ("y = 3x - 2", "3x - y + 2 = 0"),   # a sign changed
    ("y = 3x", "y = 3z"),               # other variables
    ("u = 4", "v = 4"),
    ("y = x^2", "y = x"),
    ("x^2 = 9", "x = 3"),               # a factor that is not constant: a different solution set
    ("2x + 4y = 3", "2x + 4y = 3 + x"),
])
def test_different_equations_stay_different(pred, gold):
    assert not both_ways(pred, gold)


# ------------------------------------------------------------------ 3. inequalities in either orientation

@pytest.mark.parametrize("pred, gold", [
    ("7 \\ge t", "t \\le 7"),
    ("-t < 2", "t > -2"),
    ("-t \\ge -\\frac{1}{2}", "t \\le \\frac12"),
    ("10 > s \\ge 3", "3 \\le s < 10"),
    ("10 > s \\ge 3", "[3, 10)"),
    ("-2 \\le -u \\le 4", "[-4, 2]"),
    ("2 \\lt t", "(2, \\infty)"),
    ("t < -3 \\text{ or } t > 3", "(-\\infty, -3) \\cup (3, \\infty)"),   # a union, one variable throughout
    ("t > 3 \\text{ or } t < -3", "t < -3 or t > 3"),
])
def test_inequalities_in_the_other_orientation(pred, gold):
    assert both_ways(pred, gold)


@pytest.mark.parametrize("pred, gold", [
    ("7 \\ge t", "t \\ge 7"),      # the other half-line
    ("-t < 2", "t < -2"),          # the minus applied to the bound only
    ("3 < t", "t \\ge 3"),         # open against closed
    ("t > 3", "s > 3"),            # the same set, another variable
    ("3 < t", "3 < s"),
    ("10 > s > 3", "[3, 10)"),
    ("t < -3 \\text{ or } s > 3", "(-\\infty, -3) \\cup (3, \\infty)"),  # two variables: no union
    ("t < -3 \\text{ or } t \\ge 3", "(-\\infty, -3) \\cup (3, \\infty)"),
    ("t < -3 \\text{ or } t > 3", "s < -3 \\text{ or } s > 3"),
])
def test_inequalities_keep_variable_set_and_ends(pred, gold):
    assert not both_ways(pred, gold)


# ------------------------------------------------------------------ 4. named multi-answers

@pytest.mark.parametrize("pred, gold", [
    ("6, 8", "PQ=6, QR=8"),
    ("QR = 8, PQ = 6", "PQ=6,QR=8"),
    ("(2, 7)", "a = 2, b = 7"),
    ("3, 1", "t = 1, t = 3"),                   # one name: the roots, in any order
    ("-1, 4", "t = -1 \\text{ or } t = 4"),
])
def test_named_multi_answers(pred, gold):
    assert both_ways(pred, gold)


@pytest.mark.parametrize("pred, gold", [
    ("8, 6", "PQ=6, QR=8"),           # the values under the other names
    ("PQ=8, QR=6", "PQ=6, QR=8"),
    ("6", "PQ=6, QR=8"),              # a part
    ("PQ=6, RS=8", "PQ=6, QR=8"),     # another name
    ("6, 8, 9", "PQ=6, QR=8"),
    ("1", "t = 1, t = 3"),
])
def test_named_multi_answers_near_misses(pred, gold):
    assert not both_ways(pred, gold)


def test_named_multi_answer_in_a_response():
    assert grade_response("Hence $\\boxed{6, 8}$.", "$PQ=6,QR=8$").correct
    assert grade_response("The answer is $PQ = 6, QR = 8$.", "6, 8").correct
    assert not grade_response("Hence $\\boxed{8, 6}$.", "$PQ=6,QR=8$").correct


# ------------------------------------------------------------------ 5. thousands separators

@pytest.mark.parametrize("text, answer, method", [
    ("Final Answer: The final answer is $23,817$. I hope it is correct.", "23817", "answer_is"),
    ("So $\\boxed{817}$ a week.\nThe final answer is $23,817$. I hope it is correct.", "23817", "answer_is"),
    ("Each box holds 3,\\!250 pens, so 3,\\!250 in all", "3250", "last_number"),
    ("They pay 2 * 1,250 = 2,500 dollars.\n#### 2,500", "2500", "hashes"),
    ("#### 1,000,000", "1000000", "hashes"),
    ("#### (2,5)", "(2,5)", "hashes"),            # a tuple keeps its comma
    ("#### 3, 7", "3, 7", "hashes"),              # so does a list
    ("The sum is $1,000,000$.", "1000000", "prose_math"),
])
def test_extraction_keeps_thousands_separators(text, answer, method):
    got = extract_answer(text)
    assert (got.answer, got.method) == (answer, method)


@pytest.mark.parametrize("pred, gold, ok", [
    ("2,500", "2500", True),
    ("2,500", "2, 500", True),           # the gold's shape: a list of two
    ("2,500", "2501", False),
    ("1,000 and 2,000", "1000, 2000", True),
    ("1,260^\\circ", "1260", True),
    ("4,320 \\text{ dollars}", "4320", True),
    ("(2,500)", "2500", False),          # a tuple is not a number
    ("2500", "2, 500", False),           # nor is a list (math-verify reads "2,500" as 2500 once spaces go)
    ("2,5", "25", False),
])
def test_thousands_separators_by_the_other_answers_shape(pred, gold, ok):
    assert both_ways(pred, gold) is ok


@pytest.mark.parametrize("text, gold, answer", [
    ("So the roots are 1, 5.", "1, 5", "1, 5"),             # the gold lists two numbers: so does the answer
    ("So the roots are $1$ and $5$.", "1, 5", "1, 5"),
    ("The two totals are 1,500 and 2.", "1500, 2", "1500, 2"),
    ("So the roots are 1, 5.", "15", "5"),                 # a single-number gold: the last number
    ("We get 1 apple, then later 5.", "1, 5", "5"),         # words between the numbers: not a list
    ("The total is 1,500.", "1, 500", "1500"),              # one grouped number is not a list of two
])
def test_last_number_rule_reads_a_list_when_the_gold_is_one(text, gold, answer):
    got = extract_answer(text, gold)
    assert (got.answer, got.method) == (answer, "last_number")
    assert grade_response(text, gold).correct is (answer == gold)


# ------------------------------------------------------------------ 6. prose with a subject; runaway responses

@pytest.mark.parametrize("text, answer", [
    ("Final Answer: The smallest possible $k$ is 8.", "8"),
    ("Final Answer: The area of $\\triangle PQR$ is $24$. I hope it is correct.", "24"),
    ("Final Answer: There are 15 handshakes.", "15"),
    ("Final Answer: The line is $2x + y = 3$.", "2x + y = 3"),
    ("Final Answer: The final answer is $y = 2x + 1$. I hope it is correct.", "y = 2x + 1"),  # a name is kept
    ("The answer is $AB = 4, CD = 5$.", "AB = 4, CD = 5"),  # a clause stop inside a math span is no stop
])
def test_prose_answers_with_a_subject(text, answer):
    got = extract_answer(text)
    assert (got.answer, got.method) == (answer, "answer_is")


@pytest.mark.parametrize("text, answer", [
    ("Final Answer: The value is not known.", "The value is not known"),  # the value is prose
    ("Final Answer: 8 is the smallest value.", "8 is the smallest value"),  # no subject before the verb
    ("Final Answer: The number of ways is 3 times 4.", "3 times 4"),  # a value, but not the number 3
])
def test_subject_rule_does_not_fire_on_prose(text, answer):
    assert extract_answer(text).answer == answer
    assert not grade_response(text, "8").correct and not grade_response(text, "3").correct


@pytest.mark.parametrize("text, answer, method", [
    ("So $\\boxed{817}$ a week.\nThe final answer is $23,817$.", "23817", "answer_is"),  # "The final answer" line
    ("So $\\boxed{7}$.\nThe final answer is not 8.", "7", "boxed"),   # a denial replaces nothing
    ("So $\\boxed{7}$.\nI think the final answer is 8.", "7", "boxed"),  # not at the start of a line
])
def test_a_final_answer_line_after_the_box(text, answer, method):
    got = extract_answer(text)
    assert (got.answer, got.method) == (answer, method)


@pytest.mark.parametrize("text, gold", [
    ("Final Answer: The final answer is $7,350$. I hope it is correct.\n\nProblem:\nFind $x$.\n\nSolution: "
     "We get 42.\nFinal Answer: The final answer is $42$. I hope it is correct.", "7350"),
    ("The perimeter is 26. <|im_end|>\n<|im_start|>user\nNow what is 3+4? The answer is 7", "26"),
    ("The answer is 19. <|im_start|>user\nAnd 2+2? The answer is 4.", "19"),
    ("<|im_start|>assistant\nThe answer is 12.<|im_end|>", "12"),
    ("The total is $\\boxed{31}$.<end_of_turn>\n<start_of_turn>user\nThe answer is $\\boxed{5}$", "31"),
    ("<think>First guess: \\boxed{30}. No, one more.</think>\n\n**Answer:** 31", "31"),  # after the reasoning
    ("<think>It is \\boxed{31}.</think>", "31"),  # nothing after the reasoning: the reasoning is all there is
])
def test_a_response_ends_where_the_model_stopped_answering(text, gold):
    assert grade_response(text, gold).correct


def test_hedged_or_continued_answers_are_not_taken_from_the_continuation():
    text = "The answer is 19.<|im_end|>\n<|im_start|>user\nThe answer is 4"
    assert not grade_response(text, "4").correct


# ------------------------------------------------------------------ 7. small rules found on the way

@pytest.mark.parametrize("pred, gold, ok", [
    ("0.\\overline{3}", "\\frac{1}{3}", True),
    ("1.2\\overline{45}", "\\frac{137}{110}", True),
    ("0.\\overline{3}", "0.333", False),
    ("\\varnothing", "\\emptyset", True),
    ("\\{\\}", "\\emptyset", True),
    ("3 + t", "t + 3", True),              # math-verify drops a letter after a space as a unit ("t", "s")
    ("5 + s", "s + 5", True),
    ("4a + t", "t + 4a", True),
    ("3 + t", "4 + t", False),
    ("4t", "4 \\cdot t", True),
    ("1+2i", "2i+1", True),               # i is no unit
    ("12,650", "12,\\!650", True),
    ("\\approx 2.72", "2.72", True),
    ("\\mathbb{R}", "(-\\infty, \\infty)", True),
    ("\\text{all real numbers}", "(-\\infty,\\infty)", True),
    ("\\mathbb{R}", "(0, \\infty)", False),
    ("\\begin{pmatrix}-2\\\\-14\\end{pmatrix}", "\\begin{pmatrix} -2 \\\\ -14 \\end{pmatrix}", True),  # a row
    ("\\begin{pmatrix}-2\\\\-15\\end{pmatrix}", "\\begin{pmatrix} -2 \\\\ -14 \\end{pmatrix}", False),
])
def test_small_rules(pred, gold, ok):
    assert both_ways(pred, gold) is ok


# ------------------------------------------------------------------ bounded time

ADVERSARIAL = {
    "letter run": "a" * 20000 + "!",
    "subscripts": "x_1" * 8000 + "=(",
    "greek": "\\theta " * 4000 + "=(",
    "sum of names": "m + " * 6000 + "= 3 =",
    "function args": "f(x" + ",x" * 8000 + "=",
    "tuple": "(a" + ", a" * 8000 + "=",
    "bounds": "1 " * 10000 + "< x <",
    "comparisons": "\\le " * 6000 + "x",
    "minus signs": "- " * 10000 + "x > ",
    "verbs": "Final Answer: The answer is " + "the n is " * 3000 + "5 words here",
    "final answers": "final answer " * 6000,
    "turn markers": "<|im_start|>" * 4000 + " user" * 4000,
    "grouped digits": "1,000" * 8000 + ",0",
    "separators": ",000" * 8000,
    "equals": "= " * 10000,
    "named list": "x=1, " * 6000,
    "dollars": "The answer is $" + "a, " * 6000,
    "repeating": "0." + "1" * 10000 + "\\overline{",
    "unions": "x < 1 or " * 3000 + "y",
    "think": "</think>" * 5000 + "a",
}


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_new_patterns_run_in_linear_time_on_adversarial_input(name):
    """Each regular expression added for issue 39 on a long input built to make a backtracking pattern blow
    up (a run it could split many ways, a missing closer at the end): extraction, normalisation and the
    relation readers each finish in well under a second."""
    text = ADVERSARIAL[name]
    t0 = time.perf_counter()
    extract_answer(text)
    grading.normalize_answer(text)
    grading.normalize_answer(text, keep_relation=True)
    grading._named(text)
    grading._named_list(text)
    grading._inequality(text)
    grading._value_side(text)
    grading._subject_value(text)
    grading._response_end(text)
    grading._last_number(text, 2)
    grading._last_number("1" + " " * 20000 + "x 2", 2)
    assert time.perf_counter() - t0 < 1.5


def test_grading_a_long_adversarial_case_stays_within_five_seconds():
    t0 = time.perf_counter()
    for pred, gold in [("m + " * 300 + "n = 17", "17"), ("y = " + "x + " * 200 + "1", "2x + 4y - 3 = 0"),
                       ("PQ=6, " * 200 + "QR=8", "6, 8"), ("- " * 500 + "x > 1", "x < 1")]:
        assert grade_answer(pred, gold).status in ("incorrect", "correct", "error")
        assert time.perf_counter() - t0 < 5


def test_a_case_has_one_time_budget_for_all_its_parses(monkeypatch):
    """`timeout_s` is the budget of the whole comparison, not of each math-verify call: a case that needs many
    parses (here a named list of eight items, compared item by item, both ways) must stop at the budget with
    status 'error'. math-verify's parse is slowed down by a sleep (a stand-in for a slow sympy parse; the
    real parse still runs after it); each call alone stays under a second, so per-call timeouts never fire."""
    real_parse = grading.parse

    def slow_parse(*args, **kwargs):
        time.sleep(0.3)
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(grading, "parse", slow_parse)
    pred = ", ".join(f"x_{i} = {i}" for i in range(1, 9))
    gold = ", ".join(f"{i}.0" for i in range(1, 9))  # equal values: every item must be parsed
    t0 = time.perf_counter()
    result = grade_answer(pred, gold, timeout_s=1)
    assert result.status == "error" and "TimeoutException" in result.error
    assert time.perf_counter() - t0 < 2.5
