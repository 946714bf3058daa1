"""Final-answer extraction and grading: math-verify equivalence behind our normalisation and guards.

Extraction is ours, so every benchmark uses the same inspectable rule. The response is first cut to where
the model stopped answering: at a chat-turn marker (``<|im_start|>user``, ``<|im_end|>``, ``<end_of_turn>``)
after its text, after a closing ``</think>`` when something follows it, and after Minerva's closing line
"Final Answer: ... I hope it is correct." (what follows is the model writing the next few-shot problem).
Then: the last ``\\boxed{}``/``\\fbox{}`` (boxes side by side, ``\\boxed{-3}`` and ``\\boxed{2}``, are one
multi-answer ``-3, 2``), unless a line starting "Final Answer" or "The final answer" with math in it comes
after it; then GSM8K ``####`` (``1,800`` is 1800, ``(1,5)`` keeps its comma); then "the answer is X" /
"Final Answer: The final answer is X. I hope it is correct." (Minerva's few-shot style: the nested phrase
is peeled off; "The largest $n$ is 34" is 34; a comma inside a math span ends nothing); then the last math
span of the response when nothing numeric follows it (``Hence $x \\ge 3$ is the solution.``: the
inequality, not its 3; ``$... = 6$``: the result of a computation), or a final numeric tuple; then the last
number (numbers glued to words, inside trailing remarks in parentheses, or after "Lemma"/"Step"/... are not
answers; ``10,455``, ``10,\\!455`` and ``1{,}000`` are one number). The gold lends its shape: against a
list of numbers the last-number rule reads a list ("the roots are 1, 5"), and against a gold that is no
equation an equation answer is the value it ends in (``$p - q = 15$`` answers 15).

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
* **Inequalities are intervals.** ``-1 \\le x \\le 4`` is ``[-1, 4]``, ``x > 3`` is ``(3, \\infty)``, in
  either orientation (``5 \\le x`` is ``x \\ge 5``, ``-x > -1`` is ``x < 1``, ``4 > x > 1`` is ``(1, 4)``),
  inequalities joined by "or" are the union; two inequalities must be about the same variable.
* **Named answers.** A name on one side of ``=`` is dropped: ``(a,b)=(4,1)``, ``g(x)=2``, ``5=y``,
  ``AB=6`` are the answers ``(4,1)``, ``2``, ``5``, ``6``. Only a name: a variable, a function of variables,
  an angle or segment, a tuple of names -- no sum, digit, coefficient or minus sign. ``2x + z = 1``,
  ``7 = 11a + c`` and ``m + n = 17`` are equations, and no bare value equals them. A named
  list (``AB=4, CD=5``) is its values in order (``4, 5``); ``x=1 \\text{ or } x=2`` is the roots ``1, 2``.
  A whole answer in ``\\text{}``/``\\mathrm{}`` is its text (``\\mathrm{B}`` is ``B``).
* **Equations.** Two equations over the same variables match when one's (left - right) is a nonzero
  constant times the other's: ``y = -\\frac12 x + \\frac34`` is ``2x + 4y - 3 = 0``; ``x = 5`` is not ``y = 5``.
* **Thousands separators by shape.** ``1,500`` is 1500, unless the other answer is a list of two
  (``1, 500``).
* **Plain-text math.** ``sqrt(5)``, ``pi``, ``**`` are read as ``\\sqrt{5}``, ``\\pi``, ``^``.
* **Symmetric.** Two answers are equivalent only when each matches the other as gold, so grading never
  depends on which side is the reference.

A grader crash or timeout counts as incorrect but is reported with its own status, so a broken grader
cannot hide inside a low accuracy.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal, Optional

import sympy
from math_verify import parse, verify
from math_verify.errors import TimeoutException

GradeStatus = Literal["correct", "incorrect", "no_answer", "error"]
ExtractMethod = Literal["boxed", "hashes", "answer_is", "prose_math", "last_number", "none"]

REL_TOL = 1e-6

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_IS_RE = re.compile(
    r"(?:final answer|the answer|^\s*(?:\*\*)?answer)\s*(?:\*\*)?\s*(?:is|:)\s*:?\s*(.+?)"
    r"(?=\.\s|\.?\s*$|\n|,\s+(?=[A-Za-z])|;\s|\s+(?:since|because|which|as|so|and so|where|when|for)\b)",
    re.IGNORECASE | re.MULTILINE)
_SEP = r"(?:,\\!|,|\{,\}|\\,|\\ |\u2009|\u202f|\u00a0)"  # thousands separators
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
_GROUPED_IN_TEXT = re.compile(r"(?<![\d,.])\d{1,3}(?:,\d{3})+(?![\d,])")
_TRAILING_PERCENT = re.compile(r"(.+?)\s*\\?%")
_DEGREES = re.compile(r"(.+?)\s*(?:\^\s*\{?\s*\\circ\s*\}?|°|\\degree)")
_TEXT_GROUPS = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox|operatorname|mathbf)\s*\{[^{}]*\}")
_COMMANDS = re.compile(r"\\[A-Za-z]+")
_ASSIGNMENT = re.compile(r"^\s*[A-Za-z](?:_\{?\w+\}?)?\s*(?:=|\\in\b)\s*(?=[^=]+$)")
_VAR = r"[A-Za-z](?:_\{?\w+\}?)?"
# A name that an answer may be given under, and only a name: a variable (x, x_1, AB, \theta, v_{max}, f'),
# a function of variables or numbers (f(x), g(x, y), f(3), P(A)), an angle, segment, area or \text{} name,
# or a tuple of names ((a, b)). Not a sum: "m + n = 17" could be AIME's "find m + n", but "x + y = 1" is a
# line, and the two cannot be told apart, so a sum is an expression (when in doubt, reject). No digit,
# coefficient or minus sign either: 2x + z, a + 3z and x - y are expressions, and "2x + z = 1" is an
# equation, not the answer 1 under a name. Each piece starts with a letter or a backslash, so the pattern cannot split a run two ways.
_GREEK = (r"\\(?:alpha|beta|gamma|delta|epsilon|varepsilon|zeta|eta|theta|vartheta|iota|kappa|lambda|mu|nu|"
          r"xi|rho|sigma|tau|upsilon|phi|varphi|chi|psi|omega|Gamma|Delta|Theta|Lambda|Xi|Sigma|Phi|Psi|"
          r"Omega)(?![A-Za-z])\s*")
_FACTOR = r"(?:[A-Za-z]|" + _GREEK + r")(?:_(?:\{[^{}=]*\}|\d+|[A-Za-z]))?'*"
_TERM = r"(?:" + _FACTOR + r")+"
_ARG = r"(?:" + _TERM + r"|-?\d+(?:\.\d+)?)"
_SUMMAND = (r"(?:(?:m\s*)?\\(?:measuredangle|angle)\s*[A-Z]{1,3}|\\overline\{[A-Z]{2}\}|\[[A-Z]{3,}\]"
            r"|\\(?:mathbf|vec|overrightarrow|boldsymbol)\s*\{[A-Za-z]{1,3}\}"
            r"|\\(?:text|mathrm)\{[A-Za-z][A-Za-z ]*\}"
            r"|" + _TERM + r"(?:(?:\^\{-1\})?\s*\(\s*" + _ARG + r"(?:\s*,\s*" + _ARG + r")*\s*\))?)")  # f^{-1}(x)
_NAME = (r"(?:" + _SUMMAND +
         r"|\(\s*" + _SUMMAND + r"(?:\s*,\s*" + _SUMMAND + r")+\s*\))")
_NAME_LEFT = re.compile(r"^\s*" + _NAME + r"\s*=\s*(?P<rest>[^=]+)$")
_NAME_RIGHT = re.compile(r"^(?P<rest>[^=]*[^=<>!\\\s])\s*=\s*" + _NAME + r"\s*$")  # not "3 >= x"
_WORDS = re.compile(r"[A-Za-z]+(?:\s+[A-Za-z]+)*")
_WHOLE_TEXT = re.compile(r"^\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}$")
_PERCENT_WORD = re.compile(r"(\d)\s*(?:\\text\{\s*)?(?:percent|per\s+cent|pct)\b\}?", re.IGNORECASE)
_LE = r"(?:\\leqslant|\\leq?(?![A-Za-z])|<=|≤)"  # not \left
_GE = r"(?:\\geqslant|\\geq?(?![A-Za-z])|>=|≥)"
_LT = r"(?:<|\\lt(?![A-Za-z]))"
_GT = r"(?:>|\\gt(?![A-Za-z]))"
_INEQ_OP = r"(?:" + _LE + r"|" + _GE + r"|" + _LT + r"|" + _GT + r")"
_BOUND = r"[^<>=≤≥]*[^<>=≤≥\s]"  # one side of an inequality: no comparison in it, no trailing space
_SIGNED_VAR = r"(?P<neg>-\s*)?(?P<var>" + _VAR + r")"
_CHAIN = re.compile(r"^\s*(?P<a>" + _BOUND + r")\s*(?P<o1>" + _INEQ_OP + r")\s*" + _SIGNED_VAR
                    + r"\s*(?P<o2>" + _INEQ_OP + r")\s*(?P<b>" + _BOUND + r")\s*$")
_VAR_FIRST = re.compile(r"^\s*" + _SIGNED_VAR + r"\s*(?P<op>" + _INEQ_OP + r")\s*(?P<v>" + _BOUND + r")\s*$")
_VAR_LAST = re.compile(r"^\s*(?P<v>" + _BOUND + r")\s*(?P<op>" + _INEQ_OP + r")\s*" + _SIGNED_VAR + r"\s*$")
_MEMBER = re.compile(r"^\s*(?P<var>" + _VAR + r")\s*\\in(?![A-Za-z])")
_OR = re.compile(r"\s*(?:\\text\{\s*or\s*\}|\\(?:lor|vee)(?![A-Za-z])|\bor\b)\s*")
_FLIP = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt"}
_SIGNED_TERM = re.compile(r"-?\s*(?:\d+(?:\.\d+)?|\\infty|\\[dt]?frac\{[^{}]*\}\{[^{}]*\}|\\sqrt\{[^{}]*\}|[A-Za-z])")
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$([^$]+)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_NUM_TUPLE = re.compile(r"(?<![\w\\])([(\[]\s*-?[\d.]+(?:\s*,\s*-?[\d.]+)+\s*[)\]])")
_BOX_CONNECTOR = re.compile(r"^(?:\s|\$|,|;|\\quad|\\qquad|\\,|\\text\{\s*(?:and|or)\s*\}|\band\b|\bor\b|"
                            r"\b[A-Za-z](?:_\{?\w+\}?)?\s*=)*$")  # "$\boxed{-3}$ or $x = \boxed{2}$"
_ANSWER_LEAD = re.compile(r"^\s*(?:\*\*)?\s*(?:the\s+)?(?:final\s+)?answer\s*(?:\*\*)?\s*(?:is|:)\s*:?\s*",
                          re.IGNORECASE)
_SCRIPTS = re.compile(r"[_^]\s*(?:\{[^{}]*\}|\w)")  # x_2, m^3, S_{10}: not values
_EQ = re.compile(r"(?<![<>\\=])=(?!=)")  # not <=, >=, ==; "7!=5040" is a factorial
_HOPE = re.compile(r"\s*\.?\s*I hope it is correct\.?\s*$", re.IGNORECASE)
_TURN_MARKER = (r"(?:<\|(?:im_start|im_end|endoftext|eot_id|eot|start_header_id|end_header_id|begin_of_text|user|"
                r"assistant|system|end)\|>|<(?:start|end)_of_turn>)")
_TURN = re.compile(_TURN_MARKER)
_LEADING_TURNS = re.compile(r"(?:\s*" + _TURN_MARKER + r"(?:[ \t]*(?:user|assistant|system|model)\b)?)*")
_LIST_WORDS = re.compile(r"\\text\{\s*(?:or|and)\s*\}|\\q?quad|\b(?:or|and)\b")
_REPEATING = re.compile(r"(-?)(\d*)\.(\d*)\\overline\{(\d+)\}")
_ALL_REALS = re.compile(r"\\mathbb\s*\{?R\}?|(?:\\text\{)?\s*(?:all\s+)?real\s+numbers\s*\}?", re.IGNORECASE)
_APPROX = re.compile(r"^\s*(?:\\approx|\\sim|≈)\s*")  # "\\approx 3.14" states 3.14
_LIST_GAP = re.compile(r"\s*(?:\$\s*)?(?:[,;]\s*(?:(?:and|or)\s+)?|(?:and|or)\s+)(?:\$\s*)?")  # "1, 5", "$1$ and $5$"
# the one-letter units latex2sympy2_extended (math_normalization.units) strips from the end of an expression
_TRAILING_LETTER = re.compile(r"(\s*)([chlost])\s*$")
_DOLLARS = re.compile(r"(?<!\\)\$\$?")
_FINAL_WORDS = re.compile(r"final answer", re.IGNORECASE)
_HOPE_WORDS = re.compile(r"I hope it is correct\.?", re.IGNORECASE)
_SUBJECT_VERB = re.compile(r"\s(?:is|are|was|were|equals|must be|will be|comes to)\s", re.IGNORECASE)
_GROUPED_TAIL = re.compile(r"(?:\\?\$|€|£)?\s*-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


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


def _last_number(text: str, items: int = 1) -> Optional[str]:
    """The last number that reads as an answer: not part of a word (``name2010``), not a reference
    (``Lemma 2``), not inside a parenthesised remark; ``$118 000`` and ``1{,}000`` are one number. When the
    gold is a list of `items` numbers, the last `items` numbers if only list separators stand between them
    ("the roots are 1, 5" is ``1, 5``; "the totals are 1,500 and 2" is ``1500, 2``)."""
    text = _PAREN_REMARK.sub(" ", text)
    text = _CURRENCY_SPACE_NUM.sub(lambda m: m.group(0).replace(m.group(1), m.group(1).replace(" ", "")), text)
    found: list[re.Match] = []
    for m in _LAST_NUMBER_RE.finditer(text):
        if not _REFERENCE_WORDS.search(text[max(0, m.start() - 12):m.start()]):
            found = (found + [m])[-max(items, 1):]
    if not found:
        return None
    values = [re.sub(_SEP, "", m.group(1) or m.group(2)) for m in found]
    if items > 1 and len(found) == items and all(_LIST_GAP.fullmatch(text[a.end():b.start()])
                                                 for a, b in zip(found, found[1:])):
        return ", ".join(values)
    return values[-1]


def _gold_items(gold: Optional[str]) -> int:
    """How many numbers the gold lists (``1, 5`` -> 2); 1 for anything but a plain list of numbers."""
    if not gold:
        return 1
    parts = _split_top(normalize_answer(gold))
    return len(parts) if len(parts) > 1 and all(_plain_number(p) is not None for p in parts) else 1


def _answer_phrase(text: str) -> Optional[tuple[str, int]]:
    """The last "the answer is X" / "Final Answer: X" (nested phrases and Minerva's "I hope it is correct"
    peeled off) and where it starts; None without one."""
    matches = list(_ANSWER_IS_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    if m.group(1).rstrip().endswith("?") or text[m.end(1):m.end(1) + 1] == "?":
        return None  # "Is it a coincidence that the answer is 24?" asks, it does not answer
    ans = m.group(1)
    if len(_DOLLARS.findall(ans)) % 2:  # a clause stop inside "$AB = 4, CD = 5$": to the span's end
        close = _DOLLARS.search(text, m.end(1))
        if close and "\n" not in text[m.end(1):close.start()]:
            ans = text[m.start(1):close.end()]
    ans = ans.replace("**", "")  # markdown bold
    ans = _HOPE.sub("", ans)
    while True:
        peeled = _ANSWER_LEAD.sub("", ans, count=1)
        if peeled == ans:
            break
        ans = peeled
    ans = _subject_value(ans.strip())
    while ans.endswith(")") and ans.count(")") > ans.count("("):  # "(...; here the answer is 21.)"
        ans = ans[:-1].rstrip(" .")
    return (ans, m.start()) if _clean(ans) else None


def _bare_math(ans: str) -> bool:
    """Whether `ans` reads as math, not prose: a digit or LaTeX in it, no two words in a row."""
    return bool(re.search(r"[\d\\]", ans)) and not re.search(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}", _bare(ans))


def _subject_value(ans: str) -> str:
    """An answer stated with its subject is its value: "The largest $n$ is 34" -> ``34``, "the volume of
    $ABCDEFGH$ is 120" -> ``120``, "There are 12 ways" -> ``12 ways`` (the unit rule drops the word). The
    subject must have a word in it and the value must read as math; anything else is returned unchanged."""
    verbs = list(_SUBJECT_VERB.finditer(ans))
    if not verbs or _bare_math(ans):
        return ans
    subject, value = ans[:verbs[-1].start()], ans[verbs[-1].end():].strip()
    if not re.search(r"[A-Za-z]{2,}", _bare(_MATH_SPAN.sub(" ", subject))) or "=" in subject:
        return ans
    return value if _bare_math(normalize_answer(value)) else ans


def _response_end(text: str) -> str:
    """The part of a response that holds its answer: up to the first chat-turn marker after its text
    (``... is 19. <|im_start|>user ...`` runs on into a made-up turn); after the reasoning block when one
    closes (``<think>... \\boxed{8}</think> **Answer:** 7`` answers 7) and something follows it; and up to the
    end of Minerva's closing line "Final Answer: ... I hope it is correct." (what follows is the model
    writing the next few-shot problem, with its own final answer)."""
    text = text[_LEADING_TURNS.match(text).end():]
    marker = _TURN.search(text)
    if marker:
        text = text[:marker.start()]
    _, closed, after = text.rpartition("</think>")
    if closed and after.strip():
        text = after
    offset = 0
    for line in text.splitlines(keepends=True):  # line by line: linear in the length of the text
        final = _FINAL_WORDS.search(line)
        hope = _HOPE_WORDS.search(line, final.end()) if final else None
        if hope:
            return text[:offset + hope.end()]
        offset += len(line)
    return text


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


_FINAL_LINE = re.compile(r"^\s*(?:\*\*)?\s*(?:the\s+)?final answer\b", re.IGNORECASE | re.MULTILINE)


def _final_line_answer(text: str, phrase: tuple[str, int], after: int) -> bool:
    """Whether a final-answer phrase after the last box replaces it: it starts a line with "Final Answer" or
    "The final answer" (``Final Answer: The final answer is 12.``, not "...to think the answer is 6") and is
    bare math -- a digit or LaTeX, no prose words (``7 in both cases``, ``at most 3 more`` are remarks), no
    denial (``not 8``)."""
    ans, start = phrase
    line = _FINAL_LINE.search(text, after)
    if line is None or not line.start() <= start <= line.end() + 1 or _BOX_RE.search(ans):
        return False
    return _bare_math(ans) and not re.search(r"\b(?:not|never|no)\b", ans, re.IGNORECASE)  # "not 8" denies


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
            if _EQ.search(content) and not re.search(_INEQ_OP, content):
                content = _computed(content) or content  # "y = 2x + 1", "2x + z = 1" stay as written
            if content:
                return content
    tuples = list(_NUM_TUPLE.finditer(text))
    if tuples and not re.search(r"\d", text[tuples[-1].end():]):
        return tuples[-1].group(1)
    return None


def extract_answer(text: str, gold: Optional[str] = None) -> Extraction:
    """The model's final answer, by the first rule that matches (see module docstring). `gold`, when given,
    lends its shape: a list of numbers makes the last-number rule read a list (see `_last_number`), and a gold
    that is no equation makes an equation answer its last side (see `_fit_to_gold`)."""
    ext = _extract(_response_end(text), gold)
    return Extraction(_fit_to_gold(ext.answer, gold, ext.method), ext.method)


def _fit_to_gold(answer: Optional[str], gold: Optional[str], method: ExtractMethod) -> Optional[str]:
    """A response's equation answer against a gold that is no equation is the value the equation ends in:
    ``p - q = 15``, ``200 + 2d = 350``, ``(r^2 + 3r) - (r^2 + 7r) = -4r`` answer ``15``, ``350``, ``-4r`` (a
    solution that ends in a derivation). A gold that is an equation keeps the answer whole, so ``2x + z = 1``
    is held to it as an equation. A named list (``AB = 4, CD = 5``) stays one, unless it is the last math of
    the prose against a single-value gold (``$a=60, b=750, a+b=810$``: the quantities found on the way, the
    one asked for last). Only responses are read this way; `answers_equivalent` itself compares an equation
    with a bare value strictly."""
    if answer is None or gold is None or _EQ.search(_unwrap(gold)) or not _EQ.search(answer):
        return answer
    if _named_list(answer) is not None and (method != "prose_math" or len(_split_top(_unwrap(gold))) > 1):
        return answer
    return _EQ.split(answer)[-1].strip() or answer


def _extract(text: str, gold: Optional[str]) -> Extraction:
    boxes = _boxes(text)
    phrase = _answer_phrase(text)
    if boxes:
        if phrase is not None and phrase[1] >= boxes[-1][2] and _final_line_answer(text, phrase, boxes[-1][2]):
            return Extraction(normalize_answer(phrase[0], True), "answer_is")  # a final-answer line after the boxes
        return Extraction(extract_boxed(text), "boxed")
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        if tail:
            tail = _clean(tail)  # "#### 1,800" is 1800; "#### (1,5)" and "#### 1, 5" keep their commas
            return Extraction(tail.replace(",", "") if _GROUPED_TAIL.fullmatch(tail) else tail, "hashes")
    if phrase is not None:
        return Extraction(normalize_answer(phrase[0], True), "answer_is")
    items = _gold_items(gold)
    listed = _last_number(text, items) if items > 1 else None
    if listed is not None and ", " in listed:  # "the roots are $1$ and $5$" against the gold "1, 5"
        return Extraction(listed, "last_number")
    prose = _prose_answer(text)
    if prose is not None:
        return Extraction(normalize_answer(prose, True), "prose_math")
    number = _last_number(text, items)
    if number is not None:
        return Extraction(number, "last_number")
    return Extraction(None, "none")


# ---------------------------------------------------------------------------------------------
# normalisation and guards


def _unwrap(ans: str) -> str:
    """`ans` without math delimiters (``$``, ``\\(...\\)``, ``\\[...\\]``) and a closing full stop."""
    s = re.sub(r"(?<!\\)\$", "", ans.strip())
    for left, right in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right):
            s = s[2:-2]
    return s.strip().rstrip(".").strip()


def normalize_answer(ans: str, keep_relation: bool = False) -> str:
    """Rewrite formatting that math-verify misreads or that carries no meaning (see module docstring).
    Idempotent; applied to gold and prediction alike. `keep_relation` (extraction) keeps a name, an
    inequality and a set membership as written (``y = 2x + 1``, ``x \\ge 3``), so that grading can hold
    them to their gold (``2x - y + 1 = 0``; not ``y \\ge 3``)."""
    s = _APPROX.sub("", _unwrap(ans))
    s = re.sub(r",\\!\s*", ",", s).replace("\\!", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    if not keep_relation:
        s = re.sub(r"^\s*[A-Za-z]\s*\\in(?![A-Za-z])\s*", "", s)  # "x \\in [-2, 7]" states the set [-2, 7]
    m = _WHOLE_TEXT.match(s)
    if m:
        s = m.group(1).strip()
    s = _plain_math(s)
    s = _PERCENT_WORD.sub(r"\1\\%", s)
    named = None
    if not keep_relation:
        s = _interval(s)
        named = _named(s)
    if named is not None and named[1]:
        s = named[1]
    m = _NUMBER_THEN_UNIT.match(s)
    if m:
        s = m.group(1)
    if re.fullmatch(r"-?\d{1,3}(?:" + _SEP + r"\d{3})+(?:\.\d+)?", s):
        s = re.sub(_SEP, "", s)
    listed = _GROUPED_IN_TEXT.sub(lambda g: g.group(0).replace(",", ""), s)  # "1,000 and 2,000"
    if _NUMBER_LIST_AND.fullmatch(listed):
        s = re.sub(r"\s*,?\s+and\s+", ", ", listed)
    m = _DEGREES.fullmatch(s)
    if m and _plain_number(m.group(1)) is not None:  # "30^\\circ", "1,080°"
        s = _plain_number(m.group(1))
    m = _REPEATING.fullmatch(s)
    if m:  # 0.\\overline{3} = 3/9, 1.2\\overline{45} = (1245 - 12) / 990
        sign, whole, fixed, period = m.groups()
        den = (10 ** len(period) - 1) * 10 ** len(fixed)
        s = f"{sign}\\frac{{{int(whole + fixed + period) - int(whole + fixed or '0')}}}{{{den}}}"
    s = re.sub(r"\\varnothing|\\\{\s*\\\}", r"\\emptyset", s)
    if _ALL_REALS.fullmatch(s):  # "\\mathbb{R}", "all real numbers"
        s = "(-\\infty, \\infty)"
    m = _E_NOTATION.match(s)
    if m:
        s = f"{m.group(1)} \\times 10^{{{int(m.group(2))}}}"
    m = re.fullmatch(r"(.+?)\s*\\(?:text|mathrm|mbox)\s*\{\s*[A-Za-z][A-Za-z\s./^-]*\}\s*", s)
    if m and _plain_number(m.group(1)) is not None:
        s = _plain_number(m.group(1))
    return s.strip()


def _plain_number(s: str) -> Optional[str]:
    """A plain decimal number (thousands separators allowed: ``1,080``) without its separators; else None."""
    s = s.strip()
    if re.fullmatch(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+", s):
        return s.replace(",", "")
    return None


def _plain_math(s: str) -> str:
    """Plain-text math as LaTeX: ``sqrt(5)`` / ``sqrt 5``, ``pi``, ``infinity``, ``**``."""
    s = re.sub(r"(?<![\\A-Za-z])sqrt\s*\(([^()]*)\)", r"\\sqrt{\1}", s)
    s = re.sub(r"(?<![\\A-Za-z])sqrt\s*(\d+)", r"\\sqrt{\1}", s)
    s = re.sub(r"(?<![\\A-Za-z])pi(?![A-Za-z])", r"\\pi ", s).replace("\\pi }", "\\pi}")
    s = re.sub(r"(?<![\\A-Za-z])(?:infinity|inf)(?![A-Za-z])", r"\\infty", s)
    return s.replace("**", "^").strip()


def _op_kind(op: str) -> str:
    for kind, pattern in (("le", _LE), ("ge", _GE), ("lt", _LT), ("gt", _GT)):
        if re.fullmatch(pattern, op):
            return kind
    raise ValueError(op)


def _negate(v: str) -> str:
    v = v.strip()
    if _SIGNED_TERM.fullmatch(v):
        return v[1:].strip() if v.startswith("-") else "-" + v
    return f"-({v})"


def _inequality(s: str) -> Optional[tuple[str, str]]:
    """(variable, interval) of a one-variable inequality, in either orientation: ``-1 \\le x < 4`` ->
    ``[-1, 4)``; ``x \\ge 3``, ``3 \\le x`` -> ``[3, \\infty)``; ``4 > x > 1`` -> ``(1, 4)``; ``-x > -1`` ->
    ``(-\\infty, 1)`` (a negated variable flips the comparison); ``x < -1 \\text{ or } x > 1`` -> the union
    ``(-\\infty, -1) \\cup (1, \\infty)`` (one variable throughout). None for anything else (``x < 1 < 2``,
    ``2x > 6``, ``1 < x > 2``, ``x < 1 \\text{ or } y > 2``)."""
    parts = _OR.split(s)
    if len(parts) > 1:
        found = [_inequality(p) for p in parts]
        if not all(found) or len({var for var, _ in found}) != 1:
            return None
        return found[0][0], " \\cup ".join(interval for _, interval in found)
    m = _CHAIN.match(s)
    if m:
        a, b, o1, o2 = m.group("a").strip(), m.group("b").strip(), _op_kind(m.group("o1")), _op_kind(m.group("o2"))
        if m.group("neg"):
            a, b, o1, o2 = _negate(a), _negate(b), _FLIP[o1], _FLIP[o2]
        if o1 in ("gt", "ge") and o2 in ("gt", "ge"):
            a, b, o1, o2 = b, a, _FLIP[o2], _FLIP[o1]
        if o1 not in ("lt", "le") or o2 not in ("lt", "le") or re.search(_INEQ_OP, a + " " + b):
            return None
        return canonical_text(m.group("var")), f"{'[' if o1 == 'le' else '('}{a}, {b}{']' if o2 == 'le' else ')'}"
    m = _VAR_FIRST.match(s) or _VAR_LAST.match(s)
    if m is None or re.search(_INEQ_OP, m.group("v")):
        return None
    op, v = _op_kind(m.group("op")), m.group("v").strip()
    if m.re is _VAR_LAST:
        op = _FLIP[op]
    if m.group("neg"):
        op, v = _FLIP[op], _negate(v)
    interval = {"ge": f"[{v}, \\infty)", "gt": f"({v}, \\infty)", "le": f"(-\\infty, {v}]", "lt": f"(-\\infty, {v})"}
    return canonical_text(m.group("var")), interval[op]


def _interval(s: str) -> str:
    """A one-variable inequality as the interval it states (see `_inequality`); anything else unchanged."""
    found = _inequality(s)
    return found[1] if found else s


def _compared_variable(s: str) -> Optional[str]:
    """The variable an inequality or a set membership (``x \\in [1, 2]``) speaks of; None without one."""
    found = _inequality(s)
    if found:
        return found[0]
    m = _MEMBER.match(s)
    return canonical_text(m.group("var")) if m else None


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


def _value_side(ans: str) -> Optional[str]:
    """The value an equation states: the side that is not a name (``x = 3``, ``5 = y``, ``AB = 6``), or
    the last side of a computation whose last side names no variable (``3 \\times 4 = 12``,
    ``x = 2 + 3 = 5``, ``A = \\pi r^2 = 25\\pi``). None for an equation between expressions (``2x + z = 1``,
    ``7 = 11a + c``): it states a relation, and no bare value equals it."""
    named = _named(ans)
    if named is not None:
        return named[1]
    sides = [side.strip() for side in _EQ.split(ans)]
    if len(sides) < 2 or not all(sides) or symbol_letters(sides[-1]):
        return None
    if len(sides) > 2 or not symbol_letters(sides[0]):
        return sides[-1]
    return None


def _computed(ans: str) -> Optional[str]:
    """The result of a computation written as an equation: its last side, when that names no variable and
    the answer is not a name alone with its value (``\\frac12 \\cdot 4 \\cdot 3 = 6``,
    ``x = \\left(\\frac12\\right)^2 = \\frac14``); else None (``x = 5``, ``y = 2x + 1`` and ``2x + z = 1`` are answers
    as they stand)."""
    if _named(ans) is not None or _named_list(ans) is not None:
        return None
    return _value_side(ans)


def _split_top(ans: str) -> list[str]:
    """`ans` split at the commas and semicolons outside brackets and braces."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(ans):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c in ",;" and depth == 0:
            parts.append(ans[start:i].strip())
            start = i + 1
    return parts + [ans[start:].strip()]


