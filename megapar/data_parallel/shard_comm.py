"""The reduce-scatter and all-gather of a dp-sharded bucket, in place or in bounded pieces.

A sharded bucket is a flat range of `dp * size` elements; dp rank r owns the r-th `size`
elements. On NCCL both collectives run on the bucket itself (`reduce_scatter_tensor` into the
rank's slice, `all_gather_into_tensor` from it). Gloo copies what it is given (up to two
bucket-sized copies per collective, held until it is waited for), so on the host a bucket
larger than `HOST_PIECE_BYTES` is reduced or gathered in pieces: piece j is column range
[off, off + n) of every rank's slice, staged in one contiguous `dp * n` tensor, so no copy is
larger than the piece. Same ops, same total bytes, same result; only the number of calls
grows. A one-rank group (the experts' buckets where ep = cp x dp) issues no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

HOST_PIECE_BYTES = 4 * 2**20
"""Largest collective payload (all ranks' pieces together) on the host: gloo's copies stay
this small."""


def _rs_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _ag_fn():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def pieces(size: int, dp: int, itemsize: int, host: bool) -> list[tuple[int, int]]:
    """(offset, length) inside each rank's slice of the collectives that serve a bucket of
    `dp * size` elements: the whole slice, or on the host pieces of about HOST_PIECE_BYTES."""
    step = max(1, HOST_PIECE_BYTES // (dp * itemsize)) if host else size
    return [(off, min(step, size - off)) for off in range(0, size, step)] or [(0, 0)]


def reduce_scatter(flat: torch.Tensor, out: torch.Tensor, dp: int, group, host: bool):
    """Sum `flat` (dp equal slices) over `group` and leave this rank's slice of the sum in `out`
    (which may be that slice of `flat` itself); returns a handle to wait for. On the host, in
    pieces, at most two staged pieces in flight (the next issued before the last is waited
    for)."""
    if dp == 1:  # a one-rank group (the experts' at ep = cp x dp): the sum is the input
        if out.data_ptr() != flat.data_ptr():
            out.copy_(flat)
        return _Keep(None, None)
    size = flat.numel() // dp
    parts = pieces(size, dp, flat.element_size(), host)
    if len(parts) == 1:
        return _rs_fn()(out, flat, group=group, async_op=True)
    grid = flat.view(dp, size)
    flight = None
    for off, n in parts:
        staged = grid[:, off : off + n].contiguous()
        work = _rs_fn()(out[off : off + n], staged.view(-1), group=group, async_op=True)
        if flight is not None:
            flight.wait()
        flight = _Keep(work, staged)
    return flight


def all_gather(flat: torch.Tensor, dp: int, group, host: bool):
    """All-gather a bucket in place: every rank contributes its slice of `flat`. Returns a
    handle to wait for (on the host, in pieces, each waited for before the next)."""
    if dp == 1:  # a one-rank group: its slice is the whole bucket already
        return _Keep(None, None)
    size = flat.numel() // dp
    rank = dist.get_rank(group)
    parts = pieces(size, dp, flat.element_size(), host)
    if len(parts) == 1:
        return _ag_fn()(flat, flat[rank * size : (rank + 1) * size], group=group, async_op=True)
    grid = flat.view(dp, size)
    for off, n in parts:
        staged = torch.empty(dp * n, dtype=flat.dtype, device=flat.device)
        _ag_fn()(staged, grid[rank, off : off + n], group=group, async_op=True).wait()
        grid[:, off : off + n].copy_(staged.view(dp, n))
    return _Keep(None, None)


class _Keep:
    """A collective's handle that keeps its staged input alive until waited for."""

    def __init__(self, work, staged: torch.Tensor | None):
        self.work, self.staged = work, staged

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        self.work = self.staged = None
        return True
