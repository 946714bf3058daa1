"""The `megatron` marker: tests that exercise megatron-core's (and with it torch's) version-sensitive API.

`.ci/run` runs the whole suite on the main leg (Python 3.11, megatron-core 0.16) and, on the second leg
(Python 3.12, the newest megatron-core 0.19.x, PyPI's torch), only the tests marked `megatron`: those that
build a GPTModel, set up megatron's parallel state, its optimizer or its checkpoints, convert, or train.
The pure-torch algorithm, grading, data, config and launcher tests do not touch those APIs and run once.

A test declares the marker (`pytestmark = pytest.mark.megatron` in its module, or on the test). So that a
missing declaration cannot silently drop a test from that leg, a test that builds a megatron-core GPTModel or
initialises megatron's model parallelism in the test process without the marker fails, naming the marker.
Tests whose models are built in other processes (workers over gloo, the CLI in a subprocess) cannot be seen
from here: they declare it themselves (every `dist` test is one of them: `pytest_collection_modifyitems`).
"""

from __future__ import annotations

import functools
import os

import pytest

MARKER = "megatron"
REPORT_ENV = "MEGATRON_OPD_MARKER_REPORT"
_calls = {"n": 0}
_patched: list[tuple[object, str, object]] = []
_BEFORE = pytest.StashKey[int]()


def _counting(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _calls["n"] += 1
        return fn(*args, **kwargs)
    return wrapper


def _patch() -> None:
    try:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
    except ImportError:  # a venv without megatron-core (none of ours, but the plugin must not break pytest)
        return
    for owner, name in ((GPTModel, "__init__"), (parallel_state, "initialize_model_parallel")):
        orig = getattr(owner, name)
        _patched.append((owner, name, orig))
        setattr(owner, name, _counting(orig))


def pytest_configure(config: pytest.Config) -> None:
    _patch()


def pytest_unconfigure(config: pytest.Config) -> None:
    while _patched:
        owner, name, orig = _patched.pop()
        setattr(owner, name, orig)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("dist") and not item.get_closest_marker(MARKER):
            item.add_marker(MARKER)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_BEFORE] = _calls["n"]  # from setup on: a fixture that builds the model counts for its first user


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    if _calls["n"] > item.stash.get(_BEFORE, _calls["n"]) and not item.get_closest_marker(MARKER):
        if os.environ.get(REPORT_ENV):  # list instead of failing: for marking a suite in one run
            with open(os.environ[REPORT_ENV], "a") as f:
                f.write(item.nodeid + "\n")
            return result
        pytest.fail(f"{item.nodeid} builds a megatron-core GPTModel (or megatron's model parallelism) but does not "
                    f"declare @pytest.mark.{MARKER}: the Python 3.12 + megatron-core 0.19 leg selects tests by that "
                    "marker (tests/_version_marker.py)", pytrace=False)
    return result