def _named_list(ans: str) -> Optional[list[tuple[str, str]]]:
    """[(name, value), ...] of a list whose every item is named (``AB=4, CD=5``; ``x=1 \\text{ or } x=2``);
    else None."""
    parts = [p for p in _split_top(_LIST_WORDS.sub(",", ans)) if p]
    if len(parts) < 2:
        return None
    named = [_named(p) for p in parts]
    if not all(named):
        return None
    return [(canonical_text(n), v) for n, v in named]


def answer_unit(ans: str) -> Optional[str]:
    """The unit after a number (``5 cm``, ``5\\,\\text{cm}``, ``5 \\text{ m}^2``, ``3 meters`` -> ``cm``, ``cm``,
    ``m^2``, ``m``), spelled one way; None without one."""
    s = re.sub(r"(?<!\\)\$", "", ans).replace("\\,", " ").replace("\\ ", " ").strip().rstrip(".").strip()
    if _EQ.search(s):
        s = _value_side(s) or s
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
    s = re.sub(r"\\\\|\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])|\\[,;:! ]",
               lambda m: m.group(0) if m.group(0) == "\\\\" else "", ans)  # a matrix row break is kept
    s = re.sub(r"\\frac\s*(\w)\s*(\w)", r"\\frac{\1}{\2}", s)  # \frac13 -> \frac{1}{3}
    s = re.sub(r"([_^])\{\s*(\w)\s*\}", r"\1\2", s)  # E_{1} -> E_1
    return re.sub(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])|\s+", lambda m: m.group(1) + " " if m.group(1) else "", s)


