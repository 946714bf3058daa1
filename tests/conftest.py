import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# `auto` dtypes resolve to fp32 in every test and the runs they start, whatever this host's bf16 GEMMs measure
# (models/dtype.py): the suite's numbers must not depend on which CPU CI drew; tests/test_dtype_auto.py probes
os.environ.setdefault("MEGATRON_OPD_AUTO_DTYPE", "float32")

SHARED_DATA = ROOT.parent / "shared" / "data"

pytest_plugins = ["_strict_skips", "_version_marker"]


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED_DATA / "math500.jsonl").is_file():
        pytest.skip(f"shared data not found at {SHARED_DATA} (see ../shared/data/README.md)")
    return SHARED_DATA


def pytest_terminal_summary(terminalreporter) -> None:
    """Numbers the real-SGLang tests measured (log-prob gaps vs HF / megatron), next to their tolerance."""
    import sglang_cpu

    if sglang_cpu.MEASURED:
        terminalreporter.section("SGLang measurements")
        terminalreporter.write_line(f"(tolerance on every log-prob gap: {sglang_cpu.LOGPROB_TOL:g})")
        for name, value in sglang_cpu.MEASURED.items():
            terminalreporter.write_line(f"{name}: {value:.3g}")
