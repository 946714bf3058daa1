"""Adam with bf16 moments (models/lowp_adam.py, `optim.exp_avg_dtype` / `optim.exp_avg_sq_dtype`).

The tolerance, stated: with fp32 moments the optimizer is torch's AdamW bit for bit; with bf16 moments each stored
moment is the fp32 one rounded to nearest (relative error <= 2^-9 per store), so an update m/sqrt(v) is off by at
most ~2^-8 of itself, and a weight by at most steps x lr x 2^-8 after `steps` steps (each update is at most lr in
size); the loss after 30 steps on a small least-squares problem stays within 1% of fp32 Adam's. Inside megatron (bf16 weights, fp32 main weights), the moments stay bf16 through steps, a save and a
resume, which resumes the uninterrupted run bit for bit."""

from __future__ import annotations

import pytest
import torch

from _dist import run_distributed
from megatron_opd.models.lowp_adam import AdamWLowPrecisionMoments, moment_bytes


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 40, generator=g)
    y = torch.randn(64, 7, generator=g)
    w0 = [torch.randn(40, 7, generator=g) * 0.1, torch.randn(7, generator=g) * 0.1]
    return x, y, w0


def _train(make_opt, steps: int = 30) -> tuple[list[torch.Tensor], float]:
    x, y, w0 = _problem()
    ws = [w.clone().requires_grad_(True) for w in w0]
    opt = make_opt(ws)
    loss = None
    for _ in range(steps):
        opt.zero_grad()
        loss = ((x @ ws[0] + ws[1] - y) ** 2).mean()
        loss.backward()
        opt.step()
    return [w.detach() for w in ws], float(loss.detach())


KW = dict(lr=3e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)


@pytest.mark.parametrize("chunk", [1 << 22, 37])
def test_fp32_moments_are_torch_adamw_bit_for_bit(chunk):
    ref, ref_loss = _train(lambda ws: torch.optim.AdamW(ws, foreach=False, **KW))
    ours, loss = _train(lambda ws: AdamWLowPrecisionMoments(ws, exp_avg_dtype=torch.float32,
                                                            exp_avg_sq_dtype=torch.float32, chunk=chunk, **KW))
    for a, b in zip(ref, ours):
        assert torch.equal(a, b)
    assert loss == ref_loss


def test_bf16_moments_stay_bf16_and_within_the_stated_tolerance():
    ref, ref_loss = _train(lambda ws: torch.optim.AdamW(ws, foreach=False, **KW))
    opts = []

    def make(ws):
        opts.append(AdamWLowPrecisionMoments(ws, chunk=100, **KW))
        return opts[-1]

    ours, loss = _train(make)
    for st in opts[0].state.values():
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
        assert float(st["step"]) == 30.0
    for a, b in zip(ref, ours):
        assert not torch.equal(a, b)  # the rounding is real...
        assert (a - b).abs().max() <= 30 * KW["lr"] * 2 ** -8  # ...and within the bound
    assert abs(loss - ref_loss) < 0.01 * ref_loss
    assert moment_bytes("bfloat16", "bfloat16") == 4 and moment_bytes("float32", "bfloat16") == 6


