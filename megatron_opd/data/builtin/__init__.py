"""Problem sets the project ships as code (no data files), for the CPU demo and smoke runs."""

from megatron_opd.data.builtin.arithmetic import builtin_splits, make_arithmetic_problems, write_builtin_jsonl

__all__ = ["builtin_splits", "make_arithmetic_problems", "write_builtin_jsonl"]
