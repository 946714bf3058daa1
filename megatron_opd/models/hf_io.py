"""HF directories on disk: lazy safetensors reading and sharded safetensors writing.

Only safetensors are read or written (no pickle): a `.bin`-only directory is an error naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from megatron_opd.models.weight_mapping import bucket_hf_weights

SAFE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class HFDirError(ValueError):
    """An HF directory that cannot be read (missing config/weights, bad index); names the file."""


def load_hf_config(path: str | os.PathLike) -> Any:
    """The transformers config of an HF directory (or of a `config.json` file)."""
    p = Path(path)
    cfg_file = p if p.is_file() else p / "config.json"
    if not cfg_file.is_file():
        raise HFDirError(f"{cfg_file}: not found (an HF model directory needs config.json)")
    try:
        data = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise HFDirError(f"{cfg_file}: invalid JSON at line {e.lineno}: {e.msg}") from e
    return config_from_dict(data, where=str(cfg_file))


def config_from_dict(data: dict[str, Any], where: str = "config") -> Any:
    data = dict(data)
    model_type = data.pop("model_type", None)
    if not model_type:
        raise HFDirError(f"{where}: no model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as e:
        raise HFDirError(f"{where}: model_type {model_type!r}: {e}") from e


class LazySafetensors(Mapping):
    """Read-only name -> tensor mapping over an HF directory's safetensors, loading on access.

    Handles `model.safetensors`, a sharded `model.safetensors.index.json`, or any `*.safetensors`.
    `shape_of(name)` / `dtype_of(name)` read the header only (used to validate before loading).
    """

    def __init__(self, hf_dir: str | os.PathLike):
        d = Path(hf_dir)
        index = d / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise HFDirError(f"{index}: not a safetensors index ({e})") from e
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in d.glob("*.safetensors"))
            weight_map = None
        if not files:
            hint = (" (only pickle .bin weights found; convert them to safetensors first)"
                    if any(d.glob("*.bin")) else "")
            raise HFDirError(f"{d}: no *.safetensors weights{hint}")
        self._handles = {}
        self._where: dict[str, str] = {}
        for f in files:
            if not (d / f).is_file():
                raise HFDirError(f"{index}: lists {f}, which does not exist")
            h = safe_open(str(d / f), framework="pt")
            self._handles[f] = h
            for k in h.keys():
                if k in self._where:
                    raise HFDirError(f"{d}: tensor {k} appears in both {self._where[k]} and {f}")
                if weight_map is None or weight_map.get(k) == f:
                    self._where[k] = f

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def dtype_of(self, name: str) -> torch.dtype:
        code = self._handles[self._where[name]].get_slice(name).get_dtype()
        if code not in SAFE_DTYPES:
            raise HFDirError(f"tensor {name}: unsupported safetensors dtype {code}")
        return SAFE_DTYPES[code]


def write_safetensors_shards(weights: Iterable[tuple[str, torch.Tensor]], out_dir: str | os.PathLike,
                             max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write `(name, tensor)` pairs as HF safetensors: one `model.safetensors`, or numbered shards
    plus `model.safetensors.index.json` when they exceed `max_shard_bytes`. Returns the file names."""
    out = Path(out_dir)
    parts: list[tuple[str, list[str]]] = []
    total = 0
    for i, bucket in enumerate(bucket_hf_weights(weights, max_shard_bytes)):
        tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in bucket}  # own storage: safetensors refuses shared views
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        name = f".part-{i:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        os.chmod(out / name, 0o666 & ~_umask())  # like a normally created file
        parts.append((name, list(tensors)))
    if not parts:
        raise HFDirError("no tensors to write")
    if len(parts) == 1:
        os.replace(out / parts[0][0], out / "model.safetensors")
        return ["model.safetensors"]
    n = len(parts)
    weight_map, files = {}, []
    for i, (tmp, names) in enumerate(parts):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(out / tmp, out / final)
        files.append(final)
        weight_map.update({k: final for k in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
