"""A teacher with another tokenizer, end to end through the trainer (issue 40, part 2): tiny real-architecture
models on CPU, the student over the byte tokenizer, an hf teacher over a BPE with merges (another vocabulary of
another size); and the reduction: the same teacher through the cross-tokenizer path gives the plain path's run,
bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from _tiny import tiny_setup, train as _train
from megatron_opd.config import ConfigError, load_config
from megatron_opd.data.toy_tokenizer import bpe_tokenizer
from megatron_opd.models.tiny import make_tiny_hf_model
from megatron_opd.trainer.logger import read_metrics

pytestmark = pytest.mark.megatron  # builds GPTModels (student, reference)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root, student, teacher, data = tiny_setup(tmp_path_factory.mktemp("xtok"))
    corpus = [json.loads(line)["problem"] + " " + json.loads(line).get("solution", "")
              for line in data["train"].read_text().splitlines()] * 4
    tok = bpe_tokenizer(corpus, 360)
    bpe_teacher = root / "models" / "bpe_teacher"
    make_tiny_hf_model("qwen2", bpe_teacher, seed=3, vocab_size=len(tok), eos_token_id=2, pad_token_id=0,
                       bos_token_id=1, max_position_embeddings=2048, num_hidden_layers=2)
    tok.save_pretrained(str(bpe_teacher))
    assert len(tok) != 259  # not the byte tokenizer's vocabulary
    return student, teacher, bpe_teacher, data


def _overrides(setup, out, teacher, *extra):
    student, _, _, data = setup
    return ["algo.preset=stable_opd", f"model.hf_path={student}", f"teacher.hf_path={teacher}", "teacher.backend=hf",
            f"data.train_path={data['train']}", "train.steps=2", "train.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=12", "optim.lr=1e-3", "data.shuffle=false",
            f"logging.out_dir={out}", "logging.progress_bar=false", "logging.tensorboard=false",
            "checkpoint.save_every=100", "checkpoint.export_hf=false", *extra]


def test_a_teacher_with_another_tokenizer_trains_the_student(setup, tmp_path):
    _, _, bpe_teacher, _ = setup
    out = tmp_path / "cross"
    with pytest.raises(Exception, match="student/teacher pair"):  # the plain path refuses the pair (preflight)
        _train(load_config(None, _overrides(setup, tmp_path / "plain", bpe_teacher)))
    _train(load_config(None, _overrides(setup, out, bpe_teacher, "teacher.cross_tokenizer=true")))
    rows = [r for r in read_metrics(out) if r.get("step", 0) >= 1 and "adv/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["teacher/cross_coverage"] <= 1 and r["teacher/cross_student_tokens_per_chunk"] >= 1
        assert all(math.isfinite(r[k]) for k in ("adv/mean", "loss/total_loss")) and r["logp/teacher_mean"] < 0


def test_the_same_teacher_through_the_cross_tokenizer_path_gives_the_same_run(setup, tmp_path):
    """Token-for-token: the student's own tokenizer on both sides; every metric of both steps is equal (time,
    memory and the cross path's own coverage metrics aside)."""
    _, teacher, _, _ = setup
    runs = {}
    for name, extra in (("plain", ()), ("cross", ("teacher.cross_tokenizer=true",))):
        _train(load_config(None, _overrides(setup, tmp_path / name, teacher, *extra)))
        runs[name] = [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/", "teacher/cross_", "perf/"))}
                      for r in read_metrics(tmp_path / name)]
    assert [r.get("step") for r in runs["plain"]] == [r.get("step") for r in runs["cross"]]
    for a, b in zip(runs["plain"], runs["cross"]):
        assert a.keys() == b.keys()
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k] and not (isinstance(a[k], float) and math.isnan(a[k])
                                                                   and math.isnan(b[k]))}
        assert not diff, diff


def test_cross_tokenizer_config_errors_name_the_key(setup, tmp_path):
    _, _, bpe_teacher, _ = setup
    for extra, key in ((("teacher.backend=megatron",), "teacher.cross_tokenizer"),
                       (("algo.golden_loss=fkl_topk", "teacher.top_k=4"), "teacher.top_k")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, _overrides(setup, tmp_path / "x", bpe_teacher, "teacher.cross_tokenizer=true", *extra))


def test_doctor_and_probe_accept_the_pair_only_as_cross_tokenizer(setup, tmp_path, capsys):
    """`doctor --pair` refuses the pair token for token and, with --cross-tokenizer, accepts it and prints the
    coverage; `probe --cross-tokenizer` measures it (the teacher's own samples decoded by its own tokenizer)."""
    from megatron_opd.doctor import main as doctor_main
    from megatron_opd.eval.probe import main as probe_main

    student, _, bpe_teacher, _ = setup
    assert doctor_main(["--pair", str(student), str(bpe_teacher)]) == 1
    capsys.readouterr()
    assert doctor_main(["--pair", str(student), str(bpe_teacher), "--cross-tokenizer"]) == 0
    out = capsys.readouterr().out
    assert "coverage:" in out and "end_of_turn" in out
    assert doctor_main(["--pair", str(student), str(bpe_teacher), "--cross-tokenizer", "--teacher-url",
                        "http://127.0.0.1:1"]) == 2
    report = tmp_path / "probe.json"
    assert probe_main(["--student", str(student), "--teacher", str(bpe_teacher), "--n", "4", "--budget", "24",
                       "--copies", "2", "--cross-tokenizer", "--json", str(report)]) == 0
    got = json.loads(report.read_text())
    assert got["n_samples"] == 4 and got["teacher"]["n"] == 4 and math.isfinite(got["adv_original"])
    # random byte models write invalid UTF-8: the alignment stops at the first invalid byte (coverage may be 0)
    assert 0 <= got["cross_alignment"]["coverage"] <= 1 and got["cross_alignment"]["rows"] >= 1
    assert "alignment (another tokenizer):" in capsys.readouterr().out
    assert probe_main(["--student", str(student), "--teacher", str(bpe_teacher), "--n", "4", "--budget", "24"]) == 1


def test_a_teacher_whose_template_cannot_render_is_refused(setup, tmp_path, capsys):
    import shutil

    from megatron_opd.doctor import main as doctor_main

    student, _, bpe_teacher, _ = setup
    bad = Path(shutil.copytree(bpe_teacher, tmp_path / "bad"))
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ raise_exception('no user turns here') }}"
    (bad / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in bad.glob("chat_template.*"):
        f.unlink()
    assert doctor_main(["--pair", str(student), str(bad), "--cross-tokenizer"]) == 1
    assert "teacher_template" in capsys.readouterr().out
    with pytest.raises(Exception, match=r"^teacher: student/teacher pair: teacher_template"):
        _train(load_config(None, _overrides(setup, tmp_path / "bad_run", bad, "teacher.cross_tokenizer=true")))
