"""Math benchmarks: registry, metrics, and a runner over any rollout engine.

Expected files (JSONL, one problem per line). Only MATH-500 is available beside the project
(``../shared/data/math500.jsonl``); the others are loaded from a path the user gives. Field names follow
the files commonly distributed with math evaluation suites; the first field present is used:

==============  =========================  ==============================  ==========================================
benchmark       default file               problem field                   answer field
==============  =========================  ==============================  ==========================================
math500         math500.jsonl              problem                         answer
minerva         minerva_math.jsonl         problem                         answer, else last \\boxed{} of solution
olympiadbench   olympiadbench.jsonl        question | problem              final_answer (list, joined) | answer
amc23           amc23.jsonl                question | problem              answer
aime24          aime24.jsonl               problem | question | Problem    answer | Answer
aime25          aime25.jsonl               problem | question | Problem    answer | Answer
arith           arith_eval.jsonl           problem                         answer   (the built-in CPU-demo set)
==============  =========================  ==============================  ==========================================

Metrics per benchmark with k samples per problem (c_i of them correct for problem i):
``avg@k`` = mean_i c_i / k (the unbiased pass@1 estimate from k samples), ``pass@1`` = accuracy of the
first sample of each problem (greedy accuracy when temperature is 0), ``pass@k`` = fraction of problems
with at least one correct sample. Response length and truncation rate are reported too, because
length inflation is the failure mode this project watches.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from megatron_opd.config import DataConfig
from megatron_opd.data.prompts import BadRecord, PromptRecord, PromptSet, load_prompts
from megatron_opd.eval.grading import extract_boxed, grade_response
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


BENCHMARKS: dict[str, BenchmarkSpec] = {s.name: s for s in [
    BenchmarkSpec("math500", "math500.jsonl", ("problem",), ("answer",), True,
                  "MATH-500 (Lightman et al. 2023 subset of the MATH test set)"),
    BenchmarkSpec("minerva", "minerva_math.jsonl", ("problem",), ("answer",), True,
                  "Minerva Math (OCWCourses, 272 problems)"),
    BenchmarkSpec("olympiadbench", "olympiadbench.jsonl", ("question", "problem"), ("final_answer", "answer"), False,
                  "OlympiadBench, English text-only math subset"),
    BenchmarkSpec("amc23", "amc23.jsonl", ("question", "problem"), ("answer",), False, "AMC 2023 (40 problems)"),
    BenchmarkSpec("aime24", "aime24.jsonl", ("problem", "question", "Problem"), ("answer", "Answer"), False,
                  "AIME 2024 (30 problems)"),
    BenchmarkSpec("aime25", "aime25.jsonl", ("problem", "question", "Problem"), ("answer", "Answer"), False,
                  "AIME 2025 (30 problems)"),
    BenchmarkSpec("arith", "arith_eval.jsonl", ("problem",), ("answer",), True,
                  "built-in arithmetic word problems (megatron_opd.data.builtin)"),
]}


def get_spec(name: str) -> BenchmarkSpec:
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r} (known: {', '.join(BENCHMARKS)})")
    return BENCHMARKS[name]


def _normaliser(spec: BenchmarkSpec):
    """Row transform to the canonical fields problem / answer / solution used by load_prompts."""

    def transform(row: dict) -> dict:
        out = dict(row)
        pk = next((k for k in spec.prompt_keys if isinstance(row.get(k), str)), None)
        if pk is None:
            raise BadRecord(f"missing field: none of {list(spec.prompt_keys)} ({spec.name})")
        out["problem"] = row[pk]
        ak = next((k for k in spec.answer_keys if row.get(k) not in (None, "", [])), None)
        if ak is not None:
            out["answer"] = row[ak]
        elif spec.answer_from_solution and isinstance(row.get("solution"), str) and extract_boxed(row["solution"]):
            out["answer"] = extract_boxed(row["solution"])
        else:
            tried = list(spec.answer_keys) + (["solution (\\boxed{})"] if spec.answer_from_solution else [])
            raise BadRecord(f"missing field: none of {tried} ({spec.name})")
        return out

    return transform


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

    def row(self) -> dict[str, Any]:
        return {"benchmark": self.name, "k": self.k, **self.metrics}


def _generate(engine: RolloutEngine, prompts: list[PromptRecord], sampling: SamplingParams,
              batch_size: int) -> list[list[Any]]:
    out: list[list[Any]] = []
    k = sampling.n
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        samples = engine.generate([r.prompt_ids for r in chunk], sampling)
        if len(samples) != len(chunk) * k:
            raise RuntimeError(f"engine returned {len(samples)} samples for {len(chunk)} prompts x n={k}; "
                               "the rollout contract is len(prompts) * n, grouped by prompt")
        out.extend(samples[i * k:(i + 1) * k] for i in range(len(chunk)))
    return out


def run_benchmark(engine: RolloutEngine, tokenizer: Any, name: str, prompts: PromptSet, sampling: SamplingParams,
                  batch_size: int = 32, grade_timeout_s: Optional[int] = 5) -> BenchmarkResult:
    """Generate `sampling.n` responses per prompt, grade each against the reference answer, summarise."""
    k = sampling.n
    records = list(prompts)
    grouped = _generate(engine, records, sampling, batch_size)
    correct: list[list[bool]] = []
    rows: list[dict] = []
    statuses = {"correct": 0, "incorrect": 0, "no_answer": 0, "error": 0}
    lengths, truncated = [], 0
    for rec, samples in zip(records, grouped):
        flags = []
        for j, s in enumerate(samples):
            text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
            g = grade_response(text, rec.answer or "", grade_timeout_s)
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
    })
    return BenchmarkResult(name, k, metrics, rows)


def results_markdown(results: Sequence[BenchmarkResult]) -> str:
    """One row per benchmark: the accuracy metrics, then length / truncation / grader health."""
    if not results:
        return "(no benchmarks)\n"
    keys = [key for key in results[0].metrics if key != "num_problems"]
    head = ["benchmark", "problems", "k", *keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        vals = []
        for key in keys:
            v = r.metrics.get(key, float("nan"))
            vals.append(f"{100 * v:.1f}" if key.startswith(("avg@", "pass@")) or key.endswith("_rate") else
                        (f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"))
        lines.append("| " + " | ".join([r.name, f"{int(r.metrics['num_problems'])}", str(r.k), *vals]) + " |")
    return "\n".join(lines) + "\n\n(avg@k, pass@1, pass@k and rates in %)\n"


def write_results(results: Sequence[BenchmarkResult], out_dir: Union[str, Path],
                  extra: Optional[dict[str, Any]] = None) -> dict[str, Path]:
    """results.json (metrics + run settings), results.md (table), samples_<name>.jsonl (every response)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    payload = {"results": {r.name: {"k": r.k, **r.metrics} for r in results}, **(extra or {})}
    paths["json"].write_text(json.dumps(payload, indent=2))
    paths["markdown"].write_text(results_markdown(results))
    for r in results:
        p = out / f"samples_{r.name}.jsonl"
        with p.open("w", encoding="utf-8") as f:
            for row in r.samples:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        paths[f"samples_{r.name}"] = p
    return paths


