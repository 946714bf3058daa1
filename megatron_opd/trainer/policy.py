"""The student and reference policies as megatron-core GPTModel shards, seen through the two
operations the trainer needs: score a batch (forward only) and train on a minibatch.

Both run through megatron's pipeline schedule (`models.logprobs.forward_backward`), so the same code
serves PP=1 and PP>1; per-token quantities are produced on the last pipeline stage only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_opd.config import Config
from megatron_opd.models.dtype import resolve_dtype
from megatron_opd.models.checkpoint import load_training_state, save_training_state, unshare_adam_step
from megatron_opd.models.gpt import build_forward_only_model, build_gpt_model, no_init, resolve_layer_spec
from megatron_opd.models.logprobs import (Companion, default_tp_group, enable_logit_rows, forward_backward,
                                          forward_logits, mask_vocab_padding, vocab_parallel_reduce,
                                          vocab_parallel_token_logprobs)
from megatron_opd.models.optimizer import (grads_finite, optimizer_step, restart_optimizer, setup_training, unwrap,
                                           zero_grads)
from megatron_opd.models.packing import packed_inputs
from megatron_opd.models.parallel import host_group, is_pipeline_last_stage, model_parallel_coords
from megatron_opd.models.weight_mapping import iter_hf_weights, load_hf_into_megatron
from megatron_opd.teacher.megatron import vocab_parallel_topk
from megatron_opd.trainer.batch import TrainBatch, pad_batch, plan_micro_batches, round_up, seq_len_multiple
from megatron_opd.trainer.checkpoint import per_rank_refusal

# (response logp [B, T], response logits [N, V/tp] or None, batch, full logits) -> (loss, float terms)
LossFn = Callable[[torch.Tensor, Optional[torch.Tensor], TrainBatch, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


# Response rows per fp32 log-softmax chunk: bounds the fp32 temporaries to FROZEN_LOGP_CHUNK x V/tp
# (~0.3 GB at V=152k) whatever the batch.
FROZEN_LOGP_CHUNK = 512


class MegatronPolicy:
    """A GPTModel shard for this rank with HF weights loaded; trainable (student) or frozen (reference).

    Logits are only ever computed at response positions (`models.logprobs.enable_logit_rows`; not with
    sequence parallelism, where the full logits are gathered down to those rows instead): every per-token
    quantity here works on `[N, V/tp]` rows, N = the micro-batch's valid response tokens."""

    def __init__(self, hf_config: Any, hf_state_dict: dict[str, torch.Tensor], cfg: Config, *,
                 trainable: bool, total_steps: int = 1, temperature: Optional[float] = None,
                 params_dtype: Optional[str] = None, consume_state: bool = False):
        self.cfg = cfg
        self.hf_config = hf_config
        self.trainable = trainable
        self.dtype = resolve_dtype(params_dtype or cfg.model.params_dtype)
        builder = build_gpt_model if trainable else build_forward_only_model
        model = builder(hf_config, layer_spec=cfg.model.layer_spec, params_dtype=self.dtype,
                        fp8=cfg.model.fp8, sequence_parallel=cfg.parallel.sequence_parallel,
                        recompute_activations=cfg.model.recompute_activations,
                        config_overrides=no_init(model_parallel_coords()[1]))
        _load_hf(model, hf_state_dict, hf_config, consume=consume_state)
        tp_size = model_parallel_coords()[1]
        self.total_steps = total_steps
        self.setup = setup_training(model, cfg.optim, total_steps, check_for_nan_in_grad=False) if trainable else None
        self.model = self.setup.model if trainable else model
        self.device = next(model.parameters()).device
        self.select_rows = enable_logit_rows(self.model)
        self.thd = resolve_layer_spec(cfg.model.layer_spec, cfg.model.fp8) == "te"  # packed rows as THD (else a mask)
        self.tp_group = default_tp_group()
        self.reduce = vocab_parallel_reduce(self.tp_group)
        self.is_last_stage = is_pipeline_last_stage()
        self.vocab_size = int(hf_config.vocab_size)
        # sequence lengths are padded to this (FP8 GEMMs; sequence parallel splits L over TP)
        self.seq_multiple = seq_len_multiple(cfg.model.fp8, tp_size, cfg.parallel.sequence_parallel)
        # Log-probs are those of softmax(logits / T), T = rollout.temperature: the distribution the
        # rollout engine samples from (student, pi_old and the reference; a teacher passes 1.0).
        self.temperature = float(cfg.rollout.temperature if temperature is None else temperature)

    @property
    def dropout_free(self) -> bool:
        """No dropout anywhere: a training-mode forward gives the same log-probs as a scoring one."""
        c = unwrap_config(self.model)
        return not (getattr(c, "hidden_dropout", 0.0) or getattr(c, "attention_dropout", 0.0))

    # -- per-token pieces on the last stage ---------------------------------------------------

    def micro_dict(self, batch: TrainBatch) -> dict[str, Any]:
        """A micro-batch for `models.logprobs.forward_backward`: the batch on this model's device and the
        response positions whose logits are needed (at least one, so the LM head always runs)."""
        batch = batch.to(self.device)
        mb: dict[str, Any] = {"input_ids": batch.tokens, "position_ids": batch.position_ids, "batch": batch}
        if batch.packed:
            mb.update(packed_inputs(batch.segment_ids, thd=self.thd))
        if self.select_rows:
            b_idx, _, pos = batch.response_rows()
            if b_idx.numel() == 0:
                b_idx, pos = b_idx.new_zeros(1), pos.new_zeros(1)
            mb["logit_rows"] = (pos, batch.token_rows(b_idx))
        return mb

    def _rows(self, logits: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[N, V/tp] logits of the N valid response tokens (row-major), from the model's output: already
        those rows with `select_rows` ([1, >=N, V/tp]), else gathered from [B, S, V/tp]."""
        b_idx, _, pos = batch.response_rows()
        if self.select_rows:  # a view, not logits[0]: select/slice backward would zero-fill a whole [N, V] gradient
            flat = logits.view(-1, logits.shape[-1])
            return flat if flat.shape[0] == b_idx.numel() else flat[: b_idx.numel()]
        return logits[batch.token_rows(b_idx), pos]

    def _scatter(self, values: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[N, ...] per-token values -> [B, T, ...] response layout (zeros at padding); differentiable."""
        b_idx, t_idx, _ = batch.response_rows()
        out = values.new_zeros((*batch.response_mask.shape, *values.shape[1:]))
        return out.index_put((b_idx, t_idx), values)

    def _token_logp(self, logits: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """fp32 log-probs [B, T] of the response tokens under softmax(logits / T). The softmax walks
        FROZEN_LOGP_CHUNK rows at a time in fp32 (no whole fp32 copy of the logits); differentiable."""
        return self.rows_token_logp(self._rows(logits, batch), batch, self.temperature)

    def rows_token_logp(self, rows: torch.Tensor, batch: TrainBatch, temperature: float = 1.0) -> torch.Tensor:
        """[B, T] fp32 log-probs of the response tokens from their [N, V/tp] logit rows (see `_rows`)."""
        b_idx, _, pos = batch.response_rows()
        vals = vocab_parallel_token_logprobs(rows, batch.tokens[batch.token_rows(b_idx), pos + 1], self.tp_group,
                                             vocab_size=self.vocab_size, temperature=temperature,
                                             chunk_size=FROZEN_LOGP_CHUNK,
                                             on_nonfinite="return")  # NaN -> every rank skips (train_minibatch)
        return self._scatter(vals, batch)

    def response_logits(self, logits: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[N, V/tp] logits of the N valid response tokens in row-major order (vocab padding masked), divided
        by the temperature T. At T != 1 they are fp32: a bf16 quotient would be rounded by up to 2^-9 of
        each logit, an error in the full KL far above fp32's; at T = 1 they stay in the model's dtype."""
        rows = self._rows(logits, batch)
        if self.temperature != 1.0:
            rows = rows.to(torch.promote_types(rows.dtype, torch.float32)) / self.temperature
        return mask_vocab_padding(rows, self.vocab_size, self.tp_group)

    def topk_logp(self, logits: torch.Tensor, batch: TrainBatch, topk_ids: torch.Tensor) -> torch.Tensor:
        """Student log-probs of the teacher's top-k ids, [B, T, K] in the response layout."""
        b_idx, t_idx, _ = batch.response_rows()
        rows = self._rows(logits, batch)
        ids = topk_ids.to(rows.device)[b_idx, t_idx]
        out = [vocab_parallel_token_logprobs(rows, ids[:, k], self.tp_group, vocab_size=self.vocab_size,
                                             temperature=self.temperature, chunk_size=FROZEN_LOGP_CHUNK,
                                             on_nonfinite="return")
               for k in range(ids.shape[-1])]
        return self._scatter(torch.stack(out, dim=-1), batch)

    @torch.no_grad()
    def score_topk(self, batch: TrainBatch, k: int, rows: torch.Tensor, micro_batch_size: int = 8,
                   id_limit: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (ids [B, T, k] int64, log-probs [B, T, k] float32) of this policy's full-vocab
        distribution at the response positions of the sequences flagged in `rows` [B] (zeros
        elsewhere), sorted by decreasing log-prob; vocab padding ids (and ids >= `id_limit`) never appear. Only the selected
        rows' [n, V/tp] logits are ever converted to fp32. Collective over the TP/PP group; on a
        non-last pipeline stage the result is all zeros (the loss lives on the last stage)."""
        B, T = batch.response_mask.shape
        ids_out = torch.zeros((B, T, k), dtype=torch.long)
        lp_out = torch.zeros((B, T, k), dtype=torch.float32)
        was_training = self.model.training
        self.model.eval()
        try:
            # only the flagged rows are run (every TP/PP rank of a data-parallel group holds the same batch,
            # so all of them skip the same micro-batches)
            picked = [i for i in range(B) if bool(rows[i])]
            for start in range(0, len(picked), micro_batch_size):
                sel = picked[start:start + micro_batch_size]
                mb = batch.select(sel)
                mb = pad_batch(mb, mb.batch_size, round_up(mb.tokens.shape[1], self.seq_multiple))

                def loss_fn(logits: torch.Tensor, mbd: dict, sel: list[int] = sel):
                    mb = mbd["batch"]
                    b_idx, t_idx, _ = mb.response_rows()
                    if b_idx.numel():
                        z = self._rows(logits, mb).float()
                        if self.temperature != 1.0:
                            z = z / self.temperature
                        tid, tlp = vocab_parallel_topk(z, k, self.vocab_size, self.tp_group, id_limit)
                        rows_b = torch.as_tensor(sel)[b_idx.cpu()]
                        ids_out[rows_b, t_idx.cpu()] = tid.cpu()
                        lp_out[rows_b, t_idx.cpu()] = tlp.cpu()
                    return logits.new_zeros(()), {}

                forward_backward(self.model, [self.micro_dict(mb)], loss_fn, forward_only=True)
        finally:
            self.model.train(was_training)
        return ids_out, lp_out

    # -- operations ------------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, batch: TrainBatch, want_logits: bool = False, micro_batch_size: int = 8,
              max_tokens: Optional[int] = None, pack: bool = False) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(logp [B, T] fp32 on the CPU, response logits [N, V/tp] or None) on the last stage; (None, None)
        elsewhere. Forwards of `micro_batch_size` rows, or (`max_tokens`, without `want_logits`) of rows
        grouped by length up to that many padded tokens, or (`pack`) packed into sequences of up to
        `max_tokens` (`batch.plan_micro_batches`; one forward each, so any shape works under pipeline
        parallelism too).

        Memory: `want_logits` keeps [N, V/tp] (`response_logits`: the model's dtype, fp32 at T != 1) for
        all N response tokens of `batch`; the trainer never asks for it (the full KL's reference logits come
        one micro-batch at a time: `micro_response_logits`, or inside the schedule, see `train_minibatch`)."""
        was_training = self.model.training
        self.model.eval()
        logps: list[torch.Tensor] = []
        logits_out: list[torch.Tensor] = []
        B, T = batch.response_mask.shape
        micro = plan_micro_batches(batch, list(range(B)), micro_batch_size=micro_batch_size,
                                   max_tokens=None if want_logits else max_tokens, pack=pack and not want_logits,
                                   seq_multiple=self.seq_multiple)
        try:
            for part in micro:
                def loss_fn(logits: torch.Tensor, mbd: dict):
                    mb = mbd["batch"]
                    logps.append(_pad_t(self._token_logp(logits, mb).cpu(), T)[mb.source_rows.cpu() >= 0])
                    if want_logits:  # model dtype at T = 1: full_kl upcasts chunk by chunk
                        logits_out.append(self.response_logits(logits, mb))
                    return logits.new_zeros(()), {}

                forward_backward(self.model, [self.micro_dict(part)], loss_fn, forward_only=True)
        finally:
            self.model.train(was_training)
        if not self.is_last_stage:
            return None, None
        order = torch.cat([m.source_rows[m.source_rows >= 0] for m in micro])
        logp = torch.empty((B, T), dtype=torch.float32).index_copy_(0, order, torch.cat(logps, 0))
        return logp, (torch.cat(logits_out, 0) if want_logits else None)

    @torch.no_grad()
    def micro_response_logits(self, batch: TrainBatch) -> torch.Tensor:
        """[N, V/tp] response logits (`response_logits`) of one micro-batch, from a direct forward of this
        whole model (PP=1 only): what the trainer calls inside the student's schedule, right before
        the student's forward of the same micro-batch. Only the response rows' logits are computed."""
        was_training = self.model.training
        self.model.eval()
        try:
            mbd = self.micro_dict(batch)
            logits = forward_logits(self.model, mbd["input_ids"], mbd["position_ids"], mbd.get("attention_mask"),
                                    mbd.get("packed_seq_params"), rows=mbd.get("logit_rows"))
            return self.response_logits(logits, mbd["batch"])
        finally:
            self.model.train(was_training)

    def train_minibatch(self, micro_batches: list[TrainBatch], loss_fn: LossFn, want_logits: bool,
                        ref_logits: Optional[Callable[[TrainBatch], torch.Tensor] | "MegatronPolicy"] = None
                        ) -> dict[str, float]:
        """One optimizer step over `micro_batches` (same shape each; gradients accumulate through
        megatron's schedule, which averages the micro-batch losses). A non-finite log-prob, loss or
        gradient skips the update (weights and optimizer state untouched); `update_skipped` and
        `nonfinite_loss` / `nonfinite_grad` report it. Returns the stats of the whole minibatch (every
        micro-batch on every data-parallel rank, merged by `_mean_stats`), the same on each rank.

        `ref_logits(micro_batch)`, if given, is called right before each micro-batch's forward and its
        result set as `micro_batch.ref_logits`. `ref_logits` a frozen policy of this layout (any PP): it
        runs inside this schedule (`models.logprobs.Companion`), each stage forwarding its reference
        layers on the micro-batch right before the student's, so the last stage sets its response logits
        (`response_logits`) one micro-batch at a time. Whichever way they came, a micro-batch's reference
        logits are dropped from it once its loss is computed (autograd holds them until its backward),
        so at most one micro-batch's worth is alive at a time."""
        assert self.setup is not None, "train_minibatch on a frozen policy"
        self.model.train()
        zero_grads(self.setup)
        per_micro: list[dict[str, float]] = []

        def _loss(logits: torch.Tensor, mbd: dict):
            batch: TrainBatch = mbd["batch"]
            logp = self._token_logp(logits, batch)
            if not _inputs_finite(logp, batch):
                per_micro.append({"nonfinite_loss": 1.0})
                batch.ref_logits = None
                return 0.0 * logits.sum(), {}
            resp_logits = self.response_logits(logits, batch) if want_logits else None
            loss, terms = loss_fn(logp, resp_logits, batch, logits)
            batch.ref_logits = None
            if not torch.isfinite(loss):
                terms = {**terms, "nonfinite_loss": 1.0}
                loss = 0.0 * logits.sum()
            per_micro.append(terms)
            return loss, {}

        def _prepare(mbd: dict) -> None:
            mbd["batch"].ref_logits = ref_logits(mbd["batch"])

        ref = ref_logits if isinstance(ref_logits, MegatronPolicy) else None
        companion = None
        if ref is not None:
            ref_logits = None
            ref_was_training = ref.model.training
            ref.model.eval()

            def _ref_rows(logits: torch.Tensor, mbd: dict) -> None:
                mbd["batch"].ref_logits = ref.response_logits(logits, mbd["batch"])

            companion = Companion(ref.model, _ref_rows)
        micro = [self.micro_dict(b) for b in micro_batches]
        for b in micro_batches:  # the device copies hold them now, each dropped after its loss
            b.ref_logits = None
        try:
            forward_backward(self.model, micro, _loss, prepare=_prepare if ref_logits else None, companion=companion)
        finally:
            if ref is not None:
                ref.model.train(ref_was_training)
        stats = _mean_stats(_dp_rows(per_micro))
        if _broadcast_flag(stats.get("nonfinite_loss", 0.0)):
            zero_grads(self.setup)
            stats.update(update_skipped=1.0, nonfinite_loss=1.0, grad_norm=float("nan"))
            return stats
        if not grads_finite(self.setup):
            zero_grads(self.setup)
            stats.update(update_skipped=1.0, nonfinite_grad=1.0, grad_norm=float("nan"))
            return stats
        step = optimizer_step(self.setup)
        if not math.isfinite(step["grad_norm"]):
            step["update_skipped"] = 1.0
        stats.update(step)
        return stats

    def iter_hf_weights(self):
        return iter_hf_weights(self.model, self.hf_config)

    def save_shared(self, path: Path) -> None:
        """Collective: weights and optimizer (Adam moments, fp32 main params) as one torch_dist checkpoint
        that any TP/PP/DP layout and world size can load (models/checkpoint.py)."""
        save_training_state(self.model, self.setup.optimizer if self.setup is not None else None, path)

    def load_shared(self, path: Path) -> None:
        load_training_state(self.model, self.setup.optimizer if self.setup is not None else None, path)

    def scheduler_state(self) -> Optional[dict[str, Any]]:
        return self.setup.scheduler.state_dict() if self.setup is not None else None

    def load_scheduler_state(self, state: Optional[dict[str, Any]]) -> None:
        if self.setup is not None and state is not None:
            self.setup.scheduler.load_state_dict(state)

    def reset_to(self, hf_state_dict: dict[str, torch.Tensor]) -> None:
        """The policy as built from `hf_state_dict` (the initial student): its weights, and a fresh optimizer
        and scheduler (no Adam moments, step 0 of the schedule) -- what a checkpoint of step 0 would hold."""
        with torch.no_grad():
            _load_hf(unwrap(self.model), hf_state_dict, self.hf_config)
        if self.setup is not None:
            zero_grads(self.setup)
            self.setup = restart_optimizer(self.setup, self.cfg.optim, self.total_steps)

    def load_state_dict(self, state: dict[str, Any], source: str = "(per-rank format)") -> None:
        """A checkpoint of the per-rank format (before torch_dist trainer state): this rank's own shard, so
        only at the layout that wrote it. Those of earlier versions recorded their world size only, so at the
        same world size but another TP/PP layout only the shards tell: collective, every rank refuses with
        what to do (`per_rank_refusal`, `source` naming the checkpoint) when any rank's shards do not fit its
        model, instead of torch's size mismatch on some ranks."""
        misfit = _shard_misfit(unwrap(self.model), state["model"])
        if _broadcast_flag(1.0 if misfit else 0.0):
            p = self.cfg.parallel
            raise RuntimeError(per_rank_refusal(source, f"at another TP/PP layout ({misfit or 'on another rank'})",
                                                f"is at tp={p.tensor_model_parallel_size}, "
                                                f"pp={p.pipeline_model_parallel_size}"))
        missing, unexpected = unwrap(self.model).load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if self.setup is not None:
            opt = self.setup.optimizer
            opt.load_state_dict(state["optimizer"])
            for o, shard in zip(_optimizers(opt), state.get("optimizer_shards", [])):
                if shard is not None:
                    with torch.no_grad():  # fp32 main params are views of the model's leaf params
                        o.load_parameter_state_from_dp_reshardable(shard)
                unshare_adam_step(o)
            self.setup.scheduler.load_state_dict(state["scheduler"])


def _shard_misfit(model: torch.nn.Module, saved: dict[str, Any]) -> Optional[str]:
    """The first tensor of `saved` (a per-rank checkpoint's model shard) that this rank's `model` lacks, has in
    another shape, or has and `saved` lacks; None when the shard fits."""
    own = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    for k, v in saved.items():
        if k.endswith("_extra_state") or not isinstance(v, torch.Tensor):
            continue
        if k not in own:
            return f"{k} is not in this rank's model"
        if tuple(v.shape) != tuple(own[k].shape):
            return f"{k}: {list(v.shape)} in the checkpoint, {list(own[k].shape)} here"
    lacking = [k for k in own if k not in saved]
    return f"{lacking[0]} is not in the checkpoint" if lacking else None


def _load_hf(model: torch.nn.Module, hf_state_dict: dict[str, torch.Tensor], hf_config: Any,
             consume: bool = False) -> None:
    """This rank's TP/PP shard of an HF state dict into a GPTModel (THE mapping: models/weight_mapping.py),
    tensor by tensor; `consume`: emptying `hf_state_dict` as it goes."""
    tp_rank, tp_size, pp_rank, pp_size = model_parallel_coords()
    load_hf_into_megatron(model, hf_state_dict, hf_config, tp_rank, tp_size, pp_rank, pp_size,
                          te_names=_uses_te_names(model), vocab_padded=int(model.vocab_size), consume=consume)


def _optimizers(opt: Any) -> list[Any]:
    return list(getattr(opt, "chained_optimizers", [opt]))


def unwrap_config(model: Any) -> Any:
    return unwrap(model).config


def _uses_te_names(model: torch.nn.Module) -> bool:
    return any(k.endswith("layer_norm_weight") for k in model.state_dict())


# `stable_opd_loss`'s means over the policy tokens (weighed by n_pg_tokens when merged) and its counts
_PG_MEANS = ("clipfrac", "clipfrac_lower", "ratio_mean", "approx_kl_old", "adv_mean", "adv_raw_mean")
_COUNTS = ("n_pg_tokens", "n_rollout_tokens", "n_golden_tokens")
_SHARES = ("total_loss", "pg_loss", "kl", "golden_loss", "nll")  # each part's unscaled share of the whole


def _mean_stats(rows: list[dict[str, float]]) -> dict[str, float]:
    """Merge per-part stats (micro-batches on all data-parallel ranks) into the whole minibatch's values.

    Token means and rates are weighted by their parts' token counts, `adv_std` is pooled, `ratio_max` is
    a max over parts that have policy tokens, counts and the loss terms' shares (`_SHARES`: each part's
    term normalised by the whole minibatch's counts, unscaled) add up, so each equals the value computed
    on the whole minibatch at once, however many parts each rank holds. Every other key is a plain mean;
    a flag (nonfinite_*) is kept if any part raised it."""
    out: dict[str, float] = {}
    for k in sorted({k for r in rows for k in r}):
        have = [r for r in rows if k in r]
        vals = [r[k] for r in have]
        if k.startswith("nonfinite"):
            out[k] = max(vals)
        elif k in _COUNTS or k in _SHARES:
            out[k] = sum(vals)
        elif k in _PG_MEANS or k in ("adv_std", "ratio_max"):
            w = [r.get("n_pg_tokens", 1.0) for r in have]
            if k == "ratio_max":
                out[k] = max((v for v, n in zip(vals, w) if n > 0), default=1.0)
            elif k == "adv_std":  # E[A^2] - E[A]^2 over all parts, from each part's mean and std
                mean = _weighted([r.get("adv_mean", 0.0) for r in have], w)
                second = _weighted([v * v + r.get("adv_mean", 0.0) ** 2 for v, r in zip(vals, have)], w)
                out[k] = math.sqrt(max(second - mean * mean, 0.0))
            else:
                out[k] = _weighted(vals, w)
        else:
            out[k] = sum(vals) / len(vals)
    return out


def _dp_rows(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """The per-micro-batch stats of every data-parallel rank: merged in one go they give the whole
    minibatch's values; a mean of per-rank means would weigh a rank's few tokens like another's many."""
    group = host_group("dp") if dist.is_initialized() else None
    if group is None:
        return rows
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, rows, group=group)
    return [r for part in parts for r in part]


def _weighted(vals: list[float], weights: list[float]) -> float:
    """Weighted mean; 0 when no part has weight (masked_mean of an empty set)."""
    total = sum(weights)
    return sum(v * w for v, w in zip(vals, weights)) / total if total > 0 else 0.0


def _pad_t(x: torch.Tensor, t: int) -> torch.Tensor:
    if x.shape[1] == t:
        return x
    return torch.nn.functional.pad(x, (0, t - x.shape[1]))


def _inputs_finite(logp: torch.Tensor, batch: TrainBatch) -> bool:
    """Whether the log-probs and every per-token input of the loss (old / teacher / reference
    log-probs, top-k log-probs in `batch.extras`) are finite at the response positions. A NaN there
    (e.g. from NaN logits while scoring pi_old) is reported as `nonfinite_loss` and, through
    `_broadcast_flag`, skips the update on every rank, instead of raising on one rank only."""
    mask = batch.response_mask
    if not bool(torch.isfinite(logp[mask]).all()):
        return False
    for v in batch.extras.values():
        if v.is_floating_point() and v.shape[:2] == mask.shape and not bool(torch.isfinite(v[mask]).all()):
            return False
    return True


def _broadcast_flag(value: float) -> bool:
    """True on every rank if any rank saw `value` > 0 (the last stage computes the loss)."""
    flag = torch.tensor([1.0 if value > 0 else 0.0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group("world"))
    return bool(flag.item() > 0)
