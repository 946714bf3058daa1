"""End-to-end trainer tests on CPU: tiny real-architecture models (random weights), byte tokenizer,
the project's arithmetic prompts, megatron student/reference/teacher, local rollout engine."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from _tiny import tiny_setup, train as _train
from megatron_opd.config import load_config
from megatron_opd.models.checkpoint import read_weights
from megatron_opd.trainer.logger import read_metrics

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("e2e"))


def _cfg(setup, out: Path, preset: str, steps: int, *extra: str):
    _root, student, teacher, data = setup
    return load_config(None, [
        f"algo.preset={preset}", f"model.hf_path={student}", f"teacher.hf_path={teacher}",
        f"data.train_path={data['train']}", f"train.steps={steps}", "train.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=12", "optim.lr=1e-3",
        f"logging.out_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
        "checkpoint.save_every=1", "checkpoint.keep_last=2", *extra])


@pytest.mark.parametrize("preset,teacher_backend", [("opd", "hf"), ("opd_kl", "megatron"), ("stable_opd", "megatron")])
def test_presets_run_and_log_plausible_metrics(setup, tmp_path, preset, teacher_backend):
    out = tmp_path / preset
    _train(_cfg(setup, out, preset, 2, f"teacher.backend={teacher_backend}"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples, "sample rollouts were not logged"
    for r in rows:
        assert 0.0 <= r["rollout/truncation_rate"] <= 1.0
        assert 1 <= r["rollout/response_len_mean"] <= 12
        assert r["rollout/num_samples"] == 4  # prompts_per_step * n_samples_per_prompt
        assert r["train/weight_version"] == r["step"]
        assert r["loss/update_skipped"] == 0.0
        # rollouts come from the engine holding the trainer's weights: pi_old matches behaviour log-probs
        assert r["rollout/engine_trainer_logp_absdiff"] < 1e-3
    if preset == "opd":
        assert rows[0]["loss/golden_loss"] == 0.0 and rows[0]["rollout/num_golden"] == 0
    else:
        assert rows[0]["loss/kl"] == pytest.approx(0.0, abs=1e-5)  # step 1 trains from pi_ref itself
        assert rows[1]["loss/kl"] > 1e-7  # after one update the student has moved away from pi_ref
    if preset == "stable_opd":
        assert rows[0]["rollout/num_golden"] >= 1 and rows[0]["loss/golden_loss"] > 0


def test_truncation_rate_matches_rollouts(setup, tmp_path):
    """With a 1-token budget almost nothing reaches EOS: the logged rate must equal what the samples show."""
    out = tmp_path / "trunc"
    _train(_cfg(setup, out, "opd", 1, "teacher.backend=hf", "rollout.max_new_tokens=1", "logging.sample_every=1"))
    row = read_metrics(out)[0]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    assert row["rollout/truncation_rate"] == pytest.approx(sum(s["truncated"] for s in samples) / len(samples))
    assert all(s["length"] == 1 for s in samples)


def test_resume_reproduces_the_uninterrupted_run(setup, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    _train(_cfg(setup, full, "stable_opd", 3, "teacher.backend=megatron"))
    _train(_cfg(setup, part, "stable_opd", 3, "teacher.backend=megatron"), stop_after=1)  # "killed" after step 1
    resumed = _train(_cfg(setup, part, "stable_opd", 3, "teacher.backend=megatron"))
    assert resumed.step == 3
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ("rollout/response_len_mean", "loss/pg_loss", "loss/kl", "loss/golden_loss", "logp/student_mean",
                    "logp/teacher_mean", "loss/grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    # the weights at the end are the same too
    sa, sb = (read_weights(run / "checkpoints" / "step_00000003" / "shared") for run in (full, part))
    assert sa.keys() == sb.keys() and sa
    for k, v in sa.items():
        torch.testing.assert_close(sb[k], v, rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in (part / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000003"]
    # megatron's torch_dist writer would have started a Manager server process here, which a SIGKILLed rank
    # leaves behind (Slurm then waits 60 s for the step's output to close): saving leaves no child process
    assert not [p.name for p in multiprocessing.active_children() if "Manager" in p.name]


def test_nonfinite_loss_or_grad_skips_the_update_and_is_counted(setup, tmp_path):
    from megatron_opd.models.optimizer import unwrap
    from megatron_opd.trainer.batch import SequenceItem, build_batch
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(_cfg(setup, tmp_path / "nan", "opd", 1, "teacher.backend=hf"))
    try:
        policy = trainer.student
        batch = build_batch([SequenceItem([5, 6, 7], [8, 9, 2]), SequenceItem([5, 6], [7, 2])], trainer.pad_id)
        before = {k: v.clone() for k, v in unwrap(policy.model).state_dict().items() if isinstance(v, torch.Tensor)}

        def nan_loss(logp, _logits, b, _full):
            return (logp * float("nan")).sum(), {}

        def inf_grad(logp, _logits, b, _full):  # finite (zero) loss, infinite gradient
            return torch.sqrt((logp - logp.detach())[b.response_mask]).sum(), {}

        def finite(logp, _logits, b, _full):
            return -logp[b.response_mask].mean(), {}

        s1 = policy.train_minibatch([batch], nan_loss, False)
        s2 = policy.train_minibatch([batch], inf_grad, False)
        assert s1["update_skipped"] == 1.0 and s1["nonfinite_loss"] == 1.0
        assert s2["update_skipped"] == 1.0 and s2["nonfinite_grad"] == 1.0
        after = unwrap(policy.model).state_dict()
        for k, v in before.items():
            assert torch.equal(after[k], v), f"{k} changed by a skipped step"
        s3 = policy.train_minibatch([batch], finite, False)
        assert s3["update_skipped"] == 0.0
        assert any(not torch.equal(unwrap(policy.model).state_dict()[k], v) for k, v in before.items())
    finally:
        trainer.close()


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_sum_const", "token_mean+adv_normalize"])
def test_micro_batches_accumulate_to_the_whole_minibatch(setup, tmp_path, mode):
    """train.micro_batch_size and dynamic batching (train.max_tokens_per_microbatch: micro-batches of
    different sizes, formed by length, for training and for the student, reference and teacher scoring)
    only change memory and speed: losses, gradient norm and weights match one micro-batch per minibatch
    (with adv_normalize too: whitening uses whole-minibatch statistics, not per-micro-batch ones)."""
    mode, _, flag = mode.partition("+")
    extra = [f"algo.{flag}=true"] if flag else []
    runs = {}
    for name, batching in (("mbs1", ["train.micro_batch_size=1"]), ("mbs8", ["train.micro_batch_size=8"]),
                           ("budget", ["train.micro_batch_size=8", "train.max_tokens_per_microbatch=400"]),
                           ("packed", ["train.micro_batch_size=8", "train.max_tokens_per_microbatch=400",
                                       "train.pack_sequences=true"])):
        out = tmp_path / name
        _train(_cfg(setup, out, "stable_opd", 2, "teacher.backend=megatron", *batching,
                    f"algo.loss_agg_mode={mode}", "checkpoint.save_every=2", *extra))
        runs[name] = read_metrics(out)
    for r1, r8, rb, rp in zip(runs["mbs1"], runs["mbs8"], runs["budget"], runs["packed"]):
        for key in ("loss/total_loss", "loss/pg_loss", "loss/kl", "loss/golden_loss", "loss/grad_norm",
                    "rollout/response_len_mean", "logp/teacher_mean", "logp/ref_mean"):
            assert r1[key] == pytest.approx(r8[key], rel=1e-4, abs=1e-7), (r1["step"], key)
            assert rb[key] == pytest.approx(r8[key], rel=1e-4, abs=1e-7), (rb["step"], key, "dynamic batching")
            assert rp[key] == pytest.approx(r8[key], rel=1e-4, abs=1e-7), (rp["step"], key, "packed")
        # 5 rows of 186-193 tokens: 400 tokens hold two of them (groups of 2, 2, 1); one micro-batch pads to 193
        assert 0 <= rb["batch/padding_fraction"] < r8["batch/padding_fraction"] < 1
        assert rp["batch/padding_fraction"] == 0  # packed rows are as long as their tokens


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 2, 3, 6])
def test_gradient_finite_check_sees_every_slice(bad, where):
    """The gradient check walks slices (no whole-tensor masks): a non-finite value at a slice's first or
    last element, or in the short last slice, is still found; finite values whose sum overflows pass."""
    from megatron_opd.algo._checks import all_finite

    g = torch.arange(21, dtype=torch.float32).reshape(3, 7)
    assert all_finite(g, chunk=3)
    assert all_finite(torch.full((3, 7), 3e38), chunk=3)
    g.view(-1)[where * 3 + (2 if where % 2 else 0)] = bad
    assert not all_finite(g, chunk=3)


def test_teacher_keys_reach_the_teacher(setup, tmp_path, monkeypatch):
    """teacher.params_dtype reaches an hf teacher (it was loaded in float32 whatever the key said) and
    teacher.micro_batch_size the megatron teacher in the student's layout (it scored with
    train.micro_batch_size)."""
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(_cfg(setup, tmp_path / "hf", "opd", 1, "teacher.backend=hf", "teacher.params_dtype=bfloat16"))
    try:
        assert next(trainer.teacher.model.parameters()).dtype == torch.bfloat16
        trainer.train()  # scores in bf16, log-softmax in fp32
        row = read_metrics(tmp_path / "hf")[0]
        assert "logp/teacher_mean" in row and torch.isfinite(torch.tensor(row["logp/teacher_mean"]))
    finally:
        trainer.close()
    trainer = Trainer(_cfg(setup, tmp_path / "mg", "opd", 1, "teacher.backend=megatron", "teacher.micro_batch_size=1",
                           "train.micro_batch_size=4"))
    try:
        seen, real = [], trainer.teacher_policy.score
        monkeypatch.setattr(trainer.teacher_policy, "score",
                            lambda batch, micro_batch_size, max_tokens=None, pack=False: seen.append(
                                micro_batch_size) or real(batch, micro_batch_size=micro_batch_size,
                                                          max_tokens=max_tokens, pack=pack))
        trainer.train()
        assert seen == [1]
    finally:
        trainer.close()
    # unset, it scores beside the student's micro-batches (train.micro_batch_size), as before the key applied:
    # 8 would multiply the [n, T, V] response logits of a long-response run several times over
    trainer = Trainer(_cfg(setup, tmp_path / "mg2", "opd", 1, "teacher.backend=megatron", "train.micro_batch_size=3"))
    try:
        assert trainer.scorer.teacher_micro_batch_size() == 3
    finally:
        trainer.close()


def test_run_ends_with_the_student_as_an_hf_directory(setup, tmp_path):
    """`<out>/hf` after a run: loadable by transformers (so `megatron-opd eval --model <out>/hf` works), holding
    the trained weights (not the initial ones), the tokenizer and opd_meta.json; export_hf=false writes none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _root, student, _teacher, _data = setup
    trainer = _train(_cfg(setup, tmp_path / "run", "opd", 2, "teacher.backend=megatron"))
    hf = tmp_path / "run" / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    AutoTokenizer.from_pretrained(hf)
    trained = dict(trainer.student.iter_hf_weights())
    initial = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).state_dict()
    got = model.state_dict()
    for name, t in trained.items():
        torch.testing.assert_close(got[name], t.float(), rtol=0, atol=0)
    assert any(not torch.equal(got[n], initial[n]) for n in trained), "export holds the initial weights"
    meta = json.loads((hf / "opd_meta.json").read_text())
    assert (meta["step"], meta["preset"], meta["source_model"]) == (2, "opd", str(student))
    assert not list(tmp_path.glob("run/.hf*")), "partial export left behind"
    _train(_cfg(setup, tmp_path / "none", "opd", 1, "teacher.backend=megatron", "checkpoint.export_hf=false"))
    assert not (tmp_path / "none" / "hf").exists()


