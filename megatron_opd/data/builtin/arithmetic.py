"""Generated arithmetic word problems with worked golden solutions, for the CPU demo.

The demo's teacher is SmolLM2-135M-Instruct on two CPU cores, so problems must be short, one or two
steps, with small numbers. Solutions follow the MATH convention (the final answer in ``\\boxed{}``) so the
same grader and the same golden-solution path as real data apply. Generated from a seed instead of
shipped as a data file.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Union

from megatron_opd.data.prompts import write_jsonl

_NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kira", "Liam"]
_ITEMS = ["apples", "pencils", "marbles", "stickers", "cookies", "books", "coins", "shells", "cards", "toys"]


# Each kind: (problem, one-line work, (plan, check by the inverse operation), answer). The short solution is the
# work line + the boxed answer (the demo's format); the "checked" one adds a plan before and a check after.
Kind = tuple[str, str, tuple[str, str], int]


def _add(r: random.Random, name: str, item: str) -> Kind:
    a, b = r.randint(2, 20), r.randint(2, 20)
    return (f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?",
            f"{name} starts with {a} {item} and gets {b} more, so {a} + {b} = {a + b}.",
            (f"To find the total, we add the {item} {name} gets to the {item} {name} starts with.",
             f"Check: {a + b} - {b} = {a}, which is the number of {item} {name} started with."), a + b)


def _sub(r: random.Random, name: str, item: str) -> Kind:
    a = r.randint(5, 30)
    b = r.randint(1, a - 1)
    return (f"{name} has {a} {item} and gives {b} of them away. How many {item} does {name} have left?",
            f"{name} gives away {b} of {a} {item}, so {a} - {b} = {a - b}.",
            (f"To find what is left, we subtract the {item} given away from the {item} {name} had.",
             f"Check: {a - b} + {b} = {a}, which is the number of {item} {name} had at first."), a - b)


def _mul(r: random.Random, name: str, item: str) -> Kind:
    a, b = r.randint(2, 9), r.randint(2, 9)
    return (f"{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have in total?",
            f"There are {a} bags of {b} {item}, so {a} * {b} = {a * b}.",
            (f"To find the total, we multiply the number of bags by the number of {item} in each bag.",
             f"Check: {a * b} / {b} = {a}, which is the number of bags."), a * b)


def _div(r: random.Random, name: str, item: str) -> Kind:
    b, q = r.randint(2, 6), r.randint(2, 9)
    return (f"{name} shares {b * q} {item} equally among {b} friends. How many {item} does each friend get?",
            f"Each friend gets {b * q} / {b} = {q} {item}.",
            (f"To find one share, we divide the {item} by the number of friends.",
             f"Check: {q} * {b} = {b * q}, which is the number of {item} {name} shared."), q)


def _two_step(r: random.Random, name: str, item: str) -> Kind:
    a, b = r.randint(3, 15), r.randint(2, 10)
    c = r.randint(1, a + b - 1)
    return (f"{name} has {a} {item}, buys {b} more, and then gives {c} away. How many {item} does {name} have?",
            f"After buying, {name} has {a} + {b} = {a + b} {item}. After giving {c} away, {a + b} - {c} = "
            f"{a + b - c}.",
            (f"We first add the {item} {name} buys, then subtract the {item} {name} gives away.",
             f"Check: {a + b - c} + {c} - {b} = {a}, which is the number of {item} {name} started with."), a + b - c)


_KINDS: list[Callable[[random.Random, str, str], Kind]] = [_add, _sub, _mul, _div, _two_step]
STYLES = ("short", "checked")


def make_arithmetic_problems(n: int, seed: int = 0, style: str = "short") -> list[dict]:
    """`n` distinct problems as rows ``{id, problem, answer, solution, kind}``; same seed, same list. `style`
    is the solution's: "short" (the work in one line + the boxed answer) or "checked" (a plan line, the work,
    the boxed answer, then a check by the inverse operation: ~2-3x longer, no line repeated, and it goes on
    where a short solution stops). The problems and answers do not depend on it."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if style not in STYLES:
        raise ValueError(f"style: unknown {style!r} (expected one of {', '.join(STYLES)})")
    r = random.Random(seed)
    rows: list[dict] = []
    seen: set[str] = set()
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"cannot generate {n} distinct arithmetic problems")
        kind = r.choice(_KINDS)
        problem, work, (plan, check), answer = kind(r, r.choice(_NAMES), r.choice(_ITEMS))
        if problem in seen:
            continue
        seen.add(problem)
        final = f"The answer is $\\boxed{{{answer}}}$."
        lines = [plan, work, final, check] if style == "checked" else [work, final]
        rows.append({"id": f"arith-{seed}-{len(rows)}", "problem": problem, "answer": str(answer),
                     "solution": "\n".join(lines),
                     "kind": kind.__name__[1:]})
    return rows


def builtin_splits(n_train: int = 200, n_eval: int = 50, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Train and eval problems with no problem text in common (drawn from one stream, split in order)."""
    rows = make_arithmetic_problems(n_train + n_eval, seed)
    return rows[:n_train], rows[n_train:]


def write_builtin_jsonl(out_dir: Union[str, Path], n_train: int = 200, n_eval: int = 50,
                        seed: int = 0) -> dict[str, Path]:
    """Write ``arith_train.jsonl`` / ``arith_eval.jsonl`` into `out_dir`; returns {"train": path, "eval": path}."""
    train, evals = builtin_splits(n_train, n_eval, seed)
    out = Path(out_dir)
    return {"train": write_jsonl(train, out / "arith_train.jsonl"), "eval": write_jsonl(evals, out / "arith_eval.jsonl")}


__all__ = ["builtin_splits", "make_arithmetic_problems", "write_builtin_jsonl"]
