"""The rollout-engine contract shared by the local engine, SGLang, evaluation and the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    n: int = 1  # samples per prompt
    seed: Optional[int] = None
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the engine's EOS ids


@dataclass
class Sample:
    """One generated response. `logprobs[i]` is the behaviour policy's log-prob of `response_ids[i]`
    (after temperature; the trainer recomputes pi_old itself when it needs exact values)."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS / stop token, included in response_ids) or "length" (truncated)
    weight_version: int = 0  # engine weight version that produced it

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def __len__(self) -> int:
        return len(self.response_ids)


class RolloutEngine(Protocol):
    """Generation backend. Weights arrive HF-named (see models/weight_mapping.py)."""

    eos_token_ids: list[int]
    weight_version: int

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """Returns len(prompts) * sampling.n samples, grouped by prompt in order."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load (a bucket of) HF-named weights; sets weight_version when all buckets are in."""
        ...

    def shutdown(self) -> None: ...
