"""Final-answer extraction and grading: math-verify equivalence behind our normalisation and guards.

Extraction is ours, so every benchmark uses the same inspectable rule: the last ``\\boxed{}``/``\\fbox{}``
(boxes side by side, ``\\boxed{-3}`` and ``\\boxed{2}``, are one multi-answer ``-3, 2``), unless a
final-answer line with math in it comes after it; then GSM8K ``####``; then "the answer is X" /
"Final Answer: The final answer is X. I hope it is correct." (Minerva's few-shot style: the nested phrase
is peeled off); then the last math span of the response when nothing numeric follows it (``Hence
$x \\ge 3$ is the solution.``: the inequality, not its 3; ``$... = 6$``: the right-hand side), or a
final numeric tuple; then the last number (numbers glued to words, inside trailing remarks in
parentheses, or after "Lemma"/"Step"/... are not answers).

Equivalence is math-verify's (sympy: ``\\frac{1}{2}`` == ``0.5``, ``[2,5)`` != ``(2,5)``, sets are
unordered), applied to both answers after `normalize_answer`, and then held to a stricter standard,
because math-verify alone accepts wrong answers of classes that matter on the paper's benchmarks:

* **e-notation.** ``4.5e33`` (a fifth of Minerva's gold answers) parses as ``4.5 * e * 33``; we rewrite
  a number in e-notation as ``4.5 \\times 10^{33}``, on both sides, before parsing.
* **Free symbols.** When the gold answer names a variable or symbol (``4t``, ``\\frac13E_1+\\frac23E_2``)
  and the prediction names none, they do not match, whatever the parser made of the gold (math-verify
  reads ``4t`` as ``4``). ``e`` and ``i`` count as constants, LaTeX commands and ``\\text{}`` are ignored.
* **Lossy parses.** When an answer names symbols but parses to a bare number (math-verify reads
  ``\\frac13E_1+\\frac23E_2`` as ``2/3`` and then accepts ``2/3``, or its negation), the parse is not
  trusted and the two answers must agree as text (spacing and ``\\left``/``\\right`` aside).
* **Numbers compare relatively.** Two numeric answers match only if
  ``|a - b| <= rel_tol * max(|a|, |b|)`` (`REL_TOL` = 1e-6, about 6 significant digits) -- math-verify
  rounds to 6 decimal places, so ``\\frac{2}{2004!}`` "equals" ``\\frac{1}{2004!}`` there. A per-problem
  absolute tolerance (OlympiadBench's ``error`` field) widens this for that problem only.
* **Units and formatting.** A trailing unit word (``1.6 arcsec``, ``5 cm``), math delimiters (``$``),
  thousands separators (``118{,}000``, ``118\\,000``) and ``\\dfrac`` are normalised away; a word that is a
  conjunction is not a unit (``5 or 6`` is not ``5``; ``2 and 3`` is the list ``2, 3``).
* **Sets, percents, degrees.** ``x \\in [-2,7]`` is the set ``[-2,7]``; a trailing ``\\%`` may be dropped
  (``4.2\\%`` matches ``4.2`` as well as math-verify's ``0.042``); "12.5 percent" is ``12.5\\%``;
  ``30^\\circ``, ``30°`` and ``30`` match.
* **Inequalities are intervals.** ``-1 \\le x \\le 4`` is ``[-1, 4]``, ``x > 3`` is ``(3, \\infty)``.
* **Named answers.** A name on one side of ``=`` is dropped: ``(a,b)=(4,1)``, ``g(x)=2``, ``5=y`` are the
  answers ``(4,1)``, ``2``, ``5``. A whole answer in ``\\text{}``/``\\mathrm{}`` is its text (``\\mathrm{B}`` is
  ``B``).
* **Plain-text math.** ``sqrt(5)``, ``pi``, ``**`` are read as ``\\sqrt{5}``, ``\\pi``, ``^``.
* **Symmetric.** Two answers are equivalent only when each matches the other as gold, so grading never
  depends on which side is the reference.

A grader crash or timeout counts as incorrect but is reported with its own status, so a broken grader
cannot hide inside a low accuracy.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, Literal, Optional

import sympy
from math_verify import parse, verify

GradeStatus = Literal["correct", "incorrect", "no_answer", "error"]
ExtractMethod = Literal["boxed", "hashes", "answer_is", "prose_math", "last_number", "none"]

REL_TOL = 1e-6

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_IS_RE = re.compile(
    r"(?:final answer|the answer|^\s*(?:\*\*)?answer)\s*(?:\*\*)?\s*(?:is|:)\s*:?\s*(.+?)"
    r"(?=\.\s|\.?\s*$|\n|,\s+(?=[A-Za-z])|;\s|\s+(?:since|because|which|as|so|and so|where|when|for)\b)",
    re.IGNORECASE | re.MULTILINE)
_SEP = r"(?:,|\{,\}|\\,|\\ |\u2009|\u202f|\u00a0)"  # thousands separators
_CURRENCY_SPACE_NUM = re.compile(r"(?:\\?\$|€|£)\s*(\d{1,3}(?: \d{3})+(?:\.\d+)?)(?![\d\w])")
_UNIT_SUFFIX = r"(?:cm|mm|km|m|kg|g|mg|s|ms|h|min|ml|L|K|J|N|W|V|Hz)"
_LAST_NUMBER_RE = re.compile(
    r"(-?\\[dt]?frac\{-?\d+\}\{\d+\})"  # \frac{1}{2} is one number, not a 1 and a 2
    r"|(?<![\w.\\^_])(?<!\^\{)(?<!_\{)"  # not glued to a word, an exponent or a subscript
    r"(-?(?:\d{1,3}(?:" + _SEP + r"\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+)(?:" + _UNIT_SUFFIX + r")?(?![\w^])")
_REFERENCE_WORDS = re.compile(r"(?:lemma|theorem|step|equation|eq\.|fig\.|figure|section|case|claim|part|"
                              r"exercise|chapter|problem|line|page|rule|condition|property)\s*$", re.IGNORECASE)
_PAREN_REMARK = re.compile(r"\((?=[^()]*[A-Za-z])[^()]*\)")
_E_NOTATION = re.compile(r"^(-?\d+(?:\.\d+)?)\s*[eE]\s*([+-]?\d+)$")
_NOT_UNITS = (r"(?:or|and|to|of|in|times|out|plus|minus|over|per|but|by|with|for|is|are|if|when|where|than|"
              r"from|at|on|as|not|or|nor|then|so|the|a|an|x|y|z|n|k)\b")
_NUMBER_THEN_UNIT = re.compile(
    r"^(-?(?:\d{1,3}(?:" + _SEP + r"\d{3})+|\d+)(?:\.\d+)?(?:\s*(?:\\times|\\cdot)\s*10\^\{?-?\d+\}?)?)\s*"
    r"(?!" + _NOT_UNITS + r")(?:[A-Za-z]{2}|[mgsKJNWVAL])[A-Za-z0-9]*(?:[\s./^\-]+[A-Za-z0-9]+)*\.?$")
_NUMBER_LIST_AND = re.compile(r"-?\d+(?:\.\d+)?(?:\s*,\s*-?\d+(?:\.\d+)?)*\s*,?\s+and\s+-?\d+(?:\.\d+)?")
_TRAILING_PERCENT = re.compile(r"(.+?)\s*\\?%")
_DEGREES = re.compile(r"(.+?)\s*(?:\^\s*\{?\s*\\circ\s*\}?|°|\\degree)")
_TEXT_GROUPS = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox|operatorname|mathbf)\s*\{[^{}]*\}")
_COMMANDS = re.compile(r"\\[A-Za-z]+")
_ASSIGNMENT = re.compile(r"^\s*[A-Za-z](?:_\{?\w+\}?)?\s*(?:=|\\in\b)\s*(?=[^=]+$)")
# a name that an answer may be given under: x, x_1, f(x), g(x, y), (a, b), (x_1, y_1)
_VAR = r"[A-Za-z](?:_\{?\w+\}?)?"
_NAME = (r"(?:" + _VAR + r"(?:\s*\(\s*" + _VAR + r"(?:\s*,\s*" + _VAR + r")*\s*\))?"
         r"|\(\s*" + _VAR + r"(?:\s*,\s*" + _VAR + r")+\s*\))")
_NAME_LEFT = re.compile(r"^\s*" + _NAME + r"\s*=\s*(?P<rest>[^=]+)$")
_NAME_RIGHT = re.compile(r"^(?P<rest>[^=]+?)\s*=\s*" + _NAME + r"\s*$")
_WORDS = re.compile(r"[A-Za-z]+(?:\s+[A-Za-z]+)*")
_WHOLE_TEXT = re.compile(r"^\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}$")
_PERCENT_WORD = re.compile(r"(\d)\s*(?:\\text\{\s*)?(?:percent|per\s+cent|pct)\b\}?", re.IGNORECASE)
_LE = r"(?:\\leqslant|\\leq?(?![A-Za-z])|<=|≤)"  # not \left
_GE = r"(?:\\geqslant|\\geq?(?![A-Za-z])|>=|≥)"
_CHAIN = re.compile(r"^\s*(?P<a>[^<>=≤≥]+?)\s*(?P<o1>" + _LE + r"|<)\s*" + _VAR
                    + r"\s*(?P<o2>" + _LE + r"|<)\s*(?P<b>[^<>=≤≥]+?)\s*$")
_ONE_SIDE = re.compile(r"^\s*" + _VAR + r"\s*(?P<op>" + _LE + r"|" + _GE + r"|<|>)\s*(?P<v>[^<>=≤≥]+?)\s*$")
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$([^$]+)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_NUM_TUPLE = re.compile(r"(?<![\w\\])([(\[]\s*-?[\d.]+(?:\s*,\s*-?[\d.]+)+\s*[)\]])")
_BOX_CONNECTOR = re.compile(r"^(?:\s|\$|,|;|\\quad|\\qquad|\\,|\\text\{\s*(?:and|or)\s*\}|\band\b|\bor\b|"
                            r"\b[A-Za-z](?:_\{?\w+\}?)?\s*=)*$")  # "$\boxed{-3}$ or $x = \boxed{2}$"
_ANSWER_LEAD = re.compile(r"^\s*(?:\*\*)?\s*(?:the\s+)?(?:final\s+)?answer\s*(?:\*\*)?\s*(?:is|:)\s*:?\s*",
                          re.IGNORECASE)
_SCRIPTS = re.compile(r"[_^]\s*(?:\{[^{}]*\}|\w)")  # x_2, m^3, S_{10}: not values
_EQ = re.compile(r"(?<![<>!\\=])=(?!=)")
_HOPE = re.compile(r"\s*\.?\s*I hope it is correct\.?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Extraction:
    answer: Optional[str]
    method: ExtractMethod


@dataclass(frozen=True)
class GradeResult:
    status: GradeStatus
    extracted: Optional[str]
    method: ExtractMethod = "none"
    error: Optional[str] = None

    @property
    def correct(self) -> bool:
        return self.status == "correct"


# ---------------------------------------------------------------------------------------------
# extraction


def _braced(text: str, start: int) -> Optional[tuple[str, int]]:
    """Content of the brace group opening at text[start] == '{' and the index after it; None if unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            continue  # an escaped brace \{ or \} does not open/close a group
        if c == "{" and not (i > 0 and text[i - 1] == "\\"):
            depth += 1
        elif c == "}" and not (i > 0 and text[i - 1] == "\\"):
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
    return None


