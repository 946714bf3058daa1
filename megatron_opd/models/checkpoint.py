"""megatron-core distributed (torch_dist) model checkpoints: save, load, and the metadata we add.

A torch_dist checkpoint stores every tensor with its *global* shape and each rank's slice, so it
is independent of the TP/PP layout that wrote it: any layout can load it (resharding for free).
It is also independent of the layer spec: the local spec maps its layer-norm names onto the TE
names (`sharded_state_dict_keys_map`), so CPU-written checkpoints load into TE models on GPU.

Next to megatron's own files we write `megatron_opd.json` (format version, the HF config the model
was built from, writer TP/PP and dtype) and optionally `hf_assets/` (tokenizer files), so that a
checkpoint can be turned back into an HF directory without the original HF folder.

Saving is collective (every rank of the model calls it) and atomic: everything is written into
a sibling `.<name>.partial` directory that rank 0 renames into place after a barrier.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.validation import StrictHandling

from megatron_opd.models.hf_io import write_safetensors_shards
from megatron_opd.models.weight_mapping import load_megatron_state_dict

META_FILE = "megatron_opd.json"
HF_ASSETS_DIR = "hf_assets"
FORMAT_VERSION = 1
# Files copied from an HF directory next to the weights (tokenizer and generation settings).
HF_ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                  "tokenizer.model", "added_tokens.json", "generation_config.json", "chat_template.jinja",
                  "chat_template.json")


def _writer_without_a_server_process() -> None:
    """megatron's torch_dist writer collects its results through a multiprocessing Manager, a server process it
    starts on the first save and keeps. A rank killed by SIGKILL leaves that process behind, holding the job
    step's output open (Slurm without cgroup tracking then waits 60 s before the job can end; elsewhere it
    leaks). Our saves are synchronous: every put and get happens in this process, so a plain queue does."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


_PR_SET_PDEATHSIG = 1
_fork_guard = {"installed": False, "from_main_thread": False, "parent": 0}


def _note_fork() -> None:
    _fork_guard["from_main_thread"] = threading.current_thread() is threading.main_thread()
    _fork_guard["parent"] = os.getpid()


def _die_with_parent() -> None:
    if not _fork_guard["from_main_thread"]:
        return  # PR_SET_PDEATHSIG fires when the forking *thread* ends: only the main thread lives as long as we do
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0 and os.getppid() != _fork_guard["parent"]:
        os._exit(1)  # the parent died before the signal was armed


def forked_helpers_die_with_this_process() -> None:
    """Every process this one forks from its main thread gets SIGKILL when this one dies (Linux; idempotent).

    megatron's torch_dist writer forks one process per write bucket, even for a synchronous save. A rank
    SIGKILLed while they write leaves them behind: each holds a copy of the rank's gloo sockets, so the peers
    never see the connection drop and wait in their collective (the job's step stays open too; on Slurm it
    failed a minute late instead of in seconds), and nothing reaps them."""
    if _fork_guard["installed"] or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(before=_note_fork, after_in_child=_die_with_parent)
    _fork_guard["installed"] = True


class CheckpointError(RuntimeError):
    """A checkpoint directory that is missing, incomplete or inconsistent; names the path."""


def _dist():
    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def _barrier() -> None:
    d = _dist()
    if d:
        d.barrier()


def partial_dir(out_dir: str | os.PathLike) -> Path:
    """The sibling temp directory an atomic write goes through (deterministic: all ranks agree)."""
    out = Path(out_dir).resolve()
    return out.parent / f".{out.name}.partial"


