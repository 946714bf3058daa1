"""The checkpoint converter: CLI validation (in-process), safetensors I/O, rank launching, and the
real HF -> torch_dist(TP=2, PP=2) -> HF round trips (slow: several megatron processes)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_opd.convert import checkpoint as convert
from megatron_opd.models import weight_mapping as wm
from megatron_opd.models.hf_io import LazySafetensors, write_safetensors_shards
from megatron_opd.models.tiny import make_tiny_hf_model

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


def _load_dir(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen")
    make_tiny_hf_model("qwen2", out_dir=d, seed=11)
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return d


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


# ------------------------------------------------------------------------------ fast: validation + I/O

def test_hf_to_mcore_names_bad_tensors_before_starting_ranks(qwen_dir, tmp_path, capsys):
    def reshape(sd):
        sd["model.layers.1.self_attn.v_proj.weight"] = torch.zeros(16, 64)

    bad = _broken_copy(qwen_dir, tmp_path / "bad", reshape)
    t0 = time.monotonic()
    rc = convert.main(["hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "o"), "--tp", "2", "--pp", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and time.monotonic() - t0 < 15  # refused in the parent, no rank spawned
    assert "model.layers.1.self_attn.v_proj.weight: expected shape (32, 64), got (16, 64)" in err
    assert not (tmp_path / "o").exists()

    def drop_and_add(sd):
        del sd["model.norm.weight"]
        sd["model.layers.0.mlp.extra.weight"] = torch.zeros(2)

    bad2 = _broken_copy(qwen_dir, tmp_path / "bad2", drop_and_add)
    rc = convert.main(["hf-to-mcore", "--hf", str(bad2), "--out", str(tmp_path / "o"), "--tp", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and "missing tensors: ['model.norm.weight']" in err
    assert "unexpected tensors: ['model.layers.0.mlp.extra.weight']" in err


def test_hf_to_mcore_input_errors(qwen_dir, tmp_path, capsys):
    rc = convert.main(["hf-to-mcore", "--hf", str(tmp_path), "--out", str(tmp_path / "o"), "--tp", "1"])
    assert rc == 1 and "config.json: not found" in capsys.readouterr().err
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "config.json").write_text((qwen_dir / "config.json").read_text())
    (bin_only / "pytorch_model.bin").write_bytes(b"not read")
    rc = convert.main(["hf-to-mcore", "--hf", str(bin_only), "--out", str(tmp_path / "o"), "--tp", "1"])
    assert rc == 1 and "only pickle .bin weights found" in capsys.readouterr().err
    rc = convert.main(["hf-to-mcore", "--hf", str(qwen_dir), "--out", str(tmp_path / "o"), "--tp", "3"])
    assert rc == 1 and "tp_size=3 does not divide num_attention_heads=4" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep me")
    rc = convert.main(["hf-to-mcore", "--hf", str(qwen_dir), "--out", str(busy), "--tp", "1"])
    assert rc == 1 and "already exists and is not empty" in capsys.readouterr().err
    assert (busy / "x").read_text() == "keep me"
    rc = convert.main(["mcore-to-hf", "--ckpt", str(qwen_dir), "--out", str(tmp_path / "o2")])
    assert rc == 1 and "not a megatron-core distributed checkpoint" in capsys.readouterr().err
    assert convert.main(["hf-to-mcore", "--hf", str(qwen_dir), "--out", str(tmp_path / "o"), "--tp", "0"]) == 2


def test_lazy_reader_and_sharded_writer_round_trip(qwen_dir, tmp_path):
    lazy = LazySafetensors(qwen_dir)
    eager = load_file(str(qwen_dir / "model.safetensors"))
    assert sorted(lazy) == sorted(eager)
    assert lazy.shape_of("model.layers.0.mlp.up_proj.weight") == (160, 64)
    assert lazy.dtype_of("model.embed_tokens.weight") == torch.float32
    items = list(eager.items())
    budget = sum(t.numel() * t.element_size() for _, t in items) // 3  # forces several shards + index
    files = write_safetensors_shards(items, tmp_path, max_shard_bytes=budget)
    assert len(files) >= 3 and all(f.startswith("model-") for f in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(eager) and set(index["weight_map"].values()) == set(files)
    back = LazySafetensors(tmp_path)
    assert sorted(back) == sorted(eager) and all(torch.equal(back[k], v) for k, v in eager.items())
    assert not list(tmp_path.glob(".part-*"))


def _fail_on_rank1(rank: int, world_size: int, job: dict) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if rank == 1:
        raise RuntimeError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever if the launcher did not stop it
    return rank


def test_spawn_ranks_reports_failing_rank_and_stops_the_rest():
    t0 = time.monotonic()
    with pytest.raises(convert.ConvertError, match="(?s)rank 1 failed.*boom on purpose"):
        convert.spawn_ranks(_fail_on_rank1, 2, {})
    assert time.monotonic() - t0 < 120


def test_under_torchrun_world_size_must_match(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(convert.ConvertError, match=r"WORLD_SIZE=2, but --tp \* --pp = 4"):
        convert.run_ranks(_fail_on_rank1, 4, {})


# ----------------------------------------------------------------- slow: the real converter, both ways

@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("family,overrides,load_tp,load_pp", [
    ("qwen2", {}, 1, 1),
    ("llama", {"tie_word_embeddings": True}, 2, 1),
    ("qwen3", {}, 1, 2),
])
def test_round_trip_through_torch_dist_is_bit_identical(tmp_path, capsys, family, overrides, load_tp, load_pp):
    """HF -> torch_dist written by TP=2 x PP=2 ranks -> HF loaded with another layout (resharding)."""
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "hf_back"
    model = make_tiny_hf_model(family, out_dir=src, seed=5, **overrides)
    (src / "tokenizer_config.json").write_text("{}")
    assert convert.main(["hf-to-mcore", "--hf", str(src), "--out", str(ckpt), "--tp", "2", "--pp", "2"]) == 0
    meta = json.loads((ckpt / "megatron_opd.json").read_text())
    assert (meta["writer_tp"], meta["writer_pp"], meta["params_dtype"]) == (2, 2, "float32")
    assert (ckpt / "hf_assets" / "tokenizer_config.json").is_file()
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    rc = convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--tp", str(load_tp),
                       "--pp", str(load_pp), "--verify"])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    original, back = _load_dir(src), _load_dir(out)
    assert sorted(back) == sorted(original) == sorted(wm.hf_param_shapes(model.config))  # no tied lm_head
    for k, v in original.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    verify = json.loads(stdout.split("verify-json: ")[1].splitlines()[0])
    assert verify["ok"] and verify["max_abs_logit_diff"] < 1e-4
    cfg_back = json.loads((out / "config.json").read_text())
    for key in ("model_type", "vocab_size", "num_key_value_heads", "tie_word_embeddings", "intermediate_size"):
        assert cfg_back[key] == model.config.to_dict()[key], key
    assert (out / "tokenizer_config.json").is_file()
