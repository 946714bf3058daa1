"""Training-health metrics for on-policy distillation rollouts (pure python / torch, no distributed).

Why these: the failure mode studied by the Stable-OPD paper is *length inflation*: the student drifts into
repetitive loops that never emit EOS, the rollouts hit the length budget, and the teacher keeps rewarding the
loop tokens (positive advantage on repetitive text). The signals that show it early are the truncation rate,
the repetition rate (zlib compressibility of the response tail), the response-length distribution and the
advantage carried by repetitive tokens. `rollout_health` computes all of them for one batch as a flat
`{name: float}` dict that the trainer logs.

Conventions (docs/design.md): per-token tensors are `[B, T]` over response positions, `response_mask[B, T]`
marks real tokens. Padding is ignored everywhere, wherever it sits: a row's tokens are the masked positions,
in order.

Empty sets: rates, shares and counts of an empty set are 0.0 (nothing was observed); means, extrema and
quantiles of an empty set are NaN (there is no value to report). No function raises on an empty batch or an
empty response. Non-finite values at *valid* positions of a float input raise ValueError naming the input.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import numpy as np
import torch

NAN = float("nan")

TensorOrSeq = Union[torch.Tensor, Sequence]


@dataclass
class HealthConfig:
    """Thresholds of the repetition detectors.

    text_tail_chars / text_threshold: a decoded response is repetitive when its last `text_tail_chars`
    characters, UTF-8 encoded, compress by more than `text_threshold` with zlib. 10000 chars / ratio 10 are the
    paper's values: natural prose and math compress 2-4x, a loop of a few sentences compresses 20x and more.

    token_window / token_threshold: the same test on the last `token_window` token ids (each packed as a 4-byte
    little-endian unsigned int), for when no text is at hand or responses are short.

    ngram_n: a token is "repetitive" when it ends an n-gram that already occurred earlier in the response. 16
    tokens is long enough that ordinary math notation rarely repeats a whole span, short enough to catch a
    looping sentence.
    """

    text_tail_chars: int = 10000
    text_threshold: float = 10.0
    token_window: int = 2048
    token_threshold: float = 10.0
    ngram_n: int = 16

    def __post_init__(self) -> None:
        for name in ("text_tail_chars", "token_window", "ngram_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"HealthConfig.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("text_threshold", "token_threshold"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"HealthConfig.{name}: must be a finite number > 0, got {v}")


# ---------------------------------------------------------------------------------------------
# repetition by compression


def compression_ratio(raw: bytes) -> float:
    """len(raw) / len(zlib.compress(raw)) at zlib's default level. Empty input -> 0.0 (never repetitive)."""
    if len(raw) == 0:
        return 0.0
    return len(raw) / len(zlib.compress(raw))


def text_tail_compression_ratio(text: str, tail_chars: int = 10000) -> float:
    """Compression ratio of the last `tail_chars` characters of `text`, UTF-8 encoded."""
    if tail_chars < 1:
        raise ValueError(f"tail_chars: must be >= 1, got {tail_chars}")
    return compression_ratio(text[-tail_chars:].encode("utf-8"))


def is_repetitive_text(text: str, tail_chars: int = 10000, threshold: float = 10.0) -> bool:
    """True when the response tail compresses more than `threshold` times (see HealthConfig)."""
    return text_tail_compression_ratio(text, tail_chars) > threshold


def token_ids_to_bytes(token_ids: Union[Sequence[int], torch.Tensor]) -> bytes:
    """Pack token ids as 4-byte little-endian unsigned ints (vocabularies fit in 32 bits)."""
    if isinstance(token_ids, torch.Tensor):
        ids = token_ids.detach().cpu().to(torch.int64).numpy().reshape(-1)
    else:
        ids = np.asarray([int(t) for t in token_ids], dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"token_ids: id {bad} is outside [0, 2**32)")
    return ids.astype("<u4").tobytes()


