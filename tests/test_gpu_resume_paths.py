"""Resume paths that only a GPU host takes, run on CPU with faithful stand-ins for what CPU lacks.

1. The optimizer: on a GPU with Transformer Engine, megatron's DistributedOptimizer wraps TE's FusedAdam, whose
   state_dict() knows only exp_avg / exp_avg_sq / master_param per parameter and keeps the step count in the param
   groups. `TEFusedAdamStandIn` is that optimizer on CPU; megatron's own switches (the module flags that its TE import
   sets) select it, and the save -> load_training_state round trip goes through megatron's real code.
2. The CUDA RNGs: `FakeCudaRng` puts CPU generators where torch keeps the CUDA ones, so torch.cuda.random's own
   get/set functions run (their device indexing included) on a host with any number of "visible GPUs".
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any, Iterable, Optional

import numpy as np
import pytest
import torch

from _dist import run_distributed

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


# -- 1. TE FusedAdam under megatron's DistributedOptimizer ---------------------------------------------------------


class TEFusedAdamStandIn(torch.optim.Optimizer):
    """Transformer Engine's FusedAdam (transformer_engine/pytorch/optimizers/fused_adam.py, TE v2.9) on CPU.

    A subclass of torch.optim.Optimizer, as FusedAdam is: torch.optim.Adam would not do, its __setstate__ (run by
    load_state_dict) reads a per-parameter state["step"], which FusedAdam never has. Mirrored from that file:

    - __init__ (l. 109-216): the keyword signature megatron's get_megatron_optimizer calls (adam_w_mode, ...), the
      defaults {lr, bias_correction, betas, eps, weight_decay} (l. 157-164) and name_to_dtype_map (l. 191-195), the
      only per-parameter state names FusedAdam knows;
    - get_unscaled_state (l. 294-325): `dtype = self.name_to_dtype_map[state_name]`, a KeyError for any other name;
    - set_scaled_state / _initialize_state / initialize_state (l. 327-418): states created by name, exp_avg and
      exp_avg_sq zeroed (master_param only with master_weights);
    - state_dict (l. 420-442): torch's, then get_unscaled_state for every name in each parameter's state: a `step`
      in a parameter's state is a KeyError ('step') there;
    - load_state_dict (l. 444-473): torch's, then each parameter's state rebuilt name by name with set_scaled_state;
    - step (l. 475-...): the step count in the param group (`group["step"]`, l. 495-504, skipping empty groups at
      l. 489), state initialised by initialize_state when empty (l. 543), and the update of TE's multi_tensor_adam
      kernel (transformer_engine/common/multi_tensor/adam.cu l. 124-142: L2 mode 0, AdamW mode 1; bias
      corrections l. 581-585).

    Not modelled (raise here): fp16/bf16/fp8 states and their scales, master weights, capturable mode. The math runs
    in torch ops instead of the fused CUDA kernel."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, bias_correction: bool = True,
                 adam_w_mode: bool = True, capturable: bool = False, master_weights: bool = False,
                 master_weight_dtype: torch.dtype = torch.float32, exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32, use_decoupled_grad: bool = False,
                 store_param_remainders: bool = False, set_grad_none: Optional[bool] = None):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if capturable or master_weights or store_param_remainders or use_decoupled_grad or {
                exp_avg_dtype, exp_avg_sq_dtype, master_weight_dtype} != {torch.float32}:
            raise NotImplementedError("TEFusedAdamStandIn models fp32 states without master weights only")
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.master_weights = master_weights
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        state = self.state[param]
        dtype = self.name_to_dtype_map[state_name]
        assert dtype == torch.float32 and state[state_name].dtype == torch.float32
        return state[state_name]

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        assert unscaled_state.dtype == torch.float32
        state = self.state[param]
        if state_name not in state:
            self._initialize_state(param, state_name, False)
        state[state_name].copy_(unscaled_state)

    def _initialize_state(self, param: torch.Tensor, state_name: str, zero_buffer: bool) -> None:
        data = torch.empty_like(param, dtype=self.name_to_dtype_map[state_name])
        if zero_buffer:
            data.zero_()
        self.state[param][state_name] = data

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = False) -> None:
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)

    def state_dict(self) -> dict:
        state_dict = super().state_dict()
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        id_map = dict(zip(ids, (p for g in self.param_groups for p in g["params"])))
        for k, v in state_dict["state"].items():
            if k in id_map:
                state_dict["state"][k] = {name: self.get_unscaled_state(id_map[k], name) for name in v}
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        id_map = dict(zip(ids, (p for g in self.param_groups for p in g["params"])))
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                self.state[param] = {}
                for name in v:
                    if v[name] is not None:
                        self.set_scaled_state(param, name, v[name].float())

    @torch.no_grad()
    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if len(group["params"]) == 0:
                continue
            group["step"] = group["step"] + 1 if "step" in group else 1
            beta1, beta2 = group["betas"]
            bc1, bc2 = (1 - beta1 ** group["step"], 1 - beta2 ** group["step"]) if group["bias_correction"] else (
                1.0, 1.0)
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    self.initialize_state(p)
                if p.grad is None:
                    continue
                g, m, v = p.grad.float(), state["exp_avg"], state["exp_avg_sq"]
                if self.adam_w_mode == 0:
                    g = g + decay * p
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + eps)
                if self.adam_w_mode == 1:
                    update = update + decay * p
                p.sub_(lr * update)
        return loss


