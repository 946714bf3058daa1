"""Which rows share a forward, and the model inputs of packed sequences.

Dynamic batching groups rows by length up to a token budget (`budget_groups`); packing puts several rows
in one sequence (`pack_groups`), where attention must not cross them.

Transformer Engine takes the THD format (`PackedSeqParams`: cumulative sequence lengths, rotary positions
restarted per sequence). megatron-core's local layer spec rejects THD, so on it (the CPU path) the
boundaries are a block-diagonal causal attention mask; its rotary embedding then runs over the packed
row's absolute positions, which changes nothing inside a row: rotary attention depends only on the
distance between positions, and no position attends across a boundary.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def budget_groups(lengths: list[int], rows: list[int], max_tokens: int, seq_multiple: int = 1) -> list[list[int]]:
    """`rows` grouped by length so that each group's padded size (rows x its longest row, rounded up to
    `seq_multiple`) stays within `max_tokens`: longest rows first, a group closed when the next row would
    overflow it. A row longer than the budget on its own is a group of one. Each group in `rows` order."""
    order = {r: i for i, r in enumerate(rows)}
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for r in sorted(rows, key=lambda r: (-lengths[r], order[r])):
        grown = round_up(max(longest, lengths[r]), seq_multiple) * (len(cur) + 1)
        if cur and grown > max_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(r)
        longest = max(longest, lengths[r])
    if cur:
        groups.append(cur)
    return [sorted(g, key=order.__getitem__) for g in groups]


def pack_groups(lengths: list[int], rows: list[int], max_tokens: int) -> list[list[int]]:
    """`rows` into sequences of at most `max_tokens` real tokens (first fit, longest rows first: few
    sequences, little left over); a row longer than the budget is a sequence of its own. Each group in
    `rows` order, groups in the order they were opened."""
    order = {r: i for i, r in enumerate(rows)}
    groups: list[list[int]] = []
    room: list[int] = []
    for r in sorted(rows, key=lambda r: (-lengths[r], order[r])):
        for g, free in enumerate(room):
            if lengths[r] <= free:
                groups[g].append(r)
                room[g] -= lengths[r]
                break
        else:
            groups.append([r])
            room.append(max_tokens - lengths[r])
    return [sorted(g, key=order.__getitem__) for g in groups]


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[P, 1, L, L] bool mask of packed rows `segment_ids` [P, L] (-1: padding), True where attention is
    NOT allowed (megatron's convention): a position sees the earlier positions of its own segment only;
    padding sees nothing (its outputs are never read)."""
    seg = segment_ids
    L = seg.shape[1]
    causal = torch.ones((L, L), dtype=torch.bool, device=seg.device).tril()
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    return ~(same & causal)[:, None]


def cu_seqlens(segment_ids: torch.Tensor) -> torch.Tensor:
    """int32 cumulative lengths [n + 1] of one packed row's segments (`segment_ids` [1, L], segments
    0..n-1 in order), trailing padding as a last segment of its own: THD needs offsets covering the row."""
    if segment_ids.dim() != 2 or segment_ids.shape[0] != 1:
        raise ValueError(f"cu_seqlens: one packed row [1, L] expected, got {tuple(segment_ids.shape)}")
    seg = segment_ids[0].cpu()
    lens = torch.bincount(seg[seg >= 0]).tolist()
    pad = int((seg < 0).sum())
    if pad:
        lens.append(pad)
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def thd_params(segment_ids: torch.Tensor) -> PackedSeqParams:
    """`PackedSeqParams` (THD) of one packed row, on its device."""
    cu = cu_seqlens(segment_ids).to(segment_ids.device)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def packed_inputs(segment_ids: torch.Tensor, thd: bool) -> dict[str, Any]:
    """The forward's extra arguments for packed rows: THD params (Transformer Engine) or the
    block-diagonal causal mask (local spec)."""
    if thd:
        return {"packed_seq_params": thd_params(segment_ids)}
    return {"attention_mask": block_causal_mask(segment_ids)}


__all__ = ["block_causal_mask", "budget_groups", "cu_seqlens", "pack_groups", "packed_inputs", "round_up", "thd_params"]