def _boxes(text: str) -> list[tuple[str, int, int]]:
    """Every complete ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces allowed) or ``\\boxed 5`` (no braces:
    up to whitespace or ``$``) as (content, start, end). An unclosed box (a truncated response) is left out."""
    found: list[tuple[str, int, int]] = []
    for m in _BOX_RE.finditer(text):
        j = m.end()
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            group = _braced(text, j)
            if group is not None:
                found.append((group[0].strip(), m.start(), group[1]))
        elif j > m.end():
            tok = re.match(r"[^\s$]+", text[j:])
            if tok:
                found.append((tok.group(0).strip(), m.start(), j + tok.end()))
    return found


def extract_boxed(text: str) -> Optional[str]:
    """The content of the last complete box; boxes side by side with only ``and``/``,``/``$``/spacing
    between them (``\\boxed{-3} and \\boxed{2}``) are one multi-answer, ``-3, 2``."""
    boxes = _boxes(text)
    if not boxes:
        return None
    group = [boxes[-1]]
    for prev in reversed(boxes[:-1]):
        if not _BOX_CONNECTOR.match(text[prev[2]:group[0][1]]):
            break
        group.insert(0, prev)
    parts = list(dict.fromkeys(content for content, _, _ in group if content))
    return ", ".join(parts) if parts else boxes[-1][0]