def _timeout(deadline: Optional[float]) -> Optional[int]:
    """Seconds left for the next math-verify call before the case's deadline (whole seconds, at least 1:
    math-verify times out with signal.alarm, which only works in the main thread -- None elsewhere).
    Past the deadline the case stops here with math-verify's TimeoutException."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutException("grading took longer than its time budget")
    return max(1, int(left)) if threading.current_thread() is threading.main_thread() else None


def _parse(expr: str, deadline: Optional[float]) -> list:
    """math-verify's parse of `expr`. A letter at the end that math-verify takes for a unit (c, h, l, o, s, t)
    is set off with a thin space when a space, a digit or a brace comes before it: math-verify would drop it
    (``3a + t`` parsed to 3, ``3 + t`` to nothing, ``4t`` to 4); our own unit rules have already run."""
    m = _TRAILING_LETTER.search(expr)
    if m and expr[:m.start()] and (m.group(1) or expr[m.start() - 1] in "0123456789}"):
        expr = expr[:m.start()] + "\\," + m.group(2)
    return parse("\\boxed{" + expr + "}", parsing_timeout=_timeout(deadline), raise_on_error=True)


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
    `timeout_s` bounds the whole comparison, both directions and every parse in it (math-verify's alarm has
    whole seconds, so the last call may end up to a second late); past it, math-verify's TimeoutException.
    Symmetric: each answer must match the other taken as the reference (the guards are one-sided)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    return (_equivalent(pred, gold, deadline, exact_shortcut, rel_tol, abs_tol)
            and _equivalent(gold, pred, deadline, exact_shortcut, rel_tol, abs_tol))


_GROUPED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _thousands_by_shape(ans: str, other: str) -> str:
    """``1,500`` is the number 1500 (`normalize_answer`) unless the other answer is a list of as many items
    (``1, 500``): then it is that list. The other answer's shape decides, as a reader would."""
    if _GROUPED.fullmatch(ans) and len(_split_top(normalize_answer(other))) == ans.count(",") + 1:
        return ans.replace(",", ", ")
    return ans


