"""`megatron-opd doctor`: what this machine can run, so users learn it before a job fails at step 0."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import platform
import sys


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def report() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in ("torch", "megatron-core", "transformers", "transformer-engine", "sglang", "math-verify",
                 "tensorboard", "nvidia-ml-py", "datasets"):
        out[dist] = _version(dist)
    try:
        import torch

        out["cuda"] = f"{torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "none (CPU mode: gloo, local layer spec)"
    except ImportError:
        out["cuda"] = "torch missing"
    try:
        importlib.import_module("megatron.core")
        out["megatron.core import"] = "ok"
    except Exception as e:  # noqa: BLE001 - report any import failure verbatim
        out["megatron.core import"] = f"FAILED: {e}"
    return out


def main(argv: list[str]) -> int:
    for k, v in report().items():
        print(f"{k:22s} {v}")
    return 0
