"""Prompt sets with golden solutions: reading, validation, chat templating and tokenization.

Sources: JSONL (``.jsonl``/``.json`` one object per line), a ``.json`` array of objects, Parquet, a local HF ``datasets`` directory
(``save_to_disk``) or, for anything else that is not a local path, a hub name for
``datasets.load_dataset``. Every bad row is reported as ``<file>:<line>: <reason>`` so a user can open
the file at the right place; with ``on_bad_record=skip`` the loader keeps going, counts the skips and
logs the first few reasons, with ``error`` it raises `DataError` at the first one.
"""

from __future__ import annotations

import json
import logging
import math
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from megatron_opd.config import DataConfig

logger = logging.getLogger(__name__)

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")
MAX_LOGGED_BAD = 5


class DataError(ValueError):
    """A data problem; the message starts with ``<file>:<line>:`` when it concerns one row."""


class BadRecord(Exception):
    """Raised by `build_record` for a row that cannot be used; the loader adds the location."""


@dataclass
class PromptRecord:
    """One prompt ready for rollout. `prompt` is the exact text the model sees (after the prompt template
    and, if used, the chat template); `solution_ids` is the golden assistant turn + EOS (None without a
    solution)."""

    id: str
    problem: str
    prompt: str
    prompt_ids: list[int]
    answer: Optional[str] = None
    solution: Optional[str] = None
    solution_ids: Optional[list[int]] = None
    source: str = ""  # "<file>:<line>"
    meta: dict[str, Any] = field(default_factory=dict)  # other scalar fields (subject, level, ...)
    teacher: str = ""  # the teacher that scores this prompt's rows (`route_teachers`; "": the only one)

    @property
    def has_solution(self) -> bool:
        return self.solution_ids is not None


@dataclass
class PromptSet:
    records: list[PromptRecord]
    bad: list[str]  # one "<file>:<line>: reason" per skipped row
    path: str

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[PromptRecord]:
        return iter(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]


Row = Union[dict, BadRecord]


# ---------------------------------------------------------------------------------------------
# reading rows


def _iter_json_array(path: Path) -> Iterator[tuple[str, Row]]:
    """A ``.json`` file holding one array of objects (OlympiadBench's own release); rows are 1-based."""
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON array of objects or one object per line")
    for i, obj in enumerate(rows, start=1):
        loc = f"{path}:row {i}"
        yield loc, obj if isinstance(obj, dict) else BadRecord(f"expected a JSON object, got {type(obj).__name__}")


def _starts_with_array(path: Path) -> bool:
    with path.open("r", encoding="utf-8") as f:
        head = f.read(256).lstrip("\ufeff \t\r\n")
    return head.startswith("[")


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Row]]:
    if path.suffix.lower() == ".json" and _starts_with_array(path):
        yield from _iter_json_array(path)
        return
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            loc = f"{path}:{lineno}"
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                yield loc, BadRecord(f"invalid JSON ({e.msg} at column {e.colno})")
                continue
            yield loc, obj if isinstance(obj, dict) else BadRecord(
                f"expected a JSON object, got {type(obj).__name__}")


def _iter_table(rows: Any, name: str) -> Iterator[tuple[str, Row]]:
    for i, row in enumerate(rows):
        yield f"{name}:{i + 1}", dict(row)


def _load_hf_dir(path: Path, split: str) -> Any:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: no split {split!r} in the saved DatasetDict (has {sorted(ds)})")
        ds = ds[split]
    return ds


