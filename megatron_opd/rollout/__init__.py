"""Rollout engines (local HF, SGLang) behind the contract in base.py; heavy backends import lazily."""

from __future__ import annotations

import os
import socket
from typing import Any, Optional
from urllib.parse import urlparse

import torch

from megatron_opd.rollout.base import (EOSMismatchError, RolloutEngine, Sample, SamplingParams, StaleWeightsError,
                                       assert_fresh, check_eos_compat, eos_ids_from, iter_buckets, push_weights)
from megatron_opd.rollout.server import api_key_from_env, sglang_cli_args


def make_rollout_engine(cfg: Any, hf_path: str, model: Optional[Any] = None,
                        eos_token_ids: Optional[list[int]] = None, pad_token_id: Optional[int] = None,
                        log_path: Optional[str] = None, dtype: Optional[Any] = None) -> RolloutEngine:
    """The one place rollout engines are built (trainer, eval, demo), from a `RolloutConfig`:
      * backend=local: LocalEngine on `model` if given, else loaded from `hf_path` in `dtype` (default
        fp32; the trainer passes the student's) on CUDA when available, decoding with rollout.num_threads.
      * backend=sglang, sglang_mode=engine: in-process sglang.Engine (mem_fraction_static and
        rollout.sglang_args as keyword arguments; with
        colocate=true on CUDA, SGLang's memory saver so the trainer can release/resume it).
      * backend=sglang, sglang_mode=server: attach to cfg.server_url when set (nothing is spawned; that
        URL is the one contacted), else launch `sglang.launch_server` bound to cfg.host:cfg.port (with
        rollout.sglang_args as flags).
    The API key is read from the environment variable named by cfg.api_key_env (a launched server gets
    that key, or a generated one, as --api-key)."""
    if cfg.backend == "local":
        from megatron_opd.rollout.local import LocalEngine  # lazy: each engine pulls its own stack

        eos = eos_token_ids or eos_ids_from(hf_path)
        opts = dict(eos_token_ids=eos, pad_token_id=pad_token_id, num_threads=getattr(cfg, "num_threads", 0),
                    pack_weights=bool(getattr(cfg, "pack_weights", False)),
                    lean_decode=bool(getattr(cfg, "lean_decode", False)))
        if model is not None:
            return LocalEngine(model, **opts)
        return LocalEngine.from_pretrained(hf_path, dtype=dtype or torch.float32,
                                           device="cuda" if torch.cuda.is_available() else "cpu", **opts)
    if cfg.backend == "sglang":
        from megatron_opd.rollout.sglang_engine import SGLangEngine  # lazy: as above

        # release/resume needs SGLang's memory saver (torch_memory_saver): CUDA only, and only on an engine
        # or server we start with it on (an attached server may not have --enable-memory-saver)
        memory_saver = bool(cfg.colocate) and torch.cuda.is_available() and cfg.server_url is None
        sgl_args = {**dict(getattr(cfg, "sglang_args", None) or {}), "mem_fraction_static": cfg.mem_fraction_static}
        return SGLangEngine(hf_path, mode=cfg.sglang_mode, eos_token_ids=eos_token_ids, server_url=cfg.server_url,
                            host=cfg.host, port=cfg.port, engine_kwargs=sgl_args, server_args=sglang_cli_args(sgl_args),
                            api_key=api_key_from_env(getattr(cfg, "api_key_env", None)), memory_saver=memory_saver,
                            weight_sync_timeout=getattr(cfg, "weight_sync_timeout", 600.0), log_path=log_path)
    raise ValueError(f"rollout.backend: unknown {cfg.backend!r} (expected local or sglang)")


def weight_sync_backend(parallel_backend: str = "auto") -> str:
    """Backend of the disaggregated weight group: the trainer's parallel.backend, or with "auto" NCCL when
    CUDA is available and gloo otherwise."""
    if parallel_backend in ("nccl", "gloo"):
        return parallel_backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def weight_sync_address(engine: Any) -> str:
    """Address the engine reaches trainer rank 0 at for the weight-group rendezvous: $MEGATRON_OPD_WEIGHT_SYNC_ADDR,
    else 127.0.0.1 for an engine on this machine (in-process or a loopback URL), else this host's name."""
    if os.environ.get("MEGATRON_OPD_WEIGHT_SYNC_ADDR"):
        return os.environ["MEGATRON_OPD_WEIGHT_SYNC_ADDR"]
    url = getattr(engine, "url", None)
    host = urlparse(url).hostname if url else None
    if host is None or host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    return socket.getfqdn()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def sync_weights(engine: Any, named_tensors: Any, version: int, cfg: Any, parallel_backend: str = "auto") -> int:
    """Push the trainer's HF-named weights to `engine` the way cfg (a RolloutConfig) says; returns the
    number of buckets sent. SGLang with colocate=false: over a weight process group (created on the first
    call: init_weights_update_group, then update_weights_from_distributed per bucket; NCCL on GPU, gloo on
    CPU). Otherwise by tensor (update_weights_from_tensor), after resume_memory() when the colocated
    engine's memory was released for training (see release_engine_memory)."""
    if cfg.backend == "sglang" and not cfg.colocate:
        if not engine.has_weight_group:
            engine.init_weight_group(weight_sync_address(engine), _free_port(),
                                     backend=weight_sync_backend(parallel_backend))
        return push_weights(engine, named_tensors, version, bucket_mb=cfg.sync_bucket_mb, via="distributed")
    if getattr(engine, "memory_released", False):
        engine.resume_memory()
        engine.memory_released = False
    return push_weights(engine, named_tensors, version, bucket_mb=cfg.sync_bucket_mb)


def release_engine_memory(engine: Any, cfg: Any) -> bool:
    """Colocated SGLang: free the engine's weights and KV cache while the trainer computes (sync_weights
    resumes it before the next generation). A no-op (False) for other engines or without the memory saver."""
    if cfg.backend != "sglang" or not cfg.colocate or not getattr(engine, "memory_saver", False):
        return False
    if not getattr(engine, "memory_released", False):
        engine.release_memory()
        engine.memory_released = True
    return True


__all__ = ["EOSMismatchError", "RolloutEngine", "Sample", "SamplingParams", "StaleWeightsError", "assert_fresh",
           "check_eos_compat", "eos_ids_from", "iter_buckets", "make_rollout_engine", "push_weights", "release_engine_memory", "sync_weights",
           "weight_sync_address", "weight_sync_backend"]