def test_moments_loaded_in_fp32_land_in_bf16():
    """torch.optim's load casts every state to the parameter's dtype (fp32 main weights): that would hold fp32
    moments until the next step. A checkpoint written with fp32 moments loads straight into bf16 ones."""
    x, y, w0 = _problem()
    w = w0[0].clone().requires_grad_(True)
    fp32 = torch.optim.AdamW([w], foreach=False, **KW)
    ((x @ w - y) ** 2).mean().backward()
    fp32.step()
    ours = AdamWLowPrecisionMoments([w], **KW)
    ours.load_state_dict(fp32.state_dict())
    assert ours.state[w]["exp_avg"].dtype == ours.state[w]["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(ours.state[w]["exp_avg"], fp32.state[w]["exp_avg"].bfloat16())
    ours.step()
    assert ours.state[w]["exp_avg"].dtype == ours.state[w]["exp_avg_sq"].dtype == torch.bfloat16
    assert float(ours.state[w]["step"]) == 2.0


def _megatron_case(rank: int, world_size: int, ckpt_dir: str, distributed: bool) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_opd.config import OptimConfig
    from megatron_opd.models.checkpoint import load_training_state, save_training_state
    from megatron_opd.models.gpt import build_gpt_model
    from _optim_steps import next_token_step
    from megatron_opd.models.optimizer import setup_training
    from megatron_opd.models.parallel import init_parallel
    from megatron_opd.models.tiny import make_tiny_hf_model
    from megatron_opd.models.weight_mapping import hf_to_megatron_state_dict, load_megatron_state_dict

    init_parallel(tp=1, pp=1, backend="gloo")
    hf = make_tiny_hf_model("qwen2", seed=0, num_hidden_layers=1)
    sd = hf_to_megatron_state_dict(hf.state_dict(), hf.config, 0, 1, 0, 1)
    ids = torch.randint(3, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))

    def build(moments: str):
        model = build_gpt_model(hf.config, params_dtype=torch.bfloat16)
        load_megatron_state_dict(model, sd)
        optim = OptimConfig(lr=1e-2, weight_decay=0.01, adam_eps=1e-4, use_distributed_optimizer=distributed,
                            exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
        return setup_training(model, optim, total_steps=8)

    def train_step(setup) -> None:
        next_token_step(setup, ids)

    def snapshot(setup) -> dict:
        inner = setup.optimizer.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        return {"inner": type(inner).__name__, "lr": [g["lr"] for g in inner.param_groups],
                "state": [{k: v.clone() for k, v in inner.state[p].items()} for p in params],
                "main_params": [p.detach().clone() for p in params],
                "model": [p.detach().clone() for p in setup.model.parameters()]}

    first = build("bfloat16")
    for _ in range(2):
        train_step(first)
    saved = snapshot(first)
    save_training_state(first.model, first.optimizer, ckpt_dir)
    resumed = build("bfloat16")
    load_training_state(resumed.model, resumed.optimizer, ckpt_dir)
    loaded = snapshot(resumed)
    widened = build("float32")  # the same checkpoint read by a run configured with fp32 moments
    load_training_state(widened.model, widened.optimizer, ckpt_dir)
    as_fp32 = snapshot(widened)
    train_step(first)
    train_step(resumed)
    ps.destroy_model_parallel()
    return {"saved": saved, "loaded": loaded, "as_fp32": as_fp32, "after_first": snapshot(first),
            "after_resumed": snapshot(resumed)}


@pytest.mark.dist
@pytest.mark.megatron  # version-sensitive (the AdamW inside megatron's wrappers): the megatron-core 0.19 leg runs it
@pytest.mark.parametrize("distributed", [False, True], ids=["float16-optimizer", "distributed-optimizer"])
def test_bf16_moments_inside_megatron_train_save_and_resume(tmp_path, distributed):
    (tmp_path / "ckpt").mkdir()
    (res,) = run_distributed(_megatron_case, 1, str(tmp_path / "ckpt"), distributed, timeout=300)
    saved, loaded = res["saved"], res["loaded"]
    assert saved["inner"] == loaded["inner"] == "AdamWLowPrecisionMoments"
    assert res["as_fp32"]["inner"] == "AdamW"
    assert saved["lr"] == loaded["lr"] == [1e-2] * len(saved["lr"])
    assert len(saved["state"]) == len(loaded["state"]) > 0
    for a, b, c in zip(saved["state"], loaded["state"], res["as_fp32"]["state"]):
        assert a["exp_avg"].dtype == a["exp_avg_sq"].dtype == b["exp_avg"].dtype == torch.bfloat16
        assert a["exp_avg"].abs().sum() > 0
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a[k], b[k]), k
            assert torch.equal(a[k].float(), c[k].float()), k  # fp32 moments widen exactly
        assert float(a["step"]) == 2.0
    for a, b in zip(saved["main_params"], loaded["main_params"]):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    assert all(p.dtype == torch.bfloat16 for p in res["after_first"]["model"])
    for a, b in zip(res["after_first"]["main_params"], res["after_resumed"]["main_params"]):
        assert torch.equal(a, b)
    for a, b in zip(saved["main_params"], res["after_first"]["main_params"]):
        assert not torch.equal(a, b)  # the third step moved the weights


def _te_host_case(rank: int, world_size: int) -> str:
    import megatron.core.optimizer as mopt

    from megatron_opd.config import OptimConfig
    from megatron_opd.models.optimizer import low_precision_moments

    mopt.USING_PYTORCH_OPTIMIZER = False  # what importing Transformer Engine sets (megatron/core/optimizer/__init__)
    try:
        low_precision_moments(object(), OptimConfig(exp_avg_sq_dtype="bfloat16"))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.megatron
def test_bf16_moments_under_fused_adam_is_a_clear_error():
    (msg,) = run_distributed(_te_host_case, 1, timeout=120)
    assert msg.startswith("optim.exp_avg_sq_dtype: ") and "Transformer Engine" in msg


def test_a_strided_parameter_is_updated_in_place_whole():
    """A parameter that is a strided view (a transposed slice) cannot be cut into flat slices: it is updated whole,
    in place, to the same values as a contiguous copy of it."""
    base = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))
    view = base.t()[:, :4]
    assert not view.is_contiguous()
    grad = torch.randn(view.shape, generator=torch.Generator().manual_seed(2))
    twin = view.clone()
    a, b = AdamWLowPrecisionMoments([view], chunk=7, **KW), AdamWLowPrecisionMoments([twin], chunk=7, **KW)
    view.grad, twin.grad = grad.clone(), grad.clone()
    a.step()
    b.step()
    assert torch.equal(view, twin) and torch.equal(base.t()[:, :4], twin)
