"""CUDA -> CPU shims that let megatron-core (0.16.x) build, run and train a GPTModel without a GPU.

megatron-core assumes CUDA in a handful of places (device queries, the RNG tracker, a few tensor
factories with ``device="cuda"``, ``Tensor.type()`` string checks). On a CPU-only host we patch
exactly those, so the *same* megatron code paths (TP/PP over gloo, DDP, optimizer) run in tests and
CPU smoke runs. Everything CPU-specific lives in this module; nothing here runs when CUDA exists.

Shims (each replaces one megatron assumption; see ``apply_cpu_shims``):

- ``torch.cuda.current_device`` -> returns ``"cpu"``: megatron passes it as ``device=`` to factories
  (rotary embedding, tensor-parallel layers, mappings, GPTModel); on CPU that must be the CPU device.
- ``torch.cuda.synchronize`` -> no-op: called by parallel_state / DDP around collectives; CPU ops are
  synchronous.
- ``torch.cuda.current_stream`` / ``default_stream`` -> a null stream: DDP's grad buffers wait on
  streams; on CPU there is only program order.
- ``torch.cuda.empty_cache`` -> no-op (already harmless on CPU builds; pinned for safety).
- ``tensor_parallel.random.CudaRNGStatesTracker`` -> ``CPURNGStatesTracker``: the tracker that
  forks per-TP-rank RNG streams (init, dropout) reads/writes CUDA generator states; the CPU version
  forks the CPU generator instead, keeping megatron's seeding semantics (distinct TP-rank streams).
- ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` -> the CPU generator's:
  activation recompute (``CheckpointFunction``) saves and restores the RNG states around the rerun.
- ``transformer.utils.get_default_causal_mask`` (also bound in ``fusions.fused_softmax``) ->
  builds the causal mask on CPU instead of ``device="cuda"``.
- module-level ``torch`` in the modules of ``_MODULES_WITH_CUDA_FACTORIES`` (pipeline schedules,
  optimizer, clip_grads, grad_scaler, DDP grad buffers, core.utils' multi-tensor l2 norm, rerun
  state machine, dist_checkpointing exchange/save) -> a proxy whose tensor factories
  (``tensor/zeros/ones/empty/full/arange/*_like``) map ``device="cuda"`` to CPU: those modules create
  scalars/buffers on ``"cuda"`` (token counts, grad norm, found-inf, checkpoint exchange buffers).
- ``torch.Tensor.type()`` (no arguments, called from a ``megatron.core`` frame, CPU tensor) ->
  reports the ``torch.cuda.*Tensor`` name: the optimizer asserts ``param.grad.type() ==
  'torch.cuda.FloatTensor'``. Calls from any other module, or with arguments, are untouched.
- ``torch.Tensor.cuda()`` called from a ``megatron.core`` frame -> returns the tensor itself: e.g.
  LanguageModule moves the tied embedding to CUDA before all-reducing it across PP stages.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any

import torch

_APPLIED = False

_MODULES_WITH_CUDA_FACTORIES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.tensor_parallel.data",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)


def shims_applied() -> bool:
    """True once ``apply_cpu_shims`` has patched megatron (tests use it to check idempotence)."""
    return _APPLIED


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    d = torch.device(device)
    return torch.device("cpu") if d.type == "cuda" else d


class _CpuTorchProxy:
    """Stands in for the ``torch`` module inside selected megatron modules: forwards everything to
    torch but sends tensor factories asked for ``device="cuda"`` to the CPU."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")

    def __init__(self) -> None:
        for name in self._FACTORIES:
            setattr(self, name, self._wrap(getattr(torch, name)))

    @staticmethod
    def _wrap(fn: Any) -> Any:
        def factory(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        factory.__name__ = getattr(fn, "__name__", "factory")
        return factory

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _NullStream:
    """A CUDA stream stand-in: on CPU every op is already ordered, so waits/records do nothing."""

    def wait_stream(self, *_: Any) -> None:
        return None

    def wait_event(self, *_: Any) -> None:
        return None

    def record_event(self, *_: Any) -> "_NullEvent":
        return _NullEvent()

    def synchronize(self) -> None:
        return None


class _NullEvent:
    def wait(self, *_: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _make_cpu_rng_tracker_class(base: type) -> type:
    class CPURNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """megatron's CudaRNGStatesTracker with the CPU generator as the forked state."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CPURNGStatesTracker


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _patch_tensor_type() -> None:
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("megatron.core"):
                return _CUDA_TYPE_NAMES[self.dtype]
        return original(self, *args, **kwargs)

    type_.__doc__ = original.__doc__
    torch.Tensor.type = type_  # type: ignore[method-assign]


def _patch_tensor_cuda() -> None:
    original = torch.Tensor.cuda

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if sys._getframe(1).f_globals.get("__name__", "").startswith("megatron.core"):
            return self
        return original(self, *args, **kwargs)

    cuda.__doc__ = original.__doc__
    torch.Tensor.cuda = cuda  # type: ignore[method-assign]


def apply_cpu_shims(force: bool = False) -> bool:
    """Patch megatron-core for CPU execution (see the module docstring for each shim and why).

    Idempotent; does nothing when CUDA is available (unless ``force``, used only by tests).
    Returns True when the shims are (now) in place.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available() and not force:
        return False

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]

    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")
    random_mod.CudaRNGStatesTracker = _make_cpu_rng_tracker_class(random_mod.CudaRNGStatesTracker)
    random_mod.initialize_rng_tracker(force_reset=True)
    random_mod._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random_mod._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    tutils = importlib.import_module("megatron.core.transformer.utils")
    tutils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax = importlib.import_module("megatron.core.fusions.fused_softmax")
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask

    proxy = _CpuTorchProxy()
    for name in _MODULES_WITH_CUDA_FACTORIES:
        importlib.import_module(name).torch = proxy

    _patch_tensor_type()
    _patch_tensor_cuda()
    _APPLIED = True
    return True


__all__ = ["apply_cpu_shims", "shims_applied"]
