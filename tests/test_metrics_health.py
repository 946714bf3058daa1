"""Health metrics against independent computations: zlib ratios recomputed here, n-grams counted by hand or by
brute force, quantiles by numpy."""

import math
import random
import string
import zlib

import numpy as np
import pytest
import torch

from megatron_opd.metrics.health import (
    HealthConfig,
    advantage_split,
    compression_ratio,
    is_repetitive_text,
    is_repetitive_tokens,
    length_stats,
    repeated_ngram_flags,
    repeated_ngram_ratio,
    repetitive_token_mask,
    rollout_health,
    text_tail_compression_ratio,
    token_ids_to_bytes,
    token_tail_compression_ratio,
    truncation_flags,
)


def zratio(b: bytes) -> float:
    return len(b) / len(zlib.compress(b))


def random_text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + " .,0123456789") for _ in range(n))


LOOP = "So the answer is 42. Wait, let me recheck. "


# ---------------------------------------------------------------------------------------------
# zlib repetition


def test_compression_ratio_matches_zlib_and_empty_is_zero():
    for raw in (b"a", b"abc" * 50, random_text(3000).encode()):
        assert compression_ratio(raw) == pytest.approx(zratio(raw))
    assert compression_ratio(b"") == 0.0


def test_text_repetition_loop_vs_natural():
    loop = LOOP * 400  # ~17k chars
    natural = random_text(12000, seed=1)
    assert zratio(loop[-10000:].encode()) > 10  # premise of the test, computed independently
    assert zratio(natural[-10000:].encode()) < 10
    assert is_repetitive_text(loop) and not is_repetitive_text(natural)
    assert text_tail_compression_ratio(loop) == pytest.approx(zratio(loop[-10000:].encode()))


def test_text_repetition_looks_only_at_the_tail():
    text = LOOP * 400 + random_text(10000, seed=2)  # looping middle, natural last 10000 chars
    assert not is_repetitive_text(text, tail_chars=10000)
    expected_whole = zratio(text.encode())
    assert text_tail_compression_ratio(text, tail_chars=len(text)) == pytest.approx(expected_whole)
    assert is_repetitive_text(text, tail_chars=len(text)) == (expected_whole > 10)


def test_text_tail_counts_characters_not_bytes():
    text = "é" * 50 + "abc"  # 'é' is 2 bytes in UTF-8
    assert text_tail_compression_ratio(text, tail_chars=20) == pytest.approx(zratio(("é" * 17 + "abc").encode()))


def test_text_threshold_is_strict():
    text = LOOP * 300
    r = zratio(text[-10000:].encode())
    assert not is_repetitive_text(text, threshold=r)
    assert is_repetitive_text(text, threshold=r - 1e-9)


def test_token_window_variant():
    loop = [101, 2023, 88, 151000, 7] * 500
    rng = random.Random(3)
    natural = [rng.randrange(0, 150000) for _ in range(3000)]
    packed = b"".join(t.to_bytes(4, "little") for t in loop[-2048:])
    assert token_ids_to_bytes(loop[-2048:]) == packed
    assert token_tail_compression_ratio(loop) == pytest.approx(zratio(packed))
    assert zratio(packed) > 10
    assert is_repetitive_tokens(loop) and not is_repetitive_tokens(natural)
    # only the last `window` ids count: natural tail after a loop
    assert not is_repetitive_tokens(loop + natural, window=2048)
    assert token_tail_compression_ratio([]) == 0.0
    with pytest.raises(ValueError, match="token_ids"):
        token_ids_to_bytes([1, -2])


# ---------------------------------------------------------------------------------------------
# n-grams


@pytest.mark.parametrize(
    "tokens,n,expected",
    [
        ([1, 2, 3, 1, 2, 3, 1, 2], 2, 4 / 7),  # (1,2)(2,3)(3,1) new; (1,2)(2,3)(3,1)(1,2) repeats
        ([1, 2, 3, 1, 2, 3, 1, 2], 3, 3 / 6),
        ([7, 7, 7, 7], 2, 2 / 3),  # overlapping occurrences count
        ([1, 2, 1, 1], 1, 2 / 4),
        ([1, 2, 3, 4], 2, 0.0),
        ([1, 2], 3, 0.0),  # fewer tokens than n
        ([], 2, 0.0),
        ([5], 1, 0.0),
    ],
)
def test_repeated_ngram_ratio_by_hand(tokens, n, expected):
    assert repeated_ngram_ratio(tokens, n) == pytest.approx(expected)


