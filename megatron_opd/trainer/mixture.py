"""Mixture distillation: golden solutions as rows of the step's batch, and how rows are dealt out.

Stable-OPD trains on the student's rollouts and on golden solutions in the same minibatch
(`algo.mixture_ratio` of its rows). These helpers decide how many golden rows a step gets, from which
prompts, what a golden row looks like as a response, and how the step's rows are split over
data-parallel ranks and minibatches so that every part holds its share of golden rows (and, under
dynamic batching or packing, a similar number of tokens).
"""

from __future__ import annotations

from typing import Optional, Sequence


def golden_count(n_rollouts: int, mixture_ratio: float, n_prompts: int, parts: int = 1) -> int:
    """Golden samples so that they are `mixture_ratio` of every one of `parts` minibatches
    (data-parallel ranks x minibatches): g / (g + n) = ratio per part, at least one per part."""
    if mixture_ratio <= 0:
        return 0
    if mixture_ratio >= 1:
        return n_prompts
    parts = max(1, parts)
    return parts * max(1, round(mixture_ratio * (n_rollouts / parts) / (1.0 - mixture_ratio)))


def golden_prompt_picks(n_candidates: int, n_gold: int, step: int) -> list[int]:
    """Which of the step's `n_candidates` prompts (those with a solution) get the `n_gold` golden samples:
    evenly spaced over the prompts, with the start rotated by the step, so every prompt position gets
    its turn instead of always the first prompts. More golden samples than prompts wrap around."""
    if n_candidates <= 0 or n_gold <= 0:
        return []
    offset = step % n_candidates
    return [(offset + (j * n_candidates) // n_gold) % n_candidates for j in range(n_gold)]


def golden_response(solution_ids: list[int], stop_ids: list[int], max_new_tokens: int,
                    eos_id: Optional[int] = None) -> tuple[list[int], bool]:
    """A golden solution as a response the rollout engine could have produced: (ids, truncated).

    It ends with one of the rollout's stop ids `stop_ids` (the engine's EOS ids): a final `eos_id`
    (the tokenizer's EOS that `data.prompts.solution_ids` appends) that the engine does not stop on is
    replaced by `stop_ids[0]`, and a solution without a stop id gets one appended. A solution longer than
    `max_new_tokens` is cut there and marked truncated (no EOS), like a rollout that hit the budget."""
    ids = list(solution_ids)
    stops = set(stop_ids)
    if not ids or ids[-1] not in stops:
        if ids and eos_id is not None and ids[-1] == eos_id:
            ids = ids[:-1]
        ids.append(stop_ids[0])
    if len(ids) > max_new_tokens:
        return ids[:max_new_tokens], True
    return ids, False


def spread_rows(rows: Sequence[int], golden: Sequence[bool], parts: int) -> list[list[int]]:
    """Split `rows` into `parts` groups of sizes `round(n / parts)` (contiguous bounds, as an even split
    would), each holding its share of the golden rows (`golden[i]` for `rows[i]`): size x golden / n, rounded
    by largest remainder, so within one row of it. Contiguous runs of the rollout rows and of the golden
    rows, each group in the original order. Without golden rows this is the plain contiguous split; with
    one part, the rows unchanged."""
    if parts <= 1:
        return [list(rows)]
    n = len(rows)
    gold = [r for r, g in zip(rows, golden) if g]
    roll = [r for r, g in zip(rows, golden) if not g]
    bounds = [round(j * n / parts) for j in range(parts + 1)]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    quota = [size * len(gold) / n if n else 0.0 for size in sizes]
    n_gold = [int(q) for q in quota]  # <= size, as len(gold) <= n
    by_remainder = sorted(range(parts), key=lambda j: (-(quota[j] - n_gold[j]), j))
    for j in by_remainder[: len(gold) - sum(n_gold)]:
        n_gold[j] += 1
    order = {r: i for i, r in enumerate(rows)}
    out, ga, ra = [], 0, 0
    for size, g in zip(sizes, n_gold):
        out.append(sorted(gold[ga:ga + g] + roll[ra:ra + size - g], key=order.__getitem__))
        ga, ra = ga + g, ra + size - g
    return out


def balance_rows(rows: Sequence[int], golden: Sequence[bool], lengths: Sequence[int], parts: int) -> list[list[int]]:
    """`spread_rows`'s split (the same group sizes and golden rows per group) with the rows dealt by tokens:
    longest first, each to the group with the fewest tokens that still has room for its kind. Under
    dynamic batching or packing a data-parallel rank's time follows its tokens, not its rows, and the
    step waits for the slowest rank. `lengths[r]`: row r's tokens."""
    if parts <= 1:
        return [list(rows)]
    is_gold = dict(zip(rows, golden))
    room = [{True: sum(is_gold[r] for r in g), False: sum(not is_gold[r] for r in g)}
            for g in spread_rows(rows, golden, parts)]
    order = {r: i for i, r in enumerate(rows)}
    tokens = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for r in sorted(rows, key=lambda r: (-lengths[r], order[r])):
        kind = is_gold[r]
        j = min((j for j in range(parts) if room[j][kind] > 0), key=lambda j: (tokens[j], j))
        out[j].append(r)
        room[j][kind] -= 1
        tokens[j] += lengths[r]
    return [sorted(g, key=order.__getitem__) for g in out]
