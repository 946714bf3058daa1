"""Bring torch.distributed and megatron's parallel state up and down.

One entry point for trainer, teacher, converter and tests: it reads the env vars torchrun sets
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or, without them, makes a single-process
world on a free local port, so the same code runs under torchrun, tests/_dist.py and plain python.
nccl with CUDA, gloo without (after applying the CPU shims).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_opd.models.cpu_compat import apply_cpu_shims

logger = logging.getLogger("megatron_opd.parallel")

Backend = Literal["auto", "nccl", "gloo"]


def free_port() -> int:
    """A free TCP port on the loopback interface (for a rendezvous or a server bound to 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_backend(backend: Backend = "auto") -> str:
    """'auto' -> nccl with CUDA, else gloo. nccl without CUDA is an error naming the option."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend=nccl needs CUDA; use gloo (or auto) on CPU")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"parallel.backend: must be auto, nccl or gloo, got {backend!r}")
    return backend


def _elastic_store(world: int, timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun's c10d rendezvous the workers share the agents' store across restarts (--max-restarts),
    and torch adds no per-attempt prefix there: restarted workers read the previous attempt's gloo/NCCL
    addresses and fail to connect. A prefix per TORCHELASTIC_RESTART_COUNT keeps each attempt apart. None
    (torch's own env:// store) everywhere else."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or world == 1:
        return None
    if (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and int(os.environ.get("RANK", "0")) == 0
            and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1):
        # an agent restarted for another node's failure keeps its restart count: the prefixes can differ
        logger.warning("torchrun --max-restarts over several nodes with the c10d rendezvous's shared store: "
                       "restarted workers can hang connecting; launch torchrun with "
                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per attempt; README, multi-node torchrun)")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"megatron_opd/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    backend: Backend = "auto",
    seed: int = 1234,
    timeout_minutes: int = 30,
) -> None:
    """Initialise torch.distributed (if needed) and megatron's TP/PP/DP groups, then seed RNGs.

    `tp * pp` must divide the world size; the remainder is data parallel. Re-initialising with the
    same sizes is a no-op apart from re-seeding; with different sizes the old groups are destroyed.
    """
    if tp < 1 or pp < 1:
        raise ValueError(f"parallel sizes must be >= 1, got tp={tp} pp={pp}")
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        apply_cpu_shims()
    be = resolve_backend(backend)

    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            if "MASTER_PORT" not in os.environ:
                if world != 1:
                    raise ValueError("MASTER_PORT is not set but WORLD_SIZE > 1 (launch with torchrun)")
                os.environ["MASTER_PORT"] = str(free_port())
            store = _elastic_store(world, timedelta(minutes=timeout_minutes))
        else:
            # One process and no launcher: nothing to meet, so an in-process store. A TCP store on a "free"
            # port raced with every other process on the machine for it (EADDRINUSE between free_port's close
            # and the bind: two demos, or tests side by side).
            rank, world, store = 0, 1, dist.HashStore()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        dist.init_process_group(backend=be, rank=rank, world_size=world, timeout=timedelta(minutes=timeout_minutes),
                                store=store)

    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(f"world size {world} is not divisible by tensor_model_parallel_size * "
                         f"pipeline_model_parallel_size = {tp} * {pp}")
    if parallel_state.model_parallel_is_initialized():
        same = (parallel_state.get_tensor_model_parallel_world_size() == tp
                and parallel_state.get_pipeline_model_parallel_world_size() == pp)
        if not same:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            distributed_timeout_minutes=timeout_minutes,
            create_gloo_process_groups=True,
        )
    if "world" not in _HOST_GROUPS:  # every rank gets here: new_group is collective
        _HOST_GROUPS["world"] = dist.new_group(backend="gloo") if world > 1 else None
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


_HOST_GROUPS: dict[str, Optional[dist.ProcessGroup]] = {}


def host_group(kind: Literal["world", "dp"]) -> Optional[dist.ProcessGroup]:
    """A gloo group for the trainer's small collectives on CPU tensors (skip flags, token counts,
    advantage statistics). NCCL refuses CPU tensors, so these must never go to the default or the
    NCCL data-parallel group on a GPU cluster; gloo groups over the same ranks are made up front.
    None when the group has one rank (callers skip the collective)."""
    if kind == "dp":
        if parallel_state.get_data_parallel_world_size() == 1:
            return None
        return parallel_state.get_data_parallel_group_gloo(with_context_parallel=False)
    if kind != "world":
        raise ValueError(f"host_group: kind must be 'world' or 'dp', got {kind!r}")
    if "world" not in _HOST_GROUPS:
        raise RuntimeError("host_group('world') before init_parallel")
    return _HOST_GROUPS["world"]


@dataclass
class ModelLayout:
    """A model's own TP x PP layout over the whole world, next to megatron's global one (the student's):
    process groups for GPTModel(pg_collection=...) and the schedules, and this rank's coordinates. Ranks
    are ordered as megatron orders them: TP fastest, then data-parallel replicas, then pipeline stages."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    groups: Any  # megatron.core.process_groups_config.ProcessGroupCollection
    replica_group: Optional[dist.ProcessGroup]  # gloo, this rank's data-parallel peers (same tp/pp rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def layout_rank_grid(world: int, tp: int, pp: int) -> list[list[list[int]]]:
    """grid[pp_rank][dp_rank][tp_rank] -> global rank, megatron's order (tp fastest, then dp, then pp)."""
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"layout tp={tp} x pp={pp} does not divide the world size {world}")
    dp = world // (tp * pp)
    return [[[p * dp * tp + d * tp + t for t in range(tp)] for d in range(dp)] for p in range(pp)]


