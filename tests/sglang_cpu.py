"""Setup for the tests that run real SGLang (marker `sglang`), on GPU machines and on CPU test machines.

`require_sglang()` skips with "sglang is not importable ..." where sglang is missing (an allowed skip, except
under MEGATRON_OPD_REQUIRE_SGLANG=1, which `.ci/run`'s SGLang leg sets: see tests/_strict_skips.py). On a
machine without CUDA it prepares SGLang's CPU engine, before sglang is imported:
  * SGLANG_USE_CPU_ENGINE=1 (without it the rotary embedding imports vllm, the scheduler dies and SGLang
    SIGKILLs its parent, i.e. the whole pytest run);
  * when no real `sgl_kernel` is importable, the test-only stand-in tests/support/sgl_kernel_cpu goes on
    sys.path and on PYTHONPATH (for the scheduler processes and launched servers). It is never used where
    CUDA is available and never shadows an installed sgl_kernel.
Both go into os.environ, so every SGLang process started from the tests inherits them.

CPU_SGLANG_ARGS are the ServerArgs that run SGLang on this CPU (rollout.sglang_args / teacher.sglang_args;
engine keyword arguments). KV cache: each engine reserves mem_fraction_static x the machine's memory, so
several engines fit only with a small fraction and a token cap.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

STANDIN_DIR = Path(__file__).resolve().parent / "support" / "sgl_kernel_cpu"
SKIP_REASON = "sglang is not importable in this environment"

# fp32: matches the trainer's CPU numerics (bf16 was also much slower on a 2-core CPU)
CPU_SGLANG_ARGS: dict[str, Any] = {"device": "cpu", "attention_backend": "torch_native", "dtype": "float32",
                                   "disable_cuda_graph": True, "max_total_tokens": 4096, "max_running_requests": 16,
                                   "chunked_prefill_size": 1024}
CPU_MEM_FRACTION = 0.05


def _prepend_env_path(var: str, entry: str) -> None:
    parts = [p for p in os.environ.get(var, "").split(os.pathsep) if p]
    if entry not in parts:
        os.environ[var] = os.pathsep.join([entry, *parts])


def use_sgl_kernel_standin() -> None:
    """Put the CPU stand-in for sgl_kernel on sys.path and PYTHONPATH. Refuses where CUDA is available or
    a real sgl_kernel is installed: the stand-in implements one kernel and must never replace a real one."""
    import torch

    if torch.cuda.is_available():
        raise RuntimeError("tests/support/sgl_kernel_cpu is a CPU test stand-in; CUDA is available here, so "
                           "SGLang must use a real sgl_kernel (pip install sglang-kernel)")
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is not None and not str(spec.origin or "").startswith(str(STANDIN_DIR)):
        raise RuntimeError(f"a real sgl_kernel is installed ({spec.origin}); not shadowing it with the stand-in")
    if str(STANDIN_DIR) not in sys.path:
        sys.path.insert(0, str(STANDIN_DIR))
    _prepend_env_path("PYTHONPATH", str(STANDIN_DIR))


def sglang_on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def require_sglang() -> Any:
    """Skip unless sglang is importable; on a CPU machine set up its CPU engine first. Returns sglang."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(SKIP_REASON)
    if sglang_on_cpu():
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        spec = importlib.util.find_spec("sgl_kernel")
        if spec is None or str(spec.origin or "").startswith(str(STANDIN_DIR)):  # a real one is used as is
            use_sgl_kernel_standin()
    import sglang

    return sglang


def sglang_args(**overrides: Any) -> dict[str, Any]:
    """ServerArgs for SGLang engines/servers in tests: the CPU set on CPU machines, nothing extra on GPUs."""
    return {**(CPU_SGLANG_ARGS if sglang_on_cpu() else {}), **overrides}


def mem_fraction() -> float:
    return CPU_MEM_FRACTION if sglang_on_cpu() else 0.3


# ---------------------------------------------------------------------------------------------------------
# shared by the real-SGLang tests

# |SGLang log-prob - HF/megatron log-prob| allowed at temperature 1, fp32 on both sides (measured: ~5e-7)
LOGPROB_TOL = 1e-4

MEASURED: dict[str, float] = {}  # printed at the end of the run (tests/conftest.py)


def measured(name: str, value: float) -> float:
    MEASURED[name] = value
    return value


def tiny_models(root: Path) -> tuple[Path, Path]:
    """The demo's tiny student (2 layers) / teacher (3 layers): Qwen2, byte tokenizer, EOS 2."""
    from megatron_opd.demo import _tiny_models

    return _tiny_models(root)


def hf_model(path: Path, state: Any = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if state is not None:
        m.load_state_dict(dict(state))
    return m


def hf_logprobs(model: Any, prompt: list[int], response: list[int]) -> Any:
    """log pi(response_t | prompt, response_<t) at temperature 1 from an HF model."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(response)])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def max_logprob_gap(samples: list[Any], model: Any) -> float:
    import torch

    return max(float((torch.tensor(s.logprobs) - hf_logprobs(model, s.prompt_ids, s.response_ids)).abs().max())
               for s in samples)


def perturbed(model: Any, scale: float = 0.05, seed: int = 7) -> list[tuple[str, Any]]:
    """Every HF weight plus seeded Gaussian noise: new weights whose outputs differ visibly."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + scale * torch.randn(p.shape, generator=g)) for n, p in model.state_dict().items()]


def check_sample_contract(samples: list[Any], prompts: list[list[int]], n: int, max_new: int, stop: set[int],
                          version: int) -> None:
    """The Sample contract of rollout/base.py, on real SGLang output."""
    import math

    assert len(samples) == len(prompts) * n
    for k, s in enumerate(samples):
        assert s.prompt_index == k // n and s.prompt_ids == prompts[k // n]
        assert s.weight_version == version
        assert 1 <= len(s.response_ids) <= max_new and len(s.logprobs) == len(s.response_ids)
        assert all(math.isfinite(x) and x <= 1e-6 for x in s.logprobs), s.logprobs
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in stop and not any(t in stop for t in s.response_ids[:-1])
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == max_new
            assert not any(t in stop for t in s.response_ids)
