"""`megatron-opd grade-audit`: measure the grader on a benchmark file before trusting its accuracies.

For every row it writes the reference answer the way a model does (``\\boxed{}``, ``\\dfrac``, units,
Minerva's e-notation as ``\\times 10^{}``, "the answer is N") and checks that each is graded correct;
then it perturbs the answer (off by one in a digit, sign flipped, a coefficient changed, an interval
bracket flipped) and checks that each perturbation is graded wrong. No model is involved, so this runs
in seconds on any machine and tells a user how far to trust the grader on their files::

    megatron-opd grade-audit --data-dir data/ --benchmarks math500,minerva_math,olympiadbench,amc23,aime24,aime25

With ``--labelled FILE`` it measures the grader against a team's own human labels instead: a JSONL file of
``{"gold": ..., "prediction": ... | "response": ..., "label": true/false, "category": ... (optional)}``
(``prediction`` is an extracted answer, ``response`` a whole model response to extract from; ``label`` may
also be "correct"/"incorrect" or 1/0; ``"truncated": true`` marks a response cut at its budget, graded only by
an answer it states as final). It prints the false accepts first (a wrong answer graded correct
inflates every accuracy the project reports), by category, most first; then the false rejects; then
agreement per category with the slowest case's grading time (``--show`` examples of each per category), so
a team can audit the grader on its data before trusting a number::

    megatron-opd grade-audit --labelled my_labels.jsonl [--out DIR] [--min-agreement 0.98] [--max-false-accepts 0]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from megatron_opd.eval.benchmarks import BenchmarkRow, read_benchmark_rows, resolve_benchmarks
from megatron_opd.eval.grading import grade_answer, grade_response, normalize_answer

_FIRST_NUMBER = re.compile(r"(?<![\w\\^_])\d+(?:\.\d+)?")
_COEFFICIENT = re.compile(r"(?<![\w\\^_.])(\d+)(?=\s*(?:[A-Za-z]|\\(?:sqrt|pi|frac|log|sin|cos)))")


def _top_level_split(ans: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for c in ans:
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += c
    return parts + [cur.strip()]


def reference_forms(answer: str, unit: Optional[str] = None, multiple: bool = False) -> list[tuple[str, str]]:
    """(kind, response text) renderings of a correct answer as models write it."""
    ans = re.sub(r"(?<!\\)\$", "", answer).strip()
    forms = [("boxed", f"So the final answer is $\\boxed{{{ans}}}$.")]
    sci = normalize_answer(ans)
    if sci != ans and "\\times 10^" in sci:
        forms.append(("times_10", f"Thus $L \\approx \\boxed{{{sci}}}$."))
    if "\\frac" in ans:
        forms.append(("dfrac", f"Hence the answer is $\\boxed{{{ans.replace(chr(92) + 'frac', chr(92) + 'dfrac')}}}$."))
    tight = re.sub(r"(?<![\\A-Za-z])(\\[A-Za-z]+)\s+(?=[A-Za-z])|\s+", lambda m: m.group(1) + " " if m.group(1) else "", ans)
    if tight != ans and "\\text" not in ans and "\\mbox" not in ans:
        forms.append(("no_spaces", f"The answer is $\\boxed{{{tight}}}$."))
    frac = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", ans)
    if frac:
        forms.append(("slash", f"The answer is $\\boxed{{{frac.group(1)}{frac.group(2)}/{frac.group(3)}}}$."))
    if "\\times 10^" in sci:
        forms.append(("cdot_10", f"$\\boxed{{{sci.replace(chr(92) + 'times', chr(92) + 'cdot')}}}$"))
    if multiple:
        parts = _top_level_split(ans)
        if len(parts) > 1 and not re.search(r"(?<![\\A-Za-z])[A-Za-z]{3,}", ans):
            forms.append(("reordered", f"The answers are $\\boxed{{{', '.join(reversed(parts))}}}$."))
    if unit:
        u = re.sub(r"(?<!\\)\$", "", unit).strip()
        forms.append(("unit", f"The answer is $\\boxed{{{ans} \\text{{ {u}}}}}$."))
    if re.fullmatch(r"-?\d+", ans):
        forms.append(("answer_is", f"Adding these up, the answer is {ans}."))
    return forms


def _bump_digit(m: re.Match) -> str:
    s = m.group(0)
    last = s[-1]
    return s[:-1] + str((int(last) + 1) % 10) if last != "9" else s[:-1] + "8"


def perturbations(answer: str) -> list[tuple[str, str]]:
    """(kind, wrong answer) variants of a gold answer; kinds that do not apply are left out."""
    ans = normalize_answer(re.sub(r"(?<!\\)\$", "", answer))
    out: list[tuple[str, str]] = []
    bumped = _FIRST_NUMBER.sub(_bump_digit, ans, count=1)
    if bumped != ans:
        out.append(("off_by_one", bumped))
    is_zero = re.fullmatch(r"-?0*(?:\.0*)?", ans) is not None
    if not is_zero and not re.search(r"[,=<>]|\\in\b|\\cup|\\infty", ans):
        out.append(("sign_flipped", ans[1:] if ans.startswith("-") else f"-({ans})"))
    coef = _COEFFICIENT.search(ans)
    if coef:
        out.append(("coefficient_changed", ans[:coef.start()] + str(int(coef.group(1)) * 2 + 1) + ans[coef.end():]))
    close = re.search(r"(?<!\\infty)(?<=[\w}])\s*([)\]])", ans)
    if "," in ans and close and re.match(r"^\s*[\[(]", ans):
        i = close.start(1)
        out.append(("bracket_flipped", ans[:i] + (")" if ans[i] == "]" else "]") + ans[i + 1:]))
    return out


def _within(a: str, b: str, tol: float) -> bool:
    try:
        return abs(float(a) - float(b)) <= tol
    except ValueError:
        return False


@dataclass
class AuditResult:
    benchmark: str
    rows: int
    accepted: int = 0
    reference_cases: int = 0
    rejected: int = 0
    perturbed_cases: int = 0
    false_rejects: list[dict] = field(default_factory=list)
    false_accepts: list[dict] = field(default_factory=list)

    @property
    def accept_rate(self) -> float:
        return self.accepted / max(1, self.reference_cases)

    @property
    def reject_rate(self) -> float:
        return self.rejected / max(1, self.perturbed_cases)


def audit_rows(name: str, rows: list[BenchmarkRow], timeout_s: Optional[int] = 5,
               progress: Optional[Callable[[int], None]] = None) -> AuditResult:
    res = AuditResult(name, len(rows))
    for i, row in enumerate(rows):
        for kind, text in reference_forms(row.answer, row.unit, row.multiple):
            g = grade_response(text, row.answer, timeout_s, abs_tol=row.abs_tol)
            res.reference_cases += 1
            if g.correct:
                res.accepted += 1
            else:
                res.false_rejects.append({"id": row.id, "gold": row.answer, "form": kind, "response": text,
                                          "extracted": g.extracted, "status": g.status, "error": g.error})
        for kind, wrong in perturbations(row.answer):
            if row.abs_tol > 0 and _within(wrong, row.answer, row.abs_tol):
                continue  # inside the problem's own tolerance: not a wrong answer
            g = grade_response(f"The answer is $\\boxed{{{wrong}}}$.", row.answer, timeout_s, abs_tol=row.abs_tol)
            res.perturbed_cases += 1
            if g.correct:
                res.false_accepts.append({"id": row.id, "gold": row.answer, "perturbation": kind, "wrong": wrong})
            else:
                res.rejected += 1
        if progress is not None:
            progress(i + 1)
    return res


def audit_table(results: list[AuditResult]) -> str:
    lines = ["| benchmark | rows | reference forms | graded correct | perturbed answers | graded wrong |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.benchmark} | {r.rows} | {r.reference_cases} | {100 * r.accept_rate:.2f}% | "
                     f"{r.perturbed_cases} | {100 * r.reject_rate:.2f}% |")
    return "\n".join(lines) + "\n"


class LabelledError(ValueError):
    """A labelled file that cannot be read: names the file, line and field."""


_LABELS = {True: True, False: False, 1: True, 0: False, "correct": True, "incorrect": False, "true": True,
           "false": False, "1": True, "0": False, "yes": True, "no": False}


@dataclass
class LabelledCase:
    line: int
    gold: str
    text: str
    is_response: bool
    label: bool
    category: str
    abs_tol: float = 0.0
    truncated: bool = False


def read_labelled(path: Path) -> list[LabelledCase]:
    """The cases of a labelled JSONL file (see the module docstring); LabelledError names a bad line's field."""
    cases = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise LabelledError(f"{path}: {e.strerror or e}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise LabelledError(f"{path}:{n}: not JSON ({e.msg})") from e
        if not isinstance(row, dict):
            raise LabelledError(f"{path}:{n}: expected an object, got {type(row).__name__}")
        gold = row.get("gold", row.get("answer"))
        if not isinstance(gold, str) or not gold.strip():
            raise LabelledError(f"{path}:{n}: field 'gold' must be a non-empty string")
        if isinstance(row.get("prediction"), str):
            text, is_response = row["prediction"], False
        elif isinstance(row.get("response"), str):
            text, is_response = row["response"], True
        else:
            raise LabelledError(f"{path}:{n}: needs a string field 'prediction' (an answer) or 'response'")
        label = row.get("label")
        if not isinstance(label, (str, int, float, bool)):
            raise LabelledError(f"{path}:{n}: field 'label' must be true/false, \"correct\"/\"incorrect\" or 1/0, "
                                f"got {label!r}")
        key = label.strip().lower() if isinstance(label, str) else label
        if isinstance(key, float) and key in (0.0, 1.0):
            key = int(key)
        if key not in _LABELS:
            raise LabelledError(f"{path}:{n}: field 'label' must be true/false, \"correct\"/\"incorrect\" or 1/0, "
                                f"got {label!r}")
        tol = row.get("abs_tol", 0.0)
        if not isinstance(tol, (int, float)) or tol < 0:
            raise LabelledError(f"{path}:{n}: field 'abs_tol' must be a number >= 0")
        cut = row.get("truncated", False)
        if not isinstance(cut, bool):
            raise LabelledError(f"{path}:{n}: field 'truncated' must be true/false (the response was cut at its budget)")
        cases.append(LabelledCase(n, gold, text, is_response, _LABELS[key], str(row.get("category") or "all"),
                                  float(tol), cut))
    if not cases:
        raise LabelledError(f"{path}: no cases")
    return cases


@dataclass
class LabelledResult:
    category: str
    cases: int = 0
    agree: int = 0
    errors: int = 0
    seconds_max: float = 0.0
    false_accepts: list[dict] = field(default_factory=list)
    false_rejects: list[dict] = field(default_factory=list)

    @property
    def agreement(self) -> float:
        return self.agree / max(1, self.cases)


def audit_labelled(cases: list[LabelledCase], timeout_s: Optional[int] = 5) -> list[LabelledResult]:
    """Grade every case and compare with its label, per category (and "ALL" last). Categories come most false
    accepts first, then by name."""
    by_cat: dict[str, LabelledResult] = {}
    total = LabelledResult("ALL")
    for case in cases:
        t0 = time.perf_counter()
        if case.is_response:
            g = grade_response(case.text, case.gold, timeout_s, abs_tol=case.abs_tol, truncated=case.truncated)
        else:
            g = grade_answer(case.text, case.gold, timeout_s, abs_tol=case.abs_tol)
        seconds = time.perf_counter() - t0
        for res in (by_cat.setdefault(case.category, LabelledResult(case.category)), total):
            res.cases += 1
            res.errors += g.status == "error"
            res.seconds_max = max(res.seconds_max, seconds)
            if g.correct == case.label:
                res.agree += 1
                continue
            item = {"line": case.line, "gold": case.gold, ("response" if case.is_response else "prediction"): case.text,
                    "extracted": g.extracted, "status": g.status}
            (res.false_accepts if g.correct else res.false_rejects).append(item)
    ordered = sorted(by_cat.values(), key=lambda r: (-len(r.false_accepts), r.category))
    return ordered + [total]


def labelled_table(results: list[LabelledResult]) -> str:
    lines = ["| category | cases | false accepts | agreement | false rejects | grader errors | slowest case |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.category} | {r.cases} | {len(r.false_accepts)} | {100 * r.agreement:.2f}% | "
                     f"{len(r.false_rejects)} | {r.errors} | {r.seconds_max:.2f} s |")
    return "\n".join(lines) + "\n"


def labelled_report(results: list[LabelledResult], show: int) -> str:
    """False accepts first, by category (most first), then false rejects; `show` examples per category."""
    out = []
    for title, attr in (("false accepts (graded correct, labelled wrong)", "false_accepts"),
                        ("false rejects (graded wrong, labelled correct)", "false_rejects")):
        out.append(f"{len(getattr(results[-1], attr))} {title}")
        for r in sorted(results[:-1], key=lambda r: (-len(getattr(r, attr)), r.category)):
            items = getattr(r, attr)
            if items:
                out.append(f"  {r.category}: {len(items)}")
                out += [f"    {json.dumps(item, ensure_ascii=False)}" for item in items[:show]]
    return "\n".join(out) + "\n"


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False))


