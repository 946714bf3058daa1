"""Two-step OPD training with real SGLang (tiny Qwen2 student and teacher, builtin arithmetic prompts):
`rollout.backend=sglang` in engine and server mode, colocated (tensor updates) and disaggregated (gloo weight
group), one run through the `megatron-opd train` CLI, and one with `teacher.backend=sglang` (a teacher
server the trainer launches). After training, the engine must hold exactly the trainer's weights: its
behaviour log-probs match an HF model loaded with the student's final weights.

CPU notes: `release_memory_occupation` needs CUDA (torch_memory_saver), so on CPU the factory leaves the
memory saver off and colocated runs skip release/resume (rollout.release_engine_memory is a no-op)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _proc import explain
from _dist import session_cmdlines
from megatron_opd.rollout.base import SamplingParams
from sglang_cpu import (LOGPROB_TOL, hf_model, max_logprob_gap, measured, mem_fraction, require_sglang, sglang_args,
                        tiny_models)

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.megatron]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    require_sglang()
    from megatron_opd.data.builtin.arithmetic import write_builtin_jsonl

    root = tmp_path_factory.mktemp("sgl_train")
    student, teacher = tiny_models(root / "models")
    data = write_builtin_jsonl(root / "data", n_train=8, n_eval=2)
    return student, teacher, data


def _overrides(setup, out: Path, mode: str, colocate: bool, *extra: str) -> list[str]:
    from _dist import free_port

    student, teacher, data = setup
    return ["algo.preset=opd", f"model.hf_path={student}", f"teacher.hf_path={teacher}",
            f"data.train_path={data['train']}", "train.steps=2", "train.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=6", f"logging.out_dir={out}",
            "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.save_every=10",
            "parallel.backend=gloo", "rollout.backend=sglang", f"rollout.sglang_mode={mode}",
            f"rollout.colocate={str(colocate).lower()}", f"rollout.port={free_port()}",
            f"rollout.mem_fraction_static={mem_fraction()}", "rollout.sglang_args=" + json.dumps(sglang_args()),
            "rollout.sync_bucket_mb=1", "optim.lr=1e-2", *extra]  # lr: weights visibly move in 2 steps


def _check_metrics(out: Path) -> list[dict]:
    from megatron_opd.trainer.logger import read_metrics

    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["train/weight_version"] for r in rows] == [1.0, 2.0]
    for r in rows:
        for k in ("logp/student_mean", "logp/teacher_mean", "loss/total_loss", "rollout/response_len_mean"):
            assert isinstance(r.get(k), float) and math.isfinite(r[k]), (k, r.get(k))
        assert r.get("train/skipped_steps", 0.0) == 0.0
    return rows


def _train(cfg_overrides: list[str]):
    """Trainer.train() in this process; returns the trainer (not closed) so the test can inspect its engine."""
    from megatron_opd.config import load_config
    from megatron_opd.trainer.loop import Trainer

    trainer = Trainer(load_config(None, cfg_overrides))
    try:
        trainer.train()
    except BaseException:
        trainer.close()
        raise
    return trainer


def _engine_holds_student_weights(trainer, student: Path, label: str) -> None:
    """The engine generates with the trainer's final weights (the last sync reached it, every tensor)."""
    assert trainer.engine.weight_version == trainer.weight_version == 2
    final = hf_model(student, ((n, t.detach().clone()) for n, t in trainer.student.iter_hf_weights()))
    samples = trainer.engine.generate([[5, 6, 7], [40, 41]], SamplingParams(max_new_tokens=6, n=2))
    assert measured(f"trainer {label}: max |engine - HF(trainer's final weights)| log-prob",
                    max_logprob_gap(samples, final)) < LOGPROB_TOL
    assert max_logprob_gap(samples, hf_model(student)) > 100 * LOGPROB_TOL  # training moved the weights


def _finish(trainer) -> None:
    from megatron_opd.models.parallel import destroy_parallel

    trainer.close()
    destroy_parallel()


def _key_out_of_sight(srv, log: Path) -> None:
    """The key of a server the trainer launched: in no command line of its processes (`ps`), and in its log
    only as `<redacted>` (SGLang logs its ServerArgs, api_key included, at INFO)."""
    lines = session_cmdlines(srv.proc.pid)
    assert len(lines) >= 2 and all(srv.api_key not in c for c in lines.values()), lines  # server + its workers
    text = log.read_text()
    assert srv.api_key not in text and "<redacted>" in text and "server_args=" in text


def test_train_engine_colocated_with_sglang_teacher(setup, tmp_path):
    """rollout: in-process sglang.Engine, colocate=true (update_weights_from_tensor); teacher.backend=sglang
    with no URL: the trainer launches an SGLang server for teacher.hf_path (teacher.sglang_args, --api-key)."""
    student, teacher, _ = setup
    out = tmp_path / "run"
    trainer = _train(_overrides(setup, out, "engine", True, "teacher.backend=sglang",
                                "teacher.sglang_args=" + json.dumps(sglang_args(mem_fraction_static=mem_fraction()))))
    try:
        srv = trainer.scorer.teacher_server
        assert srv.is_alive() and srv.api_key and trainer.teacher.server is srv
        _key_out_of_sight(srv, out / "logs" / "sglang_teacher.log")
        assert trainer.teacher.vocab_size == hf_model(teacher).config.vocab_size
        assert trainer.engine.mode == "engine" and not trainer.engine.memory_saver
        _engine_holds_student_weights(trainer, student, "engine, colocate=True, sglang teacher")
        # sglang.Engine.shutdown() SIGKILLs every child of its process; the client narrows that to the
        # engine's own processes, so the teacher server (a child of this process) lives on
        import psutil  # an SGLang dependency (this module only runs where SGLang is installed)

        own = trainer.engine.engine_processes
        assert own and all(p.is_running() for p in own), own  # the scheduler / detokenizer processes
        trainer.engine.shutdown()
        trainer.rollouts.engine = None
        assert srv.is_alive() and srv.healthy()
        gone = [p for p in own if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE]
        assert len(gone) == len(own), f"engine processes left running after shutdown: {own}"
    finally:
        _finish(trainer)
    assert not srv.is_alive()  # close() stopped the teacher server
    _check_metrics(out)
    assert (out / "logs" / "sglang_teacher.log").is_file()


