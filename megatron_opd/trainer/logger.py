"""Run logging: a JSONL metrics file (the source of truth for `megatron-opd plot`), tensorboard
scalars and text samples, and GPU utilisation/memory from NVML where GPUs exist."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

from megatron_opd.metrics.runlog import METRICS_FILE, read_metrics  # noqa: F401 - read_metrics: its old home

SAMPLES_FILE = "samples.jsonl"
logger = logging.getLogger("megatron_opd.logger")


def gpu_stats() -> dict[str, float]:
    """Per-GPU utilisation and memory via nvidia-ml-py; empty without GPUs or the package."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: no stats
        return {}
    out: dict[str, float] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out[f"gpu/{i}/util_pct"] = float(util.gpu)
            out[f"gpu/{i}/mem_used_gb"] = mem.used / 2**30
    finally:
        pynvml.nvmlShutdown()
    return out


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


def _open_append(path: Path) -> Any:
    """Open a JSONL file for appending, first cutting a torn last line (a process killed mid-write) back to
    the last complete one: appended rows would otherwise be glued onto it, and the file unreadable."""
    if path.is_file():
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                logger.warning("%s: dropping a torn last line (%d bytes) left by an interrupted write", path,
                               len(data) - keep)
                f.truncate(keep)
    return open(path, "a")


class RunLogger:
    """Writes only on the logging rank (rank 0); other ranks get a no-op logger."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, jsonl: bool = True, enabled: bool = True):
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self._tb = None
        self._jsonl = None
        self._samples = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self._jsonl = _open_append(self.out_dir / METRICS_FILE)
            self._samples = _open_append(self.out_dir / SAMPLES_FILE)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except ImportError:
                self._tb = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **{k: _clean(v) for k, v in metrics.items()}}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(float(v)):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        if not self.enabled or not samples:
            return
        if self._samples is not None:
            for s in samples:
                self._samples.write(json.dumps({"step": step, **s}) + "\n")
            self._samples.flush()
        if self._tb is not None:
            text = "\n\n---\n\n".join(
                f"**prompt**: {s.get('prompt', '')}\n\n**response**: {s.get('response', '')}" for s in samples)
            self._tb.add_text("samples", text, step)

    def close(self) -> None:
        for f in (self._jsonl, self._samples):
            if f is not None:
                f.close()
        if self._tb is not None:
            self._tb.close()


