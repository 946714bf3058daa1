"""megatron_opd/config.py: YAML + dotted overrides, presets, and errors that name the dotted key."""

import dataclasses

from pathlib import Path

import pytest
import yaml

from megatron_opd.config import (
    PRESETS,
    AlgoConfig,
    Config,
    ConfigError,
    config_to_dict,
    dump_config,
    load_config,
)


def write(tmp_path, data, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def error_key(excinfo) -> str:
    return str(excinfo.value).split(":", 1)[0]


def test_defaults_are_the_stable_opd_preset():
    cfg = load_config()
    assert cfg.algo.preset == "stable_opd"
    for k, v in PRESETS["stable_opd"].items():
        assert getattr(cfg.algo, k) == v
    assert cfg.optim == Config().optim and cfg.rollout == Config().rollout


def test_yaml_load_nested_sections(tmp_path):
    p = write(tmp_path, {
        "model": {"hf_path": "/m", "num_attention_heads": 8},
        "parallel": {"tensor_model_parallel_size": 2},
        "rollout": {"max_new_tokens": 64, "temperature": 1},  # int accepted for float
        "data": {"eval_paths": ["a.jsonl", "b.jsonl"]},
        "train": {"collapse_action": "rollback"},
    })
    cfg = load_config(p)
    assert cfg.model.hf_path == "/m" and cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.rollout.max_new_tokens == 64
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.data.eval_paths == ["a.jsonl", "b.jsonl"]
    assert cfg.train.collapse_action == "rollback"
    assert cfg.rollout.top_p == RolloutDefaults.top_p  # untouched keys keep defaults


RolloutDefaults = Config().rollout


def test_dotted_overrides_win_over_yaml(tmp_path):
    p = write(tmp_path, {"algo": {"preset": "custom", "beta_kl": 0.5}, "train": {"steps": 3}})
    cfg = load_config(p, ["algo.beta_kl=0.01", "--train.steps=7", "logging.tensorboard=false",
                          "data.eval_paths=[x.jsonl]", "model.hf_path=null", "logging.out_dir=runs/a=b"])
    assert cfg.algo.beta_kl == 0.01 and cfg.train.steps == 7 and cfg.logging.tensorboard is False
    assert cfg.data.eval_paths == ["x.jsonl"] and cfg.model.hf_path is None
    assert cfg.logging.out_dir == "runs/a=b"  # split on the first '=' only


def test_exponent_without_dot_is_a_float(tmp_path):
    # PyYAML reads `1e-6` as a string (YAML 1.1); a learning rate written that way must still work
    assert load_config(overrides=["optim.lr=1e-6"]).optim.lr == 1e-6
    assert load_config(write(tmp_path, "optim:\n  lr: 3e-5\n  min_lr: 1e-7\n")).optim.min_lr == 1e-7
    assert load_config(overrides=["algo.adv_clip=5e0"]).algo.adv_clip == 5.0


@pytest.mark.parametrize("preset", ["opd", "opd_kl", "stable_opd"])
def test_preset_fills_defaults(preset):
    cfg = load_config(overrides=[f"algo.preset={preset}"])
    assert cfg.algo.preset == preset
    for k, v in PRESETS[preset].items():
        assert getattr(cfg.algo, k) == v


def test_preset_explicit_keys_win(tmp_path):
    cfg = load_config(write(tmp_path, {"algo": {"preset": "opd_kl", "beta_kl": 0.2}}))
    assert cfg.algo.beta_kl == 0.2 and cfg.algo.lambda_gold == PRESETS["opd_kl"]["lambda_gold"]
    cfg = load_config(overrides=["algo.preset=stable_opd", "algo.mixture_ratio=0.5"])
    assert cfg.algo.mixture_ratio == 0.5 and cfg.algo.beta_kl == PRESETS["stable_opd"]["beta_kl"]
    # an override of the preset from the YAML picks the override's preset defaults
    cfg = load_config(write(tmp_path, {"algo": {"preset": "stable_opd"}}), ["algo.preset=opd"])
    assert (cfg.algo.beta_kl, cfg.algo.lambda_gold, cfg.algo.mixture_ratio) == (0.0, 0.0, 0.0)


def test_preset_on_the_command_line_beats_the_yaml_values(tmp_path):
    """The examples spell out Stable-OPD's values: `algo.preset=opd` on the command line must still run OPD
    (before, the YAML's beta_kl/lambda_gold/mixture_ratio survived under an `opd` label)."""
    yaml_path = write(tmp_path, {"algo": {"preset": "stable_opd", "beta_kl": 0.01, "lambda_gold": 1.0,
                                          "mixture_ratio": 0.25, "clip_eps_low": 0.1}})
    cfg = load_config(yaml_path, ["algo.preset=opd"])
    assert (cfg.algo.preset, cfg.algo.beta_kl, cfg.algo.lambda_gold, cfg.algo.mixture_ratio) == ("opd", 0, 0, 0)
    assert cfg.algo.clip_eps_low == 0.1  # keys the preset does not set keep the YAML's value
    cfg = load_config(yaml_path, ["algo.beta_kl=0.001", "algo.preset=opd_kl"])
    assert (cfg.algo.beta_kl, cfg.algo.lambda_gold) == (0.001, 0.0)  # other command-line keys beat the preset
    for example in sorted(Path(__file__).parent.parent.glob("examples/*stable_opd*.yaml")):
        cfg = load_config(example, ["algo.preset=opd"])
        assert (cfg.algo.beta_kl, cfg.algo.lambda_gold, cfg.algo.mixture_ratio) == (0, 0, 0), example


def test_custom_preset_keeps_dataclass_defaults():
    cfg = load_config(overrides=["algo.preset=custom"])
    d = AlgoConfig()
    assert (cfg.algo.beta_kl, cfg.algo.lambda_gold, cfg.algo.mixture_ratio) == (d.beta_kl, d.lambda_gold,
                                                                                d.mixture_ratio)


@pytest.mark.parametrize("overrides,key", [
    (["bogus=1"], "bogus"),
    (["algo.bogus=1"], "algo.bogus"),
    (["algo.beta_kl=0.1", "rollout.temprature=0.7"], "rollout.temprature"),
])
def test_unknown_keys_name_the_dotted_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert error_key(e) == key and "unknown key" in str(e.value)


def test_unknown_nested_yaml_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {"parallel": {"tensor_model_parallel_size": 1, "tp": 2}}))
    assert error_key(e) == "parallel.tp"