def token_tail_compression_ratio(token_ids: Union[Sequence[int], torch.Tensor], window: int = 2048) -> float:
    """Compression ratio of the last `window` token ids packed by `token_ids_to_bytes`."""
    if window < 1:
        raise ValueError(f"window: must be >= 1, got {window}")
    ids = token_ids[-window:] if isinstance(token_ids, torch.Tensor) else list(token_ids)[-window:]
    return compression_ratio(token_ids_to_bytes(ids))


def is_repetitive_tokens(
    token_ids: Union[Sequence[int], torch.Tensor], window: int = 2048, threshold: float = 10.0
) -> bool:
    """Token-id variant of `is_repetitive_text`, for short responses or when no decoded text is available."""
    return token_tail_compression_ratio(token_ids, window) > threshold


# ---------------------------------------------------------------------------------------------
# repeated n-grams


def repeated_ngram_flags(tokens: Sequence[int], n: int) -> list[bool]:
    """flags[t] is True when tokens[t-n+1 : t+1] occurred as an n-gram ending at an earlier position
    (occurrences may overlap: in `a a a` with n=2 the last `a` is repetitive). The first n-1 tokens are never
    repetitive."""
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    toks = [int(t) for t in tokens]
    flags = [False] * len(toks)
    seen: set[tuple[int, ...]] = set()
    for end in range(n - 1, len(toks)):
        gram = tuple(toks[end - n + 1 : end + 1])
        if gram in seen:
            flags[end] = True
        else:
            seen.add(gram)
    return flags


def repeated_ngram_ratio(tokens: Sequence[int], n: int) -> float:
    """Fraction of the response's n-grams that already occurred earlier in it; 0.0 with fewer than n tokens."""
    flags = repeated_ngram_flags(tokens, n)
    total = len(flags) - n + 1
    if total <= 0:
        return 0.0
    return sum(flags) / total


def _rows(token_ids: torch.Tensor, response_mask: torch.Tensor) -> list[torch.Tensor]:
    ids, mask = token_ids.detach().cpu(), response_mask.cpu()
    return [ids[b][mask[b]] for b in range(ids.shape[0])]


def _hash_coef(c: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0x5EED)
    return torch.randint(1, 2**62, (c,), generator=g) | 1


