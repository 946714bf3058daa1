"""Megatron teacher: a forward-only GPTModel with its own TP/PP, loaded from an HF checkpoint.

Every rank of the teacher's model-parallel group calls `score` with the same inputs (SPMD) and gets
the same result back: the last pipeline stage computes the log-probs (vocab-parallel, never
gathering [T, V] logits) and broadcasts them to the other stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from transformers import AutoConfig

from megatron_opd.models.gpt import build_forward_only_model, no_init, resolve_layer_spec
from megatron_opd.models.logprobs import default_tp_group, forward_backward, vocab_parallel_token_logprobs
from megatron_opd.models.packing import budget_groups, pack_groups, packed_inputs
from megatron_opd.models.parallel import is_pipeline_last_stage, model_parallel_coords, pipeline_group
from megatron_opd.models.weight_mapping import SafetensorsReader, load_hf_into_megatron
from megatron_opd.rollout.base import eos_ids_from
from megatron_opd.teacher.base import TeacherScore, check_score_inputs, validate_scores


def vocab_parallel_topk(logits: torch.Tensor, k: int, vocab_size: int, tp_group: Any,
                        id_limit: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k full-vocab log-probs of vocab-sharded logits [N, V/tp] -> (ids [N, k], logprobs [N, k]).
    Each rank proposes its local top-k; the global top-k is among the gathered tp*k candidates.
    Columns at or beyond `vocab_size` (megatron's vocab padding) are excluded: their ids never appear.
    `id_limit` also keeps ids at or beyond it out of the candidates (not out of the normalisation): a
    teacher with more vocab rows than the student must not hand it ids it does not have."""
    limit = vocab_size if id_limit is None else min(vocab_size, id_limit)
    if not 1 <= k <= limit:
        raise ValueError(f"top_k: must be in [1, {limit}] (vocab_size={vocab_size}, id_limit={id_limit}), got {k}")
    x = logits.float()
    size = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    v_local = x.shape[-1]
    start = rank * v_local
    n_valid = max(0, min(v_local, vocab_size - start))
    if n_valid < v_local:
        x = x.clone()
        x[:, n_valid:] = float("-inf")
    m = x.max(dim=-1).values
    if size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    sumexp = (x - m[:, None]).exp().sum(-1)
    if size > 1:
        dist.all_reduce(sumexp, group=tp_group)
    lp = x - (m + sumexp.log())[:, None]
    n_cand = max(0, min(v_local, limit - start))
    if n_cand < v_local:
        lp = lp.clone()
        lp[:, n_cand:] = float("-inf")
    kk = min(k, v_local)
    vals, ids = torch.topk(lp, kk, dim=-1)
    ids = ids + start
    if size > 1:
        all_vals = [torch.empty_like(vals) for _ in range(size)]
        all_ids = [torch.empty_like(ids) for _ in range(size)]
        dist.all_gather(all_vals, vals.contiguous(), group=tp_group)
        dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
        vals, ids = torch.cat(all_vals, -1), torch.cat(all_ids, -1)
    best_vals, pos = torch.topk(vals, k, dim=-1)
    best_ids = ids.gather(-1, pos)
    # A padding column can only win with non-finite logits: report its log-prob as NaN (the trainer
    # then skips the step on every rank) and never hand out its id.
    pad = best_ids >= limit
    return best_ids.masked_fill(pad, 0), best_vals.masked_fill(pad, float("nan"))


