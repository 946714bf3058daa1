"""`megatron-opd convert`: HF safetensors <-> megatron-core distributed (torch_dist) checkpoints.

    megatron-opd convert hf-to-mcore --hf DIR --out DIR --tp N --pp M [--verify]
    megatron-opd convert mcore-to-hf --ckpt DIR --out DIR [--hf-config DIR] [--tp N --pp M] [--verify]

Ranks: megatron's `sharded_state_dict` / `dist_checkpointing.save` need the real TP x PP process
groups, so the conversion runs one process per model-parallel rank. By default the command spawns
tp*pp local processes itself (gloo on CPU, nccl when CUDA is present; any machine works, no GPU
needed). Under `torchrun --nproc-per-node tp*pp` it uses the launched ranks instead (WORLD_SIZE
must equal tp*pp). The torch_dist checkpoint is layout independent, so `mcore-to-hf` may load with
any TP/PP (default 1x1, a single process) - that is the resharding path.

Both directions go through `megatron_opd.models.weight_mapping` (the one name mapping): HF ->
per-rank megatron tensors -> GPTModel -> torch_dist; torch_dist -> GPTModel -> `iter_hf_weights`
(the live-sync gather) -> safetensors. Outputs are written to a sibling `.NAME.partial` directory
and renamed into place when complete. `--verify` loads the result into a 1x1 megatron model and
the HF model, runs both on a few random token sequences and reports the max |logit difference|.
Weights are read and written as safetensors only (never pickle).
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_mod
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from megatron_opd.models.checkpoint import (HF_ASSETS_DIR, CheckpointError, commit_partial, copy_hf_assets,
                                            hf_config_dict, load_model_checkpoint, prepare_partial,
                                            read_checkpoint_meta, save_model_checkpoint)
from megatron_opd.models.gpt import build_gpt_model
from megatron_opd.models.hf_config import HFConfigError, transformer_config_from_hf
from megatron_opd.models.hf_io import (HFDirError, LazySafetensors, config_from_dict, load_hf_config,
                                       write_safetensors_shards)
from megatron_opd.models.parallel import destroy_parallel, free_port, init_parallel, model_parallel_coords
from megatron_opd.models.weight_mapping import (ModelDims, WeightMappingError, check_hf_state_dict,
                                                hf_to_megatron_state_dict, iter_hf_weights, load_megatron_state_dict)

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Default --verify tolerance on max |logit diff|: fp32 is near-exact; half types accumulate rounding.
DEFAULT_VERIFY_TOL = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.1}


class ConvertError(RuntimeError):
    """A conversion that cannot proceed or a worker rank that failed; the message says why."""


# ------------------------------------------------------------------------------------------- launching


def _worker(rank: int, world_size: int, port: int, fn: Callable, job: dict, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        q.put((rank, "ok", fn(rank, world_size, job)))
    except BaseException:  # noqa: BLE001 - report to the parent, which stops the other ranks
        q.put((rank, "error", traceback.format_exc()))


def spawn_ranks(fn: Callable, world_size: int, job: dict, timeout_s: float = 3600) -> list[Any]:
    """Run `fn(rank, world_size, job)` on `world_size` fresh local processes; return their results.

    The first failing rank stops the others (they would otherwise wait in a collective forever).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, job, q)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    error: Optional[str] = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and error is None:
            try:
                rank, status, payload = q.get(timeout=2)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    error = f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} (killed? out of memory?)"
                elif time.monotonic() > deadline:
                    error = f"timed out after {timeout_s:.0f}s"
                continue
            if status == "error":
                error = f"rank {rank} failed:\n{payload}"
            else:
                results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30 if error is None else 1)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    if error is not None:
        raise ConvertError(error)
    return [results[r] for r in range(world_size)]


