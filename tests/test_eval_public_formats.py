"""The six benchmarks in their public formats, up-front validation, progress, partial results, the paper
preset and the grader audit.

Fixture rows are written here in the field layout of the public files (Qwen2.5-Math's evaluation/data and
OlympiadBench's own JSON array); the problems are short stand-ins. The engine is a stand-in for
generation only (it answers with scripted texts through the rollout contract); tokenizer, loaders,
grading, metrics and files are real.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from megatron_opd.data.prompts import DataError
from megatron_opd.data.toy_tokenizer import byte_tokenizer
from megatron_opd.eval import audit
from megatron_opd.eval.benchmarks import (PAPER_BENCHMARKS, canonical_name, evaluate, load_benchmark,
                                          read_benchmark_rows, resolve_benchmarks)
from megatron_opd.eval.cli import PAPER_PRESET, main
from megatron_opd.rollout.base import Sample

MINERVA = [{"problem": "Compute the luminosity of the white dwarf in ergs per second.",
            "solution": "$L \\simeq \\boxed{4.5e33} \\mathrm{ergs} \\mathrm{s}^{-1}$", "type": "Astronomy", "idx": 1},
           {"problem": "Give the wavelength in meters.", "solution": "so $\\lambda=\\boxed{5e-7}$ m.", "type": "Physics",
            "idx": 2}]
OLYMPIAD = [
    {"id": 1606, "subfield": "Combinatorics", "context": None, "question": "How many moves does Sergey need?",
     "solution": ["Sergey needs 2 moves.", "A second argument."], "final_answer": ["2"], "is_multiple_answer": False,
     "unit": None, "answer_type": "Numerical", "error": None},
    {"id": 2500, "subfield": "Algebra", "context": None, "question": "Find all primes p with p+1 square.",
     "solution": ["..."], "final_answer": ["$69$,$84$"], "is_multiple_answer": True, "unit": None,
     "answer_type": "Numerical", "error": None},
    {"id": 2592, "subfield": "Geometry", "context": None, "question": "Estimate the distance in km.",
     "solution": ["..."], "final_answer": ["4.2"], "is_multiple_answer": False, "unit": "km",
     "answer_type": "Numerical", "error": "1e-1"},
    {"id": 2600, "subfield": "Algebra", "context": None, "question": "Find the interval.",
     "solution": ["..."], "final_answer": ["$(-\\infty, 2) \\cup (3, \\infty)$"], "is_multiple_answer": False,
     "unit": None, "answer_type": "Interval", "error": None},
]
AMC = [{"id": 0, "problem": "How many miles from City A will they meet?", "answer": 27.0, "url": "u",
        "question": "How many miles from City A will they meet?"}]
AIME24 = [{"id": 60, "problem": "Find the number of minutes the walk takes.", "solution": "... $\\framebox{204}$",
           "answer": "204", "url": "u"}]
AIME25 = [{"problem": "Find the sum of all integer bases b>9.", "answer": 70, "id": "0"}]
MATH500 = [{"problem": "What is half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "answer": "\\frac{1}{2}",
            "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}]
GSM8K = [{"question": "Janet sells eggs. How much does she make?",
          "answer": "She makes 9 * 2 = $<<9*2=18>>18.\n#### 1,018", "idx": 0}]


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture
def qwen_layout(tmp_path):
    """The NAME/test.jsonl layout of Qwen2.5-Math's evaluation/data (aime25 from a later suite)."""
    d = tmp_path / "evaluation" / "data"
    for name, rows in (("math500", MATH500), ("minerva_math", MINERVA), ("olympiadbench", OLYMPIAD),
                       ("amc23", AMC), ("aime24", AIME24), ("aime25", AIME25), ("gsm8k", GSM8K)):
        write(d / name / "test.jsonl", rows)
    return d


