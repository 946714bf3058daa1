"""`megatron-opd probe` (eval/probe.py) on tiny real models: the student samples for real (LocalEngine) and
both sides are scored by the trainer's teacher backends.

The "known sign" pairs wrap the student's own forward in a teacher that adds a fixed bonus to the token an
induction rule predicts (the token that followed the previous occurrence of the current one: exactly the
next token inside a copied line, rarely right in fresh text) and shifts the EOS logit. That construction is
for this test only: it fixes the sign of (a) and (b) so that the probe's arithmetic and verdict can be
checked; no run or reproduction uses it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from megatron_opd.data.toy_tokenizer import byte_tokenizer
from megatron_opd.eval.probe import (GROWTH, CopyRow, copy_variants, load_probe_prompts, main, probe, render,
                                     support_finding, verdict)
from megatron_opd.rollout.base import SamplingParams
from megatron_opd.rollout.local import LocalEngine
from megatron_opd.teacher.hf import HFTeacher
from tests._tiny import tiny_setup

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it

N, BUDGET = 16, 96


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, student, teacher, data = tiny_setup(tmp_path_factory.mktemp("probe"), n_train=8, n_eval=2)
    return student, teacher


@pytest.fixture(scope="module")
def parts(pair):
    student, _ = pair
    tok = AutoTokenizer.from_pretrained(student)
    engine = LocalEngine.from_pretrained(student)
    scorer = HFTeacher(engine.model, eos_token_ids=engine.eos_token_ids, pad_token_id=engine.pad_token_id)
    return tok, engine, scorer, load_probe_prompts(None, tok, N, use_chat=True)


class OneTokenTeacher(torch.nn.Module):
    """Puts its mass on one id (the last byte, 0xff, never in ASCII text): no support for the student's text."""

    def __init__(self, base: torch.nn.Module, token: int):
        super().__init__()
        self.base, self.config, self.token = base, base.config, token

    def forward(self, input_ids, attention_mask=None, **kw):
        logits = torch.zeros_like(self.base(input_ids=input_ids, attention_mask=attention_mask).logits)
        logits[..., self.token] = 10.0
        return SimpleNamespace(logits=logits)


class InductionTeacher(torch.nn.Module):
    """The student's logits + `bonus` on the induction token and + `eos_shift` on EOS (see the module doc)."""

    def __init__(self, base: torch.nn.Module, bonus: float, eos_shift: float, eos_id: int):
        super().__init__()
        self.base, self.bonus, self.eos_shift, self.eos_id = base, bonus, eos_shift, eos_id
        self.config = base.config

    def forward(self, input_ids, attention_mask=None, **kw):
        logits = self.base(input_ids=input_ids, attention_mask=attention_mask).logits.clone()
        for b, row in enumerate(input_ids.tolist()):
            last: dict[int, int] = {}
            for t, tok in enumerate(row):
                if tok in last and last[tok] + 1 < t + 1:
                    logits[b, t, row[last[tok] + 1]] += self.bonus
                last[tok] = t
        logits[..., self.eos_id] += self.eos_shift
        return SimpleNamespace(logits=logits)