def run_ranks(fn: Callable, world_size: int, job: dict) -> list[Any]:
    """Under torchrun (WORLD_SIZE set) run this rank in-process; otherwise spawn `world_size` ranks."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        ws = int(os.environ["WORLD_SIZE"])
        if ws != world_size:
            raise ConvertError(f"launched with WORLD_SIZE={ws}, but --tp * --pp = {world_size}: they must match")
        return [fn(int(os.environ["RANK"]), ws, job)]
    return spawn_ranks(fn, world_size, job)


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


# --------------------------------------------------------------------------------------------- workers

def _torch_dtype(name: str):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _model_parallel_ranks() -> tuple[int, int]:
    tp_rank, _, pp_rank, _ = model_parallel_coords()
    return tp_rank, pp_rank


def _hf_to_mcore_worker(rank: int, world_size: int, job: dict) -> dict:
    tp, pp = job["tp"], job["pp"]
    init_parallel(tp, pp, backend=job["backend"])
    try:
        cfg = load_hf_config(job["hf"])
        model = build_gpt_model(cfg, tp=tp, pp=pp, layer_spec="local", params_dtype=_torch_dtype(job["dtype"]))
        tp_rank, pp_rank = _model_parallel_ranks()
        mg = hf_to_megatron_state_dict(LazySafetensors(job["hf"]), cfg, tp_rank=tp_rank, tp_size=tp,
                                       pp_rank=pp_rank, pp_size=pp, vocab_padded=model.vocab_size)
        load_megatron_state_dict(model, mg)
        del mg
        save_model_checkpoint(model, job["out"], hf_config=cfg, hf_assets_from=job["hf"], overwrite=job["overwrite"])
        return {"tp_rank": tp_rank, "pp_rank": pp_rank}
    finally:
        destroy_parallel()


def _mcore_to_hf_worker(rank: int, world_size: int, job: dict) -> dict:
    tp, pp = job["tp"], job["pp"]
    init_parallel(tp, pp, backend=job["backend"])
    try:
        cfg = config_from_dict(job["hf_config"], where=job["hf_config_source"])
        model = build_gpt_model(cfg, tp=tp, pp=pp, layer_spec="local", params_dtype=_torch_dtype(job["dtype"]))
        load_model_checkpoint(model, job["ckpt"])
        tmp = prepare_partial(job["out"], overwrite=job["overwrite"])
        weights = iter_hf_weights(model, cfg)  # collective: every rank drains it, rank 0 writes
        files: list[str] = []
        if rank == 0:
            files = write_safetensors_shards(weights, tmp, max_shard_bytes=job["max_shard_bytes"])
            cfg.save_pretrained(str(tmp))
            for src in job["asset_dirs"]:
                if copy_hf_assets(src, tmp):
                    break
        else:
            for _ in weights:
                pass
        commit_partial(job["out"])
        return {"files": files}
    finally:
        destroy_parallel()


def _verify_worker(rank: int, world_size: int, job: dict) -> dict:
    """Megatron (1x1, from the torch_dist checkpoint) vs HF (from the HF dir) logits on random ids. The model
    is built with job["layer_spec"] (default local): a checkpoint written with one spec must load into the
    other (benchmarks/gpu_check.py loads a CPU-written one into the Transformer Engine model)."""
    dtype = _torch_dtype(job["dtype"])
    init_parallel(1, 1, backend=job["backend"])
    try:
        cfg = load_hf_config(job["hf"])
        model = build_gpt_model(cfg, tp=1, pp=1, layer_spec=job.get("layer_spec", "local"), params_dtype=dtype)
        load_model_checkpoint(model, job["ckpt"])
        model.eval()
        hf = AutoModelForCausalLM.from_pretrained(job["hf"], dtype=dtype).eval()
        device = next(model.parameters()).device
        hf.to(device)
        gen = torch.Generator().manual_seed(job["seed"])
        ids = torch.randint(0, cfg.vocab_size, (job["prompts"], job["seq_len"]), generator=gen).to(device)
        pos = torch.arange(job["seq_len"], device=device).unsqueeze(0).expand_as(ids)
        with torch.no_grad():
            mg_logits = model(ids, pos, attention_mask=None)[..., : cfg.vocab_size].float()
            hf_logits = hf(input_ids=ids).logits.float()
        diff = (mg_logits - hf_logits).abs()
        return {"max_abs_logit_diff": diff.max().item(), "mean_abs_logit_diff": diff.mean().item(),
                "max_abs_logit": hf_logits.abs().max().item(),
                "argmax_agreement": (mg_logits.argmax(-1) == hf_logits.argmax(-1)).float().mean().item(),
                "tokens": int(ids.numel())}
    finally:
        destroy_parallel()


# ------------------------------------------------------------------------------------------- commands

def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"--out {out}: already exists and is not empty (pass --overwrite to replace it)")


def verify_checkpoint(hf: str | Path, ckpt: str | Path, dtype: str = "float32", backend: str = "auto",
                      layer_spec: str = "local", seed: int = 0, prompts: int = 2, seq_len: int = 32) -> dict:
    """In this process (a world of one): `_verify_worker`'s report plus the default tolerance and `ok`."""
    job = {"hf": str(hf), "ckpt": str(ckpt), "dtype": dtype, "backend": backend, "seed": seed, "prompts": prompts,
           "seq_len": seq_len, "layer_spec": layer_spec}
    report = _verify_worker(0, 1, job)
    return {**report, "tol": DEFAULT_VERIFY_TOL[dtype], "ok": report["max_abs_logit_diff"] <= DEFAULT_VERIFY_TOL[dtype]}


