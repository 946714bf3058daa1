"""`megatron-opd train --config run.yaml [key=value ...]` (under torchrun for several ranks)."""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_opd.config import ConfigError, load_config


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatron-opd train", description=__doc__)
    p.add_argument("--config", default=None, help="YAML config (see examples/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.beta_kl=0.02 train.steps=10")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    _warn_if_it_will_not_fit(cfg, args.config)
    from megatron_opd.data.prompts import DataError
    from megatron_opd.models.checkpoint import CheckpointError
    from megatron_opd.models.hf_config import HFConfigError
    from megatron_opd.models.weight_mapping import WeightMappingError
    from megatron_opd.teacher.fidelity import PairMismatchError
    from megatron_opd.trainer.loop import Trainer, TrainingStopped
    from megatron_opd.trainer.preempt import PREEMPTED_EXIT, Preempted

    # Errors about what the user gave (config, paths, data, model files, checkpoints): one line, no traceback.
    input_errors = (ConfigError, DataError, HFConfigError, WeightMappingError, CheckpointError)
    try:
        trainer = Trainer(cfg)
    except PairMismatchError as e:
        print(f"preflight: {e}", file=sys.stderr)
        return 2
    except input_errors as e:
        print(f"{_label(e)}: {e}", file=sys.stderr)
        return 2
    try:
        trainer.train()
    except TrainingStopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    except Preempted as e:
        print(str(e), file=sys.stderr)
        return PREEMPTED_EXIT
    except PairMismatchError as e:
        print(f"preflight: {e}", file=sys.stderr)
        return 2
    except input_errors as e:
        print(f"{_label(e)}: {e}", file=sys.stderr)
        return 2
    finally:
        trainer.close()
    return 0


def _warn_if_it_will_not_fit(cfg, config_path) -> None:
    """`megatron-opd plan`'s verdict for this machine, once per machine (local rank 0), before anything is
    built: a run whose plan exceeds the GPU's memory or, on a CPU, the RAM is told so now rather than by the
    OOM killer later. Advice only: reading a config.json and a few formulas, never an error."""
    import os

    if int(os.environ.get("LOCAL_RANK") or 0) != 0:
        return
    from megatron_opd.plan import fit_warning

    text = fit_warning(cfg)
    if text:
        print(text.replace("<this config>", str(config_path or "<config>")), file=sys.stderr)


def _label(e: Exception) -> str:
    return "config error" if isinstance(e, ConfigError) else {
        "DataError": "data error", "HFConfigError": "model error", "WeightMappingError": "model error",
        "CheckpointError": "checkpoint error"}.get(type(e).__name__, "error")
