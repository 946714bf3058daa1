"""AdamW with its moments stored in bf16: the memory lever for a CPU host, where megatron runs torch's AdamW.

Mixed precision costs 18 bytes a parameter on a rank that holds the whole optimizer: the bf16 weight (2), fp32
gradient (4), fp32 main weight (4) and two fp32 Adam moments (8). On the Qwen2.5-Coder-0.5B student that is 11.3 GB,
the largest block of a step's peak (issue 37). Storing exp_avg and exp_avg_sq in bf16 takes 4 of those bytes back.

What Transformer Engine's FusedAdam does with ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` = bf16 on a GPU (megatron's
``use_precision_aware_optimizer``), done in torch ops: each moment is read, updated in fp32 and rounded to nearest
on store; the main weights stay fp32 and are updated in fp32. The update is torch.optim.AdamW's single-tensor one
term for term, so with fp32 moments this class gives torch's AdamW bit for bit (tested). The fp32 work is done in
slices of ``chunk`` elements, so the transient fp32 copies stay small beside a 136M-element embedding.

A subclass of torch.optim.AdamW, so megatron's wrappers, its checkpoint state dicts (a per-parameter ``step``,
exp_avg, exp_avg_sq) and the scheduler's param-group ``lr`` work unchanged. A moment loaded in another dtype (a
checkpoint written with fp32 moments) lands in this optimizer's dtype as it loads. Measured on the Qwen pair's
stable_opd step (docs/benchmarks.md): peak RSS 18.16 -> 15.39 GiB, step time within noise.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CHUNK = 1 << 22


class AdamWLowPrecisionMoments(torch.optim.AdamW):
    """torch's AdamW (decoupled weight decay, bias correction) with exp_avg and exp_avg_sq kept in the given
    dtypes, updated in fp32."""

    def __init__(self, params: Iterable[Any], *, exp_avg_dtype: torch.dtype = torch.bfloat16,
                 exp_avg_sq_dtype: torch.dtype = torch.bfloat16, chunk: int = CHUNK, **kwargs: Any):
        if kwargs.get("amsgrad") or kwargs.get("maximize"):
            raise ValueError("AdamWLowPrecisionMoments: amsgrad and maximize are not supported")
        kwargs.update(foreach=False, fused=False)
        super().__init__(params, **kwargs)
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        self.chunk = int(chunk)

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            for name, dt in self.moment_dtypes.items():
                st[name] = torch.zeros(p.shape, dtype=dt)
        for name, dt in self.moment_dtypes.items():
            if st[name].dtype != dt:
                st[name] = st[name].to(dt)
        return st

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, but the moments land in their own dtypes: torch.optim casts every floating state to its
        parameter's dtype (fp32 main weights), which would hold fp32 moments, 8 B/param, until the next step."""
        moments, rest = {}, {}
        for pid, st in state_dict["state"].items():
            rest[pid] = {k: v for k, v in st.items() if k not in self.moment_dtypes}
            moments[pid] = {k: v for k, v in st.items() if k in self.moment_dtypes}
        super().load_state_dict({**state_dict, "state": rest})
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        by_id = dict(zip(saved_ids, params))
        for pid, ms in moments.items():
            p = by_id[pid]
            for k, v in ms.items():
                self.state[p][k] = v.to(dtype=self.moment_dtypes[k], device=p.device)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamWLowPrecisionMoments does not support sparse gradients")
                st = self._state(p)
                st["step"] += 1
                t = float(st["step"])
                bias1 = 1 - beta1 ** t
                bias2_sqrt = math.sqrt(1 - beta2 ** t)
                p.mul_(1 - lr * wd)
                _update(p, p.grad, st["exp_avg"], st["exp_avg_sq"], beta1, beta2, lr / bias1, bias2_sqrt, eps,
                        self.chunk)
        return loss


def _update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, beta1: float, beta2: float,
            step_size: float, bias2_sqrt: float, eps: float, chunk: int) -> None:
    """torch's _single_tensor_adamw body on flat slices: moments read into fp32, updated, stored back."""
    parts = (p, g, m, v)
    if all(x.is_contiguous() for x in parts):
        flat = [x.view(-1) for x in parts]
        slices = [tuple(x[s:s + chunk] for x in flat) for s in range(0, p.numel(), chunk)]
    else:  # a strided view: updated whole, in place
        slices = [parts]
    for pp, gg, mm, vv in slices:
        m32 = mm.float() if mm.dtype != torch.float32 else mm
        v32 = vv.float() if vv.dtype != torch.float32 else vv
        g32 = gg.float() if gg.dtype != torch.float32 else gg
        m32.lerp_(g32, 1 - beta1)
        v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        denom = (v32.sqrt() / bias2_sqrt).add_(eps)
        pp.addcdiv_(m32, denom, value=-step_size)
        if m32 is not mm:
            mm.copy_(m32)
        if v32 is not vv:
            vv.copy_(v32)


def moment_bytes(exp_avg_dtype: str, exp_avg_sq_dtype: str) -> int:
    """Bytes a parameter of the two Adam moments."""
    return sum(MOMENT_DTYPES[d].itemsize for d in (exp_avg_dtype, exp_avg_sq_dtype))


__all__ = ["AdamWLowPrecisionMoments", "MOMENT_DTYPES", "moment_bytes"]