def _enclosed(s: str) -> Optional[str]:
    """The inside of ``( ... )`` when those parentheses enclose all of `s`; else None."""
    if not (s.startswith("(") and s.endswith(")")):
        return None
    depth = 0
    for i, c in enumerate(s):
        depth += (c == "(") - (c == ")")
        if depth == 0 and i < len(s) - 1:
            return None
    return s[1:-1]


def _named_lists_equivalent(pred: str, gold: str, lists: tuple, same) -> bool:
    """Named multi-answers. Both named: the same names, each with an equivalent value (``AB=4, CD=5`` is
    ``CD=5, AB=4``). One named, the other a bare list or tuple: the values in the order given (``AB=4, CD=5``
    is ``4, 5``, not ``5, 4``). One name throughout (``x=1, x=2``): the values as an unordered multi-answer."""
    a, b = lists
    if a and b:
        if sorted(n for n, _ in a) != sorted(n for n, _ in b):
            return False
        if len({n for n, _ in a}) == 1:
            return same(", ".join(v for _, v in a), ", ".join(v for _, v in b))
        if len({n for n, _ in a}) != len(a):
            return False
        values = dict(b)
        return all(same(v, values[n]) for n, v in a)
    named, bare = (a, gold) if a else (b, pred)
    values = [v for _, v in named]

    def check(v: str, other: str) -> bool:
        return same(v, other) if a else same(other, v)

    if len({n for n, _ in named}) == 1:
        return check(", ".join(values), bare)
    bare = normalize_answer(bare)
    parts = _split_top(bare)
    if len(parts) == 1 and _enclosed(bare) is not None:
        parts = _split_top(_enclosed(bare))
    return len(parts) == len(values) and all(check(v, p) for v, p in zip(values, parts))


