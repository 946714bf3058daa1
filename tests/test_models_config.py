"""HF config -> megatron TransformerConfig / GPTModel kwargs: mapping and validation (no processes)."""

from __future__ import annotations

import pytest
import torch

from megatron_opd.models.gpt import resolve_layer_spec
from megatron_opd.models.hf_config import (HFConfigError, check_family, family_of, rope_settings,
                                          transformer_config_from_hf)
from megatron_opd.models.tiny import tiny_hf_config

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


def test_qwen2_mapping() -> None:
    hf = tiny_hf_config("qwen2", rope_theta=1000000.0, rms_norm_eps=1e-5)
    cfg, kw = transformer_config_from_hf(hf, tp=2)
    assert family_of(hf) == "qwen2"
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 64, 160)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, 16)
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and cfg.gated_linear_unit
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-5
    assert cfg.activation_func is torch.nn.functional.silu
    assert cfg.tensor_model_parallel_size == 2 and cfg.params_dtype == torch.float32
    assert kw["rotary_base"] == 1000000 and kw["rope_scaling"] is False
    assert kw["position_embedding_type"] == "rope" and kw["share_embeddings_and_output_weights"] is False
    assert kw["vocab_size"] == 128 and kw["max_sequence_length"] == 256


def test_llama_mapping_tied_head_dim_and_llama3_rope() -> None:
    hf = tiny_hf_config("llama", tie_word_embeddings=True, head_dim=32, vocab_size=127,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192})
    cfg, kw = transformer_config_from_hf(hf, tp=2, pp=2, params_dtype=torch.bfloat16)
    assert family_of(hf) == "llama" and not cfg.add_qkv_bias
    assert cfg.kv_channels == 32 and cfg.bf16 and cfg.pipeline_dtype == torch.bfloat16
    assert kw["share_embeddings_and_output_weights"] is True
    assert kw["rope_scaling"] is True and kw["rope_scaling_factor"] == 32.0 and kw["rotary_base"] == 500000
    assert kw["vocab_size"] % 2 == 0 and kw["vocab_size"] >= 127  # padded for the two vocab shards


def test_qwen3_mapping_qk_norm_no_bias_explicit_head_dim() -> None:
    hf = tiny_hf_config("qwen3", tie_word_embeddings=True)
    cfg, kw = transformer_config_from_hf(hf, tp=2)
    assert family_of(hf) == "qwen3" and cfg.qk_layernorm and not cfg.add_qkv_bias
    assert cfg.kv_channels == 24 != cfg.hidden_size // cfg.num_attention_heads
    assert kw["rotary_base"] == 1000000 and kw["share_embeddings_and_output_weights"] is True
    qwen2, _ = transformer_config_from_hf(tiny_hf_config("qwen2"))
    assert not qwen2.qk_layernorm


def test_model_family_pins_the_checkpoint_architecture() -> None:
    check_family("auto", tiny_hf_config("llama"))
    check_family("qwen3", tiny_hf_config("qwen3"))
    with pytest.raises(HFConfigError, match="model.family: configured 'qwen2', but ckpt/ is model_type 'qwen3'"):
        check_family("qwen2", tiny_hf_config("qwen3"), "ckpt/")


def test_legacy_rope_fields_from_a_plain_dict() -> None:
    d = {"model_type": "llama", "rope_theta": 20000.0, "rope_scaling": {"type": "llama3", "factor": 8.0}}
    assert rope_settings(d) == {"rotary_base": 20000, "rope_scaling": True, "rope_scaling_factor": 8.0}
    assert rope_settings({"model_type": "qwen2"})["rotary_base"] == 10000


@pytest.mark.parametrize("family,overrides,kwargs,field", [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, {}, "use_sliding_window"),
    ("qwen2", {"hidden_act": "gelu"}, {}, "hidden_act"),
    ("llama", {"attention_bias": True}, {}, "attention_bias"),
    ("qwen3", {"attention_bias": True}, {}, "attention_bias"),
    ("llama", {"mlp_bias": True}, {}, "mlp_bias"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, {}, "rope_type"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 2.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, {},
     "low_freq_factor"),
    ("qwen2", {}, {"tp": 3}, "num_attention_heads"),
    ("qwen2", {}, {"tp": 4}, "num_key_value_heads"),
    ("qwen2", {}, {"pp": 3}, "num_hidden_layers"),
    ("qwen2", {}, {"sequence_parallel": True}, "sequence_parallel"),
    ("qwen2", {}, {"overrides": {"not_a_field": 1}}, "overrides.not_a_field"),
])
def test_unsupported_fields_are_named(family: str, overrides: dict, kwargs: dict, field: str) -> None:
    hf = tiny_hf_config(family, **overrides)
    with pytest.raises(HFConfigError, match=field):
        transformer_config_from_hf(hf, **kwargs)


def test_unknown_family_and_cpu_only_options() -> None:
    with pytest.raises(HFConfigError, match="model_type"):
        family_of({"model_type": "gpt2"})
    with pytest.raises(HFConfigError, match="qwen3_moe.*mixture of experts"):
        family_of({"model_type": "qwen3_moe"})
    if not torch.cuda.is_available():
        with pytest.raises(HFConfigError, match="fp8"):
            transformer_config_from_hf(tiny_hf_config("qwen2"), fp8="delayed")
        with pytest.raises(ValueError, match="layer_spec=te needs CUDA"):
            resolve_layer_spec("te")
        assert resolve_layer_spec("auto") == "local"
    with pytest.raises(ValueError, match="model.fp8"):
        resolve_layer_spec("local", fp8="delayed")
