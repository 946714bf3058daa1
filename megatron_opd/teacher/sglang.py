"""SGLang teacher: prefill-only scoring over HTTP (/generate with max_new_tokens=0, return_logprob).

The request asks for input log-probs from the last prompt token on (`logprob_start_len = P - 1`) and
the client keeps the last T entries. Every kept entry carries the token id SGLang scored, and it must
equal the response token at that position: any off-by-one in the server's indexing fails loudly here.

Upstream bug handled here: SGLang (0.5.23; `managers/scheduler_components/logprob_result_processor.py`,
`x if x < self.model_config.vocab_size - 1 else 0`, meant to clip padded multimodal hash ids) reports the
*last* vocabulary id V-1 as token 0 in `input_token_logprobs`; the log-prob value itself is that of V-1.
So at a position whose response token is exactly V-1 (V = the served model's config.vocab_size, passed as
`vocab_size`), a reported id of 0 is accepted as V-1; everywhere else ids must match exactly.

A teacher given by URL (no process to watch) is asked with retries: connection errors, timeouts and
HTTP 5xx are retried `retries` times with exponential backoff, then ServerError names the URL and the
attempt count. `api_key` (SGLang's --api-key) is sent as `Authorization: Bearer <key>`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_opd.rollout.server import ServerProcess, http_json_retry
from megatron_opd.teacher.base import TeacherScore, TeacherScoreError, check_score_inputs, validate_scores


class SGLangTeacher:
    def __init__(self, server: str | ServerProcess, eos_token_ids: list[int], micro_batch_size: int = 32,
                 timeout: float = 600.0, vocab_size: Optional[int] = None, api_key: Optional[str] = None,
                 retries: int = 4, backoff: float = 1.0):
        if server is None or (isinstance(server, str) and not server.strip()):
            raise ValueError("SGLangTeacher: no server (set teacher.server_url, e.g. http://host:30001)")
        self.server = server if isinstance(server, ServerProcess) else None
        self.url = server.url if isinstance(server, ServerProcess) else str(server).rstrip("/")
        if self.server is not None and api_key is not None:
            self.server.api_key = api_key
        self.api_key = api_key if self.server is None else self.server.api_key
        self.retries, self.backoff = retries, backoff
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.micro_batch_size = micro_batch_size
        self.timeout = timeout
        self.vocab_size = vocab_size

    def _post(self, payload: dict) -> Any:
        if self.server is not None:
            return self.server.request("/generate", payload, timeout=self.timeout)
        return http_json_retry(self.url + "/generate", payload, timeout=self.timeout, retries=self.retries,
                               backoff=self.backoff, api_key=self.api_key, what="SGLang teacher")

    def score(self, prompts: list[list[int]], responses: list[list[int]], top_k: int = 0) -> list[TeacherScore]:
        check_score_inputs(prompts, responses, self.vocab_size, top_k)
        scores: list[Optional[TeacherScore]] = [None] * len(prompts)
        todo = [i for i, r in enumerate(responses) if len(r) > 0]
        for i, r in enumerate(responses):
            if not r:
                scores[i] = _empty(top_k)
        for s in range(0, len(todo), self.micro_batch_size):
            idx = todo[s:s + self.micro_batch_size]
            payload: dict[str, Any] = {
                "input_ids": [list(prompts[i]) + list(responses[i]) for i in idx],
                "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                "return_logprob": True,
                "logprob_start_len": [len(prompts[i]) - 1 for i in idx],
            }
            if top_k > 0:
                payload["top_logprobs_num"] = top_k
            outs = self._post(payload)
            if not isinstance(outs, list) or len(outs) != len(idx):
                raise TeacherScoreError(f"SGLang teacher: {len(outs) if isinstance(outs, list) else 'non-list'} "
                                        f"results for {len(idx)} requests")
            for i, out in zip(idx, outs):
                scores[i] = parse_prefill(out, responses[i], top_k, i, vocab_size=self.vocab_size)
        return validate_scores(scores, responses, top_k, source="SGLangTeacher")  # type: ignore[arg-type]


def _empty(top_k: int) -> TeacherScore:
    return TeacherScore(torch.zeros(0), torch.zeros(0, top_k, dtype=torch.long) if top_k else None,
                        torch.zeros(0, top_k) if top_k else None)


def parse_prefill(out: dict, response: list[int], top_k: int, index: int,
                  vocab_size: Optional[int] = None) -> TeacherScore:
    """Last len(response) entries of meta_info.input_token_logprobs ([logprob, token_id, text]) ->
    TeacherScore, checking token ids; input_top_logprobs gives [[logprob, id, text] * K] per position.
    With `vocab_size` V, a reported id 0 where the response token is V-1 is accepted (SGLang's label bug,
    see the module docstring)."""
    meta = out.get("meta_info", {})
    entries = meta.get("input_token_logprobs") or []
    T = len(response)
    if len(entries) < T:
        raise TeacherScoreError(f"SGLang teacher: sample {index}: {len(entries)} input log-probs for {T} response tokens")
    tail = entries[-T:]
    last = vocab_size - 1 if vocab_size else None
    ids = [last if (e[1] == 0 and r == last) else e[1] for e, r in zip(tail, response)]
    if ids != list(response):
        j = next(k for k, (a, b) in enumerate(zip(ids, response)) if a != b)
        raise TeacherScoreError(f"SGLang teacher: sample {index}: scored token {ids[j]} at response position {j}, "
                                f"expected {response[j]} (misaligned logprob_start_len?)")
    if any(e[0] is None for e in tail):
        raise TeacherScoreError(f"SGLang teacher: sample {index}: missing (None) log-prob in the response span")
    score = TeacherScore(logprobs=torch.tensor([float(e[0]) for e in tail], dtype=torch.float32))
    if top_k > 0:
        tops = (meta.get("input_top_logprobs") or [])[-T:]
        if len(tops) != T or any(t is None or len(t) < top_k for t in tops):
            raise TeacherScoreError(f"SGLang teacher: sample {index}: input_top_logprobs missing or shorter than "
                                    f"top_k={top_k}")
        score.topk_logprobs = torch.tensor([[float(x[0]) for x in t[:top_k]] for t in tops], dtype=torch.float32)
        score.topk_ids = torch.tensor([[int(x[1]) for x in t[:top_k]] for t in tops], dtype=torch.long)
    return score