def _use_te_fused_adam() -> None:
    """What importing Transformer Engine does to megatron-core 0.16: megatron/core/optimizer/__init__.py takes TE's
    FusedAdam as `Adam` (USING_PYTORCH_OPTIMIZER = False: get_megatron_optimizer builds `Adam(..., adam_w_mode=...)`),
    and distrib_optimizer.py takes it as `Adam` too, setting HAVE_APEX_OR_TE and USING_TE_OPTIMIZER (the branches of
    its state_dict / load_state_dict that keep the step in the param groups)."""
    import megatron.core.optimizer as mopt
    from megatron.core.optimizer import distrib_optimizer

    mopt.Adam, mopt.USING_PYTORCH_OPTIMIZER = TEFusedAdamStandIn, False
    distrib_optimizer.Adam = TEFusedAdamStandIn
    distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER = True, True


def _resume_round_trip(rank: int, world_size: int, ckpt_dir: str, fused: bool, distributed: bool) -> dict:
    """Train 2 steps, save_training_state, build a fresh model + optimizer, load_training_state (a resume), then
    one more step on both. Returns what the parent compares."""
    if fused:
        _use_te_fused_adam()
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
    optim = OptimConfig(lr=1e-2, weight_decay=0.01, adam_eps=1e-4, use_distributed_optimizer=distributed)
    ids = torch.randint(3, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))

    def build():
        model = build_gpt_model(hf.config)
        load_megatron_state_dict(model, sd)
        return setup_training(model, optim, total_steps=8)

    def train_step(setup) -> None:
        next_token_step(setup, ids)

    def snapshot(setup) -> dict:
        inner = setup.optimizer.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        return {"state": [{k: v.clone() for k, v in inner.state[p].items()} for p in params],
                "group_steps": [g.get("step") for g in inner.param_groups],
                "main_params": [p.detach().clone() for p in params]}

    first = build()
    for _ in range(2):
        train_step(first)
    saved = snapshot(first)
    save_training_state(first.model, first.optimizer, ckpt_dir)
    resumed = build()
    load_training_state(resumed.model, resumed.optimizer, ckpt_dir)
    loaded = snapshot(resumed)
    train_step(first)
    train_step(resumed)
    ps.destroy_model_parallel()
    return {"inner": type(first.optimizer.optimizer).__name__, "saved": saved, "loaded": loaded,
            "after_first": snapshot(first)["main_params"], "after_resumed": snapshot(resumed)["main_params"]}


