"""Tiny random-weight HF models built from configs (no downloads): the real architectures at toy
size, for tests, benchmarks and CPU smoke runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

Family = Literal["qwen2", "qwen3", "llama"]


def tiny_hf_config(family: Family = "qwen2", **overrides: Any):
    """A small config of the given family. Defaults exercise GQA, untied embeddings, (Qwen2) QKV bias and
    (Qwen3) q/k norms with a head_dim that is not hidden_size / heads."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if family == "qwen2":
        cfg = Qwen2Config(**{**common, "rope_theta": 10000.0, **overrides})
    elif family == "qwen3":
        cfg = Qwen3Config(**{**common, "rope_theta": 1000000.0, "head_dim": 24, "attention_bias": False, **overrides})
    elif family == "llama":
        cfg = LlamaConfig(**{**common, "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, **overrides})
    else:
        raise ValueError(f"family: unknown {family!r} (expected qwen2, qwen3 or llama)")
    return cfg


def make_tiny_hf_model(family: Family = "qwen2", out_dir: str | Path | None = None, seed: int = 0, **overrides: Any):
    """Build (and optionally save as safetensors to `out_dir`) a random tiny HF causal LM."""
    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF init leaves norms at 1 and biases at 0; randomise so the mapping is tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.02)
    model.eval()
    if out_dir is not None:
        model.save_pretrained(str(out_dir), safe_serialization=True)
    return model
