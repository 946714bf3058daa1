"""Math benchmarks: registry, public-format loaders, metrics, and a runner over any rollout engine.

Files are JSONL (one problem per line), a ``.json`` array, Parquet or a saved HF dataset, in the formats
the public evaluation suites distribute (Qwen2.5-Math's ``evaluation/data/<name>/test.jsonl``, the
original OlympiadBench JSON, the HF copies). Only MATH-500 is available beside the project
(``../shared/data/math500.jsonl``); the others come from a path the user gives. The first field present
is used:

==============  =========================  ===================  ===============================================
benchmark       aliases                    problem field        answer field
==============  =========================  ===================  ===============================================
math500         math_500, math-500         problem              answer, else last \\boxed{} of solution
minerva         minerva_math, ocw          problem              answer, else last \\boxed{} of solution
olympiadbench   olympiad_bench, olympiad   [context +] question final_answer (list, parts joined) | answer
amc23           amc2023, amc               question | problem   answer (27.0 -> 27)
aime24          aime2024                   problem | question   answer | Answer
aime25          aime2025                   problem | question   answer | Answer
gsm8k           gsm8k_test                 question | problem   answer (after ``####`` when it is a rationale)
arith           arith_eval                 problem              answer   (the built-in CPU-demo set)
==============  =========================  ===================  ===============================================

OlympiadBench's ``unit`` and ``error`` (a per-problem absolute tolerance) are kept; a list ``solution``
is joined. A row without a usable problem or answer is skipped and recorded (``<file>:<line>: reason``)
in results.json, or is an error with ``on_bad_record=error``.

Metrics per benchmark with k samples per problem (c_i of them correct for problem i):
``avg@k`` = mean_i c_i / k (the unbiased pass@1 estimate from k samples), ``pass@1`` = accuracy of the
first sample of each problem (greedy accuracy when temperature is 0), ``pass@k`` = fraction of problems
with at least one correct sample. Response length and truncation rate are reported too, because
length inflation is the failure mode this project watches.
"""


from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from tqdm import tqdm

from megatron_opd.config import DataConfig
from megatron_opd.data.prompts import BadRecord, DataError, PromptRecord, PromptSet, iter_rows, load_prompts
from megatron_opd.eval.grading import REL_TOL, extract_boxed, grade_response
from megatron_opd.rollout.base import RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    filename: str
    prompt_keys: tuple[str, ...]
    answer_keys: tuple[str, ...]
    answer_from_solution: bool = False  # fall back to the last \boxed{} of `solution`
    description: str = ""
    aliases: tuple[str, ...] = ()
    column: str = ""  # the name in the paper's tables


BENCHMARKS: dict[str, BenchmarkSpec] = {s.name: s for s in [
    BenchmarkSpec("math500", "math500.jsonl", ("problem",), ("answer",), True,
                  "MATH-500 (Lightman et al. 2023 subset of the MATH test set)", ("math_500", "math-500"), "MATH-500"),
    BenchmarkSpec("minerva", "minerva_math.jsonl", ("problem",), ("answer",), True,
                  "Minerva Math (OCWCourses, 272 problems)", ("minerva_math", "minervamath", "ocw"), "Minerva"),
    BenchmarkSpec("olympiadbench", "olympiadbench.jsonl", ("question", "problem"), ("final_answer", "answer"), False,
                  "OlympiadBench, English text-only math subset", ("olympiad_bench", "olympiad"), "OlympiadBench"),
    BenchmarkSpec("amc23", "amc23.jsonl", ("question", "problem"), ("answer",), False, "AMC 2023 (40 problems)",
                  ("amc2023", "amc_23", "amc"), "AMC23"),
    BenchmarkSpec("aime24", "aime24.jsonl", ("problem", "question", "Problem"), ("answer", "Answer"), False,
                  "AIME 2024 (30 problems)", ("aime2024", "aime_2024"), "AIME24"),
    BenchmarkSpec("aime25", "aime25.jsonl", ("problem", "question", "Problem"), ("answer", "Answer"), False,
                  "AIME 2025 (30 problems)", ("aime2025", "aime_2025"), "AIME25"),
    BenchmarkSpec("gsm8k", "gsm8k.jsonl", ("question", "problem"), ("answer",), False,
                  "GSM8K test (answer after '####' when the field holds the rationale)", ("gsm8k_test",), "GSM8K"),
    BenchmarkSpec("arith", "arith_eval.jsonl", ("problem",), ("answer",), True,
                  "built-in arithmetic word problems (megatron_opd.data.builtin)", ("arith_eval",), "Arith"),
]}

