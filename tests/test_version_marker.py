"""tests/_version_marker.py on a throwaway suite: a test that builds a megatron-core GPTModel without declaring
`@pytest.mark.megatron` fails naming the marker (so the py3.12 + megatron-core 0.19 leg, which selects by it,
cannot silently lose it); a marked one passes, a `dist` one gets the marker, one that builds nothing needs none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _proc import explain

TESTS = Path(__file__).resolve().parent

SUITE = '''
import pytest

pytest_plugins = ["_version_marker"]


def _touch_gptmodel():
    from megatron.core.models.gpt import GPTModel
    with pytest.raises(Exception):  # the constructor is entered (and counted) before it rejects the config
        GPTModel(config=None, transformer_layer_spec=None, vocab_size=1, max_sequence_length=1)


def test_unmarked_builder():
    _touch_gptmodel()


@pytest.mark.megatron
def test_marked_builder():
    _touch_gptmodel()


@pytest.mark.dist
def test_dist_is_megatron(request):
    assert request.node.get_closest_marker("megatron")
    _touch_gptmodel()


def test_no_model():
    assert 1 + 1 == 2
'''


def test_a_test_building_a_gptmodel_must_declare_the_marker(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(SUITE.split("\n\n\ndef _touch")[0] + "\n")
    (tmp_path / "test_throwaway.py").write_text("import pytest\n\n\ndef _touch" + SUITE.split("\n\n\ndef _touch")[1])
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    env.pop("MEGATRON_OPD_MARKER_REPORT", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert "1 failed, 3 passed" in res.stdout, explain(res)
    assert "test_unmarked_builder builds a megatron-core GPTModel" in res.stdout, explain(res)
    assert "@pytest.mark.megatron" in res.stdout, explain(res)
    selected = subprocess.run(cmd + ["-m", "megatron", "--collect-only"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=180)
    assert "2/4 tests collected (2 deselected)" in selected.stdout, explain(selected)
    assert "test_marked_builder" in selected.stdout and "test_dist_is_megatron" in selected.stdout, explain(selected)