def _group_rows(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order the rows of `k` [N, C] (int64) so equal rows are adjacent and, among equal rows, in index order.
    Returns (perm, group_start): group_start[i] is True where sorted row i differs from sorted row i-1.

    One stable sort on a random 64-bit linear hash (int64 arithmetic wraps), then an exact comparison of the
    hash-equal neighbours; only on a hash collision (odds about N**2 / 2**64) does it sort column by column."""
    h = (k * _hash_coef(k.shape[1]).to(k.device)).sum(dim=1)
    perm = torch.argsort(h, stable=True)
    hs = h[perm]
    same = hs[1:] == hs[:-1]
    idx = same.nonzero().flatten()
    if bool((k[perm[idx]] != k[perm[idx + 1]]).any()):
        perm = torch.arange(k.shape[0], device=k.device)
        for col in range(k.shape[1] - 1, -1, -1):
            perm = perm[torch.argsort(k[perm, col], stable=True)]
        sk = k[perm]
        same = (sk[1:] == sk[:-1]).all(dim=1)
    group_start = torch.ones(k.shape[0], dtype=torch.bool, device=k.device)
    group_start[1:] = ~same
    return perm, group_start


def repetitive_token_mask(token_ids: torch.Tensor, response_mask: torch.Tensor, n: int = 16) -> torch.Tensor:
    """Bool `[B, T]`: token (b, t) is valid and ends an n-gram already seen earlier in response b.

    The response is the sequence of masked tokens of row b, so padding never forms or breaks an n-gram.
    Vectorised (all rows' n-grams, keyed by row, grouped by `_group_rows`): about 1 s for 64 x 4096 tokens on
    one busy CPU core. `repeated_ngram_flags` is the plain-python definition it must agree with.
    """
    _check_2d("token_ids", token_ids)
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    mask = _as_mask(response_mask, token_ids.shape)
    B, T = token_ids.shape
    out = torch.zeros(B, T, dtype=torch.bool, device=token_ids.device)
    if B == 0 or T < n:
        return out
    lengths = mask.sum(1)
    arange_t = torch.arange(T, device=token_ids.device)
    if torch.equal(mask, arange_t[None, :] < lengths[:, None]):  # the usual right-padded layout
        order = arange_t.expand(B, T)
    else:
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # valid positions first, in order
    compact = token_ids.long().gather(1, order)
    W = T - n + 1
    grams = compact.unfold(1, n, 1)  # [B, W, n]: window j covers compact tokens j .. j+n-1
    rows = torch.arange(B, device=token_ids.device)[:, None, None].expand(B, W, 1)
    keys = torch.cat([rows, grams], dim=2).reshape(B * W, n + 1)
    valid = (torch.arange(W, device=token_ids.device)[None, :] + n <= lengths[:, None]).reshape(-1)
    if not bool(valid.any()):
        return out
    pos = torch.arange(B * W, device=token_ids.device)[valid]
    k = keys[valid]
    perm, group_start = _group_rows(k)
    repeated = torch.zeros(B * W, dtype=torch.bool, device=token_ids.device)
    repeated[pos[perm]] = ~group_start  # equal n-grams sit in position order: all but the first are repeats
    end_flags = torch.zeros(B, T, dtype=torch.bool, device=token_ids.device)
    end_flags[:, n - 1 :] = repeated.reshape(B, W)  # window j ends at compact position j+n-1
    out.scatter_(1, order, end_flags)
    return out


# ---------------------------------------------------------------------------------------------
# advantage split, lengths, log-probs


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    if n == 0:
        return NAN
    return float(x[mask].double().sum() / n)


def advantage_split(
    advantages: torch.Tensor, response_mask: torch.Tensor, repetitive_mask: torch.Tensor
) -> dict[str, float]:
    """Mean advantage on repetitive vs other valid tokens, and the repetitive tokens' share of valid tokens.

    A positive `adv/repetitive_mean` well above `adv/other_mean` means the teacher is rewarding the loop: the
    mechanism behind length inflation.
    """
    _check_2d("advantages", advantages)
    mask = _as_mask(response_mask, advantages.shape)
    rep = _as_mask(repetitive_mask, advantages.shape, name="repetitive_mask") & mask
    _check_finite("advantages", advantages, mask)
    n_valid = int(mask.sum())
    return {
        "adv/mean": _masked_mean(advantages, mask),
        "adv/repetitive_mean": _masked_mean(advantages, rep),
        "adv/other_mean": _masked_mean(advantages, mask & ~rep),
        "adv/repetitive_token_share": (int(rep.sum()) / n_valid) if n_valid else 0.0,
    }


def _quantile(sorted_vals: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default 'linear' method)."""
    if not sorted_vals:
        return NAN
    pos = q * (len(sorted_vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _mean(vals: Sequence[float]) -> float:
    return sum(vals) / len(vals) if len(vals) else NAN


def length_stats(lengths: Sequence[int], truncated: Optional[Sequence[bool]] = None) -> dict[str, float]:
    """Response-length mean / max / min / p50 / p90, and mean length of truncated vs finished responses."""
    lens = [float(x) for x in lengths]
    s = sorted(lens)
    out = {
        "rollout/response_len_mean": _mean(lens),
        "rollout/response_len_max": s[-1] if s else NAN,
        "rollout/response_len_min": s[0] if s else NAN,
        "rollout/response_len_p50": _quantile(s, 0.5),
        "rollout/response_len_p90": _quantile(s, 0.9),
    }
    if truncated is not None:
        if len(truncated) != len(lens):
            raise ValueError(f"truncated: has {len(truncated)} entries for {len(lens)} responses")
        out["rollout/truncated_len_mean"] = _mean([x for x, t in zip(lens, truncated) if t])
        out["rollout/finished_len_mean"] = _mean([x for x, t in zip(lens, truncated) if not t])
    return out


def truncation_flags(
    truncated: Optional[TensorOrSeq] = None, finish_reasons: Optional[Sequence[str]] = None
) -> Optional[list[bool]]:
    """Per-sample truncation from `truncated` flags or finish reasons ("length" = hit the budget without EOS;
    "stop", "abort", ... are not truncation). When both are given they must agree. None when neither is."""
    flags = None
    if truncated is not None:
        t = truncated.tolist() if isinstance(truncated, torch.Tensor) else list(truncated)
        flags = [bool(x) for x in t]
    if finish_reasons is not None:
        for i, r in enumerate(finish_reasons):
            if not isinstance(r, str):
                raise ValueError(f"finish_reasons[{i}]: expected a string, got {r!r}")
        from_reasons = [r == "length" for r in finish_reasons]
        if flags is not None and flags != from_reasons:
            raise ValueError("truncated and finish_reasons disagree (finish_reason 'length' <=> truncated)")
        flags = from_reasons
    return flags


# ---------------------------------------------------------------------------------------------
# validation helpers


def _check_2d(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name}: expected a [B, T] tensor, got {getattr(x, 'shape', type(x))}")


def _as_mask(mask: torch.Tensor, shape: torch.Size, name: str = "response_mask") -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {getattr(mask, 'shape', type(mask))}")
    return mask.bool()


def _check_like(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(mask.shape):
        raise ValueError(f"{name}: expected shape {tuple(mask.shape)} like response_mask, "
                         f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")


def _check_finite(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    bad = ~torch.isfinite(x) & mask
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: non-finite value {float(x[b, t])} at valid position [{b}, {t}]")


def _scalar(name: str, v: Union[float, int, torch.Tensor]) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"{name}: expected a scalar, got a tensor of shape {tuple(v.shape)}")
        v = v.item()
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {v!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"{name}: non-finite value {f}")
    return f


# ---------------------------------------------------------------------------------------------
# the batch summary


def rollout_health(
    response_mask: torch.Tensor,
    *,
    token_ids: Optional[torch.Tensor] = None,
    response_texts: Optional[Sequence[str]] = None,
    truncated: Optional[TensorOrSeq] = None,
    finish_reasons: Optional[Sequence[str]] = None,
    advantages: Optional[torch.Tensor] = None,
    logp: Optional[torch.Tensor] = None,
    teacher_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    is_golden: Optional[TensorOrSeq] = None,
    kl: Optional[Mapping[str, Union[float, torch.Tensor]]] = None,
    config: Optional[HealthConfig] = None,
) -> dict[str, float]:
    """Health metrics of one batch as flat `{name: float}`; keys appear only for the inputs given.

    Golden samples (`is_golden`) are excluded: the metrics describe the student's own rollouts. Keys:
      rollout/num_samples, rollout/num_golden               counts
      rollout/truncation_rate                               from `truncated` or `finish_reasons`
      rollout/response_len_{mean,max,min,p50,p90}           valid tokens per response
      rollout/{truncated,finished}_len_mean                 with truncation info
      rollout/repetition_rate                               zlib test on texts if given, else on token ids
      rollout/repetition_rate_tokens                        zlib test on token ids (with `token_ids`)
      rollout/repeated_ngram_ratio_mean                     per-response repeated n-gram ratio, averaged
      adv/{mean,repetitive_mean,other_mean,repetitive_token_share}   with `advantages` and `token_ids`
      logp/{student,teacher,ref}_mean                       over valid rollout tokens
      kl/<name>                                             `kl` values passed through (names with a '/' kept)
    """
    cfg = config or HealthConfig()
    if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2:
        raise ValueError(f"response_mask: expected a [B, T] tensor, got {getattr(response_mask, 'shape', None)}")
    B = response_mask.shape[0]
    mask = response_mask.bool()

    def per_sample(name: str, v: Optional[TensorOrSeq]) -> Optional[list]:
        if v is None:
            return None
        vals = v.tolist() if isinstance(v, torch.Tensor) else list(v)
        if len(vals) != B:
            raise ValueError(f"{name}: has {len(vals)} entries for batch size {B}")
        return vals

    golden = [bool(g) for g in per_sample("is_golden", is_golden) or [False] * B]
    keep = [i for i in range(B) if not golden[i]]
    keep_t = torch.tensor(keep, dtype=torch.long)
    m = mask[keep_t]

    out: dict[str, float] = {"rollout/num_samples": float(len(keep)), "rollout/num_golden": float(B - len(keep))}

    trunc_all = truncation_flags(per_sample("truncated", truncated), per_sample("finish_reasons", finish_reasons))
    trunc = [trunc_all[i] for i in keep] if trunc_all is not None else None
    if trunc is not None:
        out["rollout/truncation_rate"] = (sum(trunc) / len(trunc)) if trunc else 0.0

    out.update(length_stats(m.sum(-1).tolist(), trunc))

    rep_tok = None
    if token_ids is not None:
        _check_like("token_ids", token_ids, mask)
        ids = token_ids[keep_t]
        rows = _rows(ids.cpu(), m.cpu())
        flags = [is_repetitive_tokens(r, cfg.token_window, cfg.token_threshold) for r in rows]
        out["rollout/repetition_rate_tokens"] = (sum(flags) / len(flags)) if flags else 0.0
        out["rollout/repetition_rate"] = out["rollout/repetition_rate_tokens"]
        rep_tok = repetitive_token_mask(ids, m, cfg.ngram_n)
        n_grams = (m.sum(-1) - cfg.ngram_n + 1).clamp(min=0)
        ratios = torch.where(n_grams > 0, rep_tok.sum(-1) / n_grams.clamp(min=1), 0.0)
        out["rollout/repeated_ngram_ratio_mean"] = float(ratios.double().mean()) if len(rows) else NAN

    texts = per_sample("response_texts", response_texts)
    if texts is not None:
        kept = [texts[i] for i in keep]
        for i, t in zip(keep, kept):
            if not isinstance(t, str):
                raise ValueError(f"response_texts[{i}]: expected a string, got {type(t).__name__}")
        flags = [is_repetitive_text(t, cfg.text_tail_chars, cfg.text_threshold) for t in kept]
        out["rollout/repetition_rate"] = (sum(flags) / len(flags)) if flags else 0.0

    if advantages is not None:
        _check_like("advantages", advantages, mask)
        adv = advantages[keep_t]
        if rep_tok is None:
            _check_finite("advantages", adv, m)
            out["adv/mean"] = _masked_mean(adv, m)
        else:
            out.update(advantage_split(adv, m, rep_tok))

    for name, key, x in (("logp", "logp/student_mean", logp), ("teacher_logp", "logp/teacher_mean", teacher_logp),
                         ("ref_logp", "logp/ref_mean", ref_logp)):
        if x is None:
            continue
        _check_like(name, x, mask)
        xs = x[keep_t]
        _check_finite(name, xs, m)
        out[key] = _masked_mean(xs, m)

    for name, v in (kl or {}).items():
        out[name if "/" in name else f"kl/{name}"] = _scalar(f"kl[{name!r}]", v)
    return out


__all__ = [
    "HealthConfig", "advantage_split", "compression_ratio", "is_repetitive_text", "is_repetitive_tokens",
    "length_stats", "repeated_ngram_flags", "repeated_ngram_ratio", "repetitive_token_mask", "rollout_health",
    "text_tail_compression_ratio", "token_ids_to_bytes", "token_tail_compression_ratio", "truncation_flags",
]
