"""Turn rollouts and golden solutions into the padded tensors the model and the objective consume.

Sequences are prompt+response, right-padded: under a causal mask real tokens never attend to the
padding after them, so no padding mask is needed for the forward. Per-token quantities live in the
response layout `[B, T]` of docs/design.md; `response_index[b, t]` is the position in the full
sequence whose next-token prediction scores response token t.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_opd.models.packing import budget_groups, pack_groups, round_up


@dataclass
class SequenceItem:
    prompt_ids: list[int]
    response_ids: list[int]
    is_golden: bool = False
    truncated: bool = False
    behaviour_logprobs: Optional[list[float]] = None
    prompt_index: int = -1
    teacher: str = ""  # the routed teacher's name (PromptRecord.teacher; "": the only one)


@dataclass
class TrainBatch:
    tokens: torch.Tensor  # [B, L] prompt + response, right padded with pad_id
    position_ids: torch.Tensor  # [B, L]
    response_index: torch.Tensor  # [B, T] index into the [B, L-1] next-token log-prob grid
    response_ids: torch.Tensor  # [B, T]
    response_mask: torch.Tensor  # [B, T] bool
    is_golden: torch.Tensor  # [B] bool
    truncated: torch.Tensor  # [B] bool
    behaviour_logp: Optional[torch.Tensor] = None  # [B, T] from the rollout engine (rollout rows only)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # [B, T, ...]: teacher_logp, ref_logp, old_logp ...
    ref_logits: Optional[torch.Tensor] = None  # [N, V/tp] reference logits of the N valid tokens (full KL;
    # model dtype, set on a micro-batch just before its forward and dropped after its loss)
    source_rows: Optional[torch.Tensor] = None  # [B] a micro-batch's rows in its step batch (-1: padding row)
    # packed micro-batches (`pack_rows`): `tokens` is [P, L] with several rows per sequence; row b's tokens
    # are in tokens[token_row[b]] and `segment_ids` [P, L] says which row owns each position (-1: padding)
    token_row: Optional[torch.Tensor] = None
    segment_ids: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def to(self, device: torch.device | str) -> "TrainBatch":
        """This batch with every tensor on `device` (the model's; a no-op copy-free view when already there)."""
        def mv(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if x is None else x.to(device, non_blocking=True)

        return TrainBatch(
            tokens=mv(self.tokens), position_ids=mv(self.position_ids), response_index=mv(self.response_index),
            response_ids=mv(self.response_ids), response_mask=mv(self.response_mask), is_golden=mv(self.is_golden),
            truncated=mv(self.truncated), behaviour_logp=mv(self.behaviour_logp),
            extras={k: mv(v) for k, v in self.extras.items()}, ref_logits=mv(self.ref_logits),
            source_rows=mv(self.source_rows), token_row=mv(self.token_row), segment_ids=mv(self.segment_ids))

    @property
    def packed(self) -> bool:
        return self.token_row is not None

    def response_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(b, t, pos) of the N valid response tokens in row-major order: `pos = response_index[b, t]` is
        the position whose logits predict token (b, t), i.e. where the LM head is needed."""
        b_idx, t_idx = self.response_mask.nonzero(as_tuple=True)
        return b_idx, t_idx, self.response_index[b_idx, t_idx]

    def token_rows(self, b_idx: torch.Tensor) -> torch.Tensor:
        """The rows of `tokens` (and of the model's [P, L] output) that hold rows `b_idx`: themselves,
        unless the batch is packed."""
        return b_idx if self.token_row is None else self.token_row.to(b_idx.device)[b_idx]

    def select(self, rows: torch.Tensor | list[int]) -> "TrainBatch":
        """A sub-batch (minibatch) with the same layout; T and L are trimmed to what the rows need. Rows
        without response tokens need no logits: L = 2 when no row has any (what `row_lengths` counts them
        as, so a token budget's group of such rows stays within the budget)."""
        if self.packed:
            raise ValueError("TrainBatch.select: a packed micro-batch cannot be re-selected; select from the step batch")
        rows = torch.as_tensor(rows, dtype=torch.long)
        mask = self.response_mask[rows]
        t_max = int(mask.sum(1).max().item()) if mask.numel() else 0
        t_max = max(t_max, 1)
        l_max = int(self.response_index[rows][mask].max().item() + 2) if mask.any() else 2
        l_max = max(min(l_max, self.tokens.shape[1]), 2)
        return TrainBatch(
            tokens=self.tokens[rows, :l_max], position_ids=self.position_ids[rows, :l_max],
            response_index=self.response_index[rows, :t_max].clamp(max=l_max - 2),
            response_ids=self.response_ids[rows, :t_max], response_mask=mask[:, :t_max],
            is_golden=self.is_golden[rows], truncated=self.truncated[rows],
            behaviour_logp=None if self.behaviour_logp is None else self.behaviour_logp[rows, :t_max],
            extras={k: v[rows, :t_max] if v.dim() >= 2 else v[rows] for k, v in self.extras.items()})


def seq_len_multiple(fp8: Optional[str] = None, tp: int = 1, sequence_parallel: bool = False) -> int:
    """The multiple every micro-batch's sequence length L is padded to.

    FP8: Transformer Engine's FP8 GEMMs need the token dimension of their inputs divisible by 16
    (fprop needs 8, wgrad 16) for the per-tensor recipes (delayed, tensorwise), by the scaling block
    for the block recipes (mxfp8: 32, blockwise: 128): the factors of megatron-core's multimodal
    `get_padding` (16; mxfp8 32) and ms-swift's megatron padding (blockwise 128). The GEMMs see b * L
    tokens, so L a multiple suffices for any b.
    Sequence parallel splits L over the TP ranks, so each rank's L / tp must be a multiple too
    (megatron also needs L divisible by tp there, FP8 or not)."""
    m = 1 if fp8 is None else {"mxfp8": 32, "blockwise": 128}.get(fp8, 16)
    return m * tp if sequence_parallel and tp > 1 else m


def build_batch(items: list[SequenceItem], pad_id: int, pad_to_multiple: int = 1) -> TrainBatch:
    """Pack items into a TrainBatch. Empty responses are allowed (all-False mask row). L is rounded
    up to `pad_to_multiple` (`seq_len_multiple`); the trainer pads every micro-batch it forms again,
    since `TrainBatch.select` trims L to what the selected rows need."""
    if not items:
        raise ValueError("build_batch: no sequences")
    for i, it in enumerate(items):
        if not it.prompt_ids:
            raise ValueError(f"build_batch: item {i} has an empty prompt")
        if it.behaviour_logprobs is not None and len(it.behaviour_logprobs) != len(it.response_ids):
            raise ValueError(f"build_batch: item {i}: {len(it.behaviour_logprobs)} behaviour log-probs for "
                             f"{len(it.response_ids)} response tokens")
    B = len(items)
    L = max(len(it.prompt_ids) + len(it.response_ids) for it in items)
    L = max(L, 2)
    L = round_up(L, pad_to_multiple)
    T = max(1, max(len(it.response_ids) for it in items))
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    response_ids = torch.full((B, T), pad_id, dtype=torch.long)
    response_index = torch.zeros((B, T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.bool)
    behaviour = torch.zeros((B, T), dtype=torch.float32)
    have_behaviour = any(it.behaviour_logprobs is not None for it in items)
    for b, it in enumerate(items):
        p, r = len(it.prompt_ids), len(it.response_ids)
        tokens[b, :p] = torch.tensor(it.prompt_ids)
        if r:
            tokens[b, p:p + r] = torch.tensor(it.response_ids)
            response_ids[b, :r] = torch.tensor(it.response_ids)
            response_index[b, :r] = torch.arange(p - 1, p - 1 + r)
            response_mask[b, :r] = True
            if it.behaviour_logprobs is not None:
                behaviour[b, :r] = torch.tensor(it.behaviour_logprobs, dtype=torch.float32)
    position_ids = torch.arange(L).unsqueeze(0).expand(B, L).contiguous()
    return TrainBatch(
        tokens=tokens, position_ids=position_ids, response_index=response_index, response_ids=response_ids,
        response_mask=response_mask, is_golden=torch.tensor([it.is_golden for it in items]),
        truncated=torch.tensor([it.truncated for it in items]),
        behaviour_logp=behaviour if have_behaviour else None)


def pad_batch(batch: TrainBatch, rows: int, length: int) -> TrainBatch:
    """Pad to `rows` sequences of `length` tokens with fully masked rows: megatron's schedule needs
    every micro-batch to have the same shape (and, with pipeline parallelism, the same length)."""
    B, L = batch.tokens.shape
    if rows < B or length < L:
        raise ValueError(f"pad_batch: cannot shrink [{B}, {L}] to [{rows}, {length}]")
    add = rows - B

    def grow(x: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        if add == 0:
            return x
        return torch.cat([x, torch.full((add, *x.shape[1:]), fill, dtype=x.dtype)], 0)

    tokens = torch.nn.functional.pad(grow(batch.tokens), (0, length - L))
    return TrainBatch(
        tokens=tokens, position_ids=torch.arange(length).unsqueeze(0).expand(rows, length).contiguous(),
        response_index=grow(batch.response_index), response_ids=grow(batch.response_ids),
        response_mask=grow(batch.response_mask, False), is_golden=grow(batch.is_golden, False),
        truncated=grow(batch.truncated, False),
        behaviour_logp=None if batch.behaviour_logp is None else grow(batch.behaviour_logp),
        extras={k: grow(v) for k, v in batch.extras.items()}, ref_logits=batch.ref_logits,
        source_rows=None if batch.source_rows is None else grow(batch.source_rows, -1))


def gather_response(per_position: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """[B, L-1, ...] next-token quantities -> [B, T, ...] in the response layout (padding zeroed)."""
    idx = batch.response_index
    if per_position.dim() == 2:
        out = per_position.gather(1, idx)
        return out * batch.response_mask
    expanded = idx.unsqueeze(-1).expand(*idx.shape, per_position.shape[-1])
    out = per_position.gather(1, expanded)
    return out * batch.response_mask.unsqueeze(-1)


def row_lengths(batch: TrainBatch) -> list[int]:
    """Each row's real sequence length (prompt + response; what `select` trims to), 2 for a row without
    response tokens (it needs no logits)."""
    mask = batch.response_mask
    last = torch.where(mask, batch.response_index, torch.full_like(batch.response_index, -1)).max(dim=1).values
    return [max(int(v) + 2, 2) for v in last]


def budget_micro_batches(batch: TrainBatch, rows: list[int], max_tokens: int, seq_multiple: int = 1,
                         own_length: bool = True) -> list[TrainBatch]:
    """Dynamic batching: `rows` as micro-batches of at most `max_tokens` padded tokens. With `own_length`
    (PP=1: megatron's schedule without pipelining takes micro-batches of any size) the groups of
    `budget_groups`, each trimmed to its own length; under PP>1 (one shape for every micro-batch) as many
    rows per micro-batch as the budget allows at the longest row (`split_micro_batches`)."""
    lengths = row_lengths(batch)
    if not own_length:
        longest = round_up(max(lengths[r] for r in rows), seq_multiple)
        return split_micro_batches(batch, rows, max(1, max_tokens // longest), seq_multiple, own_length=False)
    parts = []
    for group in budget_groups(lengths, rows, max_tokens, seq_multiple):
        part = batch.select(group)
        part.source_rows = torch.as_tensor(group, dtype=torch.long)
        parts.append(pad_batch(part, len(group), round_up(part.tokens.shape[1], seq_multiple)))
    return parts


def split_micro_batches(batch: TrainBatch, rows: list[int], micro_batch_size: int, seq_multiple: int = 1,
                        own_length: bool = True) -> list[TrainBatch]:
    """Split `rows` of `batch` into the fewest micro-batches of at most `micro_batch_size` rows, balanced
    (10 rows at 8 -> 5 + 5, not 8 + 2). With `own_length` (PP=1: megatron's schedule without pipelining
    takes any shape) each keeps its own rows and length; under PP>1 the stages exchange one shape, so all
    take the most rows (masked padding rows) and the longest length. Lengths are rounded up to
    `seq_multiple` (FP8 / sequence parallel). Each part's `source_rows` records its rows in `batch` (-1:
    padding row)."""
    n = -(-len(rows) // min(micro_batch_size, len(rows)))
    bounds = [round(i * len(rows) / n) for i in range(n + 1)]
    chunks = [rows[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    size = max(len(c) for c in chunks)
    parts = [batch.select(c) for c in chunks]
    for part, c in zip(parts, chunks):
        part.source_rows = torch.as_tensor(c, dtype=torch.long)
    longest = round_up(max(p.tokens.shape[1] for p in parts), seq_multiple)
    return [pad_batch(part, part.batch_size, round_up(part.tokens.shape[1], seq_multiple)) if own_length
            else pad_batch(part, size, longest) for part in parts]


def pack_rows(batch: TrainBatch, rows: list[int], length: Optional[int] = None, seq_multiple: int = 1,
              lengths: Optional[list[int]] = None) -> TrainBatch:
    """`rows` of `batch` as one packed sequence [1, L]: their real tokens back to back, each row's
    positions from 0, `segment_ids` telling the rows apart (attention must not cross them: the model
    gets a block-diagonal causal mask, or THD `PackedSeqParams` on Transformer Engine). The per-row
    fields keep the response layout [len(rows), T], with `response_index` pointing into the packed row.
    L is the rows' total rounded up to `seq_multiple`, or `length` (the same shape for every micro-batch
    under pipeline parallelism). `lengths`: `row_lengths(batch)`, when the caller has them."""
    lengths = row_lengths(batch) if lengths is None else lengths
    part = batch.select(rows)
    lens = [lengths[r] for r in rows]
    total = sum(lens)
    L = round_up(total, seq_multiple) if length is None else length
    if L < total:
        raise ValueError(f"pack_rows: {total} tokens do not fit a sequence of {L}")
    tokens = torch.zeros((1, L), dtype=part.tokens.dtype)
    positions = torch.zeros((1, L), dtype=torch.long)
    segments = torch.full((1, L), -1, dtype=torch.long)
    offsets = []
    at = 0
    for i, n in enumerate(lens):
        tokens[0, at:at + n] = part.tokens[i, :n]
        positions[0, at:at + n] = torch.arange(n)
        segments[0, at:at + n] = i
        offsets.append(at)
        at += n
    off = torch.as_tensor(offsets, dtype=torch.long)[:, None]
    response_index = torch.where(part.response_mask, part.response_index + off, off)
    return TrainBatch(
        tokens=tokens, position_ids=positions, response_index=response_index, response_ids=part.response_ids,
        response_mask=part.response_mask, is_golden=part.is_golden, truncated=part.truncated,
        behaviour_logp=part.behaviour_logp, extras=part.extras, source_rows=torch.as_tensor(rows, dtype=torch.long),
        token_row=torch.zeros(len(rows), dtype=torch.long), segment_ids=segments)


def pack_micro_batches(batch: TrainBatch, rows: list[int], max_tokens: int, seq_multiple: int = 1,
                       own_length: bool = True) -> list[TrainBatch]:
    """Packing: `rows` as packed sequences of at most `max_tokens` real tokens each (`pack_groups`,
    `pack_rows`). With `own_length` (PP=1) each is as long as its rows; under PP>1 all take the longest."""
    lengths = row_lengths(batch)
    groups = pack_groups(lengths, rows, max_tokens)
    longest = round_up(max(sum(lengths[r] for r in g) for g in groups), seq_multiple)
    return [pack_rows(batch, g, None if own_length else longest, seq_multiple, lengths) for g in groups]


def plan_micro_batches(batch: TrainBatch, rows: list[int], *, micro_batch_size: int, max_tokens: Optional[int] = None,
                       pack: bool = False, seq_multiple: int = 1, own_length: bool = True) -> list[TrainBatch]:
    """The micro-batches of `rows`, each with `source_rows`: packed sequences of up to `max_tokens` tokens
    (`pack`), rows grouped by length up to `max_tokens` padded tokens (dynamic batching), or
    `micro_batch_size` rows each. `own_length` False (PP>1): one shape for all."""
    if pack:
        if not max_tokens:
            raise ValueError("packing needs a token budget (train.max_tokens_per_microbatch)")
        return pack_micro_batches(batch, rows, max_tokens, seq_multiple, own_length=own_length)
    if max_tokens:
        return budget_micro_batches(batch, rows, max_tokens, seq_multiple, own_length=own_length)
    return split_micro_batches(batch, rows, micro_batch_size, seq_multiple, own_length=own_length)
