"""The step's shortcuts (issue 10) change no numbers, on CPU with the tiny models of tests/_tiny.py.

- Response-only logits: the LM head runs at response positions only; log-probs and gradients equal
  those from the full `[B, S, V]` logits.
- pi_old reuse: one update per step takes pi_old from the training forward; the step's losses, metrics
  and updated weights equal those of the run that scores pi_old separately. Full-KL steps take the
  reference's token log-probs from the logits the KL already needs; metrics equal the separate pass.
- bf16: a bf16 student, reference and teacher stay within stated tolerances of fp32.
- Decode threads: the local engine decodes with rollout.num_threads and restores torch's setting.
"""

from __future__ import annotations

import math

import pytest
import torch

from _tiny import tiny_setup
from megatron_opd.config import load_config
from megatron_opd.trainer.batch import SequenceItem, build_batch

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("shortcuts"))


def _cfg(setup, out, *extra: str):
    _root, student, teacher, data = setup
    return load_config(None, [
        "algo.preset=stable_opd", "algo.kl_estimator=full", f"model.hf_path={student}", f"teacher.hf_path={teacher}",
        "teacher.backend=megatron", f"data.train_path={data['train']}", "train.steps=2", "train.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=12", "optim.lr=1e-3", f"logging.out_dir={out}",
        "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.save_every=100",
        "checkpoint.resume=never", "train.micro_batch_size=2", *extra])


def _batch(pad_id: int):
    items = [SequenceItem(list(range(5, 25)), [30 + i for i in range(n)], is_golden=n == 6) for n in (3, 9, 1, 6)]
    return build_batch(items, pad_id)


def _grads(policy) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in policy.model.named_parameters()
            if getattr(p, "main_grad", None) is not None}


def test_response_only_logits_give_the_same_logprobs_and_gradients(setup, tmp_path):
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(_cfg(setup, tmp_path / "run", "optim.lr=0"))
    try:
        policy = trainer.student
        assert policy.select_rows
        batch = _batch(trainer.pad_id)
        rows = [batch.select([0, 1]), batch.select([2, 3])]
        length = max(r.tokens.shape[1] for r in rows)
        from megatron_opd.trainer.batch import pad_batch

        micro = [pad_batch(r, 2, length) for r in rows]
        head_rows: list[int] = []
        hook = policy.model.module.output_layer.register_forward_hook(
            lambda m, args, out: head_rows.append(args[0].shape[0] * args[0].shape[1]))

        def loss_fn(logp, _resp, b, _logits):
            return -(logp * b.response_mask).sum() / 7.0, {}

        def run():
            head_rows.clear()
            lp, _ = policy.score(batch, micro_batch_size=2)
            policy.train_minibatch(micro, loss_fn, want_logits=False)
            return lp, _grads(policy), list(head_rows)

        lp_rows, g_rows, seen_rows = run()
        policy.select_rows = False  # the full-logits path: LM head on every position, rows gathered after
        lp_full, g_full, seen_full = run()
        hook.remove()
    finally:
        trainer.close()
    n_resp = int(batch.response_mask.sum())
    assert sum(seen_rows) == 2 * n_resp  # scoring + training: response positions only
    assert sum(seen_full) > 2 * sum(seen_rows)  # the prompts dominate these sequences
    torch.testing.assert_close(lp_rows, lp_full, rtol=0, atol=1e-6)
    assert g_rows.keys() == g_full.keys() and g_rows
    for k in g_rows:
        torch.testing.assert_close(g_rows[k], g_full[k], rtol=1e-5, atol=1e-7, msg=k)
    assert any(float(g.abs().sum()) > 0 for g in g_rows.values())


def _one_step(setup, out, *extra):
    """(metrics of one train_step, weights after it, pi_old scoring passes) for a fresh trainer."""
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(_cfg(setup, out, *extra))
    try:
        calls = []
        real = trainer.student.score
        trainer.student.score = lambda *a, **k: calls.append(1) or real(*a, **k)
        ref_calls = []
        real_ref = trainer.ref.score
        trainer.ref.score = lambda *a, **k: ref_calls.append(1) or real_ref(*a, **k)
        metrics = trainer.train_step()
        weights = {k: v.detach().clone() for k, v in trainer.student.model.state_dict().items()
                   if isinstance(v, torch.Tensor)}
        return metrics, weights, len(calls), len(ref_calls)
    finally:
        trainer.close()


