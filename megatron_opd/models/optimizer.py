"""megatron-core training plumbing: DDP wrap, optimizer, LR schedule, one optimizer step.

We use megatron's own pieces (``DistributedDataParallel`` with contiguous grad buffers,
``get_megatron_optimizer``, ``OptimizerParamScheduler``) so the GPU path is the standard, tested one
(distributed optimizer = ZeRO-1 sharding of Adam state over data-parallel ranks, grad clipping by the
global norm across TP/PP/DP). On CPU the same classes run thanks to ``cpu_compat``; with no apex/TE
megatron falls back to ``torch.optim.AdamW`` internally, which it reports with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_opd.algo._checks import all_finite
from megatron_opd.config import OptimConfig
from megatron_opd.models.lowp_adam import MOMENT_DTYPES, AdamWLowPrecisionMoments
from megatron_opd.models.parallel import host_group


@dataclass
class TrainingSetup:
    """The three objects a training loop needs; ``model`` is the DDP-wrapped GPTModel."""

    model: Any
    optimizer: Any
    scheduler: Any


def wrap_ddp(model: torch.nn.Module, *, use_distributed_optimizer: bool = True,
             grad_reduce_in_fp32: bool = True, overlap_grad_reduce: bool = False,
             check_for_nan_in_grad: bool = True) -> Any:
    """Wrap a GPTModel in megatron's DDP (contiguous fp32 grad buffers, ``param.main_grad``).

    ``check_for_nan_in_grad`` makes megatron raise on a NaN gradient; the trainer turns it off and
    skips (and counts) such steps itself with ``grads_finite``."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=check_for_nan_in_grad,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def optimizer_config(optim: OptimConfig, params_dtype: torch.dtype) -> Any:
    """megatron ``OptimizerConfig`` from our ``OptimConfig`` (Adam; bf16/fp16 keep fp32 main params)."""
    return OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        params_dtype=params_dtype,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )


def low_precision_moments(opt: Any, optim: OptimConfig) -> Any:
    """Swap the torch AdamW inside megatron's optimizer wrapper(s) for one that keeps its moments in
    `optim.exp_avg_dtype` / `optim.exp_avg_sq_dtype` (models/lowp_adam.py), over the same param groups (the
    wrappers' own group dicts, so the scheduler's lr and megatron's group bookkeeping are unchanged). Only where
    megatron built torch's AdamW: TE's and apex's FusedAdam have their own precision-aware path."""
    if optim.exp_avg_dtype == "float32" and optim.exp_avg_sq_dtype == "float32":
        return opt
    from megatron.core import optimizer as megatron_optimizer

    key = "optim.exp_avg_dtype" if optim.exp_avg_dtype != "float32" else "optim.exp_avg_sq_dtype"
    if not getattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False):
        raise ValueError(f"{key}: bf16 moments are implemented for torch's AdamW (a host without Transformer "
                         "Engine or apex); with TE use float32 here (megatron's use_precision_aware_optimizer "
                         "is not wired)")
    for o in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(o, "optimizer", None)
        if inner is None:
            continue
        if not isinstance(inner, torch.optim.AdamW) or inner.state:
            raise ValueError(f"{key}: expected a fresh torch.optim.AdamW inside megatron's optimizer, got "
                             f"{type(inner).__name__}")
        d = inner.defaults
        o.optimizer = AdamWLowPrecisionMoments(
            inner.param_groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
            exp_avg_dtype=MOMENT_DTYPES[optim.exp_avg_dtype], exp_avg_sq_dtype=MOMENT_DTYPES[optim.exp_avg_sq_dtype])
    return opt


def build_scheduler(optimizer: Any, optim: OptimConfig, total_steps: int) -> Any:
    """megatron ``OptimizerParamScheduler`` stepping once per optimizer step (warmup from 0, then
    ``lr_decay_style`` to ``min_lr`` over the remaining steps; constant weight decay)."""
    if total_steps < 1:
        raise ValueError(f"total_steps: must be >= 1, got {total_steps}")
    if optim.warmup_steps > total_steps:
        raise ValueError(f"optim.warmup_steps: {optim.warmup_steps} exceeds the {total_steps} training steps")
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.warmup_steps > 0 else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr if optim.lr_decay_style != "constant" else optim.lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=max(total_steps, optim.warmup_steps + 1),
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=total_steps,
        wd_incr_style="constant",
    )