def _legacy_save(trainer) -> None:
    """The per-rank writer of megatron-opd before the torch_dist trainer state (format 1), kept here to make
    such a checkpoint: the student's tensors, optimizer and this rank's distributed-optimizer shard inside."""
    from megatron_opd.models.optimizer import unwrap
    from megatron_opd.trainer.checkpoint import rng_state

    opt = trainer.student.setup.optimizer
    shards = []
    for o in getattr(opt, "chained_optimizers", [opt]):
        shard = o.get_parameter_state_dp_reshardable()
        for key, per_dtype in shard.items():
            if isinstance(key, int):
                for buckets in per_dtype.values():
                    for bucket in buckets:
                        for entry in bucket:
                            entry.setdefault("padding", False)
        shards.append(shard)
    policy = {"model": {k: v for k, v in unwrap(trainer.student.model).state_dict().items()
                        if isinstance(v, torch.Tensor)},
              "optimizer": opt.state_dict(), "optimizer_shards": shards,
              "scheduler": trainer.student.setup.scheduler.state_dict()}
    state = {"policy": policy, "rng": rng_state(), "step": trainer.step, "weight_version": trainer.weight_version,
             "beta_kl": trainer.beta_kl, "skipped_steps": trainer.skipped_steps,
             "sampler": trainer.sampler.state_dict(), **trainer.guard.state_dict()}
    trainer.ckpt.save(trainer.step, state, meta={"beta_kl": trainer.beta_kl})