def prepare_partial(out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Rank 0 checks `out_dir` and (re)creates the empty partial dir; everyone then waits for it."""
    out, tmp = Path(out_dir).resolve(), partial_dir(out_dir)
    if _rank() == 0:
        if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
            raise CheckpointError(f"{out}: already exists and is not empty (pass overwrite / --overwrite)")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    return tmp


def commit_partial(out_dir: str | os.PathLike) -> Path:
    """Rank 0 renames the partial dir onto `out_dir` (replacing an old one); everyone waits."""
    out, tmp = Path(out_dir).resolve(), partial_dir(out_dir)
    _barrier()
    if _rank() == 0:
        old = out.parent / f".{out.name}.old"
        if old.exists():
            shutil.rmtree(old)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    return out


def hf_config_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, dict):
        return dict(hf_config)
    return hf_config.to_dict()


def save_model_checkpoint(model: torch.nn.Module, ckpt_dir: str | os.PathLike, *, hf_config: Any = None,
                          hf_assets_from: Optional[str | os.PathLike] = None, overwrite: bool = False,
                          extra_meta: Optional[dict[str, Any]] = None) -> Path:
    """Collectively save this rank's GPTModel shard as one torch_dist checkpoint at `ckpt_dir`.

    Every rank of the model-parallel world calls this with the same arguments. `hf_config` (the
    config the model was built from) is stored in the metadata; tokenizer files found in
    `hf_assets_from` are copied to `hf_assets/`.
    """
    tmp = prepare_partial(ckpt_dir, overwrite=overwrite)
    gpt = _gpt(model)
    _writer_without_a_server_process()
    forked_helpers_die_with_this_process()
    dist_checkpointing.save(gpt.sharded_state_dict(), str(tmp))
    if _rank() == 0:
        dtype = next(iter(gpt.parameters())).dtype
        meta = {"format": "torch_dist", "format_version": FORMAT_VERSION,
                "writer_tp": parallel_state.get_tensor_model_parallel_world_size(),
                "writer_pp": parallel_state.get_pipeline_model_parallel_world_size(),
                "params_dtype": str(dtype).replace("torch.", ""),
                "vocab_size_padded": int(getattr(gpt, "vocab_size", 0)) or None,
                "hf_config": hf_config_dict(hf_config) if hf_config is not None else None, **(extra_meta or {})}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        if hf_assets_from is not None:
            copy_hf_assets(hf_assets_from, tmp / HF_ASSETS_DIR)
    return commit_partial(ckpt_dir)


def write_hf_dir(weights: Any, hf_config: Any, source: str | os.PathLike, tmp: Path, meta_name: str,
                 meta: dict[str, Any]) -> None:
    """Write an HF model directory into `tmp` (from `prepare_partial`): safetensors shards of `weights`
    (a policy's `iter_hf_weights()`), the HF config, `source`'s tokenizer/generation files and
    `meta_name` holding `meta`. Collective: every rank drains `weights` (the gathers run on all of
    them), rank 0 writes; `commit_partial` then puts the directory in place."""
    if _rank() == 0:
        write_safetensors_shards(weights, tmp)
        hf_config.save_pretrained(str(tmp))
        copy_hf_assets(source, tmp)
        (tmp / meta_name).write_text(json.dumps(meta, indent=2))
    else:
        for _ in weights:
            pass


def copy_hf_assets(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer/generation files present in `src` to `dst`; returns the names copied."""
    src, dst = Path(src), Path(dst)
    names = [n for n in HF_ASSET_FILES if (src / n).is_file()]
    if names:
        dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copy2(src / n, dst / n)
    return names


def read_checkpoint_meta(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """Our metadata of a torch_dist checkpoint ({} for a foreign checkpoint without it)."""
    ckpt = Path(ckpt_dir)
    if not (ckpt / "metadata.json").is_file() and not (ckpt / ".metadata").is_file():
        raise CheckpointError(f"{ckpt}: not a megatron-core distributed checkpoint (no metadata.json / .metadata)")
    meta_path = ckpt / META_FILE
    if not meta_path.is_file():
        return {}
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path}: invalid JSON at line {e.lineno}: {e.msg}") from e
    if meta.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format_version {meta['format_version']} is newer than this code "
                              f"understands ({FORMAT_VERSION})")
    return meta


def load_model_checkpoint(model: torch.nn.Module, ckpt_dir: str | os.PathLike) -> None:
    """Collectively load a torch_dist checkpoint (written with any TP/PP) into this rank's shard.

    Every tensor the model asks for must be in the checkpoint (megatron's RAISE_UNEXPECTED names
    the key); extra checkpoint content (e.g. optimizer state) is ignored. The loaded tensors are
    copied in with names and shapes checked.
    """
    read_checkpoint_meta(ckpt_dir)
    gpt = model
    while hasattr(gpt, "module") and isinstance(gpt.module, torch.nn.Module):
        gpt = gpt.module
    loaded = dist_checkpointing.load(gpt.sharded_state_dict(), str(ckpt_dir), strict=StrictHandling.RAISE_UNEXPECTED)
    load_megatron_state_dict(gpt, loaded)


# The trainer's model + optimizer state (trainer/state.py): the distributed optimizer's Adam moments and fp32
# main params in megatron's "fully_reshardable" form -- one tensor per parameter with its global shape -- so
# that any TP/PP/DP layout and world size can load them.
RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable"}


def _gpt(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _keeps_step_per_param(o: Any) -> bool:
    """Whether `o`'s inner Adam is torch's, with a `step` in every parameter's state, rather than TE's/apex's
    FusedAdam, which keeps it in the param groups. Decided as megatron decides it, so that what we allocate matches
    the branch its loaders take: DistributedOptimizer by its module's HAVE_APEX_OR_TE (set by its TE/apex import),
    the other wrappers by the USING_PYTORCH_OPTIMIZER that chose the class get_megatron_optimizer built."""
    from megatron.core import optimizer as megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer

    if isinstance(o, distrib_optimizer.DistributedOptimizer):
        return not distrib_optimizer.HAVE_APEX_OR_TE
    return bool(getattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", True))


def _allocate_adam_state(optimizer: Any) -> None:
    """Before `sharded_state_dict(is_loading=True)`, a fresh torch Adam needs its state allocated: megatron's
    DistributedOptimizer.state_dict() (the `not HAVE_APEX_OR_TE` branch) reads one `step` from every parameter's
    state and asserts there is exactly one. So for torch's Adam we allocate what megatron's own load_state_dict
    does in that branch: exp_avg, exp_avg_sq and a per-parameter `step` (loading overwrites all three).

    A fused Adam (TE/apex, every GPU run with Transformer Engine) gets nothing here: it keeps its step in the param
    groups, and TE's FusedAdam.state_dict() unscales every name in a parameter's state through a map that knows only
    exp_avg, exp_avg_sq and master_param (a `step` there was KeyError: 'step' on every GPU resume). megatron
    allocates that state itself, with the dtypes the optimizer was built with: DistributedOptimizer.load_state_dict
    (exp_avg, exp_avg_sq, master_param when precision-aware) and the other wrappers' init_state_fn."""
    for o in _optimizers(optimizer):
        inner = getattr(o, "optimizer", None)
        if inner is None or not _keeps_step_per_param(o):
            continue
        dtypes = getattr(inner, "moment_dtypes", {})  # models/lowp_adam.py: moments kept in bf16
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.tensor(0.0)} | {
                        k: torch.zeros_like(p.data, dtype=dtypes.get(k, p.dtype)) for k in ("exp_avg", "exp_avg_sq")}


def _load_optimizer(optimizer: Any, loaded: Any) -> None:
    """megatron's load, minus one trap: for torch's Adam the distributed optimizer's fully-reshardable loader
    copies every per-parameter state key, `step` included, which that format does not store (KeyError in
    megatron-core 0.16-0.19). The step comes from the param groups; the moments are loaded without it."""
    opts = _optimizers(optimizer)
    states = [loaded] if len(opts) == 1 else [v for _, v in sorted(loaded.items())]
    for o, st in zip(opts, states):
        param_state = st.pop("param_state", None)
        st.pop("param_state_sharding_type", None)
        o.load_state_dict(st)
        inner = getattr(o, "optimizer", None)
        if param_state is not None:
            steps = {p: s.pop("step", None) for p, s in inner.state.items()}
            with torch.no_grad():
                o.load_parameter_state_from_fully_reshardable(param_state)
            for p, s in inner.state.items():
                if steps.get(p) is not None:
                    s["step"] = steps[p]
        unshare_adam_step(o)


def unshare_adam_step(opt: Any) -> None:
    """megatron-core's DistributedOptimizer.load_state_dict (no apex/TE) gives every param one shared `step`
    tensor; torch.optim.Adam then adds 1 per param per step and bias correction goes wrong after a resume.
    Give each param its own copy."""
    for s in getattr(getattr(opt, "optimizer", None), "state", {}).values():
        if isinstance(s.get("step"), torch.Tensor):
            s["step"] = s["step"].clone()


def save_training_state(model: torch.nn.Module, optimizer: Any, ckpt_dir: str | os.PathLike) -> None:
    """Collective: the model and (when given) its optimizer as one torch_dist checkpoint in `ckpt_dir` (an
    existing empty directory), loadable at any layout (load_training_state)."""
    msd = _gpt(model).sharded_state_dict()
    state = {"model": msd}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(msd, is_loading=False, metadata=RESHARDABLE)
    _writer_without_a_server_process()
    forked_helpers_die_with_this_process()
    dist_checkpointing.save(state, str(ckpt_dir))


def load_training_state(model: torch.nn.Module, optimizer: Any, ckpt_dir: str | os.PathLike) -> None:
    """Collective: `save_training_state`'s checkpoint, written at any TP/PP/DP, into this layout's shards."""
    gpt = _gpt(model)
    msd = gpt.sharded_state_dict()
    state = {"model": msd}
    if optimizer is not None:
        _allocate_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(msd, is_loading=True, metadata=RESHARDABLE)
    loaded = dist_checkpointing.load(state, str(ckpt_dir))
    load_megatron_state_dict(gpt, loaded["model"])
    if optimizer is not None:
        _load_optimizer(optimizer, loaded["optimizer"])


def read_weights(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model tensors of a torch_dist checkpoint, whole (global shapes, by megatron's sharded keys), read
    in this process without building a model: for comparing checkpoints."""
    own = not dist.is_initialized()  # torch.distributed.checkpoint wants a group: a private one of one rank
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return {k: v for k, v in dist_checkpointing.load_plain_tensors(str(ckpt_dir)).items()
                if isinstance(v, torch.Tensor) and not k.startswith("optimizer.")}
    finally:
        if own:
            dist.destroy_process_group()


__all__ = ["CheckpointError", "HF_ASSETS_DIR", "META_FILE", "commit_partial", "copy_hf_assets", "hf_config_dict",
           "load_model_checkpoint", "load_training_state", "partial_dir", "prepare_partial",
           "read_checkpoint_meta", "read_weights", "save_model_checkpoint", "save_training_state",
           "unshare_adam_step"]