@pytest.mark.parametrize("overrides,key", [
    (["train.steps=ten"], "train.steps"),
    (["train.steps=10.5"], "train.steps"),
    (["train.steps=true"], "train.steps"),  # bool is not an int
    (["optim.lr=fast"], "optim.lr"),
    (["optim.lr=true"], "optim.lr"),
    (["logging.tensorboard=maybe"], "logging.tensorboard"),
    (["logging.tensorboard=1"], "logging.tensorboard"),
    (["data.eval_paths=a.jsonl"], "data.eval_paths"),
    (["data.eval_paths=[a, 3]"], "data.eval_paths[1]"),
    (["algo.loss_agg_mode=mean"], "algo.loss_agg_mode"),
    (["model.fp8=fp4"], "model.fp8"),
    (["algo.adv_clip=big"], "algo.adv_clip"),
    (["model=3"], "model"),
    (["algo.beta_kl.x=1"], "algo.beta_kl"),
    (["optim.adam_beta1=.nan"], "optim.adam_beta1"),
    (["optim.weight_decay=nan"], "optim.weight_decay"),
])
def test_wrong_types_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert error_key(e) == key


def test_command_line_text_for_a_str_key_is_that_text(tmp_path):
    """`model.hf_path=123` or `logging.out_dir=2024` on the command line are paths (they were refused as
    numbers); a number where the key also takes numbers stays one, and YAML keeps its own types."""
    cfg = load_config(overrides=["model.hf_path=123", "logging.out_dir=2024", "data.prompt_key=3", "model.fp8=null"])
    assert (cfg.model.hf_path, cfg.logging.out_dir, cfg.data.prompt_key, cfg.model.fp8) == ("123", "2024", "3", None)
    with pytest.raises(ConfigError, match="data.prompt_key: expected str"):
        load_config(write(tmp_path, {"data": {"prompt_key": 3}}))


def test_removed_megatron_ckpt_key(tmp_path):
    """Run directories' config.yaml carry `megatron_ckpt: null` (dumped before the key was removed): they load;
    a path there is refused (it was never read)."""
    assert load_config(write(tmp_path, {"model": {"megatron_ckpt": None}})).model.megatron_ckpt is None
    with pytest.raises(ConfigError, match="model.megatron_ckpt: is not supported"):
        load_config(overrides=["model.megatron_ckpt=/ckpt"])


def test_literal_and_optional_messages_list_the_choices():
    with pytest.raises(ConfigError, match=r"model\.fp8: expected one of \['delayed'.*\] or null, got 'fp4'"):
        load_config(overrides=["model.fp8=fp4"])
    with pytest.raises(ConfigError, match=r"algo\.loss_agg_mode: must be one of \['token_mean'"):
        load_config(overrides=["algo.loss_agg_mode=mean"])


