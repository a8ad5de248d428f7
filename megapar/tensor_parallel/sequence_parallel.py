"""Sequence parallelism (Megatron-style): outside the tensor-parallel regions, activations are
split along the sequence across the tp group.

Without it, LayerNorm, dropout and the residual stream run on the whole [b, s, h] tensor on every
tp rank. With it each tp rank holds s / tp positions there, and the region primitives change:

| primitive (sequence = dim 1)                  | forward                | backward               |
|-----------------------------------------------|------------------------|------------------------|
| gather_from_sequence_parallel_region          | all-gather sequence    | reduce-scatter sequence|
| reduce_scatter_to_sequence_parallel_region    | reduce-scatter sequence| all-gather sequence    |
| scatter_to_sequence_parallel_region           | keep my sequence slice | all-gather sequence    |

A column-parallel layer gathers its input instead of `copy_to_tp_region` (whose backward
all-reduce becomes the gather's reduce-scatter) and a row-parallel layer reduce-scatters its
output instead of `reduce_from_tp_region`: the same bytes as the two all-reduces they replace,
while the activations in between are 1 / tp the size. Replicated parameters used on the split
sequence (LayerNorms, row-parallel biases) see only their rank's positions, so their gradients
are summed over tp after the backward (`sync_sequence_parallel_grads`).

All primitives are the identity when the group is None (tp = 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapar.comm_wait import blocked
from megapar.mesh import LayoutError, group_size
from megapar.tensor_parallel.mappings import eager_region

SEQ_DIM = 1


def all_gather_flat(out, x, group, async_op: bool = False):
    """`out` (contiguous) = every rank's `x` (contiguous), one after the other. `async_op`:
    launched and its handle returned (the caller waits for it, and counts that wait)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if async_op:
        return fn(out.view(-1), x.view(-1), group=group, async_op=True)
    with blocked(x.device):
        fn(out.view(-1), x.view(-1), group=group)
    return None


def reduce_scatter_flat(out, x, group):
    """`out` (contiguous) = the sum over ranks of this rank's equal part of `x` (contiguous)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    with blocked(x.device):
        fn(out.view(-1), x.view(-1), group=group)


def _check(x: torch.Tensor, size: int) -> None:
    if x.shape[SEQ_DIM] % size:
        raise LayoutError(
            f"sequence length {x.shape[SEQ_DIM]} is not divisible by --tp {size} "
            f"(needed by --sequence-parallel); change --seq-len or --tp"
        )


def split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous slice of the sequence (no communication)."""
    size = group_size(group)
    if size == 1:
        return x
    _check(x, size)
    return x.chunk(size, dim=SEQ_DIM)[dist.get_rank(group)].contiguous()


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's sequence slice, concatenated in rank order (all-gather).

    The collective gathers whole tensors, so the ranks' [b, s/tp, h] slices arrive one after
    the other; with one sequence per micro-batch (b = 1, the usual size for large models) that
    is already the [1, s, h] layout and nothing is copied, otherwise one copy puts each
    sequence's slices together (Megatron keeps [s, b, h] activations to avoid it)."""
    size = group_size(group)
    if size == 1:
        return x
    out = gather_buffer(x, size)
    all_gather_flat(out, x.contiguous(), group)
    return in_sequence_order(out, x, size)


def gather_buffer(x: torch.Tensor, size: int) -> torch.Tensor:
    """The all-gather's output for every rank's slice `x` ([b, s / size, ...]): [size b, ...]."""
    return torch.empty((size * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)


def in_sequence_order(out: torch.Tensor, x: torch.Tensor, size: int) -> torch.Tensor:
    """`gather_buffer` `out`, the ranks' slices like `x` one after the other, as [b, s, ...]:
    a view with b = 1, else one copy putting each sequence's slices together."""
    b = x.shape[0]
    if b == 1:
        return out.view(1, -1, *x.shape[2:])
    return (
        out.view(size, b, *x.shape[1:]).transpose(0, 1).reshape(b, size * x.shape[1], *x.shape[2:])
    )


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over ranks of x, of which each rank keeps its sequence slice (reduce-scatter).
    With b = 1 the input is handed to the collective as it is; otherwise one copy puts each
    rank's slices of all sequences together first (see `gather_sequence`)."""
    size = group_size(group)
    if size == 1:
        return x
    _check(x, size)
    b, s = x.shape[:2]
    grouped = (
        x.contiguous()
        if b == 1
        else x.reshape(b, size, s // size, *x.shape[2:]).transpose(0, 1).contiguous()
    )
    out = torch.empty((b, s // size) + x.shape[2:], dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, grouped, group)
    return out


def _region(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd function doing `forward(x, group)` and, in backward, `backward(grad, group)`."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    return type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(fwd), "backward": staticmethod(bwd)},
    )


_GatherFromSP = _region("_GatherFromSP", gather_sequence, reduce_scatter_sequence)
_ReduceScatterToSP = _region("_ReduceScatterToSP", reduce_scatter_sequence, gather_sequence)
_ScatterToSP = _region("_ScatterToSP", split_sequence, gather_sequence)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gathers the sequence in forward; reduce-scatters the gradient in backward."""
    return x if group_size(group) == 1 else eager_region(_GatherFromSP, x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sums partial results and keeps my sequence slice; all-gathers the gradient."""
    return x if group_size(group) == 1 else eager_region(_ReduceScatterToSP, x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keeps my sequence slice of a tensor every rank holds whole; all-gathers the gradient."""
    return x if group_size(group) == 1 else eager_region(_ScatterToSP, x, group)


def mark_sequence_parallel(params) -> None:
    """Flag replicated parameters whose gradient is partial under sequence parallelism."""
    for p in params:
        if getattr(p, "tp_dim", None) is None:
            p.sequence_parallel = True


def sequence_parallel_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


@torch.no_grad()
def sync_sequence_parallel_grads(model: torch.nn.Module, group) -> int:
    """Sum the gradients of `mark_sequence_parallel` parameters over the tp group, in one
    all-reduce of a flat buffer; returns the number of parameters synchronised."""
    grads = [p.grad for p in sequence_parallel_params(model) if p.grad is not None]
    if group_size(group) == 1 or not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return len(grads)