def _verify(args: argparse.Namespace, hf_dir: Path, ckpt: Path, dtype: str) -> int:
    tol = args.verify_tol if args.verify_tol is not None else DEFAULT_VERIFY_TOL[dtype]
    job = {"hf": str(hf_dir), "ckpt": str(ckpt), "dtype": dtype, "backend": args.backend, "seed": args.seed,
           "prompts": args.verify_prompts, "seq_len": args.verify_seq_len}
    report = spawn_ranks(_verify_worker, 1, job)[0]
    ok = report["max_abs_logit_diff"] <= tol
    print(f"verify: max |logit diff| = {report['max_abs_logit_diff']:.3g} (mean {report['mean_abs_logit_diff']:.3g}, "
          f"max |logit| {report['max_abs_logit']:.3g}, argmax agreement {report['argmax_agreement']:.3f}) over "
          f"{report['tokens']} tokens, {dtype}, tol {tol:g}: {'OK' if ok else 'FAILED'}")
    print("verify-json: " + json.dumps({**report, "tol": tol, "ok": ok}))
    return 0 if ok else 1


def cmd_hf_to_mcore(args: argparse.Namespace) -> int:
    hf_dir, out = Path(args.hf), Path(args.out).resolve()
    cfg = load_hf_config(hf_dir)
    sd = LazySafetensors(hf_dir)
    check_hf_state_dict(sd, cfg)  # names every missing / extra / mis-shaped tensor before any rank starts
    ModelDims.from_hf(cfg).check_parallel(args.tp, args.pp)
    dtype = args.dtype if args.dtype != "auto" else str(sd.dtype_of("model.embed_tokens.weight")).replace("torch.", "")
    if dtype not in DEFAULT_VERIFY_TOL:
        raise ConvertError(f"weights dtype {dtype} is not supported (use --dtype float32|bfloat16|float16)")
    _check_out(out, args.overwrite)
    _validate_megatron_config(cfg, args.tp, args.pp)
    job = {"hf": str(hf_dir.resolve()), "out": str(out), "tp": args.tp, "pp": args.pp, "dtype": dtype,
           "backend": args.backend, "overwrite": args.overwrite}
    t0 = time.monotonic()
    run_ranks(_hf_to_mcore_worker, args.tp * args.pp, job)
    if _is_rank0():
        print(f"wrote torch_dist checkpoint {out} (tp={args.tp}, pp={args.pp}, {dtype}) "
              f"in {time.monotonic() - t0:.1f}s")
    if args.verify and _is_rank0():
        return _verify(args, hf_dir, out, dtype)
    return 0