def brute_flags(toks, n):
    out = []
    for t in range(len(toks)):
        if t < n - 1:
            out.append(False)
            continue
        gram = toks[t - n + 1 : t + 1]
        out.append(any(toks[s - n + 1 : s + 1] == gram for s in range(n - 1, t)))
    return out


def test_ngram_flags_match_brute_force():
    rng = random.Random(4)
    for _ in range(200):
        toks = [rng.randrange(3) for _ in range(rng.randrange(0, 20))]
        n = rng.randrange(1, 5)
        assert repeated_ngram_flags(toks, n) == brute_flags(toks, n)
    with pytest.raises(ValueError, match="n:"):
        repeated_ngram_flags([1, 2], 0)


def test_repetitive_token_mask_ignores_padding():
    pad = 1  # same value as a real token: must still be ignored
    ids = torch.tensor([[1, 2, pad, 1, 2, pad], [3, 3, 3, pad, pad, pad], [9, pad, pad, pad, pad, pad]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    got = repetitive_token_mask(ids, mask, n=2)
    # row 0 compacts to [1,2,1,2]: flags F,F,F,T -> position 4; row 1 [3,3,3]: F,F,T
    expected = torch.zeros_like(mask)
    expected[0, 4] = True
    expected[1, 2] = True
    assert torch.equal(got, expected)
    assert not (got & ~mask).any()


def test_repetitive_token_mask_random_vs_brute_force():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 3, (6, 12), generator=g)
    mask = torch.rand(6, 12, generator=g) > 0.3
    got = repetitive_token_mask(ids, mask, n=2)
    for b in range(6):
        pos = mask[b].nonzero().flatten().tolist()
        flags = brute_flags([int(ids[b, p]) for p in pos], 2)
        for p, f in zip(pos, flags):
            assert bool(got[b, p]) == f


# ---------------------------------------------------------------------------------------------
# advantages, lengths, truncation


def test_advantage_split_closed_form():
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, -2.0, 0.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)  # NaN at a pad position is fine
    rep = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)  # rep at pad positions ignored
    out = advantage_split(adv, mask, rep)
    assert out["adv/repetitive_mean"] == pytest.approx((3 + 4 - 2) / 3)
    assert out["adv/other_mean"] == pytest.approx((1 + 2 + 10) / 3)
    assert out["adv/repetitive_token_share"] == pytest.approx(3 / 6)
    assert out["adv/mean"] == pytest.approx((1 + 2 + 3 + 4 + 10 - 2) / 6)
    none = advantage_split(adv[:1], mask[:1], torch.zeros(1, 4, dtype=torch.bool))
    assert math.isnan(none["adv/repetitive_mean"]) and none["adv/repetitive_token_share"] == 0.0


def test_advantage_split_rejects_non_finite_at_valid_positions():
    adv = torch.tensor([[1.0, float("inf")]])
    with pytest.raises(ValueError, match=r"advantages.*\[0, 1\]"):
        advantage_split(adv, torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.bool))


def test_length_stats_vs_numpy():
    rng = random.Random(6)
    lens = [rng.randrange(1, 500) for _ in range(37)]
    trunc = [x > 300 for x in lens]
    out = length_stats(lens, trunc)
    assert out["rollout/response_len_mean"] == pytest.approx(np.mean(lens))
    assert out["rollout/response_len_max"] == max(lens) and out["rollout/response_len_min"] == min(lens)
    assert out["rollout/response_len_p50"] == pytest.approx(np.percentile(lens, 50))
    assert out["rollout/response_len_p90"] == pytest.approx(np.percentile(lens, 90))
    assert out["rollout/truncated_len_mean"] == pytest.approx(np.mean([x for x in lens if x > 300]))
    assert out["rollout/finished_len_mean"] == pytest.approx(np.mean([x for x in lens if x <= 300]))
    q = length_stats(list(range(1, 11)))
    assert q["rollout/response_len_p50"] == pytest.approx(5.5) and q["rollout/response_len_p90"] == pytest.approx(9.1)


def test_truncation_flags_sources():
    assert truncation_flags(torch.tensor([True, False])) == [True, False]
    assert truncation_flags(finish_reasons=["length", "stop", "abort"]) == [True, False, False]
    assert truncation_flags(None, None) is None
    with pytest.raises(ValueError, match="disagree"):
        truncation_flags([True, True], ["length", "stop"])


