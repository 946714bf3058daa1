"""LocalEngine: log-probs vs a teacher-forced forward, sampling filters, stop/length, seeds, weight sync."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_opd.models.tiny import make_tiny_hf_model
from megatron_opd.rollout.base import (EOSMismatchError, SamplingParams, StaleWeightsError, assert_fresh,
                                       check_eos_compat, eos_ids_from, iter_buckets, push_weights)
from megatron_opd.rollout.local import LocalEngine, filter_logits

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20]]


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def qwen():
    return make_tiny_hf_model("qwen2", seed=0)


def forward_logits(model, prompt, response):
    """Plain full (no cache, no padding) forward: logits predicting each response token, float32 [T, V]."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1:-1]


def gather(lp, ids):
    return lp.gather(-1, torch.tensor(ids)[:, None])[:, 0]


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_logprobs_match_teacher_forcing(family):
    model = make_tiny_hf_model(family, seed=1)
    eng = LocalEngine(model, eos_token_ids=[2])
    temp = 0.7
    samples = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=temp, n=2, seed=3))
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    for s in samples:
        assert s.prompt_ids == PROMPTS[s.prompt_index]
        logits = forward_logits(model, s.prompt_ids, s.response_ids)
        raw = gather(torch.log_softmax(logits, -1), s.response_ids)
        tempered = gather(torch.log_softmax(logits / temp, -1), s.response_ids)
        torch.testing.assert_close(torch.tensor(s.raw_logprobs), raw, atol=2e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(s.logprobs), tempered, atol=2e-5, rtol=0)


def test_top_k_top_p_logprobs_are_renormalised_sampling_distribution(qwen):
    eng = LocalEngine(qwen, eos_token_ids=[2])
    sp = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=10, top_p=0.5, n=3, seed=0)
    for s in eng.generate(PROMPTS, sp):
        logits = forward_logits(qwen, s.prompt_ids, s.response_ids) / 0.9
        for t, tok in enumerate(s.response_ids):
            # brute force: sort, keep the top-10, then the smallest prefix with mass >= 0.5, renormalise
            probs = torch.softmax(logits[t], -1)
            order = torch.argsort(logits[t], descending=True)[:10]
            kept, mass = [], 0.0
            p10 = probs[order] / probs[order].sum()
            for j, idx in enumerate(order.tolist()):
                kept.append(idx)
                mass += p10[j].item()
                if mass >= 0.5:
                    break
            assert tok in kept
            expected = torch.log(probs[tok] / probs[kept].sum())
            assert abs(s.logprobs[t] - expected.item()) < 1e-4


def test_filter_logits_nucleus_is_smallest_prefix():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]))
    out = filter_logits(logits, 1.0, -1, 0.7)  # 0.4 + 0.3 = 0.7 reaches 0.7
    assert torch.isfinite(out).tolist() == [[True, True, False, False], [False, False, True, True]]
    out = filter_logits(logits, 1.0, -1, 0.71)
    assert torch.isfinite(out).sum(-1).tolist() == [3, 3]
    out = filter_logits(logits, 2.0, 1, 1.0)
    assert torch.isfinite(out).tolist() == [[True, False, False, False], [False, False, False, True]]
    torch.testing.assert_close(out[0, 0], logits[0, 0] / 2)


def test_sampling_frequencies_follow_reported_distribution(qwen):
    eng = LocalEngine(qwen, eos_token_ids=[2], max_batch_size=1000)
    sp = SamplingParams(max_new_tokens=1, temperature=0.5, top_k=4, n=3000, seed=11)
    samples = eng.generate([[5, 6, 7]], sp)
    toks = torch.tensor([s.response_ids[0] for s in samples])
    lp_by_tok = {s.response_ids[0]: s.logprobs[0] for s in samples}
    assert len(lp_by_tok) <= 4
    q = torch.softmax(filter_logits(forward_logits(qwen, [5, 6, 7], [0])[0:1], 0.5, 4, 1.0), -1)[0]
    for tok, lp in lp_by_tok.items():
        freq = (toks == tok).float().mean().item()
        assert abs(freq - q[tok].item()) < 0.035, (tok, freq, q[tok].item())
        assert abs(lp - q[tok].log().item()) < 1e-5


def test_greedy_batched_equals_unbatched(qwen):
    """Left padding + per-row positions + dropping finished rows must not change any row's output."""
    eng = LocalEngine(qwen, eos_token_ids=[2])
    sp = SamplingParams(max_new_tokens=10, temperature=0.0)
    batched = eng.generate(PROMPTS, sp)
    for i, p in enumerate(PROMPTS):
        alone = eng.generate([p], sp)[0]
        assert batched[i].response_ids == alone.response_ids
        torch.testing.assert_close(torch.tensor(batched[i].logprobs), torch.tensor(alone.logprobs), atol=2e-5, rtol=0)
        expected = forward_logits(qwen, p, alone.response_ids).argmax(-1).tolist()
        assert alone.response_ids == expected


