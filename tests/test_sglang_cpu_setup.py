"""The SGLang CPU test setup (tests/sglang_cpu.py) and its sgl_kernel stand-in: the stand-in is refused where
CUDA is available or a real sgl_kernel is installed, and its one implemented kernel does what SGLang's
Triton `assign_req_to_token_pool` does. (No sglang needed.)"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

import sglang_cpu


def test_standin_refused_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        sglang_cpu.use_sgl_kernel_standin()


def test_standin_never_shadows_a_real_sgl_kernel(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    real = types.SimpleNamespace(origin="/site-packages/sgl_kernel/__init__.py")
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: real if name == "sgl_kernel" else find(name, *a))
    with pytest.raises(RuntimeError, match="real sgl_kernel is installed"):
        sglang_cpu.use_sgl_kernel_standin()


def test_standin_assign_req_to_token_pool_cpu(monkeypatch):
    monkeypatch.syspath_prepend(str(sglang_cpu.STANDIN_DIR))
    monkeypatch.delitem(sys.modules, "sgl_kernel", raising=False)
    import sgl_kernel

    assert str(sglang_cpu.STANDIN_DIR) in sgl_kernel.__file__
    r2t = torch.zeros(3, 10, dtype=torch.int32)
    sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), r2t, torch.tensor([1, 0]), torch.tensor([4, 2]),
                                            torch.tensor([7, 8, 9, 10, 11]), 10)
    want = torch.zeros(3, 10, dtype=torch.int32)
    want[2, 1:4] = torch.tensor([7, 8, 9])
    want[0, 0:2] = torch.tensor([10, 11])
    assert torch.equal(r2t, want)
    with pytest.raises(NotImplementedError, match="CPU test stand-in"):
        sgl_kernel.verify_tree_greedy_cpu()
    monkeypatch.delitem(sys.modules, "sgl_kernel")
