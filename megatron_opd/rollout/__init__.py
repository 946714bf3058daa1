"""Rollout engines (local HF, SGLang) behind the contract in base.py; heavy backends import lazily."""

from __future__ import annotations

from typing import Any, Optional

from megatron_opd.rollout.base import (EOSMismatchError, RolloutEngine, Sample, SamplingParams, StaleWeightsError,
                                       assert_fresh, check_eos_compat, eos_ids_from, iter_buckets, push_weights)


def make_rollout_engine(cfg: Any, hf_path: str, model: Optional[Any] = None,
                        eos_token_ids: Optional[list[int]] = None) -> RolloutEngine:
    """Engine for a `RolloutConfig`: backend=local (on `model` if given, else loaded from `hf_path`) or
    sglang (engine or server mode, bound to cfg.host:cfg.port, or attached to cfg.server_url)."""
    if cfg.backend == "local":
        from megatron_opd.rollout.local import LocalEngine

        if model is not None:
            return LocalEngine(model, eos_token_ids=eos_token_ids or eos_ids_from(hf_path))
        return LocalEngine.from_pretrained(hf_path, eos_token_ids=eos_token_ids or eos_ids_from(hf_path))
    if cfg.backend == "sglang":
        from megatron_opd.rollout.sglang_engine import SGLangEngine

        kwargs = {"mem_fraction_static": cfg.mem_fraction_static}
        return SGLangEngine(hf_path, mode=cfg.sglang_mode, eos_token_ids=eos_token_ids, server_url=cfg.server_url,
                            host=cfg.host, port=cfg.port, engine_kwargs=kwargs,
                            server_args=["--mem-fraction-static", str(cfg.mem_fraction_static)])
    raise ValueError(f"rollout.backend: unknown {cfg.backend!r} (expected local or sglang)")


__all__ = ["EOSMismatchError", "RolloutEngine", "Sample", "SamplingParams", "StaleWeightsError", "assert_fresh",
           "check_eos_compat", "eos_ids_from", "iter_buckets", "make_rollout_engine", "push_weights"]
