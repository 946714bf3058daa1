"""Student/teacher fidelity preflight (teacher/fidelity.py): `megatron-opd doctor --pair`, the trainer's
check at start, the step-1 engine parity check, and teacher top-k restricted to the student's ids.

Pairs are tiny random models with the offline byte tokenizer, then broken one way at a time by editing
their saved files (tokenizer.json, tokenizer_config.json, config.json), as a user's mismatched
checkpoints would be.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _tiny import tiny_setup
from megatron_opd.config import load_config
from megatron_opd.data.toy_tokenizer import byte_tokenizer
from megatron_opd.doctor import main as doctor_main
from megatron_opd.teacher.base import scores_from_logits
from megatron_opd.teacher.fidelity import (PairMismatchError, check_pair, compare_chat_templates, compare_vocab,
                                           topk_id_limit)
from megatron_opd.teacher.megatron import vocab_parallel_topk

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("fidelity"), n_train=8, n_eval=2)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _levels(report, check):
    return [f.level for f in report.findings if f.check == check]


def test_identical_pair_passes(setup, capsys):
    _, student, teacher, _ = setup
    report = check_pair(student, teacher)
    assert not report.errors and {f.check for f in report.findings} == {
        "tokenizer", "special_tokens", "vocab", "chat_template", "eos", "golden_end"}
    assert doctor_main(["--pair", str(student), str(teacher)]) == 0
    assert "[ok   ] eos: student and teacher stop on [2 '<|im_end|>']" in capsys.readouterr().out
    assert doctor_main(["--pair", str(student), "/nope/teacher"]) == 2  # a missing path, not a hub-id error
    assert "TEACHER /nope/teacher: not found" in capsys.readouterr().err


def test_swapped_token_ids_name_the_first_differing_id(setup, tmp_path, capsys):
    _, student, teacher, _ = setup
    bad = _copy(teacher, tmp_path / "t")

    def swap(tj):
        v = tj["model"]["vocab"]
        a, b = next(k for k, i in v.items() if i == 40), next(k for k, i in v.items() if i == 41)
        v[a], v[b] = 41, 40

    _edit_json(bad / "tokenizer.json", swap)
    report = check_pair(student, bad)
    (err,) = [f for f in report.errors if f.check == "tokenizer"]
    assert "2 of 259 shared ids map to different tokens; first: id 40 is" in err.message
    with pytest.raises(PairMismatchError, match="tokenizer: 2 of 259"):
        report.raise_for_errors()
    assert doctor_main(["--pair", str(student), str(bad)]) == 1
    assert "1 problem(s)" in capsys.readouterr().err


def test_different_eos_token_and_eos_ids(setup, tmp_path):
    _, student, teacher, _ = setup
    bad = _copy(teacher, tmp_path / "t")
    _edit_json(bad / "tokenizer_config.json", lambda c: c.update(eos_token="<|pad|>"))
    _edit_json(bad / "generation_config.json", lambda c: c.update(eos_token_id=0))
    _edit_json(bad / "config.json", lambda c: c.update(eos_token_id=0))
    report = check_pair(student, bad)
    msgs = {f.check: f.message for f in report.errors}
    assert "eos_token: student '<|im_end|>' (id 2) vs teacher '<|pad|>' (id 0)" in msgs["special_tokens"]
    assert msgs["eos"] == "EOS ids differ: student [2 '<|im_end|>'] vs teacher [0 '<|pad|>']"


def test_golden_end_token_must_be_a_stop_id(setup, tmp_path):
    """The Qwen2.5 trap: tokenizer.eos_token (what golden solutions end with) is not what generation stops on."""
    _, student, teacher, _ = setup
    s, t = _copy(student, tmp_path / "s"), _copy(teacher, tmp_path / "t")
    for d in (s, t):
        _edit_json(d / "generation_config.json", lambda c: c.update(eos_token_id=[1]))
    report = check_pair(s, t)
    (err,) = report.errors
    assert err.check == "golden_end" and "golden solutions end with id 2 '<|im_end|>'" in err.message
    assert "do not stop on ([1 '<|im_start|>'])" in err.message


def test_chat_template_difference_names_the_token(setup, tmp_path):
    s = byte_tokenizer()
    t = byte_tokenizer()
    t.chat_template = t.chat_template.replace("'\\n' + message['content']", "': ' + message['content']")
    (f,) = compare_chat_templates(s, t)
    assert f.level == "error" and "the prompt of a probe conversation differs at token" in f.message
    assert "student id" in f.message and "teacher id" in f.message
    assert compare_chat_templates(s, byte_tokenizer(chat_template=False))[0].level == "error"
    assert compare_chat_templates(s, byte_tokenizer(chat_template=False), required=False)[0].level == "warn"
    assert compare_chat_templates(s, byte_tokenizer())[0].level == "ok"


def test_padded_vocab_is_reported_and_a_short_model_is_an_error():
    """Qwen2.5-1.5B vs -7B: 151,936 vs 152,064 rows for a 151,665-token tokenizer."""
    (f,) = compare_vocab(151936, 152064, 151665)
    assert f.level == "info" and "teacher top-k is restricted to ids < 151665" in f.message
    assert topk_id_limit(151936, 152064, 151665) == 151665
    (f,) = compare_vocab(151936, 100000, 151665)
    assert f.level == "error" and "the teacher has 100000 vocab rows for a 151665-token tokenizer" in f.message


def test_topk_candidates_stay_below_the_id_limit_normalisation_unchanged():
    torch.manual_seed(0)
    logits = torch.randn(6, 20)
    logits[:, 15:] += 8.0  # the rows a larger teacher has beyond the student's ids win without a limit
    ids, lps = vocab_parallel_topk(logits, 4, 20, None)
    assert int(ids.min()) >= 15
    ids, lps = vocab_parallel_topk(logits, 4, 20, None, id_limit=15)
    full = torch.log_softmax(logits, -1)
    ref_vals, ref_ids = torch.topk(full[:, :15], 4)
    assert torch.equal(ids, ref_ids) and torch.allclose(lps, ref_vals)
    sc = scores_from_logits(logits, torch.zeros(6, dtype=torch.long), 4, id_limit=15)
    assert torch.equal(sc.topk_ids, ref_ids) and torch.allclose(sc.topk_logprobs, ref_vals)
    with pytest.raises(ValueError, match="top_k"):
        vocab_parallel_topk(logits, 16, 20, None, id_limit=15)


def _overrides(setup, student, teacher, out, *extra):
    _, _, _, data = setup
    return [f"model.hf_path={student}", f"teacher.hf_path={teacher}", f"data.train_path={data['train']}",
            "train.steps=1", "train.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=8",
            f"logging.out_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
            "checkpoint.save_every=100", *extra]


def test_trainer_stops_a_mismatched_pair_before_loading_models(setup, tmp_path, monkeypatch, capsys):
    from megatron_opd.trainer import cli
    from megatron_opd.trainer.loop import MegatronPolicy, Trainer

    _, student, teacher, _ = setup
    bad = _copy(teacher, tmp_path / "t")
    _edit_json(bad / "generation_config.json", lambda c: c.update(eos_token_id=0))
    _edit_json(bad / "config.json", lambda c: c.update(eos_token_id=0))

    def no_models(*a, **k):
        raise AssertionError("no model may load for a mismatched pair")

    monkeypatch.setattr(MegatronPolicy, "__init__", no_models)
    with pytest.raises(PairMismatchError, match=r"eos: EOS ids differ: student \[2"):
        Trainer(load_config(None, _overrides(setup, student, bad, tmp_path / "o")))
    assert cli.main(_overrides(setup, student, bad, tmp_path / "o2")) == 2
    assert "preflight: teacher: student/teacher pair: eos: EOS ids differ" in capsys.readouterr().err
    monkeypatch.undo()
    trainer = Trainer(load_config(None, _overrides(setup, student, bad, tmp_path / "o3", "teacher.preflight=warn",
                                                   "teacher.backend=hf")))
    trainer.close()


def test_engine_parity_at_step_one(setup, tmp_path, caplog):
    """bf16 rollout against an fp32 trainer: the gap is measured and, above the threshold, stops the run."""
    from megatron_opd.trainer.loop import Trainer

    _, student, teacher, _ = setup
    over = _overrides(setup, student, teacher, tmp_path / "a", "rollout.dtype=bfloat16", "teacher.backend=hf")
    trainer = Trainer(load_config(None, over))
    try:
        with caplog.at_level("INFO", logger="megatron_opd.trainer"):
            metrics = trainer.train_step()
    finally:
        trainer.close()
    gap, worst = metrics["rollout/engine_trainer_logp_absdiff"], metrics["rollout/engine_trainer_logp_absdiff_max"]
    assert 0 < gap <= worst and gap < 0.1
    assert "rollout engine vs trainer log-probs at step 1: mean |diff|" in caplog.text and ": ok" in caplog.text
    trainer = Trainer(load_config(None, _overrides(setup, student, teacher, tmp_path / "b", "rollout.dtype=bfloat16",
                                                   "teacher.backend=hf", f"rollout.max_engine_logp_absdiff={gap / 10}")))
    try:
        with pytest.raises(PairMismatchError, match="mean \\|diff\\|"):
            trainer.train_step()
    finally:
        trainer.close()


def test_teacher_offload_parks_weights_between_steps_and_changes_nothing(setup, tmp_path):
    """teacher.offload: the in-process teacher's parameters are empty between scoring phases and the
    training numbers equal a run without it."""
    from megatron_opd.trainer.logger import read_metrics
    from megatron_opd.trainer.loop import Trainer

    _, student, teacher, _ = setup
    rows = {}
    for off in (False, True):
        over = _overrides(setup, student, teacher, tmp_path / str(off), "teacher.backend=megatron",
                          f"teacher.offload={str(off).lower()}", "train.steps=2", "algo.preset=opd_kl")
        trainer = Trainer(load_config(None, over))
        try:
            params = list(trainer.teacher_policy.model.parameters())
            assert all(p.numel() == 0 for p in params) is off  # parked from the start
            trainer.train()
            assert all(p.numel() == 0 for p in params) is off  # and again after every step
        finally:
            trainer.close()
        rows[off] = read_metrics(tmp_path / str(off))
    for a, b in zip(rows[False], rows[True]):
        for k in ("loss/pg_loss", "loss/kl", "adv/mean", "logp/teacher_mean"):
            assert a[k] == b[k], k
    with pytest.raises(Exception, match="teacher.offload"):
        load_config(None, ["teacher.offload=true", "teacher.backend=hf"])


def test_weight_offloader_round_trip_is_bit_identical():
    from megatron_opd.models.offload import WeightOffloader
    from megatron_opd.models.tiny import make_tiny_hf_model

    model = make_tiny_hf_model("qwen2", seed=2, tie_word_embeddings=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    off = WeightOffloader(model)
    off.offload()
    off.offload()  # idempotent
    assert off.offloaded and model.model.embed_tokens.weight.numel() == 0
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied weights stay tied
    off.restore()
    assert not off.offloaded
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def _fake_teacher_server(tmp_path, model_dir, seqs):
    """The stdlib prefill stand-in of tests/test_teacher_sglang.py (NOT SGLang), answering from `model_dir`'s
    log-probs for `seqs`."""
    import sys

    from transformers import AutoModelForCausalLM

    from _dist import free_port
    from megatron_opd.rollout.server import ServerProcess
    from test_teacher_sglang import FAKE_SGLANG

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    table = {}
    for s in seqs:
        with torch.no_grad():
            table[json.dumps(s)] = torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1)[:-1].tolist()
    (tmp_path / "table.json").write_text(json.dumps(table))
    (tmp_path / "fake_sglang.py").write_text(FAKE_SGLANG)
    port = free_port()
    return ServerProcess([sys.executable, tmp_path / "fake_sglang.py", port, tmp_path / "table.json", "ok"],
                         port=port, startup_timeout=60, log_path=tmp_path / "fake.log")


def test_doctor_compares_a_teacher_server_with_the_in_process_teacher(setup, tmp_path, capsys):
    from transformers import AutoTokenizer

    from megatron_opd.teacher.fidelity import probe_ids

    _, student, teacher, _ = setup
    prompt, response = probe_ids(AutoTokenizer.from_pretrained(str(student)))
    assert len(prompt) > 10 and len(response) > 10
    with _fake_teacher_server(tmp_path, teacher, [prompt + response]) as srv:
        assert doctor_main(["--pair", str(student), str(teacher), "--teacher-url", srv.url]) == 0
    out = capsys.readouterr().out
    assert f"[ok   ] teacher_server: server {srv.url} vs in-process teacher on {len(response)} probe tokens" in out
    drifted = tmp_path / "drift"
    drifted.mkdir()
    with _fake_teacher_server(drifted, student, [prompt + response]) as srv:  # serves another checkpoint
        assert doctor_main(["--pair", str(student), str(teacher), "--teacher-url", srv.url]) == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if "teacher_server" in x)
    assert "[error] teacher_server" in line and "mean |diff|" in line
    assert doctor_main(["--pair", str(student), str(teacher), "--teacher-url", "http://127.0.0.1:9"]) == 2
    assert "megatron-opd doctor: --pair:" in capsys.readouterr().err
