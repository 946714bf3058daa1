"""The trainer on two gloo ranks (TP=2, or DP=2) reproduces the single-process run: the controller
broadcast, vocab-parallel scoring, metric gathering and the collective weight sync all take part."""

from __future__ import annotations

import re

import pytest
import torch

from _dist import run_distributed
from _tiny import tiny_setup, train_to_end
from megatron_opd.trainer.logger import read_metrics

KEYS = ("rollout/response_len_mean", "loss/pg_loss", "loss/kl", "loss/golden_loss", "logp/student_mean",
        "logp/teacher_mean", "loss/grad_norm")


def _overrides(student, teacher, data, out, tp, pp=1, *extra):
    return [f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=megatron",
            f"teacher.tensor_model_parallel_size={tp}", f"parallel.tensor_model_parallel_size={tp}",
            f"teacher.pipeline_model_parallel_size={pp}", f"parallel.pipeline_model_parallel_size={pp}", *extra,
            f"data.train_path={data}", "train.steps=2", "train.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=10", "optim.lr=1e-3", f"logging.out_dir={out}", "logging.progress_bar=false",
            "logging.tensorboard=false", "checkpoint.save_every=2",
            "algo.mixture_ratio=0.34"]  # 4 rollouts + 2 golden: splits evenly over 2 data-parallel ranks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root, student, teacher, data = tiny_setup(tmp_path_factory.mktemp("dist"), n_train=16, n_eval=2)
    return root, student, teacher, data["train"]


# rows of ~190 tokens: micro-batches of 1 and 2 rows, 2 on each rank (ranks with different micro-batch counts:
# test_objective_batching.py::test_logged_losses_equal_the_whole_minibatch_when_ranks_hold_different_micro_batch_counts)
BUDGET = "train.max_tokens_per_microbatch=400"
PACK = "train.pack_sequences=true"  # two rows per packed sequence


@pytest.mark.dist
@pytest.mark.parametrize("layout", [(2, 1, ()), (1, 1, ()), (1, 1, (BUDGET,)),
                                    (1, 2, (BUDGET, "teacher.backend=hf", "teacher.pipeline_model_parallel_size=1")),
                                    (2, 1, (BUDGET, PACK)),
                                    (1, 2, (BUDGET, PACK, "teacher.backend=hf", "teacher.pipeline_model_parallel_size=1")),
                                    (1, 2, ("teacher.hf_path=STUDENT",))],
                         ids=["tp2", "dp2", "dp2-dynamic", "pp2-dynamic", "tp2-packed", "pp2-packed",
                              "pp2-teacher-in-layout"])
