"""Autograd primitives that move activations into and out of the tensor-parallel region.

Each is a pair (forward op, backward op) over the tp group, named after what it does:

| primitive                 | forward                    | backward                   |
|---------------------------|----------------------------|----------------------------|
| copy_to_tp_region         | identity                   | all-reduce (sum)           |
| reduce_from_tp_region     | all-reduce (sum)           | identity                   |
| scatter_to_tp_region      | keep my slice of last dim  | all-gather last dim        |
| gather_from_tp_region     | all-gather last dim        | keep my slice of last dim  |

With a group of None (tp = 1) every primitive is the identity. The all-reduces run in place,
as Megatron's: the forward one on the partial sums a row-parallel layer just made (marked dirty
for autograd), the backward one on the gradient the region's consumers (linear layers) just
made; no copy of the b x s x h activation is taken.

Under mixed precision (autocast) the tensors that enter the tp region are often fp32 where
Megatron's are 16-bit: megapar keeps fp32 parameters, so the norms' outputs, the embedding's
output and the residual stream are fp32. `to_wire_dtype` casts such a tensor to the autocast
dtype where a collective of more than one rank will carry it (what the linear reading it
would cast it to anyway): the collective, and in the backward the gradient flowing back
through it, move 2 bytes an element, as Megatron's; autograd casts the gradient back to fp32
behind the cast. fp32 runs (no autocast) and tp 1 are untouched. Expert parallelism sends the
routed rows through it too (`megapar.models.moe`, over the ep group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapar.comm_wait import blocked
from megapar.graph_break import graph_break


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous()
    with blocked(x.device):
        dist.all_reduce(x, group=group)
    return x


def to_wire_dtype(x: torch.Tensor, group) -> torch.Tensor:
    """`x` in the autocast dtype where autocast is on, `x` is fp32 and `group` has more than one
    rank (a collective of `group` will carry it, or its gradient: a tp region's, or expert
    parallelism's dispatch of the routed rows); else `x` itself. No host sync."""
    if _size(group) == 1 or x.dtype != torch.float32:
        return x
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return x
    return x.to(torch.get_autocast_dtype(kind))


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    with blocked(x.device):
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def eager_region(function: type[torch.autograd.Function], x: torch.Tensor, group) -> torch.Tensor:
    """`function.apply(x, group)`, run eagerly also inside torch.compile'd code (`--compile`:
    a graph break), so a tp collective stays the in-place torch.distributed call it is in eager
    mode: issued in the same order, counted (`comm_count`) and timed (`comm_wait`) the same.
    Outside compiled code it is the plain call (no wrapper's cost)."""
    if torch.compiler.is_compiling():
        return _apply_eagerly(function, x, group)
    return function.apply(x, group)


@graph_break
def _apply_eagerly(function: type[torch.autograd.Function], x: torch.Tensor, group):
    return function.apply(x, group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = _all_reduce(x, group)
        if out is x:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; sums the input gradient over the tp group in backward."""
    return x if _size(group) == 1 else eager_region(_CopyToTP, x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sums partial results over the tp group in forward; identity backward."""
    return x if _size(group) == 1 else eager_region(_ReduceFromTP, x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keeps this rank's slice of the last dim; gathers the gradient in backward."""
    return x if _size(group) == 1 else eager_region(_ScatterToTP, x, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenates every rank's last-dim slice; keeps this rank's slice of the gradient."""
    return x if _size(group) == 1 else eager_region(_GatherFromTP, x, group)