def _equation_sides(ans: str) -> Optional[list[str]]:
    """The two sides of an answer that is one equation (no list, inequality or membership); else None."""
    if len(ans) > 300 or re.search(_INEQ_OP + r"|\\in(?![A-Za-z])|\\ne", ans) or len(_split_top(ans)) > 1:
        return None
    sides = [side.strip() for side in _EQ.split(ans)]
    return sides if len(sides) == 2 and all(sides) else None


def _same_equation(pred: str, gold: str, deadline: Optional[float]) -> bool:
    """Whether two equations state the same relation: over the same variables, (left - right) of one is a
    nonzero constant times the other's (``y = -\\frac{1}{2}x + \\frac{3}{4}`` and ``2x + 4y - 3 = 0``; ``x = 5``
    and ``2x = 10``; not ``x = 5`` and ``y = 5``, not ``x^2 = 4`` and ``x = 2``)."""
    sides = _equation_sides(pred), _equation_sides(gold)
    if not all(sides):
        return False
    forms = []
    for left, right in sides:
        try:
            parsed = [_parse(normalize_answer(side), deadline) for side in (left, right)]
        except Exception:  # noqa: BLE001 - an unparsable side is not an equation we can compare
            return False
        if not all(p and isinstance(p[0], sympy.Expr) for p in parsed):
            return False
        if any(symbol_letters(side) and not p[0].free_symbols for side, p in zip((left, right), parsed)):
            return False  # a lossy parse dropped the variables
        forms.append(parsed[0][0] - parsed[1][0])
    f, g = forms
    if not f.free_symbols or f.free_symbols != g.free_symbols:
        return False
    try:
        ratio = sympy.cancel(f / g)
    except Exception:  # noqa: BLE001 - sympy raises many types on exotic expressions
        return False
    return bool(ratio.is_number and not ratio.free_symbols and ratio != 0 and ratio.is_finite)