def test_two_rank_training_matches_single_process(models, tmp_path, layout):
    """Losses, gradient norm and every health metric equal the single-process run's: the metrics are computed
    over all ranks' rows (before: a mean of the data-parallel ranks' means, so per-token means differed), and
    dynamic batching (micro-batches formed by length, of different sizes per rank; one size per micro-batch
    under PP) and packing (two rows per sequence, under TP and PP) change none of them."""
    tp, pp, extra = layout
    root, student, teacher, data = models
    # the megatron teacher in the student's PP=2 layout (its first stage once crashed on the teacher's missing
    # log-probs): the 2-layer student as its own teacher, since the 3-layer teacher cannot split over PP=2
    extra = tuple(e.replace("STUDENT", str(student)) for e in extra)
    single = tmp_path / "single"
    same = [e for e in extra if e.startswith(("teacher.backend", "teacher.hf_path"))]
    assert run_distributed(train_to_end, 1, _overrides(student, teacher, data, single, 1, 1, *same)) == [2]
    multi = tmp_path / "multi"
    assert run_distributed(train_to_end, 2, _overrides(student, teacher, data, multi, tp, pp, *extra)) == [2, 2]
    a, b = read_metrics(single), read_metrics(multi)
    assert [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        for key in (*KEYS, "loss/total_loss", "rollout/truncation_rate", "adv/mean"):
            assert rb[key] == pytest.approx(ra[key], rel=2e-4, abs=1e-6), (ra["step"], key)
    assert (multi / "checkpoints" / "step_00000002" / "rank1.pt").is_file()


def _control_collectives_and_rank0_resume(rank, world_size, overrides):
    """Two trainers in a row on 2 ranks: the first saves step 1, the second resumes it. Every all_reduce
    the project's own code issues must use a gloo host group (NCCL refuses the CPU tensors they carry),
    and only rank 0 may read the checkpoint pointer."""
    import sys

    import torch.distributed as dist

    from megatron_opd.config import load_config
    from megatron_opd.models import parallel
    from megatron_opd.trainer.checkpoint import CheckpointManager
    from megatron_opd.trainer.loop import Trainer

    bad: list[str] = []
    ours = [0]
    all_reduce = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        caller = sys._getframe(1)
        if caller.f_globals.get("__name__", "").startswith("megatron_opd"):
            ours[0] += 1
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            if group is None or group not in (parallel.host_group("world"), parallel.host_group("dp")):
                bad.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        first = Trainer(load_config(None, overrides))
        try:
            first.train(stop_after=1)
        finally:
            first.close()
        if rank == 1:
            def refuse(self):
                raise AssertionError("rank 1 read the checkpoint pointer itself")
            CheckpointManager.latest_step = refuse
        second = Trainer(load_config(None, overrides))
        try:
            resumed_at = second.step
            second.train()
        finally:
            second.close()
    finally:
        dist.all_reduce = all_reduce
    return bad, ours[0], resumed_at, second.step


@pytest.mark.dist
def test_control_collectives_use_gloo_host_groups_and_rank0_decides_resume(models, tmp_path):
    root, student, teacher, data = models
    overrides = _overrides(student, teacher, data, tmp_path / "run", 1) + [
        "checkpoint.save_every=1", "algo.adv_normalize=true"]
    results = run_distributed(_control_collectives_and_rank0_resume, 2, overrides)
    for bad, ours, resumed_at, final in results:
        assert ours > 0, "the spy saw none of the trainer's collectives"
        assert bad == [], f"collectives outside the gloo host groups: {bad}"
        assert (resumed_at, final) == (1, 2)


def _resume_from(src, dst, step):
    """dst starts as src's checkpoints up to `step` (as a run stopped there would have left them)."""
    import shutil

    (dst / "checkpoints").mkdir(parents=True)
    for d in (src / "checkpoints").glob("step_*"):
        if int(d.name.split("_")[1]) <= step:
            shutil.copytree(d, dst / "checkpoints" / d.name)
    (dst / "checkpoints" / "latest").write_text(f"step_{step:08d}\n")


LAYOUTS = {"tp2": (2, 2, 1), "dp2": (2, 1, 1), "pp2": (2, 1, 2), "one": (1, 1, 1)}  # world, tp, pp


@pytest.mark.dist
@pytest.mark.parametrize("before,after", [("tp2", "dp2"), ("pp2", "one"), ("dp2", "one"), ("one", "tp2")],
                         ids=["tp2-to-dp2", "pp2-to-pp1", "world2-to-1", "world1-to-2"])
def test_resume_on_another_layout_continues_the_run(models, tmp_path, before, after):
    """A checkpoint holds the student and its optimizer as one torch_dist checkpoint: a run stopped at step 1
    on one layout resumes on another (TP<->DP at the same world size, PP2 -> PP1, 2 ranks -> 1 and back) and its
    step 2 equals the uninterrupted run's within fp tolerance; rank 0's file gives the rest of the state."""
    root, student, teacher, data = models
    pp_teacher = ("teacher.backend=hf",)  # the 3-layer tiny teacher cannot split over PP=2
    wa, tpa, ppa = LAYOUTS[before]
    wb, tpb, ppb = LAYOUTS[after]
    common = ("train.steps=2", "checkpoint.save_every=1", "checkpoint.keep_last=3")
    full = tmp_path / "full"
    over_a = _overrides(student, teacher, data, full, tpa, ppa, *pp_teacher) + list(common)
    assert run_distributed(train_to_end, wa, over_a) == [2] * wa
    moved = tmp_path / "moved"
    _resume_from(full, moved, 1)
    over_b = _overrides(student, teacher, data, moved, tpb, ppb, *pp_teacher) + list(common)
    assert run_distributed(train_to_end, wb, over_b) == [2] * wb
    a, b = read_metrics(full), read_metrics(moved)
    assert [r["step"] for r in b] == [2]  # resumed: step 1 was not re-trained
    for key in (*KEYS, "loss/total_loss", "rollout/truncation_rate", "adv/mean"):
        assert b[0][key] == pytest.approx(a[1][key], rel=2e-4, abs=1e-6), key
    from megatron_opd.models.checkpoint import read_weights

    wa_, wb_ = (read_weights(run / "checkpoints" / "step_00000002" / "shared") for run in (full, moved))
    assert wa_.keys() == wb_.keys()
    for k, v in wa_.items():
        u = wb_[k]
        if u.shape != v.shape:  # the vocabulary is padded to a multiple of TP: compare the real rows
            assert u.shape[1:] == v.shape[1:] and "embedding" in k or "output_layer" in k, (k, u.shape, v.shape)
            rows = min(u.shape[0], v.shape[0])
            u, v = u[:rows], v[:rows]
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5)