# The paper's six benchmarks in the column order of its tables.
PAPER_BENCHMARKS = ("math500", "minerva", "olympiadbench", "amc23", "aime24", "aime25")


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


_ALIASES = {_key(a): s.name for s in BENCHMARKS.values() for a in (s.name, *s.aliases)}


def canonical_name(name: str) -> str:
    """The registry name of a benchmark given by name or alias (``minerva_math`` -> ``minerva``)."""
    key = _key(name)
    if key not in _ALIASES:
        raise KeyError(f"unknown benchmark {name!r} (known: {', '.join(BENCHMARKS)}; aliases: "
                       f"{', '.join(a for s in BENCHMARKS.values() for a in s.aliases)})")
    return _ALIASES[key]


def get_spec(name: str) -> BenchmarkSpec:
    return BENCHMARKS[canonical_name(name)]


def candidate_files(name: str, data_dir: Union[str, Path]) -> list[Path]:
    """Where ``--data-dir`` may hold a benchmark: the default file name, ``<alias>.jsonl``, or the
    ``<name>/test.jsonl`` layout of the public evaluation suites (e.g. Qwen2.5-Math's evaluation/data)."""
    spec, d = get_spec(name), Path(data_dir)
    names = [name.strip(), spec.name, *spec.aliases]
    out = [d / spec.filename]
    for n in dict.fromkeys(names):
        out += [d / f"{n}.jsonl", d / n / "test.jsonl", d / n / "test.json"]
    return list(dict.fromkeys(out))


def resolve_benchmarks(spec: str, data_dir: Optional[str]) -> dict[str, Path]:
    """``"math500=PATH,aime24"`` -> {canonical name: path}; names must be registered, paths must exist."""
    out: dict[str, Path] = {}
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        given, _, path = item.partition("=")
        name = canonical_name(given)
        if path:
            p = Path(path.strip())
            if not p.exists():
                raise FileNotFoundError(f"--benchmarks {given}: {p} not found")
        elif data_dir:
            candidates = candidate_files(given, data_dir)
            found = [c for c in candidates if c.is_file()]
            if not found:
                shown = ", ".join(str(c.relative_to(data_dir)) for c in candidates[:4])
                raise FileNotFoundError(f"--benchmarks {given}: no file for it in {data_dir} (looked for {shown}, "
                                        f"... {len(candidates)} names)")
            p = found[0]
        else:
            raise ValueError(f"--benchmarks {given}: no path; give {given}=PATH or --data-dir DIR holding "
                             f"{get_spec(name).filename}")
        if name in out:
            raise ValueError(f"--benchmarks: {name} given twice")
        out[name] = p
    if not out:
        raise ValueError("--benchmarks: empty")
    return out


def _strip_dollars(text: str) -> str:
    return re.sub(r"(?<!\\)\$", "", text).strip()


def _answer_text(value: Any, key: str) -> str:
    """A gold answer from a string, a number, or a list of parts (OlympiadBench's ``["$69$,$84$"]``)."""
    if isinstance(value, bool) or value is None:
        raise BadRecord(f"field {key!r} must be a string, number or list, got {type(value).__name__}")
    if isinstance(value, (list, tuple)):
        parts = [_answer_text(v, key) for v in value]
        return ", ".join(p for p in parts if p)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadRecord(f"field {key!r} is not finite ({value})")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    if not isinstance(value, str):
        raise BadRecord(f"field {key!r} must be a string, number or list, got {type(value).__name__}")
    if "####" in value:  # GSM8K: the rationale, then "#### 1,234"
        value = value.rsplit("####", 1)[1].replace(",", "")
    parts = [_strip_dollars(p) for p in re.split(r"(?<=\$)\s*,\s*(?=\$)", value.strip())]
    return ", ".join(p for p in parts if p)


