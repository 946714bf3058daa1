"""A teacher with another tokenizer, on-policy: the student's own response, scored by the teacher in its own tokens.

OPD's signal is per student token, A_t = log pi_T(y_t | prefix) - log pi_old(y_t | prefix), which needs the
teacher to read the student's ids. A teacher with another tokenizer cannot. `CrossTokenizerTeacher` wraps any
teacher (hf, SGLang: the controller backends) and, for each row:

1. **the conversation in the teacher's template.** The user message is recovered from the student's prompt ids
   (the student's template rendered around a marker tells what comes before and after the message) and rendered
   with the teacher's chat template; without chat templates the raw prompt text is tokenized by the teacher;
2. **the response in the teacher's tokens.** The student's response text (its tokens' exact bytes) is tokenized
   by the teacher; the student's EOS, when the response ends with one, becomes the teacher's end of turn (its
   EOS id), scored as a token of its own. Template tokens around the response are context, never scored;
3. **chunks.** The two token sequences are cut into the smallest chunks whose byte boundaries agree (a boundary
   of both tokenizations is a chunk boundary); the EOS pair is a chunk of its own;
4. **the teacher's log-prob per student token.** A chunk's teacher log-prob (the sum over its teacher tokens) is
   spread evenly over its student tokens. So a chunk's advantage, summed over its student tokens, is exactly the
   teacher's chunk log-prob minus the student's, whichever spread is chosen. We spread evenly rather than put
   the chunk on its last token (DPCA, arXiv 2606.09456, assigns credit in closed form within a chunk; AReaL's
   open PR sums per chunk): spread evenly, every student token of a chunk sees the teacher's verdict on the chunk
   at once, the token-level PPO ratio and clip stay as they are, and nothing here needs the student's own
   log-probs, so the teacher contract (log-probs per student token) is unchanged.

A token-for-token teacher reduces to the plain path exactly: a teacher whose tokenizer is the student's (the same
token -> id table) reads the student's own ids (the student's tokenization is one of its own; re-tokenizing the
text could merge tokens the student sampled apart), every chunk is one token on each side, and the spread divides
by 1. Top-k log-probs (the forward-KL golden loss) have no meaning across vocabularies and are refused.

Coverage, reported by `doctor --pair`, `probe` and the trainer (`teacher/cross_coverage`): the fraction of
response bytes that lie in chunks of at most COVERAGE_MAX_TOKENS student tokens: where it is low, the signal is
spread over long chunks and is coarse.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional, Sequence

import torch

from megatron_opd.data.prompts import encode
from megatron_opd.teacher.base import Teacher, TeacherScore, validate_scores

COVERAGE_MAX_TOKENS = 4
_MARKER = "\u2063MEGATRON-OPD-USER-MESSAGE\u2063"


class CrossTokenizerError(ValueError):
    """A prompt or template that cannot be carried into the teacher's tokens; the message says what."""


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character each byte is written as -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
        range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return type(backend.decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(backend.decoder)


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> list[bytes]:
    """The exact bytes of each token of `ids` (special tokens: their text). Byte-level BPE (GPT-2, Qwen, SmolLM2,
    Llama 3): each token string mapped back through the byte alphabet, so a token that holds half a UTF-8
    character holds half its bytes. Other tokenizers: the growth of the decoded prefix, token by token."""
    ids = [int(i) for i in ids]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    if _is_byte_level(tokenizer):
        dec = _byte_decoder()
        out = []
        for i, tok in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
            if i in special or tok is None or any(ch not in dec for ch in tok):
                out.append(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8"))
            else:
                out.append(bytes(dec[ch] for ch in tok))
        return out
    out, prev = [], b""
    for k in range(len(ids)):
        cur = tokenizer.decode(ids[:k + 1], skip_special_tokens=False).encode("utf-8")
        common = 0
        while common < min(len(prev), len(cur)) and prev[common] == cur[common]:
            common += 1
        out.append(cur[len(prev):] if common == len(prev) else cur[common:])
        prev = cur
    return out


@dataclass(frozen=True)
class Chunk:
    """Student tokens [s0, s1) and teacher tokens [t0, t1) covering the same bytes."""

    s0: int
    s1: int
    t0: int
    t1: int
    nbytes: int


def align_chunks(student: Sequence[bytes], teacher: Sequence[bytes]) -> list[Chunk]:
    """The smallest chunks whose byte boundaries agree. The chunks partition both token lists in order. Where the
    two byte strings differ (a response cut inside a UTF-8 character decodes to U+FFFD, which the teacher then
    encodes), the boundaries are taken up to the first differing byte, and the rest of both is one last chunk. A
    chunk with tokens on one side only (possible only there) is merged into the chunk before it."""
    s_cum, t_cum = [0], [0]
    for b in student:
        s_cum.append(s_cum[-1] + len(b))
    for b in teacher:
        t_cum.append(t_cum[-1] + len(b))
    s_all, t_all = b"".join(student), b"".join(teacher)
    same = 0
    while same < min(len(s_all), len(t_all)) and s_all[same] == t_all[same]:
        same += 1
    if len(s_all) != len(t_all):  # the shorter one is a prefix of the other: no boundary at its end is shared
        same = min(same, min(len(s_all), len(t_all)) - 1)
    s_at = {off: i for i, off in enumerate(s_cum)}  # an offset -> the last token ending there (zero-byte tokens
    t_at = {off: j for j, off in enumerate(t_cum)}  # join the chunk before them)
    chunks: list[Chunk] = []
    si = ti = prev = 0
    for off in sorted(o for o in s_at if o in t_at and 0 < o <= same):
        i, j = s_at[off], t_at[off]
        chunks.append(Chunk(si, i, ti, j, off - prev))
        si, ti, prev = i, j, off
    if si < len(student) or ti < len(teacher):
        rest = Chunk(si, len(student), ti, len(teacher), s_cum[-1] - prev)
        if chunks and (rest.s1 == rest.s0 or rest.t1 == rest.t0):
            p = chunks.pop()
            rest = Chunk(p.s0, rest.s1, p.t0, rest.t1, p.nbytes + rest.nbytes)
        chunks.append(rest)
    return chunks


def spread(chunks: Sequence[Chunk], teacher_logprobs: torch.Tensor, n_student: int) -> torch.Tensor:
    """Per student token: its chunk's teacher log-prob (summed over the chunk's teacher tokens, in float64)
    divided by the chunk's student tokens. A chunk without teacher tokens (only when one side is empty) gets 0."""
    out = torch.zeros(n_student, dtype=torch.float32)
    lp = teacher_logprobs.double()
    for c in chunks:
        n = c.s1 - c.s0
        if n:
            out[c.s0:c.s1] = (float(lp[c.t0:c.t1].sum()) / n) if c.t1 > c.t0 else 0.0
    return out


def coverage(chunks: Sequence[Chunk], max_tokens: int = COVERAGE_MAX_TOKENS) -> float:
    """Fraction of the bytes in chunks of at most `max_tokens` student tokens (1.0 for no bytes)."""
    total = sum(c.nbytes for c in chunks)
    return 1.0 if total == 0 else sum(c.nbytes for c in chunks if c.s1 - c.s0 <= max_tokens) / total


def same_tokens(a: Any, b: Any) -> bool:
    """Whether two tokenizers map the same tokens to the same ids (the student's ids are then the teacher's)."""
    return a is b or (len(a) == len(b) and a.get_vocab() == b.get_vocab())


def template_frame(tokenizer: Any) -> tuple[str, str]:
    """(text before, text after) the user message in `tokenizer`'s chat template with the generation prompt."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False,
                                             add_generation_prompt=True)
    if rendered.count(_MARKER) != 1:
        raise CrossTokenizerError("the chat template does not write the user message once, as given")
    before, _, after = rendered.partition(_MARKER)
    return before, after


def end_of_turn_id(tokenizer: Any) -> int:
    """The token the teacher's template closes an assistant turn with, which must be its EOS: the student's EOS is
    scored as this token."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise CrossTokenizerError("the teacher's tokenizer has no eos_token_id")
    reply = "4"
    turn = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": reply}]
    ids = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=False)
    cut = ids.rfind(reply)
    after = encode(tokenizer, ids[cut + len(reply):], add_special_tokens=False) if cut >= 0 else []
    if not after or after[0] != int(eos):
        raise CrossTokenizerError(
            f"the teacher's template closes an assistant turn with {tokenizer.convert_ids_to_tokens(after[:1])} "
            f"where its EOS is {tokenizer.convert_ids_to_tokens([int(eos)])}: the student's EOS has no teacher token")
    return int(eos)


@dataclass
class Aligned:
    """One row carried into the teacher's tokens."""

    prompt_ids: list[int]
    response_ids: list[int]
    chunks: list[Chunk]
    eos: bool


class CrossTokenizerTeacher:
    """`inner` (a teacher that reads `teacher_tokenizer`'s ids) scoring rows given in `student_tokenizer`'s ids;
    see the module docstring. `last_stats` after each call: chunks, coverage, the largest chunk, rows."""

    def __init__(self, inner: Teacher, student_tokenizer: Any, teacher_tokenizer: Any, *, chat_template: bool = True,
                 student_eos_ids: Optional[Sequence[int]] = None):
        self.inner, self.student_tok, self.teacher_tok = inner, student_tokenizer, teacher_tokenizer
        self.chat = chat_template
        self.identical = same_tokens(student_tokenizer, teacher_tokenizer)
        if student_eos_ids is None:
            student_eos_ids = [student_tokenizer.eos_token_id]
        self.student_eos = {int(i) for i in student_eos_ids if i is not None}
        self.eos_token_ids = sorted(self.student_eos)
        self.teacher_eos = end_of_turn_id(teacher_tokenizer) if chat_template else int(teacher_tokenizer.eos_token_id)
        if chat_template:
            self.student_frame = template_frame(student_tokenizer)
            self.teacher_frame = template_frame(teacher_tokenizer)
        self.vocab_size = getattr(inner, "vocab_size", None)
        self.last_stats: dict[str, float] = {}
        self._seen = {"rows": 0, "chunks": 0, "student_tokens": 0, "bytes": 0, "bytes_covered": 0}
        self._prompt_cache: dict[tuple[int, ...], list[int]] = {}

    def user_text(self, prompt_ids: Sequence[int]) -> str:
        """The message the student's prompt ids carry (the raw prompt without chat templates)."""
        text = self.student_tok.decode(list(prompt_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not self.chat:
            bos = getattr(self.student_tok, "bos_token", None)
            return text[len(bos):] if bos and text.startswith(bos) else text
        before, after = self.student_frame
        if not (text.startswith(before) and text.endswith(after)) or len(text) < len(before) + len(after):
            raise CrossTokenizerError(
                f"a prompt is not the student's chat template around one user message (it starts {text[:60]!r}); "
                "a cross-tokenizer teacher re-renders the conversation and needs it")
        return text[len(before):len(text) - len(after)]

    def teacher_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        key = tuple(int(i) for i in prompt_ids)
        if key not in self._prompt_cache:
            if self.identical and (not self.chat or self.student_frame == self.teacher_frame):
                self._prompt_cache[key] = list(key)
            elif self.chat:
                rendered = self.teacher_tok.apply_chat_template(
                    [{"role": "user", "content": self.user_text(key)}], tokenize=False, add_generation_prompt=True)
                self._prompt_cache[key] = encode(self.teacher_tok, rendered, add_special_tokens=False)
            else:
                self._prompt_cache[key] = encode(self.teacher_tok, self.user_text(key), add_special_tokens=True)
        return self._prompt_cache[key]

    def align(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> Aligned:
        resp = [int(i) for i in response_ids]
        eos = bool(resp) and resp[-1] in self.student_eos
        body = resp[:-1] if eos else resp
        s_bytes = token_bytes(self.student_tok, body)
        if self.identical:
            t_body = list(body)
        else:
            text = b"".join(s_bytes).decode("utf-8", errors="replace")
            t_body = encode(self.teacher_tok, text, add_special_tokens=False) if text else []
        chunks = align_chunks(s_bytes, token_bytes(self.teacher_tok, t_body))
        if eos:
            chunks.append(Chunk(len(body), len(body) + 1, len(t_body), len(t_body) + 1, 0))
        return Aligned(self.teacher_prompt(prompt_ids), t_body + ([self.teacher_eos] if eos else []), chunks, eos)

    def score(self, prompts: list[list[int]], responses: list[list[int]], top_k: int = 0) -> list[TeacherScore]:
        if top_k:
            raise ValueError("a cross-tokenizer teacher has no top-k over the student's vocabulary (the forward-KL "
                             "golden loss needs a teacher with the student's tokenizer)")
        rows = [self.align(p, r) for p, r in zip(prompts, responses)]
        scored = self.inner.score([a.prompt_ids for a in rows], [a.response_ids for a in rows])
        out = [TeacherScore(spread(a.chunks, s.logprobs, len(r))) for a, s, r in zip(rows, scored, responses)]
        chunks = [c for a in rows for c in a.chunks]
        nbytes = sum(c.nbytes for c in chunks)
        self.last_stats = {
            "rows": float(len(rows)), "chunks": float(len(chunks)),
            "coverage": coverage(chunks),
            "student_tokens_per_chunk": (sum(c.s1 - c.s0 for c in chunks) / len(chunks)) if chunks else 0.0,
            "max_chunk_tokens": float(max((c.s1 - c.s0 for c in chunks), default=0)),
            "bytes": float(nbytes)}
        small = sum(c.nbytes for c in chunks if c.s1 - c.s0 <= COVERAGE_MAX_TOKENS)
        for k, v in (("rows", len(rows)), ("chunks", len(chunks)), ("student_tokens", sum(c.s1 - c.s0 for c in chunks)),
                     ("bytes", nbytes), ("bytes_covered", small)):
            self._seen[k] += v
        return validate_scores(out, responses, source="CrossTokenizerTeacher")

    def summary(self) -> dict[str, float]:
        """The alignment over every row scored so far: rows, chunks, coverage, student tokens per chunk."""
        n = self._seen
        return {"rows": float(n["rows"]), "chunks": float(n["chunks"]),
                "coverage": n["bytes_covered"] / n["bytes"] if n["bytes"] else 1.0,
                "student_tokens_per_chunk": n["student_tokens"] / n["chunks"] if n["chunks"] else 0.0}


__all__ = ["COVERAGE_MAX_TOKENS", "Aligned", "Chunk", "CrossTokenizerError", "CrossTokenizerTeacher",
           "align_chunks", "coverage", "end_of_turn_id", "same_tokens", "spread", "template_frame", "token_bytes"]