def iter_rows(path: Union[str, Path], split: str = "train") -> Iterator[tuple[str, Row]]:
    """Yield ``(location, row)`` for every row of a data source; a row that cannot be read is a
    `BadRecord` instead of a dict. Locations are ``<file>:<line>`` (1-based data row for tables)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if p.is_dir():
        yield from _iter_table(_load_hf_dir(p, split), str(p))
    elif p.is_file() and suffix in _PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        yield from _iter_table(pq.read_table(p).to_pylist(), str(p))
    elif p.is_file() and suffix in _JSONL_SUFFIXES:
        yield from _iter_jsonl(p)
    elif p.is_file():
        raise DataError(f"{p}: unsupported file type {suffix!r} (expected .jsonl, .json, .parquet or a "
                        "datasets directory)")
    elif suffix in _JSONL_SUFFIXES + _PARQUET_SUFFIXES or p.is_absolute() or str(path).startswith("."):
        raise DataError(f"{p}: file not found")
    else:
        import datasets

        try:
            ds = datasets.load_dataset(str(path), split=split)
        except Exception as e:
            raise DataError(f"{path}: not a local path, and loading it as a hub dataset failed: {e}") from e
        yield from _iter_table(ds, str(path))


# ---------------------------------------------------------------------------------------------
# one row -> PromptRecord


def _as_answer(value: Any, key: str) -> str:
    """Answers come as strings, numbers, or (OlympiadBench) a list of strings."""
    if isinstance(value, bool):
        raise BadRecord(f"field {key!r} must be a string or number, got bool")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadRecord(f"field {key!r} is not finite ({value})")
        value = repr(int(value)) if value.is_integer() else repr(value)
    elif isinstance(value, int):
        value = str(value)
    elif isinstance(value, (list, tuple)):
        value = ", ".join(_as_answer(v, key) for v in value)
    if not isinstance(value, str):
        raise BadRecord(f"field {key!r} must be a string or number, got {type(value).__name__}")
    value = value.strip()
    if len(value) >= 2 and value[0] == "$" and value[-1] == "$":
        value = value.strip("$").strip()
    if not value:
        raise BadRecord(f"field {key!r} is empty")
    return value


def _text_field(row: dict, key: str, required: bool) -> Optional[str]:
    if key not in row or row[key] is None:
        if required:
            raise BadRecord(f"missing field {key!r}")
        return None
    value = row[key]
    if not isinstance(value, str):
        raise BadRecord(f"field {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        if required:
            raise BadRecord(f"field {key!r} is empty")
        return None
    return value


def _fill(template: str, key: str, row: dict, fields: dict[str, str]) -> str:
    """`template` filled from `fields` and, for any other ``{name}``, the row's scalar fields; a name the row
    lacks is a BadRecord naming the config key."""
    values = {**{k: v for k, v in row.items() if isinstance(v, (str, int, float))}, **fields}
    names = {f[1] for f in string.Formatter().parse(template) if f[1]}
    missing = sorted(n for n in names if n not in values)
    if missing:
        raise BadRecord(f"{key} uses {{{missing[0]}}} but the row has no field {missing[0]!r}")
    return template.format_map(values)


def render_solution(solution: str, answer: Optional[str], row: dict, cfg: DataConfig) -> str:
    """Fill `cfg.solution_template`: ``{solution}`` and ``{answer}`` are those fields whatever their keys are
    called; any other ``{name}`` is taken from the row."""
    if cfg.solution_template == "{solution}":
        return solution
    fields = {"solution": solution, **({"answer": answer} if answer is not None else {})}
    return _fill(cfg.solution_template, "data.solution_template", row, fields)


def render_prompt(problem: str, row: dict, cfg: DataConfig) -> str:
    """Fill `cfg.prompt_template`. ``{problem}`` is the prompt field whatever `prompt_key` is called; any
    other ``{name}`` is taken from the row."""
    return _fill(cfg.prompt_template, "data.prompt_template", row, {"problem": problem, cfg.prompt_key: problem})


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError("the tokenizer has no eos_token_id: golden solutions need an end-of-sequence token")
    return int(eos[0] if isinstance(eos, (list, tuple)) else eos)


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def tokenize_prompt(text: str, tokenizer: Any, use_chat: bool) -> tuple[str, list[int]]:
    """(model-facing text, ids). With a chat template the text already carries its special tokens, so
    it is tokenized without adding more (no double BOS)."""
    if use_chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return rendered, encode(tokenizer, rendered, add_special_tokens=False)
    return text, encode(tokenizer, text, add_special_tokens=True)


def solution_ids(solution: str, tokenizer: Any) -> list[int]:
    """Golden tokens = the assistant-turn content + EOS (what the student would emit after the prompt)."""
    return encode(tokenizer, solution, add_special_tokens=False) + [eos_id(tokenizer)]


def build_record(row: dict, loc: str, cfg: DataConfig, tokenizer: Any, *, require_answer: bool = True,
                 require_solution: bool = False, use_chat: Optional[bool] = None) -> PromptRecord:
    """Validate one row and turn it into a PromptRecord; raises BadRecord with the reason."""
    problem = _text_field(row, cfg.prompt_key, required=True)
    assert problem is not None
    answer: Optional[str] = None
    if cfg.answer_key in row and row[cfg.answer_key] is not None:
        answer = _as_answer(row[cfg.answer_key], cfg.answer_key)
    elif require_answer:
        raise BadRecord(f"missing field {cfg.answer_key!r}")
    solution = _text_field(row, cfg.solution_key, required=require_solution)
    if solution is not None:
        solution = render_solution(solution, answer, row, cfg)
    if use_chat is None:
        use_chat = cfg.apply_chat_template and has_chat_template(tokenizer)
    prompt, ids = tokenize_prompt(render_prompt(problem, row, cfg), tokenizer, use_chat)
    if len(ids) > cfg.max_prompt_tokens:
        raise BadRecord(f"prompt has {len(ids)} tokens > data.max_prompt_tokens={cfg.max_prompt_tokens}")
    rid = row.get("id", row.get("idx"))
    meta = {k: v for k, v in row.items() if isinstance(v, (str, int, float, bool)) and k not in
            (cfg.prompt_key, cfg.answer_key, cfg.solution_key, "id")}
    return PromptRecord(
        id=str(rid) if rid is not None else loc, problem=problem, prompt=prompt, prompt_ids=ids, answer=answer,
        solution=solution, solution_ids=solution_ids(solution, tokenizer) if solution is not None else None,
        source=loc, meta=meta)


def load_prompts(path: Union[str, Path], cfg: DataConfig, tokenizer: Any, *, require_answer: bool = True,
                 require_solution: bool = False, split: str = "train", limit: Optional[int] = None,
                 transform: Optional[Callable[[dict], dict]] = None) -> PromptSet:
    """Load and validate a prompt set. `transform` maps each raw row first (benchmarks use it to rename
    fields); `limit` keeps the first N good records."""
    use_chat = cfg.apply_chat_template and has_chat_template(tokenizer)
    if cfg.apply_chat_template and not use_chat:
        logger.info("data.apply_chat_template is set but the tokenizer has no chat template: using the raw "
                    "prompt template")
    records: list[PromptRecord] = []
    bad: list[str] = []
    for loc, row in iter_rows(path, split):
        try:
            if isinstance(row, BadRecord):
                raise row
            if transform is not None:
                row = transform(row)
            records.append(build_record(row, loc, cfg, tokenizer, require_answer=require_answer,
                                        require_solution=require_solution, use_chat=use_chat))
        except BadRecord as e:
            msg = f"{loc}: {e}"
            if cfg.on_bad_record == "error":
                raise DataError(msg) from None
            bad.append(msg)
        if limit is not None and len(records) >= limit:
            break
    if bad:
        shown = "\n  ".join(bad[:MAX_LOGGED_BAD])
        more = f"\n  ... and {len(bad) - MAX_LOGGED_BAD} more" if len(bad) > MAX_LOGGED_BAD else ""
        logger.warning("%s: skipped %d bad record(s) of %d (data.on_bad_record=skip):\n  %s%s", path, len(bad),
                       len(bad) + len(records), shown, more)
    if not records:
        raise DataError(f"{path}: no usable records" + (f" (first problem: {bad[0]})" if bad else ""))
    return PromptSet(records, bad, str(path))


def route_teachers(prompts: PromptSet, route: Any, names: list[str]) -> PromptSet:
    """Set each record's `teacher` by `route` (config.TeacherRouteConfig): the record's `route.field`,
    mapped by `route.map` (a value absent from the map is itself a teacher name), else `route.default`.
    A record whose value names no teacher, with no default, is a DataError naming its file and line;
    without several teachers every record gets the only one."""
    mapping = {str(k): v for k, v in route.map.items()}
    default = route.default if route.default is not None or len(names) > 1 else names[0]
    for rec in prompts.records:
        value = rec.meta.get(route.field) if route.field is not None else None
        name = str(mapping.get(str(value), value)) if value is not None else None
        if name not in names:
            if default is None:
                what = (f"has no field {route.field!r}" if value is None
                        else f"{route.field}={value!r} names no teacher")
                raise DataError(f"{rec.source}: {what} (teachers: {names}; teacher_route.map: {dict(route.map)}) "
                                "and teacher_route.default is not set")
            name = default
        rec.teacher = name
    return prompts


def write_jsonl(rows: Sequence[dict], path: Union[str, Path]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return p


__all__ = ["BadRecord", "DataError", "PromptRecord", "PromptSet", "build_record", "encode", "eos_id",
           "has_chat_template", "iter_rows", "load_prompts", "render_prompt", "render_solution", "route_teachers",
           "solution_ids", "tokenize_prompt", "write_jsonl"]