def _tolerance(value: Any) -> float:
    """OlympiadBench's per-problem ``error`` field: an absolute tolerance for numeric answers."""
    if value in (None, "", []):
        return 0.0
    try:
        tol = float(str(value).split(",")[0])
    except ValueError:
        raise BadRecord(f"field 'error' must be a number, got {value!r}") from None
    if not math.isfinite(tol) or tol < 0:
        raise BadRecord(f"field 'error' must be a finite number >= 0, got {value!r}")
    return tol


def _normaliser(spec: BenchmarkSpec):
    """Row transform from a benchmark's public format to the canonical fields problem / answer / solution
    (plus ``unit`` and ``abs_tol`` when the format has them) used by load_prompts."""

    def transform(row: dict) -> dict:
        out = dict(row)
        pk = next((k for k in spec.prompt_keys if isinstance(row.get(k), str) and row[k].strip()), None)
        if pk is None:
            raise BadRecord(f"missing field: none of {list(spec.prompt_keys)} ({spec.name})")
        context = row.get("context")
        out["problem"] = (context.strip() + "\n\n" if isinstance(context, str) and context.strip() else "") + row[pk]
        solution = row.get("solution")
        if isinstance(solution, (list, tuple)):
            solution = "\n\n".join(s for s in solution if isinstance(s, str))
        out["solution"] = solution if isinstance(solution, str) and solution.strip() else None
        ak = next((k for k in spec.answer_keys if row.get(k) not in (None, "", [])), None)
        if ak is not None:
            out["answer"] = _answer_text(row[ak], ak)
        elif spec.answer_from_solution and out["solution"] and extract_boxed(out["solution"]):
            out["answer"] = extract_boxed(out["solution"])
        else:
            tried = list(spec.answer_keys) + (["solution (\\boxed{})"] if spec.answer_from_solution else [])
            raise BadRecord(f"missing field: none of {tried} ({spec.name})")
        if not out["answer"]:
            raise BadRecord(f"field {ak!r} is empty ({spec.name})")
        unit = row.get("unit")
        out["unit"] = _strip_dollars(unit) if isinstance(unit, str) and _strip_dollars(unit) else None
        out["abs_tol"] = _tolerance(row.get("error"))
        return out

    return transform


@dataclass(frozen=True)
class BenchmarkRow:
    """One problem of a benchmark file, read without a tokenizer (validation, grader audits)."""

    id: str
    problem: str
    answer: str
    unit: Optional[str] = None
    abs_tol: float = 0.0
    source: str = ""
    multiple: bool = False  # several answers, any order (OlympiadBench's is_multiple_answer)


def read_benchmark_rows(name: str, path: Union[str, Path]) -> tuple[list[BenchmarkRow], list[str]]:
    """(usable rows, ``"<file>:<line>: reason"`` per skipped row). Raises DataError when nothing is usable,
    so a wrong file fails before any model is loaded."""
    spec = get_spec(name)
    transform = _normaliser(spec)
    rows: list[BenchmarkRow] = []
    bad: list[str] = []
    for loc, row in iter_rows(path):
        try:
            if isinstance(row, BadRecord):
                raise row
            r = transform(row)
            rid = row.get("id", row.get("idx", row.get("unique_id")))
            rows.append(BenchmarkRow(str(rid) if rid is not None else loc, r["problem"], r["answer"], r["unit"],
                                     r["abs_tol"], loc, bool(row.get("is_multiple_answer"))))
        except BadRecord as e:
            bad.append(f"{loc}: {e}")
    if not rows:
        raise DataError(f"{path}: no usable {spec.name} rows" + (f" (first problem: {bad[0]})" if bad else ""))
    return rows, bad


