"""Deterministic global batches, identical whatever the parallel layout.

The sample stream of epoch ``e`` is ``numpy.random.default_rng(seed + e).permutation(N)``
(``range(N)`` when ``shuffle=False``), taken ``G`` samples at a time as global batches; when
fewer than ``G`` samples of the epoch are left they are dropped and epoch ``e + 1`` starts.
Data-parallel rank ``r`` of ``dp`` takes the contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of each
global batch, cut into micro-batches of ``micro_batch_size``.  The stream depends only on
``(N, seed, shuffle)``, and its cut into global batches on ``G`` -- never on ``dp``, the
micro-batch size or the rank.  A resumed run may take another ``G``: it continues the stream
from the saved position (the next ``G`` samples of the current epoch).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from megapar.wording import counted


class GlobalBatchSampler:
    """Yields, per global batch, this rank's micro-batches (each a list of sample indices).

    Iterating runs to the end of the current epoch; iterate again for the next epoch. The
    stream's position (the epoch, and how many samples of its order were taken) and
    ``consumed_samples`` (samples handed out so far, all ranks and epochs) are advanced *before*
    a batch is yielded, so a checkpoint saved after training on a batch resumes with the next
    one. ``consumed_samples`` given to the constructor is a position reached at this global
    batch size.
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
        epoch_offset: bool = False,
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
                f"the dataset has {counted(dataset_len, 'sample')}, fewer than one global batch of "
                f"{global_batch_size}; use more data or a smaller global batch size"
            )
        self.dataset_len = int(dataset_len)
        self.global_batch_size = int(global_batch_size)
        self.micro_batch_size = int(micro_batch_size)
        self.dp_size = int(dp_size)
        self.dp_rank = int(dp_rank)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch_offset = bool(epoch_offset)
        self.consumed_samples = int(consumed_samples)
        self._epoch, self._taken = self._position_at(self.consumed_samples, global_batch_size)

    @property
    def batches_per_epoch(self) -> int:
        """Number of global batches in one epoch (incomplete last batch dropped)."""
        return self.dataset_len // self.global_batch_size

    @property
    def position(self) -> tuple[int, int]:
        """Where the next global batch starts: (epoch, index into that epoch's order)."""
        if self._taken + self.global_batch_size > self.dataset_len:  # the epoch's rest dropped
            return self._epoch + 1, 0
        return self._epoch, self._taken

    @property
    def epoch(self) -> int:
        """The epoch the next global batch comes from."""
        return self.position[0]

    @property
    def micro_batches_per_rank(self) -> int:
        """Micro-batches each rank processes per global batch (gradient-accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample stream of ``epoch`` (a permutation of ``range(dataset_len)``; with
        ``epoch_offset``, for a dataset that is another sequence each epoch such as a blend,
        unshuffled: ``epoch * dataset_len + range(dataset_len)``)."""
        if self.epoch_offset:
            return np.arange(self.dataset_len, dtype=np.int64) + epoch * self.dataset_len
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
        epoch, start = self.position
        order = self.epoch_order(epoch)
        g = self.global_batch_size
        # until the epoch ends (the position moves on to the next one) or the state is reloaded
        while self.position == (epoch, start):
            self._epoch, self._taken = epoch, start + g
            self.consumed_samples += g
            yield self.rank_micro_batches(order[start : start + g].tolist())
            start += g

    def _position_at(self, consumed: int, global_batch_size: int) -> tuple[int, int]:
        """(epoch, samples of its order taken) after `consumed` samples drawn at one global
        batch size from the start."""
        if consumed < 0 or consumed % global_batch_size != 0:
            raise ValueError(
                f"consumed_samples {consumed} is not a non-negative multiple of the global batch "
                f"size {global_batch_size}"
            )
        per_epoch = self.dataset_len // global_batch_size * global_batch_size
        return consumed // per_epoch, consumed % per_epoch

    def state_dict(self) -> dict[str, Any]:
        """JSON-able resume state: the stream's position (``epoch``, and ``epoch_samples`` of
        its order taken, at most ``dataset_len``) and the samples consumed in all."""
        return {
            "consumed_samples": self.consumed_samples,
            "epoch": self._epoch,
            "epoch_samples": self._taken,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "shuffle": self.shuffle,
            "epoch_offset": self.epoch_offset,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (of any global batch size): the next global batch is
        the next ``global_batch_size`` samples of the stream after the saved position. A state
        without ``epoch_samples`` (written before it was recorded) is a position reached at
        its own global batch size, found from ``consumed_samples``. A state without
        ``epoch_offset`` was written before it was recorded (`older_epoch_order`)."""
        for key in ("seed", "dataset_len", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{getattr(self, key)!r}; resume with the same data and seed"
                )
        consumed = int(state["consumed_samples"])
        if "epoch_samples" in state:
            epoch, taken = int(state["epoch"]), int(state["epoch_samples"])
            if epoch < 0 or not 0 <= taken <= self.dataset_len:
                raise ValueError(
                    f"sampler state says {taken} samples of epoch {epoch} were taken, of "
                    f"{self.dataset_len}; the state is corrupt"
                )
        else:
            saved = int(state.get("global_batch_size", self.global_batch_size))
            epoch, taken = self._position_at(consumed, saved)
            if "epoch" in state and int(state["epoch"]) != epoch:
                raise ValueError(
                    f"sampler state says epoch {state['epoch']} but consumed_samples {consumed} "
                    f"implies epoch {epoch}; the state is corrupt"
                )
        self.consumed_samples, self._epoch, self._taken = consumed, epoch, taken


def older_epoch_order(sampler: GlobalBatchSampler, state: Mapping[str, Any]) -> bool:
    """Whether `state` (loaded into `sampler`, which takes a blend's epochs by
    ``epoch_offset``) does not record its epoch order and resumes past the first epoch: it may
    come from megapar before each epoch of a blend continued its parts' draws (where every
    epoch repeated the first), so the samples from here can differ from the ones that run
    would have drawn (epoch 0 is the same in both)."""
    return sampler.epoch_offset and "epoch_offset" not in state and sampler.position[0] >= 1


def collate(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of sample dicts into a dict of batched tensors (same keys)."""
    if not samples:
        raise ValueError("collate got an empty list of samples")
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