# ---------------------------------------------------------------------------------------------
# rollout_health


def make_batch():
    B, T = 4, 8
    ids = torch.tensor(
        [
            [5, 6, 5, 6, 5, 6, 0, 0],  # len 6, repeats
            [1, 2, 3, 4, 5, 6, 7, 8],  # len 8 (truncated)
            [9, 9, 9, 0, 0, 0, 0, 0],  # golden, len 3: excluded
            [4, 0, 0, 0, 0, 0, 0, 0],  # len 1
        ]
    )
    lens = torch.tensor([6, 8, 3, 1])
    mask = torch.arange(T)[None, :] < lens[:, None]
    g = torch.Generator().manual_seed(7)
    logp = -torch.rand(B, T, generator=g)
    teacher = -torch.rand(B, T, generator=g)
    ref = -torch.rand(B, T, generator=g)
    logp[~mask] = float("nan")  # garbage in padding must be ignored
    adv = teacher - logp
    return ids, mask, logp, teacher, ref, adv


def test_rollout_health_full_batch():
    ids, mask, logp, teacher, ref, adv = make_batch()
    texts = [LOOP * 300, random_text(500, 8), "golden", "x"]
    cfg = HealthConfig(ngram_n=2)
    out = rollout_health(
        mask, token_ids=ids, response_texts=texts, finish_reasons=["stop", "length", "stop", "stop"],
        advantages=adv, logp=logp, teacher_logp=teacher, ref_logp=ref, is_golden=[False, False, True, False],
        kl={"ref_kl": torch.tensor(0.25), "loss/kl": 0.5}, config=cfg,
    )
    keep = [0, 1, 3]
    m = mask[keep]
    assert out["rollout/num_samples"] == 3 and out["rollout/num_golden"] == 1
    assert out["rollout/truncation_rate"] == pytest.approx(1 / 3)
    assert out["rollout/response_len_mean"] == pytest.approx((6 + 8 + 1) / 3)
    assert out["rollout/truncated_len_mean"] == 8 and out["rollout/finished_len_mean"] == pytest.approx(3.5)
    assert out["rollout/repetition_rate"] == pytest.approx(1 / 3)  # text: only the LOOP one
    assert out["rollout/repetition_rate_tokens"] == 0.0  # 6 tokens compress < 10x (zlib header)
    # bigrams of [5,6,5,6,5,6]: (5,6) (6,5) new, then 3 repeats -> 3/5; [1..8] -> 0; [4] -> 0
    assert out["rollout/repeated_ngram_ratio_mean"] == pytest.approx((3 / 5) / 3)
    rep = torch.zeros_like(m)
    rep[0, 3:6] = True
    assert out["adv/repetitive_mean"] == pytest.approx(float(adv[0, 3:6].double().mean()))
    assert out["adv/other_mean"] == pytest.approx(float(adv[keep][m & ~rep].double().mean()))
    assert out["adv/repetitive_token_share"] == pytest.approx(3 / 15)
    assert out["logp/student_mean"] == pytest.approx(float(logp[keep][m].double().mean()))
    assert out["logp/teacher_mean"] == pytest.approx(float(teacher[keep][m].double().mean()))
    assert out["logp/ref_mean"] == pytest.approx(float(ref[keep][m].double().mean()))
    assert out["kl/ref_kl"] == 0.25 and out["loss/kl"] == 0.5
    assert all(isinstance(v, float) for v in out.values())


def test_rollout_health_token_repetition_without_texts():
    ids = torch.tensor([[3, 4] * 600, list(range(1200))])
    mask = torch.ones_like(ids, dtype=torch.bool)
    out = rollout_health(mask, token_ids=ids, truncated=torch.tensor([True, False]))
    assert out["rollout/repetition_rate"] == out["rollout/repetition_rate_tokens"] == 0.5
    assert out["rollout/truncation_rate"] == 0.5


def test_rollout_health_empty_batch():
    ids = torch.zeros(0, 5, dtype=torch.long)
    mask = torch.zeros(0, 5, dtype=torch.bool)
    out = rollout_health(mask, token_ids=ids, response_texts=[], truncated=[], advantages=torch.zeros(0, 5),
                         logp=torch.zeros(0, 5))
    assert out["rollout/num_samples"] == 0
    for k in ("rollout/truncation_rate", "rollout/repetition_rate", "adv/repetitive_token_share"):
        assert out[k] == 0.0
    for k in ("rollout/response_len_mean", "rollout/response_len_p90", "adv/repetitive_mean", "logp/student_mean",
              "rollout/truncated_len_mean", "rollout/repeated_ngram_ratio_mean"):
        assert math.isnan(out[k])


