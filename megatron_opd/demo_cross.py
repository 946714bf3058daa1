"""`megatron-opd demo --cross-tokenizer`: on-policy distillation across tokenizers, on real models, in minutes.

SmolLM2-135M-Instruct (49,152 ids) is distilled from Qwen2.5-Coder-0.5B-Instruct (151,936 ids) on GSM8K prompts:
each rollout is decoded, re-rendered in Qwen's chat template, tokenized by Qwen, aligned to the student's tokens
by bytes, and each chunk's teacher log-prob spread over its student tokens (teacher/cross_tokenizer.py). The
demo prints one rollout's alignment (the first chunks, and the EOS chunk) and a table of the steps: the
alignment's coverage, the advantage, both log-probs, length and truncation.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from megatron_opd.config import load_config
from megatron_opd.trainer.logger import read_metrics

TEACHER = "qwen2.5-coder-0.5b-instruct"
TABLE_KEYS = [("teacher/cross_coverage", "coverage"), ("teacher/cross_student_tokens_per_chunk", "student tok/chunk"),
              ("adv/mean", "adv mean"), ("logp/teacher_mean", "logp teacher"), ("logp/student_mean", "logp student"),
              ("rollout/response_len_mean", "length"), ("rollout/truncation_rate", "truncation"),
              ("loss/golden_loss", "golden NLL"), ("time/step_s", "step s")]


def cross_overrides(student: Path, teacher: Path, data: Path, out: Path, steps: int, budget: int) -> list[str]:
    """The demo's setting: stable_opd, 4 GSM8K prompts x 2 rollouts a step, fp32, the teacher on the controller
    (hf backend) through the cross-tokenizer path."""
    return [
        "algo.preset=stable_opd", f"model.hf_path={student}", "model.params_dtype=float32",
        f"teacher.hf_path={teacher}", "teacher.backend=hf", "teacher.cross_tokenizer=true",
        "teacher.params_dtype=float32", f"data.train_path={data}", "data.solution_key=solution_clean",
        "data.solution_template={solution}\nThe answer is $\\boxed{{{answer}}}$.",
        f"train.steps={steps}", "train.prompts_per_step=4", "train.micro_batch_size=8",
        "rollout.n_samples_per_prompt=2",
        f"rollout.max_new_tokens={budget}", "rollout.temperature=1.0", "optim.lr=1e-5", "algo.num_minibatches=1",
        f"logging.out_dir={out}", "logging.sample_every=1", "logging.tensorboard=false",
        f"checkpoint.save_every={steps}", "checkpoint.keep_last=1", "checkpoint.resume=never",
        "checkpoint.export_hf=false", "train.health.text_threshold=2.2"]


def alignment_example(student: Path, teacher: Path, prompt_ids: list[int], response_ids: list[int],
                      n: int = 8) -> str:
    """The first `n` chunks and the last one of a response, student tokens | teacher tokens."""
    from transformers import AutoTokenizer

    from megatron_opd.teacher.cross_tokenizer import CrossTokenizerTeacher

    s_tok, t_tok = AutoTokenizer.from_pretrained(str(student)), AutoTokenizer.from_pretrained(str(teacher))

    class _Nothing:
        eos_token_ids: list[int] = []

    x = CrossTokenizerTeacher(_Nothing(), s_tok, t_tok)
    a = x.align(prompt_ids, response_ids)
    body = response_ids

    def show(tok: Any, ids: list[int]) -> str:
        return " ".join(repr(t) for t in tok.convert_ids_to_tokens(ids)).replace("|", "\\|")

    rows = ["| chunk | student tokens (SmolLM2) | teacher tokens (Qwen2.5) |", "|---|---|---|"]
    picked = list(enumerate(a.chunks))[:n] + ([(len(a.chunks) - 1, a.chunks[-1])] if len(a.chunks) > n else [])
    for i, c in picked:
        rows.append(f"| {i} | {show(s_tok, body[c.s0:c.s1])} | {show(t_tok, a.response_ids[c.t0:c.t1])} |")
    head = (f"teacher prompt: {len(a.prompt_ids)} Qwen tokens (its own template: "
            f"{t_tok.decode(a.prompt_ids[:12])!r}...), never scored; response: {len(body)} student tokens in "
            f"{len(a.chunks)} chunks")
    return head + "\n\n" + "\n".join(rows)


def table(out: Path) -> str:
    rows = [r for r in read_metrics(out) if "adv/mean" in r]
    head = "| step | " + " | ".join(name for _, name in TABLE_KEYS) + " |"
    lines = [head, "|" + "---|" * (len(TABLE_KEYS) + 1)]
    for r in rows:
        vals = [f"{r[k]:.3g}" if isinstance(r.get(k), (int, float)) else "-" for k, _ in TABLE_KEYS]
        lines.append(f"| {r['step']} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def run(out: Path, steps: int, budget: int, data: Path, overrides: list[str]) -> int:
    from megatron_opd.models.pretrained import export_chunked, export_smollm2
    from megatron_opd.trainer.loop import Trainer

    t0 = time.time()
    if not data.is_file():
        print(f"megatron-opd demo --cross-tokenizer: --data {data}: not found (GSM8K train JSONL with problem, "
              "answer and solution_clean)")
        return 2
    try:
        student, teacher = export_smollm2(), export_chunked(TEACHER)
    except (ImportError, FileNotFoundError, ValueError) as e:
        print(f"megatron-opd demo --cross-tokenizer: {e} (`make qwen-models` installs the teacher)")
        return 2
    cfg = load_config(None, cross_overrides(student, teacher, data, out, steps, budget) + list(overrides))
    print(f"[demo] cross-tokenizer: student {student.name} under teacher {teacher.name}, {steps} steps at "
          f"{budget} tokens -> {out}", flush=True)
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines() if line.strip()]
    example = ""
    payload = trainer._last_payload
    if payload:
        first = next(it for it in payload["items"] if not it.is_golden)
        example = alignment_example(student, teacher, list(first.prompt_ids), list(first.response_ids))
        example = f"One rollout of the last step, aligned:\n\n{example}\n\n"
    text = example + table(out)
    (out / "table.md").write_text(text)
    print(f"\n[demo] done in {time.time() - t0:.0f} s ({len(samples)} sample rows logged).\n\n{text}\n"
          f"[demo] table: {out / 'table.md'}")
    return 0
