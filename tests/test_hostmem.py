"""trainer/hostmem.py: the heap memory freed by a phase goes back to the OS, and a step reports its RSS."""

import json
import sys

import pytest

from _proc import run
from megatron_opd.trainer.hostmem import _libc, host_memory_gb

# In a fresh process: the suite's own heap (earlier tests' freed blocks) would blur the numbers.
HEAP_SCRIPT = """
import json, torch
from megatron_opd.trainer.hostmem import host_memory_gb, release_freed_memory
rss = lambda: host_memory_gb()["mem/rss_gb"]
base = rss()
blocks = [torch.ones(16384) for _ in range(8192)]
held = rss()
del blocks
kept = rss()
trimmed = release_freed_memory()
print("HEAP " + json.dumps([base, held, kept, rss(), trimmed]))
"""


def test_freed_heap_memory_leaves_rss():
    """512 MB in 64 KB tensors (below glibc's mmap threshold: they come from the heap), freed: glibc keeps
    them resident until `release_freed_memory` hands them back."""
    if _libc() is None:
        pytest.fail("no glibc malloc_trim on this host: the trainer's RSS bound does not hold here")
    res = run([sys.executable, "-c", HEAP_SCRIPT], timeout=120)
    base, held, kept, after, trimmed = json.loads(res.stdout.split("HEAP ", 1)[1].splitlines()[0])
    assert trimmed and held - base > 0.4
    assert kept > held - 0.1, "glibc returned the blocks by itself: the test no longer shows the trim"
    assert after - base < 0.1, f"RSS (GB) base {base:.2f}, held {held:.2f}, freed {kept:.2f}, trimmed {after:.2f}"


def test_reports_rss_and_peak():
    m = host_memory_gb()
    assert set(m) == {"mem/rss_gb", "mem/peak_rss_gb"} and 0 < m["mem/rss_gb"] <= m["mem/peak_rss_gb"]