def test_rollout_health_all_truncated_single_token_and_empty_response():
    ids = torch.tensor([[7, 0], [0, 0]])
    mask = torch.tensor([[True, False], [False, False]])  # one single-token response, one empty response
    out = rollout_health(mask, token_ids=ids, response_texts=["7", ""], truncated=[True, True],
                         advantages=torch.tensor([[0.5, 0.0], [0.0, 0.0]]))
    assert out["rollout/truncation_rate"] == 1.0
    assert math.isnan(out["rollout/finished_len_mean"]) and out["rollout/truncated_len_mean"] == 0.5
    assert out["rollout/response_len_min"] == 0 and out["rollout/response_len_max"] == 1
    assert out["rollout/repetition_rate"] == 0.0 and out["rollout/repeated_ngram_ratio_mean"] == 0.0
    assert out["adv/other_mean"] == 0.5 and math.isnan(out["adv/repetitive_mean"])


def test_rollout_health_all_golden():
    mask = torch.ones(2, 3, dtype=torch.bool)
    out = rollout_health(mask, truncated=[True, False], is_golden=torch.tensor([True, True]))
    assert out["rollout/num_golden"] == 2 and out["rollout/truncation_rate"] == 0.0


@pytest.mark.parametrize("name", ["advantages", "logp", "teacher_logp", "ref_logp"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_rollout_health_rejects_non_finite(name, bad):
    mask = torch.tensor([[True, True, False]])
    x = torch.zeros(1, 3)
    x[0, 1] = bad
    with pytest.raises(ValueError, match=rf"^{name}: non-finite value .* \[0, 1\]"):
        rollout_health(mask, **{name: x})
    x[0, 1] = 0.0
    x[0, 2] = bad  # padding: ignored
    rollout_health(mask, **{name: x})


def test_rollout_health_rejects_bad_kl_and_shapes():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"kl\['ref'\]: non-finite"):
        rollout_health(mask, kl={"ref": float("nan")})
    with pytest.raises(ValueError, match="kl\\['ref'\\]: expected a scalar"):
        rollout_health(mask, kl={"ref": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"^logp: expected shape \(2, 3\) like response_mask, got \(2,\)"):
        rollout_health(mask, logp=torch.zeros(2))
    with pytest.raises(ValueError, match=r"^advantages: expected shape \(2, 3\)"):
        rollout_health(mask, advantages=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"^token_ids: expected shape"):
        rollout_health(mask, token_ids=[[1, 2, 3]])
    with pytest.raises(ValueError, match=r"^response_mask: expected a \[B, T\] tensor"):
        rollout_health(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="^truncated: has 3 entries"):
        rollout_health(mask, truncated=[True, False, True])
    with pytest.raises(ValueError, match=r"^response_texts\[1\]"):
        rollout_health(mask, response_texts=["a", None])


def test_health_config_validation():
    with pytest.raises(ValueError, match="ngram_n"):
        HealthConfig(ngram_n=0)
    with pytest.raises(ValueError, match="text_threshold"):
        HealthConfig(text_threshold=float("nan"))


@pytest.mark.parametrize("collide", [False, True])
@pytest.mark.parametrize("layout", ["right_padded", "scattered"])
def test_vectorised_mask_matches_python_definition(monkeypatch, collide, layout):
    import megatron_opd.metrics.health as health

    if collide:  # every hash equal: exercises the exact column-by-column fallback
        monkeypatch.setattr(health, "_hash_coef", lambda c: torch.zeros(c, dtype=torch.long))
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 4, (8, 40), generator=g)
    if layout == "right_padded":
        mask = torch.arange(40)[None, :] < torch.randint(0, 41, (8, 1), generator=g)
    else:
        mask = torch.rand(8, 40, generator=g) > 0.25
    for n in (1, 3, 5):
        got = health.repetitive_token_mask(ids, mask, n)
        for b in range(8):
            pos = mask[b].nonzero().flatten().tolist()
            flags = repeated_ngram_flags([int(ids[b, p]) for p in pos], n)
            assert got[b, pos].tolist() == flags
        assert not (got & ~mask).any()
