"""Token log-probs and full-vocab logits access for a (tensor-parallel) megatron GPTModel.

Memory: logits are ``[T, V/tp]`` per rank in the model's dtype; an fp32 softmax over all T tokens at
once would cost ``4*T*V/tp`` bytes per intermediate (5 GB at T=8192, V=152k) and autograd would keep
it. ``vocab_parallel_token_logprobs`` is a custom autograd function that walks ``chunk_size`` tokens
at a time in forward (saving only the per-token log-normaliser) and again in backward, where it
writes the analytic gradient ``d logp / d z_j = onehot_j - softmax_j``. Across TP ranks the max and
the sum-exp are all-reduced; backward needs no communication because the loss is replicated on the
TP ranks and each rank owns the gradient of its own vocab shard.

Vocab padding: megatron pads the vocabulary (``weight_mapping.padded_vocab_size``); columns at or
beyond the real ``vocab_size`` are masked out of every softmax here.

Padding: right-padded ``[B, S]`` rows need no mask (under a causal mask trailing padding cannot
influence earlier positions; tests check it). Packed rows (several sequences in one) pass the
``attention_mask`` or ``packed_seq_params`` of ``models.packing``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

Reduce = Callable[[torch.Tensor, str], torch.Tensor]


def _group_size_rank(tp_group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if tp_group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def vocab_parallel_reduce(tp_group: Optional[dist.ProcessGroup] = None) -> Reduce:
    """``reduce(tensor, op)`` for algo/ (docs/design.md): identity on one rank, else an all-reduce
    ("sum" or "max") over ``tp_group`` of a copy of ``tensor``. Not differentiable: algo/ uses it
    inside custom autograd functions whose backward needs no cross-shard reduction."""
    size, _ = _group_size_rank(tp_group)

    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        if op not in ("sum", "max"):
            raise ValueError(f"reduce op must be 'sum' or 'max', got {op!r}")
        if size == 1:
            return tensor
        out = tensor.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=tp_group)
        return out

    return reduce


def _local_vocab_range(v_local: int, tp_group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    _, rank = _group_size_rank(tp_group)
    return rank * v_local, (rank + 1) * v_local


def _valid_columns(v_local: int, vocab_size: Optional[int], tp_group: Optional[dist.ProcessGroup]) -> int:
    """How many leading columns of this rank's shard are real vocabulary (the rest is padding)."""
    start, end = _local_vocab_range(v_local, tp_group)
    if vocab_size is None:
        return v_local
    return max(0, min(end, vocab_size) - start)


class _VocabParallelTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, vocab_size, chunk_size, temperature, on_nonfinite):  # type: ignore[override]
        N, v_local = logits.shape
        start, _ = _local_vocab_range(v_local, tp_group)
        n_valid = _valid_columns(v_local, vocab_size, tp_group)
        size, _ = _group_size_rank(tp_group)
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        lse = torch.empty(N, dtype=acc, device=logits.device)
        tgt_logit = torch.empty(N, dtype=acc, device=logits.device)
        local_t = target - start
        in_shard = (local_t >= 0) & (local_t < n_valid)
        local_t = local_t.clamp(0, v_local - 1)
        for s in range(0, N, chunk_size):
            e = min(N, s + chunk_size)
            x = logits[s:e].to(acc, copy=True)
            if temperature != 1.0:
                x.div_(temperature)
            if n_valid < v_local:
                x[:, n_valid:] = float("-inf")
            m = x.max(dim=-1).values
            if size > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            t = x.gather(1, local_t[s:e, None]).squeeze(1)
            t = torch.where(in_shard[s:e], t, torch.zeros_like(t))
            sumexp = x.sub_(m[:, None]).exp_().sum(dim=-1)  # in place: no second [chunk, V] temporary
            if size > 1:
                dist.all_reduce(sumexp, group=tp_group)
                dist.all_reduce(t, group=tp_group)
            lse[s:e] = m + sumexp.log()
            tgt_logit[s:e] = t
        logp = tgt_logit - lse
        if on_nonfinite == "raise" and not bool(torch.isfinite(logp).all()):
            bad = int((~torch.isfinite(logp)).nonzero()[0])
            raise ValueError(f"logits: non-finite token log-prob at flat position {bad} (NaN/inf logits)")
        ctx.save_for_backward(logits, local_t, in_shard, lse)
        ctx.n_valid, ctx.chunk_size, ctx.temperature = n_valid, chunk_size, temperature
        return logp  # fp32 (fp64 for fp64 logits) whatever the logits' dtype: bf16 would round a log-prob by ~1e-2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp):  # type: ignore[override]
        logits, local_t, in_shard, lse = ctx.saved_tensors
        N, v_local = logits.shape
        grad = torch.empty_like(logits)
        in_place = grad.dtype == lse.dtype
        for s in range(0, N, ctx.chunk_size):
            e = min(N, s + ctx.chunk_size)
            g = grad_logp[s:e].to(lse.dtype)
            if ctx.temperature != 1.0:  # d logp / d z = (onehot - softmax(z / T)) / T
                g = g / ctx.temperature
            # fp32 logits: build the gradient in its own rows of `grad` (no [chunk, V] temporary and copy)
            p = grad[s:e].copy_(logits[s:e]) if in_place else logits[s:e].to(lse.dtype, copy=True)
            if ctx.temperature != 1.0:
                p.div_(ctx.temperature)
            p.sub_(lse[s:e, None]).exp_()
            if ctx.n_valid < v_local:
                p[:, ctx.n_valid:] = 0.0
            p.mul_(-g[:, None])
            rows = torch.arange(e - s, device=logits.device)[in_shard[s:e]]
            p[rows, local_t[s:e][in_shard[s:e]]] += g[in_shard[s:e]]
            if not in_place:
                grad[s:e] = p.to(grad.dtype)
        return grad, None, None, None, None, None, None