def _clean(ans: str) -> str:
    ans = ans.strip()
    if len(ans) >= 2 and ans[0] == "$" and ans[-1] == "$":
        ans = ans.strip("$").strip()
    return ans.rstrip(".").strip()


def _last_number(text: str) -> Optional[str]:
    """The last number that reads as an answer: not part of a word (``name2010``), not a reference
    (``Lemma 2``), not inside a parenthesised remark; ``$118 000`` and ``1{,}000`` are one number."""
    text = _PAREN_REMARK.sub(" ", text)
    text = _CURRENCY_SPACE_NUM.sub(lambda m: m.group(0).replace(m.group(1), m.group(1).replace(" ", "")), text)
    found = None
    for m in _LAST_NUMBER_RE.finditer(text):
        if _REFERENCE_WORDS.search(text[max(0, m.start() - 12):m.start()]):
            continue
        found = m.group(1) or m.group(2)
    if found is None:
        return None
    return re.sub(_SEP, "", found)


def _answer_phrase(text: str) -> Optional[tuple[str, int]]:
    """The last "the answer is X" / "Final Answer: X" (nested phrases and Minerva's "I hope it is correct"
    peeled off) and where it starts; None without one."""
    matches = list(_ANSWER_IS_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    if m.group(1).rstrip().endswith("?") or text[m.end(1):m.end(1) + 1] == "?":
        return None  # "Is it a coincidence that the answer is 24?" asks, it does not answer
    ans = m.group(1).replace("**", "")  # markdown bold
    ans = _HOPE.sub("", ans)
    while True:
        peeled = _ANSWER_LEAD.sub("", ans, count=1)
        if peeled == ans:
            break
        ans = peeled
    ans = ans.strip()
    while ans.endswith(")") and ans.count(")") > ans.count("("):  # "(...; here the answer is 21.)"
        ans = ans[:-1].rstrip(" .")
    return (ans, m.start()) if _clean(ans) else None


def _bare(s: str) -> str:
    """`s` without ``\\text{}``-like groups and LaTeX command names (what is left reads as words/letters)."""
    return _COMMANDS.sub(" ", _TEXT_GROUPS.sub(" ", s))


def _is_math(m: re.Match) -> bool:
    """A ``$...$`` span that is math, not prose between two currency signs (``20 $ to Jack ... 120$``)."""
    content = next(g for g in m.groups() if g is not None)
    if m.group(2) is not None and "\n" in content:
        return False
    return not re.search(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}\s+[A-Za-z]{2,}", _bare(content))


def _in_parentheses(text: str, pos: int) -> bool:
    """Whether `pos` lies inside a parenthesised remark "(... " of the prose (math spans not counted)."""
    prose = _MATH_SPAN.sub(lambda m: " " * len(m.group(0)), text[:pos])
    return prose.count("(") > prose.count(")")


_FINAL_LINE = re.compile(r"^\s*(?:\*\*)?\s*final answer\b", re.IGNORECASE | re.MULTILINE)


def _final_line_answer(text: str, phrase: tuple[str, int], after: int) -> bool:
    """Whether a final-answer phrase after the last box replaces it: it starts a line with "Final Answer"
    (``Final Answer: The final answer is 12.``, not "...to think the answer is 6") and is bare math -- a
    digit or LaTeX, no prose words (``7 in both cases``, ``at most 3 more`` are remarks)."""
    ans, start = phrase
    line = _FINAL_LINE.search(text, after)
    if line is None or not line.start() <= start <= line.end() + 1 or _BOX_RE.search(ans):
        return False
    return bool(re.search(r"[\d\\]", ans)) and not re.search(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}", _bare(ans))


def _prose_answer(text: str) -> Optional[str]:
    """An answer written in prose without a box: the last math span when nothing numeric follows it (its
    right-hand side after ``=``, unless it states an inequality), else a final numeric tuple."""
    m = next((m for m in reversed(list(_MATH_SPAN.finditer(text)))
              if _is_math(m) and not _in_parentheses(text, m.start())), None)
    if m is not None:
        content = next(g for g in m.groups() if g is not None).strip()
        sentence = re.split(r"[.!?]\s|\n", _MATH_SPAN.sub(" ", text[:m.start()]))[-1]
        if (re.search(r"\d", _SCRIPTS.sub(" ", _TEXT_GROUPS.sub(" ", content)))
                and not re.search(r"\d", _PAREN_REMARK.sub(" ", text[m.end():]))
                and not re.search(r"\d", sentence)):
            if "=" in content and not re.search(_LE + "|" + _GE + "|[<>]", content):
                content = content.rsplit("=", 1)[1].strip()
            if content:
                return content
    tuples = list(_NUM_TUPLE.finditer(text))
    if tuples and not re.search(r"\d", text[tuples[-1].end():]):
        return tuples[-1].group(1)
    return None


def extract_answer(text: str) -> Extraction:
    """The model's final answer, by the first rule that matches (see module docstring)."""
    boxes = _boxes(text)
    phrase = _answer_phrase(text)
    if boxes:
        if phrase is not None and phrase[1] >= boxes[-1][2] and _final_line_answer(text, phrase, boxes[-1][2]):
            return Extraction(normalize_answer(phrase[0]), "answer_is")  # a final-answer line after the boxes
        return Extraction(extract_boxed(text), "boxed")
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        if tail:
            return Extraction(_clean(tail).replace(",", ""), "hashes")
    if phrase is not None:
        return Extraction(normalize_answer(phrase[0]), "answer_is")
    prose = _prose_answer(text)
    if prose is not None:
        return Extraction(normalize_answer(prose), "prose_math")
    number = _last_number(text)
    if number is not None:
        return Extraction(number, "last_number")
    return Extraction(None, "none")


# ---------------------------------------------------------------------------------------------
# normalisation and guards


def normalize_answer(ans: str) -> str:
    """Rewrite formatting that math-verify misreads or that carries no meaning (see module docstring).
    Idempotent; applied to gold and prediction alike."""
    s = ans.strip()
    s = re.sub(r"(?<!\\)\$", "", s)
    for left, right in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right):
            s = s[2:-2]
    s = s.strip().rstrip(".").strip()
    s = re.sub(r",\\!\s*", ",", s).replace("\\!", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"^\s*[A-Za-z]\s*\\in(?![A-Za-z])\s*", "", s)  # "x \\in [-2, 7]" states the set [-2, 7]
    m = _WHOLE_TEXT.match(s)
    if m:
        s = m.group(1).strip()
    s = _plain_math(s)
    s = _PERCENT_WORD.sub(r"\1\\%", s)
    s = _interval(s)
    named = _named(s)
    if named is not None and named[1]:
        s = named[1]
    m = _NUMBER_THEN_UNIT.match(s)
    if m:
        s = m.group(1)
    if re.fullmatch(r"-?\d{1,3}(?:" + _SEP + r"\d{3})+(?:\.\d+)?", s):
        s = re.sub(_SEP, "", s)
    if _NUMBER_LIST_AND.fullmatch(s):
        s = re.sub(r"\s*,?\s+and\s+", ", ", s)
    m = _DEGREES.fullmatch(s)
    if m and re.fullmatch(r"-?\d+(?:\.\d+)?", m.group(1).strip()):
        s = m.group(1).strip()
    m = _E_NOTATION.match(s)
    if m:
        s = f"{m.group(1)} \\times 10^{{{int(m.group(2))}}}"
    m = re.fullmatch(r"(.+?)\s*\\(?:text|mathrm|mbox)\s*\{\s*[A-Za-z][A-Za-z\s./^-]*\}\s*", s)
    if m and re.fullmatch(r"-?[\d.]+", m.group(1)):
        s = m.group(1)
    return s.strip()


