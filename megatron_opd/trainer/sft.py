"""`megatron-opd sft`: supervised fine-tuning on golden solutions, on the same megatron backend as OPD.

Why it is here: OPD needs a teacher that is clearly better than its student on the task, and a student
that already writes in the task's format. Users warm-start students (or make a task teacher) this way
before distilling; the CPU demo makes its teacher so (`demo.prepare_models`). The loss is the golden
term of Stable-OPD alone: token-mean NLL of the solution (+ EOS) given the prompt, the prompt rendered
exactly as in OPD training (chat template, `data.*` keys), so what the model learns is what OPD samples.

Everything comes from the same config as `train` (model.*, parallel.*, data.*, optim.*, train.seed,
train.micro_batch_size); `--steps`, `--batch-size` and `--out` are the SFT run's own. Output: an HF
directory (safetensors, config, tokenizer files, `sft_meta.json`), written atomically.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

from megatron_opd.config import Config, ConfigError, load_config
from megatron_opd.data.prompts import DataError, load_prompts
from megatron_opd.data.sampler import PromptSampler
from megatron_opd.models.checkpoint import CheckpointError, commit_partial, prepare_partial, write_hf_dir
from megatron_opd.models.hf_config import check_family
from megatron_opd.models.parallel import (data_parallel_rank_size, host_group, init_parallel, is_pipeline_last_stage,
                                          tensor_parallel_rank)
from megatron_opd.models.weight_mapping import load_hf_state_dict
from megatron_opd.trainer.batch import SequenceItem, TrainBatch, build_batch, split_micro_batches
from megatron_opd.trainer.policy import MegatronPolicy

# Under the YAML and the overrides (which win): SFT wants a larger step size than OPD's default.
SFT_DEFAULTS = ["optim.lr=5e-5", "optim.lr_decay_style=cosine", "optim.min_lr=5e-6", "checkpoint.resume=never"]


def sft_defaults(steps: int) -> list[str]:
    """SFT_DEFAULTS plus a warmup of 5 optimizer steps, shortened for runs of 5 steps or fewer (a default
    the user never set must not make `--steps 2` fail)."""
    return [*SFT_DEFAULTS, f"optim.warmup_steps={max(0, min(5, steps - 1))}"]
META_FILE = "sft_meta.json"


def sft_items(records: list, max_response_tokens: int) -> list[SequenceItem]:
    """Golden sequences (prompt ids, solution ids + EOS) cut at `max_response_tokens`."""
    return [SequenceItem(list(r.prompt_ids), list(r.solution_ids[:max_response_tokens]), is_golden=True,
                         truncated=len(r.solution_ids) > max_response_tokens, prompt_index=i)
            for i, r in enumerate(records)]


def _nll_loss(total_tokens: int, scale: int):
    """Loss closure for `MegatronPolicy.train_minibatch`: this micro-batch's share of the token-mean NLL
    over the whole (all data-parallel ranks) batch; megatron averages micro-batches and DDP averages
    ranks, hence the loss's `scale` = micro-batches x data-parallel size. The logged `nll` is the
    unscaled share: `_mean_stats` sums the shares of every micro-batch on every rank."""

    def loss_fn(logp: torch.Tensor, _resp: Optional[torch.Tensor], batch: TrainBatch, _logits: torch.Tensor):
        nll = -(logp * batch.response_mask).sum() / total_tokens
        return nll * scale, {"nll": float(nll.detach())}

    return loss_fn


def _dp_mean(value: float) -> float:
    group = host_group("dp")
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t.item()) / dist.get_world_size(group)


def run_sft(cfg: Config, out: str | Path, steps: int, batch_size: int, max_response_tokens: int = 1024,
            log: Callable[[str], None] = print, log_every: int = 10, overwrite: bool = False,
            extra_meta: Optional[dict] = None) -> dict:
    """Fine-tune `cfg.model.hf_path` on the solutions of `cfg.data.train_path` for `steps` optimizer steps
    of `batch_size` sequences (split over the data-parallel ranks, `train.micro_batch_size` at a time)
    and write the result to `out` as an HF directory. Returns the run summary (also `sft_meta.json`).
    Collective: every rank calls it."""
    if cfg.model.hf_path is None:
        raise ValueError("model.hf_path: required (the HF directory to fine-tune)")
    if not (Path(cfg.model.hf_path) / "config.json").is_file():
        raise ValueError(f"model.hf_path={cfg.model.hf_path}: not an HF model directory (no config.json)")
    if cfg.data.train_path is None:
        raise ValueError("data.train_path: required (JSONL / Parquet / HF dataset with a solution field)")
    if steps < 1 or batch_size < 1 or max_response_tokens < 1:
        raise ValueError(f"--steps, --batch-size and --max-response-tokens must be >= 1, got {steps}, "
                         f"{batch_size}, {max_response_tokens}")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    hf_config = AutoConfig.from_pretrained(cfg.model.hf_path)
    check_family(cfg.model.family, hf_config, cfg.model.hf_path)
    prompts = load_prompts(cfg.data.train_path, cfg.data, tokenizer, require_solution=True)
    records = [r for r in prompts.records if r.has_solution]
    if not records:
        raise ValueError(f"data.train_path={cfg.data.train_path}: no rows with a '{cfg.data.solution_key}' field")
    p = cfg.parallel
    init_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.backend, seed=cfg.train.seed)
    dp_rank, dp_size = data_parallel_rank_size()
    if batch_size % dp_size:
        raise ValueError(f"--batch-size {batch_size} must be a multiple of the data-parallel size {dp_size}")
    tmp = prepare_partial(out, overwrite=overwrite)  # refuse an existing --out before training, not after
    reports = (is_pipeline_last_stage() and tensor_parallel_rank() == 0
               and dp_rank == 0)
    is_last = is_pipeline_last_stage()
    policy = MegatronPolicy(hf_config, load_hf_state_dict(cfg.model.hf_path), cfg, trainable=True, total_steps=steps,
                            temperature=1.0)
    sampler = PromptSampler(records, seed=cfg.train.seed, shuffle=cfg.data.shuffle, batch_size=batch_size)
    per_rank = batch_size // dp_size
    losses: list[float] = []
    t0 = time.time()
    for step in range(1, steps + 1):
        items = sft_items(sampler.next_batch(), max_response_tokens)
        total_tokens = sum(len(it.response_ids) for it in items)
        mine = items[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        batch = build_batch(mine, pad_id, pad_to_multiple=policy.seq_multiple)
        micro = split_micro_batches(batch, list(range(batch.batch_size)), cfg.train.micro_batch_size,
                                    policy.seq_multiple, own_length=p.pipeline_model_parallel_size == 1)
        stats = policy.train_minibatch(micro, _nll_loss(total_tokens, len(micro) * dp_size), want_logits=False)
        nll = _dp_mean(stats.get("nll", float("nan"))) if is_last else float("nan")
        losses.append(nll)
        if reports and (step == 1 or step == steps or step % log_every == 0):
            skipped = " (update skipped: non-finite)" if stats.get("update_skipped") else ""
            log(f"[sft] step {step}/{steps} nll {nll:.4f} grad_norm {stats.get('grad_norm', float('nan')):.3g} "
                f"{(time.time() - t0) / step:.2f} s/step{skipped}")
    summary = {"source_model": str(cfg.model.hf_path), "data": str(cfg.data.train_path), "steps": steps,
               "batch_size": batch_size, "lr": cfg.optim.lr, "seed": cfg.train.seed,
               "nll_first": losses[0], "nll_last": losses[-1], "seconds": round(time.time() - t0, 1),
               **(extra_meta or {})}
    if not all(math.isfinite(x) for x in (summary["nll_first"], summary["nll_last"])) and reports:
        raise RuntimeError(f"sft: non-finite loss (first {summary['nll_first']}, last {summary['nll_last']})")
    write_hf_dir(policy.iter_hf_weights(), hf_config, cfg.model.hf_path, tmp, META_FILE, summary)
    commit_partial(out)
    return summary


def read_sft_meta(model_dir: str | Path) -> Optional[dict]:
    """The `sft_meta.json` of a directory written by `run_sft` (None if absent or unreadable)."""
    f = Path(model_dir) / META_FILE
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="megatron-opd sft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="YAML config (same schema as `train`)")
    ap.add_argument("--out", required=True, help="output HF directory")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step (all ranks)")
    ap.add_argument("--max-response-tokens", type=int, default=1024, help="solutions are cut here")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.hf_path=DIR data.train_path=F.jsonl")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, list(args.overrides), defaults=sft_defaults(args.steps))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        summary = run_sft(cfg, args.out, args.steps, args.batch_size, args.max_response_tokens,
                          overwrite=args.overwrite)
    except (ValueError, DataError, CheckpointError) as e:
        print(f"sft: {e}", file=sys.stderr)
        return 2
    print(f"[sft] wrote {args.out}: nll {summary['nll_first']:.4f} -> {summary['nll_last']:.4f} in "
          f"{summary['seconds']:.0f} s")
    return 0
