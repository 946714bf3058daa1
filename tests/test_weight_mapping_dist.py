"""`iter_hf_weights` collectives over real gloo TP x PP groups, without megatron: each rank holds a
stand-in module whose state dict is exactly what `hf_to_megatron_state_dict` gives that rank, so
the children import only torch (fast). The GPTModel version is in test_convert_model.py (slow)."""

from __future__ import annotations

import pytest
import torch

from _dist import run_distributed
from megatron_opd.models import weight_mapping as wm

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


class _RankShard(torch.nn.Module):
    """Quacks like this rank's GPTModel for iter_hf_weights: `state_dict()` and `vocab_size`."""

    def __init__(self, sd: dict, vocab_size: int):
        super().__init__()
        self._sd, self.vocab_size = sd, vocab_size

    def state_dict(self, *args, **kwargs):  # noqa: D102 - megatron names, this rank's shards
        return dict(self._sd)


def _worker(rank: int, world_size: int, tp: int, pp: int, hf_sd: dict, cfg: dict) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        tp_rank, pp_rank = rank % tp, rank // tp  # megatron's order: TP ranks adjacent
        tp_groups = [dist.new_group([p * tp + t for t in range(tp)]) for p in range(pp)]
        pp_groups = [dist.new_group([p * tp + t for p in range(pp)]) for t in range(tp)]
        shard = wm.hf_to_megatron_state_dict(hf_sd, cfg, tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp,
                                             make_vocab_size_divisible_by=8)
        model = _RankShard(shard, wm.padded_vocab_size(cfg["vocab_size"], tp, 8))
        got = list(wm.iter_hf_weights(model, cfg, tp_group=tp_groups[pp_rank], pp_group=pp_groups[tp_rank]))
        buckets = list(wm.bucket_hf_weights(
            wm.iter_hf_weights(model, cfg, tp_groups[pp_rank], pp_groups[tp_rank], dtype=torch.float16), 20_000))
        # compared here: tensors returned through the queue die with the exiting child's shared memory
        return {"names": [n for n, _ in got], "bucketed": [n for b in buckets for n, _ in b],
                "mismatch": [n for n, t in got if n not in hf_sd or not torch.equal(t, hf_sd[n])],
                "fp16": all(t.dtype == torch.float16 for b in buckets for _, t in b)}
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("family,overrides,tp,pp", [
    ("qwen2", {"vocab_size": 100}, 2, 2),  # vocab 100 -> padded to 112: pad rows must not leak out
    ("llama", {"tie_word_embeddings": True}, 2, 2),
    ("qwen3", {"tie_word_embeddings": True}, 2, 2),
])
def test_iter_hf_weights_gathers_exact_hf_state_dict(family, overrides, tp, pp):
    from megatron_opd.models.tiny import make_tiny_hf_model

    hf = make_tiny_hf_model(family, seed=4, **overrides)
    cfg = hf.config.to_dict()
    expected = dict(wm.canonical_hf_state_dict(hf.state_dict(), cfg))
    results = run_distributed(_worker, tp * pp, tp, pp, expected, cfg)
    for rank, r in enumerate(results):  # every rank yields the full model, in HF order
        assert r["names"] == list(expected) == r["bucketed"], rank
        assert r["mismatch"] == [] and r["fp16"], (rank, r["mismatch"])
