"""What a run reads from disk, checked before anything is loaded.

`validate` (config.py) checks the config against itself; this checks it against the machine: the model
directories, data files and evaluation sets exist and have the shape the trainer needs, the benchmark
names resolve and the launch's world size fits the layout. A bad path is then one line naming the key,
in seconds, instead of a traceback after the student, reference and teacher have loaded (`train`), and
`launch check-config` catches it on the login node before a job holds its GPUs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_opd.config import Config, ConfigError
from megatron_opd.eval.benchmarks import BENCHMARKS, canonical_name


def _model_dir(key: str, path: str | None, why: str) -> None:
    if path is None:
        raise ConfigError(f"{key}: required ({why})")
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{key}={path}: not found")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{key}={path}: not an HF model directory (no config.json)")


def _declared_sizes(cfg: Config) -> None:
    """model.num_attention_heads / num_query_groups / num_layers, when declared (to validate a layout where
    the models are not readable), must be the model's: a wrong one validated TP/PP against made-up numbers."""
    try:
        hf = json.loads((Path(cfg.model.hf_path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf_path={cfg.model.hf_path}: config.json unreadable ({e})") from None
    heads = hf.get("num_attention_heads")
    for key, declared, actual, hf_key in (
            ("model.num_attention_heads", cfg.model.num_attention_heads, heads, "num_attention_heads"),
            ("model.num_query_groups", cfg.model.num_query_groups, hf.get("num_key_value_heads", heads),
             "num_key_value_heads"),
            ("model.num_layers", cfg.model.num_layers, hf.get("num_hidden_layers"), "num_hidden_layers")):
        if declared is not None and actual is not None and declared != actual:
            raise ConfigError(f"{key}: {declared}, but {cfg.model.hf_path}/config.json has {hf_key}={actual} "
                              f"(drop the key or correct it)")


def _data_path(key: str, path: str | None) -> None:
    if path is None:
        raise ConfigError(f"{key}: required (a JSONL or Parquet file, or a saved HF dataset directory)")
    if not Path(path).exists():
        raise ConfigError(f"{key}={path}: not found")


def eval_set_name(item: str) -> tuple[str, str]:
    """`data.eval_paths` entry -> (benchmark name or alias, path). `name=path` names it; otherwise the file's
    stem, or, when the stem is no benchmark (`math500/test.jsonl`), its directory's name. KeyError if the
    name is no known benchmark."""
    if "=" in item:
        name, _, path = item.partition("=")
        canonical_name(name)
        return name, path
    p = Path(item)
    for candidate in (p.stem, p.parent.name):
        try:
            canonical_name(candidate)
            return candidate, item
        except KeyError:
            continue
    raise KeyError(f"{item}: neither {p.stem!r} nor {p.parent.name!r} is a known benchmark "
                   f"(known: {', '.join(BENCHMARKS)}); name it as NAME=PATH, e.g. math500={item}")


def check_inputs(cfg: Config, world_size: int | None = None) -> None:
    """Raise ConfigError naming the key for the first input that cannot work. `world_size` defaults to
    torchrun's WORLD_SIZE (no check without it)."""
    _model_dir("model.hf_path", cfg.model.hf_path, "the student: an HF directory with config.json and *.safetensors")
    _declared_sizes(cfg)
    for i, t in enumerate(cfg.all_teachers()):
        key = cfg.teacher_key(i)
        if t.backend in ("megatron", "hf") or (t.backend == "sglang" and t.server_url is None):
            _model_dir(f"{key}.hf_path", t.hf_path, f"the teacher model for {key}.backend={t.backend}")
        if t.tokenizer_path is not None:
            _model_dir(f"{key}.tokenizer_path", t.tokenizer_path, "the teacher's tokenizer and config files")
    _data_path("data.train_path", cfg.data.train_path)
    for i, item in enumerate(cfg.data.eval_paths):
        try:
            _name, path = eval_set_name(item)
        except KeyError as e:
            raise ConfigError(f"data.eval_paths[{i}]: {e.args[0]}") from None
        _data_path(f"data.eval_paths[{i}]", path)
    steps = max(cfg.train.steps, 1) * cfg.algo.ppo_epochs * cfg.algo.num_minibatches
    if cfg.optim.warmup_steps > steps:
        raise ConfigError(f"optim.warmup_steps: {cfg.optim.warmup_steps} exceeds the run's {steps} optimizer steps "
                          f"(train.steps x algo.ppo_epochs x algo.num_minibatches)")
    if world_size is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world_size = int(os.environ["WORLD_SIZE"])
    p = cfg.parallel
    layout = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if world_size is not None and world_size % layout:
        raise ConfigError(f"parallel.tensor_model_parallel_size: the world size {world_size} is not divisible by "
                          f"tensor_model_parallel_size * pipeline_model_parallel_size = "
                          f"{p.tensor_model_parallel_size} * {p.pipeline_model_parallel_size}")
