"""The Stable-OPD objective (pure torch: no torch.distributed, no megatron imports). See docs/algorithm.md."""

from megatron_opd.algo.advantages import compute_advantages, discounted_reverse_cumsum, rollout_token_mask
from megatron_opd.algo.aggregation import LOSS_AGG_MODES, aggregate_loss, aggregation_weights, masked_mean
from megatron_opd.algo.golden import forward_kl_topk, gather_at_ids, sft_nll
from megatron_opd.algo.objective import stable_opd_loss
from megatron_opd.algo.policy_loss import PolicyLossOutput, ppo_policy_loss
from megatron_opd.algo.ref_kl import full_kl, full_kl_reference, identity_reduce, kl_estimator

__all__ = [
    "LOSS_AGG_MODES", "PolicyLossOutput", "aggregate_loss", "aggregation_weights", "compute_advantages",
    "discounted_reverse_cumsum", "forward_kl_topk", "full_kl", "full_kl_reference", "gather_at_ids",
    "identity_reduce", "kl_estimator", "masked_mean", "ppo_policy_loss", "rollout_token_mask", "sft_nll",
    "stable_opd_loss",
]
