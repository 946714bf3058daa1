"""One optimizer step of next-token loss on fixed ids, through megatron's schedule: the step the optimizer and
resume tests (test_gpu_resume_paths, test_lowp_adam) train with. Imported inside a spawned rank."""

from __future__ import annotations

from typing import Any

import torch


def next_token_step(setup: Any, ids: torch.Tensor) -> None:
    """zero grads, forward/backward of -mean log p(ids[t+1] | ids[:t+1]) (log-softmax in fp32), optimizer step."""
    from megatron_opd.models.logprobs import forward_backward, model_vocab_size, vocab_parallel_token_logprobs
    from megatron_opd.models.optimizer import optimizer_step, zero_grads

    def loss_fn(logits, mb):
        logp = vocab_parallel_token_logprobs(logits[:, :-1].float(), mb["input_ids"][:, 1:], None,
                                             vocab_size=model_vocab_size(setup.model.module))
        return -logp.mean(), {}

    zero_grads(setup)
    forward_backward(setup.model, [{"input_ids": ids}], loss_fn)
    optimizer_step(setup)