def _plain_math(s: str) -> str:
    """Plain-text math as LaTeX: ``sqrt(5)`` / ``sqrt 5``, ``pi``, ``infinity``, ``**``."""
    s = re.sub(r"(?<![\\A-Za-z])sqrt\s*\(([^()]*)\)", r"\\sqrt{\1}", s)
    s = re.sub(r"(?<![\\A-Za-z])sqrt\s*(\d+)", r"\\sqrt{\1}", s)
    s = re.sub(r"(?<![\\A-Za-z])pi(?![A-Za-z])", r"\\pi ", s).replace("\\pi }", "\\pi}")
    s = re.sub(r"(?<![\\A-Za-z])(?:infinity|inf)(?![A-Za-z])", r"\\infty", s)
    return s.replace("**", "^").strip()


def _interval(s: str) -> str:
    """A one-variable inequality as the interval it states: ``-1 \\le x < 4`` -> ``[-1, 4)``, ``x \\ge 3`` ->
    ``[3, \\infty)``."""
    m = _CHAIN.match(s)
    if m:
        lo = "[" if re.fullmatch(_LE, m.group("o1")) else "("
        hi = "]" if re.fullmatch(_LE, m.group("o2")) else ")"
        return f"{lo}{m.group('a').strip()}, {m.group('b').strip()}{hi}"
    m = _ONE_SIDE.match(s)
    if m:
        op, v = m.group("op"), m.group("v").strip()
        if re.fullmatch(_GE, op):
            return f"[{v}, \\infty)"
        if op == ">":
            return f"({v}, \\infty)"
        if re.fullmatch(_LE, op):
            return f"(-\\infty, {v}]"
        return f"(-\\infty, {v})"
    return s