def _main_labelled(args: argparse.Namespace) -> int:
    try:
        cases = read_labelled(Path(args.labelled))
    except LabelledError as e:
        print(f"megatron-opd grade-audit: {e}", file=sys.stderr)
        return 2
    results = audit_labelled(cases)
    print(labelled_report(results, args.show))
    print(labelled_table(results))
    if args.out:
        _write_json(Path(args.out) / "labelled_audit.json", [r.__dict__ | {"agreement": r.agreement} for r in results])
    total = results[-1]
    too_many = args.max_false_accepts is not None and len(total.false_accepts) > args.max_false_accepts
    return 0 if total.agreement >= args.min_agreement and not too_many else 1


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-opd grade-audit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--benchmarks", default=None, help="comma list of NAME[=PATH] (as for `megatron-opd eval`)")
    p.add_argument("--labelled", default=None, help="JSONL of human-labelled (gold, prediction or response, label)")
    p.add_argument("--min-agreement", type=float, default=0.0,
                   help="--labelled: exit 1 below this overall agreement with the labels")
    p.add_argument("--max-false-accepts", type=int, default=None,
                   help="--labelled: exit 1 with more false accepts than this (0: none allowed)")
    p.add_argument("--data-dir", default=None, help="folder holding benchmark files under their default names")
    p.add_argument("--out", default=None, help="write audit.json with every false accept / false reject")
    p.add_argument("--min-accept", type=float, default=0.995, help="exit 1 below this reference accept rate")
    p.add_argument("--min-reject", type=float, default=0.995, help="exit 1 below this perturbation reject rate")
    p.add_argument("--show", type=int, default=5, help="print this many failures per benchmark / category")
    args = p.parse_args(argv)
    if (args.benchmarks is None) == (args.labelled is None):
        p.error("give exactly one of --benchmarks (generated cases) or --labelled FILE (your labels)")
    if args.labelled is not None:
        return _main_labelled(args)
    try:
        benches = resolve_benchmarks(args.benchmarks, args.data_dir)
        loaded = {name: read_benchmark_rows(name, path) for name, path in benches.items()}
    except (KeyError, ValueError, OSError) as e:
        print(f"megatron-opd grade-audit: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    results = []
    for name, (rows, skipped) in loaded.items():
        res = audit_rows(name, rows)
        results.append(res)
        for label, items in (("graded wrong although correct", res.false_rejects),
                             ("graded correct although wrong", res.false_accepts)):
            for item in items[:args.show]:
                print(f"{name}: {label}: {json.dumps(item, ensure_ascii=False)}")
        if skipped:
            print(f"{name}: {len(skipped)} row(s) skipped, first: {skipped[0]}")
    print(audit_table(results))
    if args.out:
        _write_json(Path(args.out) / "audit.json", [r.__dict__ | {"accept_rate": r.accept_rate,
                                                                  "reject_rate": r.reject_rate} for r in results])
    ok = all(r.accept_rate >= args.min_accept and r.reject_rate >= args.min_reject for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
