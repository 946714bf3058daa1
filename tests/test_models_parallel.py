"""megatron GPTModel on CPU over gloo: HF parity, TP=2 / PP=2 against TP=1, a training step.

Each check runs in spawned ranks (tests/_dist.py); workers return small tensors and the parent
compares them with references computed from the HF model (log_softmax + gather, brute force).
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_distributed

pytestmark = pytest.mark.dist

B, S = 2, 16


def _inputs(vocab: int, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (B, S), generator=g)


def _hf_reference(family: str, overrides: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(HF logits [B, S, V] in float64, next-token logp [B, S-1]) of the tiny model (seed 0)."""
    from megatron_opd.models.tiny import make_tiny_hf_model

    hf = make_tiny_hf_model(family, seed=0, **overrides).double()
    ids = _inputs(hf.config.vocab_size)
    with torch.no_grad():
        logits = hf(ids).logits
    logp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logits, logp


def _build_loaded(family: str, overrides: dict, tp: int, pp: int):
    """Init parallel state and build this rank's GPTModel with the tiny HF weights loaded."""
    from megatron.core import parallel_state as ps

    from megatron_opd.models.gpt import build_gpt_model
    from megatron_opd.models.parallel import init_parallel
    from megatron_opd.models.tiny import make_tiny_hf_model
    from megatron_opd.models.weight_mapping import hf_to_megatron_state_dict, load_megatron_state_dict

    init_parallel(tp=tp, pp=pp)
    hf = make_tiny_hf_model(family, seed=0, **overrides)
    model = build_gpt_model(hf.config)
    sd = hf_to_megatron_state_dict(hf.state_dict(), hf.config, ps.get_tensor_model_parallel_rank(), tp,
                                   ps.get_pipeline_model_parallel_rank(), pp)
    load_megatron_state_dict(model, sd)
    return hf, model


def _gather_vocab(shard: torch.Tensor) -> torch.Tensor:
    from megatron_opd.models.logprobs import default_tp_group

    group = default_tp_group()
    if group is None:
        return shard
    parts = [torch.empty_like(shard) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, -1)


def _logits_case(family: str, overrides: dict, tp: int, pp: int) -> dict:
    """Full-vocab logits and next-token log-probs from a TP x PP model through megatron's pipeline
    schedule; empty dict on non-last PP stages."""
    from megatron_opd.models.logprobs import (default_tp_group, forward_backward, model_vocab_size,
                                              vocab_parallel_token_logprobs)

    hf, model = _build_loaded(family, overrides, tp, pp)
    ids = _inputs(hf.config.vocab_size)
    model.eval()
    got: dict = {}

    def loss_fn(logits: torch.Tensor, mb: dict):
        logp = vocab_parallel_token_logprobs(logits[:, :-1], mb["input_ids"][:, 1:], default_tp_group(),
                                             vocab_size=model_vocab_size(model), chunk_size=5)
        got["logits"] = _gather_vocab(logits.detach())[..., : hf.config.vocab_size]
        return logp.sum(), {"logp": logp.detach()}

    with torch.no_grad():
        out = forward_backward(model, [{"input_ids": ids}], loss_fn, forward_only=True)
    if not out:
        return {}
    return {"logits": got["logits"], "logp": out[0]["logp"]}


def _train_case(family: str, overrides: dict, tp: int, pp: int, steps: int) -> dict:
    """`steps` optimizer steps on a next-token NLL; returns this rank's megatron state dict."""
    from megatron.core import parallel_state as ps

    from megatron_opd.config import OptimConfig
    from megatron_opd.models.logprobs import (default_tp_group, forward_backward, model_vocab_size,
                                              vocab_parallel_token_logprobs)
    from megatron_opd.models.optimizer import optimizer_step, setup_training, unwrap, zero_grads

    hf, model = _build_loaded(family, overrides, tp, pp)
    vocab = model_vocab_size(model)
    # adam_eps well above float noise: with eps=1e-8, Adam turns a ~1e-9 gradient (whose value
    # depends on the all-reduce order) into a full lr-sized update, which no layout can match.
    setup = setup_training(model, OptimConfig(lr=1e-2, clip_grad=1.0, weight_decay=0.01, adam_eps=1e-4,
                                              use_distributed_optimizer=True), total_steps=steps)
    mbs = [{"input_ids": _inputs(hf.config.vocab_size, seed=11 + i)} for i in range(2)]
    losses, norms = [], []

    def loss_fn(logits: torch.Tensor, mb: dict):
        logp = vocab_parallel_token_logprobs(logits[:, :-1], mb["input_ids"][:, 1:], default_tp_group(),
                                             vocab_size=vocab, chunk_size=7)
        loss = -logp.mean()
        return loss, {"loss": loss.detach()}

    for _ in range(steps):
        zero_grads(setup)
        out = forward_backward(setup.model, mbs, loss_fn)
        stats = optimizer_step(setup)
        losses.append([float(o["loss"]) for o in out])
        norms.append(stats["grad_norm"])
    sd = {k: v.detach().clone() for k, v in unwrap(setup.model).state_dict().items()
          if not k.endswith("_extra_state") and v is not None}
    key = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    return {"key": key, "sd": sd, "losses": losses, "grad_norms": norms}


