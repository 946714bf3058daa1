"""Deterministic, resumable prompt sampler.

The order of epoch ``e`` is a pure function of ``(seed, e, len(records))``, so the sampler's whole state
is ``(epoch, position)``: a resumed run reproduces exactly the batches the uninterrupted run would have
drawn, without pickling any RNG.
"""

from __future__ import annotations

from typing import Any, Generic, Iterator, Optional, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


class PromptSampler(Generic[T]):
    """Batches of records, epoch after epoch, each epoch a fresh permutation (or in order without
    `shuffle`). `next_batch` always returns `batch_size` records, continuing into the next epoch when the
    current one runs out; `epoch_batches` yields the rest of the current epoch (the last batch may be
    short) and then moves to the next epoch."""

    def __init__(self, records: Sequence[T], seed: int = 0, shuffle: bool = True, batch_size: int = 1):
        if len(records) == 0:
            raise ValueError("PromptSampler: records is empty")
        if batch_size < 1:
            raise ValueError(f"PromptSampler: batch_size must be >= 1, got {batch_size}")
        self.records = records
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.batch_size = int(batch_size)
        self.epoch = 0
        self.position = 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.records)

    def order(self, epoch: int) -> np.ndarray:
        """Record indices in the order epoch `epoch` visits them."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        n = len(self.records)
        idx = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        self._order_cache = (epoch, idx)
        return idx

    def _take(self, k: int) -> list[T]:
        idx = self.order(self.epoch)[self.position:self.position + k]
        self.position += len(idx)
        if self.position >= len(self.records):
            self.epoch, self.position = self.epoch + 1, 0
        return [self.records[int(i)] for i in idx]

    def next_batch(self, batch_size: Optional[int] = None) -> list[T]:
        k = self.batch_size if batch_size is None else int(batch_size)
        if k < 1:
            raise ValueError(f"batch_size must be >= 1, got {k}")
        out: list[T] = []
        while len(out) < k:
            out.extend(self._take(k - len(out)))
        return out

    def epoch_batches(self, batch_size: Optional[int] = None) -> Iterator[list[T]]:
        k = self.batch_size if batch_size is None else int(batch_size)
        epoch = self.epoch
        while self.epoch == epoch:
            yield self._take(k)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "num_records": len(self.records)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position. The seed, shuffle flag and record count must match: resuming with other
        data would silently change which prompts come next."""
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("num_records", len(self.records))):
            if key in state and state[key] != mine:
                raise ValueError(f"PromptSampler.load_state_dict: {key}={state[key]!r} in the checkpoint but "
                                 f"{mine!r} now; resume with the same data and seed")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.records):
            raise ValueError(f"PromptSampler.load_state_dict: bad position epoch={epoch} position={position}")
        self.epoch, self.position = epoch, position


__all__ = ["PromptSampler"]