def vocab_parallel_token_logprobs(
    logits_shard: torch.Tensor,
    target_ids: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    *,
    vocab_size: Optional[int] = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    on_nonfinite: str = "raise",
) -> torch.Tensor:
    """``log softmax(logits / temperature)[target]`` for logits sharded over the vocab:
    ``[..., V/tp]`` -> ``[...]``.

    ``tp_group`` None (or size 1): the shard is the whole vocabulary. ``vocab_size``: the real
    vocabulary; columns at or beyond it (megatron's padding) are excluded. Differentiable w.r.t. the
    logits. Targets outside ``[0, vocab_size)`` are an error. ``temperature`` (> 0): the sampling
    temperature, applied chunk by chunk (no scaled copy of the whole logits). ``on_nonfinite``:
    ``"raise"`` (ValueError on a NaN/inf log-prob) or ``"return"`` (return it, so the caller can make
    every rank agree to skip the step instead of one rank dying mid-collective). The result is fp32
    for fp32/bf16/fp16 logits (fp64 for fp64): the softmax accumulates in fp32 and is not rounded back.
    """
    if logits_shard.shape[:-1] != target_ids.shape:
        raise ValueError(f"target_ids: shape {tuple(target_ids.shape)} does not match logits "
                         f"{tuple(logits_shard.shape)} without the vocab dim")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    if on_nonfinite not in ("raise", "return"):
        raise ValueError(f"on_nonfinite: must be 'raise' or 'return', got {on_nonfinite!r}")
    size, _ = _group_size_rank(tp_group)
    v_total = logits_shard.shape[-1] * size
    limit = v_total if vocab_size is None else min(vocab_size, v_total)
    if target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= limit):
        raise ValueError(f"target_ids: values must be in [0, {limit}), got range "
                         f"[{int(target_ids.min())}, {int(target_ids.max())}]")
    flat = logits_shard.reshape(-1, logits_shard.shape[-1])
    out = _VocabParallelTokenLogprob.apply(flat, target_ids.reshape(-1).long(), tp_group, vocab_size,
                                           int(chunk_size), float(temperature), on_nonfinite)
    return out.reshape(target_ids.shape)


