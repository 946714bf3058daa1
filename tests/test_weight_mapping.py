"""Pure HF <-> megatron mapping (no model, no processes): round trips, layout, padding, errors."""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_opd.models import weight_mapping as wm
from megatron_opd.models.tiny import make_tiny_hf_model, tiny_hf_config

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it

CASES = {
    "qwen2_untied": ("qwen2", {}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama": ("llama", {}),
    "llama_tied_mha": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "qwen3": ("qwen3", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
}


@functools.lru_cache(maxsize=None)
def _hf(case: str):
    family, overrides = CASES[case]
    model = make_tiny_hf_model(family, seed=3, **overrides)
    return dict(wm.canonical_hf_state_dict(model.state_dict(), model.config)), model.config


def _all_ranks(sd, cfg, tp, pp, **kw):
    return {(t, p): wm.hf_to_megatron_state_dict(sd, cfg, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, **kw)
            for t in range(tp) for p in range(pp)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (2, 1), (1, 4)])
def test_round_trip_is_bit_identical(case, tp, pp):
    sd, cfg = _hf(case)
    ranks = _all_ranks(sd, cfg, tp, pp)
    for (t, p), rsd in ranks.items():  # every rank holds exactly the names/shapes megatron expects
        assert {k: tuple(v.shape) for k, v in rsd.items()} == wm.megatron_param_shapes(cfg, tp, p, pp)
    back = wm.megatron_to_hf_state_dict(ranks, cfg)
    assert list(back) == list(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


@pytest.mark.parametrize("te_names", [False, True])
def test_layer_names_and_te_variant(te_names):
    sd, cfg = _hf("qwen2_tied")
    ranks = _all_ranks(sd, cfg, 1, 2, te_names=te_names)
    first, last = ranks[(0, 0)], ranks[(0, 1)]
    norm = "self_attention.linear_qkv.layer_norm_weight" if te_names else "input_layernorm.weight"
    # pp stage 1 holds HF layers 2,3 as local layers 0,1
    assert torch.equal(last[f"decoder.layers.0.{norm}"], sd["model.layers.2.input_layernorm.weight"])
    assert "decoder.layers.2.self_attention.linear_qkv.weight" not in last
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    # tied + pp>1: the last stage keeps its own copy of the embedding as output_layer
    assert torch.equal(last["output_layer.weight"], sd["model.embed_tokens.weight"])
    single = wm.hf_to_megatron_state_dict(sd, cfg)  # tied + pp=1: no output_layer at all
    assert "output_layer.weight" not in single
    back = wm.megatron_to_hf_state_dict(ranks, cfg)  # te naming detected from the keys
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def test_qkv_is_interleaved_per_query_group_and_sharded_by_group():
    """Brute force the layout from SelfAttention.get_query_key_value_tensors: per group g
    rows [q heads g*qpg .. (g+1)*qpg-1, k_g, v_g], each head `head_dim` rows; TP takes whole groups."""
    sd, cfg = _hf("qwen2_untied")
    hd, nh, ng = 16, 4, 2
    q = sd["model.layers.1.self_attn.q_proj.weight"]
    k = sd["model.layers.1.self_attn.k_proj.weight"]
    v = sd["model.layers.1.self_attn.v_proj.weight"]
    rows = []
    for g in range(ng):
        for h in range(g * nh // ng, (g + 1) * nh // ng):
            rows.append(q[h * hd:(h + 1) * hd])
        rows += [k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    expected = torch.cat(rows)
    full = wm.hf_to_megatron_state_dict(sd, cfg)["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert torch.equal(full, expected)
    for t in range(2):
        shard = wm.hf_to_megatron_state_dict(sd, cfg, tp_rank=t, tp_size=2)
        assert torch.equal(shard["decoder.layers.1.self_attention.linear_qkv.weight"], expected.chunk(2)[t])


def test_fc1_shard_holds_gate_then_up_of_that_rank():
    sd, cfg = _hf("llama")
    gate, up = sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]
    for t in range(2):
        fc1 = wm.hf_to_megatron_state_dict(sd, cfg, tp_rank=t, tp_size=2)["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(fc1[:80], gate[80 * t:80 * (t + 1)]) and torch.equal(fc1[80:], up[80 * t:80 * (t + 1)])
        proj = wm.hf_to_megatron_state_dict(sd, cfg, tp_rank=t, tp_size=2)[
            "decoder.layers.0.self_attention.linear_proj.weight"]
        assert torch.equal(proj, sd["model.layers.0.self_attn.o_proj.weight"][:, 32 * t:32 * (t + 1)])


def test_vocab_padding_round_trips_to_exact_hf_vocab():
    sd, cfg = _hf("qwen2_untied")
    cfg = tiny_hf_config("qwen2", vocab_size=100)
    sd = wm.canonical_hf_state_dict(make_tiny_hf_model("qwen2", vocab_size=100).state_dict(), cfg)
    assert wm.padded_vocab_size(100, 2) == 100 and wm.padded_vocab_size(100, 2, 128) == 256
    assert wm.padded_vocab_size(101, 2) == 102
    ranks = _all_ranks(sd, cfg, 2, 1, make_vocab_size_divisible_by=128)
    emb0, emb1 = ranks[(0, 0)]["embedding.word_embeddings.weight"], ranks[(1, 0)]["embedding.word_embeddings.weight"]
    assert emb0.shape == (128, 64) and torch.equal(emb0[:100], sd["model.embed_tokens.weight"])
    assert torch.count_nonzero(emb0[100:]) == 0 and torch.count_nonzero(emb1) == 0
    back = wm.megatron_to_hf_state_dict(ranks, cfg)
    assert back["model.embed_tokens.weight"].shape == (100, 64) and back["lm_head.weight"].shape == (100, 64)
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def test_hf_side_errors_name_the_tensor():
    sd, cfg = _hf("qwen2_untied")
    missing = {k: v for k, v in sd.items() if k != "model.layers.2.self_attn.k_proj.bias"}
    with pytest.raises(wm.WeightMappingError, match=r"missing tensors: \['model.layers.2.self_attn.k_proj.bias'\]"):
        wm.hf_to_megatron_state_dict(missing, cfg)
    extra = {**sd, "model.layers.9.mlp.up_proj.weight": torch.zeros(160, 64)}
    with pytest.raises(wm.WeightMappingError, match=r"unexpected tensors: \['model.layers.9.mlp.up_proj.weight'\]"):
        wm.hf_to_megatron_state_dict(extra, cfg)
    bad = {**sd, "model.layers.0.mlp.down_proj.weight": torch.zeros(64, 150)}
    with pytest.raises(wm.WeightMappingError,
                       match=r"model.layers.0.mlp.down_proj.weight: expected shape \(64, 160\), got \(64, 150\)"):
        wm.hf_to_megatron_state_dict(bad, cfg)
    tied_sd, tied_cfg = _hf("qwen2_tied")
    wrong_head = {**tied_sd, "lm_head.weight": torch.zeros(128, 64)}
    with pytest.raises(wm.WeightMappingError, match="lm_head.weight: config.tie_word_embeddings=True"):
        wm.hf_to_megatron_state_dict(wrong_head, tied_cfg)
    with pytest.raises(wm.WeightMappingError, match="tp_size=3 does not divide num_attention_heads=4"):
        wm.hf_to_megatron_state_dict(sd, cfg, tp_size=3)
    with pytest.raises(wm.WeightMappingError, match="pp_size=3 does not divide num_hidden_layers=4"):
        wm.hf_to_megatron_state_dict(sd, cfg, pp_size=3)
    with pytest.raises(wm.WeightMappingError, match="model_type"):
        wm.hf_to_megatron_state_dict(sd, {**cfg.to_dict(), "model_type": "gpt2"})


def test_megatron_side_errors_name_rank_and_tensor():
    sd, cfg = _hf("llama")
    ranks = _all_ranks(sd, cfg, 2, 2)
    ranks[(1, 1)] = {k: v for k, v in ranks[(1, 1)].items() if k != "decoder.layers.1.mlp.linear_fc2.weight"}
    with pytest.raises(wm.WeightMappingError,
                       match=r"rank \(tp=1, pp=1\).*missing tensors: \['decoder.layers.1.mlp.linear_fc2.weight'\]"):
        wm.megatron_to_hf_state_dict(ranks, cfg)
    ranks = _all_ranks(sd, cfg, 2, 2)
    ranks[(0, 1)]["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.zeros(63, 64)
    with pytest.raises(wm.WeightMappingError, match=r"linear_qkv.weight: expected shape \(64, 64\), got \(63, 64\)"):
        wm.megatron_to_hf_state_dict(ranks, cfg)
    ranks = _all_ranks(sd, cfg, 2, 2)
    del ranks[(1, 0)]
    with pytest.raises(wm.WeightMappingError, match=r"missing \[\(1, 0\)\]"):
        wm.megatron_to_hf_state_dict(ranks, cfg)
    ranks = _all_ranks(sd, cfg, 2, 2)
    norm = "decoder.layers.0.input_layernorm.weight"
    ranks[(1, 0)][norm] = ranks[(0, 0)][norm] + 1
    with pytest.raises(wm.WeightMappingError, match="input_layernorm.weight .*differs between tp ranks 0 and 1"):
        wm.megatron_to_hf_state_dict(ranks, cfg)
    ranks = _all_ranks(sd, cfg, 1, 1)
    ranks[(0, 0)]["decoder.layers.0.mlp.linear_fc1.bias"] = torch.zeros(320)
    with pytest.raises(wm.WeightMappingError, match=r"unexpected tensors: \['decoder.layers.0.mlp.linear_fc1.bias'\]"):
        wm.megatron_to_hf_state_dict(ranks, cfg)


def test_extra_state_and_module_prefix_are_ignored_on_reverse():
    sd, cfg = _hf("qwen2_tied")
    rsd = wm.hf_to_megatron_state_dict(sd, cfg)
    wrapped = {"module." + k: v for k, v in rsd.items()}
    wrapped["module.decoder.layers.0.mlp.linear_fc1._extra_state"] = None
    back = wm.megatron_to_hf_state_dict({(0, 0): wrapped}, cfg)
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def test_bucket_hf_weights_respects_budget_and_order():
    items = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    buckets = list(wm.bucket_hf_weights(items, bucket_bytes=4 * 25))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(wm.bucket_hf_weights(items, 0))


def test_qwen3_qk_norms_map_to_q_k_layernorm_and_are_required():
    sd, cfg = _hf("qwen3")
    ranks = _all_ranks(sd, cfg, 2, 2)
    for t in range(2):  # replicated on every TP rank; stage 1 holds HF layers 2, 3 as local 0, 1
        assert torch.equal(ranks[(t, 1)]["decoder.layers.1.self_attention.k_layernorm.weight"],
                           sd["model.layers.3.self_attn.k_norm.weight"])
        assert ranks[(t, 0)]["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (24,)
    broken = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.q_norm.weight"}
    with pytest.raises(wm.WeightMappingError, match=r"missing.*model\.layers\.1\.self_attn\.q_norm\.weight"):
        wm.hf_to_megatron_state_dict(broken, cfg)
    with pytest.raises(wm.WeightMappingError, match="attention_bias"):
        wm.ModelDims.from_hf({**cfg.to_dict(), "attention_bias": True})


def test_safetensors_reader_reads_what_safetensors_wrote_and_names_a_bad_file(tmp_path):
    """`SafetensorsReader` (pread, no mmap: the teacher's 7.1 GB checkpoint no longer counts as RSS while it is
    read): the same tensors as safetensors' own loader, cast on read when asked, lazy shapes, `pop` forgets;
    a truncated or foreign file is an error naming the file (and the tensor)."""
    from safetensors.torch import load_file, save_file

    sd = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2).to(torch.bfloat16),
          "empty": torch.zeros(0, 4)}
    save_file(sd, str(tmp_path / "model.safetensors"))
    r = wm.SafetensorsReader(tmp_path)
    want = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(r) == sorted(want) and len(r) == 4 and r.shape_of("a") == (3, 5)
    for k, v in want.items():
        assert r[k].dtype == v.dtype and torch.equal(r[k], v), k
    cast = wm.SafetensorsReader(tmp_path, dtype=torch.bfloat16)
    assert cast["a"].dtype == torch.bfloat16 and torch.equal(cast["a"], want["a"].to(torch.bfloat16))
    assert cast["b"].dtype == torch.int64  # integers are never cast
    assert wm.load_hf_state_dict(tmp_path, torch.bfloat16)["c"].dtype == torch.bfloat16
    cast.pop("a")
    assert "a" not in cast and len(cast) == 3

    data = (tmp_path / "model.safetensors").read_bytes()
    bad = tmp_path / "cut"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(data[:-8])  # the last tensor's data cut short
    cut = wm.SafetensorsReader(bad)
    last = max(cut._index, key=lambda k: cut._index[k][4])
    with pytest.raises(wm.WeightMappingError, match=f"cut/model.safetensors: tensor {last}: file ends"):
        cut[last]
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(wm.WeightMappingError, match="not a safetensors file"):
        wm.SafetensorsReader(bad)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        wm.SafetensorsReader(tmp_path / "cut" / "none")