def test_public_formats_load_with_their_answers(qwen_layout, tok):
    d = qwen_layout
    mi = load_benchmark("minerva_math", d / "minerva_math" / "test.jsonl", tok)
    assert [r.answer for r in mi] == ["4.5e33", "5e-7"] and not mi.bad
    ob = load_benchmark("olympiadbench", d / "olympiadbench" / "test.jsonl", tok)
    assert [r.answer for r in ob] == ["2", "69, 84", "4.2", "(-\\infty, 2) \\cup (3, \\infty)"] and not ob.bad
    assert ob[2].meta["abs_tol"] == pytest.approx(0.1) and ob[1].meta["is_multiple_answer"] is True
    assert load_benchmark("amc23", d / "amc23" / "test.jsonl", tok)[0].answer == "27"
    assert load_benchmark("aime25", d / "aime25" / "test.jsonl", tok)[0].answer == "70"
    assert load_benchmark("gsm8k", d / "gsm8k" / "test.jsonl", tok)[0].answer == "1018"
    rows, skipped = read_benchmark_rows("olympiadbench", d / "olympiadbench" / "test.jsonl")
    assert [r.unit for r in rows] == [None, None, "km", None] and [r.multiple for r in rows][:2] == [False, True]
    assert not skipped


def test_olympiadbench_json_array_release(tmp_path, tok):
    p = tmp_path / "OE_TO_maths_en_COMP.json"
    p.write_text(json.dumps(OLYMPIAD[:2] + [{"id": 9, "question": "No answer here."}], indent=2))
    ps = load_benchmark("olympiadbench", p, tok)
    assert [r.answer for r in ps] == ["2", "69, 84"]
    assert ps.bad == [f"{p}:row 3: missing field: none of ['final_answer', 'answer'] (olympiadbench)"]


@pytest.mark.parametrize("alias, name", [("minerva_math", "minerva"), ("Minerva-Math", "minerva"),
                                         ("olympiad_bench", "olympiadbench"), ("gsm8k", "gsm8k"),
                                         ("aime2024", "aime24"), ("MATH-500", "math500"), ("amc", "amc23")])
def test_aliases(alias, name):
    assert canonical_name(alias) == name


def test_data_dir_layouts_resolve(qwen_layout, tmp_path):
    got = resolve_benchmarks("math500,minerva_math,olympiadbench,amc23,aime24,aime25,gsm8k", str(qwen_layout))
    assert got["minerva"] == qwen_layout / "minerva_math" / "test.jsonl" and len(got) == 7
    flat = tmp_path / "flat"
    write(flat / "minerva_math.jsonl", MINERVA)
    assert resolve_benchmarks("minerva", str(flat)) == {"minerva": flat / "minerva_math.jsonl"}
    with pytest.raises(FileNotFoundError, match="no file for it"):
        resolve_benchmarks("aime24", str(flat))
    with pytest.raises(ValueError, match="given twice"):
        resolve_benchmarks("minerva,minerva_math", str(flat))


class ScriptedEngine:
    """Answers each prompt with responses[first matching key]; records the sampling of every call."""

    def __init__(self, tok, responses, fail_on=None):
        self.tok, self.responses, self.fail_on = tok, responses, fail_on
        self.eos_token_ids = [tok.eos_token_id]
        self.weight_version = 0
        self.calls = []
        self.shut = False

    def generate(self, prompts, sampling):
        self.calls.append(sampling)
        out = []
        for i, ids in enumerate(prompts):
            text = self.tok.decode(ids)
            if self.fail_on and self.fail_on in text:
                raise RuntimeError("engine died")
            resp = next((r for key, r in self.responses.items() if key in text), "I do not know.")
            rid = self.tok(resp, add_special_tokens=False)["input_ids"] + self.eos_token_ids
            out.extend(Sample(i, list(ids), rid, [0.0] * len(rid), "stop") for _ in range(sampling.n))
        return out

    def shutdown(self):
        self.shut = True


RIGHT = {"luminosity": "So $L \\approx \\boxed{4.5 \\times 10^{33}}$ erg/s.",
         "wavelength": "$\\boxed{5 \\times 10^{-7}}$",
         "Sergey": "He needs \\boxed{2} moves.",
         "primes": "The answers are $\\boxed{84, 69}$.",
         "distance": "About $\\boxed{4.25 \\text{ km}}$.",
         "interval": "$\\boxed{(-\\infty,2)\\cup(3,\\infty)}$",
         "miles": "They meet 27 miles from A, so the answer is 27.",
         "minutes": "\\boxed{204}", "bases": "\\boxed{70}", "half of one": "\\boxed{0.5}",
         "Janet": "She makes $1,018.\n#### 1018"}


