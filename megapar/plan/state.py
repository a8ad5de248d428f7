"""Weights, gradients and optimizer state of one rank, byte for byte as megapar-train holds them.

megapar keeps fp32 parameters, their gradients in one buffer (`GradBuckets`) and AdamW's two
moments plus a float32 step count per parameter. With ZeRO-1 (dp > 1) the gradient buffer is
cut into buckets padded to a multiple of dp, the parameters move into a parameter buffer of the
same layout, and each dp rank keeps AdamW state only for its pieces (its slice of each bucket,
cut inside parameters): laid out here by `bucket_layout` and `slice_pieces`, the functions the
real code lays them out with, over the parameter list of the stage (`params.stage_tensors`).
The dry run (`megapar.dryrun`) reads the same figures off the real tensors and
`megapar-plan --verify` compares the two.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from megapar.data_parallel.buckets import bucket_layout, slice_pieces
from megapar.models.config import config_from_dict
from megapar.plan.params import stage_tensors

ADAM_MOMENTS = 2
"""AdamW's exp_avg and exp_avg_sq, each of the parameter's (piece's) shape and dtype."""
STEP_BYTES = 4
"""torch keeps Adam's step as a float32 scalar tensor per parameter (per ZeRO-1 piece)."""


@dataclass(frozen=True)
class RankState:
    """What one rank holds besides activations, in bytes (params: elements)."""

    params: int
    weights: int
    grads: int
    optimizer: int


def rank_state(config, tp: int, pp: int, v: int, stage: int, dp: int, dp_rank: int,
               zero: int, bucket_mb: float = 25.0, placement: str = "loop") -> RankState:
    """The state of dp rank `dp_rank` of pipeline rank `stage` (any tp rank: they hold equal
    shapes) under megapar-train with AdamW and gradient buckets of `bucket_mb` MB; `placement`
    maps chunks to virtual stages (`megapar.pipeline.schedules.PLACEMENTS`)."""
    tensors, buckets = _layout(config, tp, pp, v, stage, dp, zero, bucket_mb, placement)
    elements = sum(t.numel for t in tensors)
    if not buckets:  # no ZeRO-1: every parameter whole, its own state
        nbytes = sum(t.numel * t.dtype.itemsize for t in tensors)
        return RankState(elements, nbytes, nbytes,
                         ADAM_MOMENTS * nbytes + STEP_BYTES * len(tensors))
    buffer = sum(padded * tensors[idx[0]].dtype.itemsize for idx, padded in buckets)
    moments = steps = 0
    for idx, padded in buckets:
        size = padded // dp
        pieces = slice_pieces([tensors[i].numel for i in idx], dp_rank * size,
                              (dp_rank + 1) * size)
        moments += sum(e - s for _, s, e in pieces) * tensors[idx[0]].dtype.itemsize
        steps += len(pieces)
    return RankState(elements, buffer, buffer, ADAM_MOMENTS * moments + STEP_BYTES * steps)


@lru_cache(maxsize=4096)
def most_loaded(config_json: str, tp: int, pp: int, v: int, stage: int, dp: int, zero: int,
                bucket_mb: float = 25.0, placement: str = "loop") -> RankState:
    """The largest `rank_state` over the dp ranks of a stage (ZeRO-1 slices differ: the last
    holds the padding, ranks whose slice starts inside a parameter hold one more piece)."""

    config = config_from_dict(json.loads(config_json))
    tensors, buckets = _layout(config, tp, pp, v, stage, dp, zero, bucket_mb, placement)
    if not buckets:
        return rank_state(config, tp, pp, v, stage, dp, 0, zero, bucket_mb, placement)
    ranks = _candidate_ranks(tensors, buckets, dp)
    optimizer = np.zeros(len(ranks), dtype=np.int64)
    for idx, padded in buckets:
        size, itemsize = padded // dp, tensors[idx[0]].dtype.itemsize
        ends = np.cumsum([tensors[i].numel for i in idx])
        lo, hi = ranks * size, np.minimum((ranks + 1) * size, ends[-1])
        real = np.maximum(hi - lo, 0)
        first = np.searchsorted(ends, lo, side="right")
        last = np.searchsorted(ends, np.maximum(hi - 1, 0), side="right")
        optimizer += ADAM_MOMENTS * real * itemsize + STEP_BYTES * np.where(
            real > 0, last - first + 1, 0)
    worst = rank_state(config, tp, pp, v, stage, dp, 0, zero, bucket_mb, placement)
    return RankState(worst.params, worst.weights, worst.grads, int(optimizer.max()))


def _candidate_ranks(tensors, buckets, dp: int) -> np.ndarray:
    """The dp ranks among which the most loaded one is, without looking at all dp of them (a
    plan may try a billion): in some bucket, those whose slice holds a parameter boundary or the
    end of the real elements, the first and the last; every other rank holds one piece of
    `size` real elements or none in each bucket, so the lowest of them (its slices are real
    wherever anyone's are) stands for all of them."""
    special = {0, dp - 1}
    for idx, padded in buckets:
        size = padded // dp
        for end in np.cumsum([tensors[i].numel for i in idx]).tolist():
            special.update(r for r in (max(end - 1, 0) // size, end // size) if r < dp)
    generic = next((r for r in range(dp) if r not in special), None)
    return np.array(sorted(special | ({generic} if generic is not None else set())),
                    dtype=np.int64)


def _layout(config, tp, pp, v, stage, dp, zero, bucket_mb, placement="loop"):
    """(the stage's tensors, ZeRO-1's buckets as `bucket_layout` gives them, or [] without)."""
    tensors = stage_tensors(config, tp, pp, v, stage, placement)
    if not (zero and dp > 1):
        return tensors, []
    late = [i for i, t in enumerate(tensors) if t.shared] if pp > 1 else []
    return tensors, bucket_layout([(t.numel, t.dtype) for t in tensors], bucket_mb, dp, late)