@pytest.mark.parametrize("estimator", ["full", "k3"])
def test_pi_old_reuse_gives_the_same_step(setup, tmp_path, estimator):
    m_reuse, w_reuse, n_old_reuse, n_ref_reuse = _one_step(setup, tmp_path / "a", f"algo.kl_estimator={estimator}")
    m_sep, w_sep, n_old_sep, n_ref_sep = _one_step(setup, tmp_path / "b", f"algo.kl_estimator={estimator}",
                                                   "train.reuse_old_logp=false")
    assert (n_old_reuse, n_old_sep) == (0, 1)
    # full KL: the reference's token log-probs come from its per-micro-batch logits, no separate pass
    assert (n_ref_reuse, n_ref_sep) == ((0, 0) if estimator == "full" else (1, 1))
    keys = sorted(k for k in m_sep if not k.startswith(("time/", "system/", "gpu/", "mem/")))
    assert set(keys) <= set(m_reuse), set(keys) - set(m_reuse)
    for k in ("loss/total_loss", "loss/pg_loss", "loss/kl", "loss/golden_loss", "logp/student_mean",
              "logp/ref_mean", "adv/mean", "rollout/engine_trainer_logp_absdiff"):
        assert k in keys, k
    for k in keys:
        a, b = m_reuse[k], m_sep[k]
        if isinstance(b, float) and math.isnan(b):
            assert math.isnan(a), k
        else:
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6), k
    for k in w_sep:
        torch.testing.assert_close(w_reuse[k], w_sep[k], rtol=1e-5, atol=1e-6, msg=k)


def test_pi_old_reuse_only_when_the_step_makes_one_update(setup, tmp_path):
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(_cfg(setup, tmp_path / "run"))
    try:
        assert trainer.learner.reuse_old_logp(8)
        for key, value in (("ppo_epochs", 2), ("num_minibatches", 2), ("adv_normalize", True)):
            saved = getattr(trainer.cfg.algo, key)
            setattr(trainer.cfg.algo, key, value)
            assert not trainer.learner.reuse_old_logp(8), key
            setattr(trainer.cfg.algo, key, saved)
        trainer.cfg.algo.num_minibatches = 2
        assert trainer.learner.reuse_old_logp(1)  # one sequence: one minibatch whatever the setting
    finally:
        trainer.close()


def test_bf16_policies_stay_within_tolerance(setup, tmp_path):
    """bf16 weights and activations with fp32 log-softmax: token log-probs within 0.05 of fp32 (bf16 keeps
    8 mantissa bits: logits of magnitude ~1 carry ~4e-3 rounding per op), and a bf16 step trains."""
    from megatron_opd.trainer.loop import Trainer

    batch = _batch(0)
    out = {}
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(_cfg(setup, tmp_path / dtype, f"model.params_dtype={dtype}", f"teacher.params_dtype={dtype}",
                               f"model.ref_params_dtype={dtype}"))
        try:
            assert trainer.student.dtype == trainer.ref.dtype == trainer.teacher_policy.dtype == getattr(torch, dtype)
            out[dtype] = {name: p.score(batch, micro_batch_size=2)[0]
                          for name, p in (("student", trainer.student), ("ref", trainer.ref),
                                          ("teacher", trainer.teacher_policy))}
            out[dtype]["metrics"] = trainer.train_step()
        finally:
            trainer.close()
    for name in ("student", "ref", "teacher"):
        lp32, lp16 = out["float32"][name], out["bfloat16"][name]
        assert lp16.dtype == torch.float32
        gap = float((lp32 - lp16).abs()[batch.response_mask].max())
        assert 0 < gap < 0.05, (name, gap)
    m = out["bfloat16"]["metrics"]
    assert math.isfinite(m["loss/total_loss"]) and m.get("loss/update_skipped", 0.0) == 0.0
    # the rollout engine runs the student's dtype: its gap to the trainer's pi_old is reported
    assert 0 <= m["rollout/engine_trainer_logp_absdiff"] < 0.05