@pytest.mark.dist
@pytest.mark.parametrize("fused,distributed", [(True, True), (True, False), (False, True)],
                         ids=["te-fused-adam", "te-fused-adam-no-distopt", "torch-adamw"])
def test_resume_round_trips_adam_moments_and_step(tmp_path, fused, distributed):
    """A resume (save_training_state -> load_training_state into a fresh optimizer) brings back every parameter's
    Adam moments, the fp32 main params and the step, and the next step matches the uninterrupted run's. With TE's
    FusedAdam (a GPU with Transformer Engine) loading used to raise KeyError: 'step' (a per-parameter `step` put into
    the fresh state, which FusedAdam.state_dict() rejects), through megatron's DistributedOptimizer and its plain fp32
    wrapper alike; torch's AdamW (CPU) keeps its per-parameter step."""
    (tmp_path / "ckpt").mkdir()
    (res,) = run_distributed(_resume_round_trip, 1, str(tmp_path / "ckpt"), fused, distributed, timeout=300)
    assert res["inner"] == ("TEFusedAdamStandIn" if fused else "AdamW")
    saved, loaded = res["saved"], res["loaded"]
    if fused:
        assert saved["group_steps"] == loaded["group_steps"] == [2] * len(saved["group_steps"])
        assert all(set(s) == {"exp_avg", "exp_avg_sq"} for s in loaded["state"])
    else:
        assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} and float(s["step"]) == 2.0 for s in loaded["state"])
    assert len(saved["state"]) == len(loaded["state"]) > 0
    for a, b in zip(saved["state"], loaded["state"]):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
        assert a["exp_avg"].abs().sum() > 0  # trained moments, not zeros on both sides
    for a, b in zip(saved["main_params"], loaded["main_params"]):
        assert torch.equal(a, b)
    for a, b in zip(res["after_first"], res["after_resumed"]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


# -- 2. CUDA RNG states across device counts and layouts ----------------------------------------------------------


class FakeCudaRng:
    """Stands in for CUDA's RNGs on a host where each process sees `n` GPUs and uses device `current`.

    torch keeps one generator per GPU in torch.cuda.default_generators; here they are CPU generators, seeded apart.
    torch.cuda.random's own get_rng_state / set_rng_state / get_rng_state_all / set_rng_state_all / manual_seed then
    run unchanged on them: only the hooks they call are replaced (_lazy_init, _lazy_call made immediate, as on an
    initialised GPU; current_device, device_count, is_initialized). An index past the visible devices raises
    IndexError from `torch.cuda.default_generators[idx]`, as it does on a GPU host."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, n: int, current: int):
        self.gens = tuple(torch.Generator().manual_seed(1000 + i) for i in range(n))
        hooks = {"_lazy_init": lambda: None, "_lazy_call": lambda cb, **kw: cb(), "current_device": lambda: current,
                 "device_count": lambda: n, "is_initialized": lambda: True}
        for name, fn in hooks.items():
            monkeypatch.setattr(torch.cuda.random, name, fn)
        for name in ("current_device", "device_count"):
            monkeypatch.setattr(torch.cuda, name, hooks[name])
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "default_generators", self.gens)

    def draw(self, device: int) -> None:
        torch.rand(7, generator=self.gens[device])

    def state(self, device: int) -> torch.Tensor:
        return self.gens[device].get_state()


@pytest.fixture
def tracker(monkeypatch):
    """A fresh megatron RNG tracker as get_cuda_rng_tracker() returns it (the process's own is left alone)."""
    from megatron.core.tensor_parallel import random as tp_random

    t = tp_random.CudaRNGStatesTracker()
    monkeypatch.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER", t)
    monkeypatch.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    return t


def _seed_tracker(t: Any, tp_rank: int) -> dict[str, torch.Tensor]:
    """What model_parallel_cuda_manual_seed puts in the tracker (CudaRNGStatesTracker.add: manual_seed, then the
    current device's state), without its reset of the device's own generator."""
    orig = torch.cuda.get_rng_state()
    states = {}
    for name, seed in (("data-parallel-rng", 1234), ("model-parallel-rng", 1234 + 2718 + tp_rank),
                       ("expert-parallel-rng", 1234 + 1024)):
        torch.cuda.manual_seed(seed)
        states[name] = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(orig)
    t.set_states(states)
    return {k: v.clone() for k, v in states.items()}


def _write_rank_files(root, states: list[dict], meta: dict) -> None:
    from megatron_opd.trainer import checkpoint as ck

    d = root / "step_00000001"
    (d / "shared").mkdir(parents=True, exist_ok=True)
    (d / "shared" / "metadata.json").write_text("{}")
    for r, s in enumerate(states):
        torch.save(ck._to_safe(s), d / f"rank{r}.pt")
    (d / "meta.json").write_text(json.dumps({"step": 1, "world_size": len(states), "format": 2, **meta}))
    (root / "latest").write_text("step_00000001\n")


def test_resume_seeing_fewer_gpus_restores_this_ranks_cuda_and_tracker_states(tmp_path, monkeypatch, tracker):
    """Saved by the rank on device 2 of 4 visible GPUs, resumed by a process that sees one: the saved state is this
    device's (torch.cuda.get_rng_state), it lands on the current device, and the tracker's states come back. The
    all-devices list of earlier versions raised IndexError here (set_rng_state_all on device 1 of 1)."""
    from megatron_opd.trainer.checkpoint import CheckpointManager, rng_state, set_rng_state

    gpus = FakeCudaRng(monkeypatch, n=4, current=2)
    seeded = _seed_tracker(tracker, tp_rank=1)
    gpus.draw(2)
    saved_cuda = gpus.state(2).clone()
    mgr = CheckpointManager(tmp_path, world_size=1, layout={"tp": 1, "pp": 1, "dp": 1})
    mgr.save(1, {"rng": rng_state()}, write_shared=lambda d: (d / "metadata.json").write_text("{}"))
    gpus.draw(2)
    tracker.set_states({k: torch.Generator().manual_seed(7).get_state() for k in seeded})  # the run went on

    one = FakeCudaRng(monkeypatch, n=1, current=0)
    _, state, _ = CheckpointManager(tmp_path, world_size=1, layout={"tp": 1, "pp": 1, "dp": 1}).load()
    set_rng_state(state["rng"])
    assert isinstance(state["rng"]["cuda"], torch.Tensor)  # one device's state, not a list of all
    assert torch.equal(one.state(0), saved_cuda)
    got = tracker.get_states()
    assert got.keys() == seeded.keys() and all(torch.equal(got[k], seeded[k]) for k in seeded)


def test_old_checkpoint_with_every_devices_state_loads(tmp_path, monkeypatch, tracker, caplog):
    """A checkpoint of earlier versions (torch.cuda.get_rng_state_all(): one state per visible device, no tracker)
    restores the current device's entry and nothing else; where it has no entry for the current device the CUDA
    state stays as seeded, with a note, and the resume goes on."""
    from megatron_opd.trainer.checkpoint import CheckpointManager, set_rng_state

    writer = FakeCudaRng(monkeypatch, n=4, current=0)
    for i in range(4):
        writer.draw(i)
    all_devices = torch.cuda.get_rng_state_all()
    old = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
           "cuda": all_devices}
    _write_rank_files(tmp_path, [{"rng": old}], {"tp": 1, "pp": 1, "dp": 1})
    seeded = _seed_tracker(tracker, tp_rank=0)
    layout = {"tp": 1, "pp": 1, "dp": 1}

    two = FakeCudaRng(monkeypatch, n=2, current=1)
    untouched = two.state(0).clone()
    set_rng_state(CheckpointManager(tmp_path, layout=layout).load()[1]["rng"])
    assert torch.equal(two.state(1), all_devices[1]) and torch.equal(two.state(0), untouched)
    assert all(torch.equal(tracker.get_states()[k], v) for k, v in seeded.items())  # no tracker in the file: as is

    _write_rank_files(tmp_path, [{"rng": {**old, "cuda": all_devices[:1]}}], {"tp": 1, "pp": 1, "dp": 1})
    eight = FakeCudaRng(monkeypatch, n=8, current=5)
    before = [eight.state(i).clone() for i in range(8)]
    with caplog.at_level(logging.INFO, logger="megatron_opd.checkpoint"):
        set_rng_state(CheckpointManager(tmp_path, layout=layout).load()[1]["rng"])
    assert all(torch.equal(eight.state(i), before[i]) for i in range(8))
    assert "none for the current device 5" in caplog.text


def test_another_layout_keeps_its_own_cuda_and_tracker_seeding(tmp_path, monkeypatch, tracker, caplog):
    """Each rank saves its own CUDA and tracker states. At the writing layout rank 1 gets rank 1's; at another layout
    every rank reads rank 0's file, whose tracker holds TP rank 0's model-parallel stream: the per-rank CUDA and
    tracker states are then dropped (as megatron ignores the RNG state after a TP/PP change) and this layout's own
    seeding stands, while the CPU RNGs still come from rank 0's file."""
    from megatron_opd.trainer.checkpoint import CheckpointManager, rng_state, set_rng_state

    gpus = FakeCudaRng(monkeypatch, n=2, current=0)
    states = []
    for r in range(2):
        _seed_tracker(tracker, tp_rank=r)
        gpus.draw(0)
        states.append({"rng": rng_state()})
    _write_rank_files(tmp_path, states, {"tp": 2, "pp": 1, "dp": 1})

    same = CheckpointManager(tmp_path, rank=1, world_size=2, layout={"tp": 2, "pp": 1, "dp": 1}).load()[1]["rng"]
    assert torch.equal(same["tracker"]["model-parallel-rng"], states[1]["rng"]["tracker"]["model-parallel-rng"])
    assert torch.equal(same["cuda"], states[1]["rng"]["cuda"])

    ours = _seed_tracker(tracker, tp_rank=1)
    gpus.draw(0)
    cuda_before = gpus.state(0).clone()
    with caplog.at_level(logging.INFO, logger="megatron_opd.checkpoint"):
        other = CheckpointManager(tmp_path, rank=1, world_size=2, layout={"tp": 1, "pp": 1, "dp": 2}).load()[1]["rng"]
    assert "cuda" not in other and "tracker" not in other
    assert torch.equal(other["torch"], states[0]["rng"]["torch"])
    set_rng_state(other)
    assert torch.equal(gpus.state(0), cuda_before)
    assert all(torch.equal(tracker.get_states()[k], v) for k, v in ours.items())
    assert torch.equal(torch.get_rng_state(), states[0]["rng"]["torch"])


def test_tracker_states_of_the_other_device_kind_are_not_applied(tmp_path, tracker, caplog):
    """A GPU checkpoint resumed on CPU: the CUDA tracker states would not fit cpu_compat's CPU-generator tracker."""
    from megatron_opd.trainer.checkpoint import rng_state, set_rng_state

    seeded = {"model-parallel-rng": torch.Generator().manual_seed(3).get_state()}
    tracker.set_states(dict(seeded))
    st = rng_state()
    assert st["tracker_kind"] == "cpu" and torch.equal(st["tracker"]["model-parallel-rng"],
                                                        seeded["model-parallel-rng"])
    with caplog.at_level(logging.INFO, logger="megatron_opd.checkpoint"):
        set_rng_state({**st, "tracker": {"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)},
                       "tracker_kind": "cuda"})
    assert torch.equal(tracker.get_states()["model-parallel-rng"], seeded["model-parallel-rng"])
    assert "saved on cuda" in caplog.text
