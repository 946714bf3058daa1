"""Several teachers over two gloo ranks (issue 40, part 1): student TP1 x DP2, teacher "math" a megatron
teacher in its own layout (TP2 over both ranks: `Scorer.score_payload` scores its routed rows' shares) and
teacher "easy" in the student's layout (each rank scores the sub-batch of its own rows routed to it). The run
must match the one with both teachers in the student's layout: the two differ only in the "math" teacher's
summation order (TP2 splits its vocab and heads), so metrics agree to rel 1e-4, per teacher too."""

from __future__ import annotations

import json

import pytest

from _dist import run_distributed
from _tiny import tiny_setup, train_to_end
from megatron_opd.trainer.logger import read_metrics

pytestmark = [pytest.mark.dist, pytest.mark.megatron]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root, student, teacher, data = tiny_setup(tmp_path_factory.mktemp("mtd"), n_train=8, n_eval=2)
    routed = root / "data" / "routed.jsonl"
    rows = [json.loads(line) for line in data["train"].read_text().splitlines()]
    routed.write_text("".join(json.dumps({**r, "teacher": ["math", "easy"][i % 2]}) + "\n" for i, r in enumerate(rows)))
    return root, student, teacher, routed


def _overrides(setup, out, math_tp: int) -> list[str]:
    _root, student, teacher, routed = setup
    return [f"model.hf_path={student}",
            f"teachers=[{{name: math, hf_path: '{teacher}', tensor_model_parallel_size: {math_tp}, top_k: 4}}, "
            f"{{name: easy, hf_path: '{student}', top_k: 4}}]",
            "teacher_route.field=teacher", "algo.golden_loss=fkl_topk",
            "algo.preset=stable_opd", f"data.train_path={routed}", "train.steps=2", "data.shuffle=false",
            "train.prompts_per_step=4", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=8",
            "optim.lr=1e-3", f"logging.out_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
            "checkpoint.save_every=100", "parallel.backend=gloo"]


@pytest.mark.slow
def test_layout_teacher_and_in_layout_teacher_match_both_in_layout(setup, tmp_path):
    runs = {}
    for name, tp in (("same", 1), ("own", 2)):
        assert run_distributed(train_to_end, 2, _overrides(setup, tmp_path / name, tp)) == [2, 2]
        runs[name] = read_metrics(tmp_path / name)
    for same, own in zip(runs["same"], runs["own"]):
        assert own["loss/update_skipped"] == 0.0 and own["rollout/num_golden"] >= 1
        keys = [k for k in same if k.startswith(("loss/", "adv", "logp/teacher")) and isinstance(same[k], float)]
        assert {"adv/mean/math", "adv/mean/easy", "logp/teacher_mean/math", "loss/golden_loss"} <= set(keys)
        assert own["logp/teacher_mean/math"] != own["logp/teacher_mean/easy"]
        for k in keys:
            assert own[k] == pytest.approx(same[k], rel=1e-4, abs=1e-6), (same["step"], k)


PROMPTS, RESPONSES = [[5, 6, 7], [8, 9]], [[40, 41, 2], [50, 51]]


def _temperature_worker(rank: int, world: int, path: str, temperature: float) -> list[list[float]]:
    from megatron_opd.models.parallel import destroy_parallel, init_parallel
    from megatron_opd.teacher.megatron import MegatronTeacher

    init_parallel(tp=1, pp=1, backend="gloo")
    try:
        teacher = MegatronTeacher.from_hf(path, micro_batch_size=2, temperature=temperature)
        return [s.logprobs.tolist() for s in teacher.score(PROMPTS, RESPONSES)]
    finally:
        destroy_parallel()


def test_teacher_temperature_is_softmax_of_logits_over_t(setup):
    """A teacher's `temperature`: log softmax(logits / T) of the HF model's own logits, for the hf and the
    megatron (own layout) backends (the in-layout megatron teacher is a MegatronPolicy at that temperature)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_opd.teacher.hf import HFTeacher

    _root, _student, teacher, _routed = setup
    model = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).eval()
    want = []
    for p, r in zip(PROMPTS, RESPONSES):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:len(p) - 1 + len(r)]
        want.append(torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])
    hf = HFTeacher.from_pretrained(teacher, temperature=0.7).score(PROMPTS, RESPONSES)
    (mg,) = run_distributed(_temperature_worker, 1, str(teacher), 0.7)
    plain = HFTeacher.from_pretrained(teacher).score(PROMPTS, RESPONSES)
    for w, h, m, t1 in zip(want, hf, mg, plain):
        torch.testing.assert_close(h.logprobs, w, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(m), w, atol=1e-4, rtol=0)
        assert not torch.allclose(t1.logprobs, w, atol=1e-3)  # T = 0.7 is not T = 1
