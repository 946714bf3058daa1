"""Prompt loading: formats, field mapping, bad-record reporting (file:line), chat templates, golden ids."""

from __future__ import annotations

import json
import logging

import pytest

from megatron_opd.config import DataConfig
from megatron_opd.data.prompts import DataError, iter_rows, load_prompts
from megatron_opd.data.toy_tokenizer import byte_tokenizer

TEMPLATE = "Q: {problem}"


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer(chat_template=True)


@pytest.fixture(scope="module")
def plain_tok():
    return byte_tokenizer(chat_template=False, bos=True)


def cfg(**kw) -> DataConfig:
    base = dict(prompt_template=TEMPLATE, apply_chat_template=False, max_prompt_tokens=64)
    base.update(kw)
    return DataConfig(**base)


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = [
    {"id": "a", "problem": "1+1?", "answer": "2", "solution": "1+1=\\boxed{2}", "level": 1},
    {"id": "b", "problem": "2+2?", "answer": 4, "solution": "\\boxed{4}"},
    {"id": "c", "problem": "half?", "answer": "\\frac{1}{2}"},
]


def test_jsonl_plain_template_ids_and_fields(tmp_path, plain_tok):
    p = write_lines(tmp_path / "m.jsonl", [json.dumps(r) for r in GOOD])
    ps = load_prompts(p, cfg(), plain_tok)
    assert [r.id for r in ps] == ["a", "b", "c"]
    r = ps[0]
    assert r.prompt == "Q: 1+1?"
    # byte tokenizer: BOS (id 1) then one token per UTF-8 byte; decoding returns the exact text
    assert r.prompt_ids[0] == 1 and len(r.prompt_ids) == 1 + len("Q: 1+1?".encode())
    assert plain_tok.decode(r.prompt_ids[1:]) == "Q: 1+1?"
    assert r.answer == "2" and ps[1].answer == "4"  # numeric answers become strings
    assert r.solution_ids[-1] == plain_tok.eos_token_id
    assert plain_tok.decode(r.solution_ids[:-1]) == "1+1=\\boxed{2}"  # no BOS inside the golden turn
    assert ps[2].solution is None and ps[2].solution_ids is None and not ps[2].has_solution
    assert r.meta == {"level": 1} and r.source == f"{p}:1"
    assert ps.bad == []


def test_chat_template_applied_with_generation_prompt(tmp_path, tok):
    p = write_lines(tmp_path / "m.jsonl", [json.dumps(GOOD[0])])
    r = load_prompts(p, cfg(apply_chat_template=True, max_prompt_tokens=512), tok)[0]
    assert r.prompt == "<|im_start|>user\nQ: 1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(r.prompt_ids) == r.prompt
    assert r.prompt_ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2  # no extra BOS added
    # prompt + golden ids = the full conversation as the chat template would render it
    full = tok.apply_chat_template([{"role": "user", "content": "Q: 1+1?"},
                                    {"role": "assistant", "content": "1+1=\\boxed{2}"}], tokenize=False)
    assert tok.decode(r.prompt_ids + r.solution_ids) == full.rstrip("\n")


def test_apply_chat_template_without_template_falls_back_to_plain(tmp_path, plain_tok):
    p = write_lines(tmp_path / "m.jsonl", [json.dumps(GOOD[0])])
    r = load_prompts(p, cfg(apply_chat_template=True), plain_tok)[0]
    assert r.prompt == "Q: 1+1?"


def test_default_template_and_renamed_keys(tmp_path, plain_tok):
    rows = [{"question": "What is 3*3?", "final": "9", "steps": "3*3=9"}]
    p = write_lines(tmp_path / "g.jsonl", [json.dumps(r) for r in rows])
    c = DataConfig(prompt_key="question", answer_key="final", solution_key="steps", apply_chat_template=False)
    r = load_prompts(p, c, plain_tok)[0]
    assert r.prompt == "What is 3*3?\n\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert r.answer == "9" and r.solution == "3*3=9" and r.id == f"{p}:1"


BAD_LINES = [
    json.dumps(GOOD[0]),                                   # 1 ok
    "{not json",                                           # 2 invalid JSON
    json.dumps({"question": "x", "answer": "1"}),          # 3 missing problem
    json.dumps({"problem": "   ", "answer": "1"}),         # 4 empty prompt
    json.dumps({"problem": "y" * 100, "answer": "1"}),     # 5 too long (> 64 tokens)
    "",                                                    # 6 blank: ignored, not an error
    json.dumps({"problem": "ok?", "answer": ""}),          # 7 empty answer
    json.dumps([1, 2]),                                    # 8 not an object
    json.dumps({"problem": 5, "answer": "1"}),             # 9 wrong type
    json.dumps({"problem": "z?"}),                         # 10 missing answer
    '{"problem": "nan?", "answer": NaN}',                  # 11 non-finite answer
    json.dumps(GOOD[1]),                                   # 12 ok
]


