"""Atomic, resumable training checkpoints.

A checkpoint is a directory `step_{N:08d}/` holding `shared/` (the student's weights and optimizer state as
one megatron-core torch_dist checkpoint, written collectively in a form any TP/PP/DP layout and world size
can load), one `rank{R}.pt` per rank (RNGs, sampler, guard, schedule: small) and `meta.json` (written last,
with the layout that wrote it, so a directory is *complete* when `meta.json`, every rank file it announces
and `shared/`'s metadata exist). Resuming at another layout takes the shared part resharded and rank 0's
file for the rest. Checkpoints of format 1 (the per-rank student state of earlier versions) load only at
the world size that wrote them.
`latest` is a one-line text file naming the newest checkpoint, replaced atomically. Loading uses
`weights_only=True`: nothing we did not write as plain tensors/containers can execute on load.

Crash safety (a SIGKILL at any instruction leaves a loadable checkpoint):

- save: every rank writes into `.tmp_step_N/`; rank 0 adds `meta.json`, fsyncs, renames it to
  `step_N/`, then points `latest` at it, then prunes. A kill while writing leaves only a stale
  `.tmp_step_N/` (removed by the next save) and the previous checkpoint untouched.
- re-save of an existing step (e.g. after a collapse rollback): the old `step_N/` is first renamed
  to `.old_step_N/`, the new one renamed into place, `latest` updated, and only then is the old copy
  deleted. Nothing is deleted before its replacement is in place.
- load: `latest` -> `step_N/` when complete; else `.old_step_N/` (a kill between the two renames of a
  re-save: the previous copy of the same step); else, with a warning, the newest complete
  `step_*/` (a pointer to a missing or damaged directory never makes a run unresumable). Without
  `latest` (killed before the first pointer write) the newest complete `step_*/` is used too.
- pruning keeps the newest `keep_last` checkpoints by *parsed* step number (`step_100000000` is newer
  than `step_99999999`) among those not newer than the step `latest` names (newer ones are abandoned:
  a rollback's discarded trajectory), ignores names that are not `step_<digits>`, never removes the
  step `latest` names, and renames a directory to `.trash_*` before deleting it, so a kill mid-delete never leaves a
  half-deleted `step_*/` that looks complete. A complete `.old_step_N/` without a `step_N/` (left by a
  kill mid re-save) is renamed back to `step_N/` by the next save.

Test hook: with `MEGATRON_OPD_CKPT_PAUSE=<phase>:<step>` set, rank 0 stops at that point of the save of
that step (phases: `written` = all ranks' files and meta in the temporary dir, `moved_aside` = re-save
only, after the old copy was renamed aside, `renamed` = new dir in place, `latest` not yet updated),
touches the file named by `MEGATRON_OPD_CKPT_PAUSE_FILE` and sleeps, so a test can SIGKILL it there.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

LATEST = "latest"
PAUSE_ENV = "MEGATRON_OPD_CKPT_PAUSE"
PAUSE_FILE_ENV = "MEGATRON_OPD_CKPT_PAUSE_FILE"
_STEP_RE = re.compile(r"^step_(\d+)$")
FORMAT = 2
SHARED = "shared"

logger = logging.getLogger("megatron_opd.checkpoint")


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _old_dir(root: Path, step: int) -> Path:
    return root / f".old_step_{step:08d}"


def parse_step(name: str) -> Optional[int]:
    """`step_00000012` -> 12; anything else (`step_foo`, `.tmp_step_1`) -> None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


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


