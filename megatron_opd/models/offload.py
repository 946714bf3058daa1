"""Park a frozen model's weights in host memory between uses (a colocated in-process teacher).

On a GPU the device copy is released between scoring phases, so training and the rollout engine get
those `2·P/(TP·PP)` bytes back, for one host<->device copy of the weights per step. Parameters keep
their identity (modules, hooks and tied weights stay wired); only their storage moves.
"""

from __future__ import annotations

from typing import Optional

import torch


class WeightOffloader:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._host: Optional[dict[str, torch.Tensor]] = None
        self._device: Optional[torch.device] = None

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    @torch.no_grad()
    def offload(self) -> None:
        """Host copies of every parameter (pinned on CUDA); the device storage is released."""
        if self._host is not None:
            return
        params = dict(self.model.named_parameters())  # shared (tied) parameters once
        self._device = next(iter(params.values())).device
        on_gpu = self._device.type == "cuda"
        self._host = {}
        for name, p in params.items():
            self._host[name] = p.data.to("cpu", copy=True).pin_memory() if on_gpu else p.data
            p.data = torch.empty(0, dtype=p.dtype, device=self._device)

    @torch.no_grad()
    def restore(self) -> None:
        """Weights back on their device, bit-identical."""
        if self._host is None:
            return
        for name, p in self.model.named_parameters():
            p.data = self._host[name].to(self._device, non_blocking=True)
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self._host = None


__all__ = ["WeightOffloader"]
