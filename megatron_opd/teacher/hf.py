"""HF transformers teacher: forward-only, right-padded micro-batches.

The simplest backend and the reference the Megatron and SGLang teachers are tested against."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoModelForCausalLM

from megatron_opd.rollout.base import eos_ids_from
from megatron_opd.teacher.base import TeacherScore, check_score_inputs, scores_from_logits, validate_scores


class HFTeacher:
    def __init__(self, model: torch.nn.Module, micro_batch_size: int = 8, eos_token_ids: Optional[list[int]] = None,
                 pad_token_id: int = 0, temperature: float = 1.0):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size: must be >= 1, got {micro_batch_size}")
        self.model = model.eval()
        self.micro_batch_size = micro_batch_size
        self.eos_token_ids = sorted(set(eos_token_ids)) if eos_token_ids is not None else eos_ids_from(model)
        self.pad_token_id = pad_token_id
        if not temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        self.temperature = float(temperature)  # log-probs of softmax(logits / temperature)
        self.vocab_size = int(model.config.vocab_size)
        self.topk_id_limit: Optional[int] = None  # teacher/fidelity.py topk_id_limit: ids the student has
        self._device = next(model.parameters()).device

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        **kwargs: Any) -> "HFTeacher":
        p = Path(path)
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"HFTeacher: {p}/config.json not found (expected an HF model directory)")
        kwargs.setdefault("eos_token_ids", eos_ids_from(p))
        return cls(AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype).to(device), **kwargs)

    @torch.no_grad()
    def score(self, prompts: list[list[int]], responses: list[list[int]], top_k: int = 0) -> list[TeacherScore]:
        check_score_inputs(prompts, responses, self.vocab_size, top_k)
        out: list[TeacherScore] = []
        for s in range(0, len(prompts), self.micro_batch_size):
            out.extend(self._score_batch(prompts[s:s + self.micro_batch_size], responses[s:s + self.micro_batch_size],
                                         top_k))
        return validate_scores(out, responses, top_k, source="HFTeacher")

    def _score_batch(self, prompts: list[list[int]], responses: list[list[int]], top_k: int) -> list[TeacherScore]:
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        width = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, x in enumerate(seqs):  # right padding: positions 0..len-1 are the defaults
            ids[i, :len(x)] = torch.tensor(x)
            mask[i, :len(x)] = 1
        logits = self.model(input_ids=ids.to(self._device), attention_mask=mask.to(self._device)).logits
        out = []
        for i, (p, r) in enumerate(zip(prompts, responses)):
            P, T = len(p), len(r)
            rows = logits[i, P - 1:P - 1 + T].cpu()
            if self.temperature != 1.0:
                rows = rows.float() / self.temperature
            out.append(scores_from_logits(rows, torch.tensor(r, dtype=torch.long), top_k,
                                          self.topk_id_limit))
        return out
