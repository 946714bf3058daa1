"""The local engine's decode levers (rollout/packed.py, rollout/local.py `draw`): packed weights give the
plain model's outputs, follow weight updates between calls and leave the model as it was; the inverse-CDF
sampler draws from the given distribution and never a token without mass."""

from __future__ import annotations

import pytest
import torch

from megatron_opd.models.tiny import make_tiny_hf_model
from megatron_opd.rollout.base import SamplingParams
from megatron_opd.rollout.local import LocalEngine, draw
from megatron_opd.rollout.packed import packed_weights, packing_available

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20]]

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="torch built without oneDNN: the engine decodes unpacked (tested as such)")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@needs_onednn
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_packed_model_matches_plain(dtype, tol):
    model = make_tiny_hf_model("qwen2", seed=0).to(dtype)
    assert packing_available(model)
    ids = torch.tensor([PROMPTS[1], PROMPTS[1][::-1]])
    with torch.no_grad():
        plain = model(ids).logits.float()
        with packed_weights(model, rows=2) as n:
            packed = model(ids).logits.float()
    assert n >= sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                    if name.endswith("proj.weight"))
    scale = plain.abs().max().item()
    assert (packed - plain).abs().max().item() <= tol * max(scale, 1.0)
    assert not any("forward" in vars(m) for m in model.modules()), "forwards restored"


@needs_onednn
def test_packing_restores_forwards_after_an_error():
    model = make_tiny_hf_model("llama", seed=0)
    with pytest.raises(RuntimeError, match="boom"):
        with packed_weights(model, rows=1):
            assert any("forward" in vars(m) for m in model.modules())
            raise RuntimeError("boom")
    assert not any("forward" in vars(m) for m in model.modules())


def test_unpackable_model_runs_unchanged():
    model = make_tiny_hf_model("qwen2", seed=0).to(torch.float16)
    assert not packing_available(model)
    with packed_weights(model, rows=1) as n:
        assert n == 0 and not any("forward" in vars(m) for m in model.modules())


@needs_onednn
def test_engine_packed_equals_unpacked_and_sees_updates():
    """Greedy decoding picks the same tokens packed or not; log-probs agree to fp32 rounding. A weight update
    between calls is what the next call decodes with (the packed copy is per call)."""
    a = LocalEngine(make_tiny_hf_model("qwen2", seed=0), eos_token_ids=[2], pack_weights=True)
    b = LocalEngine(make_tiny_hf_model("qwen2", seed=0), eos_token_ids=[2], pack_weights=False)
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, n=1)
    for step in range(2):
        sa, sb = a.generate(PROMPTS, sp), b.generate(PROMPTS, sp)
        assert [s.response_ids for s in sa] == [s.response_ids for s in sb]
        for x, y in zip(sa, sb):
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
        assert a.last_stats["decode_steps"] >= 1 and a.last_stats["decode_s"] > 0
        new = make_tiny_hf_model("qwen2", seed=7 + step)
        for eng in (a, b):
            eng.update_weights(list(eng_named(new)), version=step + 1)
    fresh = LocalEngine(make_tiny_hf_model("qwen2", seed=8), eos_token_ids=[2], pack_weights=False)
    assert [s.response_ids for s in a.generate(PROMPTS, sp)] == [s.response_ids for s in fresh.generate(PROMPTS, sp)]


def eng_named(model):
    seen = set()
    for n, p in model.state_dict(keep_vars=True).items():
        if isinstance(p, torch.nn.Parameter) and id(p) not in seen:
            seen.add(id(p))
            yield n, p.detach()


def test_draw_follows_the_distribution_and_skips_empty_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]] * 20000)
    gen = torch.Generator().manual_seed(0)
    tok = draw(probs, gen)
    counts = torch.bincount(tok, minlength=6).float() / tok.numel()
    assert counts[[0, 2, 5]].sum() == 0, "a token without mass was drawn"
    assert torch.allclose(counts, probs[0], atol=0.015)
    again = draw(probs[:50], torch.Generator().manual_seed(0))
    assert torch.equal(again, tok[:50]), "seeded draws repeat"


def test_draw_at_the_top_of_the_cdf_takes_the_last_token_with_mass(monkeypatch):
    """A uniform that rounds up to the row's total would fall past the CDF: it lands on the last token with
    mass, never on the zero-probability tail."""

    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda size, **k: torch.ones(size, dtype=k.get("dtype")))  # u == 1 exactly
    assert draw(probs, torch.Generator()).tolist() == [1]


def test_config_key_reaches_the_engine(tmp_path):
    """`rollout.pack_weights` (off by default: config.py says why) is what the trainer's engine decodes with."""
    from megatron_opd.config import load_config
    from megatron_opd.rollout import make_rollout_engine

    model = make_tiny_hf_model("qwen2", seed=0)
    model.save_pretrained(tmp_path / "m")
    for overrides, want in (([], False), (["rollout.pack_weights=true"], True)):
        cfg = load_config(None, [f"model.hf_path={tmp_path / 'm'}", *overrides])
        engine = make_rollout_engine(cfg.rollout, str(tmp_path / "m"), pad_token_id=0)
        assert engine.pack_weights is want