class MegatronTeacher:
    """Forward-only megatron teacher; build with `from_hf`. Its layout is megatron's global one (call
    `megatron_opd.models.parallel.init_parallel(tp, pp)` with the teacher's sizes first) or, with
    `layout=make_layout(tp, pp)`, its own over the same ranks as a student laid out differently.
    `score` is collective over the teacher's model-parallel group: its ranks pass the same inputs."""

    def __init__(self, model: torch.nn.Module, hf_config: Any, eos_token_ids: list[int], micro_batch_size: int = 8,
                 pad_token_id: int = 0, layout: Optional[Any] = None, max_tokens: Optional[int] = None,
                 pack: bool = False, thd: bool = False, temperature: float = 1.0):
        if micro_batch_size < 1:
            raise ValueError(f"teacher.micro_batch_size: must be >= 1, got {micro_batch_size}")
        if pack and not max_tokens:
            raise ValueError("MegatronTeacher: pack needs max_tokens (train.max_tokens_per_microbatch)")
        self.model = model
        self.hf_config = hf_config
        self.vocab_size = int(hf_config.vocab_size)
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.micro_batch_size = micro_batch_size
        self.pad_token_id = pad_token_id
        self.topk_id_limit: Optional[int] = None  # teacher/fidelity.py topk_id_limit: ids the student has
        self.layout = layout
        # forwards as the trainer's (train.max_tokens_per_microbatch / pack_sequences): rows grouped by length
        # up to max_tokens padded tokens, or packed into sequences of up to max_tokens (THD on TE, else a mask)
        self.max_tokens, self.pack, self.thd = max_tokens, pack, thd
        if not temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        self.temperature = float(temperature)  # log-probs (and top-k) of softmax(logits / temperature)

    @classmethod
    def from_hf(cls, path: str | Path, micro_batch_size: int = 8, layer_spec: str = "auto",
                params_dtype: Optional[torch.dtype] = None, layout: Optional[Any] = None,
                **kwargs: Any) -> "MegatronTeacher":
        p = Path(path)
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"MegatronTeacher: {p}/config.json not found (expected an HF model directory)")
        cfg = AutoConfig.from_pretrained(str(p))
        if layout is not None:
            tp_rank, tp_size, pp_rank, pp_size = layout.tp_rank, layout.tp, layout.pp_rank, layout.pp
        else:
            tp_rank, tp_size, pp_rank, pp_size = model_parallel_coords()
        model = build_forward_only_model(cfg, layer_spec=layer_spec, params_dtype=params_dtype, layout=layout,
                                         config_overrides=no_init(tp_size))  # every weight loaded below
        load_hf_into_megatron(model, SafetensorsReader(p, dtype=params_dtype), cfg, tp_rank=tp_rank, tp_size=tp_size,
                              pp_rank=pp_rank, pp_size=pp_size, te_names=resolve_layer_spec(layer_spec) == "te",
                              vocab_padded=model.vocab_size, consume=True)
        kwargs.setdefault("eos_token_ids", eos_ids_from(p))
        kwargs.setdefault("thd", resolve_layer_spec(layer_spec) == "te")
        return cls(model, cfg, micro_batch_size=micro_batch_size, layout=layout, **kwargs)

    def _groups(self, lengths: list[int]) -> list[list[int]]:
        rows = list(range(len(lengths)))
        if self.pack:
            return pack_groups(lengths, rows, self.max_tokens)
        if self.max_tokens:
            return budget_groups(lengths, rows, self.max_tokens)
        return [rows[s:s + self.micro_batch_size] for s in range(0, len(rows), self.micro_batch_size)]

    def _micro_batches(self, seqs: list[list[int]], pipelined: bool) -> tuple[list[dict], list[tuple[int, int, int]]]:
        """The forwards' inputs and, per sequence, (micro-batch, row, offset) of its tokens. Under pipeline
        parallelism every micro-batch takes one shape (megatron's schedule exchanges one tensor shape)."""
        lengths = [len(s) for s in seqs]
        groups = self._groups(lengths)
        rows = 1 if self.pack else max(len(g) for g in groups)
        width = max(sum(lengths[i] for i in g) if self.pack else max(lengths[i] for i in g) for g in groups)
        where: list[tuple[int, int, int]] = [(0, 0, 0)] * len(seqs)
        micro = []
        for j, g in enumerate(groups):
            b = rows if pipelined else (1 if self.pack else len(g))
            S = width if pipelined else (sum(lengths[i] for i in g) if self.pack else max(lengths[i] for i in g))
            ids = torch.full((b, S), self.pad_token_id, dtype=torch.long)
            seg = torch.full((b, S), -1, dtype=torch.long)
            pos = torch.zeros((b, S), dtype=torch.long)
            at = 0
            for k, i in enumerate(g):
                n = lengths[i]
                r, o = (0, at) if self.pack else (k, 0)
                ids[r, o:o + n] = torch.tensor(seqs[i])
                seg[r, o:o + n] = k
                pos[r, o:o + n] = torch.arange(n)
                where[i] = (j, r, o)
                at += n
            mb = {"input_ids": ids, "position_ids": pos}
            if self.pack:
                mb.update(packed_inputs(seg, self.thd))
            micro.append(mb)
        return micro, where

    @torch.no_grad()
    def score(self, prompts: list[list[int]], responses: list[list[int]], top_k: int = 0) -> list[TeacherScore]:
        check_score_inputs(prompts, responses, self.vocab_size, top_k)
        n = len(prompts)
        if n == 0:
            return []
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        lay = self.layout
        pp_size = lay.pp if lay is not None else model_parallel_coords()[3]
        device = next(self.model.parameters()).device
        micro, where = self._micro_batches(seqs, pipelined=pp_size > 1)
        for mb in micro:
            mb["input_ids"] = mb["input_ids"].to(device)
            mb["position_ids"] = mb["position_ids"].to(device)
            targets = torch.roll(mb["input_ids"], -1, dims=1)
            targets[:, -1] = 0
            mb["targets"] = targets
        tp_group = (lay.groups.tp if lay.tp > 1 else None) if lay is not None else default_tp_group()
        K = top_k

        def loss_fn(logits: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
            if self.temperature != 1.0:
                logits = logits.float() / self.temperature
            lp = vocab_parallel_token_logprobs(logits, mb["targets"], tp_group, vocab_size=self.vocab_size)
            rep = {"logp": lp.float()}
            if K:
                b, s, v = logits.shape
                tid, tlp = vocab_parallel_topk(logits.reshape(b * s, v), K, self.vocab_size, tp_group,
                                               self.topk_id_limit)
                rep["topk_ids"], rep["topk_lp"] = tid.reshape(b, s, K), tlp.reshape(b, s, K)
            return lp.sum() * 0.0, rep

        reports = forward_backward(self.model, micro, loss_fn, forward_only=True, layout=lay)

        T = max(1, max(len(r) for r in responses))
        logp = torch.zeros(n, T, dtype=torch.float32, device=device)
        topk_ids = torch.zeros(n, T, K, dtype=torch.long, device=device) if K else None
        topk_lp = torch.zeros(n, T, K, dtype=torch.float32, device=device) if K else None
        last = lay.is_last_stage if lay is not None else is_pipeline_last_stage()
        if last:
            if len(reports) != len(micro):
                raise RuntimeError(f"MegatronTeacher: {len(reports)} reports for {len(micro)} micro-batches")
            for i, (p, r) in enumerate(zip(prompts, responses)):
                j, row, o = where[i]
                sl = slice(o + len(p) - 1, o + len(p) - 1 + len(r))
                logp[i, :len(r)] = reports[j]["logp"][row, sl]
                if K:
                    topk_ids[i, :len(r)] = reports[j]["topk_ids"][row, sl]
                    topk_lp[i, :len(r)] = reports[j]["topk_lp"][row, sl]
        if pp_size > 1:
            group = lay.groups.pp if lay is not None else pipeline_group()
            src = dist.get_global_rank(group, pp_size - 1)
            for t in (logp, topk_ids, topk_lp):
                if t is not None:
                    dist.broadcast(t, src=src, group=group)

        out = []
        for i, r in enumerate(responses):
            sc = TeacherScore(logprobs=logp[i, :len(r)].cpu())
            if K:
                sc.topk_ids, sc.topk_logprobs = topk_ids[i, :len(r)].cpu(), topk_lp[i, :len(r)].cpu()
            out.append(sc)
        return validate_scores(out, responses, top_k, source="MegatronTeacher")


__all__ = ["MegatronTeacher", "vocab_parallel_topk"]
