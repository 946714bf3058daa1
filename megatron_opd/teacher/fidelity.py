"""Student/teacher fidelity preflight: the pair must speak the same tokens before any GPU-hour is spent.

OPD compares two models token by token, so everything that maps text to ids must agree: the
token -> id table on the shared range, the special tokens, the chat template (the teacher scores the
student's prompt as its own), the end-of-sequence ids (a student that stops on a token the teacher never
ends with gets a meaningless EOS advantage and learns to run on: length inflation), and the token the
golden solutions end with (it must be one the rollout stops on). Padded vocabularies differ even within a
family (Qwen2.5-1.5B has 151,936 rows, Qwen2.5-7B 152,064, for one 151,665-token tokenizer): that is
reported, not an error. Our choice: each model's log-softmax runs over its own rows (the padding rows are
never trained, so their mass is negligible for trained checkpoints), and teacher top-k candidates are
restricted to the ids both models and the tokenizer have (`topk_id_limit`).

`check_pair` reads tokenizers and configs only (seconds, no weights); `megatron-opd doctor --pair` prints
it and the trainer runs it at start (``teacher.preflight``). With a teacher server, `doctor --pair ...
--teacher-url URL` also compares the served teacher's log-probs with the in-process one on a probe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from transformers import AutoConfig, AutoTokenizer

from megatron_opd.data.prompts import encode, eos_id, has_chat_template, tokenize_prompt
from megatron_opd.rollout.base import eos_ids_from
from megatron_opd.teacher.hf import HFTeacher
from megatron_opd.teacher.sglang import SGLangTeacher

Level = Literal["ok", "info", "warn", "error"]
PROBE_MESSAGES = [{"role": "user", "content": "What is 1 + 1? Put the answer in \\boxed{}."}]
PROBE_REPLY = "1 + 1 = 2, so the answer is $\\boxed{2}$."


class PairMismatchError(ValueError):
    """The student and teacher (or the rollout engine, or the golden data) disagree on tokens; the message
    names what differs."""


@dataclass(frozen=True)
class Finding:
    check: str
    level: Level
    message: str


@dataclass
class PairReport:
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warn"]

    def render(self) -> str:
        return "\n".join(f"  [{f.level:5s}] {f.check}: {f.message}" for f in self.findings)

    def raise_for_errors(self) -> None:
        if self.errors:
            raise PairMismatchError("student/teacher pair: " + "; ".join(f"{f.check}: {f.message}" for f in self.errors))


def _token(tok: Any, i: Optional[int]) -> str:
    return "None" if i is None else repr(tok.convert_ids_to_tokens(int(i)))


def compare_tokenizers(student: Any, teacher: Any) -> list[Finding]:
    """Identical token -> id mapping on the shared id range, and the same special tokens."""
    out: list[Finding] = []
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    s_ids = {i: t for t, i in s_vocab.items()}
    t_ids = {i: t for t, i in t_vocab.items()}
    shared = sorted(set(s_ids) & set(t_ids))
    differ = [i for i in shared if s_ids[i] != t_ids[i]]
    if differ:
        i = differ[0]
        out.append(Finding("tokenizer", "error", f"{len(differ)} of {len(shared)} shared ids map to different "
                           f"tokens; first: id {i} is {s_ids[i]!r} for the student, {t_ids[i]!r} for the teacher"))
    else:
        out.append(Finding("tokenizer", "ok", f"{len(shared)} shared ids map to the same tokens"))
    only_s, only_t = sorted(set(s_ids) - set(t_ids)), sorted(set(t_ids) - set(s_ids))
    if only_s:
        out.append(Finding("tokenizer", "error", f"the student has {len(only_s)} ids the teacher lacks "
                           f"(first: {only_s[0]} = {s_ids[only_s[0]]!r}): the teacher cannot score them"))
    if only_t:
        out.append(Finding("tokenizer", "info", f"the teacher has {len(only_t)} ids the student lacks "
                           f"(first: {only_t[0]}); the student never emits them"))
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        s_tok, t_tok = getattr(student, name, None), getattr(teacher, name, None)
        s_id, t_id = getattr(student, name + "_id", None), getattr(teacher, name + "_id", None)
        if (s_tok, s_id) == (t_tok, t_id):
            continue
        level: Level = "error" if name in ("eos_token", "bos_token") else "warn"
        out.append(Finding("special_tokens", level, f"{name}: student {s_tok!r} (id {s_id}) vs teacher "
                           f"{t_tok!r} (id {t_id})"))
    s_added, t_added = student.get_added_vocab(), teacher.get_added_vocab()
    diff = sorted(k for k in set(s_added) | set(t_added) if s_added.get(k) != t_added.get(k))
    if diff:
        k = diff[0]
        out.append(Finding("special_tokens", "error", f"{len(diff)} added/special tokens differ; first: {k!r} is "
                           f"id {s_added.get(k)} for the student, {t_added.get(k)} for the teacher"))
    elif not any(f.check == "special_tokens" for f in out):
        out.append(Finding("special_tokens", "ok", f"same eos/bos/pad/unk and {len(s_added)} added tokens"))
    return out


def _render(tok: Any, messages: list[dict], generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def compare_chat_templates(student: Any, teacher: Any, required: bool = True) -> list[Finding]:
    """The same prompt and the same assistant turn, token for token, under both chat templates."""
    s_has, t_has = bool(getattr(student, "chat_template", None)), bool(getattr(teacher, "chat_template", None))
    if not s_has and not t_has:
        return [Finding("chat_template", "info", "neither tokenizer has a chat template (raw prompts)")]
    if s_has != t_has:
        who = "student" if s_has else "teacher"
        return [Finding("chat_template", "error" if required else "warn",
                        f"only the {who} has a chat template: the other model would score prompts in a format it "
                        "was not trained on")]
    for label, messages, gen in (("prompt", PROBE_MESSAGES, True),
                                 ("assistant turn", PROBE_MESSAGES + [{"role": "assistant", "content": PROBE_REPLY}],
                                  False)):
        s_ids, t_ids = _render(student, messages, gen), _render(teacher, messages, gen)
        if s_ids != t_ids:
            pos = next((i for i, (a, b) in enumerate(zip(s_ids, t_ids)) if a != b), min(len(s_ids), len(t_ids)))
            s_at = s_ids[pos] if pos < len(s_ids) else None
            t_at = t_ids[pos] if pos < len(t_ids) else None
            return [Finding("chat_template", "error", f"the {label} of a probe conversation differs at token {pos}: "
                            f"student id {s_at} {_token(student, s_at)}, teacher id {t_at} {_token(teacher, t_at)}")]
    return [Finding("chat_template", "ok", "the probe conversation renders to the same ids")]


def compare_stops(student_eos: list[int], teacher_eos: list[int], golden_end: Optional[int], tokenizer: Any,
                  engine_eos: Optional[list[int]] = None) -> list[Finding]:
    """EOS ids of student, teacher and rollout engine agree, and golden solutions end with one of them."""
    out: list[Finding] = []
    names = lambda ids: ", ".join(f"{i} {_token(tokenizer, i)}" for i in ids)  # noqa: E731
    if set(student_eos) != set(teacher_eos):
        out.append(Finding("eos", "error", f"EOS ids differ: student [{names(student_eos)}] vs teacher "
                           f"[{names(teacher_eos)}]"))
    else:
        out.append(Finding("eos", "ok", f"student and teacher stop on [{names(student_eos)}]"))
    if engine_eos is not None and set(engine_eos) != set(student_eos):
        out.append(Finding("eos", "error", f"the rollout engine stops on [{names(engine_eos)}], the student's "
                           f"config on [{names(student_eos)}]"))
    if golden_end is not None and golden_end not in student_eos:
        out.append(Finding("golden_end", "error", f"golden solutions end with id {golden_end} "
                           f"{_token(tokenizer, golden_end)} (tokenizer.eos_token), which the student's rollouts do "
                           f"not stop on ([{names(student_eos)}]): set generation_config.eos_token_id to include it"))
    elif golden_end is not None:
        out.append(Finding("golden_end", "ok", f"golden solutions end with {golden_end} {_token(tokenizer, golden_end)}"))
    return out


def topk_id_limit(student_vocab: int, teacher_vocab: int, n_tokens: int) -> int:
    """Teacher top-k candidates must be ids every side has: below both models' rows and the tokenizer."""
    return min(student_vocab, teacher_vocab, n_tokens)