def _equivalent(pred: str, gold: str, deadline: Optional[float], exact_shortcut: bool, rel_tol: float,
                abs_tol: float) -> bool:
    def same(p: str, g: str) -> bool:
        return _equivalent(p, g, deadline, exact_shortcut, rel_tol, abs_tol)

    pred, gold = _unwrap(pred), _unwrap(gold)
    lists = _named_list(pred), _named_list(gold)
    if any(lists):  # "AB=4, CD=5" against "4, 5" or "CD=5, AB=4"
        return _named_lists_equivalent(pred, gold, lists, same)
    pred, gold = _thousands_by_shape(pred, gold), _thousands_by_shape(gold, pred)
    if _same_equation(pred, gold, deadline):  # "y = -\\frac12 x + \\frac34" is "2x + 4y - 3 = 0"
        return True
    variables = _compared_variable(pred), _compared_variable(gold)
    if all(variables) and variables[0] != variables[1]:
        return False  # "y > 3" is not "x > 3"
    names = _named(pred), _named(gold)
    if all(names) and canonical_text(names[0][0]) != canonical_text(names[1][0]):
        return False  # "y=3" is not "x=3", "(b,a)=(4,1)" is not "(a,b)=(4,1)"
    if bool(_EQ.search(pred)) != bool(_EQ.search(gold)):  # "m+n=17", "AB = 5" against a bare "17", "5"
        value = _value_side(pred if _EQ.search(pred) else gold)
        if value is None:
            return False  # "2x + z = 1" is an equation; the bare "1" is not equal to it
        pred, gold = (value, gold) if _EQ.search(pred) else (pred, value)
    units = answer_unit(pred), answer_unit(gold)
    if all(units) and units[0] != units[1]:  # both name a unit: "5 cm" is not "5 m" (one alone may omit it)
        return False
    wrapped = bool(_WHOLE_TEXT.match(pred) or _WHOLE_TEXT.match(gold))
    pred, gold = normalize_answer(pred), normalize_answer(gold)
    if bool(_EQ.search(pred)) != bool(_EQ.search(gold)):
        return False  # an equation left after names are dropped (math-verify would compare its right side)
    words = _WORDS.fullmatch(pred), _WORDS.fullmatch(gold)
    if all(words) and (wrapped or min(len(pred), len(gold)) >= 4):  # "no" vs "on" are words, not products
        return (pred.split() == gold.split()) if max(len(pred), len(gold)) == 1 else \
            pred.lower().split() == gold.lower().split()
    if not pred or not gold:
        return False
    bare = [_TRAILING_PERCENT.fullmatch(a) for a in (pred, gold)]
    if any(bare):  # "4.2\\%" also matches "4.2" (math-verify alone reads it only as 0.042)
        unpercent = [m.group(1) if m else a for m, a in zip(bare, (pred, gold))]
        if _equivalent(unpercent[0], unpercent[1], deadline, exact_shortcut, rel_tol, abs_tol):
            return True
    if exact_shortcut and canonical_text(pred) == canonical_text(gold):
        return True
    if symbol_letters(gold) and not symbol_letters(pred):
        return False
    gold_parsed, pred_parsed = _parse(gold, deadline), _parse(pred, deadline)
    if not gold_parsed or not pred_parsed:
        return False
    gold_num, pred_num = _as_number(gold_parsed), _as_number(pred_parsed)
    if (gold_num is not None and symbol_letters(gold)) or (pred_num is not None and symbol_letters(pred)):
        return canonical_text(pred) == canonical_text(gold)  # the parser dropped symbols: trust text only
    numeric = gold_num is not None and pred_num is not None and "%" not in gold + pred
    if numeric and abs_tol > 0 and numbers_close(pred_num, gold_num, rel_tol, abs_tol):
        return True
    if not verify(gold_parsed, pred_parsed, timeout_seconds=_timeout(deadline), raise_on_error=True):
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