def evaluate(engine: RolloutEngine, tokenizer: Any, benchmarks: Mapping[str, Union[str, Path, PromptSet]],
             k: int = 1, sampling: Optional[SamplingParams] = None, out_dir: Union[str, Path, None] = None,
             data_cfg: Optional[DataConfig] = None, limit: Optional[int] = None, batch_size: int = 32,
             grade_timeout_s: Optional[int] = 5) -> list[BenchmarkResult]:
    """Evaluate on each benchmark (name -> path, or name -> an already loaded PromptSet) with k samples per
    problem; `sampling.n` is set to k. Writes results.{json,md} and per-sample JSONL when `out_dir` is given."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    sp = copy.deepcopy(sampling) if sampling is not None else SamplingParams()
    sp.n = k
    results = []
    for name, src in benchmarks.items():
        prompts = src if isinstance(src, PromptSet) else load_benchmark(name, src, tokenizer, data_cfg, limit)
        logger.info("eval %s: %d problems x %d samples", name, len(prompts), k)
        results.append(run_benchmark(engine, tokenizer, name, prompts, sp, batch_size, grade_timeout_s))
    if out_dir is not None:
        write_results(results, out_dir, {"k": k, "sampling": asdict(sp)})
    return results


__all__ = ["BENCHMARKS", "BenchmarkResult", "BenchmarkSpec", "evaluate", "get_spec", "load_benchmark", "pass_at_k",
           "results_markdown", "run_benchmark", "summarize", "write_results"]
