"""The lean decode step (rollout/lean.py, `rollout.lean_decode`): the HF forward's samples, and its log-probs to
fp32 rounding, on tiny Llama and Qwen2 models in fp32 and bf16, packed or not, with rows finishing early; it
follows weight updates between calls; a model it does not cover is refused under its config key; and a trainer
run with it logs what the HF decode logs.

The log-probs are bit for bit HF's with the main leg's torch 2.13 + transformers 5.24; with torch 2.14 +
transformers 5.19 (the SGLang venv) fp32 ones differed by up to 5e-7 (a different attention kernel on one side),
so the tests allow LOGP_TOL rather than equality."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_opd.models.tiny import make_tiny_hf_model
from megatron_opd.rollout.base import SamplingParams
from megatron_opd.rollout.lean import LeanDecoder, unsupported_reason
from megatron_opd.rollout.local import LocalEngine

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20]]
EOS = list(range(3, 128, 9))  # a dense stop set: rows finish at different steps, so the cache drops rows
LOGP_TOL = 1e-5


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return all(len(x) == len(y) and all(abs(u - v) <= LOGP_TOL for u, v in zip(x, y)) for x, y in zip(a, b))


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _pair(family, dtype, pack, **kw):
    return [LocalEngine(make_tiny_hf_model(family, seed=0, **kw).to(dtype), eos_token_ids=EOS, pack_weights=pack,
                        lean_decode=lean) for lean in (False, True)]


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
def test_lean_step_samples_what_hf_samples(family, dtype, pack):
    if pack and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN: packing is off (the plain case covers the engine)")
    hf, lean = _pair(family, dtype, pack)
    sp = SamplingParams(n=3, max_new_tokens=40, temperature=1.0, seed=5)
    a, b = hf.generate(PROMPTS, sp), lean.generate(PROMPTS, sp)
    lengths = [len(s.response_ids) for s in a]
    assert len(set(lengths)) > 2 and min(lengths) < 40, f"rows should finish at different steps: {lengths}"
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert _close([s.logprobs for s in a], [s.logprobs for s in b])
    assert _close([s.raw_logprobs for s in a], [s.raw_logprobs for s in b])
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
    assert lean.last_stats["decode_steps"] == hf.last_stats["decode_steps"] > 0


def test_lean_step_logits_match_the_hf_forward_at_a_head_dim_apart_from_hidden_over_heads():
    """Teacher-forced: the lean step's logits at each position of a longer continuation equal a full HF forward
    over prompt + continuation (head_dim 24 with 4 heads on hidden 64; the rotary from the model's own module)."""
    model = make_tiny_hf_model("qwen2", seed=3, head_dim=24)
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])
    mask = (torch.arange(5)[None] >= torch.tensor([[2], [0]])).long()
    cont = torch.tensor([[40, 41, 42, 43], [50, 51, 52, 53]])
    from transformers import DynamicCache

    dec = LeanDecoder(model, rows=2, capacity=16, pack=False)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        got = [model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1].float()]
    dec.adopt(cache, mask)
    nxt = pos[:, -1] + 1
    for t in range(cont.shape[1]):
        got.append(dec.step(cont[:, t], nxt + t))
    full_ids, full_mask = torch.cat([ids, cont], 1), torch.cat([mask, torch.ones_like(cont)], 1)
    with torch.no_grad():
        ref = model(input_ids=full_ids, attention_mask=full_mask,
                    position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    for t, logits in enumerate(got):
        assert torch.allclose(logits, ref[:, 4 + t], atol=1e-5), t


def test_lean_engine_follows_weight_updates():
    """The fused / packed copies are made per call: after an update the lean engine samples what a fresh HF
    engine with the new weights samples."""
    _, lean = _pair("qwen2", torch.float32, pack=False)
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, n=1)
    lean.generate(PROMPTS, sp)
    new = make_tiny_hf_model("qwen2", seed=9)
    lean.update_weights([(n, p.detach()) for n, p in new.named_parameters()], version=1)
    fresh = LocalEngine(make_tiny_hf_model("qwen2", seed=9), eos_token_ids=EOS)
    assert [s.response_ids for s in lean.generate(PROMPTS, sp)] == [s.response_ids for s in fresh.generate(PROMPTS, sp)]


