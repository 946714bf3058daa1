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
        # Serialised to bytes: a tensor shared through torch's IPC can vanish when this rank exits
        # before the parent reads it (FileNotFoundError).
        buf = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - ship the traceback to the parent
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
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
