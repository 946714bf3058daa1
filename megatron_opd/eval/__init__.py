"""Answer extraction and grading (grading.py), benchmark registry and runner (benchmarks.py), CLI (cli.py)."""
