"""Final-answer extraction and math-verify grading.

Extraction is ours (so every benchmark uses the same, inspectable rule: last ``\\boxed{}``/``\\fbox{}``,
then GSM8K ``####``, then "the answer is X", then the last number); equivalence is math-verify's
(sympy-based, so ``\\frac{1}{2}`` == ``0.5`` and ``[2,5)`` != ``(2,5)``). A grader crash or timeout
counts as incorrect but is reported with its own status, so a broken grader cannot hide inside a low
accuracy.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Literal, Optional

GradeStatus = Literal["correct", "incorrect", "no_answer", "error"]
ExtractMethod = Literal["boxed", "hashes", "answer_is", "last_number", "none"]

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_IS_RE = re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*:?\s*(.+?)(?=\.\s|\.?\s*$|\n)",
                           re.IGNORECASE | re.MULTILINE)
_NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+/\d+|-?\d+(?:\.\d+)?|-?\.\d+")


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


def extract_boxed(text: str) -> Optional[str]:
    """The content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces allowed), or
    of ``\\boxed 5`` (no braces: up to whitespace or ``$``). An unclosed last box (a truncated response)
    is passed over in favour of the previous complete one."""
    found: Optional[str] = None
    for m in _BOX_RE.finditer(text):
        j = m.end()
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            group = _braced(text, j)
            if group is not None:
                found = group[0]
        elif j > m.end():
            tok = re.match(r"[^\s$]+", text[j:])
            if tok:
                found = tok.group(0)
    return found.strip() if found is not None else None


def _clean(ans: str) -> str:
    ans = ans.strip()
    if len(ans) >= 2 and ans[0] == "$" and ans[-1] == "$":
        ans = ans.strip("$").strip()
    return ans.rstrip(".").strip()


def extract_answer(text: str) -> Extraction:
    """The model's final answer, by the first rule that matches (see module docstring)."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return Extraction(boxed, "boxed")
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        if tail:
            return Extraction(_clean(tail).replace(",", ""), "hashes")
    matches = _ANSWER_IS_RE.findall(text)
    if matches and _clean(matches[-1]):
        return Extraction(_clean(matches[-1]), "answer_is")
    numbers = _NUMBER_RE.findall(text)
    if numbers:
        return Extraction(numbers[-1].replace(",", ""), "last_number")
    return Extraction(None, "none")


def _timeout(seconds: Optional[int]) -> Optional[int]:
    # math-verify times out with signal.alarm, which only works in the main thread.
    return seconds if threading.current_thread() is threading.main_thread() else None


def _parse(expr: str, timeout_s: Optional[int]) -> list:
    from math_verify import parse

    return parse("\\boxed{" + expr + "}", parsing_timeout=_timeout(timeout_s), raise_on_error=True)


def answers_equivalent(pred: str, gold: str, timeout_s: Optional[int] = 5, exact_shortcut: bool = True) -> bool:
    """math-verify equivalence of two bare answers (LaTeX or plain). Raises on grader errors/timeouts;
    `grade_answer` is the non-raising wrapper. `exact_shortcut` accepts identical strings without
    calling math-verify (sympy parsing is ~10 ms an answer)."""
    from math_verify import verify

    pred, gold = _clean(pred), _clean(gold)
    if not pred or not gold:
        return False
    if exact_shortcut and pred == gold:
        return True
    gold_parsed, pred_parsed = _parse(gold, timeout_s), _parse(pred, timeout_s)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=_timeout(timeout_s), raise_on_error=True))


def grade_answer(pred: Optional[str], gold: str, timeout_s: Optional[int] = 5,
                 method: ExtractMethod = "boxed") -> GradeResult:
    """Grade an already-extracted answer. Never raises for grader failures: they become status 'error'."""
    if pred is None or not pred.strip():
        return GradeResult("no_answer", pred, "none")
    try:
        ok = answers_equivalent(pred, gold, timeout_s)
    except BaseException as e:  # math-verify's TimeoutException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return GradeResult("error", pred, method, f"{type(e).__name__}: {e}"[:300])
    return GradeResult("correct" if ok else "incorrect", pred, method)


def grade_response(response: str, gold: str, timeout_s: Optional[int] = 5) -> GradeResult:
    """Extract the final answer from a full model response and grade it against `gold`."""
    ext = extract_answer(response)
    return grade_answer(ext.answer, gold, timeout_s, ext.method)


__all__ = ["Extraction", "GradeResult", "GradeStatus", "answers_equivalent", "extract_answer",
           "extract_boxed", "grade_answer", "grade_response"]