def test_checkpoint_of_the_per_rank_format_resumes_at_its_layout_and_is_refused_elsewhere(setup, tmp_path):
    from megatron_opd.trainer.checkpoint import CheckpointManager
    from megatron_opd.trainer.loop import Trainer

    full, old = tmp_path / "full", tmp_path / "old"
    _train(_cfg(setup, full, "opd", 2, "checkpoint.save_every=2"))
    trainer = Trainer(_cfg(setup, old, "opd", 2, "checkpoint.save_every=100"))
    try:
        trainer.train(stop_after=1)
        _legacy_save(trainer)
    finally:
        trainer.close()
    step1 = old / "checkpoints" / "step_00000001"
    assert json.loads((step1 / "meta.json").read_text()).get("format", 1) == 1 and not (step1 / "shared").exists()
    resumed = _train(_cfg(setup, old, "opd", 2, "checkpoint.save_every=100"))
    assert resumed.step == 2
    a, b = read_metrics(full), read_metrics(old)
    assert [r["step"] for r in b] == [1, 2]
    for key in ("loss/pg_loss", "logp/student_mean", "logp/teacher_mean", "loss/grad_norm"):
        assert b[1][key] == pytest.approx(a[1][key], rel=1e-5, abs=1e-7), key
    # written by 2 ranks: refused on 1, with what to do
    (step1 / "rank1.pt").write_bytes((step1 / "rank0.pt").read_bytes())
    meta = json.loads((step1 / "meta.json").read_text())
    (step1 / "meta.json").write_text(json.dumps({**meta, "world_size": 2}))
    with pytest.raises(RuntimeError, match=r"per-rank format .* written by 2 ranks; it resumes only there .* "
                                           r"Resume it once at its own layout"):
        CheckpointManager(old / "checkpoints", world_size=1).load(1)