def make_layout(tp: int, pp: int) -> ModelLayout:
    """Process groups for a model laid out TP x PP over every rank (collective: all ranks call it, in the
    same order). Used for a teacher whose layout differs from the student's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = layout_rank_grid(world, tp, pp)
    dp = world // (tp * pp)
    where = {grid[p][d][t]: (t, p, d) for p in range(pp) for d in range(dp) for t in range(tp)}
    t_rank, p_rank, d_rank = where[rank]
    mine: dict[str, Any] = {}

    def group(kind: str, ranks: list[int], backend: Optional[str] = None) -> None:
        g = dist.new_group(ranks, backend=backend)  # every rank creates every group
        if rank in ranks:
            mine[kind] = g

    for p in range(pp):
        for d in range(dp):
            group("tp", grid[p][d])
    for d in range(dp):
        for t in range(tp):
            stages = [grid[p][d][t] for p in range(pp)]
            group("pp", stages)
            group("embd", sorted({stages[0], stages[-1]}))
            group("pos_embd", [stages[0]])
    for p in range(pp):
        for t in range(tp):
            replicas = [grid[p][d][t] for d in range(dp)]
            group("dp", replicas)
            group("replica", replicas, backend="gloo")
    for r in range(world):
        group("cp", [r])
    pgs = ProcessGroupCollection()
    pgs.tp, pgs.pp, pgs.cp, pgs.dp = mine["tp"], mine["pp"], mine["cp"], mine["dp"]
    pgs.dp_cp = mine["dp"]
    pgs.embd = mine["embd"] if rank in (grid[0][d_rank][t_rank], grid[-1][d_rank][t_rank]) else None
    pgs.pos_embd = mine["pos_embd"] if p_rank == 0 else None
    return ModelLayout(tp, pp, dp, t_rank, p_rank, d_rank, pgs, mine["replica"] if dp > 1 else None)


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default process group (safe to call twice)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _HOST_GROUPS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_group() -> Optional[dist.ProcessGroup]:
    """The tensor-parallel group, or None when TP is 1 (callers then skip the collectives)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def is_pipeline_first_stage() -> bool:
    return parallel_state.is_pipeline_first_stage(ignore_virtual=True)


def is_pipeline_last_stage() -> bool:
    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def data_parallel_rank_size() -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel size) of the student's layout."""
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def tensor_parallel_rank() -> int:
    return parallel_state.get_tensor_model_parallel_rank()


def model_parallel_coords() -> tuple[int, int, int, int]:
    """(tp rank, tp size, pp rank, pp size) of this rank in the student's layout."""
    ps = parallel_state
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size())


def pipeline_group() -> Optional[dist.ProcessGroup]:
    return parallel_state.get_pipeline_model_parallel_group()


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a no-op without a process group or with one rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


__all__ = ["ModelLayout", "broadcast_object", "data_parallel_rank_size", "destroy_parallel", "free_port", "global_rank", "host_group", "init_parallel",
           "is_pipeline_first_stage", "is_pipeline_last_stage", "layout_rank_grid", "make_layout", "resolve_backend",
           "model_parallel_coords", "pipeline_group", "tensor_parallel_rank", "tp_group"]
