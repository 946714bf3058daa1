"""The full KL's reference under pipeline parallelism runs inside the student's 1F1B schedule
(`models.logprobs.Companion`): each stage forwards its reference layers on the micro-batch it is about to
train and sends their hidden states on beside the student's, so the last stage holds one micro-batch's
reference logits at a time. Before, a forward-only reference pipeline pass ran over the whole minibatch
first and the last stage kept every micro-batch's `[N, V/tp]` logits until the schedule reached them
(~100 GB per GPU for the 7B example at TP2 x PP2 and 8k-token responses; docs/scaling.md).

Real megatron-core over gloo on two processes (PP=2), tiny models; nothing is mocked.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from _dist import run_distributed
from _tiny import tiny_setup

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("refsched"))


def _overrides(setup, out, *extra: str) -> list[str]:
    _root, student, teacher, data = setup
    return ["algo.preset=stable_opd", "algo.kl_estimator=full", "algo.beta_kl=0.5", f"model.hf_path={student}",
            f"teacher.hf_path={teacher}", "teacher.backend=hf", f"data.train_path={data['train']}",
            "train.steps=1", "train.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=12", "optim.lr=0", "train.micro_batch_size=1",
            "parallel.pipeline_model_parallel_size=2", f"logging.out_dir={out}", "logging.progress_bar=false",
            "logging.tensorboard=false", "checkpoint.save_every=100", "checkpoint.resume=never", *extra]


def _old_source(ref, micro):
    """The path this change replaced (Learner.ref_logits_source before it, via the removed
    `MegatronPolicy.response_logits_for`): one forward-only reference pipeline pass over the minibatch's
    micro-batches, each one's response logits attached to it before the student's schedule starts."""
    from megatron_opd.models.logprobs import forward_backward

    out = []
    ref.model.eval()

    def loss_fn(logits, mbd):
        out.append(ref.response_logits(logits, mbd["batch"]))
        return logits.new_zeros(()), {}

    forward_backward(ref.model, [ref.micro_dict(b) for b in micro], loss_fn, forward_only=True)
    for part, logits in zip(micro, out if ref.is_last_stage else [None] * len(micro)):
        part.ref_logits = logits
    return None


def _compare(rank, world_size, overrides):
    """On each PP rank: the minibatch's loss statistics and gradients with the reference inside the schedule
    (the learner's source) and with the old separate pass, and how many reference-logit tensors were alive
    each time a new one was made."""
    from megatron_opd.config import load_config
    from megatron_opd.trainer.batch import SequenceItem, build_batch
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        learner, student, ref = trainer.learner, trainer.student, trainer.ref
        with torch.no_grad():  # a reference that differs from the student, so the KL and its gradient are not 0
            for i, p in enumerate(ref.model.parameters()):
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + i)).to(p.dtype))
        items = [SequenceItem(list(range(5, 25)), [30 + i for i in range(n)], is_golden=n == 6) for n in (3, 9, 1, 6)]
        batch = build_batch(items, trainer.pad_id)
        g = torch.Generator().manual_seed(0)
        batch.extras["teacher_logp"] = -torch.rand(batch.response_mask.shape, generator=g) * 3
        learner.set_old_logp(batch, student.score(batch, micro_batch_size=2)[0])

        live: list[weakref.ref] = []
        alive_at_new: list[int] = []
        real = ref.response_logits

        def tracked(logits, b):
            alive_at_new.append(sum(r() is not None for r in live))
            out = real(logits, b)
            live.append(weakref.ref(out))
            return out

        ref.response_logits = tracked

        def run(source):
            live.clear()
            alive_at_new.clear()
            rows = list(range(batch.batch_size))
            micro = learner.micro_batches(batch, rows)
            loss_fn, want = learner.loss_fn(batch.select(rows), learner.cfg.algo.beta_kl, len(micro))
            stats = student.train_minibatch(micro, loss_fn, want, ref_logits=source(ref, micro))
            grads = {n: p.main_grad.detach().clone() for n, p in student.model.named_parameters()
                     if getattr(p, "main_grad", None) is not None}
            return stats, grads, list(alive_at_new), len(micro)

        return run(learner.ref_logits_source), run(_old_source), student.is_last_stage, str(ref.dtype)
    finally:
        trainer.close()


TP2 = ("parallel.tensor_model_parallel_size=2",)  # no sequence parallelism on the CPU (torch norm refuses it)


@pytest.mark.dist
@pytest.mark.parametrize("dtypes", [(), ("model.ref_params_dtype=bfloat16",),
                                    ("model.params_dtype=bfloat16", "model.ref_params_dtype=float32"),
                                    pytest.param(TP2, marks=pytest.mark.slow)],
                         ids=["same-dtype", "bf16-reference", "fp32-reference-bf16-student", "tp2"])
def test_reference_inside_the_schedule_equals_the_separate_pass_and_holds_one_micro_batch(setup, tmp_path, dtypes):
    """Loss statistics and every gradient equal the old separate reference pass bit for bit, on both
    stages, for a reference in the student's dtype, a narrower one (its hidden states cast up to the
    student's pipeline dtype, exactly) and a wider one (sent as twice the positions), and at TP2 x PP2 (the
    reference's logits vocab-parallel; slow: four processes); and the last stage
    never holds more than one micro-batch's reference logits (the old path: all 4 at once)."""
    world = 4 if dtypes == TP2 else 2
    results = run_distributed(_compare, world, _overrides(setup, tmp_path / "run", *dtypes))
    for (new, old, is_last, ref_dtype) in results:
        (s_new, g_new, alive_new, n_micro), (s_old, g_old, alive_old, _) = new, old
        assert n_micro == 4
        assert g_new.keys() == g_old.keys() and g_new
        for name in g_new:
            assert torch.equal(g_new[name], g_old[name]), name
        assert any(float(g.abs().sum()) > 0 for g in g_new.values())
        if is_last:
            assert alive_new == [0, 0, 0, 0], alive_new
            assert alive_old == [0, 1, 2, 3], alive_old
            assert s_new["kl"] > 1e-6 and s_new.keys() == s_old.keys()
            for k in s_new:
                assert s_new[k] == s_old[k], k
        else:
            assert alive_new == [] and alive_old == []
    want = {"model.ref_params_dtype=bfloat16": "torch.bfloat16", "model.ref_params_dtype=float32": "torch.float32"}
    assert results[0][3] == next((want[d] for d in dtypes if d in want), "torch.float32")


def test_wire_round_trips_a_companion_of_any_width_bit_for_bit():
    """The companion's hidden states survive the trained model's pipeline buffer exactly: cast up when
    narrower, reinterpreted when as wide or wider (an fp32 companion beside a bf16 model: twice the
    positions), NaN and infinity payloads included."""
    from megatron_opd.models.logprobs import _Wire

    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 2, 8, generator=g) * 1e3
    base[0, 0, 0], base[1, 1, 1], base[2, 0, 3] = float("nan"), float("inf"), -float("inf")
    for own, wire, factor in ((torch.float32, torch.float32, 1), (torch.bfloat16, torch.float32, 1),
                              (torch.float16, torch.bfloat16, 1), (torch.float32, torch.bfloat16, 2),
                              (torch.float32, torch.float16, 2)):
        w = _Wire(own, wire)
        t = base.to(own)
        sent = w.encode(t)
        assert w.factor == factor and sent.dtype == wire and sent.shape == (6 * factor, 2, 8)
        back = w.decode(sent.clone())
        assert back.dtype == own and back.shape == t.shape
        assert torch.equal(back.view(torch.int16 if own.itemsize == 2 else torch.int32),
                           t.view(torch.int16 if own.itemsize == 2 else torch.int32)), (own, wire)
