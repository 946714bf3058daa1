"""Shared by the trainer tests: tiny random student/teacher (byte tokenizer) plus the builtin
arithmetic data, and a whole training run for `run_distributed`."""

from __future__ import annotations

from pathlib import Path


def tiny_setup(root: Path, n_train: int = 24, n_eval: int = 4) -> tuple[Path, Path, Path, dict[str, Path]]:
    """(root, student dir, teacher dir, {"train": jsonl, "eval": jsonl}) under `root`."""
    from megatron_opd.data.builtin.arithmetic import write_builtin_jsonl
    from megatron_opd.demo import _tiny_models

    student, teacher = _tiny_models(root / "models")
    return root, student, teacher, write_builtin_jsonl(root / "data", n_train=n_train, n_eval=n_eval)


def train(cfg, stop_after=None):
    """A whole `Trainer.train()` in this process (optionally stopping after step `stop_after`, as a killed run
    would); returns the closed trainer."""
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.train(stop_after=stop_after)
    finally:
        trainer.close()
    return trainer


def train_to_end(rank: int, world_size: int, overrides: list[str]) -> int:
    """A whole `Trainer.train()` from config overrides (a `run_distributed` target); returns the last step."""
    from megatron_opd.config import load_config
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer.step
