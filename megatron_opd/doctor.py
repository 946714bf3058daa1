"""`megatron-opd doctor`: what this machine can run, so users learn it before a job fails at step 0."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import platform
import sys
from pathlib import Path


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def report() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in ("torch", "megatron-core", "transformers", "transformer-engine", "sglang", "math-verify",
                 "tensorboard", "nvidia-ml-py", "datasets"):
        out[dist] = _version(dist)
    try:
        import torch

        out["cuda"] = f"{torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "none (CPU mode: gloo, local layer spec)"
    except ImportError:
        out["cuda"] = "torch missing"
    try:
        importlib.import_module("megatron.core")
        out["megatron.core import"] = "ok"
    except Exception as e:  # noqa: BLE001 - report any import failure verbatim
        out["megatron.core import"] = f"FAILED: {e}"
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatron-opd doctor", description=__doc__)
    p.add_argument("--pair", nargs=2, metavar=("STUDENT", "TEACHER"), default=None,
                   help="check a student/teacher pair of HF directories (tokenizers, special tokens, chat template, "
                        "EOS ids, golden end token, vocab padding); exit 1 if they disagree")
    p.add_argument("--no-chat-template", action="store_true", help="the run feeds raw prompts (no chat template)")
    p.add_argument("--cross-tokenizer", action="store_true",
                   help="with --pair: the teacher has another tokenizer (teacher.cross_tokenizer): check that both chat "
                        "templates render and the teacher ends a turn with its EOS, and report the alignment's coverage")
    p.add_argument("--teacher-url", default=None,
                   help="with --pair: also score a probe with this SGLang teacher server and with TEACHER in-process "
                        "(HF, on this machine) and compare the log-probs")
    p.add_argument("--api-key-env", default="SGLANG_API_KEY", help="env var holding the server's API key")
    p.add_argument("--max-logp-absdiff", type=float, default=0.1,
                   help="--teacher-url: the largest mean |log-prob difference| accepted")
    args = p.parse_args(argv)
    if args.pair is None:
        for k, v in report().items():
            print(f"{k:22s} {v}")
        return 0
    from transformers import AutoTokenizer

    from megatron_opd.rollout.server import api_key_from_env
    from megatron_opd.teacher.fidelity import check_cross_pair, check_pair, compare_teacher_server

    student, teacher = args.pair
    for role, path in (("STUDENT", student), ("TEACHER", teacher)):
        if not Path(path).is_dir():  # else transformers reads it as a hub id and says so
            print(f"megatron-opd doctor: --pair: {role} {path}: not found (expected an HF model directory)",
                  file=sys.stderr)
            return 2
    if args.cross_tokenizer and args.teacher_url:
        print("megatron-opd doctor: --teacher-url compares a served teacher token for token with the in-process one; "
              "not with --cross-tokenizer", file=sys.stderr)
        return 2
    try:
        pair = (check_cross_pair if args.cross_tokenizer else check_pair)(student, teacher,
                                                                          chat_template=not args.no_chat_template)
        if args.teacher_url:
            pair.findings += compare_teacher_server(
                teacher, args.teacher_url, AutoTokenizer.from_pretrained(student), api_key_from_env(args.api_key_env),
                args.max_logp_absdiff, chat_template=not args.no_chat_template)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"megatron-opd doctor: --pair: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"student {student}\nteacher {teacher}\n{pair.render()}")
    if pair.errors:
        print(f"\n{len(pair.errors)} problem(s): this pair would train on mismatched tokens", file=sys.stderr)
        return 1
    return 0