_UNIT_NAMES = {"centimeter": "cm", "millimeter": "mm", "kilometer": "km", "meter": "m", "metre": "m",
               "kilogram": "kg", "gram": "g", "milligram": "mg", "second": "s", "sec": "s", "minute": "min",
               "hour": "h", "hr": "h", "milliliter": "ml", "liter": "L", "litre": "L", "joule": "J", "newton": "N",
               "watt": "W", "volt": "V", "hertz": "Hz", "kelvin": "K"}


def _named(ans: str) -> Optional[tuple[str, str]]:
    """(name, value) of an answer given under a name: ``x = 3``, ``(a,b)=(4,1)``, ``5=y``; None otherwise."""
    m = _NAME_LEFT.match(ans)
    if m:
        return ans[:m.start("rest")].rstrip(" ="), m.group("rest").strip()
    m = _NAME_RIGHT.match(ans)
    if m:
        return ans[m.end("rest"):].lstrip(" ="), m.group("rest").strip()
    return None


def _value_side(ans: str) -> str:
    """The value of an equation: the side that is not a name, else the right-hand side."""
    named = _named(ans)
    if named is not None:
        return named[1]
    return _EQ.split(ans)[-1].strip() or ans


def answer_unit(ans: str) -> Optional[str]:
    """The unit after a number (``5 cm``, ``5\\,\\text{cm}``, ``5 \\text{ m}^2``, ``3 meters`` -> ``cm``, ``cm``,
    ``m^2``, ``m``), spelled one way; None without one."""
    s = re.sub(r"(?<!\\)\$", "", ans).replace("\\,", " ").replace("\\ ", " ").strip().rstrip(".").strip()
    if _EQ.search(s):
        s = _value_side(s)
    m = re.fullmatch(r"(.+?)\s*\\(?:text|mathrm|mbox)\s*\{\s*([A-Za-z][A-Za-z\s./-]*)\}\s*"
                     r"(\^\s*\{?\s*\d+\s*\}?)?\s*", s)
    if m and re.fullmatch(r"-?[\d.,]+(?:\s*(?:\\times|\\cdot)\s*10\^\{?-?\d+\}?)?", m.group(1).strip()):
        unit = m.group(2) + (re.sub(r"[\s{}]", "", m.group(3)) if m.group(3) else "")
    else:
        m = _NUMBER_THEN_UNIT.match(s)
        if not m:
            return None
        unit = s[m.end(1):]
    unit = re.sub(r"\s+", " ", unit).strip().rstrip(".").strip()
    words = []
    for w in unit.split(" "):
        base = w.lower() if len(w) > 2 else w
        if len(base) > 3 and base.endswith("s"):
            base = base[:-1]
        words.append(_UNIT_NAMES.get(base, base))
    return " ".join(words) or None


