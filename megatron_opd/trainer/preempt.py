"""Preemption: finish the current step, checkpoint, and exit with PREEMPTED_EXIT so the job can requeue.

A stop is requested in either of two ways, because on Slurm the signal rarely reaches the trainer itself:

* SIGUSR1 delivered to the training processes themselves (`kill -USR1` of a worker, a launcher that
  signals its workers). Not `scancel --signal=USR1 JOB` without `--batch`: that reaches torchrun's agent,
  which does not handle USR1 and dies;
* the request file `<logging.out_dir>/preempt.request`, which the sbatch scripts write when the batch
  shell receives `--signal=B:USR1@SECONDS` or `scancel --batch --signal=USR1` (scripts/slurm/common.sh).
  A shared filesystem carries it to every node; rank 0 reads it.

The ranks agree at the end of every step (one all-reduce of a flag), so they all checkpoint the same step
and none waits in a collective the others left. The request file is consumed when the run stops on it; the
job scripts clear stale requests and markers when a job starts (a request that arrives while the trainer
is still loading must survive until its first step).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_opd.models.parallel import host_group

logger = logging.getLogger("megatron_opd.trainer")

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: checkpointed, resubmit to go on
REQUEST_FILE = "preempt.request"
MARKER_FILE = "preempted.json"  # written by rank 0 after the checkpoint: the job script requeues on it


class Preempted(RuntimeError):
    """Training stopped at a step boundary on a preemption request, after a checkpoint."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"preempted ({reason}): checkpointed at step {step}; resubmit to resume from it")
        self.step = step


class PreemptionWatch:
    """Collects a stop request (signal or file) and turns it into one decision shared by all ranks."""

    def __init__(self, out_dir: Path, rank: int, signals: tuple[int, ...] = (signal.SIGUSR1,)):
        self.request_file = Path(out_dir) / REQUEST_FILE
        self.marker_file = Path(out_dir) / MARKER_FILE
        self.rank = rank
        self._signalled: str = ""
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():  # Python installs handlers there only
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        if rank == 0 and self.marker_file.exists():
            logger.info("removing %s (left by the run this one resumes)", self.marker_file)
            self.marker_file.unlink(missing_ok=True)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signalled = signal.Signals(signum).name

    def reason(self) -> str:
        """The local reason to stop ('' for none): the signal, or the request file on rank 0."""
        if self._signalled:
            return self._signalled
        if self.rank == 0 and self.request_file.exists():
            return str(self.request_file)
        return ""

    def requested(self) -> str:
        """Collective: a non-empty reason on every rank when any rank has one."""
        local = self.reason()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local
        flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group("world"))  # gloo: a CPU flag on any backend
        if int(flag.item()) == 0:
            return ""
        return local or "another rank's request"

    def mark(self, step: int, reason: str) -> None:
        """Rank 0 records that the run stopped on a request at `step` (after its checkpoint): torchrun reports
        any worker exit as its own failure, so the job script tells a preemption from a crash by this file."""
        if self.rank == 0:
            tmp = self.marker_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step, "reason": reason}) + "\n")
            tmp.replace(self.marker_file)
            self.request_file.unlink(missing_ok=True)  # consumed: the resumed run must not stop on it again

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