def compare_vocab(student_vocab: int, teacher_vocab: int, n_tokens: int) -> list[Finding]:
    """Model vocab rows against the tokenizer: padding is reported, a tokenizer larger than a model is an error."""
    out: list[Finding] = []
    for who, rows in (("student", student_vocab), ("teacher", teacher_vocab)):
        if rows < n_tokens:
            out.append(Finding("vocab", "error", f"the {who} has {rows} vocab rows for a {n_tokens}-token tokenizer: "
                               "ids beyond its rows cannot be scored"))
    if not out:
        if student_vocab == teacher_vocab:
            msg = f"both models have {student_vocab} vocab rows for {n_tokens} tokenizer ids"
        else:
            msg = (f"padded vocab differs: student {student_vocab} rows, teacher {teacher_vocab}, for {n_tokens} "
                   f"tokenizer ids; each log-softmax runs over its own rows, teacher top-k is restricted to ids < "
                   f"{topk_id_limit(student_vocab, teacher_vocab, n_tokens)}")
        out.append(Finding("vocab", "ok" if student_vocab == teacher_vocab else "info", msg))
    return out


def probe_ids(tokenizer: Any, chat_template: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of the probe conversation, as the trainer would tokenize them."""
    _, prompt = tokenize_prompt(PROBE_MESSAGES[0]["content"], tokenizer, chat_template and has_chat_template(tokenizer))
    return prompt, encode(tokenizer, PROBE_REPLY, add_special_tokens=False)


def compare_teacher_server(teacher: Union[str, Path], url: str, tokenizer: Any, api_key: Optional[str] = None,
                           max_absdiff: float = 0.1, chat_template: bool = True) -> list[Finding]:
    """The served teacher's log-probs against the in-process reference (HF, which the megatron teacher
    matches to 1e-4 in the tests) on the probe tokens: engine version, dtype or checkpoint drift."""
    prompt, response = probe_ids(tokenizer, chat_template)
    local = HFTeacher.from_pretrained(teacher).score([prompt], [response])[0].logprobs
    served = SGLangTeacher(url, eos_token_ids=eos_ids_from(teacher), api_key=api_key, retries=1).score(
        [prompt], [response])[0].logprobs
    diff = (local.double() - served.double()).abs()
    mean, worst = float(diff.mean()), float(diff.max())
    msg = (f"server {url} vs in-process teacher on {len(response)} probe tokens: mean |diff| {mean:.3g}, "
           f"max {worst:.3g} (threshold {max_absdiff})")
    return [Finding("teacher_server", "ok" if mean <= max_absdiff else "error", msg)]


def check_pair(student: Union[str, Path], teacher: Union[str, Path], engine_eos: Optional[list[int]] = None,
               chat_template: bool = True) -> PairReport:
    """All the tokenizer/config checks for two HF model directories (tokenizer + config files only)."""
    s_tok, t_tok = AutoTokenizer.from_pretrained(str(student)), AutoTokenizer.from_pretrained(str(teacher))
    s_cfg, t_cfg = AutoConfig.from_pretrained(str(student)), AutoConfig.from_pretrained(str(teacher))
    report = PairReport(compare_tokenizers(s_tok, t_tok))
    report.findings += compare_vocab(int(s_cfg.vocab_size), int(t_cfg.vocab_size), len(s_tok))
    if chat_template:
        report.findings += compare_chat_templates(s_tok, t_tok)
    golden = eos_id(s_tok) if getattr(s_tok, "eos_token_id", None) is not None else None
    report.findings += compare_stops(eos_ids_from(student), eos_ids_from(teacher), golden, s_tok, engine_eos)
    return report


CROSS_PROBE_TEXTS = [PROBE_REPLY,
                     "Natalia sold 48/2 = 24 clips in May.\nShe sold 48 + 24 = 72 clips in all.\n\n#### 72",
                     "Let $f(x) = x^2 - 3x + 2$. Then $f(x) = (x - 1)(x - 2)$, so the roots are $1$ and $2$."]


def check_cross_pair(student: Union[str, Path], teacher: Union[str, Path], chat_template: bool = True,
                     s_tok: Any = None, t_tok: Any = None) -> PairReport:
    """The checks for a teacher with another tokenizer (teacher/cross_tokenizer.py): both chat templates render
    a user message once and as given, the teacher's template ends an assistant turn with its EOS (the student's
    EOS is scored as it), the student has an EOS, and the alignment's coverage on a few math texts (the fraction
    of bytes in chunks of <= COVERAGE_MAX_TOKENS student tokens), reported."""
    from megatron_opd.teacher.cross_tokenizer import (COVERAGE_MAX_TOKENS, CrossTokenizerError, align_chunks,
                                                      coverage, end_of_turn_id, same_tokens, template_frame,
                                                      token_bytes)

    s_tok = s_tok or AutoTokenizer.from_pretrained(str(student))
    t_tok = t_tok or AutoTokenizer.from_pretrained(str(teacher))
    out: list[Finding] = []
    if same_tokens(s_tok, t_tok):
        out.append(Finding("cross_tokenizer", "info", "the tokenizers are the same (token -> id): the teacher reads "
                                                      "the student's ids and cross_tokenizer changes nothing"))
    if getattr(s_tok, "eos_token_id", None) is None:
        out.append(Finding("student_eos", "error", "the student's tokenizer has no eos_token_id"))
    for role, tok in (("student", s_tok), ("teacher", t_tok)):
        if not chat_template:
            break
        if not has_chat_template(tok):
            out.append(Finding(f"{role}_template", "error", f"the {role}'s tokenizer has no chat template to render "
                                                             "the conversation with (data.apply_chat_template)"))
            continue
        try:
            template_frame(tok)
        except Exception as e:  # a template that raises on a plain conversation cannot be rendered
            out.append(Finding(f"{role}_template", "error", f"cannot render a conversation: {e}"))
    if chat_template and not any(f.check == "teacher_template" for f in out):
        try:
            eot = end_of_turn_id(t_tok)
            out.append(Finding("end_of_turn", "ok", f"the student's EOS {_token(s_tok, s_tok.eos_token_id)} is scored "
                                                    f"as the teacher's end of turn {_token(t_tok, eot)}"))
        except CrossTokenizerError as e:
            out.append(Finding("end_of_turn", "error", str(e)))
        except Exception as e:  # the template raised on a user + assistant conversation
            out.append(Finding("teacher_template", "error", f"cannot render an assistant turn: {e}"))
    chunks = []
    for text in CROSS_PROBE_TEXTS:
        s_ids, t_ids = encode(s_tok, text, add_special_tokens=False), encode(t_tok, text, add_special_tokens=False)
        chunks += align_chunks(token_bytes(s_tok, s_ids), token_bytes(t_tok, t_ids))
    cov = coverage(chunks)
    out.append(Finding("coverage", "ok" if cov >= 0.5 else "warn",
                       f"{cov:.3f} of the probe texts' bytes lie in chunks of <= {COVERAGE_MAX_TOKENS} student tokens "
                       f"({len(chunks)} chunks, {sum(c.s1 - c.s0 for c in chunks) / max(len(chunks), 1):.2f} student "
                       f"tokens each)"))
    return PairReport(out)


__all__ = ["Finding", "PairMismatchError", "PairReport", "check_cross_pair", "check_pair", "compare_chat_templates", "compare_stops",
           "compare_teacher_server", "probe_ids",
           "compare_tokenizers", "compare_vocab", "topk_id_limit"]