def test_bf16_mixed_precision_step_tracks_fp32(setup, tmp_path):
    """One training step from the same weights on the same rollouts (an fp32 engine in both runs): a bf16 student
    (megatron's mixed precision: bf16 compute, fp32 main weights, gradients and Adam; fp32 log-softmax and
    loss) against an fp32 one. Stated tolerances: the step's loss within 0.05 (relative, at least 0.05
    absolute), its update's direction (cosine of the weight change, Adam's first step ~ lr * sign(grad))
    >= 0.9, and its size within 10%."""
    from megatron_opd.trainer.loop import Trainer

    out = {}
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(_cfg(setup, tmp_path / dtype, f"model.params_dtype={dtype}", "teacher.params_dtype=float32",
                               "model.ref_params_dtype=float32", "rollout.dtype=float32", "algo.num_minibatches=1"))
        try:
            before = {n: t.float().clone() for n, t in trainer.student.iter_hf_weights()}
            m = trainer.train_step()
            after = {n: t.float() for n, t in trainer.student.iter_hf_weights()}
            opt = trainer.student.setup.optimizer
            opts = getattr(opt, "chained_optimizers", [opt])  # megatron may chain one optimizer per param group
            mains = [p for o in opts for g in getattr(o, "shard_fp32_from_float16_groups", []) for p in g]
            out[dtype] = {"loss": m["loss/total_loss"], "texts": m.get("rollout/response_length_mean"),
                          "delta": torch.cat([(after[n] - before[n]).flatten() for n in sorted(before)]),
                          "main_dtypes": {p.dtype for p in mains}, "param_dtype": trainer.student.dtype}
        finally:
            trainer.close()
    f32, b16 = out["float32"], out["bfloat16"]
    assert b16["param_dtype"] == torch.bfloat16 and b16["main_dtypes"] == {torch.float32}, "fp32 main weights"
    assert f32["texts"] == b16["texts"], "both runs trained on the same rollouts"
    assert abs(f32["loss"] - b16["loss"]) <= 0.05 * max(1.0, abs(f32["loss"])), (f32["loss"], b16["loss"])
    cos = float(torch.nn.functional.cosine_similarity(f32["delta"], b16["delta"], dim=0))
    size = float(b16["delta"].norm() / f32["delta"].norm())
    assert cos >= 0.9 and abs(size - 1) <= 0.1, (cos, size)


