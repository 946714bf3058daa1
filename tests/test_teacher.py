"""Teacher scoring: HF backend vs unpadded brute force, validation failures, agreement with rollouts."""

from __future__ import annotations

import pytest
import torch

from megatron_opd.models.tiny import make_tiny_hf_model
from megatron_opd.rollout.base import SamplingParams
from megatron_opd.rollout.local import LocalEngine
from megatron_opd.teacher.base import TeacherScore, TeacherScoreError, check_score_inputs, validate_scores
from megatron_opd.teacher.hf import HFTeacher

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20], [30, 31]]
RESPONSES = [[40, 41, 2], [50], [60, 61, 62, 63, 64, 65, 66], []]


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return make_tiny_hf_model("llama", seed=5)


def brute_force(model, prompt, response):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(response)]


def test_hf_teacher_matches_unpadded_forward(model):
    teacher = HFTeacher(model, micro_batch_size=3)
    scores = teacher.score(PROMPTS, RESPONSES, top_k=5)
    assert len(scores) == 4 and [len(s) for s in scores] == [3, 1, 7, 0]
    for p, r, s in zip(PROMPTS, RESPONSES, scores):
        lp = brute_force(model, p, r)
        torch.testing.assert_close(s.logprobs, lp.gather(-1, torch.tensor(r, dtype=torch.long)[:, None])[:, 0],
                                   atol=2e-5, rtol=0)
        vals, ids = torch.topk(lp, 5, dim=-1)
        torch.testing.assert_close(s.topk_logprobs, vals, atol=2e-5, rtol=0)
        assert s.topk_ids.shape == (len(r), 5)
        assert (s.topk_logprobs[:, :-1] >= s.topk_logprobs[:, 1:]).all()


def test_teacher_equals_engine_raw_logprobs_on_same_weights(model):
    """Same weights as the student: A_t = logp_teacher - logp_raw must be ~0 for every token."""
    samples = LocalEngine(model, eos_token_ids=[2]).generate(PROMPTS, SamplingParams(max_new_tokens=9, n=2, seed=1))
    scores = HFTeacher(model, micro_batch_size=4).score([s.prompt_ids for s in samples],
                                                        [s.response_ids for s in samples])
    for s, sc in zip(samples, scores):
        torch.testing.assert_close(sc.logprobs, torch.tensor(s.raw_logprobs), atol=2e-5, rtol=0)


def test_input_errors_name_the_sample(model):
    teacher = HFTeacher(model)
    with pytest.raises(ValueError, match="sample 1 has token ids \\[128\\]"):
        teacher.score([[1], [1]], [[2], [128]])
    with pytest.raises(ValueError, match="prompts\\[0\\] is empty"):
        teacher.score([[]], [[1]])
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        teacher.score([[1], [2]], [[1]])


def test_validate_scores_fails_loudly():
    ok = TeacherScore(logprobs=torch.tensor([-1.0, -2.0]))
    validate_scores([ok], [[3, 4]])
    with pytest.raises(TeacherScoreError, match="sample 0: \\(1,\\) log-probs for a response of 2 tokens"):
        validate_scores([TeacherScore(logprobs=torch.tensor([-1.0]))], [[3, 4]])
    with pytest.raises(TeacherScoreError, match="non-finite log-prob nan at token 1"):
        validate_scores([TeacherScore(logprobs=torch.tensor([-1.0, float("nan")]))], [[3, 4]])
    with pytest.raises(TeacherScoreError, match="log-prob > 0"):
        validate_scores([TeacherScore(logprobs=torch.tensor([-1.0, 0.5]))], [[3, 4]])
    with pytest.raises(TeacherScoreError, match="returned 1 scores for 2 responses"):
        validate_scores([ok], [[3, 4], [5, 6]])
    with pytest.raises(TeacherScoreError, match="top-3 log-probs requested but missing"):
        validate_scores([ok], [[3, 4]], top_k=3)
    with pytest.raises(TeacherScoreError, match="top-k shapes"):
        validate_scores([TeacherScore(ok.logprobs, torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2))],
                        [[3, 4]], top_k=3)
    with pytest.raises(ValueError, match="top_k=200 exceeds"):
        check_score_inputs([[1]], [[1]], vocab_size=128, top_k=200)


def test_factories_from_config(tmp_path):
    from megatron_opd.config import RolloutConfig, TeacherConfig
    from megatron_opd.rollout import check_eos_compat, make_rollout_engine
    from megatron_opd.teacher import make_teacher

    make_tiny_hf_model("qwen2", out_dir=tmp_path, seed=0)
    engine = make_rollout_engine(RolloutConfig(backend="local"), str(tmp_path))
    teacher = make_teacher(TeacherConfig(backend="hf", hf_path=str(tmp_path)))
    assert check_eos_compat(engine.eos_token_ids, teacher.eos_token_ids) == [2]
    s = engine.generate([[5, 6]], SamplingParams(max_new_tokens=4, seed=0))[0]
    (sc,) = teacher.score([s.prompt_ids], [s.response_ids])
    torch.testing.assert_close(sc.logprobs, torch.tensor(s.raw_logprobs), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="teacher.server_url"):
        make_teacher(TeacherConfig(backend="sglang", hf_path=str(tmp_path)))
    sg = make_teacher(TeacherConfig(backend="sglang", hf_path=str(tmp_path), server_url="http://127.0.0.1:9",
                                    retries=1, api_key_env="TEST_TEACHER_KEY"), eos_token_ids=[2])
    from transformers import AutoConfig

    assert sg.vocab_size == AutoConfig.from_pretrained(str(tmp_path)).vocab_size and sg.retries == 1