def symbol_letters(ans: str) -> set[str]:
    """Letters that name variables or symbols in an answer: LaTeX commands, ``\\text{}``-like groups, a
    leading ``x =`` and the constants ``e`` and ``i`` do not count."""
    s = _ASSIGNMENT.sub("", _bare(ans))
    return {c for c in s if c.isascii() and c.isalpha()} - {"e", "i"}


def canonical_text(ans: str) -> str:
    """The answer's text without spacing and sizing commands, with ``\\frac13`` and ``E_{1}`` spelled one
    way (a space that ends a command name before a letter is kept: ``\\pi t`` is not ``\\pit``)."""
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])|\\[,;:! ]", "", ans)
    s = re.sub(r"\\frac\s*(\w)\s*(\w)", r"\\frac{\1}{\2}", s)  # \frac13 -> \frac{1}{3}
    s = re.sub(r"([_^])\{\s*(\w)\s*\}", r"\1\2", s)  # E_{1} -> E_1
    return re.sub(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])|\s+", lambda m: m.group(1) + " " if m.group(1) else "", s)


def _timeout(seconds: Optional[int]) -> Optional[int]:
    # math-verify times out with signal.alarm, which only works in the main thread.
    return seconds if threading.current_thread() is threading.main_thread() else None


def _parse(expr: str, timeout_s: Optional[int]) -> list:
    return parse("\\boxed{" + expr + "}", parsing_timeout=_timeout(timeout_s), raise_on_error=True)


