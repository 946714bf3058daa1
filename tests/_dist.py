"""Run a function on N processes over gloo (what torchrun would do), for TP/PP tests on CPU.

The target must be a module-level function `fn(rank, world_size, *args)`; its return value from
each rank is collected through a queue so tests can compare ranks against a single-process run.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

import _version_marker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        _version_marker._patch()  # this rank's GPTModel builds count for the test (the `megatron` marker)
        # Serialised to bytes: a tensor shared through torch's IPC can vanish when this rank exits
        # before the parent reads it (FileNotFoundError).
        buf = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buf)
        queue.put((rank, "ok", buf.getvalue(), _version_marker._calls["n"]))
    except BaseException:  # noqa: BLE001 - ship the traceback to the parent
        queue.put((rank, "error", traceback.format_exc(), 0))
        raise


# Imported once by the fork server, before it forks each rank: a spawned rank paid ~5-20 s of these imports
# on 2 cores, once per rank per test. Each rank is still a fresh process (no parallel state, no process group,
# no thread pool: importing starts none), forked from a server that has only imported modules.
PRELOAD = ["torch", "torch.distributed", "transformers", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.dist_checkpointing", "megatron_opd.trainer.loop",
           "megatron_opd.models.weight_mapping", "megatron_opd.teacher.megatron", "_tiny", "_version_marker"]


def _context() -> Any:
    method = os.environ.get("MEGATRON_OPD_TEST_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> list[Any]:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, payload, built = queue.get(timeout=timeout)
            _version_marker._calls["n"] += built
            if status == "error":
                errors.append(f"rank {rank}:\n{payload}")
            else:
                import torch

                payload = torch.load(io.BytesIO(payload), weights_only=False)  # our own test results
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def session_cmdlines(pid: int) -> dict[int, str]:
    """The command lines of every live process in the session led by `pid` (ServerProcess starts one)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) == pid:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ProcessLookupError):
            continue
    return out