def test_bad_records_skipped_with_file_line_reasons(tmp_path, plain_tok, caplog):
    p = write_lines(tmp_path / "math.jsonl", BAD_LINES)
    with caplog.at_level(logging.WARNING):
        ps = load_prompts(p, cfg(), plain_tok)
    assert [r.id for r in ps] == ["a", "b"]
    where = {int(b.split(":")[1]): b for b in ps.bad}
    assert sorted(where) == [2, 3, 4, 5, 7, 8, 9, 10, 11]
    assert "invalid JSON" in where[2]
    assert where[3] == f"{p}:3: missing field 'problem'"
    assert "field 'problem' is empty" in where[4]
    assert "prompt has 104 tokens > data.max_prompt_tokens=64" in where[5]  # BOS + "Q: " + 100 bytes
    assert "field 'answer' is empty" in where[7]
    assert "expected a JSON object, got list" in where[8]
    assert "field 'problem' must be a string, got int" in where[9]
    assert "missing field 'answer'" in where[10]
    assert "not finite" in where[11]
    log = caplog.text
    assert "skipped 9 bad record(s) of 11" in log and f"{p}:2:" in log and "and 4 more" in log


def test_bad_record_error_mode_raises_first_with_location(tmp_path, plain_tok):
    p = write_lines(tmp_path / "math.jsonl", BAD_LINES)
    with pytest.raises(DataError, match=r"math\.jsonl:2: invalid JSON"):
        load_prompts(p, cfg(on_bad_record="error"), plain_tok)


def test_optional_answer_and_required_solution(tmp_path, plain_tok):
    p = write_lines(tmp_path / "m.jsonl", [json.dumps(r) for r in GOOD])
    ps = load_prompts(p, cfg(), plain_tok, require_solution=True)
    assert [r.id for r in ps] == ["a", "b"] and "missing field 'solution'" in ps.bad[0]
    q = write_lines(tmp_path / "q.jsonl", [json.dumps({"problem": "no answer"})])
    assert load_prompts(q, cfg(), plain_tok, require_answer=False)[0].answer is None


def test_list_answers_and_dollar_stripping(tmp_path, plain_tok):
    p = write_lines(tmp_path / "m.jsonl", [json.dumps({"problem": "p", "answer": ["$x=1$", "$y=2$"]}),
                                           json.dumps({"problem": "q", "answer": 70.0})])
    ps = load_prompts(p, cfg(), plain_tok)
    assert ps[0].answer == "x=1, y=2" and ps[1].answer == "70"


def test_template_field_missing_is_reported(tmp_path, plain_tok):
    p = write_lines(tmp_path / "m.jsonl", [json.dumps(GOOD[0])])
    with pytest.raises(DataError, match=r"m\.jsonl:1: data\.prompt_template uses \{topic\}"):
        load_prompts(p, cfg(prompt_template="{topic}: {problem}", on_bad_record="error"), plain_tok)


def test_solution_template_states_the_answer_and_names_a_missing_field(tmp_path, plain_tok):
    """GSM8K-style rationales end in a sentence: the template appends the boxed answer the prompt asks for. The
    default leaves the solution as written; a field the row lacks is that row's error (file:line)."""
    rows = [{"id": "g", "problem": "48 + 24?", "answer": "72", "solution_clean": "48 + 24 = 72 clips."}]
    p = write_lines(tmp_path / "g.jsonl", [json.dumps(r) for r in rows])
    t = "{solution}\nThe answer is $\\boxed{{{answer}}}$."
    [r] = load_prompts(p, cfg(solution_key="solution_clean", solution_template=t), plain_tok)
    assert r.solution == "48 + 24 = 72 clips.\nThe answer is $\\boxed{72}$."
    assert plain_tok.decode(r.solution_ids[:-1]) == r.solution and r.solution_ids[-1] == plain_tok.eos_token_id
    [r] = load_prompts(p, cfg(solution_key="solution_clean"), plain_tok)
    assert r.solution == "48 + 24 = 72 clips."
    with pytest.raises(DataError, match=r"g\.jsonl:1: data\.solution_template uses \{level\}"):
        load_prompts(p, cfg(solution_key="solution_clean", solution_template="{solution} ({level})",
                            on_bad_record="error"), plain_tok)


def test_all_bad_raises(tmp_path, plain_tok):
    p = write_lines(tmp_path / "m.jsonl", ["{bad", "[]"])
    with pytest.raises(DataError, match="no usable records"):
        load_prompts(p, cfg(), plain_tok)


def test_limit_keeps_first_good(tmp_path, plain_tok):
    p = write_lines(tmp_path / "m.jsonl", [json.dumps(r) for r in GOOD])
    assert [r.id for r in load_prompts(p, cfg(), plain_tok, limit=2)] == ["a", "b"]


def test_parquet_and_hf_dir_sources_match_jsonl(tmp_path, plain_tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{k: str(v) for k, v in r.items() if k != "level"} for r in GOOD[:2]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hfds"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "hfdd"))
    jl = load_prompts(write_lines(tmp_path / "m.jsonl", [json.dumps(r) for r in rows]), cfg(), plain_tok)
    for src, kw in ((tmp_path / "m.parquet", {}), (tmp_path / "hfds", {}), (tmp_path / "hfdd", {"split": "test"})):
        ps = load_prompts(src, cfg(), plain_tok, **kw)
        assert [(r.id, r.prompt_ids, r.answer, r.solution_ids) for r in ps] == \
               [(r.id, r.prompt_ids, r.answer, r.solution_ids) for r in jl]
        assert ps[1].source == f"{src}:2"
    with pytest.raises(DataError, match="no split 'train'"):
        load_prompts(tmp_path / "hfdd", cfg(), plain_tok)


def test_missing_and_unsupported_paths(tmp_path, plain_tok):
    with pytest.raises(DataError, match="nope.jsonl: file not found"):
        list(iter_rows(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        list(iter_rows(tmp_path / "x.csv"))
