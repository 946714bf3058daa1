import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SHARED_DATA = ROOT.parent / "shared" / "data"

pytest_plugins = ["_strict_skips"]


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED_DATA / "math500.jsonl").is_file():
        pytest.skip(f"shared data not found at {SHARED_DATA} (see ../shared/data/README.md)")
    return SHARED_DATA
