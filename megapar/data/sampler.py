"""Deterministic global batches, identical whatever the parallel layout.

The sample stream of epoch ``e`` is ``numpy.random.default_rng(seed + e).permutation(N)``
(``range(N)`` when ``shuffle=False``), cut into global batches of ``G`` samples; the last
incomplete global batch of each epoch is dropped.  Data-parallel rank ``r`` of ``dp``
takes the contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of each global batch, cut into
micro-batches of ``micro_batch_size``.  The content of global batch ``k`` depends only on
``(N, G, seed, shuffle)`` -- never on ``dp``, the micro-batch size or the rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch


class GlobalBatchSampler:
    """Yields, per global batch, this rank's micro-batches (each a list of sample indices).

    Iterating runs to the end of the current epoch; iterate again for the next epoch.
    ``consumed_samples`` counts whole global batches handed out so far (all ranks), and is
    advanced *before* a batch is yielded, so a checkpoint saved after training on a batch
    resumes with the next one.
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int,
        dp_rank: int,
        seed: int,
        shuffle: bool = True,
        consumed_samples: int = 0,
    ):
        if micro_batch_size < 1 or dp_size < 1 or global_batch_size < 1:
            raise ValueError(
                f"batch sizes and dp size must be >= 1 (global {global_batch_size}, "
                f"micro {micro_batch_size}, dp {dp_size})"
            )
        if global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by micro-batch size "
                f"{micro_batch_size} x dp {dp_size} = {micro_batch_size * dp_size}; "
                f"choose a global "
                f"batch size that is a multiple of {micro_batch_size * dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        if dataset_len < global_batch_size:
            raise ValueError(
                f"the dataset has {dataset_len} samples, fewer than one global batch of "
                f"{global_batch_size}; use more data or a smaller global batch size"
            )
        self.dataset_len = int(dataset_len)
        self.global_batch_size = int(global_batch_size)
        self.micro_batch_size = int(micro_batch_size)
        self.dp_size = int(dp_size)
        self.dp_rank = int(dp_rank)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self._check_consumed(consumed_samples)
        self.consumed_samples = int(consumed_samples)

    @property
    def batches_per_epoch(self) -> int:
        """Number of global batches in one epoch (incomplete last batch dropped)."""
        return self.dataset_len // self.global_batch_size

    @property
    def samples_per_epoch(self) -> int:
        """Samples consumed by one full epoch."""
        return self.batches_per_epoch * self.global_batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next global batch comes from."""
        return self.consumed_samples // self.samples_per_epoch

    @property
    def micro_batches_per_rank(self) -> int:
        """Micro-batches each rank processes per global batch (gradient-accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample stream of ``epoch`` (a permutation of ``range(dataset_len)``)."""
        if not self.shuffle:
            return np.arange(self.dataset_len, dtype=np.int64)
        return (
            np.random.default_rng(self.seed + epoch).permutation(self.dataset_len).astype(np.int64)
        )

    def global_batch(self, epoch: int, k: int) -> list[int]:
        """All ``global_batch_size`` sample indices of global batch ``k`` of ``epoch``
        (all ranks)."""
        if not 0 <= k < self.batches_per_epoch:
            raise IndexError(f"global batch {k} outside the epoch's {self.batches_per_epoch}")
        g = self.global_batch_size
        return self.epoch_order(epoch)[k * g : (k + 1) * g].tolist()

    def rank_micro_batches(self, batch: Sequence[int]) -> list[list[int]]:
        """This rank's slice of a global batch, cut into micro-batches."""
        per_rank = self.global_batch_size // self.dp_size
        mine = list(batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank])
        m = self.micro_batch_size
        return [mine[j : j + m] for j in range(0, per_rank, m)]

    def __iter__(self) -> Iterator[list[list[int]]]:
        epoch = self.epoch
        order = self.epoch_order(epoch)
        g = self.global_batch_size
        k = (self.consumed_samples - epoch * self.samples_per_epoch) // g
        while k < self.batches_per_epoch and self.epoch == epoch:
            batch = order[k * g : (k + 1) * g].tolist()
            self.consumed_samples += g
            k += 1
            yield self.rank_micro_batches(batch)

    def _check_consumed(self, consumed: int) -> None:
        if consumed < 0 or consumed % self.global_batch_size != 0:
            raise ValueError(
                f"consumed_samples {consumed} is not a non-negative multiple of the global batch "
                f"size {self.global_batch_size}; resume with the global batch size of the "
                f"checkpoint"
            )

    def state_dict(self) -> dict[str, Any]:
        """JSON-able resume state."""
        return {
            "consumed_samples": self.consumed_samples,
            "epoch": self.epoch,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the next global batch is the one after the saved
        position."""
        for key in ("global_batch_size", "seed", "dataset_len", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{getattr(self, key)!r}; resume with the same data and batch settings"
                )
        consumed = int(state["consumed_samples"])
        self._check_consumed(consumed)
        self.consumed_samples = consumed
        if "epoch" in state and int(state["epoch"]) != self.epoch:
            raise ValueError(
                f"sampler state says epoch {state['epoch']} but consumed_samples {consumed} "
                f"implies epoch {self.epoch}; the state is corrupt"
            )


def collate(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of sample dicts into a dict of batched tensors (same keys)."""
    if not samples:
        raise ValueError("collate got an empty list of samples")
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