def _legacy_checkpoint(rank, world_size, overrides):
    """One step, then a checkpoint in the per-rank format of earlier versions (format 1: each rank's student
    shards in its own file), by the writer test_trainer_e2e keeps for that."""
    from megatron_opd.config import load_config
    from megatron_opd.trainer.loop import Trainer
    from test_trainer_e2e import _legacy_save

    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.train(stop_after=1)
        _legacy_save(trainer)
    finally:
        trainer.close()
    return trainer.step


def _resume_error(rank, world_size, overrides):
    from megatron_opd.config import load_config
    from megatron_opd.trainer.loop import Trainer

    try:
        trainer = Trainer(load_config(None, overrides))
    except RuntimeError as e:
        return str(e)
    trainer.close()
    return f"resumed at step {trainer.step}"


@pytest.mark.dist
@pytest.mark.slow
def test_per_rank_checkpoint_of_another_tp_layout_is_refused_at_the_same_world_size(models, tmp_path):
    """Regression: a format-1 checkpoint of an earlier version (its meta.json records the world size only)
    written at TP=2 and resumed at DP=2 (same world size) failed in torch's load_state_dict ("size mismatch" on
    the TP shards); now every rank refuses with the project's text, naming a tensor that does not fit and what
    to do."""
    import json

    root, student, teacher, data = models
    run = tmp_path / "run"
    tp2 = _overrides(student, teacher, data, run, 2) + ["checkpoint.save_every=100"]
    assert run_distributed(_legacy_checkpoint, 2, tp2) == [1, 1]
    step1 = run / "checkpoints" / "step_00000001"
    meta = json.loads((step1 / "meta.json").read_text())
    assert meta.get("format", 1) == 1 and not (step1 / "shared").exists()
    (step1 / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("tp", "pp", "dp")}))
    dp2 = _overrides(student, teacher, data, run, 1) + ["checkpoint.save_every=100"]
    for err in run_distributed(_resume_error, 2, dp2):
        assert "size mismatch" not in err
        assert re.search(r"checkpoint of step 1 under .* is in the per-rank format .* written at another TP/PP layout "
                         r"\(.*: \[.*\] in the checkpoint, \[.*\] here\); it resumes only there \(this run is at "
                         r"tp=1, pp=1\)\. Resume it once at its own layout", err), err