@pytest.mark.parametrize("overrides,key", [
    (["model.num_attention_heads=12", "parallel.tensor_model_parallel_size=8"], "parallel.tensor_model_parallel_size"),
    (["model.num_query_groups=2", "parallel.tensor_model_parallel_size=4"], "parallel.tensor_model_parallel_size"),
    (["model.num_layers=10", "parallel.pipeline_model_parallel_size=3"], "parallel.pipeline_model_parallel_size"),
    (["parallel.tensor_model_parallel_size=0"], "parallel.tensor_model_parallel_size"),
    (["teacher.pipeline_model_parallel_size=0"], "teacher.pipeline_model_parallel_size"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (["algo.mixture_ratio=1.5"], "algo.mixture_ratio"),
    (["algo.mixture_ratio=-0.1"], "algo.mixture_ratio"),
    (["algo.preset=custom", "algo.mixture_ratio=0.3"], "algo.lambda_gold"),
    (["algo.beta_kl=-1"], "algo.beta_kl"),
    (["algo.clip_eps_low=1.0"], "algo.clip_eps_low"),
    (["algo.dual_clip_c=1.0"], "algo.dual_clip_c"),
    (["algo.adv_gamma=1.5"], "algo.adv_gamma"),
    (["algo.golden_loss=fkl_topk"], "teacher.top_k"),
    (["rollout.top_p=0"], "rollout.top_p"),
    (["rollout.temperature=0"], "rollout.temperature"),
    (["rollout.top_k=0"], "rollout.top_k"),
    (["rollout.port=70000"], "rollout.port"),
    (["rollout.mem_fraction_static=1.0"], "rollout.mem_fraction_static"),
    (["model.fp8=delayed", "model.layer_spec=local"], "model.fp8"),
    (["optim.lr=1e-6", "optim.min_lr=1e-5"], "optim.min_lr"),
    (["teacher.backend=sglang"], "teacher.server_url"),
    (["train.micro_batch_size=0"], "train.micro_batch_size"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last"),
])
def test_inconsistent_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert error_key(e) == key


def test_consistent_parallel_layout_passes():
    cfg = load_config(overrides=["model.num_attention_heads=12", "model.num_query_groups=4", "model.num_layers=8",
                                 "parallel.tensor_model_parallel_size=4", "parallel.pipeline_model_parallel_size=2",
                                 "parallel.sequence_parallel=true"])
    assert cfg.parallel.tensor_model_parallel_size == 4


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = write(tmp_path, "algo: [unclosed\n", "bad.yaml")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML"):
        load_config(bad)
    lst = write(tmp_path, "- 1\n- 2\n", "list.yaml")
    with pytest.raises(ConfigError, match=r"list\.yaml: top level must be a mapping"):
        load_config(lst)
    assert load_config(write(tmp_path, "", "empty.yaml")).algo.preset == "stable_opd"


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(overrides=["algo.beta_kl"])
    with pytest.raises(ConfigError, match="empty key"):
        load_config(overrides=["=3"])


def test_dump_load_round_trip(tmp_path):
    cfg = load_config(overrides=["algo.preset=opd_kl", "algo.beta_kl=0.05", "optim.lr=1e-6",
                                 "data.eval_paths=[a.jsonl]", "model.fp8=delayed"])
    p = tmp_path / "dumped.yaml"
    dump_config(cfg, p)
    again = load_config(p)
    assert config_to_dict(again) == config_to_dict(cfg)
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def test_string_fields_take_override_text_as_typed():
    """A prompt template with braces is YAML flow-mapping syntax; a str field must keep the text."""
    from megatron_opd.config import ConfigError, load_config

    assert load_config(overrides=["data.prompt_template={problem}"]).data.prompt_template == "{problem}"
    with pytest.raises(ConfigError, match="data.solution_template: must contain"):
        load_config(overrides=["data.solution_template=The answer is {answer}."])
    assert load_config(overrides=["data.prompt_template={problem} now"]).data.prompt_template == "{problem} now"
    with pytest.raises(ConfigError, match=r"^optim\.lr: cannot parse"):
        load_config(overrides=["optim.lr={x} y"])
    with pytest.raises(ConfigError, match=r"^checkpoint\.save_every"):
        load_config(overrides=["checkpoint.save_every=0"])


def test_bare_off_in_yaml_is_the_off_choice_not_a_boolean(tmp_path):
    """YAML 1.1 reads `off` as False; Literal choices that include "off" take it back."""
    p = tmp_path / "c.yaml"
    p.write_text("teacher:\n  preflight: off\nrollout:\n  parity_check: off\n")
    cfg = load_config(p, ["rollout.parity_check=warn"])
    assert cfg.teacher.preflight == "off" and cfg.rollout.parity_check == "warn"
    assert load_config(None, ["rollout.parity_check=off"]).rollout.parity_check == "off"
    with pytest.raises(ConfigError, match="algo.preset"):
        load_config(None, ["algo.preset=off"])