def _remove_dir(path: Path) -> None:
    """Delete a directory so that no kill leaves a partly deleted dir under its name: rename first."""
    if not path.exists():
        return
    trash = path.with_name(f".trash_{path.name.lstrip('.')}_{os.getpid()}")
    try:
        os.replace(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def _pause_for_test(phase: str, step: int) -> None:
    spec = os.environ.get(PAUSE_ENV)
    if not spec or spec != f"{phase}:{step}":
        return
    marker = os.environ.get(PAUSE_FILE_ENV)
    if marker:
        Path(marker).write_text(f"{phase}:{step}\n")
    time.sleep(3600)


def is_complete(path: Path) -> bool:
    """`meta.json` parses and every rank file it announces exists."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        shared = int(meta.get("format", 1)) < 2 or any((path / SHARED / f).is_file()
                                                         for f in ("metadata.json", ".metadata"))
        return shared and all((path / f"rank{r}.pt").is_file() for r in range(int(meta["world_size"])))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _rng_tracker() -> Any:
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker()


def _tracker_kind() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"  # on CPU, cpu_compat's tracker forks the CPU generator


def rng_state() -> dict[str, Any]:
    """Every RNG a step consumes, so a resumed run continues bit-for-bit. As megatron saves them
    (megatron/training/checkpointing.py, get_rng_state): this rank's CUDA generator -- the current device's only
    (torch.cuda.get_rng_state), not every visible device's -- and the states of megatron's RNG tracker (the streams
    forked per TP rank for dropout and init), which belong to this rank too."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = {}
    for name, s in _rng_tracker().get_states().items():
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"RNG tracker state {name!r} is a {type(s).__name__}, not a tensor (a CUDA-graph-safe "
                            "tracker?): a checkpoint cannot hold it")
        tracker[name] = s.clone()
    state["tracker"], state["tracker_kind"] = tracker, _tracker_kind()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()`'s RNGs on the rank that saved them (megatron's load: torch.cuda.set_rng_state, then
    the tracker's set_states). A checkpoint of earlier versions holds every visible device's CUDA state: the
    current device's entry is taken when there is one (as set_rng_state_all gave this device), otherwise the
    CUDA state is left as seeded, with a note (a resume that sees fewer GPUs per process). Tracker states saved
    on the other kind of device (CPU vs CUDA) are not applied."""
    torch.set_rng_state(state["torch"])
    random.setstate(_tuplify(state["python"]))
    np.random.set_state(_tuplify(state["numpy"]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):
            device = torch.cuda.current_device()
            if device < len(cuda):
                torch.cuda.set_rng_state(cuda[device])
            else:
                logger.info("checkpoint RNG state: CUDA states of %d devices (earlier format), none for the current "
                            "device %d; its CUDA generator stays as seeded", len(cuda), device)
        else:
            torch.cuda.set_rng_state(cuda)
    tracker = state.get("tracker")
    if tracker is not None:
        if state.get("tracker_kind") == _tracker_kind():
            _rng_tracker().set_states({name: s.clone() for name, s in tracker.items()})
        else:
            logger.info("checkpoint RNG state: tracker states saved on %s, this run is on %s; the tracker stays as "
                        "seeded", state.get("tracker_kind"), _tracker_kind())


def _drop_per_rank_rng(state: dict[str, Any]) -> None:
    """At another layout a rank reads rank 0's file: its CUDA generator and tracker states belong to rank 0's
    device and TP rank (the tracker's model-parallel stream is seeded per TP rank), so they are dropped and this
    run's own seeding (init_parallel) stands -- as megatron ignores the RNG state after a TP/PP change."""
    rng = state.get("rng")
    if isinstance(rng, dict):
        for k in ("cuda", "tracker", "tracker_kind"):
            rng.pop(k, None)


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


def per_rank_refusal(where: str, written: str, here: str) -> str:
    """Why a checkpoint of format 1 (the per-rank student shards of earlier versions) cannot resume here, and
    what to do: `written` says how it was written ("by 2 ranks", "at another TP/PP layout ..."), `here` this
    run's side. The check of the recorded world size and layout (`CheckpointManager.load`) and the one of the
    shards' shapes (`MegatronPolicy.load_state_dict`, for checkpoints that recorded their world size only)."""
    return (f"checkpoint {where} is in the per-rank format of megatron-opd before the torch_dist trainer state "
            f"and was written {written}; it resumes only there (this run {here}). Resume it once at its own "
            "layout: its next save is layout-free, and any TP/PP/DP layout or world size can resume from that one.")


def _layout_text(layout: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in layout.items())


class CheckpointManager:
    """Save / find / load step checkpoints under `root`, keeping the newest `keep_last`."""

    def __init__(self, root: str | Path, keep_last: int = 3, rank: int = 0, world_size: int = 1,
                 barrier: Optional[Any] = None, layout: Optional[dict[str, int]] = None):
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self.layout = {"world_size": world_size, **(layout or {})}  # tp, pp, dp: who wrote the rank files
        self._barrier = barrier or (lambda: None)

    # -- finding ---------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending (by number, not name): `step_N/`, or the aside copy
        `.old_step_N/` that a kill in the middle of a re-save of step N left as its only copy."""
        if not self.root.is_dir():
            return []
        out = set()
        for p in self.root.iterdir():
            s = parse_step(p.name[len(".old_"):] if p.name.startswith(".old_step_") else p.name)
            if s is not None and s not in out and self._path(s) is not None:
                out.add(s)
        return sorted(out)

    def _pointer(self) -> Optional[str]:
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        return pointer.read_text().strip()

    def _path(self, step: int) -> Optional[Path]:
        """The complete directory holding `step`: `step_N/`, else the aside copy `.old_step_N/`."""
        for p in (_step_dir(self.root, step), _old_dir(self.root, step)):
            if p.is_dir() and is_complete(p):
                return p
        return None

    def latest_step(self) -> Optional[int]:
        """The step `latest` names, or None when there is no checkpoint. A pointer to a missing or
        incomplete directory falls back (with a warning) to the aside copy of that step, then to the
        newest complete checkpoint."""
        name = self._pointer()
        if name is not None:
            step = parse_step(name)
            path = self._path(step) if step is not None else None
            if path is not None:
                if path.name != name:
                    logger.warning("checkpoint pointer %s names %r, which is missing or incomplete (a save was "
                                   "killed while replacing it); using its previous copy %s", self.root / LATEST,
                                   name, path.name)
                return step
        steps = self.steps()
        fallback = steps[-1] if steps else None
        if name is not None or fallback is not None:
            why = (f"checkpoint pointer {self.root / LATEST} names {name!r}, which is missing or incomplete"
                   if name is not None else f"no checkpoint pointer {self.root / LATEST}")
            logger.warning("%s; %s", why, f"using the newest complete checkpoint, step {fallback}"
                           if fallback is not None else "no complete checkpoint exists")
        return fallback

    # -- saving ----------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], meta: Optional[dict[str, Any]] = None,
             write_shared: Optional[Callable[[Path], None]] = None) -> Path:
        """Write this rank's `state`, and (collectively, every rank) `write_shared(dir)`'s torch_dist part; rank
        0 finalises (rename, meta, latest, pruning) after a barrier."""
        final = _step_dir(self.root, step)
        tmp = self.root / f".tmp_step_{step:08d}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                _remove_dir(tmp)
            tmp.mkdir()
            if write_shared is not None:
                (tmp / SHARED).mkdir()
        self._barrier()
        if write_shared is not None:
            write_shared(tmp / SHARED)
        payload = _to_safe(state)
        part = tmp / f"rank{self.rank}.pt"
        with open(part, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        self._barrier()
        if self.rank == 0:
            info = {"step": step, **self.layout, "format": FORMAT if write_shared is not None else 1, **(meta or {})}
            with open(tmp / "meta.json", "w") as f:
                f.write(json.dumps(info, indent=1))
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            _pause_for_test("written", step)
            old = _old_dir(self.root, step)
            if final.exists():
                if old.exists():  # left by an earlier kill; `final` is the newer complete copy
                    _remove_dir(old)
                os.replace(final, old)
                _fsync_dir(self.root)
                _pause_for_test("moved_aside", step)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _pause_for_test("renamed", step)
            _atomic_write_text(self.root / LATEST, final.name)
            _remove_dir(old)
            self._prune()
        self._barrier()
        return final

    # -- loading ---------------------------------------------------------------------------------

    def load(self, step: Optional[int] = None) -> tuple[int, dict[str, Any], Optional[Path]]:
        """(step, this rank's state, the torch_dist dir of the shared part or None for a format-1 checkpoint).
        At the layout that wrote it each rank reads its own file; at another layout every rank reads rank 0's
        (the CPU, Python and numpy RNG states then are rank 0's: sampling is seeded per step, so the run goes on the
        same; the per-rank CUDA and tracker states are dropped, see `_drop_per_rank_rng`)."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint under {self.root}")
        path = self._path(step)
        if path is None:
            raise FileNotFoundError(f"checkpoint step {step} under {self.root}: missing or incomplete")
        meta = json.loads((path / "meta.json").read_text())
        fmt = int(meta.get("format", 1))
        written = {k: meta[k] for k in self.layout if k in meta}
        # format 1 recorded the world size only, and its rank files hold each rank's own shard
        same = written == self.layout if fmt >= 2 else meta["world_size"] == self.world_size
        if fmt < 2 and meta["world_size"] != self.world_size:
            raise RuntimeError(per_rank_refusal(str(path), f"by {meta['world_size']} ranks", f"has {self.world_size}"))
        if fmt < 2 and written != {k: self.layout[k] for k in written}:  # a recorded TP/PP/DP of its own
            raise RuntimeError(per_rank_refusal(str(path), f"at {_layout_text(written)}",
                                                f"is at {_layout_text(self.layout)}"))
        state = torch.load(path / f"rank{self.rank if same else 0}.pt", map_location="cpu", weights_only=True)
        if "rng" in state and "numpy" in state["rng"]:
            state["rng"]["numpy"] = _from_safe_numpy_state(state["rng"]["numpy"])
        if not same:
            _drop_per_rank_rng(state)
            if self.rank == 0:
                logger.info("checkpoint %s was written at %s; resuming at %s (weights and optimizer resharded; the "
                            "CUDA and RNG-tracker states stay as this layout seeded them)", path, written, self.layout)
        return step, state, (path / SHARED if fmt >= 2 else None)

    def _prune(self) -> None:
        """Keep the newest `keep_last` complete checkpoints by step number, and always the one `latest`
        names; drop incomplete `step_*` dirs older than it and leftovers of killed saves."""
        for aside in self.root.glob(".old_step_*"):  # a kill mid re-save: the old copy is the only one
            s = parse_step(aside.name[len(".old_"):])
            if s is not None and not _step_dir(self.root, s).exists() and is_complete(aside):
                os.replace(aside, _step_dir(self.root, s))
        name = self._pointer()
        protected = parse_step(name) if name is not None else None
        dirs = {}
        for p in self.root.iterdir():
            s = parse_step(p.name)
            if s is not None and p.is_dir():
                dirs[s] = p
        # Steps above the one `latest` names are abandoned (a rollback's discarded trajectory, or a save
        # killed before its pointer write): a resume never reaches them, so they neither count towards
        # keep_last nor survive.
        complete = sorted(s for s, p in dirs.items() if is_complete(p) and (protected is None or s <= protected))
        keep = set(complete[-self.keep_last:]) | ({protected} if protected is not None else set())
        for s, p in dirs.items():
            if s in keep:
                continue
            if s in complete or protected is not None:
                _remove_dir(p)
        for stale in list(self.root.glob(".tmp_step_*")) + list(self.root.glob(".old_step_*")) + list(
                self.root.glob(".trash_*")):
            shutil.rmtree(stale, ignore_errors=True)
