"""Atomic, resumable training checkpoints.

A checkpoint is a directory `step_{N:08d}/` holding one `rank{R}.pt` per rank plus `meta.json`. It is
written under a temporary name and renamed into place only when complete, and `latest` (a one-line
text file, replaced atomically) is updated last, so a kill at any moment leaves the previous checkpoint
intact and `latest` pointing at a complete one. Loading uses `weights_only=True`: nothing we did not
write as plain tensors/containers can execute on load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

LATEST = "latest"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def rng_state() -> dict[str, Any]:
    """Every RNG a step consumes, so a resumed run continues bit-for-bit."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuplify(state["python"]))
    np.random.set_state(_tuplify(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_tuplify(v) for v in x)
    return x


def _to_safe(obj: Any) -> Any:
    """numpy arrays/scalars -> tensors/python so `weights_only=True` loads them."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _to_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_safe(v) for v in obj)
    return obj


def _from_safe_numpy_state(state: Any) -> Any:
    if isinstance(state, (list, tuple)):
        return tuple(v.numpy() if isinstance(v, torch.Tensor) else v for v in state)
    return state


class CheckpointManager:
    """Save / find / load step checkpoints under `root`, keeping the newest `keep_last`."""

    def __init__(self, root: str | Path, keep_last: int = 3, rank: int = 0, world_size: int = 1,
                 barrier: Optional[Any] = None):
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self._barrier = barrier or (lambda: None)

    def latest_step(self) -> Optional[int]:
        """The step recorded in `latest`, or None. A pointer to a missing/incomplete dir is an error."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        name = pointer.read_text().strip()
        path = self.root / name
        if not (path / "meta.json").is_file():
            raise RuntimeError(f"checkpoint pointer {pointer} names {name}, which is missing or incomplete")
        return int(json.loads((path / "meta.json").read_text())["step"])

    def save(self, step: int, state: dict[str, Any], meta: Optional[dict[str, Any]] = None) -> Path:
        """Write this rank's `state`; rank 0 finalises (rename, meta, latest, pruning) after a barrier."""
        final = _step_dir(self.root, step)
        tmp = self.root / f".tmp_step_{step:08d}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        self._barrier()
        payload = _to_safe(state)
        part = tmp / f"rank{self.rank}.pt"
        with open(part, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        self._barrier()
        if self.rank == 0:
            info = {"step": step, "world_size": self.world_size, **(meta or {})}
            (tmp / "meta.json").write_text(json.dumps(info, indent=1))
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _atomic_write_text(self.root / LATEST, final.name)
            self._prune()
        self._barrier()
        return final

    def load(self, step: Optional[int] = None) -> tuple[int, dict[str, Any]]:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint under {self.root}")
        path = _step_dir(self.root, step)
        meta = json.loads((path / "meta.json").read_text())
        if meta["world_size"] != self.world_size:
            raise RuntimeError(f"checkpoint {path} was written by {meta['world_size']} ranks; this run has "
                               f"{self.world_size} (reshard with `megatron-opd convert`)")
        state = torch.load(path / f"rank{self.rank}.pt", map_location="cpu", weights_only=True)
        if "rng" in state and "numpy" in state["rng"]:
            state["rng"]["numpy"] = _from_safe_numpy_state(state["rng"]["numpy"])
        return step, state

    def _prune(self) -> None:
        steps = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in steps[: max(0, len(steps) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp_step_*"):
            shutil.rmtree(stale, ignore_errors=True)