def test_truncation_exactly_at_max_new_tokens_and_eos_stops(qwen):
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    ref = LocalEngine(qwen, eos_token_ids=[127]).generate([[5, 6, 7]], greedy)[0]
    first_new = next(j for j, t in enumerate(ref.response_ids) if t not in ref.response_ids[:j] and j >= 2)
    eos = ref.response_ids[first_new]
    if 127 not in ref.response_ids:
        assert ref.finish_reason == "length" and len(ref.response_ids) == 6 and ref.truncated
    stopped = LocalEngine(qwen, eos_token_ids=[eos]).generate([[5, 6, 7]], greedy)[0]
    assert stopped.finish_reason == "stop" and not stopped.truncated
    assert stopped.response_ids == ref.response_ids[:first_new + 1]  # EOS included
    # the same through per-request stop ids
    via_stop = LocalEngine(qwen, eos_token_ids=[127]).generate(
        [[5, 6, 7]], SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=[eos]))[0]
    assert via_stop.response_ids == stopped.response_ids and via_stop.finish_reason == "stop"


def test_sampled_finish_reasons_consistent(qwen):
    eng = LocalEngine(qwen, eos_token_ids=[2, 3, 4, 5])  # 4/128 of the vocab: some samples stop early
    samples = eng.generate(PROMPTS, SamplingParams(max_new_tokens=15, n=8, seed=5))
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}
    for s in samples:
        assert len(s.logprobs) == len(s.raw_logprobs) == len(s.response_ids) >= 1
        assert not set(s.response_ids[:-1]) & {2, 3, 4, 5}
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in {2, 3, 4, 5} and len(s) <= 15
        else:
            assert len(s) == 15
        # rows that finished early were dropped from the KV cache mid-batch; the others must be unaffected
        raw = gather(torch.log_softmax(forward_logits(qwen, s.prompt_ids, s.response_ids), -1), s.response_ids)
        torch.testing.assert_close(torch.tensor(s.raw_logprobs), raw, atol=2e-5, rtol=0)
    assert len({len(s) for s in samples}) > 2


def test_seeds_reproduce(qwen):
    eng = LocalEngine(qwen, eos_token_ids=[2])
    sp = SamplingParams(max_new_tokens=10, n=2, seed=42)
    a = eng.generate(PROMPTS, sp)
    b = eng.generate(PROMPTS, sp)
    c = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, n=2, seed=43))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_bad_inputs_rejected(qwen):
    eng = LocalEngine(qwen, eos_token_ids=[2])
    with pytest.raises(ValueError, match="prompts\\[1\\]"):
        eng.generate([[1], [500]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([[]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="top_p"):
        eng.generate([[1]], SamplingParams(max_new_tokens=2, top_p=0.0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([[1]], SamplingParams(max_new_tokens=0))


def test_weight_sync_round_trip_and_versions():
    model = make_tiny_hf_model("qwen2", seed=2)
    eng = LocalEngine(model, eos_token_ids=[2])
    sp = SamplingParams(max_new_tokens=10, n=2, seed=7)
    original = {n: t.clone() for n, t in eng.named_hf_weights()}
    before = eng.generate(PROMPTS, sp)
    assert_fresh(before, 0)

    g = torch.Generator().manual_seed(0)
    perturbed = {n: t + 0.5 * torch.randn(t.shape, generator=g) for n, t in original.items()}
    n_buckets = push_weights(eng, perturbed.items(), version=1, bucket_mb=0.05)
    assert n_buckets > 1 and eng.weight_version == 1
    after = eng.generate(PROMPTS, sp)
    assert [s.response_ids for s in after] != [s.response_ids for s in before]
    assert all(s.weight_version == 1 for s in after)
    with pytest.raises(StaleWeightsError, match="expected weight_version=1"):
        assert_fresh(before + after, 1)

    push_weights(eng, original.items(), version=2)
    restored = eng.generate(PROMPTS, sp)
    assert [s.response_ids for s in restored] == [s.response_ids for s in before]
    assert [s.logprobs for s in restored] == [s.logprobs for s in before]
    assert_fresh(restored, 2)


def test_update_weights_errors_and_partial_state():
    model = make_tiny_hf_model("llama", seed=3)
    eng = LocalEngine(model, eos_token_ids=[2])
    w = dict(eng.named_hf_weights())
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="unknown parameter name 'model.bogus'"):
        eng.update_weights([("model.bogus", torch.zeros(1))], version=1)
    with pytest.raises(ValueError, match=f"{name}: shape"):
        eng.update_weights([(name, torch.zeros(3, 3))], version=1)
    with pytest.raises(ValueError, match="NaN"):
        eng.update_weights([(name, torch.full_like(w[name], float("nan")))], version=1)
    with pytest.raises(ValueError, match="must be > current weight_version 0"):
        eng.update_weights(w.items(), version=0)
    eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))  # failed first buckets copied nothing

    eng.update_weights([(name, w[name])], version=1, last_bucket=False)
    assert eng.weight_version == 0
    with pytest.raises(RuntimeError, match="in progress"):
        eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="incomplete"):
        eng.update_weights([], version=1, last_bucket=True)
    with pytest.raises(RuntimeError, match="mixed weights"):
        eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    eng.update_weights(w.items(), version=3)
    assert eng.weight_version == 3
    eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))


