"""The most loaded dp rank of a stage under ZeRO: its state (`most_loaded`), found without
looking at every rank (a plan may try a billion), by the slices' loads over all units at once.

ZeRO's slices differ between dp ranks by a few bytes (the last holds the padding, a slice that
starts inside a parameter makes one more piece); `plan.state.rank_state` gives any one rank's
state, this the worst of them.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import accumulate

import numpy as np

from megapar.plan.params import StageLayout
from megapar.plan.state import (
    MOMENTS,
    STEPS,
    Offload,
    RankState,
    _finish,
    _layout,
    _shards,
    expert_rank,
    muon_matrix,
    rank_state,
)

NO_OFFLOAD = Offload()
"""Nothing offloaded, no ZeRO-3 options (`most_loaded`'s default)."""


@lru_cache(maxsize=4096)
def most_loaded(layout: StageLayout, offload: Offload = NO_OFFLOAD) -> RankState:
    """The most loaded `rank_state` over the dp ranks of stage `layout` (ZeRO slices differ: the
    last holds the padding, ranks whose slice starts inside a parameter hold one more piece):
    the one with the most optimizer bytes (with --offload-optimizer, optimizer and host
    copies). `layout.dp` is over cp x dp; under ep > 1 with more than `EXACT_EP_RANKS` ranks,
    the most loaded dense slice plus the most loaded expert slice (an upper bound, off by at
    most a piece's step count and a bucket's padding). Under --optimizer muon (a Muon
    matrix's piece holds less than an AdamW parameter's) every rank is looked at, up to
    `EXACT_EP_RANKS`; above, Muon's pieces are counted as AdamW's (an upper bound)."""

    tensors, units, specs, stepped, state = _slice_loads(layout)
    if not units:
        return rank_state(layout, 0, offload)
    held = state + (2 * stepped if offload.optimizer else 0)
    worst = int(np.argmax(held))
    return _finish(tensors, units, specs, layout, int(stepped[worst]), int(state[worst]), offload)


EXACT_EP_RANKS = 4096
"""Under ep > 1, `most_loaded` looks at every rank up to this many cp x dp ranks (a rank's
dense and expert slices are cut over two groups); above, it adds the two groups' worst."""


@lru_cache(maxsize=1024)
def _slice_loads(layout: StageLayout):
    """`_layout`'s (tensors, units, specs) and, for each of `_candidate_ranks`, the bytes it steps
    and its optimizer-state bytes (numpy arrays, read-only), over every unit at once: a rank's
    slice of unit u is [rank x size_u, (rank + 1) x size_u) clipped to the unit's real elements,
    its pieces the parameters that slice meets (found in the stage's running sum of sizes).
    Under ep > 1 an expert unit's slice is of the rank's place in its expert group
    (`expert_rank`): every rank up to `EXACT_EP_RANKS`, else each group's candidates, summed at
    their worst."""
    tensors, units, specs = _layout(layout)
    dp, ep = layout.dp, layout.ep
    if not units:
        return tensors, units, specs, None, None
    expert = np.array([_shards(tensors, idx, dp, ep) != dp for idx, _ in units])[:, None]
    muon = layout.optimizer == "muon" and dp <= EXACT_EP_RANKS
    if not expert.any() and muon:  # which tensor a rank's slice meets matters: every rank
        ranks = np.arange(dp, dtype=np.int64)[None, :]
    elif not expert.any():
        ranks = _candidate_ranks(tensors, units, dp)[None, :]
    elif dp <= EXACT_EP_RANKS:
        every = np.arange(dp, dtype=np.int64)
        ranks = np.where(expert, expert_rank(every, ep), every)
    else:
        dense = _candidate_ranks(tensors, [u for u, x in zip(units, expert[:, 0]) if not x], dp)
        experts = _candidate_ranks(tensors, [u for u, x in zip(units, expert[:, 0]) if x], dp // ep)
        width = max(len(dense), len(experts))
        ranks = np.where(expert, np.resize(experts, width), np.resize(dense, width))
    moments, step_bytes = MOMENTS[layout.optimizer], STEPS[layout.optimizer]
    if expert.any() and dp > EXACT_EP_RANKS:  # each group's worst, together
        parts = [_loads(tensors, units, dp, ep, ranks, expert[:, 0] == x) for x in (False, True)]
        best = [int(np.argmax(moments * a + step_bytes * b)) for a, b in parts]
        stepped = np.array([sum(int(a[i]) for (a, _), i in zip(parts, best))])
        steps = np.array([sum(int(b[i]) for (_, b), i in zip(parts, best))])
        state = moments * stepped + step_bytes * steps  # Muon's too: an upper bound
    else:
        stepped, steps, muon_bytes, muon_pieces = _loads(tensors, units, dp, ep, ranks, muon=muon)
        # AdamW / LAMB: two moments and a step count per piece (SGD / LARS: one buffer, no
        # count); a Muon piece: one buffer, no count
        state = moments * stepped + step_bytes * steps
        state = state - (moments - 1) * muon_bytes - step_bytes * muon_pieces
    stepped.setflags(write=False)
    state.setflags(write=False)
    return tensors, units, specs, stepped, state


def _loads(tensors, units, dp: int, ep: int, ranks: np.ndarray, rows=None, muon: bool = False):
    """(bytes stepped, pieces) of each column of `ranks` (unit x column: the place in the
    unit's group whose slice is taken), over the units (`rows`: a mask choosing some: those two
    only); without `rows`, also (bytes stepped, pieces) of those inside Muon's matrices
    (`muon_matrix`) where `muon`, else zeros."""
    numels = [tensors[i].numel for idx, _ in units for i in idx]
    ends = np.cumsum(numels, dtype=np.int64)  # every unit's parameters, one after another
    last = np.cumsum([len(idx) for idx, _ in units]) - 1  # each unit's last index into `ends`
    base = (
        ends[last]
        - np.array([sum(tensors[i].numel for i in idx) for idx, _ in units], dtype=np.int64)
    )[:, None]  # where each unit starts
    size = np.array(
        [padded // _shards(tensors, idx, dp, ep) for idx, padded in units], dtype=np.int64
    )[:, None]
    itemsize = np.array([tensors[idx[0]].dtype.itemsize for idx, _ in units], dtype=np.int64)[
        :, None
    ]
    lo = base + ranks * size  # unit x rank, in the running sum
    hi = np.minimum(lo + size, ends[last][:, None])
    real = np.maximum(hi - lo, 0)
    pieces = (
        np.searchsorted(ends, np.maximum(hi - 1, lo), side="right")
        - np.searchsorted(ends, lo, side="right")
        + 1
    )
    if rows is not None:
        real, pieces = real[rows], pieces[rows]
        itemsize = itemsize[rows]
    stepped, steps = (real * itemsize).sum(axis=0), np.where(real > 0, pieces, 0).sum(axis=0)
    if rows is not None:
        return stepped, steps
    if not muon:
        return stepped, steps, np.zeros_like(stepped), np.zeros_like(steps)
    # Muon's elements before running-sum position x: whole Muon tensors before the one x is in,
    # and x's offset into that one if it is Muon's (a sentinel past the end)
    is_muon = np.array([muon_matrix(tensors[i]) for idx, _ in units for i in idx] + [False])
    starts = np.append(ends - np.array(numels, dtype=np.int64), ends[-1])
    before = np.concatenate([[0], np.cumsum(np.where(is_muon[:-1], numels, 0))])
    counted = np.concatenate([[0], np.cumsum(is_muon[:-1])])

    def muon_elements(x):
        j = np.searchsorted(ends, x, side="right")
        return before[j] + np.where(is_muon[j], x - starts[j], 0)

    first = np.searchsorted(ends, lo, side="right")
    last_piece = np.searchsorted(ends, np.maximum(hi - 1, lo), side="right")
    inside = np.where(real > 0, muon_elements(hi) - muon_elements(lo), 0)
    after = np.minimum(last_piece + 1, len(counted) - 1)  # (a slice past the end: no pieces)
    muon_pieces = np.where(real > 0, counted[after] - counted[first], 0)
    return stepped, steps, (inside * itemsize).sum(axis=0), muon_pieces.sum(axis=0)


def _candidate_ranks(tensors, buckets, dp: int) -> np.ndarray:
    """The dp ranks among which the most loaded one is, without looking at all dp of them (a
    plan may try a billion): in some bucket, those whose slice holds a parameter boundary or the
    end of the real elements, the first and the last; every other rank holds one piece of
    `size` real elements or none in each bucket, so the lowest of them (its slices are real
    wherever anyone's are) stands for all of them."""
    special = {0, dp - 1}
    for idx, padded in buckets:
        size = padded // dp
        for end in accumulate(tensors[i].numel for i in idx):
            special.update(r for r in (max(end - 1, 0) // size, end // size) if r < dp)
    generic = next((r for r in range(dp) if r not in special), None)
    return np.array(sorted(special | ({generic} if generic is not None else set())), dtype=np.int64)
