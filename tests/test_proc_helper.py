"""tests/_proc.py on a throwaway suite: a subprocess that fails inside a test, or inside a module fixture (the
torchrun fixture's case), puts its stderr and exit status into pytest's report; a timeout names itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _proc import explain

TESTS = Path(__file__).resolve().parent

SUITE = '''
import sys
import pytest
from _proc import run

FAIL = [sys.executable, "-c", "import sys; print('out-line'); sys.stderr.write('cause-in-stderr'); sys.exit(3)"]

@pytest.fixture(scope="module")
def prepared():
    run(FAIL, timeout=60)

def test_in_fixture(prepared):
    pass

def test_in_body():
    run(FAIL, timeout=60)

def test_expected_code():
    assert run(FAIL, timeout=60, expect=3).stdout.strip() == "out-line"

def test_timeout():
    run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
'''


def test_a_failing_subprocess_shows_its_stderr_in_the_report(tmp_path: Path) -> None:
    (tmp_path / "test_throwaway.py").write_text(SUITE)
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = res.stdout
    assert "1 passed" in out and "2 failed" in out and "1 error" in out, explain(res)
    assert out.count("cause-in-stderr") >= 2 and out.count("-> exit 3") >= 2, explain(res)
    assert "expected exit 0" in out and "timed out after 0.5 s" in out, explain(res)