def test_share_weights_decodes_from_the_given_storage():
    """share_weights: the engine's parameters become the given tensors (no copy), so an in-place change
    of the source is what the engine decodes with; update_weights onto a shared tensor copies nothing;
    bad tensors are refused before anything is shared."""
    src_model = make_tiny_hf_model("qwen2", seed=5)
    eng = LocalEngine(make_tiny_hf_model("qwen2", seed=6), eos_token_ids=[2])
    src = dict(src_model.state_dict())
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="unknown parameter name"):
        eng.share_weights([("model.bogus", torch.zeros(1))])
    with pytest.raises(ValueError, match=f"{name}: .*float64"):
        eng.share_weights([(name, src[name].double())])
    with pytest.raises(ValueError, match=f"{name}: not contiguous"):
        eng.share_weights([(name, src[name].t().contiguous().t())])
    with pytest.raises(ValueError, match=f"{name}: contains NaN"):
        eng.share_weights([(name, torch.full_like(src[name], float("nan")))])
    assert all(p.data_ptr() != src[n].data_ptr() for n, p in eng._params.items() if n in src)  # nothing shared yet

    shared = eng.share_weights(src.items())
    assert shared == sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in src.values()}.values())
    assert all(eng._params[n].data_ptr() == t.data_ptr() for n, t in src.items())
    assert eng.share_weights(src.items()) == 0  # already shared
    sp = SamplingParams(max_new_tokens=8, n=2, seed=1)
    reference = LocalEngine(src_model, eos_token_ids=[2])
    assert [s.logprobs for s in eng.generate(PROMPTS, sp)] == [s.logprobs for s in reference.generate(PROMPTS, sp)]

    with torch.no_grad():
        src[name].mul_(3.0)  # the "optimizer step" happens in the source's storage
    assert [s.logprobs for s in eng.generate(PROMPTS, sp)] == [s.logprobs for s in reference.generate(PROMPTS, sp)]
    eng.update_weights(src.items(), version=1)
    assert eng.weight_version == 1 and eng._params[name].data_ptr() == src[name].data_ptr()


def test_tied_embeddings_counted_once():
    model = make_tiny_hf_model("qwen2", seed=4, tie_word_embeddings=True)
    eng = LocalEngine(model, eos_token_ids=[2])
    names = [n for n, _ in eng.named_hf_weights()]
    assert "lm_head.weight" not in names or "model.embed_tokens.weight" not in names
    eng.update_weights(list(eng.named_hf_weights()), version=1)
    assert eng.weight_version == 1


def test_from_pretrained_and_eos_ids(tmp_path):
    model = make_tiny_hf_model("qwen2", out_dir=tmp_path / "s", seed=0)
    gc = tmp_path / "s" / "generation_config.json"
    gc.write_text(json.dumps({"eos_token_id": [2, 7]}))
    eng = LocalEngine.from_pretrained(tmp_path / "s")
    assert eng.eos_token_ids == [2, 7]
    assert eos_ids_from(model) == [2]
    a = eng.generate([[5, 6]], SamplingParams(max_new_tokens=5, temperature=0.0))[0]
    b = LocalEngine(model, eos_token_ids=[2, 7]).generate([[5, 6]], SamplingParams(max_new_tokens=5, temperature=0.0))[0]
    assert a.response_ids == b.response_ids

    make_tiny_hf_model("llama", out_dir=tmp_path / "t", seed=1)
    with pytest.raises(EOSMismatchError, match=r"student \[2, 7\] vs teacher \[2\]"):
        check_eos_compat(tmp_path / "s", tmp_path / "t")
    assert check_eos_compat(model, str(tmp_path / "t")) == [2]
    assert check_eos_compat([2, 7], [7, 2]) == [2, 7]


def test_iter_buckets_bounds_size():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    buckets = list(iter_buckets(tensors, bucket_bytes=80))  # 20 floats per bucket
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
