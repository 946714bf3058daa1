"""Local rollout engine: KV-cached batched sampling on an HF transformers copy of the student.

Why it exists: CPU tests, tiny-model demos and environments without SGLang still need real on-policy
rollouts with behaviour log-probs and the same weight-sync/version contract as SGLang.

Log-prob semantics (per generated token y_t):
  * `Sample.logprobs[t]` = log q(y_t), q the exact distribution y_t was drawn from: softmax(logits / T)
    restricted to the top-k / top-p set and renormalised. With top-k/top-p off this is the
    "after temperature" log-prob. Greedy (temperature=0) reports the raw log-prob.
  * `Sample.raw_logprobs[t]` = log softmax(logits)[y_t] at temperature 1, no truncation: what a plain
    teacher-forced forward of the same model gives.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from megatron_opd.algo._checks import all_finite
from megatron_opd.rollout.lean import LeanDecoder, unsupported_reason
from megatron_opd.rollout.packed import packed_weights
from megatron_opd.rollout.base import Sample, SamplingParams, eos_ids_from, validate_sampling


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature-scale `logits` [B, V] (float32) and set everything outside the top-k / nucleus to -inf.
    The top-p set is the smallest prefix of the sorted distribution whose mass reaches top_p."""
    x = logits / temperature
    if top_k > 0 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p  # the first token is always kept (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [B, V] (rows summing to ~1), by inverting the row's float64 CDF at one
    uniform draw. Same distribution as `torch.multinomial(probs, 1)`, which draws an exponential for every
    vocabulary entry: 24 ms a step at 8 x 152k on a 2-core host, against ~2 ms here. A zero-probability
    token is never drawn (its CDF step is empty); float64 keeps the CDF's rounding far below any
    probability an fp32 softmax can represent."""
    cdf = probs.to(torch.float64).cumsum_(-1)
    total = cdf[:, -1:].contiguous()
    u = torch.rand((probs.shape[0], 1), generator=gen, dtype=torch.float64) * total
    last = torch.searchsorted(cdf, total)  # the last token with mass: where u rounds up to the total
    return torch.minimum(torch.searchsorted(cdf, u, right=True), last)[:, 0]


# Decode-stall guard (num_threads=0): a decode step slower than STALL_FACTOR x the fastest one of the same
# call means another process took a core (every step waits for its slowest thread); the call finishes
# on one thread and the next STALL_CALLS calls start on one.
STALL_FACTOR, STALL_WARMUP, STALL_CALLS = 3.0, 3, 3


class LocalEngine:
    """RolloutEngine on an HF causal LM (see module docstring for log-prob semantics).

    Build from an HF directory (`LocalEngine.from_pretrained`) or from a module (`LocalEngine(model)`,
    optionally followed by `update_weights`). `max_batch_size` bounds the rows decoded together.
    """

    def __init__(self, model: torch.nn.Module, eos_token_ids: Optional[Iterable[int]] = None,
                 pad_token_id: Optional[int] = None, max_batch_size: int = 64, weight_version: int = 0,
                 check_finite_weights: bool = True, num_threads: int = 0, pack_weights: bool = False,
                 lean_decode: bool = False):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be >= 1, got {max_batch_size}")
        if num_threads < 0:
            raise ValueError(f"num_threads: must be >= 0 (0: auto), got {num_threads}")
        self.num_threads = num_threads
        self.pack_weights = pack_weights  # rollout/packed.py: oneDNN-packed weights while a call decodes (CPU)
        if lean_decode and unsupported_reason(model):
            raise ValueError(f"rollout.lean_decode: {unsupported_reason(model)}")
        self.lean_decode = lean_decode  # rollout/lean.py: the decode step without HF's forward
        self.stalls = 0  # decode calls that fell back to one thread (num_threads=0)
        # the last `generate`: decode steps (one forward of the live rows each), their seconds with sampling, prefill
        self.last_stats: dict[str, float] = {}
        self._clock = time.perf_counter  # the stall guard's clock (tests drive it by hand)
        self._single_calls = 0
        self.model = model.eval()
        self.eos_token_ids = sorted(set(eos_token_ids)) if eos_token_ids is not None else eos_ids_from(model)
        cfg = getattr(model, "config", None)
        pad = pad_token_id if pad_token_id is not None else getattr(cfg, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or model.get_output_embeddings().weight.shape[0])
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.check_finite_weights = check_finite_weights
        self._pending_version: Optional[int] = None
        self._pending_covered: set[int] = set()
        self._dirty: Optional[str] = None
        self._params = dict(model.state_dict(keep_vars=True))
        self._generator = torch.Generator(device="cpu")
        self._generator.seed()
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._device = next(model.parameters()).device

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        **kwargs: Any) -> "LocalEngine":
        p = Path(path)
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"LocalEngine: {p}/config.json not found (expected an HF model directory)")
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype).to(device)
        kwargs.setdefault("eos_token_ids", eos_ids_from(p))
        return cls(model, **kwargs)

    # ------------------------------------------------------------------------------------------
    # generation

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """len(prompts) * n samples grouped by prompt. Seeded: the same seed and inputs give the same output."""
        validate_sampling(sampling)
        if self._pending_version is not None:
            raise RuntimeError(f"LocalEngine.generate: weight update to version {self._pending_version} is in "
                               "progress (last_bucket not received); refusing to sample from mixed weights")
        if self._dirty:
            raise RuntimeError(f"LocalEngine.generate: {self._dirty}; send a complete update first")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}]: empty prompt")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}]: token ids {bad[:5]} outside [0, {self.vocab_size})")
        gen = self._generator
        if sampling.seed is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(sampling.seed)
        stop = set(self.eos_token_ids) | set(sampling.stop_token_ids)
        rows = [(i, p) for i, p in enumerate(prompts) for _ in range(sampling.n)]
        out: list[Sample] = []
        threads = torch.get_num_threads()
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        elif self._single_calls > 0:
            self._single_calls -= 1
            torch.set_num_threads(1)
        self.last_stats = {"decode_steps": 0, "decode_s": 0.0, "prefill_s": 0.0}
        # the lean step packs its own fused weights; HF's prefill then runs unpacked (one packed copy, not two)
        packing = (packed_weights(self.model, min(len(rows), self.max_batch_size))
                   if self.pack_weights and not self.lean_decode else nullcontext())
        try:
            with packing:
                for start in range(0, len(rows), self.max_batch_size):
                    out.extend(self._generate_batch(rows[start:start + self.max_batch_size], sampling, stop, gen))
        finally:
            torch.set_num_threads(threads)
        return out

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1, :].float()

    def _sample(self, logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raw = torch.log_softmax(logits, dim=-1)
        if sp.temperature == 0:
            tok = raw.argmax(dim=-1)
            lp = raw.gather(-1, tok[:, None])[:, 0]
            return tok, lp, lp
        plain = sp.temperature == 1.0 and sp.top_k <= 0 and sp.top_p >= 1.0
        q = raw if plain else torch.log_softmax(filter_logits(logits, sp.temperature, sp.top_k, sp.top_p), dim=-1)
        tok = draw(q.exp().cpu(), gen).to(logits.device)
        return tok, q.gather(-1, tok[:, None])[:, 0], raw.gather(-1, tok[:, None])[:, 0]

    def _generate_batch(self, rows: list[tuple[int, list[int]]], sp: SamplingParams, stop: set[int],
                        gen: torch.Generator) -> list[Sample]:
        dev = self._device
        lens = [len(p) for _, p in rows]
        width = max(lens)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (_, p) in enumerate(rows):  # left padding: the next token is always at column -1
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        t0 = time.perf_counter()
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, pos, cache)
        if self.lean_decode:
            lean = LeanDecoder(self.model, len(rows), width + sp.max_new_tokens + 1, pack=self.pack_weights)
            lean.adopt(cache, mask)
            del cache
        t1 = time.perf_counter()
        self.last_stats["prefill_s"] += t1 - t0
        next_pos = torch.tensor(lens, device=dev)

        resp: list[list[int]] = [[] for _ in rows]
        lps: list[list[float]] = [[] for _ in rows]
        raws: list[list[float]] = [[] for _ in rows]
        reason = ["length"] * len(rows)
        alive = list(range(len(rows)))  # batch row j decodes sample alive[j]
        guard = self.num_threads == 0 and dev.type == "cpu" and torch.get_num_threads() > 1
        fastest = float("inf")
        for step in range(sp.max_new_tokens):
            tok, lp, raw = self._sample(logits, sp, gen)
            keep = []
            for j, (t, a, b) in enumerate(zip(tok.tolist(), lp.tolist(), raw.tolist())):
                r = alive[j]
                resp[r].append(t)
                lps[r].append(a)
                raws[r].append(b)
                if t in stop:
                    reason[r] = "stop"
                else:
                    keep.append(j)
            if not keep or step == sp.max_new_tokens - 1:
                break
            if len(keep) < len(alive):
                idx = torch.tensor(keep, device=dev)
                if self.lean_decode:
                    lean.keep(idx)
                else:
                    cache.reorder_cache(idx)
                    mask = mask[idx]
                tok, next_pos = tok[idx], next_pos[idx]
                alive = [alive[j] for j in keep]
            t = self._clock()
            if self.lean_decode:
                logits = lean.step(tok, next_pos)
            else:
                mask = torch.cat([mask, mask.new_ones((len(alive), 1))], dim=1)
                logits = self._forward(tok[:, None], mask, next_pos[:, None], cache)
            if guard:
                took = self._clock() - t
                if step >= STALL_WARMUP and took > STALL_FACTOR * fastest:
                    torch.set_num_threads(1)
                    self.stalls += 1
                    self._single_calls = STALL_CALLS
                    guard = False
                fastest = min(fastest, took)
            next_pos = next_pos + 1
            self.last_stats["decode_steps"] += 1
        self.last_stats["decode_s"] += time.perf_counter() - t1
        return [Sample(prompt_index=i, prompt_ids=list(p), response_ids=resp[r], logprobs=lps[r],
                       finish_reason=reason[r], weight_version=self.weight_version, raw_logprobs=raws[r])
                for r, (i, p) in enumerate(rows)]

    # ------------------------------------------------------------------------------------------
    # weights

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       last_bucket: bool = True) -> None:
        """Copy HF-named tensors into the model. Names must exist and shapes match (else ValueError naming
        the tensor); the update must cover every parameter by its last bucket (tied weights count once).
        The version must increase; weight_version changes only when the last bucket is in. A bucket is
        validated before any of it is copied; if a later bucket fails after earlier ones were applied,
        the engine refuses to generate until a complete update arrives."""
        bucket = list(named_tensors)
        if self._pending_version is None:
            if version <= self.weight_version:
                raise ValueError(f"update_weights: version {version} must be > current weight_version "
                                 f"{self.weight_version}")
            self._pending_version, self._pending_covered = version, set()
        elif version != self._pending_version:
            self._fail(f"bucket for version {version} while version {self._pending_version} is in progress")
        for name, t in bucket:
            problem = self._tensor_problem(name, t)
            if problem:
                self._fail(problem)
        for name, t in bucket:
            dst = self._params[name]
            if dst.data_ptr() != t.data_ptr():  # equal: a tensor shared with the trainer (share_weights)
                dst.copy_(t)
            self._pending_covered.add(id(dst))
        if last_bucket:
            missing = [n for n, p in self._params.items()
                       if isinstance(p, torch.nn.Parameter) and id(p) not in self._pending_covered]
            if missing:
                self._fail(f"version {version} is incomplete: {len(missing)} parameter(s) never sent, "
                           f"e.g. {missing[:5]}")
            self.weight_version = version
            self._pending_version, self._pending_covered, self._dirty = None, set(), None

    @torch.no_grad()
    def share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Use the given HF-named tensors as this engine's parameters instead of copying them; returns the
        bytes of engine memory that became shared.

        For an in-process trainer whose live-model export yields views of its own parameters
        (`iter_hf_weights` at TP=PP=1): the engine then holds no second copy of those weights and sees
        every optimizer step as it happens; `update_weights` still brings the tensors that are not
        shared (q/k/v, which megatron stores fused) and its copy onto a shared tensor is a no-op.
        Only sound when nothing generates while the trainer updates its weights (no rollout overlap).
        Tensors are checked like `update_weights` (name, shape, finite) plus dtype, device and
        contiguity; a mismatch raises before anything is shared. The weight version is unchanged."""
        bucket = list(named_tensors)
        for name, t in bucket:
            problem = self._tensor_problem(name, t)
            dst = self._params.get(name)
            if not problem and (dst.dtype != t.dtype or dst.device != t.device):
                problem = f"{name}: {t.dtype} on {t.device} != engine {dst.dtype} on {dst.device}"
            if not problem and not t.is_contiguous():
                problem = f"{name}: not contiguous (decode would copy it every step)"
            if problem:
                raise ValueError(f"share_weights: {problem}")
        shared = 0
        for name, t in bucket:
            dst = self._params[name]
            if dst.data_ptr() != t.data_ptr():
                dst.data = t.detach()
                shared += t.numel() * t.element_size()
        return shared

    def _tensor_problem(self, name: str, t: torch.Tensor) -> Optional[str]:
        """Why `t` cannot stand for the engine's parameter `name` (unknown name, shape, NaN/inf), or None."""
        dst = self._params.get(name)
        if dst is None:
            return f"unknown parameter name {name!r} (model has e.g. {list(self._params)[:3]})"
        if tuple(dst.shape) != tuple(t.shape):
            return f"{name}: shape {tuple(t.shape)} != model {tuple(dst.shape)}"
        if self.check_finite_weights and t.is_floating_point() and not all_finite(t):
            return f"{name}: contains NaN/inf"
        return None

    def _fail(self, msg: str) -> None:
        if self._pending_covered:  # earlier buckets were applied: the weights are now mixed
            self._dirty = f"a failed weight update to version {self._pending_version} left mixed weights ({msg})"
        self._pending_version, self._pending_covered = None, set()
        raise ValueError(f"update_weights: {msg}")

    def named_hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The engine's current HF-named parameters (views, not copies)."""
        seen: set[int] = set()
        for n, p in self._params.items():
            if isinstance(p, torch.nn.Parameter) and id(p) not in seen:
                seen.add(id(p))
                yield n, p.detach()

    def shutdown(self) -> None:
        self.model = None  # type: ignore[assignment]
        self._params = {}


__all__ = ["LocalEngine", "draw", "filter_logits"]