def setup_training(model: torch.nn.Module, optim: OptimConfig, total_steps: int,
                   check_for_nan_in_grad: bool = True) -> TrainingSetup:
    """DDP-wrap ``model``, build the megatron optimizer and scheduler, and hook megatron's grad
    finalisation (DP all-reduce / reduce-scatter, tied-embedding grads across PP stages) into the
    model config so ``get_forward_backward_func`` schedules run it."""
    ddp = wrap_ddp(model, use_distributed_optimizer=optim.use_distributed_optimizer,
                   check_for_nan_in_grad=check_for_nan_in_grad)
    cfg = model.config
    opt = low_precision_moments(get_megatron_optimizer(optimizer_config(optim, cfg.params_dtype), [ddp]), optim)
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.grad_scale_func = opt.scale_loss
    if optim.use_distributed_optimizer:
        skip_param_gather_on_one_rank(ddp)
    sched = build_scheduler(opt, optim, total_steps)
    return TrainingSetup(model=ddp, optimizer=opt, scheduler=sched)


def restart_optimizer(setup: TrainingSetup, optim: OptimConfig, total_steps: int) -> TrainingSetup:
    """A new optimizer and scheduler over the same DDP model, as `setup_training` builds them: Adam moments,
    step counts and the learning-rate schedule back at their start, fp32 main params taken from the model's
    current weights (a rollback to the initial student)."""
    cfg = unwrap(setup.model).config
    opt = low_precision_moments(get_megatron_optimizer(optimizer_config(optim, cfg.params_dtype), [setup.model]),
                                optim)
    cfg.grad_scale_func = opt.scale_loss
    return TrainingSetup(model=setup.model, optimizer=opt, scheduler=build_scheduler(opt, optim, total_steps))


def skip_param_gather_on_one_rank(ddp: Any) -> bool:
    """With one data-parallel rank the distributed optimizer's post-step parameter all-gather copies
    the parameter buffer onto itself (this rank's shard is the whole buffer, updated in place). Skip it:
    on CPU the gloo all-gather also left every later GEMM in the process ~2.5x slower (an 8x576x1536
    fp32 linear: 0.19 -> 0.46 s per 2000 calls, measured; decode after the first step ran 40% slower).
    Returns whether it was skipped."""
    if ps.get_data_parallel_world_size(with_context_parallel=True) != 1 or getattr(
            ddp.ddp_config, "use_megatron_fsdp", False):
        return False
    ddp.start_param_sync = lambda *args, **kwargs: None
    return True


def zero_grads(setup: TrainingSetup) -> None:
    """Clear DDP grad buffers and optimizer grads before a new step's backward passes."""
    setup.model.zero_grad_buffer()
    setup.optimizer.zero_grad()


def optimizer_step(setup: TrainingSetup) -> dict[str, float]:
    """Clip, step, advance the LR schedule. Returns ``{"grad_norm", "lr", "update_skipped"}``.

    Gradients must already be finalised (``forward_backward`` does it through the schedule).
    A skipped update (fp16 overflow or non-finite grad norm) does not advance the schedule.
    """
    ok, grad_norm, _ = setup.optimizer.step()
    if ok:
        setup.scheduler.step(increment=1)
    lr = setup.optimizer.param_groups[0]["lr"]
    return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "lr": float(lr),
            "update_skipped": float(not ok)}


def grads_finite(setup: TrainingSetup) -> bool:
    """True on every rank iff every rank's (finalised) gradients are finite."""
    ok = all(all_finite(g) for p in setup.model.parameters() if (g := getattr(p, "main_grad", None)) is not None)
    flag = torch.tensor([1.0 if ok else 0.0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=host_group("world"))
    return bool(flag.item() > 0)


def unwrap(model: Any) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


__all__ = ["TrainingSetup", "build_scheduler", "grads_finite", "low_precision_moments", "optimizer_config", "optimizer_step", "setup_training",
           "unwrap", "wrap_ddp", "zero_grads"]