def test_local_engine_decodes_with_its_thread_count(setup, monkeypatch):
    from megatron_opd.rollout import local as local_mod
    from megatron_opd.rollout.base import SamplingParams
    from megatron_opd.rollout.local import LocalEngine

    _root, student, _teacher, _data = setup
    engine = LocalEngine.from_pretrained(student, num_threads=1)
    seen = []
    real = engine._forward
    engine._forward = lambda *a: seen.append(torch.get_num_threads()) or real(*a)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)

    # auto (0): torch's threads, and one thread once a decode step stalls (simulated on a hand-driven clock:
    # every step takes 1 unit, step 6 takes 100, so a loaded host cannot trip the guard early)
    auto = LocalEngine(engine.model, num_threads=0)
    seen.clear()
    real_auto = auto._forward
    now = [0.0]
    auto._clock = lambda: now[0]

    def slow_once(*a):
        seen.append(torch.get_num_threads())
        now[0] += 100.0 if len(seen) == 7 else 1.0
        return real_auto(*a)

    auto._forward = slow_once
    torch.set_num_threads(2)
    try:
        auto.generate([[5, 6, 7]], SamplingParams(max_new_tokens=12, temperature=1.0, seed=0, stop_token_ids=[]))
        assert seen[:7] == [2] * 7 and set(seen[7:]) == {1}, seen
        assert auto.stalls == 1 and torch.get_num_threads() == 2
        seen.clear()
        auto.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=1.0, seed=0))
        assert set(seen) == {1}  # the next calls start on one thread
    finally:
        torch.set_num_threads(before)
    assert local_mod.STALL_CALLS >= 1
    with pytest.raises(ValueError, match="num_threads"):
        LocalEngine(engine.model, num_threads=-1)
    from megatron_opd.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.num_threads"):
        load_config(None, ["rollout.num_threads=-2"])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_recompute_gives_the_same_loss_and_gradients(setup, tmp_path, mode):
    """model.recompute_activations reruns layers in backward instead of keeping their activations: the
    gradients must be those of the plain run (same kernels, same order: equal to fp32 rounding)."""
    from megatron_opd.trainer.batch import pad_batch
    from megatron_opd.trainer.loop import Trainer

    def grads(*extra: str):
        trainer = Trainer(_cfg(setup, tmp_path / f"run{len(extra)}", "optim.lr=0", *extra))
        try:
            batch = _batch(trainer.pad_id)
            micro = [pad_batch(batch, 4, batch.tokens.shape[1])]
            trainer.student.model.train()
            trainer.student.train_minibatch(
                micro, lambda logp, _r, b, _l: (-(logp * b.response_mask).sum() / 7.0, {}), want_logits=False)
            return _grads(trainer.student), trainer.student.model.module.config.recompute_granularity
        finally:
            trainer.close()

    plain, gran_plain = grads()
    rec, gran = grads(f"model.recompute_activations={mode}")
    assert (gran_plain, gran) == (None, mode)
    assert plain.keys() == rec.keys() and plain
    for name in plain:
        torch.testing.assert_close(rec[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(float(g.abs().sum()) > 0 for g in plain.values())


def test_bf16_rollout_engine_beside_an_fp32_student(setup, tmp_path):
    """rollout.dtype=bfloat16: the local engine holds bf16 weights (synced from the fp32 student after the
    update), the trainer stays fp32, and the engine-vs-trainer log-prob gap is reported and small."""
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(_cfg(setup, tmp_path / "run", "rollout.dtype=bfloat16", "train.reuse_old_logp=false"))
    try:
        assert trainer.student.dtype == torch.float32
        assert {p.dtype for p in trainer.engine.model.parameters()} == {torch.bfloat16}
        assert trainer.engine_shared_bytes == 0  # another dtype: the engine keeps its own bf16 copy
        m = trainer.train_step()
        assert math.isfinite(m["loss/total_loss"]) and m.get("loss/update_skipped", 0.0) == 0.0
        assert 0 < m["rollout/engine_trainer_logp_absdiff"] < 0.05
        synced, matched = dict(trainer.engine.model.named_parameters()), 0
        for name, w in trainer.student.iter_hf_weights():
            if name in synced:
                torch.testing.assert_close(synced[name], w.to(torch.bfloat16), rtol=0, atol=0, msg=name)
                matched += 1
        assert matched == len(synced)
    finally:
        trainer.close()


def test_one_rank_skips_the_identity_param_gather_and_still_trains(setup, tmp_path):
    """One data-parallel rank: the distributed optimizer's post-step all-gather is skipped (it would copy
    the buffer onto itself); the step still changes the weights the engine receives."""
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(_cfg(setup, tmp_path / "run"))
    try:
        ddp = trainer.student.setup.model
        assert "start_param_sync" in vars(ddp)  # the instance override from skip_param_gather_on_one_rank
        before = {n: w.clone() for n, w in trainer.student.iter_hf_weights()}
        m = trainer.train_step()
        assert m.get("loss/update_skipped", 0.0) == 0.0
        after = dict(trainer.student.iter_hf_weights())
        assert any(not torch.equal(before[n], after[n]) for n in before)
        engine = dict(trainer.engine.model.named_parameters())
        assert engine and all(torch.equal(engine[n], after[n]) for n in engine)
    finally:
        trainer.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_local_engine_shares_the_students_weights(setup, tmp_path, overlap):
    """TP=PP=1, same dtype: the local engine decodes from the student's own parameter storage (every
    tensor but q/k/v), holds exactly the student's weights after each step's sync, and generates what an
    engine with its own copy generates. With rollout.overlap (generation during the update) nothing is shared."""
    from megatron_opd.rollout.base import SamplingParams
    from megatron_opd.rollout.local import LocalEngine
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(_cfg(setup, tmp_path / "run", f"rollout.overlap={str(overlap).lower()}"))
    try:
        engine = trainer.engine
        storages = {p.untyped_storage().data_ptr() for p in trainer.student.model.parameters()}
        on_student = {n for n, p in engine.named_hf_weights() if p.untyped_storage().data_ptr() in storages}
        if overlap:
            assert trainer.engine_shared_bytes == 0 and not on_student
        else:
            assert trainer.engine_shared_bytes > 0
            assert {n for n, _ in engine.named_hf_weights()} - on_student == {
                n for n, _ in engine.named_hf_weights() if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                                      "q_proj.bias", "k_proj.bias", "v_proj.bias"))}
        for _ in range(2):
            m = trainer.train_step()
            assert m.get("loss/update_skipped", 0.0) == 0.0
            student = {n: w.clone() for n, w in trainer.student.iter_hf_weights()}
            for n, w in engine.named_hf_weights():
                assert torch.equal(w, student[n]), n
        own = LocalEngine.from_pretrained(setup[1], eos_token_ids=engine.eos_token_ids, pad_token_id=engine.pad_token_id)
        own.update_weights(student.items(), version=1)
        sp, prompts = SamplingParams(max_new_tokens=8, seed=3), [[5, 6, 7], [9, 10]]
        assert [s.logprobs for s in engine.generate(prompts, sp)] == [s.logprobs for s in own.generate(prompts, sp)]
    finally:
        trainer.close()

