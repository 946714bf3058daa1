"""THE one HF <-> megatron-core name/shape mapping, for dense Qwen2/Qwen2.5, Qwen3 and Llama-style models.

Used by the checkpoint converter (static per-rank state dicts) and by the live weight sync to
rollout engines (`iter_hf_weights`, which gathers a sharded model into HF-named full tensors).

Megatron-core GPTModel layout (verified against megatron-core 0.16.1):

* `embedding.word_embeddings.weight` / `output_layer.weight`: `[V_pad / tp, H]`, vocab-parallel
  (contiguous row chunks of the padded vocab). With tied embeddings and pp=1 there is no
  `output_layer.weight`; with tied embeddings and pp>1 the last stage holds its own copy.
* `decoder.layers.{i}.self_attention.linear_qkv.weight` (`.bias`): rows are interleaved per query
  group, `[q heads of group g, k_g, v_g]` for g = 0..ng-1 (see `SelfAttention.get_query_key_value_tensors`),
  and TP ranks hold contiguous row chunks of that interleaved tensor (whole groups, as tp | ng).
* `...linear_proj.weight` and `mlp.linear_fc2.weight`: row-parallel, column chunks.
* `mlp.linear_fc1.weight`: each TP rank holds `[gate_shard_r; up_shard_r]`.
* Qwen3's per-head q/k RMSNorms (`self_attn.q_norm` / `k_norm`, `[head_dim]`): replicated, as
  `self_attention.q_layernorm.weight` / `k_layernorm.weight` (local and TE spec alike).
* layer norms: replicated. Local spec: `input_layernorm.weight`, `pre_mlp_layernorm.weight`;
  TE spec (`te_names=True`): fused into `self_attention.linear_qkv.layer_norm_weight` and
  `mlp.linear_fc1.layer_norm_weight`.
* `decoder.layers.{i}` indices are local to the pipeline stage (uniform split of the layers).

Vocab padding is explicit: megatron-core needs the embedding rows divisible by tp; megatron-LM
additionally pads to a multiple of `make_vocab_size_divisible_by * tp` (128 there). We default to
`make_vocab_size_divisible_by=1`, i.e. no padding when tp divides the vocab, because that is what
`models.gpt.build_gpt_model` builds (HF vocab as is), and because padded rows are extra logits that
would enter every softmax unless masked. With padding (explicit `vocab_padded` or divisor) the pad
rows are zero on the way in and dropped on the way out: the HF vocab size always comes back exactly.
The reverse paths read the padded size from the tensors (or `GPTModel.vocab_size`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

__all__ = [
    "WeightMappingError", "ModelDims", "padded_vocab_size", "hf_param_shapes", "megatron_param_shapes",
    "hf_to_megatron_state_dict", "megatron_to_hf_state_dict", "iter_hf_weights", "bucket_hf_weights", "load_hf_state_dict",
    "load_hf_into_megatron", "SafetensorsReader",
    "canonical_hf_state_dict", "check_hf_state_dict", "load_megatron_state_dict",
]

DEFAULT_VOCAB_DIVISIBLE_BY = 1
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
# HF checkpoints from older transformers versions may carry these non-parameter buffers.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightMappingError(ValueError):
    """Missing, extra or mis-shaped tensors, or a config the mapping cannot express; names the tensor."""


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass(frozen=True)
class ModelDims:
    """The architecture numbers the mapping needs, read once from an HF config (object or dict)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelDims":
        model_type = _cfg_get(hf_config, "model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise WeightMappingError(f"config.model_type: {model_type!r} is not supported "
                                     f"(expected one of {SUPPORTED_MODEL_TYPES})")
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if not isinstance(_cfg_get(hf_config, key), int) or _cfg_get(hf_config, key) <= 0:
                raise WeightMappingError(f"config.{key}: expected a positive int, got {_cfg_get(hf_config, key)!r}")
        hidden = _cfg_get(hf_config, "hidden_size")
        heads = _cfg_get(hf_config, "num_attention_heads")
        kv_heads = _cfg_get(hf_config, "num_key_value_heads") or heads
        head_dim = _cfg_get(hf_config, "head_dim") or hidden // heads
        if heads % kv_heads:
            raise WeightMappingError(f"config.num_key_value_heads: {kv_heads} does not divide "
                                     f"num_attention_heads={heads}")
        if model_type == "qwen2":
            qkv_bias = True
        elif model_type == "qwen3":
            if _cfg_get(hf_config, "attention_bias", False):
                raise WeightMappingError("config.attention_bias: True (bias on q/k/v AND o_proj) is not supported")
            qkv_bias = False
        else:
            if _cfg_get(hf_config, "mlp_bias", False):
                raise WeightMappingError("config.mlp_bias: True is not supported (megatron local spec has no MLP bias "
                                         "without biases on every linear)")
            if _cfg_get(hf_config, "attention_bias", False):
                raise WeightMappingError("config.attention_bias: True (bias on q/k/v AND o_proj) is not supported")
            qkv_bias = False
        return cls(model_type=model_type, num_layers=_cfg_get(hf_config, "num_hidden_layers"), hidden_size=hidden,
                   num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   ffn_hidden_size=_cfg_get(hf_config, "intermediate_size"),
                   vocab_size=_cfg_get(hf_config, "vocab_size"),
                   tied=bool(_cfg_get(hf_config, "tie_word_embeddings", False)), qkv_bias=qkv_bias,
                   qk_norm=model_type == "qwen3")

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_rows(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def check_parallel(self, tp_size: int, pp_size: int) -> None:
        """Raise if this model cannot be split `tp_size` x `pp_size` ways the way megatron splits it."""
        if tp_size < 1 or pp_size < 1:
            raise WeightMappingError(f"tp_size/pp_size: must be >= 1, got tp={tp_size} pp={pp_size}")
        problems = []
        if self.num_heads % tp_size:
            problems.append(f"tp_size={tp_size} does not divide num_attention_heads={self.num_heads}")
        if self.num_kv_heads % tp_size:  # megatron can replicate kv heads (tp > ng); build_gpt_model does not
            problems.append(f"tp_size={tp_size} does not divide num_key_value_heads={self.num_kv_heads}")
        if self.ffn_hidden_size % tp_size:
            problems.append(f"tp_size={tp_size} does not divide intermediate_size={self.ffn_hidden_size}")
        if self.num_layers % pp_size:
            problems.append(f"pp_size={pp_size} does not divide num_hidden_layers={self.num_layers}")
        if problems:
            raise WeightMappingError("; ".join(problems))


def padded_vocab_size(vocab_size: int, tp_size: int,
                      make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> int:
    """megatron-LM's rule: round the vocab up to a multiple of `make_vocab_size_divisible_by * tp_size`.

    With the default divisor 1 this is the HF vocab itself whenever tp divides it.
    """
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


# ----------------------------------------------------------------------------------------------- names

def _hf_layer(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {"input_norm": p + "input_layernorm.weight", "post_norm": p + "post_attention_layernorm.weight",
            "q": p + "self_attn.q_proj.weight", "k": p + "self_attn.k_proj.weight", "v": p + "self_attn.v_proj.weight",
            "q_bias": p + "self_attn.q_proj.bias", "k_bias": p + "self_attn.k_proj.bias",
            "v_bias": p + "self_attn.v_proj.bias", "o": p + "self_attn.o_proj.weight",
            "q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight",
            "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight", "down": p + "mlp.down_proj.weight"}


def _mg_layer(i: int, te_names: bool) -> dict[str, str]:
    p = f"decoder.layers.{i}."
    return {"input_norm": p + ("self_attention.linear_qkv.layer_norm_weight" if te_names else "input_layernorm.weight"),
            "post_norm": p + ("mlp.linear_fc1.layer_norm_weight" if te_names else "pre_mlp_layernorm.weight"),
            "qkv": p + "self_attention.linear_qkv.weight", "qkv_bias": p + "self_attention.linear_qkv.bias",
            "proj": p + "self_attention.linear_proj.weight", "fc1": p + "mlp.linear_fc1.weight",
            "q_norm": p + "self_attention.q_layernorm.weight", "k_norm": p + "self_attention.k_layernorm.weight",
            "fc2": p + "mlp.linear_fc2.weight"}


HF_EMBED, HF_NORM, HF_LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
MG_EMBED, MG_NORM = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"
MG_OUTPUT = "output_layer.weight"


def hf_param_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Every HF parameter name -> shape, in HF order, as `save_pretrained` writes them (no tied lm_head)."""
    d = ModelDims.from_hf(hf_config)
    h, kv = d.hidden_size, d.num_kv_heads * d.head_dim
    out: dict[str, tuple[int, ...]] = {HF_EMBED: (d.vocab_size, h)}
    for i in range(d.num_layers):
        n = _hf_layer(i)
        out[n["q"]] = (d.num_heads * d.head_dim, h)
        if d.qkv_bias:
            out[n["q_bias"]] = (d.num_heads * d.head_dim,)
        out[n["k"]] = (kv, h)
        if d.qkv_bias:
            out[n["k_bias"]] = (kv,)
        out[n["v"]] = (kv, h)
        if d.qkv_bias:
            out[n["v_bias"]] = (kv,)
        out[n["o"]] = (h, d.num_heads * d.head_dim)
        if d.qk_norm:
            out[n["q_norm"]] = (d.head_dim,)
            out[n["k_norm"]] = (d.head_dim,)
        out[n["gate"]] = (d.ffn_hidden_size, h)
        out[n["up"]] = (d.ffn_hidden_size, h)
        out[n["down"]] = (h, d.ffn_hidden_size)
        out[n["input_norm"]] = (h,)
        out[n["post_norm"]] = (h,)
    out[HF_NORM] = (h,)
    if not d.tied:
        out[HF_LM_HEAD] = (d.vocab_size, h)
    return out


def megatron_param_shapes(hf_config: Any, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                          te_names: bool = False, vocab_padded: Optional[int] = None,
                          make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> dict[str, tuple[int, ...]]:
    """Every megatron parameter name -> shape held by one (any tp rank, `pp_rank`) rank."""
    d = ModelDims.from_hf(hf_config)
    d.check_parallel(tp_size, pp_size)
    vp = vocab_padded or padded_vocab_size(d.vocab_size, tp_size, make_vocab_size_divisible_by)
    _check_vocab_padded(d, vp, tp_size)
    h, f = d.hidden_size, d.ffn_hidden_size
    out: dict[str, tuple[int, ...]] = {}
    if pp_rank == 0:
        out[MG_EMBED] = (vp // tp_size, h)
    for i in range(d.num_layers // pp_size):
        n = _mg_layer(i, te_names)
        out[n["input_norm"]] = (h,)
        out[n["qkv"]] = (d.qkv_rows // tp_size, h)
        if d.qkv_bias:
            out[n["qkv_bias"]] = (d.qkv_rows // tp_size,)
        out[n["proj"]] = (h, d.num_heads * d.head_dim // tp_size)
        if d.qk_norm:
            out[n["q_norm"]] = (d.head_dim,)
            out[n["k_norm"]] = (d.head_dim,)
        out[n["post_norm"]] = (h,)
        out[n["fc1"]] = (2 * f // tp_size, h)
        out[n["fc2"]] = (h, f // tp_size)
    if pp_rank == pp_size - 1:
        out[MG_NORM] = (h,)
        if not d.tied or pp_size > 1:
            out[MG_OUTPUT] = (vp // tp_size, h)
    return out


def _check_vocab_padded(d: ModelDims, vocab_padded: int, tp_size: int) -> None:
    if vocab_padded < d.vocab_size or vocab_padded % tp_size:
        raise WeightMappingError(f"vocab_padded={vocab_padded}: must be >= config.vocab_size={d.vocab_size} and "
                                 f"divisible by tp_size={tp_size}")


def _check_tensors(sd: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], what: str) -> None:
    """Raise one error listing every missing, extra and mis-shaped tensor of `sd` against `expected`."""
    shape_of = getattr(sd, "shape_of", None) or (lambda k: tuple(sd[k].shape))  # lazy readers skip loading
    missing = [k for k in expected if k not in sd]
    extra = [k for k in sd if k not in expected]
    bad = [f"{k}: expected shape {tuple(expected[k])}, got {tuple(shape_of(k))}"
           for k in expected if k in sd and tuple(shape_of(k)) != tuple(expected[k])]
    if missing or extra or bad:
        parts = []
        if missing:
            parts.append(f"missing tensors: {missing}")
        if extra:
            parts.append(f"unexpected tensors: {extra}")
        if bad:
            parts.append("mis-shaped tensors: " + "; ".join(bad))
        raise WeightMappingError(f"{what}: " + " | ".join(parts))


# ----------------------------------------------------------------------------------------- tensor ops

def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: ModelDims) -> torch.Tensor:
    """Full HF q/k/v (weight `[rows, H]` or bias `[rows]`) -> megatron's per-group interleaved full tensor."""
    tail = q.shape[1:]
    ng, hd = d.num_kv_heads, d.head_dim
    qkv = torch.cat([q.reshape(ng, d.q_per_group, hd, *tail), k.reshape(ng, 1, hd, *tail),
                     v.reshape(ng, 1, hd, *tail)], dim=1)
    return qkv.reshape(d.qkv_rows, *tail)


def _qkv_to_hf(qkv: torch.Tensor, d: ModelDims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tail = qkv.shape[1:]
    ng, hd = d.num_kv_heads, d.head_dim
    g = qkv.reshape(ng, d.q_per_group + 2, hd, *tail)
    q, k, v = torch.split(g, [d.q_per_group, 1, 1], dim=1)
    return (q.reshape(d.num_heads * hd, *tail), k.reshape(ng * hd, *tail), v.reshape(ng * hd, *tail))


def _pad_vocab(w: torch.Tensor, vocab_padded: int) -> torch.Tensor:
    if w.shape[0] == vocab_padded:
        return w
    return torch.cat([w, w.new_zeros(vocab_padded - w.shape[0], *w.shape[1:])], dim=0)


def _shard(t: torch.Tensor, tp_rank: int, tp_size: int, dim: int) -> torch.Tensor:
    return t.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def _fc1_shard(gate: torch.Tensor, up: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    return torch.cat([_shard(gate, tp_rank, tp_size, 0), _shard(up, tp_rank, tp_size, 0)], dim=0)


def _fc1_to_hf(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    halves = [s.chunk(2, dim=0) for s in shards]
    return _cat([g for g, _ in halves], 0), _cat([u for _, u in halves], 0)


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat, except that one part is returned as it is: at TP=1 the live-model export then yields
    views of the model's own parameters, which an in-process engine can share (`LocalEngine.share_weights`)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


# --------------------------------------------------------------------------------------- HF -> megatron

def check_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], hf_config: Any) -> None:
    """Raise naming every missing / unexpected / mis-shaped tensor of `hf_sd` against `hf_config`.

    A mapping with a `shape_of(name)` method (lazy safetensors readers) is checked without loading.
    """
    _check_tensors(canonical_hf_state_dict(hf_sd, hf_config), hf_param_shapes(hf_config), "HF state dict")


def hf_to_megatron_state_dict(hf_sd: Mapping[str, torch.Tensor], hf_config: Any, tp_rank: int = 0, tp_size: int = 1,
                              pp_rank: int = 0, pp_size: int = 1, te_names: bool = False,
                              vocab_padded: Optional[int] = None,
                              make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY
                              ) -> dict[str, torch.Tensor]:
    """The megatron parameters held by rank (`tp_rank`, `pp_rank`), from a full HF state dict.

    `hf_sd` is validated against `hf_config` first (every missing/extra/mis-shaped tensor named).
    A tied checkpoint may carry `lm_head.weight` only if it equals the embedding. Layer indices are
    local to the stage; the vocab is zero-padded to `vocab_padded` (default: `padded_vocab_size`).
    """
    d, hf_sd, vp = _checked_source(hf_sd, hf_config, tp_rank, tp_size, pp_rank, pp_size, vocab_padded,
                                   make_vocab_size_divisible_by)

    return dict(_iter_megatron(hf_sd, d, tp_rank, tp_size, pp_rank, pp_size, te_names, vp))


def _checked_source(hf_sd: Mapping[str, torch.Tensor], hf_config: Any, tp_rank: int, tp_size: int, pp_rank: int,
                    pp_size: int, vocab_padded: Optional[int],
                    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY
                    ) -> tuple[ModelDims, Mapping[str, torch.Tensor], int]:
    """(dims, the canonical HF state dict, the padded vocab) for rank (`tp_rank`, `pp_rank`), every check of
    the layout, the tensors and the padding done: what both HF -> megatron paths start from."""
    d = ModelDims.from_hf(hf_config)
    d.check_parallel(tp_size, pp_size)
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise WeightMappingError(f"rank (tp_rank={tp_rank}, pp_rank={pp_rank}) outside tp={tp_size} x pp={pp_size}")
    canon = canonical_hf_state_dict(hf_sd, hf_config)
    check_hf_state_dict(canon, hf_config)
    vp = vocab_padded or padded_vocab_size(d.vocab_size, tp_size, make_vocab_size_divisible_by)
    _check_vocab_padded(d, vp, tp_size)
    return d, canon, vp


def _iter_megatron(hf_sd: Mapping[str, torch.Tensor], d: ModelDims, tp_rank: int, tp_size: int, pp_rank: int,
                   pp_size: int, te_names: bool, vp: int,
                   consume: Optional[list[dict[str, torch.Tensor]]] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `hf_to_megatron_state_dict`, one layer at a time. `consume`: dicts to pop
    each HF tensor from once the layer using it is done, so that a caller copying the pairs into a model
    holds one layer's converted copies at a time instead of the whole checkpoint twice."""
    def done(*names: str) -> None:
        for sd in consume or ():
            for n in names:
                sd.pop(n, None)

    if pp_rank == 0:
        yield MG_EMBED, _shard(_pad_vocab(hf_sd[HF_EMBED], vp), tp_rank, tp_size, 0)
    per_stage = d.num_layers // pp_size
    for local in range(per_stage):
        hn, mn = _hf_layer(pp_rank * per_stage + local), _mg_layer(local, te_names)
        yield mn["input_norm"], hf_sd[hn["input_norm"]]
        yield mn["qkv"], _shard(_qkv_to_megatron(hf_sd[hn["q"]], hf_sd[hn["k"]], hf_sd[hn["v"]], d), tp_rank, tp_size, 0)
        if d.qkv_bias:
            qkv_b = _qkv_to_megatron(hf_sd[hn["q_bias"]], hf_sd[hn["k_bias"]], hf_sd[hn["v_bias"]], d)
            yield mn["qkv_bias"], _shard(qkv_b, tp_rank, tp_size, 0)
        yield mn["proj"], _shard(hf_sd[hn["o"]], tp_rank, tp_size, 1)
        if d.qk_norm:
            yield mn["q_norm"], hf_sd[hn["q_norm"]]
            yield mn["k_norm"], hf_sd[hn["k_norm"]]
        yield mn["post_norm"], hf_sd[hn["post_norm"]]
        yield mn["fc1"], _fc1_shard(hf_sd[hn["gate"]], hf_sd[hn["up"]], tp_rank, tp_size)
        yield mn["fc2"], _shard(hf_sd[hn["down"]], tp_rank, tp_size, 1)
        done(*hn.values())
    if pp_rank == pp_size - 1:
        yield MG_NORM, hf_sd[HF_NORM]
        if not d.tied:
            yield MG_OUTPUT, _shard(_pad_vocab(hf_sd[HF_LM_HEAD], vp), tp_rank, tp_size, 0)
        elif pp_size > 1:  # megatron keeps a synced copy of the tied embedding on the last stage
            yield MG_OUTPUT, _shard(_pad_vocab(hf_sd[HF_EMBED], vp), tp_rank, tp_size, 0)
    done(*hf_sd.keys())


def canonical_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], hf_config: Any) -> Mapping[str, torch.Tensor]:
    """`hf_sd` as `save_pretrained` would write it: no known buffers, no `lm_head.weight` when tied.

    `model.state_dict()` of a tied HF model contains `lm_head.weight` (the embedding itself); it
    is dropped here, but only if it really equals the embedding, otherwise that is an error.
    """
    d = ModelDims.from_hf(hf_config)
    ignored = [k for k in hf_sd if k.endswith(_IGNORED_HF_SUFFIXES)]
    tied_head = d.tied and HF_LM_HEAD in hf_sd
    if not ignored and not tied_head:
        return hf_sd  # as is: keeps lazy mappings lazy
    if tied_head:
        head, emb = hf_sd[HF_LM_HEAD], (hf_sd[HF_EMBED] if HF_EMBED in hf_sd else None)
        if emb is None or head.shape != emb.shape or not torch.equal(head, emb):
            raise WeightMappingError(f"{HF_LM_HEAD}: config.tie_word_embeddings=True but it differs from {HF_EMBED}")
    drop = set(ignored) | ({HF_LM_HEAD} if tied_head else set())
    return {k: hf_sd[k] for k in hf_sd if k not in drop}


# --------------------------------------------------------------------------------------- megatron -> HF

_EXTRA_STATE = "._extra_state"


def _strip(sd: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Drop `_extra_state` entries (TE/megatron metadata, not weights) and a DDP `module.` prefix."""
    out = {}
    for k, v in sd.items():
        if k.endswith(_EXTRA_STATE) or k == "_extra_state":
            continue
        while k.startswith("module."):
            k = k[len("module."):]
        out[k] = v
    return out


def _detect_te_names(sd: Mapping[str, torch.Tensor]) -> bool:
    return any(k.endswith("linear_qkv.layer_norm_weight") for k in sd)


def megatron_to_hf_state_dict(rank_state_dicts: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
                              hf_config: Any, te_names: Optional[bool] = None) -> dict[str, torch.Tensor]:
    """Full HF state dict (save_pretrained form) from every rank's megatron parameters.

    `rank_state_dicts[(tp_rank, pp_rank)]` must cover the full tp x pp grid. Each rank's dict is
    checked against the expected names/shapes; replicated tensors (layer norms) must agree across
    tp ranks. The padded vocab is read from the tensors and cut back to `config.vocab_size`.
    `te_names=None` detects the TE naming from the keys.
    """
    if not rank_state_dicts:
        raise WeightMappingError("rank_state_dicts: empty")
    keys = set(rank_state_dicts)
    tp_size = 1 + max(t for t, _ in keys)
    pp_size = 1 + max(p for _, p in keys)
    grid = {(t, p) for t in range(tp_size) for p in range(pp_size)}
    if keys != grid:
        raise WeightMappingError(f"rank_state_dicts: expected ranks {sorted(grid)}, missing {sorted(grid - keys)}, "
                                 f"unexpected {sorted(keys - grid)}")
    d = ModelDims.from_hf(hf_config)
    d.check_parallel(tp_size, pp_size)
    sds = {r: _strip(sd) for r, sd in rank_state_dicts.items()}
    if te_names is None:
        te_names = _detect_te_names(sds[(0, 0)])
    first = sds[(0, 0)].get(MG_EMBED)
    if first is None:
        raise WeightMappingError(f"rank (tp=0, pp=0): missing tensors: ['{MG_EMBED}']")
    vp = first.shape[0] * tp_size
    for (t, p), sd in sorted(sds.items()):
        expected = megatron_param_shapes(hf_config, tp_size, p, pp_size, te_names, vocab_padded=vp)
        _check_tensors(sd, expected, f"megatron state dict of rank (tp={t}, pp={p})")

    def shards(pp: int, name: str) -> list[torch.Tensor]:
        return [sds[(t, pp)][name] for t in range(tp_size)]

    def replicated(pp: int, name: str) -> torch.Tensor:
        ts = shards(pp, name)
        for t, x in enumerate(ts[1:], start=1):
            if not torch.equal(x, ts[0]):
                raise WeightMappingError(f"{name} (pp={pp}): replicated tensor differs between tp ranks 0 and {t}")
        return ts[0]

    out: dict[str, torch.Tensor] = {HF_EMBED: torch.cat(shards(0, MG_EMBED), 0)[: d.vocab_size]}
    per_stage = d.num_layers // pp_size
    for p in range(pp_size):
        for local in range(per_stage):
            hn, mn = _hf_layer(p * per_stage + local), _mg_layer(local, te_names)
            _layer_to_hf(lambda n: shards(p, n), lambda n: replicated(p, n), hn, mn, d, out)
    last = pp_size - 1
    out[HF_NORM] = replicated(last, MG_NORM)
    if not d.tied:
        out[HF_LM_HEAD] = torch.cat(shards(last, MG_OUTPUT), 0)[: d.vocab_size]
    return {k: out[k] for k in hf_param_shapes(hf_config)}


def _layer_to_hf(shards, replicated, hn: dict[str, str], mn: dict[str, str], d: ModelDims,
                 out: dict[str, torch.Tensor]) -> None:
    """One decoder layer's HF tensors from its megatron tensors (`shards(name)` -> per-tp-rank list)."""
    out[hn["input_norm"]] = replicated(mn["input_norm"])
    out[hn["q"]], out[hn["k"]], out[hn["v"]] = _qkv_to_hf(torch.cat(shards(mn["qkv"]), 0), d)
    if d.qkv_bias:
        out[hn["q_bias"]], out[hn["k_bias"]], out[hn["v_bias"]] = _qkv_to_hf(torch.cat(shards(mn["qkv_bias"]), 0), d)
    out[hn["o"]] = _cat(shards(mn["proj"]), 1)
    if d.qk_norm:
        out[hn["q_norm"]], out[hn["k_norm"]] = replicated(mn["q_norm"]), replicated(mn["k_norm"])
    out[hn["post_norm"]] = replicated(mn["post_norm"])
    out[hn["gate"]], out[hn["up"]] = _fc1_to_hf(shards(mn["fc1"]))
    out[hn["down"]] = _cat(shards(mn["fc2"]), 1)


# ---------------------------------------------------------------------------------- live model helpers

def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module-style wrappers (they expose `.module`)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def load_megatron_state_dict(model: torch.nn.Module, sd: Mapping[str, torch.Tensor]) -> None:
    """Copy mapped tensors into a (local-rank) GPTModel, naming any missing/extra/mis-shaped tensor.

    `_extra_state` entries of the model are not weights and are not required.
    """
    model = _unwrap(model)
    params = {k: v for k, v in model.state_dict().items() if not k.endswith(_EXTRA_STATE) and v is not None}
    _check_tensors(_strip(sd), {k: tuple(v.shape) for k, v in params.items()}, "loading into GPTModel")
    missing, unexpected = model.load_state_dict(_strip(sd), strict=False)
    leftover = [k for k in missing if not k.endswith(_EXTRA_STATE)]
    if leftover or unexpected:
        raise WeightMappingError(f"loading into GPTModel: missing {leftover}, unexpected {list(unexpected)}")


def load_hf_into_megatron(model: torch.nn.Module, hf_sd: dict[str, torch.Tensor], hf_config: Any, tp_rank: int = 0,
                          tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1, te_names: bool = False,
                          vocab_padded: Optional[int] = None, consume: bool = False) -> None:
    """`load_megatron_state_dict(model, hf_to_megatron_state_dict(hf_sd, ...))`, tensor by tensor: the same
    checks and the same weights, without a whole converted copy of the checkpoint. `consume=True` also empties
    `hf_sd` layer by layer (the caller's dict: pass one nothing else needs). Building the 1.5B bf16 teacher
    so peaks at its weights plus one layer, where the two-copy path held the checkpoint, its converted copy
    and the model (~3 x 3.6 GB)."""
    d, canon, vp = _checked_source(hf_sd, hf_config, tp_rank, tp_size, pp_rank, pp_size, vocab_padded)
    params = {k: v for k, v in _strip(_unwrap(model).state_dict(keep_vars=True)).items() if v is not None}
    want = {k for k in params if not k.endswith(_EXTRA_STATE)}
    pops = None if not consume else [hf_sd] if canon is hf_sd else [hf_sd, canon]
    with torch.no_grad():
        for name, t in _iter_megatron(canon, d, tp_rank, tp_size, pp_rank, pp_size, te_names, vp, consume=pops):
            if name not in want:
                raise WeightMappingError(f"loading into GPTModel: unexpected {name}")
            if tuple(t.shape) != tuple(params[name].shape):
                raise WeightMappingError(f"loading into GPTModel: {name} has shape {tuple(t.shape)}, the model "
                                         f"{tuple(params[name].shape)}")
            params[name].copy_(t)
            want.discard(name)
    if want:
        raise WeightMappingError(f"loading into GPTModel: missing {sorted(want)}")


def iter_hf_weights(model: torch.nn.Module, hf_config: Any, tp_group: Any = None, pp_group: Any = None,
                    te_names: Optional[bool] = None, dtype: Optional[torch.dtype] = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full tensor)` for every HF parameter of a live TP/PP-sharded GPTModel.

    A collective generator: every rank of the tp x pp grid must consume it fully and in step;
    every rank yields the same full tensors (TP shards all-gathered, other stages' layers broadcast
    over `pp_group`), so whichever rank talks to the rollout engine can send them. Groups default to
    megatron's parallel_state groups; `None` sizes of 1 work without torch.distributed. Tensors are
    yielded one HF name at a time (layer by layer), so peak extra memory is one layer; feed the
    generator to `bucket_hf_weights` to batch sends. `dtype` casts the yielded tensors.
    At TP=PP=1 without a cast, every tensor except q/k/v (and their biases) is a view of the model's
    own parameter storage, not a copy: a consumer that keeps tensors beyond the current layer or
    writes them out must copy them (`write_safetensors_shards` does).
    """
    if tp_group is None or pp_group is None:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized():
            tp_group = ps.get_tensor_model_parallel_group() if tp_group is None else tp_group
            pp_group = ps.get_pipeline_model_parallel_group() if pp_group is None else pp_group

    def size_rank(group: Any) -> tuple[int, int]:
        if group is None:
            return 1, 0
        return dist.get_world_size(group), dist.get_rank(group)

    tp_size, _ = size_rank(tp_group)
    pp_size, pp_rank = size_rank(pp_group)
    d = ModelDims.from_hf(hf_config)
    d.check_parallel(tp_size, pp_size)
    gpt = _unwrap(model)
    local = _strip({k: v for k, v in gpt.state_dict(keep_vars=False).items() if v is not None})
    if te_names is None:
        te_names = _detect_te_names(local)
    vp = int(getattr(gpt, "vocab_size", 0)) or None
    expected = megatron_param_shapes(hf_config, tp_size, pp_rank, pp_size, te_names, vocab_padded=vp)
    _check_tensors(local, expected, f"live model (pp_rank={pp_rank})")
    vp = vp or padded_vocab_size(d.vocab_size, tp_size)
    wire_dtype = next(iter(local.values())).dtype

    def gather(name: str, owner: int, shape: tuple[int, ...], tp_gather: bool = True) -> list[torch.Tensor]:
        """TP shards of `name` held by pipeline stage `owner` (only this rank's if not `tp_gather`), on every rank."""
        if pp_rank == owner:
            mine = local[name].detach().contiguous()
        else:
            mine = torch.empty(shape, dtype=wire_dtype, device=_device_of(local))
        if pp_size > 1:
            dist.broadcast(mine, src=dist.get_global_rank(pp_group, owner), group=pp_group)
        if tp_size == 1 or not tp_gather:
            return [mine]
        parts = [torch.empty_like(mine) for _ in range(tp_size)]
        dist.all_gather(parts, mine, group=tp_group)
        return parts

    def stage_shapes(stage: int) -> dict[str, tuple[int, ...]]:
        return megatron_param_shapes(hf_config, tp_size, stage, pp_size, te_names, vocab_padded=vp)

    def emit(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        return name, (t if dtype is None else t.to(dtype))

    shapes0 = stage_shapes(0)
    yield emit(HF_EMBED, _cat(gather(MG_EMBED, 0, shapes0[MG_EMBED]), 0)[: d.vocab_size])
    per_stage = d.num_layers // pp_size
    for stage in range(pp_size):
        sh = stage_shapes(stage)
        for i in range(per_stage):
            hn, mn = _hf_layer(stage * per_stage + i), _mg_layer(i, te_names)
            layer: dict[str, torch.Tensor] = {}
            _layer_to_hf(lambda n: gather(n, stage, sh[n]), lambda n: gather(n, stage, sh[n], False)[0],
                         hn, mn, d, layer)
            for name in _hf_layer_order(hn, d):
                yield emit(name, layer[name])
    last_sh = stage_shapes(pp_size - 1)
    yield emit(HF_NORM, gather(MG_NORM, pp_size - 1, last_sh[MG_NORM], False)[0])
    if not d.tied:
        yield emit(HF_LM_HEAD, _cat(gather(MG_OUTPUT, pp_size - 1, last_sh[MG_OUTPUT]), 0)[: d.vocab_size])


def _hf_layer_order(hn: dict[str, str], d: ModelDims) -> list[str]:
    """One layer's HF names in the order HF modules register them."""
    keys = ["q", "q_bias", "k", "k_bias", "v", "v_bias", "o", "q_norm", "k_norm", "gate", "up", "down", "input_norm",
            "post_norm"]
    skip = (set() if d.qkv_bias else {"q_bias", "k_bias", "v_bias"}) | (set() if d.qk_norm else {"q_norm", "k_norm"})
    return [hn[k] for k in keys if k not in skip]


def _device_of(sd: Mapping[str, torch.Tensor]) -> torch.device:
    return next(iter(sd.values())).device


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


class SafetensorsReader(Mapping):
    """name -> tensor over an HF directory's `*.safetensors`, each tensor read from the file when asked for
    (and cast to `dtype` if floating), nothing mapped.

    Why not safetensors' own `safe_open`/`load_file`: they mmap the file, and every page of it a read touches
    stays in the process's RSS until the file is closed. Reading the 1.5B teacher's fp32 checkpoint (7.1 GB)
    to build it in bf16 so peaked at 3.6 GB of bf16 tensors plus the 7.1 GB mapping (measured: +9.9 GB in
    that one call); read with `pread` into each tensor's own buffer it peaks at the tensors plus one fp32
    tensor. Lazy like `hf_io.LazySafetensors` (`shape_of` reads the header only), and `pop` forgets a tensor,
    so `load_hf_into_megatron(..., consume=True)` streams a checkpoint into a model one layer at a time."""

    def __init__(self, hf_dir: Any, dtype: Optional[torch.dtype] = None):
        files = sorted(Path(hf_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{hf_dir}: no *.safetensors files (expected an HF model directory)")
        self.dtype = dtype
        self._index: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        for f in files:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                try:
                    header = json.loads(fh.read(n))
                except ValueError as e:
                    raise WeightMappingError(f"{f}: not a safetensors file (header: {e})") from None
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                if meta.get("dtype") not in _ST_DTYPES:
                    raise WeightMappingError(f"{f}: tensor {name}: unsupported safetensors dtype {meta.get('dtype')}")
                start, end = meta["data_offsets"]
                self._index[name] = (str(f), meta["dtype"], tuple(meta["shape"]), 8 + n + start, 8 + n + end)

    def __getitem__(self, name: str) -> torch.Tensor:
        path, code, shape, start, end = self._index[name]
        buf = torch.empty(end - start, dtype=torch.uint8)
        view, got = memoryview(buf.numpy()), 0
        fd = os.open(path, os.O_RDONLY)
        try:
            while got < len(view):
                k = os.preadv(fd, [view[got:]], start + got)
                if k == 0:
                    raise WeightMappingError(f"{path}: tensor {name}: file ends before its data (truncated?)")
                got += k
        finally:
            os.close(fd)
        t = buf.view(_ST_DTYPES[code]).reshape(shape)
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._index))

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._index[name][2]

    def pop(self, name: str, default: Any = None) -> Any:
        return default if self._index.pop(name, None) is None else None


def load_hf_state_dict(hf_dir: Any, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory (single file or sharded), read one at a time
    (`SafetensorsReader`). `dtype`: floating tensors are cast as they are read, so a bf16 model built from
    an fp32 checkpoint never holds the whole fp32 copy."""
    reader = SafetensorsReader(hf_dir, dtype)
    return {name: reader[name] for name in reader}


def bucket_hf_weights(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                      ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group `(name, tensor)` pairs into lists of at most `bucket_bytes` (a larger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in weights:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket

