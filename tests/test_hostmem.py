"""trainer/hostmem.py: the heap memory freed by a phase goes back to the OS, and a step reports its RSS."""

import pytest
import torch

from megatron_opd.trainer.hostmem import _libc, host_memory_gb, release_freed_memory


def test_freed_heap_memory_leaves_rss():
    """512 MB in 64 KB tensors (below glibc's mmap threshold: they come from the heap), freed: glibc keeps
    most of them resident until `release_freed_memory`."""
    if _libc() is None:
        pytest.fail("no glibc malloc_trim on this host: the trainer's RSS bound does not hold here")
    base = host_memory_gb()["mem/rss_gb"]
    blocks = [torch.ones(16384) for _ in range(8192)]
    held = host_memory_gb()["mem/rss_gb"]
    assert held - base > 0.4
    del blocks
    kept = host_memory_gb()["mem/rss_gb"]
    assert release_freed_memory()
    after = host_memory_gb()["mem/rss_gb"]
    assert after < kept - 0.3 or kept < held - 0.3  # returned by the trim (or glibc returned it on its own)
    assert after - base < 0.15


def test_reports_rss_and_peak():
    m = host_memory_gb()
    assert set(m) == {"mem/rss_gb", "mem/peak_rss_gb"} and 0 < m["mem/rss_gb"] <= m["mem/peak_rss_gb"]
