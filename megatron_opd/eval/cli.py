"""`megatron-opd eval`: sample k responses per problem with the local engine, grade, write a table.

Example::

    megatron-opd eval --model runs/x/hf --benchmarks math500=../shared/data/math500.jsonl,aime24=aime24.jsonl \\
        --k 4 --max-new-tokens 2048 --out runs/x/eval

A benchmark given without ``=PATH`` is looked up as ``<--data-dir>/<default file name>`` (see
`megatron_opd.eval.benchmarks` for names, file names and fields).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_opd.config import DataConfig
from megatron_opd.eval.benchmarks import BENCHMARKS, evaluate, get_spec, results_markdown
from megatron_opd.rollout.base import SamplingParams

EngineFactory = Callable[[argparse.Namespace], Any]


def parse_benchmarks(spec: str, data_dir: Optional[str]) -> dict[str, Path]:
    """``"math500=PATH,aime24"`` -> {name: path}; names must be registered, paths must exist."""
    out: dict[str, Path] = {}
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        name, _, path = item.partition("=")
        name = name.strip()
        bench = get_spec(name)
        if path:
            p = Path(path.strip())
        elif data_dir:
            p = Path(data_dir) / bench.filename
        else:
            raise ValueError(f"--benchmarks {name}: no path; give {name}=PATH or --data-dir DIR holding {bench.filename}")
        if not p.exists():
            raise FileNotFoundError(f"--benchmarks {name}: {p} not found")
        if name in out:
            raise ValueError(f"--benchmarks: {name} given twice")
        out[name] = p
    if not out:
        raise ValueError("--benchmarks: empty")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-opd eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    p.add_argument("--benchmarks", required=True,
                   help=f"comma list of NAME[=PATH]; names: {', '.join(BENCHMARKS)}")
    p.add_argument("--data-dir", default=None, help="folder holding benchmark files under their default names")
    p.add_argument("--k", type=int, default=1, help="samples per problem (avg@k, pass@k)")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=32, help="prompts per engine.generate call")
    p.add_argument("--limit", type=int, default=None, help="only the first N problems of each benchmark")
    p.add_argument("--max-prompt-tokens", type=int, default=2048)
    p.add_argument("--prompt-template", default=None, help="default: data.prompt_template of the config")
    p.add_argument("--no-chat-template", action="store_true", help="feed the raw prompt template text")
    p.add_argument("--out", required=True, help="output folder for results.json / results.md / samples_*.jsonl")
    return p


def _local_engine(args: argparse.Namespace) -> Any:
    from megatron_opd.rollout.local import LocalEngine  # lazy: pulls in torch + transformers models

    return LocalEngine.from_pretrained(args.model, max_batch_size=max(1, args.batch_size * args.k))


def main(argv: Optional[list[str]] = None, engine_factory: Optional[EngineFactory] = None) -> int:
    """Entry point; `engine_factory(args)` replaces the local engine (tests, other backends)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for flag, value, ok in (("--k", args.k, args.k >= 1), ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1),
                            ("--temperature", args.temperature, args.temperature >= 0),
                            ("--top-p", args.top_p, 0 < args.top_p <= 1),
                            ("--batch-size", args.batch_size, args.batch_size >= 1),
                            ("--limit", args.limit, args.limit is None or args.limit >= 1)):
        if not ok:
            print(f"megatron-opd eval: {flag}: invalid value {value}", file=sys.stderr)
            return 2
    try:
        benches = parse_benchmarks(args.benchmarks, args.data_dir)
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"megatron-opd eval: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    data_cfg = DataConfig(apply_chat_template=not args.no_chat_template, max_prompt_tokens=args.max_prompt_tokens)
    if args.prompt_template is not None:
        data_cfg.prompt_template = args.prompt_template
    engine = (engine_factory or _local_engine)(args)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed)
    try:
        results = evaluate(engine, tokenizer, benches, k=args.k, sampling=sampling, out_dir=args.out,
                           data_cfg=data_cfg, limit=args.limit, batch_size=args.batch_size)
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
    print(results_markdown(results))
    print(f"wrote {Path(args.out) / 'results.md'} and results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
