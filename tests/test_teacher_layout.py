"""A trainer whose in-process megatron teacher has its own layout (issue 12): student TP1 x DP2 with the
teacher TP2 over the same two ranks trains like the same teacher at the student's layout.

Two gloo processes, tiny random models, stable_opd with the forward-KL golden loss so the teacher's top-k
crosses the layouts too (3 prompts x 2 samples + 2 golden = 8 sequences, even over DP=2). The two runs differ only in the teacher's summation order (TP2 splits its vocab
and attention heads), so their losses agree to rel 1e-4.
"""

from __future__ import annotations

import math

import pytest

from _dist import run_distributed
from _tiny import tiny_setup, train_to_end
from megatron_opd.trainer.logger import read_metrics

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("layout"), n_train=8, n_eval=2)


def _four_layer_teacher(root) -> str:
    """The shared tiny teacher has 3 layers; PP2 needs an even count."""
    import json

    from megatron_opd.data.toy_tokenizer import byte_tokenizer
    from megatron_opd.models.tiny import make_tiny_hf_model

    d = root / "teacher4"
    if not d.exists():
        tok = byte_tokenizer()
        make_tiny_hf_model("qwen2", d, seed=7, vocab_size=len(tok), num_hidden_layers=4, eos_token_id=2,
                           pad_token_id=0, bos_token_id=1, max_position_embeddings=2048)
        tok.save_pretrained(str(d))
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return str(d)


def _overrides(setup, out, teacher_tp: int, teacher_pp: int = 1, teacher=None) -> list[str]:
    _root, student, shared_teacher, data = setup
    teacher = teacher or shared_teacher
    return [f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=megatron",
            f"teacher.tensor_model_parallel_size={teacher_tp}", f"teacher.pipeline_model_parallel_size={teacher_pp}",
            "teacher.top_k=4", "algo.golden_loss=fkl_topk",
            "algo.preset=stable_opd", f"data.train_path={data['train']}", "train.steps=2",
            "train.prompts_per_step=3", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=8",
            "optim.lr=1e-3", f"logging.out_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
            "checkpoint.save_every=100", "parallel.backend=gloo"]


@pytest.mark.parametrize("layout", [(2, 1), pytest.param((1, 2), marks=pytest.mark.slow)],
                         ids=["teacher-tp2", "teacher-pp2"])
def test_teacher_with_own_layout_beside_student_dp2_matches_the_shared_layout(setup, tmp_path, layout):
    runs = {}
    teacher = _four_layer_teacher(setup[0]) if layout[1] > 1 else None
    for name, (tp, pp) in (("same", (1, 1)), ("own", layout)):
        out = tmp_path / name
        extra = ["teacher.offload=true"] if name == "own" else []  # weights parked between steps: no change
        assert run_distributed(train_to_end, 2, _overrides(setup, out, tp, pp, teacher) + extra) == [2, 2]
        runs[name] = read_metrics(out)
    for same, own in zip(runs["same"], runs["own"]):
        assert own["rollout/num_golden"] >= 1 and own["loss/update_skipped"] == 0.0
        assert math.isfinite(own["loss/golden_loss"]) and own["loss/golden_loss"] > 0
        keys = [k for k in same if k.startswith(("loss/", "adv", "rollout/teacher", "rollout/adv")) and k in own
                and isinstance(same[k], float)]
        assert "loss/pg_loss" in keys and "loss/golden_loss" in keys
        for k in keys:
            assert own[k] == pytest.approx(same[k], rel=1e-4, abs=1e-6), (same["step"], k)


def test_teacher_layout_must_divide_the_world(setup, tmp_path):
    res = run_distributed(_expect_error, 2, _overrides(setup, tmp_path / "bad", 1) + [
        "teacher.pipeline_model_parallel_size=3"])
    assert all("does not divide the 2 ranks" in r for r in res)


def _expect_error(rank: int, world: int, overrides: list[str]) -> str:
    from megatron_opd.config import load_config
    from megatron_opd.trainer.loop import Trainer

    try:
        Trainer(load_config(None, overrides)).close()
    except ValueError as e:
        return str(e)
    return "no error"


def _score_fails_on_replica_1(rank: int, world: int, overrides: list[str]) -> str:
    """One teacher replica raises while scoring (stand-in for an OOM or a bad sequence on that rank)."""
    from megatron_opd.config import load_config
    from megatron_opd.teacher.megatron import MegatronTeacher
    from megatron_opd.trainer.loop import Trainer

    real = MegatronTeacher.score

    def score(self, *a, **kw):
        if self.layout.dp_rank == 1:
            raise MemoryError("stand-in for an out-of-memory teacher forward")
        return real(self, *a, **kw)

    MegatronTeacher.score = score
    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.train()
    except RuntimeError as e:
        return str(e)
    finally:
        trainer.close()
    return "no error"


def test_a_failing_teacher_replica_fails_every_rank_instead_of_hanging(setup, tmp_path):
    """Student TP2 (one data-parallel replica), teacher TP1: two teacher replicas gather their shares. When
    one raises, the other must not wait forever in the gather: both ranks raise, naming the replica."""
    res = run_distributed(_score_fails_on_replica_1, 2, _overrides(setup, tmp_path / "fail", 1) + [
        "parallel.tensor_model_parallel_size=2", "train.steps=1"])
    assert all("teacher replica 1 (rank 1): MemoryError" in r for r in res), res