def test_a_model_the_lean_step_does_not_cover_is_refused_by_its_key():
    qwen3 = make_tiny_hf_model("qwen3", seed=0)  # q/k norms: not the Llama / Qwen2 layer
    assert "qwen3" in unsupported_reason(qwen3)
    with pytest.raises(ValueError, match=r"rollout\.lean_decode: model_type 'qwen3'"):
        LocalEngine(qwen3, eos_token_ids=[2], lean_decode=True)
    gelu = make_tiny_hf_model("llama", seed=0, hidden_act="gelu")
    assert "SiLU" in unsupported_reason(gelu)
    assert unsupported_reason(make_tiny_hf_model("llama", seed=0)) is None


def test_config_key_reaches_the_engine_and_the_plan(tmp_path):
    """`rollout.lean_decode` is what the trainer's engine decodes with, and the CPU plan counts its fused
    [q; k; v] and [gate; up] copies (without packing, which counts a packed copy of every weight instead)."""
    from megatron_opd.config import load_config
    from megatron_opd.plan import Cluster, arch_from, cpu_device, plan_run
    from megatron_opd.rollout import make_rollout_engine

    make_tiny_hf_model("qwen2", seed=0).save_pretrained(tmp_path / "m")
    student = arch_from(str(tmp_path / "m"), "model")
    for overrides, want in (([], False), (["rollout.lean_decode=true"], True)):
        cfg = load_config(None, [f"model.hf_path={tmp_path / 'm'}", *overrides])
        assert make_rollout_engine(cfg.rollout, str(tmp_path / "m"), pad_token_id=0).lean_decode is want
        rank = plan_run(cfg, Cluster(cpu_device(24), 1), student, None, device="cpu")["ranks"][0]
        fused = [c for c in rank["components"] if c["name"] == "rollout engine fused weights"]
        assert bool(fused) is want
        if want:
            layer = 64 * ((4 + 2 * 2) * 16 + 2 * 160)  # hidden x ((heads + 2 kv_heads) x head_dim + 2 ffn)
            assert fused[0]["gb"] * 1e9 == pytest.approx(4 * layer * 4)


@pytest.mark.megatron
def test_a_trainer_run_logs_the_same_with_the_lean_step(tmp_path):
    """Two stable_opd steps of the tiny pair, seeded: the lean decode gives the HF decode's metrics (rollouts,
    losses, KL: the same samples, behaviour log-probs to fp32 rounding; exactly equal on the main leg)."""
    from _tiny import tiny_setup, train
    from megatron_opd.config import load_config
    from megatron_opd.trainer.logger import read_metrics

    _root, student, teacher, data = tiny_setup(tmp_path / "setup")
    runs = {}
    for lean in (False, True):
        out = tmp_path / f"lean{lean}"
        train(load_config(None, [
            f"model.hf_path={student}", f"teacher.hf_path={teacher}", f"data.train_path={data['train']}",
            "algo.preset=stable_opd", "train.steps=2", "train.prompts_per_step=4", "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=12", "data.shuffle=false", f"logging.out_dir={out}", "logging.progress_bar=false",
            "logging.tensorboard=false", "checkpoint.save_every=10", f"rollout.lean_decode={str(lean).lower()}"]))
        runs[lean] = [r for r in read_metrics(out) if "loss/total_loss" in r]
    assert [r["step"] for r in runs[True]] == [1, 2]
    for a, b in zip(runs[False], runs[True]):
        keys = [k for k in a if not k.startswith(("time/", "mem/", "decode/", "perf/")) and isinstance(a[k], float)]
        same = lambda x, y: x == pytest.approx(y, rel=1e-4, abs=1e-6) or (math.isnan(x) and math.isnan(y))  # noqa: E731
        assert keys and all(same(a[k], b[k]) for k in keys), {k: (a[k], b[k]) for k in keys if not same(a[k], b[k])}


@pytest.mark.slow  # a subprocess with the machine-facts probe (1 GiB copy, GEMMs): the slow CI leg runs it
@pytest.mark.timeout(300)
def test_bench_rollout_decode_variants_prints_every_variant():
    """`benchmarks/bench_rollout.py --decode-variants` runs end to end on the tiny model: a row per decode variant,
    each with its rounds and its ratio to the roofline. Speed is the benchmark's business: no time asserted."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "bench_rollout.py", "--decode-variants", "--model", "tiny", "--threads", "1",
                           "--rounds", "2", "--new-tokens", "6", "--dtype", "float32"],
                          cwd=repo / "benchmarks", capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]  # the header, then a row each
    names = [r.split("|")[1].strip() for r in rows[1:]]
    assert names == ["hf", "hf + packed", "lean", "lean + packed"], proc.stdout
    for r in rows[1:]:
        cells = [c.strip() for c in r.split("|")[1:-1]]
        assert len(cells[2].split(" / ")) == 2 and float(cells[3]) > 0, r
