"""HF ``config.json`` -> megatron-core ``TransformerConfig`` plus the ``GPTModel`` constructor kwargs.

Supported families: Qwen2 / Qwen2.5 (``model_type=qwen2``: QKV bias, GQA, tied or untied embeddings),
Qwen3 dense (``model_type=qwen3``: per-head q/k RMSNorm, no QKV bias, explicit ``head_dim``) and
Llama-style (``model_type=llama``: SmolLM2, Llama 3.x incl. ``rope_type=llama3``). Anything in the
HF config that the megatron model would silently compute differently is rejected with a
``HFConfigError`` naming the field, because a model that loads but computes something else is the
worst failure mode for distillation (teacher/student log-probs would be quietly wrong).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_opd.models.weight_mapping import DEFAULT_VOCAB_DIVISIBLE_BY, padded_vocab_size

Family = Literal["qwen2", "qwen3", "llama"]

# megatron-core's RotaryEmbedding._apply_scaling hard-codes these llama3 parameters (only `factor` is
# configurable), so a checkpoint with different values cannot be reproduced.
_MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class HFConfigError(ValueError):
    """An HF config field that the megatron model cannot honour; the message names the field."""


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def family_of(hf_config: Any) -> Family:
    """'qwen2', 'qwen3' or 'llama' from ``model_type``; anything else is an error naming the field."""
    mt = _get(hf_config, "model_type")
    if mt in ("qwen2", "qwen3", "llama"):
        return mt
    if mt == "qwen3_moe":
        raise HFConfigError("model_type: 'qwen3_moe' (mixture of experts) is not supported; dense qwen3 is")
    raise HFConfigError(f"model_type: unsupported {mt!r} (supported: qwen2, qwen3, llama)")


def check_family(expected: str, hf_config: Any, where: str = "the checkpoint") -> None:
    """`model.family` pins the architecture the run was configured for: a checkpoint of another family is
    an error naming both, not a silently different model."""
    if expected == "auto":
        return
    got = family_of(hf_config)
    if got != expected:
        raise HFConfigError(f"model.family: configured {expected!r}, but {where} is model_type {got!r}")


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """Return ``{"rotary_base", "rope_scaling", "rope_scaling_factor"}`` for GPTModel.

    Reads transformers>=5 ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``.
    """
    params = _get(hf_config, "rope_parameters")
    field = "rope_parameters"
    if not params:
        params = dict(_get(hf_config, "rope_scaling") or {})
        field = "rope_scaling"
        if _get(hf_config, "rope_theta") is not None:
            params.setdefault("rope_theta", _get(hf_config, "rope_theta"))
    params = dict(params or {})
    theta = params.get("rope_theta", _get(hf_config, "rope_theta", 10000.0))
    if theta is None or not (float(theta) > 0 and math.isfinite(float(theta))):
        raise HFConfigError(f"{field}.rope_theta: must be a positive finite number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    out: dict[str, Any] = {"rotary_base": int(theta) if float(theta).is_integer() else float(theta),
                           "rope_scaling": False, "rope_scaling_factor": 8.0}
    if rope_type == "default":
        return out
    if rope_type == "llama3":
        for key, fixed in _MEGATRON_LLAMA3_FIXED.items():
            if key in params and float(params[key]) != fixed:
                raise HFConfigError(f"{field}.{key}: megatron-core's llama3 rope scaling fixes it to {fixed}, "
                                    f"got {params[key]}")
        factor = float(params.get("factor", 8.0))
        if not factor > 0:
            raise HFConfigError(f"{field}.factor: must be > 0, got {factor}")
        out.update(rope_scaling=True, rope_scaling_factor=factor)
        return out
    raise HFConfigError(f"{field}.rope_type: unsupported {rope_type!r} (supported: default, llama3)")


def _check_sliding_window(hf_config: Any) -> None:
    if _get(hf_config, "use_sliding_window", False):
        raise HFConfigError("use_sliding_window: sliding-window attention is not supported (set it to false)")
    layer_types = _get(hf_config, "layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        bad = sorted({t for t in layer_types if t != "full_attention"})
        raise HFConfigError(f"layer_types: only full_attention is supported, got {bad}")


def _default_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def transformer_config_from_hf(
    hf_config: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    params_dtype: Optional[torch.dtype] = None,
    fp8: Optional[str] = None,
    sequence_parallel: bool = False,
    recompute_activations: bool | str = False,
    variable_seq_lengths: bool = True,
    make_vocab_size_divisible_by: Optional[int] = None,
    overrides: Optional[dict[str, Any]] = None,
) -> tuple[Any, dict[str, Any]]:
    """Validate ``hf_config`` and return ``(TransformerConfig, GPTModel kwargs)``.

    GPTModel kwargs: vocab_size (padded to a multiple of ``make_vocab_size_divisible_by * tp`` by
    ``weight_mapping.padded_vocab_size``, whose default divisor is used when None, so the model and
    the one weight mapping always agree;
    the logits of the padding columns must be masked, see ``logprobs``), max_sequence_length, position_embedding_type="rope", rotary_base,
    rope_scaling, rope_scaling_factor, share_embeddings_and_output_weights.
    ``fp8`` is a TE recipe name (delayed|tensorwise|mxfp8|blockwise), GPU + Transformer Engine only.
    ``overrides`` sets extra TransformerConfig fields (unknown names are an error).
    """
    family = family_of(hf_config)
    act = _get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"hidden_act: only silu (SwiGLU MLP) is supported, got {act!r}")
    _check_sliding_window(hf_config)
    if family in ("llama", "qwen3"):
        if _get(hf_config, "attention_bias", False):
            raise HFConfigError("attention_bias: attention biases on q/k/v and o_proj are not supported")
    if family == "llama":
        if _get(hf_config, "mlp_bias", False):
            raise HFConfigError("mlp_bias: Llama MLP biases are not supported")
        if int(_get(hf_config, "pretraining_tp", 1) or 1) != 1:
            raise HFConfigError("pretraining_tp: must be 1")

    hidden = int(_get(hf_config, "hidden_size"))
    heads = int(_get(hf_config, "num_attention_heads"))
    kv_heads = int(_get(hf_config, "num_key_value_heads") or heads)
    layers = int(_get(hf_config, "num_hidden_layers"))
    vocab = int(_get(hf_config, "vocab_size"))
    head_dim = _get(hf_config, "head_dim") or hidden // heads
    if heads % kv_heads:
        raise HFConfigError(f"num_key_value_heads: {kv_heads} does not divide num_attention_heads={heads}")
    if tp < 1 or pp < 1:
        raise HFConfigError(f"tensor/pipeline parallel sizes must be >= 1, got tp={tp} pp={pp}")
    if heads % tp:
        raise HFConfigError(f"num_attention_heads: {heads} is not divisible by tensor_model_parallel_size={tp}")
    if kv_heads % tp:
        raise HFConfigError(f"num_key_value_heads: {kv_heads} is not divisible by tensor_model_parallel_size={tp}")
    if make_vocab_size_divisible_by is None:
        make_vocab_size_divisible_by = DEFAULT_VOCAB_DIVISIBLE_BY
    if make_vocab_size_divisible_by < 1:
        raise HFConfigError(f"make_vocab_size_divisible_by: must be >= 1, got {make_vocab_size_divisible_by}")
    if layers % pp:
        raise HFConfigError(f"num_hidden_layers: {layers} is not divisible by pipeline_model_parallel_size={pp}")
    if sequence_parallel and tp == 1:
        raise HFConfigError("sequence_parallel: needs tensor_model_parallel_size > 1")
    if fp8 is not None:
        if fp8 not in ("delayed", "tensorwise", "mxfp8", "blockwise"):
            raise HFConfigError(f"fp8: unknown recipe {fp8!r} (delayed, tensorwise, mxfp8, blockwise)")
        if not torch.cuda.is_available():
            raise HFConfigError("fp8: needs CUDA and Transformer Engine")
    dtype = params_dtype or _default_dtype()
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise HFConfigError(f"params_dtype: unsupported {dtype}")
    eps = float(_get(hf_config, "rms_norm_eps", 1e-6))
    attn_dropout = float(_get(hf_config, "attention_dropout", 0.0) or 0.0)
    rope = rope_settings(hf_config)
    on_gpu = torch.cuda.is_available()

    kwargs: dict[str, Any] = dict(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=int(_get(hf_config, "intermediate_size")),
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=int(head_dim),
        normalization="RMSNorm",
        layernorm_epsilon=eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=(family == "qwen2"),
        qk_layernorm=(family == "qwen3"),
        hidden_dropout=0.0,
        attention_dropout=attn_dropout,
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        variable_seq_lengths=variable_seq_lengths,
        moe_token_dispatcher_type="alltoall",  # dense model; megatron rejects the default with variable_seq_lengths
        init_method_std=float(_get(hf_config, "initializer_range", 0.02) or 0.02),
    )
    if fp8 is not None:
        kwargs.update(fp8="hybrid", fp8_recipe=fp8)
    if recompute_activations == "selective":
        kwargs.update(recompute_granularity="selective")
    elif recompute_activations in (True, "full"):
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute_activations is not False:
        raise HFConfigError(f"recompute_activations: expected false, true, 'selective' or 'full', "
                            f"got {recompute_activations!r}")
    # megatron-core warns "full scope is deprecated" for its own default CUDA-graph scope "full", which
    # it normalises to []: pass [] (no CUDA graphs either way: cuda_graph_impl stays "none"). The field
    # is cuda_graph_modules from 0.19 on (cuda_graph_scope is deprecated there), cuda_graph_scope before.
    fields = TransformerConfig.__dataclass_fields__
    graph_scope_field = "cuda_graph_modules" if "cuda_graph_modules" in fields else "cuda_graph_scope"
    if graph_scope_field in fields:
        kwargs[graph_scope_field] = []
    for key, value in (overrides or {}).items():
        if key not in TransformerConfig.__dataclass_fields__:
            raise HFConfigError(f"overrides.{key}: not a TransformerConfig field")
        kwargs[key] = value
    config = TransformerConfig(**kwargs)

    gpt_kwargs: dict[str, Any] = dict(
        vocab_size=padded_vocab_size(vocab, tp, make_vocab_size_divisible_by),
        max_sequence_length=int(_get(hf_config, "max_position_embeddings")),
        position_embedding_type="rope",
        rotary_base=rope["rotary_base"],
        rope_scaling=rope["rope_scaling"],
        rope_scaling_factor=rope["rope_scaling_factor"],
        share_embeddings_and_output_weights=bool(_get(hf_config, "tie_word_embeddings", False)),
    )
    return config, gpt_kwargs


__all__ = ["HFConfigError", "check_family", "family_of", "rope_settings", "transformer_config_from_hf"]