def test_model_style_answers_grade_correct_on_every_public_format(qwen_layout, tok, tmp_path):
    benches = resolve_benchmarks(",".join(PAPER_BENCHMARKS) + ",gsm8k", str(qwen_layout))
    res = evaluate(ScriptedEngine(tok, RIGHT), tok, benches, k=1, out_dir=tmp_path / "out")
    assert {r.name: r.metrics["avg@1"] for r in res} == {n: 1.0 for n in [*PAPER_BENCHMARKS, "gsm8k"]}
    wrong = {k: v.replace("4.5 \\times", "4.6 \\times").replace("\\boxed{2}", "\\boxed{3}").replace("84, 69", "84, 68")
             .replace("4.25", "4.35").replace("(-\\infty,2)", "(-\\infty,2]") for k, v in RIGHT.items()}
    res = evaluate(ScriptedEngine(tok, wrong), tok, {n: benches[n] for n in ("minerva", "olympiadbench")}, k=1)
    assert res[0].metrics["avg@1"] == 0.5  # only the wavelength answer is unchanged
    assert res[1].metrics["avg@1"] == 0.0


def test_results_record_sources_skips_and_survive_a_failing_benchmark(tmp_path, tok):
    good = write(tmp_path / "aime24.jsonl", AIME24 + [{"problem": "no answer"}])
    bad = write(tmp_path / "aime25.jsonl", [{"problem": "Find the sum of all integer bases b>9.", "answer": 70}])
    engine = ScriptedEngine(tok, RIGHT, fail_on="bases")
    out = tmp_path / "out"
    res = evaluate(engine, tok, {"aime24": good, "aime25": bad}, k=1, out_dir=out, on_error="continue")
    assert res[0].error is None and res[1].error == "RuntimeError: engine died"
    saved = json.loads((out / "results.json").read_text())
    assert saved["results"]["aime24"]["avg@1"] == 1.0 and "aime25" not in saved["results"]
    assert saved["failed"] == {"aime25": "RuntimeError: engine died"}
    src = saved["sources"]["aime24"]
    assert src["path"] == str(good) and src["rows_used"] == 1 and src["rows_skipped"] == 1
    assert src["sha256"] == hashlib.sha256(good.read_bytes()).hexdigest()
    assert src["skipped"][0].startswith(f"{good}:2: missing field")
    assert saved["grader"]["rel_tol"] == 1e-6 and saved["grader"]["math_verify"]
    assert (out / "samples_aime24.jsonl").exists() and not (out / "samples_aime25.jsonl").exists()
    with pytest.raises(RuntimeError, match="engine died"):
        evaluate(ScriptedEngine(tok, RIGHT, fail_on="bases"), tok, {"aime24": good, "aime25": bad}, k=1,
                 out_dir=tmp_path / "out2")
    assert json.loads((tmp_path / "out2" / "results.json").read_text())["results"]["aime24"]["avg@1"] == 1.0


def test_progress_bar_reports_each_benchmark(tmp_path, tok, capsys):
    p = write(tmp_path / "aime24.jsonl", AIME24 * 3)
    evaluate(ScriptedEngine(tok, RIGHT), tok, {"aime24": p}, k=2, batch_size=1, progress=True)
    err = capsys.readouterr().err
    assert "eval aime24" in err and "6/6" in err and "sample" in err


@pytest.fixture
def model_dir(tmp_path, tok):
    tok.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _never(args):
    raise AssertionError("the model must not load when a benchmark file is bad")


def test_cli_validates_every_file_before_the_model_loads(tmp_path, model_dir, capsys):
    ok = write(tmp_path / "aime24.jsonl", AIME24)
    wrong_field = write(tmp_path / "amc.jsonl", [{"query": "How many?", "answer": 3}])
    rc = main(["--model", str(model_dir), "--benchmarks", f"aime24={ok},amc23={wrong_field}", "--out",
               str(tmp_path / "o")], engine_factory=_never)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"megatron-opd eval: amc23: {wrong_field}: no usable records")
    assert "missing field: none of ['question', 'problem']" in err
    partly = write(tmp_path / "aime25.jsonl", AIME25 + [{"problem": "x"}])
    rc = main(["--model", str(model_dir), "--benchmarks", f"aime25={partly}", "--strict-data", "--out",
               str(tmp_path / "o")], engine_factory=_never)
    assert rc == 2 and f"{partly}:2: missing field" in capsys.readouterr().err