def _extras_case() -> dict:
    """Single-rank checks: right padding leaves log-probs unchanged; forward-only build; shims."""
    from megatron.core.transformer.utils import get_default_causal_mask

    from megatron_opd.models.cpu_compat import apply_cpu_shims
    from megatron_opd.models.gpt import build_forward_only_model
    from megatron_opd.models.logprobs import forward_logprobs
    from megatron_opd.models.weight_mapping import (WeightMappingError, hf_to_megatron_state_dict,
                                                    load_hf_into_megatron, load_megatron_state_dict)

    hf, model = _build_loaded("qwen2", {}, 1, 1)
    ids = _inputs(hf.config.vocab_size)
    n = 10
    padded = ids.clone()
    padded[0, n:] = 0
    with torch.no_grad():
        alone = forward_logprobs(model, ids[:1, :n])[:, : n - 1]
        batch = forward_logprobs(model, padded)[:1, : n - 1]
        full_b = forward_logprobs(model, ids)[1:]
        batch_b = forward_logprobs(model, padded)[1:]
    fo = build_forward_only_model(hf.config)
    load_megatron_state_dict(fo, hf_to_megatron_state_dict(hf.state_dict(), hf.config))
    streamed = build_forward_only_model(hf.config)  # tensor by tensor, emptying the HF dict as it goes
    hf_sd = dict(hf.state_dict())
    load_hf_into_megatron(streamed, hf_sd, hf.config, consume=True)
    got = streamed.state_dict()
    same = all(torch.equal(v, got[k]) for k, v in fo.state_dict().items() if isinstance(v, torch.Tensor))
    short = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    try:
        load_hf_into_megatron(build_forward_only_model(hf.config), short, hf.config)
        missing_error = ""
    except WeightMappingError as e:
        missing_error = str(e)
    with torch.no_grad():
        fo_logp = forward_logprobs(fo, ids)
        tr_logp = forward_logprobs(model, ids)
    return {
        "pad_alone": alone, "pad_batch": batch, "other_full": full_b, "other_batch": batch_b,
        "fo_requires_grad": any(p.requires_grad for p in fo.parameters()), "fo_training": fo.training,
        "fo_logp": fo_logp, "tr_logp": tr_logp, "streamed_same": same, "streamed_left": len(hf_sd),
        "streamed_missing_error": missing_error,
        "shims_twice": [apply_cpu_shims(), apply_cpu_shims()],
        "current_device": str(torch.cuda.current_device()),
        "mask": get_default_causal_mask(3),
    }


