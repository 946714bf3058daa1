"""Inputs checked before anything loads (megatron_opd/inputs.py): each bad path or name is one line naming
the key, from `megatron-opd train` (exit 2, no traceback, no model loaded) and from `launch check-config`."""

from __future__ import annotations

import pytest

from _tiny import tiny_setup
from megatron_opd.config import ConfigError, load_config
from megatron_opd.inputs import check_inputs, eval_set_name


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("inputs"))


def _over(setup, tmp_path, *extra: str) -> list[str]:
    _root, student, teacher, data = setup
    return [f"model.hf_path={student}", f"teacher.hf_path={teacher}", f"data.train_path={data['train']}",
            f"logging.out_dir={tmp_path / 'run'}", "train.steps=1", *extra]


def test_good_inputs_pass(setup, tmp_path):
    _root, _s, _t, data = setup
    check_inputs(load_config(None, _over(setup, tmp_path, f"data.eval_paths=[arith={data['eval']}]")), world_size=4)


@pytest.mark.parametrize("extra, key, msg", [
    (["model.hf_path=null"], "model.hf_path", "required"),
    (["model.hf_path=/nope/student"], "model.hf_path=/nope/student", "not found"),
    (["model.hf_path={data_dir}"], "model.hf_path=", "no config.json"),
    (["teacher.hf_path=null"], "teacher.hf_path", "required"),
    (["teacher.backend=hf", "teacher.hf_path=null"], "teacher.hf_path", "teacher.backend=hf"),
    (["teacher.backend=sglang", "teacher.hf_path=/nope"], "teacher.hf_path=/nope", "not found"),
    (["data.train_path=/nope/train.jsonl"], "data.train_path=/nope/train.jsonl", "not found"),
    (["data.eval_paths=[/nope/test.jsonl]"], "data.eval_paths[0]", "name it as NAME=PATH"),
    (["data.eval_paths=[math500=/nope/test.jsonl]"], "data.eval_paths[0]=/nope/test.jsonl", "not found"),
    (["data.eval_paths=[mmlu={train}]"], "data.eval_paths[0]", "unknown benchmark 'mmlu'"),
    (["optim.warmup_steps=3"], "optim.warmup_steps", "exceeds the run's 2 optimizer steps"),
    (["model.num_layers=7"], "model.num_layers: 7, but", "num_hidden_layers="),
    (["model.num_attention_heads=2"], "model.num_attention_heads: 2, but", "num_attention_heads=4"),
])
def test_bad_inputs_name_the_key(setup, tmp_path, extra, key, msg):
    _root, student, _t, data = setup
    fill = {"data_dir": data["train"].parent, "train": data["train"]}
    cfg = load_config(None, _over(setup, tmp_path, "algo.num_minibatches=2", *(e.format(**fill) for e in extra)))
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    assert str(e.value).startswith(key) and msg in str(e.value), str(e.value)


def test_world_size_must_fit_the_layout(setup, tmp_path, monkeypatch):
    cfg = load_config(None, _over(setup, tmp_path, "parallel.tensor_model_parallel_size=2",
                                  "model.num_attention_heads=4", "model.num_query_groups=2"))
    with pytest.raises(ConfigError, match="parallel.tensor_model_parallel_size: the world size 3"):
        check_inputs(cfg, world_size=3)
    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(ConfigError, match="world size 5"):
        check_inputs(cfg)
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_inputs(cfg)


def test_eval_set_names(tmp_path):
    assert eval_set_name("arith=x/y.jsonl") == ("arith", "x/y.jsonl")
    assert eval_set_name("data/math500.jsonl") == ("math500", "data/math500.jsonl")
    assert eval_set_name("data/aime24/test.jsonl") == ("aime24", "data/aime24/test.jsonl")  # docs/evaluation.md layout
    assert eval_set_name("data/minerva_math.jsonl") == ("minerva_math", "data/minerva_math.jsonl")
    with pytest.raises(KeyError, match="NAME=PATH"):
        eval_set_name("data/mine/test.jsonl")


def test_train_cli_reports_bad_inputs_in_one_line_before_loading(setup, tmp_path, capsys, monkeypatch):
    """`megatron-opd train` with a missing data file: exit 2, one line naming the key, no traceback and no
    model built (the check runs before the student loads; it used to come after student, ref and teacher)."""
    from megatron_opd.trainer import cli, loop

    built = []
    monkeypatch.setattr(loop, "MegatronPolicy", lambda *a, **k: built.append(1))
    for extra, want in ((["data.train_path=/nope/train.jsonl"], "config error: data.train_path=/nope/train.jsonl: "
                                                                  "not found"),
                        ([], "config error: model.hf_path: required"),
                        (["data.eval_paths=[/nope/test.jsonl]"], "config error: data.eval_paths[0]: ")):
        over = _over(setup, tmp_path, *extra) if extra else ["train.steps=1"]
        assert cli.main(over) == 2
        err = capsys.readouterr().err
        assert err.startswith(want) and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not built


def test_check_config_checks_paths_unless_skipped(setup, tmp_path, capsys):
    from pathlib import Path

    from megatron_opd.launch import main as launch_main

    example = str(Path(__file__).parent.parent / "examples" / "qwen2.5-math-1.5b_opd_kl.yaml")
    assert launch_main(["check-config", "--config", example]) == 2
    assert "config error: model.hf_path=" in capsys.readouterr().err
    assert launch_main(["check-config", "--skip-paths", "--config", example]) == 0
    assert "paths not checked" in capsys.readouterr().out
    fitting = ["data.eval_paths=[]", "model.num_attention_heads=null", "model.num_query_groups=null",
               "model.num_layers=null", "optim.warmup_steps=0"]  # the example's values are Qwen2.5-Math-1.5B's
    assert launch_main(["check-config", "--config", example, *_over(setup, tmp_path), *fitting]) == 0