def cmd_mcore_to_hf(args: argparse.Namespace) -> int:
    ckpt, out = Path(args.ckpt).resolve(), Path(args.out).resolve()
    meta = read_checkpoint_meta(ckpt)
    if args.hf_config:
        cfg = load_hf_config(args.hf_config)
        source = str(Path(args.hf_config))
    elif meta.get("hf_config"):
        cfg = config_from_dict(meta["hf_config"], where=f"{ckpt}/megatron_opd.json:hf_config")
        source = f"{ckpt}/megatron_opd.json:hf_config"
    else:
        raise ConvertError(f"--ckpt {ckpt}: has no stored HF config (not written by this tool); pass --hf-config DIR")
    ModelDims.from_hf(cfg).check_parallel(args.tp, args.pp)
    dtype = args.dtype if args.dtype != "auto" else meta.get("params_dtype", "float32")
    if dtype not in DEFAULT_VERIFY_TOL:
        raise ConvertError(f"{ckpt}/megatron_opd.json: params_dtype {dtype!r} not supported; pass --dtype")
    _check_out(out, args.overwrite)
    _validate_megatron_config(cfg, args.tp, args.pp)
    asset_dirs = [d for d in ([args.hf_config] if args.hf_config and Path(args.hf_config).is_dir() else [])]
    asset_dirs.append(str(ckpt / HF_ASSETS_DIR))
    job = {"ckpt": str(ckpt), "out": str(out), "tp": args.tp, "pp": args.pp, "dtype": dtype, "backend": args.backend,
           "overwrite": args.overwrite, "hf_config": hf_config_dict(cfg), "hf_config_source": source,
           "asset_dirs": asset_dirs, "max_shard_bytes": int(args.max_shard_mb * 2**20)}
    t0 = time.monotonic()
    results = run_ranks(_mcore_to_hf_worker, args.tp * args.pp, job)
    if _is_rank0():
        files = results[0]["files"]
        print(f"wrote HF model {out} ({len(files)} safetensors file(s)) from {ckpt} loaded as tp={args.tp}, "
              f"pp={args.pp}, {dtype} in {time.monotonic() - t0:.1f}s")
    if args.verify and _is_rank0():
        return _verify(args, out, ckpt, dtype)
    return 0


def _validate_megatron_config(cfg: Any, tp: int, pp: int) -> None:
    """The HF config must also be one megatron can build (raises HFConfigError naming the field)."""
    transformer_config_from_hf(cfg, tp=tp, pp=pp)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-opd convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)

    def common(p: argparse.ArgumentParser, tp_default: Optional[int]) -> None:
        p.add_argument("--out", required=True, help="output directory (written atomically)")
        p.add_argument("--tp", type=int, default=tp_default, required=tp_default is None,
                       help="tensor-parallel size of the ranks doing the conversion")
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the ranks")
        p.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="parameter dtype (auto: the source's; casting makes the conversion lossy)")
        p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
        p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")
        p.add_argument("--verify", action="store_true", help="compare HF and megatron logits after converting")
        p.add_argument("--verify-tol", type=float, default=None,
                       help="max allowed |logit diff| (default 1e-3 fp32, 0.25 bf16, 0.1 fp16)")
        p.add_argument("--verify-prompts", type=int, default=2)
        p.add_argument("--verify-seq-len", type=int, default=16)
        p.add_argument("--seed", type=int, default=0, help="seed of the random --verify token ids")

    h2m = sub.add_parser("hf-to-mcore", help="HF safetensors directory -> torch_dist checkpoint")
    h2m.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    common(h2m, tp_default=None)
    m2h = sub.add_parser("mcore-to-hf", help="torch_dist checkpoint -> HF safetensors directory")
    m2h.add_argument("--ckpt", required=True, help="torch_dist checkpoint directory")
    m2h.add_argument("--hf-config", default=None,
                     help="HF directory or config.json to take the config (and tokenizer) from; default: the "
                          "config stored in the checkpoint by hf-to-mcore")
    m2h.add_argument("--max-shard-mb", type=float, default=5000, help="split safetensors files above this size")
    common(m2h, tp_default=1)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("tp", "pp", "verify_prompts", "verify_seq_len"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        if args.direction == "hf-to-mcore":
            return cmd_hf_to_mcore(args)
        return cmd_mcore_to_hf(args)
    except (ConvertError, CheckpointError, HFConfigError, WeightMappingError, HFDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