def _to_numpy(obj):
    """Tensors -> numpy so results cross the process boundary by value (a tensor would travel as a
    shared-memory handle that dies with the worker)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v) for v in obj)
    return obj


def _to_torch(obj):
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_torch(v) for v in obj]
    return obj


def _suite_worker(rank: int, world: int, tp: int, pp: int, cases: list, train: bool) -> dict:
    """All checks for one (tp, pp) layout in one spawn (a spawn costs ~20-40 s of imports here)."""
    from megatron_opd.models.parallel import destroy_parallel

    try:
        out = {"logits": [_logits_case(f, o, tp, pp) for f, o in cases]}
        if train:
            out["train"] = _train_case(*TRAIN_CASE, tp, pp, 2)
        if tp == pp == 1:
            out["extras"] = _extras_case()
        return _to_numpy(out)
    finally:
        destroy_parallel()


CASES = [
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    ("qwen2", {"vocab_size": 127}),  # odd vocab: TP=2 pads one logits column that must be masked
    ("qwen3", {}),  # per-head q/k RMSNorm, head_dim (24) != hidden / heads (16)
]
TRAIN_CASE = ("qwen2", {"tie_word_embeddings": True})
TP2_CASES = [0, 1, 2, 4, 5]
PP2_CASES = [0, 1, 5]


def _run(world: int, tp: int, pp: int, cases: list, train: bool) -> list[dict]:
    return [_to_torch(r) for r in run_distributed(_suite_worker, world, tp, pp, cases, train)]


@pytest.fixture(scope="module")
def single() -> list[dict]:
    return _run(1, 1, 1, CASES, True)


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return _run(2, 2, 1, [CASES[i] for i in TP2_CASES], True)


@pytest.fixture(scope="module")
def pp2() -> list[dict]:
    return _run(2, 1, 2, [CASES[i] for i in PP2_CASES], True)


def _check_logits(res: dict, case: tuple) -> None:
    ref_logits, ref_logp = _hf_reference(*case)
    torch.testing.assert_close(res["logits"].double(), ref_logits, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(res["logp"].double(), ref_logp, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("i", range(len(CASES)), ids=["qwen2", "qwen2-tied", "llama", "llama3-rope-tied",
                                                       "qwen2-vocab127", "qwen3"])
def test_gpt_matches_hf_single_rank(single: list[dict], i: int) -> None:
    _check_logits(single[0]["logits"][i], CASES[i])


@pytest.mark.parametrize("j", range(len(TP2_CASES)), ids=["qwen2", "qwen2-tied", "llama", "qwen2-vocab127-padded",
                                                          "qwen3"])
def test_tp2_matches_hf_and_tp1(tp2: list[dict], single: list[dict], j: int) -> None:
    i = TP2_CASES[j]
    for res in tp2:  # both TP ranks hold the same (replicated) log-probs
        _check_logits(res["logits"][j], CASES[i])
        torch.testing.assert_close(res["logits"][j]["logp"], single[0]["logits"][i]["logp"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res["logits"][j]["logits"], single[0]["logits"][i]["logits"],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("j", range(len(PP2_CASES)), ids=["qwen2", "qwen2-tied", "qwen3"])
def test_pp2_matches_hf(pp2: list[dict], j: int) -> None:
    first, last = pp2
    assert first["logits"][j] == {}
    _check_logits(last["logits"][j], CASES[PP2_CASES[j]])


def _train_to_hf(results: list[dict], hf_config) -> dict:
    from megatron_opd.models.weight_mapping import megatron_to_hf_state_dict

    return megatron_to_hf_state_dict({tuple(r["train"]["key"]): r["train"]["sd"] for r in results}, hf_config)


def test_right_padding_does_not_change_logprobs(single: list[dict]) -> None:
    x = single[0]["extras"]
    torch.testing.assert_close(x["pad_batch"], x["pad_alone"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x["other_batch"], x["other_full"], atol=1e-6, rtol=1e-5)


def test_forward_only_model_and_cpu_shims(single: list[dict]) -> None:
    x = single[0]["extras"]
    assert x["fo_requires_grad"] is False and x["fo_training"] is False
    torch.testing.assert_close(x["fo_logp"], x["tr_logp"], atol=0, rtol=0)
    assert x["streamed_same"] and x["streamed_left"] == 0  # load_hf_into_megatron == the two-copy path
    assert "model.layers.1.mlp.up_proj.weight" in x["streamed_missing_error"]
    assert x["shims_twice"] == [True, True] and x["current_device"] == "cpu"
    assert torch.equal(x["mask"], torch.tensor([[False, True, True], [False, False, True], [False, False, False]]))


@pytest.mark.parametrize("layout", ["tp2", pytest.param("pp2", marks=pytest.mark.slow)])
def test_training_step_parallel_matches_single_rank(single: list[dict], layout: str, request) -> None:
    from megatron_opd.models.tiny import make_tiny_hf_model

    par_results = request.getfixturevalue(layout)
    hf = make_tiny_hf_model(TRAIN_CASE[0], seed=0, **TRAIN_CASE[1])
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    one = single[0]["train"]
    par = next(r["train"] for r in par_results if r["train"]["losses"][0])  # the last PP stage reports
    for a, b in zip(one["losses"], par["losses"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert one["grad_norms"] == pytest.approx(par["grad_norms"], rel=1e-4)
    assert one["losses"][1][0] < one["losses"][0][0], "loss did not decrease"
    w1, w2 = _train_to_hf(single, hf.config), _train_to_hf(par_results, hf.config)
    for name, w in w1.items():
        torch.testing.assert_close(w2[name], w, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        assert not torch.equal(w, before[name]), f"{name}: unchanged by the optimizer step"
