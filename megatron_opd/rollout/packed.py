"""Decode-time weight layout of the local engine on CPU: oneDNN-packed linears and a fused gate/up projection.

Why: at decode, a step multiplies a few rows (the batch) by every weight matrix once, so its time is the time
to stream the weights from memory. `F.linear` on a plain row-major weight streams them at ~8-23 GB/s on the
2-core hosts we measured (fp32 LM head at 8 rows: 8 GB/s), where oneDNN's blocked layout (the one inductor
uses on CPU, `mkldnn._reorder_linear_weight`) reaches 18-45 GB/s, and one [2I, H] gate+up GEMM beats two
[I, H] ones (benchmarks/bench_step.py --pair qwen reports the engine's decode step against the measured copy
bandwidth). Packing is per `generate` call: the packed copies are made from the weights as they are at the
call (so an engine sharing the trainer's tensors sees every optimizer step) and freed at its end, so the
extra memory (one copy of the weights in the engine's dtype) lives only while rollouts decode.

The model's modules keep their parameters and names (weight updates and `state_dict` are unaffected): only
their `forward` is swapped for the call, and restored after it, also on an exception.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(model: torch.nn.Module) -> bool:
    """oneDNN is built in, and the model is on CPU in fp32 or bf16 (the dtypes its packed GEMMs cover)."""
    p = next(model.parameters(), None)
    return (p is not None and p.device.type == "cpu" and p.dtype in PACKABLE_DTYPES
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _packed_linear(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def _apply(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _is_gated_mlp(m: torch.nn.Module) -> bool:
    """An HF Llama/Qwen2-style MLP: down(act(gate(x)) * up(x)) with bias-free Linear projections."""
    parts = [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (all(isinstance(p, torch.nn.Linear) and p.bias is None for p in parts) and callable(getattr(m, "act_fn", None))
            and parts[0].weight.shape == parts[1].weight.shape)


@contextlib.contextmanager
def packed_weights(model: torch.nn.Module, rows: int) -> Iterator[int]:
    """Within the block, every `nn.Linear` of `model` runs on a oneDNN-packed copy of its weight (packed for
    `rows` rows per GEMM) and every gated MLP on one packed [gate; up] matrix; yields the bytes packed.
    A model the packing does not cover (`packing_available`) runs unchanged."""
    if not packing_available(model):
        yield 0
        return
    swapped: list[torch.nn.Module] = []
    packed_bytes = 0
    try:
        with torch.no_grad():
            fused: set[int] = set()
            for m in model.modules():
                if _is_gated_mlp(m):
                    gate_up = _packed_linear(torch.cat([m.gate_proj.weight, m.up_proj.weight]), rows)
                    down = _packed_linear(m.down_proj.weight, rows)
                    half = m.gate_proj.weight.shape[0]

                    def mlp_forward(x: torch.Tensor, _gu=gate_up, _down=down, _act=m.act_fn, _h=half) -> torch.Tensor:
                        gu = _apply(x, _gu, None)
                        return _apply(_act(gu[..., :_h]) * gu[..., _h:], _down, None)

                    m.forward = mlp_forward
                    swapped.append(m)
                    fused.update(id(p) for p in (m.gate_proj, m.up_proj, m.down_proj))
                    packed_bytes += 3 * m.gate_proj.weight.numel() * m.gate_proj.weight.element_size()
            for m in model.modules():
                if isinstance(m, torch.nn.Linear) and id(m) not in fused:
                    w = _packed_linear(m.weight, rows)

                    def linear_forward(x: torch.Tensor, _w=w, _m=m) -> torch.Tensor:
                        return _apply(x, _w, _m.bias)

                    m.forward = linear_forward
                    swapped.append(m)
                    packed_bytes += m.weight.numel() * m.weight.element_size()
        yield packed_bytes
    finally:
        for m in swapped:
            del m.forward  # the instance attribute; the class's forward shows through again


__all__ = ["packed_weights", "packing_available", "PACKABLE_DTYPES"]