def _as_number(parsed: list) -> Optional[Any]:
    """The parsed value as a sympy number (finite, real), or None when it is anything else."""
    if not parsed or not isinstance(parsed[0], sympy.Basic):
        return None
    expr = parsed[0]
    if not getattr(expr, "is_number", False) or expr.free_symbols:
        return None
    try:
        value = sympy.N(expr, 40)
    except Exception:  # noqa: BLE001 - sympy raises many types on exotic expressions
        return None
    if not value.is_real or not value.is_finite:
        return None
    return value


def numbers_close(a: Any, b: Any, rel_tol: float = REL_TOL, abs_tol: float = 0.0) -> bool:
    """``|a - b| <= max(rel_tol * max(|a|, |b|), abs_tol)`` on sympy numbers at 40 digits."""
    diff = abs(a - b)
    return bool(diff <= max(rel_tol * max(abs(a), abs(b)), abs_tol))


def answers_equivalent(pred: str, gold: str, timeout_s: Optional[int] = 5, exact_shortcut: bool = True,
                       rel_tol: float = REL_TOL, abs_tol: float = 0.0) -> bool:
    """Whether a bare predicted answer equals the gold one (LaTeX or plain), under the rules of the module
    docstring. Raises on grader errors/timeouts; `grade_answer` is the non-raising wrapper.
    `exact_shortcut` accepts answers identical up to spacing without calling math-verify (~10 ms an
    answer, and it rejects some identical expressions);
    `abs_tol` is a per-problem absolute tolerance for numeric answers.
    Symmetric: each answer must match the other taken as the reference (the guards are one-sided)."""
    return (_equivalent(pred, gold, timeout_s, exact_shortcut, rel_tol, abs_tol)
            and _equivalent(gold, pred, timeout_s, exact_shortcut, rel_tol, abs_tol))