def test_cli_keeps_earlier_results_when_a_later_benchmark_fails(tmp_path, model_dir, tok, capsys):
    a = write(tmp_path / "aime24.jsonl", AIME24)
    b = write(tmp_path / "aime25.jsonl", AIME25)
    rc = main(["--model", str(model_dir), "--benchmarks", f"aime24={a},aime25={b}", "--out", str(tmp_path / "o"),
               "--no-progress"], engine_factory=lambda args: ScriptedEngine(tok, RIGHT, fail_on="bases"))
    assert rc == 1
    saved = json.loads((tmp_path / "o" / "results.json").read_text())
    assert saved["results"]["aime24"]["avg@1"] == 1.0 and "aime25" in saved["failed"]
    assert "aime25: FAILED: RuntimeError: engine died" in capsys.readouterr().out


def test_cli_paper_preset(qwen_layout, model_dir, tok, tmp_path, capsys):
    engines = []

    def factory(args):
        engines.append(ScriptedEngine(tok, RIGHT))
        return engines[-1]

    rc = main(["--model", str(model_dir), "--preset", "paper", "--data-dir", str(qwen_layout), "--out",
               str(tmp_path / "o"), "--no-progress"], engine_factory=factory)
    assert rc == 0
    calls = engines[0].calls
    assert [c.n for c in calls] == [PAPER_PRESET["k"][n] for n in PAPER_BENCHMARKS]
    assert all(c.temperature == 0.6 and c.top_p == 0.95 and c.max_new_tokens == 3072 for c in calls)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| model |"))
    assert header == ("| model | MATH-500 (avg@4) | Minerva (avg@4) | OlympiadBench (avg@4) | AMC23 (avg@16) | "
                      "AIME24 (avg@16) | AIME25 (avg@16) | Avg |")
    assert "| model | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 |" in out
    saved = json.loads((tmp_path / "o" / "results.json").read_text())
    assert saved["k"]["aime24"] == 16 and saved["sampling"]["temperature"] == 0.6
    engines.clear()
    rc = main(["--model", str(model_dir), "--preset", "paper", "--data-dir", str(qwen_layout), "--k", "2",
               "--temperature", "0", "--out", str(tmp_path / "o2"), "--no-progress"], engine_factory=factory)
    assert rc == 0 and {c.n for c in engines[0].calls} == {2} and {c.temperature for c in engines[0].calls} == {0.0}


def test_grade_audit_passes_on_public_formats_and_catches_a_lax_grader(qwen_layout, monkeypatch, capsys, tmp_path):
    argv = ["--data-dir", str(qwen_layout), "--benchmarks", "math500,minerva_math,olympiadbench,amc23,aime24,aime25,gsm8k",
            "--out", str(tmp_path / "a")]
    assert audit.main(argv) == 0
    out = capsys.readouterr().out
    assert "| minerva | 2 |" in out and "100.00%" in out
    saved = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert all(r["accept_rate"] == 1.0 and r["reject_rate"] == 1.0 for r in saved)
    assert sum(r["perturbed_cases"] for r in saved) >= 20

    class Lax:
        correct, status, extracted, error = True, "correct", "x", None

    monkeypatch.setattr(audit, "grade_response", lambda *a, **k: Lax())
    assert audit.main(argv) == 1
    assert "graded correct although wrong" in capsys.readouterr().out


def test_perturbations_cover_the_four_kinds():
    kinds = {k for ans in ("27", "2\\sqrt{3}", "[2, 5)", "-4") for k, _ in audit.perturbations(ans)}
    assert kinds == {"off_by_one", "sign_flipped", "coefficient_changed", "bracket_flipped"}
    assert ("bracket_flipped", "[2, 5]") in audit.perturbations("[2, 5)")
    assert all(k != "sign_flipped" for k, _ in audit.perturbations("0"))


def test_unreadable_benchmark_file_is_a_data_error(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text("[{\"problem\": 1,")
    with pytest.raises(DataError, match="broken.json:1: invalid JSON"):
        read_benchmark_rows("aime24", p)


def test_cli_missing_model_is_one_line(tmp_path, capsys):
    ok = write(tmp_path / "aime24.jsonl", AIME24)
    rc = main(["--model", str(tmp_path / "nope"), "--benchmarks", f"aime24={ok}", "--out", str(tmp_path / "o")],
              engine_factory=_never)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and f"--model {tmp_path / 'nope'}: not found" in err