STATED: tuple[ExtractMethod, ...] = ("boxed", "hashes", "answer_is")
"""The rules that read an answer the response states as final (a box, ``####``, "the answer is"). The others
(the last math of the prose, the last number) read wherever the text stops, which, for a response cut at the
token budget, is wherever the cut fell: a number on the way, not an answer."""


def grade_response(response: str, gold: str, timeout_s: Optional[int] = 5, abs_tol: float = 0.0,
                   truncated: bool = False) -> GradeResult:
    """Extract the final answer from a full model response and grade it against `gold`. A `truncated` response
    (cut at the budget, no EOS) is graded only by an answer it states as final (STATED); one that states none has
    no answer. Real outputs showed why: Qwen2.5-Coder-0.5B cut at 384 tokens in "...Therefore, the number of
    boxes Marie ordered is \\(\\boxed" was graded correct from the last number of its working
    (tests/support/grading_regression_qwen.jsonl)."""
    ext = extract_answer(response, gold)
    if truncated and ext.method not in STATED:
        return GradeResult("no_answer", None, "none")
    return grade_answer(ext.answer, gold, timeout_s, ext.method, abs_tol=abs_tol)


__all__ = ["STATED", "Extraction", "GradeResult", "GradeStatus", "REL_TOL", "answer_unit", "answers_equivalent",
           "extract_answer", "canonical_text", "extract_boxed", "grade_answer", "grade_response", "normalize_answer",
           "numbers_close", "symbol_letters"]
