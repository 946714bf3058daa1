"""A teacher with another tokenizer (teacher/cross_tokenizer.py): byte alignment into chunks, the spread of a
chunk's teacher log-prob, the conversation re-rendered in the teacher's template, and the exact reduction to the
plain path for a token-for-token teacher. Two real `tokenizers` byte-level BPEs stand in for two model families:
the byte tokenizer (every byte a token) and a BPE with merges learned here (tests/test_cross_tokenizer_real.py
runs the same properties on SmolLM2's and Qwen2.5's own tokenizers)."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_opd.data.toy_tokenizer import bpe_tokenizer, byte_tokenizer
from megatron_opd.teacher.base import TeacherScore
from megatron_opd.teacher.cross_tokenizer import (
    Chunk, CrossTokenizerError, CrossTokenizerTeacher, align_chunks, coverage, end_of_turn_id, spread, token_bytes)

CORPUS = ["Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether.\n",
          "Let $x = 5$, then $2x + 3 = 13$, so the answer is $\\boxed{13}$.", "héllo wörld, 日本語のテキスト 🙂\n\n"] * 30
WORDS = ["the", " answer", " is", " $", "\\boxed{", "}", "48", "/2", " = ", "24", " clips", "\n", "\n\n", "日本", "語",
         "🙂", "é", " ", "  ", "x", "+", "Natalia", " sold", "\t", "$$", "ö"]


@pytest.fixture(scope="module")
def toks():
    return byte_tokenizer(), bpe_tokenizer(CORPUS, 400)


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def check_partition(chunks: list[Chunk], s: list[bytes], t: list[bytes]) -> None:
    assert chunks[0].s0 == 0 and chunks[0].t0 == 0 and chunks[-1].s1 == len(s) and chunks[-1].t1 == len(t)
    for a, b in zip(chunks, chunks[1:]):
        assert (a.s1, a.t1) == (b.s0, b.t0)
    for c in chunks:
        assert c.s1 > c.s0 and c.t1 > c.t0
        assert b"".join(s[c.s0:c.s1]) == b"".join(t[c.t0:c.t1])  # the same bytes on both sides
        assert c.nbytes == len(b"".join(s[c.s0:c.s1]))


def test_token_bytes_are_exact_and_chunks_partition_both_sides(toks) -> None:
    byte_tok, bpe = toks
    for text in random_texts(200, 0):
        s_ids, t_ids = byte_tok.encode(text, add_special_tokens=False), bpe.encode(text, add_special_tokens=False)
        s, t = token_bytes(byte_tok, s_ids), token_bytes(bpe, t_ids)
        assert b"".join(s) == b"".join(t) == text.encode()
        chunks = align_chunks(s, t)
        check_partition(chunks, s, t)
        # smallest: no byte offset inside a chunk is a token boundary of both sides
        for c in chunks:
            s_cuts = {sum(map(len, s[c.s0:i])) for i in range(c.s0 + 1, c.s1)}
            t_cuts = {sum(map(len, t[c.t0:j])) for j in range(c.t0 + 1, c.t1)}
            assert not s_cuts & t_cuts


def test_a_token_that_holds_part_of_a_character_keeps_its_bytes(toks) -> None:
    byte_tok, bpe = toks
    ids = byte_tok.encode("🙂", add_special_tokens=False)
    assert len(ids) == 4 and [len(b) for b in token_bytes(byte_tok, ids)] == [1, 1, 1, 1]
    # a response cut inside the emoji: the text decodes to U+FFFD, which the teacher encodes as other bytes
    s = token_bytes(byte_tok, byte_tok.encode("ab 🙂", add_special_tokens=False)[:-2])
    t = token_bytes(bpe, bpe.encode(b"".join(s).decode("utf-8", errors="replace"), add_special_tokens=False))
    chunks = align_chunks(s, t)
    assert chunks[-1].s1 == len(s) and chunks[-1].t1 == len(t) and chunks[0].s0 == 0
    assert all(c.s1 > c.s0 and c.t1 > c.t0 for c in chunks)
    assert b"".join(s[:chunks[-1].s0]) == b"ab "  # everything before the cut character aligned as usual


def test_spread_keeps_each_chunk_sum() -> None:
    chunks = [Chunk(0, 3, 0, 1, 3), Chunk(3, 4, 1, 3, 2), Chunk(4, 5, 3, 4, 1)]
    lp = torch.tensor([-0.9, -0.25, -0.5, -0.125])
    out = spread(chunks, lp, 5)
    assert torch.allclose(out[:3], torch.full((3,), -0.3)) and out[3] == -0.75 and out[4] == -0.125
    for c in chunks:
        assert torch.isclose(out[c.s0:c.s1].double().sum(), lp[c.t0:c.t1].double().sum())
    assert coverage(chunks) == 1.0 and coverage(chunks, max_tokens=2) == 0.5


class Recording:
    """A teacher over the BPE's ids whose log-prob of a token depends on the token and its position only, and
    that records what it was asked to score."""

    def __init__(self, eos: int):
        self.eos_token_ids, self.calls = [eos], []

    def score(self, prompts, responses, top_k=0):
        self.calls.append((prompts, responses))
        return [TeacherScore(torch.tensor([-0.01 * ((7 * i + t) % 13 + 1) for i, t in enumerate(r)])) for r in responses]


def prompt_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def test_the_teacher_scores_the_student_text_in_its_own_template_and_tokens(toks) -> None:
    byte_tok, bpe = toks
    inner = Recording(bpe.eos_token_id)
    teacher = CrossTokenizerTeacher(inner, byte_tok, bpe)
    question, answer = "What is 48/2?", "48/2 = 24 clips, so the answer is $\\boxed{24}$."
    p = prompt_ids(byte_tok, question)
    done = byte_tok.encode(answer, add_special_tokens=False) + [byte_tok.eos_token_id]
    cut = done[:20]  # truncated: no EOS
    scores = teacher.score([p, p], [done, cut])
    [(t_prompts, t_resps)] = inner.calls
    assert t_prompts == [prompt_ids(bpe, question)] * 2  # the conversation rendered by the teacher's template
    assert t_resps[0] == bpe.encode(answer, add_special_tokens=False) + [end_of_turn_id(bpe)]  # EOS -> end of turn
    assert t_resps[1] == bpe.encode(byte_tok.decode(cut), add_special_tokens=False)  # no template token scored
    assert [len(s) for s in scores] == [len(done), len(cut)]
    t_lp = inner.score(t_prompts, t_resps)
    assert torch.isclose(scores[0].logprobs.double().sum(), t_lp[0].logprobs.double().sum())  # sums are kept
    assert scores[0].logprobs[-1] == t_lp[0].logprobs[-1]  # the EOS is a chunk of its own, 1:1
    assert torch.isclose(scores[1].logprobs.double().sum(), t_lp[1].logprobs.double().sum())
    assert teacher.last_stats["rows"] == 2 and 0 < teacher.last_stats["coverage"] <= 1
    with pytest.raises(ValueError, match="top-k"):
        teacher.score([p], [done], top_k=4)
    with pytest.raises(CrossTokenizerError, match="chat template"):
        teacher.score([byte_tok.encode("no template here", add_special_tokens=False)], [done])


def test_a_token_for_token_teacher_gives_exactly_the_plain_log_probs(toks) -> None:
    """Same tokenizer: the student's own ids, however it split the text (here byte by byte where the BPE would
    merge), are what the teacher scores; every chunk is 1:1 and the log-probs are the inner teacher's, bit for
    bit."""
    _, bpe = toks
    inner = Recording(bpe.eos_token_id)
    teacher = CrossTokenizerTeacher(inner, bpe, bpe_tokenizer(CORPUS, 400))
    assert teacher.identical
    rng = random.Random(1)
    prompts, responses = [], []
    for text in random_texts(20, 2):
        ids = [i for ch in text for i in bpe.encode(ch, add_special_tokens=False)]  # a non-canonical split
        prompts.append(prompt_ids(bpe, f"question {rng.randint(0, 9)}"))
        responses.append(ids + ([bpe.eos_token_id] if rng.random() < 0.5 else []))
    got = teacher.score(prompts, responses)
    want = inner.score(prompts, responses)
    assert inner.calls[0] == (prompts, responses)
    for g, w in zip(got, want):
        assert torch.equal(g.logprobs, w.logprobs)
    assert teacher.last_stats["coverage"] == 1.0 and teacher.last_stats["max_chunk_tokens"] == 1


def test_a_template_without_the_teachers_eos_at_the_end_of_a_turn_is_refused(toks) -> None:
    byte_tok, _ = toks
    odd = bpe_tokenizer(CORPUS, 400, template=(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_start|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"))
    with pytest.raises(CrossTokenizerError, match="closes an assistant turn"):
        CrossTokenizerTeacher(Recording(2), byte_tok, odd)