@pytest.mark.parametrize("mode,colocate", [("engine", False), ("server", True)])
def test_train_rollout_sglang_modes(setup, tmp_path, mode, colocate):
    """engine + disaggregated (gloo weight group to the in-process engine's scheduler) and a launched server +
    colocated (tensor updates over HTTP); megatron teacher."""
    student = setup[0]
    out = tmp_path / "run"
    trainer = _train(_overrides(setup, out, mode, colocate))
    try:
        assert trainer.engine.mode == mode and trainer.engine.has_weight_group is (not colocate)
        if mode == "server":
            assert trainer.engine.server is not None and trainer.engine.server.is_alive()
            _key_out_of_sight(trainer.engine.server, out / "logs" / "sglang_rollout.log")
        _engine_holds_student_weights(trainer, student, f"{mode}, colocate={colocate}")
        proc = trainer.engine.server
    finally:
        _finish(trainer)
    if mode == "server":
        assert not proc.is_alive()
    _check_metrics(out)


def test_megatron_opd_train_cli_server_disaggregated(setup, tmp_path):
    """`megatron-opd train` as a user runs it: rollout.sglang_mode=server (launched on rollout.port),
    rollout.colocate=false (gloo weight group over loopback); the server is gone when the command returns."""
    out = tmp_path / "run"
    ov = _overrides(setup, out, "server", False)
    port = int(next(o for o in ov if o.startswith("rollout.port=")).split("=")[1])
    # this process's init_parallel left MASTER_ADDR/PORT in os.environ: a user's shell has none
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", "megatron_opd.cli", "train", *ov], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, explain(res)
    _check_metrics(out)
    assert (out / "logs" / "sglang_rollout.log").stat().st_size > 0  # the launched server's own log
    import socket

    with socket.socket() as s:  # nothing listens on the rollout port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_cross_tokenizer_teacher_served_by_sglang_scores_as_the_hf_teacher(setup, tmp_path):
    """teacher.cross_tokenizer=true with teacher.backend=sglang: a teacher over another tokenizer (a BPE with
    merges, another vocabulary) served by a real SGLang server the trainer launches. The student's text is
    re-tokenized by the teacher's tokenizer and the server scores the teacher's ids; the same teacher through
    the hf backend gives the same step-1 scores (same seeds and weights: the same rollouts), within the
    SGLang-vs-HF tolerance, with the same alignment coverage."""
    from megatron_opd.data.toy_tokenizer import bpe_tokenizer
    from megatron_opd.models.tiny import make_tiny_hf_model
    from megatron_opd.trainer.logger import read_metrics

    student, _, data = setup
    corpus = [json.loads(line)["problem"] for line in Path(data["train"]).read_text().splitlines()] * 4
    tok = bpe_tokenizer(corpus, 300)
    bpe_teacher = tmp_path / "bpe_teacher"
    make_tiny_hf_model("qwen2", bpe_teacher, seed=3, vocab_size=len(tok), eos_token_id=2, pad_token_id=0,
                       bos_token_id=1, max_position_embeddings=2048, num_hidden_layers=2)
    tok.save_pretrained(str(bpe_teacher))
    assert len(tok) != hf_model(student).config.vocab_size
    common = ("rollout.backend=local", f"teacher.hf_path={bpe_teacher}", "teacher.cross_tokenizer=true",
              "teacher.params_dtype=float32", "model.params_dtype=float32")
    runs = {}
    for backend in ("sglang", "hf"):
        extra = (("teacher.sglang_args=" + json.dumps(sglang_args(mem_fraction_static=mem_fraction())),)
                 if backend == "sglang" else ())
        out = tmp_path / backend
        trainer = _train(_overrides(setup, out, "engine", False, *common, f"teacher.backend={backend}", *extra))
        try:
            from megatron_opd.teacher.cross_tokenizer import CrossTokenizerTeacher
            from megatron_opd.teacher.sglang import SGLangTeacher

            assert isinstance(trainer.teacher, CrossTokenizerTeacher)
            assert isinstance(trainer.teacher.inner, SGLangTeacher) == (backend == "sglang")
            if backend == "sglang":
                assert trainer.scorer.teacher_server is not None and trainer.scorer.teacher_server.is_alive()
                assert trainer.teacher.inner.server is trainer.scorer.teacher_server
        finally:
            _finish(trainer)
        runs[backend] = [r for r in read_metrics(out) if r.get("step") == 1][0]
    sgl, hf = runs["sglang"], runs["hf"]
    assert sgl["rollout/response_len_mean"] == hf["rollout/response_len_mean"]  # the same rollouts
    assert 0 < sgl["teacher/cross_coverage"] == hf["teacher/cross_coverage"] <= 1
    gap = abs(sgl["logp/teacher_mean"] - hf["logp/teacher_mean"])
    assert measured("cross-tokenizer teacher: |SGLang - HF| mean teacher log-prob, step 1", gap) < LOGPROB_TOL
    assert math.isfinite(sgl["adv/mean"]) and abs(sgl["adv/mean"] - hf["adv/mean"]) < LOGPROB_TOL
