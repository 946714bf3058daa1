"""A run's metrics file (`<out_dir>/metrics.jsonl`, written by trainer/logger.py) read back: for the plots,
the demo's tables and `check-reproduction`, which sit beside or above the trainer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: str | Path, upto_step: Optional[int] = None) -> list[dict[str, Any]]:
    """Metrics rows of a run; when a resumed run re-logs steps, the last row for a step wins."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file (is {run_dir} a run directory?)")
    rows: dict[int, dict[str, Any]] = {}
    text = path.read_text()
    lines = text.splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not text.endswith("\n"):  # being written, or torn by a kill
                break
            raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from None
        if upto_step is None or row["step"] <= upto_step:
            rows[int(row["step"])] = row
    return [rows[k] for k in sorted(rows)]


__all__ = ["METRICS_FILE", "read_metrics"]