def merging_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE whose merges put a line break into a token with the text before it ("}\\n", as Llama-3's
    and Qwen's pre-tokenizers allow), and join "y =" into one token."""
    vocab = {"<|pad|>": 0, "<|im_end|>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [("}", "Ċ"), ("Ġ", "="), ("y", "Ġ=")]
    for x, y in merges:
        vocab[x + y] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>")


def test_copy_variants_insert_the_last_line_before_trailing_breaks_and_eos():
    tok = byte_tokenizer()
    eos = tok.eos_token_id
    ids = tok("ab\ncd\n", add_special_tokens=False)["input_ids"] + [eos]
    (v0, v1, v2) = copy_variants(ids, tok, 2)
    assert v0.tokens == ids and v0.copies == 0
    assert tok.decode(v2.tokens) == "ab\ncd\ncd\ncd\n<|im_end|>" and v2.tokens[-1] == eos
    assert [tok.decode(v2.tokens[a:b]) for a, b in v2.spans] == ["\ncd", "\ncd"] and v2.spans[0][0] == 5
    assert [tok.decode(v1.tokens[a:b]) for a, b in v1.spans] == ["\ncd"]
    one_line = copy_variants(tok("cd", add_special_tokens=False)["input_ids"] + [eos], tok, 1)
    assert tok.decode(one_line[1].tokens) == "cd\ncd<|im_end|>"
    assert copy_variants(tok("\n \n", add_special_tokens=False)["input_ids"] + [eos], tok, 3) is None


@pytest.mark.parametrize("text", ["x = 1\ny = {b}\n", "x = {a}\ny = 5\n", "y = {b}\n", "x = {a}\ny = {é}\n\n"])
def test_copies_are_the_last_line_when_a_token_merges_a_line_break(text):
    """Regression: copies were cut from the ids at ids that contain a line break, so with "}\\n" one token the
    inserted copy of "y = {b}" was "\\ny = {b" (the text lost its "}"), and after "x = {a}\\n" the copy of
    "y = 5" was "}\\ny = 5"."""
    tok = merging_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert any(len(t) > 1 and "\n" in t for t in (tok.decode([i]) for i in ids)), "the case needs a merged break"
    body = text.rstrip()
    line = body[body.rfind("\n") + 1:]
    variants = copy_variants(ids, tok, 3)
    assert variants[0].tokens == ids
    for v in variants[1:]:
        assert tok.decode(v.tokens) == body + ("\n" + line) * v.copies + text[len(body):] + "<|im_end|>"
        copies = [tok.decode(v.tokens[a:b]) for a, b in v.spans]
        assert len(copies) == v.copies and len(set(copies)) == 1
        assert copies[-1] in ("\n" + line, line + "\n"), copies
        assert v.spans == sorted(v.spans) and all(a < b for a, b in v.spans)
        assert all(b == c for (_, b), (c, _) in zip(v.spans, v.spans[1:]))  # adjacent: nothing between copies
        kept = next((i for i, (x, y) in enumerate(zip(v.tokens, ids)) if x != y), len(ids))
        assert kept >= len(ids) - 3  # the sampled ids up to the end of the last line are kept


def test_teacher_equal_to_the_student_gives_zero_advantage_everywhere(parts):
    tok, engine, scorer, prompts = parts
    r = probe(engine, scorer, scorer, tok, prompts, n=N, budget=BUDGET, copies=3, seed=3, teacher_engine=engine)
    assert r.n_finished >= 2, "the tiny student must finish some samples for (a) and (b) to be measured"
    assert abs(r.adv_original) < 1e-6 and abs(r.adv_eos) < 1e-6
    assert all(abs(c.adv_inserted) < 1e-6 and abs(c.adv_last_copy) < 1e-6 and abs(c.adv_eos) < 1e-6
               for c in r.copies)
    assert r.p_eos_teacher == pytest.approx(r.p_eos_student, abs=1e-7)
    assert not r.prone and r.verdict.startswith("not prone") and r.findings == []
    assert r.student == r.teacher  # the same engine and seed: the same own samples


def test_the_student_is_scored_at_the_runs_temperature_and_the_teacher_at_1(parts):
    """A run's A_t is log pi_T(y_t) at T=1 minus log pi_old(y_t) at rollout.temperature (trainer/policy.py,
    trainer/scoring.py). With the student's own model as the teacher that is log softmax(z)[y] -
    log softmax(z / T)[y], which the sampling engine reports on its own path (Sample.raw_logprobs and
    Sample.logprobs, KV-cached decoding): not zero at T = 0.5. Regression: the probe sampled at T but scored
    both sides at 1, so this pair got A = 0 everywhere."""
    tok, engine, scorer, prompts = parts
    T = 0.5
    r = probe(engine, scorer, scorer, tok, prompts, n=N, budget=BUDGET, copies=1, temperature=T, seed=3)
    picked = [prompts[i % len(prompts)] for i in range(N)]
    samples = engine.generate(picked, SamplingParams(max_new_tokens=BUDGET, temperature=T, n=1, seed=3))
    done = [s for s in samples if not s.truncated and tok.decode(s.response_ids[:-1]).strip()]
    assert r.n_finished == len(done) >= 2
    adv = [torch.tensor(s.raw_logprobs) - torch.tensor(s.logprobs) for s in done]
    want = {"adv_original": float(torch.stack([a[:-1].mean() for a in adv]).mean()),
            "adv_eos": float(torch.stack([a[-1] for a in adv]).mean()),
            "p_eos_student": sum(math.exp(s.logprobs[-1]) for s in done) / len(done),
            "p_eos_teacher": sum(math.exp(s.raw_logprobs[-1]) for s in done) / len(done)}
    for k, v in want.items():
        assert getattr(r, k) == pytest.approx(v, abs=1e-6), k
    assert abs(want["adv_original"]) > 1e-3 and abs(want["adv_eos"]) > 1e-3  # far above the tolerance: not 0
    assert r.temperature == T and f"the student at T={T:g}" in render(r)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        probe(engine, scorer, scorer, tok, prompts, n=N, budget=BUDGET, temperature=0.0)


def test_a_teacher_without_support_for_the_students_text_is_a_finding(parts):
    tok, engine, scorer, prompts = parts
    teacher = HFTeacher(OneTokenTeacher(engine.model, len(tok) - 1), eos_token_ids=engine.eos_token_ids,
                        pad_token_id=engine.pad_token_id)
    r = probe(engine, scorer, teacher, tok, prompts, n=N, budget=BUDGET, copies=3, seed=3)
    assert r.adv_original < -2.0
    [note] = [f for f in r.findings if f.startswith("no support")]
    assert f"{r.adv_original:+.3g}" in note and f"note: {note}" in render(r)
    assert support_finding(-1.9) is None and support_finding(float("nan")) is None


@pytest.mark.parametrize("bonus,eos_shift,prone", [(3.0, -3.0, True), (-3.0, 3.0, False)])
def test_a_pair_with_a_known_sign(parts, bonus, eos_shift, prone):
    tok, engine, scorer, prompts = parts
    teacher = HFTeacher(InductionTeacher(engine.model, bonus, eos_shift, engine.eos_token_ids[0]),
                        eos_token_ids=engine.eos_token_ids, pad_token_id=engine.pad_token_id)
    r = probe(engine, scorer, teacher, tok, prompts, n=N, budget=BUDGET, copies=3, seed=3)
    sign = 1 if prone else -1
    assert all(sign * (c.adv_inserted - r.adv_original) > 0.5 for c in r.copies), (r.adv_original, r.copies)
    assert sign * r.adv_eos < -1 and sign * (r.p_eos_student - r.p_eos_teacher) > 0
    assert r.prone is prone and r.verdict.startswith("PRONE" if prone else "not prone")
    assert r.teacher is None


def _rows(adv, *last):
    """One CopyRow per k-th copy's A in `last`; `adv` (one number, or one per k) on all the copies."""
    return [CopyRow(copies=k + 1, adv_inserted=adv[k] if isinstance(adv, list) else adv, adv_last_copy=x,
                    p_eos_teacher=0.1, p_eos_student=0.1, adv_eos=0.0) for k, x in enumerate(last)]


def test_verdict_levels():
    assert verdict(-1.0, 0.0, _rows(0.5, 0.5, 0.6, 0.7))[0] == "prone"  # paid and growing
    assert verdict(-1.0, -0.5, _rows(0.5, 0.5, 0.5, 0.5))[0] == "prone"  # paid, flat, EOS penalised
    assert verdict(-1.0, 0.0, _rows(0.5, 0.5, 0.5, 0.5))[0] == "at risk"  # paid but neither
    assert verdict(-1.0, -0.5, _rows(-0.4, 0.5, 0.6, 0.7))[0] == "at risk"  # preferred but paid < 0
    assert verdict(0.45, -0.5, _rows(0.5, 0.5, 0.6, 0.7))[0] == "prone"  # the margin is on the copies' own A
    assert verdict(-0.45, 0.0, _rows(-0.4, 0.5, 0.6, 0.7))[0] == "not prone"  # within the margin
    assert verdict(-0.37, -19.3, _rows(-0.7, 0.5, 0.5, 0.5))[0] == "at risk"  # copies unpaid, pushed to go on
    assert verdict(-0.37, -0.5, _rows(-0.7, 0.5, 0.5, 0.5))[0] == "not prone"
    assert verdict(float("nan"), 0.0, [])[0] == "none"


def test_at_risk_says_the_sign_the_copies_are_paid_with():
    """Regression: every "at risk" for copies said "pays them < 0", also when they were paid > 0."""
    level, line = verdict(-1.0, 0.0, _rows(0.5, 0.5, 0.5, 0.5))
    assert level == "at risk" and "pays them (A > 0.1 on every k)" in line
    assert "< 0" not in line and "less than nothing" not in line
    assert "neither grows with each copy nor comes with a push off the EOS" in line
    level, line = verdict(-1.0, 0.0, _rows(0.05, 0.5, 0.5))
    assert level == "at risk" and "pays them (A > 0 on every k), but not more than the margin" in line
    level, line = verdict(-1.0, -0.5, _rows(-0.4, 0.5, 0.6, 0.7))
    assert level == "at risk" and "less than nothing (A < 0 on every k)" in line
    level, line = verdict(-1.0, 0.0, _rows([-0.2, 0.3], 0.5, 0.5))
    assert level == "at risk" and "pays them -0.2 to +0.3 depending on k" in line and "every k" not in line


def test_growth_counts_only_above_its_margin_on_every_step():
    """Copies paid 0.5 > margin, no EOS push: "prone" then rests on growth alone. Regression: growth had no
    margin (any rise, 1e-6 included, was growth) and a single k counted as growing."""
    def by(step):
        return _rows(0.5, *(0.5 + i * step for i in range(4)))
    level, line = verdict(-1.0, 0.0, by(GROWTH + 0.01))
    assert level == "prone" and f", growing by more than {GROWTH:g}" in line
    level, line = verdict(-1.0, 0.0, by(GROWTH - 0.01))
    assert level == "at risk" and f"not growing by more than {GROWTH:g}" in line
    assert verdict(-1.0, 0.0, by(1e-6))[0] == "at risk"
    assert verdict(-1.0, 0.0, _rows(0.5, 0.5, 0.6, 0.7, 0.74))[0] == "at risk"  # one step within the margin
    assert verdict(-1.0, 0.0, _rows(0.5, 0.5))[0] == "at risk"  # k = 1 alone: no growth to see
    assert verdict(-1.0, -0.5, _rows(0.5, 0.5))[0] == "prone"  # ... the EOS push still decides


def test_cli_writes_the_table_and_json_and_refuses_bad_pairs(pair, tmp_path, capsys):
    student, teacher = pair
    out = tmp_path / "probe.json"
    assert main(["--student", str(student), "--teacher", str(teacher), "--n", "8", "--budget", "48",
                 "--copies", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "verdict:" in text and "k=2" in text and "train.health.text_threshold=" in text
    report = json.loads(out.read_text())
    assert report["n_samples"] == 8 and report["teacher"]["n"] == 8 and len(report["copies"]) == 2
    assert report["teacher_backend"] == "hf" and report["temperature"] == 1.0
    rows = [CopyRow(**c) for c in report["copies"]]
    assert (report["level"], report["verdict"]) == verdict(report["adv_original"], report["adv_eos"], rows,
                                                           report["margin"])
    assert f"verdict: {report['verdict']}" in text

    assert main(["--student", str(student), "--teacher", str(teacher), "--temperature", "0"]) == 2
    assert "--temperature must be > 0" in capsys.readouterr().err

    assert main(["--student", str(student), "--teacher", str(tmp_path / "nope")]) == 2
    assert "--teacher" in capsys.readouterr().err
    bad = Path(shutil.copytree(teacher, tmp_path / "bad"))
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|pad|>"
    (bad / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name in ("config.json", "generation_config.json"):
        c = json.loads((bad / name).read_text())
        c["eos_token_id"] = 0
        (bad / name).write_text(json.dumps(c))
    assert main(["--student", str(student), "--teacher", str(bad), "--n", "4", "--budget", "16"]) == 1
    err = capsys.readouterr().err
    assert "EOS ids differ" in err and "doctor --pair" in err
    # the EOS-disagreement arm: probed on request, the disagreement named in the report
    assert main(["--student", str(student), "--teacher", str(bad), "--n", "4", "--budget", "16",
                 "--preflight", "warn", "--no-teacher-samples"]) == 0
    assert "EOS disagreement" in capsys.readouterr().out
    assert main(["--student", str(student), "--teacher", str(teacher), "--prompts", str(tmp_path / "x.jsonl")]) == 2
    assert "--prompts" in capsys.readouterr().err


@pytest.mark.slow  # > 15 s: the slow CI leg runs it
def test_megatron_teacher_backend_matches_hf(pair, tmp_path):
    """--teacher-backend megatron (a forward-only GPTModel over gloo, in its own process) scores as HF does."""
    student, teacher = pair
    res = {}
    # a rendezvous this pytest process may hold (init_parallel exports MASTER_PORT) is not the child's
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    for backend in ("hf", "megatron"):
        out = tmp_path / f"{backend}.json"
        proc = subprocess.run([sys.executable, "-m", "megatron_opd.cli", "probe", "--student", str(student),
                               "--teacher", str(teacher), "--n", "8", "--budget", "64", "--copies", "2",
                               "--no-teacher-samples", "--teacher-backend", backend, "--json", str(out)],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        res[backend] = json.loads(out.read_text())
    assert res["hf"]["n_finished"] == res["megatron"]["n_finished"] > 0
    assert res["megatron"]["adv_original"] == pytest.approx(res["hf"]["adv_original"], abs=1e-4)
    for a, b in zip(res["hf"]["copies"], res["megatron"]["copies"]):
        assert b["adv_inserted"] == pytest.approx(a["adv_inserted"], abs=1e-4)