def load_benchmark(name: str, path: Union[str, Path], tokenizer: Any, data_cfg: Optional[DataConfig] = None,
                   limit: Optional[int] = None) -> PromptSet:
    """Load a registered benchmark from `path` with the prompt/chat template of `data_cfg`."""
    spec = get_spec(name)
    cfg = copy.deepcopy(data_cfg) if data_cfg is not None else DataConfig()
    cfg.prompt_key, cfg.answer_key, cfg.solution_key = "problem", "answer", "solution"
    return load_prompts(path, cfg, tokenizer, require_answer=True, require_solution=False, limit=limit,
                        transform=_normaliser(spec))


# ---------------------------------------------------------------------------------------------
# metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(correct: Sequence[Sequence[bool]]) -> dict[str, float]:
    """avg@k, pass@1 (first sample) and pass@k over problems; `correct[i][j]` = sample j of problem i."""
    if not correct:
        raise ValueError("summarize: no problems")
    k = len(correct[0])
    if k == 0 or any(len(row) != k for row in correct):
        raise ValueError("summarize: every problem needs the same number (>= 1) of samples")
    n = len(correct)
    return {
        f"avg@{k}": sum(sum(row) / k for row in correct) / n,
        "pass@1": sum(bool(row[0]) for row in correct) / n,
        f"pass@{k}": sum(pass_at_k(k, sum(row), k) for row in correct) / n,
    }


# ---------------------------------------------------------------------------------------------
# runner


@dataclass
class BenchmarkResult:
    name: str
    k: int
    metrics: dict[str, float]
    samples: list[dict] = field(default_factory=list)  # one row per generated response
    source: dict[str, Any] = field(default_factory=dict)  # file, sha256, rows used / skipped
    error: Optional[str] = None  # set when the benchmark failed; metrics are then empty

    def row(self) -> dict[str, Any]:
        return {"benchmark": self.name, "k": self.k, **self.metrics}


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """tqdm on stderr with rate and ETA; sparse updates when stderr is not a terminal (logs, Slurm)."""
    tty = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, disable=not enabled,
                mininterval=0.5 if tty else 30.0, dynamic_ncols=tty, ascii=not tty)


def _generate(engine: RolloutEngine, prompts: list[PromptRecord], sampling: SamplingParams,
              batch_size: int, bar: Any = None) -> list[list[Any]]:
    out: list[list[Any]] = []
    k = sampling.n
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        samples = engine.generate([r.prompt_ids for r in chunk], sampling)
        if len(samples) != len(chunk) * k:
            raise RuntimeError(f"engine returned {len(samples)} samples for {len(chunk)} prompts x n={k}; "
                               "the rollout contract is len(prompts) * n, grouped by prompt")
        out.extend(samples[i * k:(i + 1) * k] for i in range(len(chunk)))
        if bar is not None:
            bar.update(len(samples))
    return out


