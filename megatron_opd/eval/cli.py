"""`megatron-opd eval`: sample k responses per problem with the local engine, grade, write a table.

Example::

    megatron-opd eval --model runs/x/hf --benchmarks math500=../shared/data/math500.jsonl,aime24=aime24.jsonl \\
        --k 4 --max-new-tokens 2048 --out runs/x/eval

A benchmark given without ``=PATH`` is looked up in ``--data-dir`` (``NAME.jsonl``, the default file name,
or the ``NAME/test.jsonl`` layout of the public evaluation suites); see `megatron_opd.eval.benchmarks` for
names, aliases and fields. The paper's protocol on its six benchmarks::

    megatron-opd eval --model runs/x/hf --preset paper --data-dir evaluation/data --out runs/x/eval
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_opd.config import DataConfig
from megatron_opd.data.prompts import DataError, PromptSet
from megatron_opd.eval.benchmarks import (BENCHMARKS, PAPER_BENCHMARKS, evaluate, load_benchmark, paper_table,
                                          resolve_benchmarks, results_markdown)
from megatron_opd.rollout.base import SamplingParams

EngineFactory = Callable[[argparse.Namespace], Any]

# `--preset paper`: the six benchmarks of the Stable-OPD paper, in its column order, with the sampling of
# common practice for these models (DeepSeek-R1 / OpenThoughts evaluations: T=0.6, top-p 0.95), avg@16 on
# the small competition sets (30-40 problems) and avg@4 on the larger ones. Any flag given overrides it.
PAPER_PRESET: dict[str, Any] = {
    "benchmarks": ",".join(PAPER_BENCHMARKS),
    "k": {"math500": 4, "minerva": 4, "olympiadbench": 4, "amc23": 16, "aime24": 16, "aime25": 16},
    "temperature": 0.6,
    "top_p": 0.95,
    "max_new_tokens": 3072,
}
DEFAULTS: dict[str, Any] = {"k": 1, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 1024}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-opd eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    p.add_argument("--preset", choices=["paper"], default=None,
                   help="paper: MATH-500, Minerva, OlympiadBench, AMC23, AIME24, AIME25 from --data-dir, "
                        "avg@4 / avg@16, T=0.6, top-p 0.95, 3072 new tokens (flags override)")
    p.add_argument("--benchmarks", default=None,
                   help=f"comma list of NAME[=PATH]; names: {', '.join(BENCHMARKS)} (aliases such as minerva_math)")
    p.add_argument("--data-dir", default=None,
                   help="folder holding benchmark files: NAME.jsonl, the default file names, or NAME/test.jsonl")
    p.add_argument("--k", type=int, default=None, help="samples per problem (avg@k, pass@k); default 1")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 1024")
    p.add_argument("--temperature", type=float, default=None, help="default 1.0")
    p.add_argument("--top-p", type=float, default=None, help="default 1.0")
    p.add_argument("--top-k", type=int, default=-1, help="-1 (default): off; else >= 1")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="the model's weights (auto: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--device", default="auto", help="auto (default: cuda when available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=32, help="prompts per engine.generate call")
    p.add_argument("--limit", type=int, default=None, help="only the first N problems of each benchmark")
    p.add_argument("--max-prompt-tokens", type=int, default=2048)
    p.add_argument("--prompt-template", default=None,
                   help="prompt template with {problem} (default: the trainer's data.prompt_template default)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the raw prompt template text")
    p.add_argument("--strict-data", action="store_true", help="a bad row is an error instead of a recorded skip")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--out", required=True, help="output folder for results.json / results.md / samples_*.jsonl")
    return p


def _local_engine(args: argparse.Namespace) -> Any:
    import torch

    from megatron_opd.rollout.local import LocalEngine  # lazy: pulls in torch + transformers models

    k = max(args.k.values()) if isinstance(args.k, dict) else args.k
    device = args.device
    if device == "auto":  # the GPU when there is one: the CPU is for tests and tiny models
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    return LocalEngine.from_pretrained(args.model, dtype=dtype, device=device,
                                       max_batch_size=max(1, args.batch_size * k))


def _apply_preset(args: argparse.Namespace) -> None:
    """Fill every flag the user left unset from the preset, then from the plain defaults."""
    preset = PAPER_PRESET if args.preset == "paper" else {}
    if args.benchmarks is None:
        args.benchmarks = preset.get("benchmarks")
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))


def _fail(msg: str) -> int:
    print(f"megatron-opd eval: {msg}", file=sys.stderr)
    return 2


def main(argv: Optional[list[str]] = None, engine_factory: Optional[EngineFactory] = None) -> int:
    """Entry point; `engine_factory(args)` replaces the local engine (tests, other backends). Every
    benchmark file is read and validated before the model loads."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _apply_preset(args)
    if args.benchmarks is None:
        return _fail("--benchmarks: give NAME[=PATH],... or --preset paper with --data-dir")
    ks = list(args.k.values()) if isinstance(args.k, dict) else [args.k]
    for flag, value, ok in (("--k", args.k, all(k >= 1 for k in ks)),
                            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1),
                            ("--temperature", args.temperature, args.temperature >= 0),
                            ("--top-p", args.top_p, 0 < args.top_p <= 1),
                            ("--top-k", args.top_k, args.top_k == -1 or args.top_k >= 1),
                            ("--device", args.device, args.device in ("auto", "cpu") or args.device.startswith("cuda")),
                            ("--batch-size", args.batch_size, args.batch_size >= 1),
                            ("--limit", args.limit, args.limit is None or args.limit >= 1)):
        if not ok:
            return _fail(f"{flag}: invalid value {value}")
    try:
        benches = resolve_benchmarks(args.benchmarks, args.data_dir)
    except (KeyError, ValueError, FileNotFoundError) as e:
        return _fail(str(e.args[0] if e.args else e))
    if isinstance(args.k, dict):
        args.k = {name: args.k.get(name, 1) for name in benches}
    from transformers import AutoTokenizer

    for flag, path in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        if path is not None and not Path(path).is_dir():  # else transformers reads it as a hub id and says so
            return _fail(f"{flag} {path}: not found (expected an HF model directory)")
    if not (Path(args.model) / "config.json").is_file() and engine_factory is None:
        return _fail(f"--model {args.model}: not an HF model directory (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except (OSError, ValueError) as e:
        return _fail(f"--{'tokenizer' if args.tokenizer else 'model'} {args.tokenizer or args.model}: cannot load "
                     f"a tokenizer ({str(e).splitlines()[0]})")
    data_cfg = DataConfig(apply_chat_template=not args.no_chat_template, max_prompt_tokens=args.max_prompt_tokens,
                          on_bad_record="error" if args.strict_data else "skip")
    if args.prompt_template is not None:
        data_cfg.prompt_template = args.prompt_template
    loaded: dict[str, PromptSet] = {}
    for name, path in benches.items():
        try:
            loaded[name] = load_benchmark(name, path, tokenizer, data_cfg, args.limit)
        except (DataError, OSError) as e:
            return _fail(f"{name}: {e}")
        if loaded[name].bad:
            print(f"megatron-opd eval: {name}: skipped {len(loaded[name].bad)} row(s) of {path} (listed in "
                  f"results.json); first: {loaded[name].bad[0]}", file=sys.stderr)
    try:
        engine = (engine_factory or _local_engine)(args)
    except (OSError, ValueError) as e:
        return _fail(f"--model {args.model}: cannot load the model ({str(e).splitlines()[0]})")
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed)
    try:
        results = evaluate(engine, tokenizer, loaded, k=args.k, sampling=sampling, out_dir=args.out,
                           batch_size=args.batch_size, progress=not args.no_progress, on_error="continue")
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
    print(results_markdown(results))
    print(paper_table(results, label=Path(args.model).name or "model"))
    print(f"wrote {Path(args.out) / 'results.md'} and results.json")
    return 1 if any(r.error is not None for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
