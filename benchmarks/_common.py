"""Helpers the benchmark scripts share: this process's memory from /proc, a free port, the trainer
overrides every step benchmark starts from (one student/teacher pair, local engine, no logging or
checkpoint side work), so the scripts measure the same setting."""

from __future__ import annotations

import socket
from pathlib import Path

from megatron_opd.trainer.hostmem import proc_status_kb  # noqa: F401 - the scripts import it from here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_overrides(preset: str, student: str | Path, teacher: str | Path, data: str | Path, out: str | Path, *,
                   steps: int, prompts: int, samples: int, new_tokens: int, micro_batch_size: int) -> list[str]:
    """A training run that only steps: megatron teacher in the student's layout, local rollout engine at
    temperature 1, lr 1e-5, one minibatch, no tensorboard, progress bar, samples or checkpoints."""
    return [
        f"algo.preset={preset}", f"model.hf_path={student}", f"teacher.hf_path={teacher}",
        "teacher.backend=megatron", "rollout.backend=local", f"data.train_path={data}", f"train.steps={steps}",
        f"train.prompts_per_step={prompts}", f"rollout.n_samples_per_prompt={samples}",
        f"rollout.max_new_tokens={new_tokens}", "rollout.temperature=1.0", f"train.micro_batch_size={micro_batch_size}",
        "optim.lr=1e-5", "optim.clip_grad=1.0", "algo.num_minibatches=1", f"logging.out_dir={out}",
        "logging.tensorboard=false", "logging.progress_bar=false", "logging.sample_every=0",
        "checkpoint.save_every=100000", "checkpoint.resume=never",
    ]