def file_source(prompts: PromptSet) -> dict[str, Any]:
    """Provenance of a benchmark for results.json: the file, its sha256, rows used and skipped (with why)."""
    src: dict[str, Any] = {"path": prompts.path, "rows_used": len(prompts), "rows_skipped": len(prompts.bad),
                           "skipped": list(prompts.bad[:100])}
    p = Path(prompts.path) if prompts.path else None
    if p is not None and p.is_file():
        src["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
    return src


def run_benchmark(engine: RolloutEngine, tokenizer: Any, name: str, prompts: PromptSet, sampling: SamplingParams,
                  batch_size: int = 32, grade_timeout_s: Optional[int] = 5, progress: bool = False) -> BenchmarkResult:
    """Generate `sampling.n` responses per prompt, grade each against the reference answer, summarise."""
    k = sampling.n
    records = list(prompts)
    t0 = time.perf_counter()
    with _progress_bar(len(records) * k, f"eval {name}", progress) as bar:
        grouped = _generate(engine, records, sampling, batch_size, bar)
    t_gen = time.perf_counter() - t0
    correct: list[list[bool]] = []
    rows: list[dict] = []
    statuses = {"correct": 0, "incorrect": 0, "no_answer": 0, "error": 0}
    lengths, truncated = [], 0
    for rec, samples in zip(records, grouped):
        flags = []
        abs_tol = float(rec.meta.get("abs_tol", 0.0) or 0.0)
        for j, s in enumerate(samples):
            text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
            g = grade_response(text, rec.answer or "", grade_timeout_s, abs_tol=abs_tol, truncated=s.truncated)
            flags.append(g.correct)
            statuses[g.status] += 1
            lengths.append(len(s.response_ids))
            truncated += int(s.truncated)
            rows.append({"id": rec.id, "sample": j, "answer": rec.answer, "extracted": g.extracted,
                         "method": g.method, "status": g.status, "error": g.error, "tokens": len(s.response_ids),
                         "finish_reason": s.finish_reason, "response": text})
        correct.append(flags)
    total = len(rows)
    metrics = summarize(correct)
    metrics.update({
        "num_problems": float(len(records)),
        "mean_response_tokens": sum(lengths) / total,
        "max_response_tokens": float(max(lengths)),
        "truncation_rate": truncated / total,
        "no_answer_rate": statuses["no_answer"] / total,
        "grader_errors": float(statuses["error"]),
        "generate_s": t_gen,
        "grade_s": time.perf_counter() - t0 - t_gen,
    })
    return BenchmarkResult(name, k, metrics, rows)


_PERCENT_KEYS = ("avg@", "pass@")
_TABLE_SKIP = ("num_problems", "generate_s", "grade_s")


def results_markdown(results: Sequence[BenchmarkResult]) -> str:
    """One row per benchmark: the accuracy metrics, then length / truncation / grader health."""
    done = [r for r in results if r.error is None]
    lines = []
    if done:
        keys = [key for key in done[0].metrics if key not in _TABLE_SKIP]
        head = ["benchmark", "problems", "k", *keys]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in done:
            vals = []
            for key in keys:
                v = r.metrics.get(key, float("nan"))
                vals.append(f"{100 * v:.1f}" if key.startswith(_PERCENT_KEYS) or key.endswith("_rate") else
                            (f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"))
            lines.append("| " + " | ".join([r.name, f"{int(r.metrics['num_problems'])}", str(r.k), *vals]) + " |")
        lines.append("\n(avg@k, pass@1, pass@k and rates in %)")
    for r in results:
        if r.error is not None:
            lines.append(f"\n{r.name}: FAILED: {r.error}")
    return ("\n".join(lines) if lines else "(no benchmarks)") + "\n"


def paper_table(results: Sequence[BenchmarkResult], label: str = "model") -> str:
    """The paper's layout: one row, avg@k per benchmark in its column order, then the average over them."""
    by_name = {r.name: r for r in results if r.error is None}
    names = [n for n in PAPER_BENCHMARKS if n in by_name] + [n for n in by_name if n not in PAPER_BENCHMARKS]
    if not names:
        return "(no finished benchmarks)\n"
    accs = [by_name[n].metrics[f"avg@{by_name[n].k}"] for n in names]
    cols = [f"{BENCHMARKS[n].column or n} (avg@{by_name[n].k})" for n in names]
    lines = ["| " + " | ".join([label, *cols, "Avg"]) + " |", "|" + "---|" * (len(cols) + 2),
             "| " + " | ".join([label, *(f"{100 * a:.1f}" for a in accs), f"{100 * sum(accs) / len(accs):.1f}"]) + " |"]
    return "\n".join(lines) + "\n"


def write_results(results: Sequence[BenchmarkResult], out_dir: Union[str, Path],
                  extra: Optional[dict[str, Any]] = None) -> dict[str, Path]:
    """results.json (metrics, sources, failures, run settings), results.md (tables), samples_<name>.jsonl
    (every response). Rewritten after each benchmark, atomically, so a later failure loses nothing."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    payload = {
        "results": {r.name: {"k": r.k, **r.metrics} for r in results if r.error is None},
        "sources": {r.name: r.source for r in results if r.source},
        "failed": {r.name: r.error for r in results if r.error is not None},
        "grader": grader_info(),
        **(extra or {}),
    }
    _atomic_write(paths["json"], json.dumps(payload, indent=2, ensure_ascii=False))
    _atomic_write(paths["markdown"], results_markdown(results) + "\n" + paper_table(results))
    for r in results:
        if r.error is not None:
            continue
        p = out / f"samples_{r.name}.jsonl"
        _atomic_write(p, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in r.samples))
        paths[f"samples_{r.name}"] = p
    return paths


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def grader_info() -> dict[str, Any]:
    try:
        mv = version("math-verify")
    except PackageNotFoundError:
        mv = None
    return {"math_verify": mv, "rel_tol": REL_TOL, "rules": "megatron_opd.eval.grading (e-notation, free-symbol "
            "guard, relative numeric tolerance, unit/format normalisation)"}


def evaluate(engine: RolloutEngine, tokenizer: Any, benchmarks: Mapping[str, Union[str, Path, PromptSet]],
             k: Union[int, Mapping[str, int]] = 1, sampling: Optional[SamplingParams] = None,
             out_dir: Union[str, Path, None] = None, data_cfg: Optional[DataConfig] = None,
             limit: Optional[int] = None, batch_size: int = 32, grade_timeout_s: Optional[int] = 5,
             progress: bool = False, on_error: str = "raise") -> list[BenchmarkResult]:
    """Evaluate on each benchmark (name -> path, or name -> an already loaded PromptSet) with k samples per
    problem (one k, or one per benchmark name); `sampling.n` is set to k. With `out_dir`, results.{json,md}
    and per-sample JSONL are rewritten after every benchmark. ``on_error="continue"`` records a failed
    benchmark in the results and goes on with the next; ``"raise"`` re-raises after writing."""
    if on_error not in ("raise", "continue"):
        raise ValueError(f"on_error must be 'raise' or 'continue', got {on_error!r}")
    ks = {name: (k[name] if isinstance(k, Mapping) else k) for name in benchmarks}
    for name, kk in ks.items():
        if kk < 1:
            raise ValueError(f"k must be >= 1, got {kk} for {name}")
    base = copy.deepcopy(sampling) if sampling is not None else SamplingParams()
    settings = {"k": ks, "sampling": {key: v for key, v in asdict(base).items() if key != "n"}}
    results: list[BenchmarkResult] = []
    for name, src in benchmarks.items():
        sp = copy.deepcopy(base)
        sp.n = ks[name]
        try:
            prompts = src if isinstance(src, PromptSet) else load_benchmark(name, src, tokenizer, data_cfg, limit)
            logger.info("eval %s: %d problems x %d samples", name, len(prompts), sp.n)
            res = run_benchmark(engine, tokenizer, name, prompts, sp, batch_size, grade_timeout_s, progress)
            res.source = file_source(prompts)
        except Exception as e:  # noqa: BLE001 - recorded with the benchmark, then raised or skipped
            res = BenchmarkResult(name, sp.n, {}, error=f"{type(e).__name__}: {e}")
            results.append(res)
            if out_dir is not None:
                write_results(results, out_dir, settings)
            if on_error == "raise":
                raise
            logger.error("eval %s failed: %s", name, res.error)
            continue
        results.append(res)
        if out_dir is not None:
            write_results(results, out_dir, settings)
    return results


__all__ = ["BENCHMARKS", "PAPER_BENCHMARKS", "BenchmarkResult", "BenchmarkRow", "BenchmarkSpec", "candidate_files",
           "canonical_name", "evaluate", "file_source", "get_spec", "load_benchmark", "paper_table", "pass_at_k",
           "read_benchmark_rows", "resolve_benchmarks", "results_markdown", "run_benchmark", "summarize",
           "write_results"]
