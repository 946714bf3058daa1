"""`params_dtype: auto`: what it picks, why it says so, and how a run pins it (models/dtype.py)."""

import logging

import pytest
import torch

from megatron_opd.models import dtype as D


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    D._settled.clear()
    D.auto_dtype.cache_clear()
    monkeypatch.delenv(D.ENV, raising=False)
    yield
    D._settled.clear()
    D.auto_dtype.cache_clear()


def _gemm(monkeypatch, f32: float, b16: float, flags=("avx512f",)):
    monkeypatch.setattr(D, "gemm_gflops", lambda dt, **kw: b16 if dt == torch.bfloat16 else f32)
    monkeypatch.setattr(D, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_probe_picks_bf16_only_when_it_pays(monkeypatch):
    _gemm(monkeypatch, f32=300, b16=2000, flags=("amx_bf16", "avx512_bf16"))
    pick = D.probe_cpu()
    assert pick.dtype == torch.bfloat16
    assert "2000" in pick.reason and "300" in pick.reason and "amx_bf16" in pick.reason

    _gemm(monkeypatch, f32=300, b16=360)  # 1.2x: below MIN_SPEEDUP
    pick = D.probe_cpu()
    assert pick.dtype == torch.float32 and "below" in pick.reason and "no bf16 GEMM flags" in pick.reason

    _gemm(monkeypatch, f32=300, b16=150)  # an AVX2-only host emulating bf16
    assert D.probe_cpu().dtype == torch.float32


def test_auto_logs_its_pick_and_reason_once(monkeypatch, caplog):
    _gemm(monkeypatch, f32=100, b16=400)
    with caplog.at_level(logging.INFO, logger="megatron_opd.dtype"):
        assert D.resolve_dtype("auto") == torch.bfloat16
        assert D.resolve_dtype("auto") == torch.bfloat16
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_opd.dtype"]
    assert len(lines) == 1 and lines[0].startswith("dtype auto: bfloat16 (bf16 GEMM 400 vs fp32 100")


def test_env_pins_the_answer_without_a_probe(monkeypatch):
    monkeypatch.setattr(D, "gemm_gflops", lambda *a, **k: pytest.fail("probed although pinned"))
    monkeypatch.setenv(D.ENV, "bfloat16")
    assert D.auto_dtype().dtype == torch.bfloat16 and D.ENV in D.auto_dtype().reason
    D.auto_dtype.cache_clear()
    monkeypatch.setenv(D.ENV, "float32")
    assert D.resolve_dtype("auto") == torch.float32


def test_bad_env_value_and_bad_name_say_what(monkeypatch):
    monkeypatch.setenv(D.ENV, "fp8")
    with pytest.raises(ValueError, match=f"{D.ENV}='fp8'"):
        D.auto_dtype()
    with pytest.raises(ValueError, match="unknown 'bf16'"):
        D.resolve_dtype("bf16")


def test_gpu_is_bf16_without_probe(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(D, "gemm_gflops", lambda *a, **k: pytest.fail("probed on a GPU"))
    assert D.auto_dtype().dtype == torch.bfloat16


def test_real_probe_runs_and_measures():
    """The probe itself on this host: both GEMMs time to a positive rate and the pick is one of the two."""
    f32 = D.gemm_gflops(torch.float32, m=64, k=128, n=128, repeats=2)
    assert f32 > 0
    assert D.probe_cpu().dtype in (torch.float32, torch.bfloat16)


def test_every_rank_takes_the_source_ranks_pick(monkeypatch):
    """Two ranks on one loaded host may probe either side of the threshold: the trainer settles rank 0's pick
    on every rank (`settle_auto_dtype(broadcast_object)`); a rank that is not the source does not probe."""
    source = D.AutoDtype(torch.bfloat16, "rank 0's probe")
    monkeypatch.setattr(D, "gemm_gflops", lambda *a, **k: pytest.fail("a non-source rank probed"))
    got = D.settle_auto_dtype(lambda mine: source if mine is None else pytest.fail("sent its own"), is_source=False)
    assert got == source and D.resolve_dtype("auto") == torch.bfloat16 and D.auto_dtype().reason == "rank 0's probe"
    monkeypatch.setenv(D.ENV, "float32")  # a new job in the same process settles anew
    assert D.settle_auto_dtype(lambda mine: mine).dtype == torch.float32
