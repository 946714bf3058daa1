"""Megatron teacher (forward-only GPTModel, own TP/PP) vs the HF teacher on the same weights."""

from __future__ import annotations

import pytest
import torch

from _dist import run_distributed
from megatron_opd.models.tiny import make_tiny_hf_model
from megatron_opd.teacher.hf import HFTeacher

pytestmark = pytest.mark.dist

PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [20], [3, 4], [7, 7, 7, 7, 7]]
RESPONSES = [[40, 41, 2], [50], [60, 61, 62, 63, 64], [], [1, 2]]
TOP_K = 4


def _worker(rank: int, world: int, path: str, tp: int, pp: int, mbs: int, max_tokens: int | None = None,
            pack: bool = False) -> list[dict]:
    from megatron_opd.models.parallel import destroy_parallel, init_parallel
    from megatron_opd.teacher.megatron import MegatronTeacher

    init_parallel(tp=tp, pp=pp, backend="gloo")
    try:
        teacher = MegatronTeacher.from_hf(path, micro_batch_size=mbs, max_tokens=max_tokens, pack=pack)
        scores = teacher.score(PROMPTS, RESPONSES, top_k=TOP_K)
        # plain lists: tensors through the queue share fds that die with the worker process
        return [{"lp": s.logprobs.tolist(), "ids": s.topk_ids.tolist(), "tlp": s.topk_logprobs.tolist()}
                for s in scores]
    finally:
        destroy_parallel()


def _check(results: list[list[dict]], path) -> None:
    expected = HFTeacher.from_pretrained(path).score(PROMPTS, RESPONSES, top_k=TOP_K)
    assert results and len(expected) == len(PROMPTS)
    for rank_res in results:  # every rank returns the full answer: one result per sequence, none missing
        assert len(rank_res) == len(expected), (len(rank_res), len(expected))
        for e, g in zip(expected, rank_res):
            torch.testing.assert_close(torch.tensor(g["lp"]).reshape(-1), e.logprobs, atol=1e-4, rtol=0)
            torch.testing.assert_close(torch.tensor(g["tlp"]).reshape(-1, TOP_K), e.topk_logprobs, atol=1e-4, rtol=0)
            assert torch.equal(torch.tensor(g["ids"], dtype=torch.long).reshape(-1, TOP_K), e.topk_ids)


@pytest.mark.parametrize("family", ["qwen2", pytest.param("llama", marks=pytest.mark.slow)])
def test_megatron_teacher_matches_hf_single_rank(tmp_path, family):
    make_tiny_hf_model(family, out_dir=tmp_path, seed=3)
    _check(run_distributed(_worker, 1, str(tmp_path), 1, 1, 2), tmp_path)


@pytest.mark.parametrize("batching", [(10, False), (12, True), (100, True)], ids=["budget10", "packed12", "packed-all"])
def test_megatron_teacher_batched_by_tokens_matches_hf(tmp_path, batching):
    """Forwards formed by length (dynamic batching) or packed (several sequences per row, attention kept
    inside each: a block-diagonal causal mask on the local spec) score exactly what HF scores per row."""
    make_tiny_hf_model("qwen2", out_dir=tmp_path, seed=3)
    _check(run_distributed(_worker, 1, str(tmp_path), 1, 1, 2, *batching), tmp_path)


def test_megatron_teacher_packed_pp2_matches_hf(tmp_path):
    """Packed under PP=2: every packed row padded to one shape for the pipeline's exchange."""
    make_tiny_hf_model("llama", out_dir=tmp_path, seed=5)
    _check(run_distributed(_worker, 2, str(tmp_path), 1, 2, 2, 12, True), tmp_path)


@pytest.mark.slow
def test_megatron_teacher_tp2_matches_hf(tmp_path):
    make_tiny_hf_model("qwen2", out_dir=tmp_path, seed=4, vocab_size=200)  # padded vocab split over 2 ranks
    _check(run_distributed(_worker, 2, str(tmp_path), 2, 1, 3), tmp_path)


@pytest.mark.slow
def test_megatron_teacher_pp2_matches_hf(tmp_path):
    make_tiny_hf_model("llama", out_dir=tmp_path, seed=5)
    _check(run_distributed(_worker, 2, str(tmp_path), 1, 2, 2), tmp_path)


# -- a teacher with its own layout beside a student laid out differently (issue 12) -------------------

def _layout_worker(rank: int, world: int, path: str, student: tuple, teacher: tuple, mbs: int) -> list[dict]:
    """megatron's global state is the student's layout; the teacher gets its own groups (make_layout)."""
    from megatron.core import parallel_state

    from megatron_opd.models.parallel import destroy_parallel, init_parallel, make_layout
    from megatron_opd.teacher.megatron import MegatronTeacher

    init_parallel(tp=student[0], pp=student[1], backend="gloo")
    try:
        layout = make_layout(*teacher)
        t = MegatronTeacher.from_hf(path, micro_batch_size=mbs, layout=layout)
        scores = t.score(PROMPTS, RESPONSES, top_k=TOP_K)
        # the student's global groups are untouched
        assert parallel_state.get_tensor_model_parallel_world_size() == student[0]
        return [{"lp": s.logprobs.tolist(), "ids": s.topk_ids.tolist(), "tlp": s.topk_logprobs.tolist()}
                for s in scores]
    finally:
        destroy_parallel()


@pytest.mark.parametrize("teacher", [(2, 1), (1, 2)], ids=["teacher-tp2", "teacher-pp2"])
def test_teacher_with_its_own_layout_matches_hf(tmp_path, teacher):
    """Student TP1 x DP2 (megatron's global groups); the teacher TP2 (or PP2) over the same two ranks:
    log-probs and top-k equal the single-process HF teacher's (atol 1e-4, fp32)."""
    make_tiny_hf_model("qwen3", out_dir=tmp_path, seed=6, vocab_size=200)
    _check(run_distributed(_layout_worker, 2, str(tmp_path), (1, 1), teacher, 2), tmp_path)