def mask_vocab_padding(logits_shard: torch.Tensor, vocab_size: Optional[int],
                       tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Set this rank's padding columns (global index >= ``vocab_size``) to a huge negative finite
    value, so they get zero probability in algo/'s full-vocab KL without producing ``-inf - -inf``.
    Returns the input unchanged when the shard holds no padding; otherwise a differentiable copy."""
    v_local = logits_shard.shape[-1]
    n_valid = _valid_columns(v_local, vocab_size, tp_group)
    if n_valid == v_local:
        return logits_shard
    fill = max(torch.finfo(logits_shard.dtype).min, -1e30)
    mask = torch.arange(v_local, device=logits_shard.device) >= n_valid
    return logits_shard.masked_fill(mask, fill)


def iter_logit_chunks(
    logits_shard: torch.Tensor,
    chunk_size: int,
    *,
    vocab_size: Optional[int] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(start, end, logits[start:end])`` over the flattened tokens of ``[..., V/tp]`` logits,
    each chunk ``[chunk, V/tp]`` with vocab padding masked (see ``mask_vocab_padding``), so callers can
    compute full-vocab quantities (reference KL) without one fp32 ``[T, V]`` tensor."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be >= 1, got {chunk_size}")
    flat = logits_shard.reshape(-1, logits_shard.shape[-1])
    for s in range(0, flat.shape[0], chunk_size):
        e = min(flat.shape[0], s + chunk_size)
        yield s, e, mask_vocab_padding(flat[s:e], vocab_size, tp_group)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def model_vocab_size(model: torch.nn.Module) -> Optional[int]:
    """The real (unpadded) vocabulary of a model from ``gpt.build_gpt_model``."""
    return getattr(_unwrap(model), "hf_vocab_size", None)


def default_tp_group() -> Optional[dist.ProcessGroup]:
    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def forward_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    packed_seq_params: Any = None,
    rows: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """``[B, S, V/tp]`` logits from a model that is both first and last pipeline stage (``[1, N, V/tp]``
    at ``rows`` only, for a model prepared by ``enable_logit_rows``).

    ``attention_mask`` None means plain causal (right padding needs nothing more, see module doc).
    """
    inner = _unwrap(model)
    if not (getattr(inner, "pre_process", True) and getattr(inner, "post_process", True)):
        raise ValueError("forward_logits needs a model that is the first and last pipeline stage; "
                         "with pipeline parallelism use pipeline.forward_backward")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected [B, S], got shape {tuple(input_ids.shape)}")
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    kwargs = {"packed_seq_params": packed_seq_params} if packed_seq_params is not None else {}
    with logit_rows(model, rows):
        return model(input_ids, position_ids, attention_mask, **kwargs)


def forward_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    target_ids: Optional[torch.Tensor] = None,
    *,
    packed_seq_params: Any = None,
    tp_group: Any = "auto",
    chunk_size: int = 1024,
) -> torch.Tensor:
    """``logp[b, s] = log p(target_ids[b, s] | input_ids[b, :s+1])`` for a first-and-last-stage model.

    ``target_ids`` default: the next token (``input_ids`` shifted left; the last position gets
    target 0 and should be masked by the caller). Differentiable when the model has grads.
    """
    if target_ids is None:
        target_ids = torch.roll(input_ids, shifts=-1, dims=1)
        target_ids[:, -1] = 0
    logits = forward_logits(model, input_ids, position_ids, attention_mask, packed_seq_params)
    group = default_tp_group() if tp_group == "auto" else tp_group
    return vocab_parallel_token_logprobs(logits, target_ids, group, vocab_size=model_vocab_size(model),
                                         chunk_size=chunk_size)


LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


def _row_select_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    rows = getattr(module, "_opd_logit_rows", None)
    if rows is None:
        return None
    s_idx, b_idx = rows
    hidden = args[0] if args else kwargs.pop("input_")
    return (hidden[s_idx, b_idx].unsqueeze(1), *args[1:]), kwargs


def enable_logit_rows(model: torch.nn.Module) -> bool:
    """Let this model's output layer compute logits at chosen positions only (``logit_rows``).

    Why: the trainer needs logits at response positions alone, yet GPTModel applies the LM head to
    every position: prompt positions cost an LM-head GEMM, a ``[S, V/tp]`` logits tensor and its
    gradient for nothing (the vocabulary GEMM is ~1/4 of a 135M model's FLOPs). A forward pre-hook on
    ``output_layer`` gathers the selected hidden states ``[N, H]`` and feeds them as ``[N, 1, H]``,
    so the model returns ``[1, N, V/tp]``. State dict and weights are untouched. Not with sequence
    parallelism (the output layer gathers the sequence itself) or multi-token prediction; returns
    whether it was enabled (False on a non-last pipeline stage, which has no output layer)."""
    inner = _unwrap(model)
    layer = getattr(inner, "output_layer", None)
    if layer is None or not getattr(inner, "post_process", True):
        return False
    if getattr(layer, "sequence_parallel", False) or getattr(inner.config, "mtp_num_layers", None):
        return False
    if not getattr(layer, "_opd_rows_hook", False):
        layer.register_forward_pre_hook(_row_select_hook, with_kwargs=True)
        layer._opd_rows_hook = True
    return True


class logit_rows:
    """Context: while active, a model prepared by ``enable_logit_rows`` returns logits only at
    ``rows = (s_idx, b_idx)`` ([N] index tensors into the [S, B] grid), shaped ``[1, N, V/tp]``.
    ``rows`` None: a no-op (full logits)."""

    def __init__(self, model: torch.nn.Module, rows: Optional[tuple[torch.Tensor, torch.Tensor]]):
        self.layer = getattr(_unwrap(model), "output_layer", None) if rows is not None else None
        self.rows = rows

    def __enter__(self) -> "logit_rows":
        if self.layer is not None and getattr(self.layer, "_opd_rows_hook", False):
            self.layer._opd_logit_rows = self.rows
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.layer is not None:
            self.layer._opd_logit_rows = None


def forward_backward(
    model: torch.nn.Module,
    microbatches: list[dict],
    loss_fn: LossFn,
    *,
    forward_only: bool = False,
    prepare: Optional[Callable[[dict], None]] = None,
    layout: Optional[Any] = None,
    companion: Optional["Companion"] = None,
) -> list[dict]:
    """Run megatron's pipeline schedule (``get_forward_backward_func``) over ``microbatches``.

    Each microbatch is a dict with ``input_ids`` [b, S] (with pipeline parallelism every microbatch the
    same b; without, megatron's schedule ignores the shape, so sizes may differ: dynamic batching), optional
    ``position_ids`` / ``attention_mask`` / ``packed_seq_params`` (packed rows: `models.packing`), and whatever ``loss_fn`` needs; every rank of a TP/PP group
    passes the same list. On the last stage ``loss_fn(logits [b, S, V/tp], microbatch)`` returns
    ``(scalar loss, dict of tensors to report)``; megatron averages the loss over microbatches before
    backward. Returns the reported dicts (last pipeline stage; ``[]`` elsewhere). Works for PP=1 too.
    A microbatch's ``logit_rows`` (see ``logit_rows``), if present, restricts its logits to those
    positions: ``loss_fn`` then gets ``[1, N, V/tp]``.
    ``prepare(microbatch)``, if given, runs right before each microbatch's forward on this stage
    (the trainer computes that micro-batch's reference logits there, so only one is ever held).
    ``layout`` (`models.parallel.ModelLayout`) runs a model built with its own process groups.
    ``companion`` (see ``Companion``) runs a frozen model of the same layout forward-only beside ``model``,
    micro-batch by micro-batch inside the same schedule.
    """
    if not microbatches:
        raise ValueError("microbatches: empty")
    b, s = microbatches[0]["input_ids"].shape
    pipelined = (layout.pp if layout is not None else parallel_state.get_pipeline_model_parallel_world_size()) > 1
    for i, mb in enumerate(microbatches):
        if pipelined and mb["input_ids"].shape[0] != b:
            raise ValueError(f"microbatches[{i}].input_ids: batch {mb['input_ids'].shape[0]} != {b} "
                             "(megatron's pipeline schedule needs one micro-batch size)")

    def forward_step(data_iterator: Iterator[dict], mdl: torch.nn.Module):
        mb = next(data_iterator)
        if prepare is not None:
            prepare(mb)
        ids = mb["input_ids"]
        pos = mb.get("position_ids")
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        extra = {"packed_seq_params": mb["packed_seq_params"]} if mb.get("packed_seq_params") is not None else {}
        side = companion.forward(mdl, mb, ids, pos, extra) if companion is not None else None
        with logit_rows(mdl, mb.get("logit_rows")):
            out = mdl(ids, pos, mb.get("attention_mask"), **extra)
        if side is not None:  # a stage before the last: the companion's hidden states ride along
            out = torch.cat([out, companion.wire.encode(side)], 0)

        def loss_func(output_tensor: torch.Tensor):
            return loss_fn(output_tensor, mb)

        return out, loss_func

    max_s = max(mb["input_ids"].shape[1] for mb in microbatches)
    kwargs: dict[str, Any] = {}
    if companion is not None:
        companion.bind(model)
        if pipelined:
            factor = 1 + companion.wire.factor
            # a shape () is exchanged at run time (megatron-core 0.19 with variable_seq_lengths): it is the
            # concatenated tensor's own, companion included
            grow = lambda shapes: [(s[0] * factor, *s[1:]) if len(s) else s for s in shapes]  # noqa: E731
            kwargs["adjust_tensor_shapes_fn"] = lambda recv, send: (grow(recv), grow(send))
    if layout is None:
        schedule = get_forward_backward_func()
    else:
        kwargs["pg_collection"] = layout.groups
        if layout.pp == 1:
            schedule = schedules.forward_backward_no_pipelining
        else:
            schedule = schedules.forward_backward_pipelining_without_interleaving
            kwargs["p2p_communicator"] = P2PCommunicator(pp_group=layout.groups.pp, config=_unwrap(model).config)
    return list(schedule(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=max_s,
        micro_batch_size=b,
        forward_only=forward_only,
        **kwargs,
    ))


class _Wire:
    """How a companion's hidden states travel in the trained model's pipeline buffers (megatron allocates
    them in the trained model's ``pipeline_dtype``), bit-exactly: the same dtype as is; a narrower one cast
    up (bf16/fp16 -> fp32 is exact); one of the same width reinterpreted; a wider one (an fp32 companion
    beside a bf16 model) reinterpreted as ``factor`` times as many sequence positions."""

    def __init__(self, own: torch.dtype, wire: torch.dtype):
        self.own, self.dtype = own, wire
        own_size, wire_size = own.itemsize, wire.itemsize
        self.factor = own_size // wire_size if own_size > wire_size else 1

    def encode(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype == self.dtype:
            return t
        if t.dtype.itemsize < self.dtype.itemsize:
            return t.to(self.dtype)
        s, b, h = t.shape
        return t.contiguous().view(self.dtype).reshape(s * self.factor, b, h)

    def decode(self, w: torch.Tensor) -> torch.Tensor:
        if w.dtype == self.own:
            return w
        if self.own.itemsize < self.dtype.itemsize:
            return w.to(self.own)
        s, b, h = w.shape
        return w.contiguous().reshape(s // self.factor, b, h * self.factor).view(self.own)


def _pipeline_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a model's stages exchange (megatron's ``config.pipeline_dtype``, else its params_dtype)."""
    config = _unwrap(model).config
    return getattr(config, "pipeline_dtype", None) or config.params_dtype


@dataclass
class Companion:
    """A frozen model with the trained model's pipeline layout (the reference of the full KL) that runs
    forward-only inside the trained model's schedule, on the same micro-batch right before it.

    Why: under pipeline parallelism the loss lives on the last stage, and a separate forward-only pipeline
    pass of the companion would have to keep its logits for every micro-batch of the minibatch there
    until the training schedule reaches them. Here each stage runs its companion layers on the micro-batch
    it is about to forward and sends their hidden states on together with its own (one buffer, the
    sequence dimension ``1 + wire.factor`` times as long; no gradient flows into the companion's part), so
    the last stage gets the companion's logits of one micro-batch at a time: ``on_logits(logits,
    microbatch)`` is called there right before the trained model's forward of that micro-batch, with
    ``[1, N, V/tp]`` at the micro-batch's ``logit_rows``."""

    model: torch.nn.Module
    on_logits: Callable[[torch.Tensor, dict], None]
    wire: Optional[_Wire] = None

    def bind(self, trained: torch.nn.Module) -> None:
        self.wire = _Wire(_pipeline_dtype(self.model), _pipeline_dtype(trained))

    def forward(self, trained: torch.nn.Module, mb: dict, ids: torch.Tensor, pos: torch.Tensor,
                extra: dict) -> Optional[torch.Tensor]:
        """This stage's companion forward of `mb`; on a stage after the first, the received buffer is split
        first (the trained model keeps a view of its own part, so its input gradient flows back). Returns
        the hidden states to send on, or None on the last stage (the logits went to ``on_logits``)."""
        inner, side = _unwrap(trained), _unwrap(self.model)
        if not getattr(inner, "pre_process", True):
            received = inner.decoder.input_tensor
            n = received.shape[0] // (1 + self.wire.factor)
            inner.set_input_tensor(received[:n])
            side.set_input_tensor(self.wire.decode(received[n:].detach()))
        with torch.no_grad(), logit_rows(self.model, mb.get("logit_rows")):
            out = self.model(ids, pos, mb.get("attention_mask"), **extra)
        if getattr(inner, "post_process", True):
            self.on_logits(out, mb)
            return None
        return out


__all__ = [
    "Companion", "LossFn", "enable_logit_rows", "forward_backward", "logit_rows",
    "Reduce", "default_tp_group", "forward_logits", "forward_logprobs", "iter_logit_chunks",
    "mask_vocab_padding", "model_vocab_size", "vocab_parallel_reduce", "vocab_parallel_token_logprobs",
]
