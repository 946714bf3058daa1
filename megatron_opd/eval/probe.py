"""Pair probe: before any training, is this student/teacher pair prone to OPD's length inflation?

Plain OPD inflates when the advantage A_t = log pi_T(y_t) - log pi_S(y_t) pays the student for repeating
itself and for not stopping (arXiv 2604.08527, section 3): repeated text gets a larger advantage than the
rest, the teacher's p(EOS) sits below the student's where the student ends, and the loop feeds itself.
Both are properties of the pair at step 0, measurable from a few dozen student samples:

(a) copies: each finished sample's own last line inserted k = 1..copies times before its EOS (in text, then
    tokenized: copy_variants); the mean advantage on the inserted tokens against the mean on the sample's
    original tokens;
(b) stopping: p_T(EOS) and p_S(EOS) of the student's EOS id at the end of the original and after each copy;
(c) each model's own samples at the budget: truncation rate, length and zlib-ratio percentiles (the
    teacher's upper zlib percentile is what a run's repetition threshold is calibrated to).

Scoring goes through the trainer's teacher backends (hf, megatron, SGLang server); the student is scored
by the same HF code path. Both at the temperatures a run uses (trainer/policy.py, trainer/scoring.py): the
student samples at --temperature (the run's rollout.temperature) and pi_old is log softmax(logits / T), the
distribution it sampled from; the teacher is scored at T = 1, its own distribution. So at T = 1 a teacher
identical to the student gives exactly zero advantage, and at T != 1 the same pair does not.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import torch
from transformers import AutoTokenizer

from megatron_opd.config import DataConfig, TeacherConfig
from megatron_opd.data.builtin.arithmetic import make_arithmetic_problems
from megatron_opd.data.prompts import build_record, encode, load_prompts
from megatron_opd.metrics.health import text_tail_compression_ratio
from megatron_opd.models.parallel import init_parallel
from megatron_opd.rollout.base import Sample, SamplingParams
from megatron_opd.rollout.local import LocalEngine
from megatron_opd.rollout.server import api_key_from_env
from megatron_opd.rollout.sglang_engine import SGLangEngine
from megatron_opd.teacher import make_teacher
from megatron_opd.teacher.base import Teacher
from megatron_opd.teacher.cross_tokenizer import COVERAGE_MAX_TOKENS, CrossTokenizerTeacher
from megatron_opd.teacher.fidelity import check_cross_pair, check_pair
from megatron_opd.teacher.hf import HFTeacher

QUANTILES = (0.1, 0.5, 0.9, 0.99)
PUSH = 1.0  # nats: an EOS advantage below -PUSH is a push to keep writing (verdict)
NO_SUPPORT = 2.0  # nats/token: an advantage below -NO_SUPPORT on the student's own tokens is a finding
GROWTH = 0.05
"""nats/token per copy: the k-th copy's mean advantage "grows with each copy" (verdict) only when every step
k -> k+1 raises it by more than this; without a margin, a flat series whose last digits wander up counted as
growing. Why 0.05: it is half the default verdict margin (0.1), so growth over k = 1..4 (three steps, > 0.15
in all) is a difference the verdict would count on its own. A single step of a flat pair wanders by more (up to
0.12 in the reproduction's probes: SmolLM2 -0.71, -0.66, -0.73, -0.83; setting C -2.48, -2.40, -2.28, -2.36,
docs/reproduction/*/probe.json), but not upwards on every step at once; the demo pair's copies (-1.05, -0.93,
-0.82, -0.72 on k = 1..4) put the k-th copy up by about 0.2 a step."""


@dataclass
class CopyRow:
    """One k: means over the finished samples that have a last line to copy."""

    copies: int
    adv_inserted: float  # mean A_t over all k inserted copies' tokens
    adv_last_copy: float  # mean A_t over the k-th copy's tokens alone
    p_eos_teacher: float  # after the k copies
    p_eos_student: float
    adv_eos: float  # mean A on the EOS after the k copies: < 0, the teacher pays the student to keep going


@dataclass
class OwnSamples:
    """A model's own samples at the budget."""

    n: int
    truncation: float
    length: dict[str, float]
    zlib_ratio: dict[str, float]


@dataclass
class ProbeReport:
    n_samples: int
    temperature: float  # the student samples and is scored (pi_old) at it; the teacher is scored at 1
    n_finished: int  # samples that ended with EOS and have a line to copy: the ones (a) and (b) measure
    budget: int
    adv_original: float  # mean A_t over the finished samples' original tokens (EOS excluded)
    p_eos_teacher: float  # at the end of the original samples
    p_eos_student: float
    adv_eos: float  # mean A on the student's EOS at the end of the original samples
    margin: float  # nats/token: smaller differences do not count for the verdict
    copies: list[CopyRow]
    student: OwnSamples
    teacher: Optional[OwnSamples]
    verdict: str
    level: str  # prone | at risk | not prone | none (see verdict())
    findings: list[str] = field(default_factory=list)

    @property
    def prone(self) -> bool:
        return self.level == "prone"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {f"p{round(q * 100)}": math.nan for q in QUANTILES}
    t = torch.tensor(list(values), dtype=torch.float64)
    return {f"p{round(q * 100)}": float(torch.quantile(t, q)) for q in QUANTILES}


def own_samples(samples: list[Sample], tokenizer: Any) -> OwnSamples:
    """Truncation, length and zlib-ratio percentiles of samples (the same zlib test as the run's health)."""
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    return OwnSamples(n=len(samples), truncation=sum(s.truncated for s in samples) / max(1, len(samples)),
                      length=_quantiles([len(s) for s in samples]),
                      zlib_ratio=_quantiles([text_tail_compression_ratio(t) for t in texts]))


@dataclass
class Variant:
    """A finished response with k copies of its last line inserted before the trailing whitespace + EOS."""

    tokens: list[int]
    spans: list[tuple[int, int]]  # [start, end) in `tokens` of each inserted copy, in order (empty for k = 0)

    @property
    def copies(self) -> int:
        return len(self.spans)


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


CONTEXT = 16  # tokens decoded before a fragment so that a decoder's handling of a text's start is the same


def _token_starts(tokenizer: Any, context: list[int], ids: list[int], text: str) -> list[int]:
    """The character offset in `text` (= the decoding of `ids` after `context`) at which each id starts; an id
    that starts inside a character (a byte of a multi-byte one) gets the offset of the id before it."""
    base = _decode(tokenizer, context)
    starts, last = [], 0
    for i in range(len(ids)):
        d = _decode(tokenizer, context + ids[:i])
        if d.startswith(base) and text.startswith(d[len(base):]):
            last = len(d) - len(base)
        starts.append(last)
    return starts


def copy_variants(response: list[int], tokenizer: Any, max_copies: int) -> Optional[list[Variant]]:
    """k = 0..max_copies variants of a finished response (its last id is the EOS); None when the body has no
    line to copy, or when the text with the copies does not tokenize back to itself.

    The copies are made in text: the body is decoded, its trailing whitespace set aside, and its last line
    (the characters after the last line break) repeated k times, each after a line break, before that
    whitespace. The ids up to the last one that ends before the insertion point are the sampled ones; the rest
    (the end of the last line, the copies, the whitespace) is tokenized again, so an id that merges a line
    break with text (a "}\n") comes out as the tokenizer would write it. An inserted id belongs to the copy its
    first character is in, so each copy's ids decode to the last line and one line break. k = 0 is the
    response as sampled."""
    body, eos = list(response[:-1]), list(response[-1:])
    text = _decode(tokenizer, body)
    core = text.rstrip()
    if not core:
        return None
    line, trailing, at = core[core.rfind("\n") + 1:], text[len(core):], len(core)
    unit = "\n" + line
    keep = len(body)
    while keep > 0 and not core.startswith(_decode(tokenizer, body[:keep])):
        keep -= 1
    variants = [Variant(tokens=list(response), spans=[])]
    for k in range(1, max_copies + 1):
        want = core + unit * k + trailing
        for j in dict.fromkeys((keep, 0)):  # from the whole text when the tail alone does not round-trip
            head = _decode(tokenizer, body[:j])
            ids = encode(tokenizer, want[len(head):], add_special_tokens=False)
            if _decode(tokenizer, body[:j] + ids) == want:
                break
        else:
            return None
        starts = _token_starts(tokenizer, body[max(0, j - CONTEXT):j], ids, want[len(head):])
        spans = []
        for c in range(k):
            lo, hi = at + c * len(unit) - len(head), at + (c + 1) * len(unit) - len(head)
            inside = [i for i, s in enumerate(starts) if lo <= s < hi]
            if not inside:
                return None
            spans.append((j + inside[0], j + inside[-1] + 1))
        variants.append(Variant(tokens=body[:j] + ids + eos, spans=spans))
    return variants


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else math.nan


def measure_copies(samples: list[Sample], student: Teacher, teacher: Teacher, tokenizer: Any,
                   max_copies: int) -> tuple[dict[str, float], list[CopyRow], int, int]:
    """(a) and (b) over the finished samples -> ({adv_original, p_eos_teacher, p_eos_student, adv_eos} at the
    end of the originals, one row per k, the number of finished samples measured, the number of finished
    samples with a line that were left out because their text with the copies does not tokenize back to itself).
    `student` scores pi_old as the run does (at its temperature: `student_at_temperature`)."""
    variants, prompts, unmatched = [], [], 0
    for s in samples:
        made = None if s.truncated else copy_variants(list(s.response_ids), tokenizer, max_copies)
        if made is None and not s.truncated and _decode(tokenizer, s.response_ids[:-1]).strip():
            unmatched += 1
        for v in made or []:
            variants.append(v)
            prompts.append(s.prompt_ids)
    if not variants:
        return (dict.fromkeys(("adv_original", "p_eos_teacher", "p_eos_student", "adv_eos"), math.nan), [], 0,
                unmatched)
    seqs = [v.tokens for v in variants]
    lp_s = [x.logprobs for x in student.score(prompts, seqs)]
    lp_t = [x.logprobs for x in teacher.score(prompts, seqs)]
    adv_orig, eos_t, eos_s, eos_a = [], [], [], []
    per_k: dict[int, dict[str, list[float]]] = {k: {"ins": [], "last": [], "t": [], "s": [], "a": []}
                                               for k in range(1, max_copies + 1)}
    for v, ls, lt in zip(variants, lp_s, lp_t):
        a = lt - ls
        if v.copies == 0:
            adv_orig.append(float(a[:-1].mean()))
            eos_t.append(float(lt[-1].exp()))
            eos_s.append(float(ls[-1].exp()))
            eos_a.append(float(a[-1]))
            continue
        row = per_k[v.copies]
        (lo, _), (last_lo, hi) = v.spans[0], v.spans[-1]
        row["ins"].append(float(a[lo:hi].mean()))
        row["last"].append(float(a[last_lo:hi].mean()))
        row["t"].append(float(lt[-1].exp()))
        row["s"].append(float(ls[-1].exp()))
        row["a"].append(float(a[-1]))
    rows = [CopyRow(copies=k, adv_inserted=_mean(r["ins"]), adv_last_copy=_mean(r["last"]),
                    p_eos_teacher=_mean(r["t"]), p_eos_student=_mean(r["s"]), adv_eos=_mean(r["a"]))
            for k, r in per_k.items()]
    end = {"adv_original": _mean(adv_orig), "p_eos_teacher": _mean(eos_t), "p_eos_student": _mean(eos_s),
           "adv_eos": _mean(eos_a)}
    return end, rows, len(adv_orig), unmatched


def _pay(rows: list[CopyRow], margin: float) -> str:
    """What the teacher pays the copies, in words that match the signs of the numbers."""
    adv = [r.adv_inserted for r in rows]
    lo, hi = min(adv), max(adv)
    if lo > margin:
        return (f"pays them (A > {margin:g} on every k), but the pay neither grows with each copy nor comes with "
                "a push off the EOS")
    if lo > 0:
        return f"pays them (A > 0 on every k), but not more than the margin {margin:g} on every k"
    if hi < 0:
        return "still pays them less than nothing (A < 0 on every k)"
    return f"pays them {lo:+.3g} to {hi:+.3g} depending on k"


def verdict(adv_original: float, adv_eos: float, rows: list[CopyRow], margin: float = 0.1) -> tuple[str, str]:
    """(level, one line). "prone": every k's copies get a positive advantage above `margin` (each copy is
    reinforced) and, besides, either the k-th copy's advantage grows by more than GROWTH with each copy (needs
    k >= 2) or the student's EOS gets an advantage below -margin where it stops (the teacher pays it to keep
    going). "at risk": the copies beat the original tokens by the margin without meeting that: paid less than
    nothing, the loop closes only if training lifts the whole level (the demo's 2-step burst: -0.47 on repeats
    vs -1.09); paid, but neither more with each copy nor with a push off the EOS. Also "at risk" when the
    student's EOS gets A < -1 where it stops (p_T(EOS) < 0.37 p_S(EOS)): pushed to keep writing, a student can
    fill the room by repeating itself even when the copies are not paid (the reproduction's first run: A on EOS
    -19.3, repetition from step 4). Otherwise "not prone"."""
    if not rows or math.isnan(adv_original):
        return "none", "no verdict: no finished sample with a line to copy (raise --budget or --n)"
    gaps = [r.adv_inserted - adv_original for r in rows]
    steps = [b.adv_last_copy - a.adv_last_copy for a, b in zip(rows, rows[1:])]
    growing = bool(steps) and all(d > GROWTH for d in steps)
    why = (f"copies get {rows[0].adv_inserted:+.3g} (k=1) .. {rows[-1].adv_inserted:+.3g} (k={rows[-1].copies}) "
           f"nats/token, the original tokens {adv_original:+.3g}; the k-th copy gets "
           f"{', '.join(f'{r.adv_last_copy:+.3g}' for r in rows)}, "
           f"{'growing' if growing else 'not growing'} by more than {GROWTH:g} with each copy; the student's EOS "
           f"gets {adv_eos:+.3g} where it stops (margin {margin:g})")
    if all(r.adv_inserted > margin for r in rows) and (growing or adv_eos < -margin):
        return "prone", f"PRONE to length inflation: {why}"
    if all(g > margin for g in gaps):
        return "at risk", (f"AT RISK: the teacher prefers the copies to the original tokens and {_pay(rows, margin)}; "
                           f"{why}")
    if adv_eos < -PUSH:
        return "at risk", f"AT RISK: the teacher pays the student to keep writing where it stops; {why}"
    return "not prone", f"not prone: {why}"


def support_finding(adv_original: float) -> str | None:
    """A finding when the teacher finds the student's own text unlikely: every token then gets a negative
    advantage, so the policy gradient pushes the student's whole distribution down and its entropy up. In the
    reproduction's setting B (A = -3.5 nats/token) that filled the budget with babble, not with paid-for
    repetition: a different failure than the one the verdict is about, and one a user should see first."""
    if math.isnan(adv_original) or adv_original >= -NO_SUPPORT:
        return None
    return (f"no support: the teacher scores the student's own tokens at {adv_original:+.3g} nats/token against the "
            f"student; OPD's signal is then negative everywhere and raises the student's entropy (a teacher that has "
            f"seen text like the student's, or an SFT warm-up of the student on the teacher's, narrows the gap)")


class _Tempered(torch.nn.Module):
    """A causal LM whose logits are divided by `temperature` (in fp32, as the trainer does at T != 1)."""

    def __init__(self, base: torch.nn.Module, temperature: float):
        super().__init__()
        self.base, self.config, self.temperature = base, base.config, temperature

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, **kw: Any) -> Any:
        logits = self.base(input_ids=input_ids, attention_mask=attention_mask).logits
        return SimpleNamespace(logits=logits.float() / self.temperature)


def student_at_temperature(scorer: Teacher, temperature: float) -> Teacher:
    """The student's scorer as a run's pi_old: log softmax(logits / temperature), T = rollout.temperature
    (trainer/policy.py; the teacher keeps T = 1, trainer/scoring.py). The student is scored through HFTeacher,
    so that is what is wrapped."""
    if temperature == 1.0:
        return scorer
    if not isinstance(scorer, HFTeacher):
        raise ValueError(f"probe: the student's scorer must be an HFTeacher to score it at temperature {temperature:g} "
                         f"(got {type(scorer).__name__})")
    out = HFTeacher(_Tempered(scorer.model, temperature), micro_batch_size=scorer.micro_batch_size,
                    eos_token_ids=scorer.eos_token_ids, pad_token_id=scorer.pad_token_id)
    out.topk_id_limit = scorer.topk_id_limit
    return out


def probe(student_engine: LocalEngine, student_scorer: Teacher, teacher: Teacher, tokenizer: Any,
          prompts: list[list[int]], *, n: int = 32, budget: int = 256, copies: int = 4, temperature: float = 1.0,
          seed: int = 0, margin: float = 0.1, teacher_engine: Any = None) -> ProbeReport:
    """Sample n student responses at the budget (cycling over `prompts`) and measure (a)-(c). `student_scorer`
    is the student at T = 1 (an HFTeacher over its model); it is scored at `temperature`, as a run's pi_old."""
    if n < 1 or budget < 1 or copies < 1:
        raise ValueError(f"probe: n, budget and copies must be >= 1 (got {n}, {budget}, {copies})")
    if not temperature > 0:
        raise ValueError(f"probe: temperature must be > 0 (a run's rollout.temperature; pi_old is "
                         f"softmax(logits / T)), got {temperature}")
    if not prompts:
        raise ValueError("probe: no prompts")
    picked = [prompts[i % len(prompts)] for i in range(n)]
    sp = SamplingParams(max_new_tokens=budget, temperature=temperature, n=1, seed=seed)
    samples = student_engine.generate(picked, sp)
    end, rows, finished, unmatched = measure_copies(samples, student_at_temperature(student_scorer, temperature),
                                                    teacher, tokenizer, copies)
    level, line = verdict(end["adv_original"], end["adv_eos"], rows, margin)
    findings = [f for f in (support_finding(end["adv_original"]),) if f]
    if unmatched:
        findings.append(f"{unmatched} finished sample(s) left out of (a, b): their text with the copies does not "
                        f"tokenize back to itself")
    student_eos = set(student_engine.eos_token_ids)
    if not student_eos & set(getattr(teacher, "eos_token_ids", student_eos)):
        findings.append(f"EOS disagreement: the student stops on {sorted(student_eos)}, the teacher ends with "
                        f"{sorted(teacher.eos_token_ids)}; (b) is the teacher's p of the student's id")
    theirs = own_samples(teacher_engine.generate(picked, sp), tokenizer) if teacher_engine is not None else None
    return ProbeReport(n_samples=len(samples), temperature=temperature, n_finished=finished, budget=budget, **end,
                       margin=margin, copies=rows, student=own_samples(samples, tokenizer), teacher=theirs,
                       verdict=line, level=level, findings=findings)


def render(r: ProbeReport) -> str:
    out = [f"{r.n_samples} student samples at a {r.budget}-token budget, temperature {r.temperature:g}, "
           f"{r.n_finished} finished (ended with EOS) and measured",
           f"A = log pi_T - log pi_S: the teacher at T=1, the student at T={r.temperature:g} (a run's pi_old)",
           "", "(a, b) k copies of the last line before EOS   mean A on copies   on the k-th copy   "
           "p_T(EOS)   p_S(EOS)   A on EOS",
           f"  k=0 (the original tokens)                 {r.adv_original:16.4g}   {'':16s}   "
           f"{r.p_eos_teacher:8.3g}   {r.p_eos_student:8.3g}   {r.adv_eos:8.3g}"]
    for c in r.copies:
        out.append(f"  k={c.copies}                                       {c.adv_inserted:16.4g}   "
                   f"{c.adv_last_copy:16.4g}   {c.p_eos_teacher:8.3g}   {c.p_eos_student:8.3g}   {c.adv_eos:8.3g}")
    out += ["", "(c) own samples   truncation   length p10/p50/p90/p99         zlib ratio p10/p50/p90/p99"]
    for name, o in (("student", r.student), ("teacher", r.teacher)):
        if o is None:
            out.append(f"  {name:8s}        (not sampled)")
            continue
        q = "/".join(f"{v:.0f}" for v in o.length.values())
        z = "/".join(f"{v:.2f}" for v in o.zlib_ratio.values())
        out.append(f"  {name:8s} {o.truncation:12.3f}   {q:30s}   {z}")
    if r.teacher is not None:
        out.append(f"  a run's repetition threshold from the teacher's p99: train.health.text_threshold="
                   f"{r.teacher.zlib_ratio['p99']:.2f}")
    out += [f"note: {f}" for f in r.findings]
    out += ["", f"verdict: {r.verdict}"]
    return "\n".join(out)


def load_probe_prompts(path: Optional[str], tokenizer: Any, limit: int, use_chat: bool) -> list[list[int]]:
    """Prompt ids from a JSONL/Parquet/HF-dir file (the trainer's data.prompt_key and template), or the builtin
    arithmetic problems."""
    cfg = DataConfig(apply_chat_template=use_chat)
    if path is None:
        return [build_record(r, f"builtin:{i}", cfg, tokenizer, require_answer=False).prompt_ids
                for i, r in enumerate(make_arithmetic_problems(limit, seed=0))]
    if not Path(path).exists():
        raise FileNotFoundError(f"--prompts {path}: not found")
    return [rec.prompt_ids for rec in load_prompts(path, cfg, tokenizer, require_answer=False, limit=limit)]


class _OwnTokens:
    """A teacher engine with another tokenizer, for (c): the student's prompts carried into the teacher's template
    by the probe's CrossTokenizerTeacher, the teacher's samples returned as text re-encoded by the student's
    tokenizer (only their text, length in tokens and stop are read)."""

    def __init__(self, engine: Any, cross: CrossTokenizerTeacher):
        self.engine, self.cross = engine, cross
        self.eos_token_ids = getattr(engine, "eos_token_ids", [])

    def generate(self, prompts: list[list[int]], sp: SamplingParams) -> list[Sample]:
        out = self.engine.generate([self.cross.teacher_prompt(p) for p in prompts], sp)
        for s in out:
            text = self.cross.teacher_tok.decode(list(s.response_ids), skip_special_tokens=True)
            s.response_ids = self.cross.student_tok.encode(text, add_special_tokens=False)
        return out


def _teacher(args: argparse.Namespace, student_eos: list[int]) -> tuple[Teacher, Any]:
    """(scorer, engine for its own samples or None) for --teacher-backend."""
    if args.teacher_backend == "hf":
        scorer = HFTeacher.from_pretrained(args.teacher)
        return scorer, (LocalEngine(scorer.model) if args.teacher_samples else None)
    if args.teacher_backend == "megatron":
        init_parallel(1, 1, backend="gloo" if not torch.cuda.is_available() else "auto", seed=args.seed)
        scorer = make_teacher(TeacherConfig(backend="megatron", hf_path=args.teacher))
        return scorer, (LocalEngine.from_pretrained(args.teacher) if args.teacher_samples else None)
    if not args.teacher_url:
        raise ValueError("--teacher-backend sglang: --teacher-url is required (a running SGLang server)")
    scorer = make_teacher(TeacherConfig(backend="sglang", hf_path=args.teacher, server_url=args.teacher_url,
                                        api_key_env=args.api_key_env), eos_token_ids=None)
    engine = None
    if args.teacher_samples:
        engine = SGLangEngine(args.teacher, mode="server", server_url=args.teacher_url,
                              api_key=api_key_from_env(args.api_key_env))
    return scorer, engine


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatron-opd probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", required=True, help="student HF directory")
    p.add_argument("--teacher", required=True,
                   help="teacher HF directory (with --teacher-backend sglang: its tokenizer and config files)")
    p.add_argument("--prompts", default=None, help="JSONL / Parquet / HF dataset dir with a 'problem' field "
                                                    "(default: the builtin arithmetic problems)")
    p.add_argument("--n", type=int, default=32, help="student samples (prompts are cycled)")
    p.add_argument("--budget", type=int, default=256, help="max new tokens per sample (the run's budget)")
    p.add_argument("--copies", type=int, default=4, help="largest k of (a) and (b)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="the run's rollout.temperature: the student samples at it and is scored at it (pi_old); "
                        "the teacher is scored at 1, as the trainer does")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--margin", type=float, default=0.1,
                   help="nats/token: advantage differences smaller than this do not count for the verdict")
    p.add_argument("--teacher-backend", choices=("hf", "megatron", "sglang"), default="hf")
    p.add_argument("--teacher-url", default=None, help="--teacher-backend sglang: the server's URL")
    p.add_argument("--api-key-env", default="SGLANG_API_KEY", help="env var holding the server's API key")
    p.add_argument("--no-teacher-samples", dest="teacher_samples", action="store_false",
                   help="skip (c) for the teacher (its own samples)")
    p.add_argument("--no-chat-template", action="store_true", help="the run feeds raw prompts (no chat template)")
    p.add_argument("--preflight", choices=("error", "warn"), default="error",
                   help="the pair checks of doctor --pair: error stops on a mismatch, warn prints it and probes "
                        "anyway (an EOS-disagreement pair)")
    p.add_argument("--cross-tokenizer", action="store_true",
                   help="the teacher has another tokenizer (teacher.cross_tokenizer): it scores the student's text in "
                        "its own template and tokens, each chunk's log-prob spread over the student's tokens; (c)'s "
                        "teacher samples are decoded by the teacher's tokenizer")
    p.add_argument("--json", default=None, help="write the report here as JSON")
    args = p.parse_args(argv)
    if not args.temperature > 0:
        print(f"megatron-opd probe: --temperature must be > 0 (a run's rollout.temperature), got {args.temperature}",
              file=sys.stderr)
        return 2
    for role, path in (("--student", args.student), ("--teacher", args.teacher)):
        if not Path(path).is_dir():
            print(f"megatron-opd probe: {role} {path}: not found (expected an HF model directory)", file=sys.stderr)
            return 2
    try:
        pair = (check_cross_pair if args.cross_tokenizer else check_pair)(args.student, args.teacher,
                                                                          chat_template=not args.no_chat_template)
        if pair.errors:
            print(f"student {args.student}\nteacher {args.teacher}\n{pair.render()}\n\n{len(pair.errors)} "
                  "problem(s) (the checks of doctor --pair): the teacher would score mismatched tokens"
                  + ("; probing anyway (--preflight warn)" if args.preflight == "warn" else ""), file=sys.stderr)
            if args.preflight == "error":
                return 1
        torch.manual_seed(args.seed)
        tokenizer = AutoTokenizer.from_pretrained(args.student)
        prompts = load_probe_prompts(args.prompts, tokenizer, args.n, use_chat=not args.no_chat_template)
        engine = LocalEngine.from_pretrained(args.student)
        scorer = HFTeacher(engine.model, eos_token_ids=engine.eos_token_ids, pad_token_id=engine.pad_token_id)
        teacher, teacher_engine = _teacher(args, engine.eos_token_ids)
        if args.cross_tokenizer:
            t_tok = AutoTokenizer.from_pretrained(args.teacher)
            teacher = CrossTokenizerTeacher(teacher, tokenizer, t_tok, chat_template=not args.no_chat_template,
                                            student_eos_ids=engine.eos_token_ids)
            teacher_engine = _OwnTokens(teacher_engine, teacher) if teacher_engine is not None else None
        report = probe(engine, scorer, teacher, tokenizer, prompts, n=args.n, budget=args.budget,
                       copies=args.copies, temperature=args.temperature, seed=args.seed, margin=args.margin,
                       teacher_engine=teacher_engine)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"megatron-opd probe: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"student {args.student}\nteacher {args.teacher} ({args.teacher_backend})\n{render(report)}")
    extra = {}
    if args.cross_tokenizer:
        a = teacher.summary()
        extra["cross_alignment"] = a
        print(f"\nalignment (another tokenizer): {a['coverage']:.3f} of the scored responses' bytes in chunks of <= "
              f"{COVERAGE_MAX_TOKENS} student tokens; {a['chunks']:.0f} chunks over {a['rows']:.0f} scored responses, "
              f"{a['student_tokens_per_chunk']:.2f} student tokens each\n{pair.render()}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"student_path": args.student, "teacher_path": args.teacher,
                                               "teacher_backend": args.teacher_backend, **report.to_json(), **extra},
                                              indent=1, allow_nan=True) + "\n")
    return 0