def _equivalent(pred: str, gold: str, timeout_s: Optional[int], exact_shortcut: bool, rel_tol: float,
                abs_tol: float) -> bool:
    pred, gold = _clean(pred), _clean(gold)
    names = _named(pred), _named(gold)
    if all(names) and canonical_text(names[0][0]) != canonical_text(names[1][0]):
        return False  # "y=3" is not "x=3", "(b,a)=(4,1)" is not "(a,b)=(4,1)"
    if bool(_EQ.search(pred)) != bool(_EQ.search(gold)):  # "m+n=17", "AB = 5" against a bare "17", "5"
        pred, gold = (_value_side(pred), gold) if _EQ.search(pred) else (pred, _value_side(gold))
    units = answer_unit(pred), answer_unit(gold)
    if all(units) and units[0] != units[1]:  # both name a unit: "5 cm" is not "5 m" (one alone may omit it)
        return False
    wrapped = bool(_WHOLE_TEXT.match(pred) or _WHOLE_TEXT.match(gold))
    pred, gold = normalize_answer(pred), normalize_answer(gold)
    words = _WORDS.fullmatch(pred), _WORDS.fullmatch(gold)
    if all(words) and (wrapped or min(len(pred), len(gold)) >= 4):  # "no" vs "on" are words, not products
        return (pred.split() == gold.split()) if max(len(pred), len(gold)) == 1 else \
            pred.lower().split() == gold.lower().split()
    if not pred or not gold:
        return False
    bare = [_TRAILING_PERCENT.fullmatch(a) for a in (pred, gold)]
    if any(bare):  # "4.2\\%" also matches "4.2" (math-verify alone reads it only as 0.042)
        unpercent = [m.group(1) if m else a for m, a in zip(bare, (pred, gold))]
        if _equivalent(unpercent[0], unpercent[1], timeout_s, exact_shortcut, rel_tol, abs_tol):
            return True
    if exact_shortcut and canonical_text(pred) == canonical_text(gold):
        return True
    if symbol_letters(gold) and not symbol_letters(pred):
        return False
    gold_parsed, pred_parsed = _parse(gold, timeout_s), _parse(pred, timeout_s)
    if not gold_parsed or not pred_parsed:
        return False
    gold_num, pred_num = _as_number(gold_parsed), _as_number(pred_parsed)
    if (gold_num is not None and symbol_letters(gold)) or (pred_num is not None and symbol_letters(pred)):
        return canonical_text(pred) == canonical_text(gold)  # the parser dropped symbols: trust text only
    numeric = gold_num is not None and pred_num is not None and "%" not in gold + pred
    if numeric and abs_tol > 0 and numbers_close(pred_num, gold_num, rel_tol, abs_tol):
        return True
    if not verify(gold_parsed, pred_parsed, timeout_seconds=_timeout(timeout_s), raise_on_error=True):
        return False
    return not numeric or numbers_close(pred_num, gold_num, rel_tol)


def grade_answer(pred: Optional[str], gold: str, timeout_s: Optional[int] = 5,
                 method: ExtractMethod = "boxed", abs_tol: float = 0.0) -> GradeResult:
    """Grade an already-extracted answer. Never raises for grader failures: they become status 'error'."""
    if pred is None or not pred.strip():
        return GradeResult("no_answer", pred, "none")
    try:
        ok = answers_equivalent(pred, gold, timeout_s, abs_tol=abs_tol)
    except BaseException as e:  # math-verify's TimeoutException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return GradeResult("error", pred, method, f"{type(e).__name__}: {e}"[:300])
    return GradeResult("correct" if ok else "incorrect", pred, method)


def grade_response(response: str, gold: str, timeout_s: Optional[int] = 5, abs_tol: float = 0.0) -> GradeResult:
    """Extract the final answer from a full model response and grade it against `gold`."""
    ext = extract_answer(response)
    return grade_answer(ext.answer, gold, timeout_s, ext.method, abs_tol=abs_tol)


__all__ = ["Extraction", "GradeResult", "GradeStatus", "REL_TOL", "answer_unit", "answers_equivalent",
           "extract_answer", "canonical_text", "extract_boxed", "grade_answer", "grade_response", "normalize_answer",
           "numbers_close", "symbol_letters"]
