"""The no-silent-skips plugin on a throwaway suite: a skip whose dependency CI installs fails under
MEGATRON_OPD_STRICT_SKIPS=1, an allowed one does not, and both are listed with their reasons."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _proc import explain

TESTS = Path(__file__).resolve().parent

SUITE = '''
import pytest

def test_runs():
    assert True

def test_missing_extra():
    pytest.importorskip("surely_not_installed_pkg_xyz")

def test_shared():
    pytest.skip("shared data not found at /nowhere")

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False
'''


MODULE_SKIP = '''
import pytest

pytest.importorskip("another_missing_pkg_xyz")


def test_never_collected():
    assert False
'''


def _run(tmp_path: Path, strict: bool, module_skip: bool = False) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["_strict_skips"]\n')
    (tmp_path / "test_suite.py").write_text(SUITE)
    if module_skip:
        (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "MEGATRON_OPD_STRICT_SKIPS": "1" if strict else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_strict_mode_fails_disallowed_skip(tmp_path):
    r = _run(tmp_path, strict=True)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "1 failed" in out and "1 skipped" in out and "1 xfailed" in out, out
    assert "test_missing_extra" in out and "its dependency is one CI installs" in out
    assert "skipped tests and why" in out and "shared data not found at /nowhere" in out


def test_lenient_mode_lists_skips(tmp_path):
    r = _run(tmp_path, strict=False, module_skip=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "3 skipped" in out and "would fail in CI" in out and "another_missing_pkg_xyz" in out, out


def test_strict_mode_fails_a_module_level_skip(tmp_path):
    r = _run(tmp_path, strict=True, module_skip=True)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "module skipped under MEGATRON_OPD_STRICT_SKIPS=1" in out, out
    assert "another_missing_pkg_xyz" in out


def test_require_sglang_turns_the_sglang_skip_into_a_failure(tmp_path):
    """MEGATRON_OPD_REQUIRE_SGLANG=1 (.ci/run's SGLang leg): "sglang is not importable" is no longer allowed."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["_strict_skips"]\n')
    (tmp_path / "test_sgl.py").write_text('import pytest\n\ndef test_sgl():\n'
                                          '    pytest.skip("sglang is not importable in this environment")\n')
    base = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "MEGATRON_OPD_STRICT_SKIPS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    ok = subprocess.run(cmd, cwd=tmp_path, env={**base, "MEGATRON_OPD_REQUIRE_SGLANG": "0"}, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0 and "1 skipped" in ok.stdout, explain(ok)
    bad = subprocess.run(cmd, cwd=tmp_path, env={**base, "MEGATRON_OPD_REQUIRE_SGLANG": "1"}, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1 and "1 failed" in bad.stdout and "NOT ALLOWED in CI" in bad.stdout, explain(bad)
