"""No silent skips: under MEGATRON_OPD_STRICT_SKIPS=1 (set by `.ci/run`) a skipped test fails unless
its reason names a dependency that CI does not install, listed in ALLOWED_SKIPS with why. Every run
ends with the list of what skipped and why, so a green CI cannot hide an untested path.

Loaded as a plugin from tests/conftest.py; tests/test_strict_skips.py checks it on a throwaway suite.
"""

from __future__ import annotations

import os

import pytest

STRICT_ENV = "MEGATRON_OPD_STRICT_SKIPS"

# Skip-reason prefix -> why CI may take that skip (what .ci/run does not provide).
ALLOWED_SKIPS: dict[str, str] = {
    "shared data not found": "../shared/data lies beside developer checkouts only; CI clones main alone",
    "sglang is not importable": "the main leg's venv has no SGLang; .ci/run's SGLang leg (make test-sglang) "
                                "runs these tests with MEGATRON_OPD_REQUIRE_SGLANG=1, where this skip fails",
    "sglang is installed here": "the counterpart of the sglang tests: only meaningful where sglang is missing",
}

# Set by .ci/run's SGLang leg: there sglang is installed, so a "sglang is not importable" skip is a failure.
REQUIRE_SGLANG_ENV = "MEGATRON_OPD_REQUIRE_SGLANG"
if os.environ.get(REQUIRE_SGLANG_ENV, "") not in ("", "0"):
    ALLOWED_SKIPS.pop("sglang is not importable")

_skipped: list[tuple[str, str, bool]] = []


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def allowed(reason: str) -> bool:
    return any(reason.startswith(prefix) for prefix in ALLOWED_SKIPS)


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def _judge(report: pytest.BaseReport, nodeid: str, what: str) -> None:
    """Record a skip; under strict mode turn a disallowed one into a failure."""
    reason = _reason(report)
    ok = allowed(reason)
    _skipped.append((nodeid, reason, ok))
    if strict() and not ok:
        report.outcome = "failed"
        report.longrepr = (f"{what} under {STRICT_ENV}=1, and its dependency is one CI installs: {reason}\n"
                           f"(allowed skip reasons: {sorted(ALLOWED_SKIPS)}; see tests/_strict_skips.py)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        _judge(report, item.nodeid, "skipped")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A module-level skip (`importorskip` at import time, `allow_module_level=True`) drops a whole file."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        _judge(report, report.nodeid, "module skipped")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    tr = terminalreporter
    tr.section("skipped tests and why")
    if not _skipped:
        tr.write_line("none")
    for nodeid, reason, ok in _skipped:
        why = ALLOWED_SKIPS[next(p for p in ALLOWED_SKIPS if reason.startswith(p))] if ok else \
            ("NOT ALLOWED in CI" if strict() else "would fail in CI")
        tr.write_line(f"{nodeid}: {reason}  [{why}]")
    deselected = len(tr.stats.get("deselected", []))
    if deselected:
        tr.write_line(f"({deselected} tests deselected by -m/-k: not part of this run)")
