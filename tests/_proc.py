"""Subprocesses in tests: when one fails, the report shows what it said.

A `subprocess.run(..., check=True, capture_output=True)` that fails raises CalledProcessError, whose message
names the command and the exit status but not the stderr it captured: the report then has no cause (the
torchrun fixture's `demo --inputs-only` failed that way in a fresh clone's `make test`). Every test that runs a
process goes through `run` (or puts `explain` / `log_tail` in its assertion message)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional, Sequence, Union

import pytest

TAIL_CHARS = 4000


def tail(text: Optional[Union[str, bytes]], n: int = TAIL_CHARS) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text if len(text) <= n else "..." + text[-n:]


def explain(res: Union[subprocess.CompletedProcess, subprocess.TimeoutExpired], n: int = TAIL_CHARS) -> str:
    """The command, its exit status and the tails of its stderr and stdout, for an assertion message."""
    cmd = res.args if isinstance(res, subprocess.CompletedProcess) else res.cmd
    shown = " ".join(map(str, cmd)) if isinstance(cmd, (list, tuple)) else str(cmd)
    status = (f"exit {res.returncode}" if isinstance(res, subprocess.CompletedProcess)
              else f"timed out after {res.timeout:g} s")
    return (f"$ {shown}\n-> {status}\n--- stderr (tail) ---\n{tail(res.stderr, n)}\n"
            f"--- stdout (tail) ---\n{tail(res.stdout, n)}")


def run(cmd: Sequence[str], *, timeout: float, expect: Union[int, str, None] = 0,
        **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run` with output captured as text. The test fails, showing `explain`, when the exit status is
    not `expect` (an int, "nonzero", or None for any) or when the process outlives `timeout`."""
    if kwargs.get("stdout") is None and kwargs.get("stderr") is None:
        kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    try:
        res = subprocess.run(list(map(str, cmd)), timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(explain(exc), pytrace=False)
    ok = (expect is None or (res.returncode != 0 if expect == "nonzero" else res.returncode == expect))
    if not ok:
        pytest.fail(f"expected exit {expect}\n{explain(res)}", pytrace=False)
    return res


def log_tail(*paths: Union[str, Path], n: int = TAIL_CHARS) -> str:
    """The tails of log files a background process wrote (Popen with stdout to a file), for an assertion."""
    parts = []
    for p in paths:
        p = Path(p)
        text = p.read_text(errors="replace") if p.is_file() else "(absent)"
        parts.append(f"--- {p} (tail) ---\n{tail(text, n)}")
    return "\n".join(parts)
