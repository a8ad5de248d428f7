"""Tokens dispatched to the ep rank holding their experts, and combined back.

Before dispatch, a rank's routed tokens (one row per token and chosen expert) are sorted by
global expert id, with `tokens_per_expert` counting them over all E experts. Ep rank j holds
experts [j E/ep, (j+1) E/ep) (`params.local_experts`), so the sorted rows are already cut into
one contiguous block per destination rank.

`plan_route` exchanges the counts: one all-to-all of E integers over the ep group tells each
rank how many rows it will receive from each peer for each of its local experts. Reading those
counts on the host is the only host-device sync of expert parallelism (the receive buffer's
size and the splits are host integers that the all-to-all needs): one per MoE layer per
micro-batch, as it is in Megatron-core and torchtitan. The order the received rows must be put
in (sorted by local expert across source ranks) is computed on the device from the counts.

`dispatch` sends the rows with one all-to-all of variable splits and reorders them by local
expert; `combine` is its inverse (the experts' outputs put back in source order and returned
with the all-to-all of swapped splits) and each one's backward is the other's forward. Rows and
gradients travel in the dtype they are given: the MoE layer hands its rows over in the compute
dtype (fp32, or bf16 / fp16 under mixed precision:
`megapar.tensor_parallel.mappings.to_wire_dtype`) and the experts' outputs come back in it. The
exchange is `_AllToAll`, a small autograd function around `dist.all_to_all_single` rather than
`torch.distributed.nn.functional.all_to_all_single`: both directions run inside
`comm_wait.blocked`, so the time a rank waits there for a slow peer, forward and backward,
counts as waiting and not as its compute (the straggler measure).

Every rank of an ep group issues the same collectives in the same order (the count exchange,
the dispatch, the combine; the backward in the graph's reverse order), as NCCL requires;
nothing relies on gloo buffering (gloo's all-to-all serves uneven and empty splits). With an
ep group of None (ep 1) every function is the identity and nothing is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from megapar.comm_wait import blocked
from megapar.mesh import group_size


@dataclass
class Route:
    """Where one MoE layer's rows go in one micro-batch, from `plan_route`."""

    group: dist.ProcessGroup | None
    """The ep group (None: ep 1, nothing sent)."""
    send_splits: list[int]
    """Rows sent to each ep rank (host integers; empty under ep 1)."""
    recv_splits: list[int]
    """Rows received from each ep rank (host integers; empty under ep 1)."""
    tokens_per_local_expert: torch.Tensor
    """Rows each local expert receives, on the device (int64, [E / ep])."""
    host_counts: list[int] | None = None
    """The same counts as host integers, when the count exchange read them (ep > 1)."""
    order: torch.Tensor | None = None
    """Received row i (source-rank order) goes to row order[i] of the expert-sorted rows."""
    gather: torch.Tensor | None = None
    """The inverse: expert-sorted row j is received row gather[j]."""

    @property
    def counts(self) -> list[int]:
        """`tokens_per_local_expert` as host integers (for a CPU loop over experts): read with
        the count exchange under ep > 1; under ep 1 this reads them (the layer's one sync)."""
        if self.host_counts is None:
            self.host_counts = self.tokens_per_local_expert.tolist()
        return self.host_counts


def plan_route(tokens_per_expert: torch.Tensor, group, rows: int = 0) -> Route:
    """The route of rows sorted by global expert with `tokens_per_expert` ([E] integer counts,
    on the device) over the ep `group`: one all-to-all of the counts and one host read of them
    (collective over `group`). Under ep 1 (`group` None) nothing is exchanged or read. Under
    the dry run's fake tensors (no values) the `rows` are taken as spread evenly over the
    experts on every rank."""
    ep = group_size(group)
    if ep == 1:
        return Route(None, [], [], tokens_per_expert)  # nothing is sent
    num = tokens_per_expert.numel()
    if num % ep:
        raise ValueError(f"{num} experts cannot be split over an ep group of {ep} ranks")
    send = tokens_per_expert.to(torch.int64).view(ep, num // ep)
    recv = torch.empty_like(send)
    with blocked(send.device):  # recv[i]: rows from rank i per local expert
        dist.all_to_all_single(recv, send, group=group)
    local = num // ep
    if is_fake(recv):
        even = [rows // num + (e < rows % num) for e in range(num)]
        mine = even[dist.get_rank(group) * local :][:local]
        host = [sum(even[j * local : (j + 1) * local]) for j in range(ep)] + mine * ep
    else:
        host = torch.cat([send.sum(1), recv.flatten()]).tolist()  # the one host sync
    from_each = [host[ep + i * local : ep + (i + 1) * local] for i in range(ep)]
    route = Route(
        group,
        host[:ep],
        [sum(c) for c in from_each],
        recv.sum(0),
        host_counts=[sum(c[e] for c in from_each) for e in range(local)],
    )
    route.order = _expert_order(recv, sum(route.recv_splits))
    route.gather = torch.empty_like(route.order)
    route.gather[route.order] = torch.arange(route.order.numel(), device=recv.device)
    return route


def _expert_order(recv: torch.Tensor, total: int) -> torch.Tensor:
    """For each received row (by source rank, then local expert), its row once sorted by local
    expert (then source rank); on the device, from the [ep, local] counts, without a sync."""
    ep, local = recv.shape
    sizes = recv.flatten()  # chunk k = (source i, expert e) at k = i * local + e
    chunk = torch.repeat_interleave(
        torch.arange(ep * local, device=recv.device), sizes, output_size=total
    )
    src_start = torch.cumsum(sizes, 0) - sizes
    by_expert = recv.t().flatten()  # chunks in (expert, source) order
    dst_start = (torch.cumsum(by_expert, 0) - by_expert).view(local, ep).t().flatten()
    row = torch.arange(total, device=recv.device)
    return dst_start[chunk] + row - src_start[chunk]


class _AllToAll(torch.autograd.Function):
    """Rows exchanged over an ep group with variable splits; the backward exchanges the
    gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(rows, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """`send[j]` rows to ep rank j, `recv[i]` from rank i, in rank order (one collective)."""
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    with blocked(rows.device):
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


def dispatch(tokens: torch.Tensor, route: Route) -> torch.Tensor:
    """`tokens` (rows sorted by global expert, as `route` was planned for) sent to the ep ranks
    holding their experts: this rank's received rows, sorted by local expert
    (`route.tokens_per_local_expert` of each). Differentiable; its backward is `combine`'s
    exchange."""
    if route.group is None:
        return tokens
    received = _AllToAll.apply(tokens, route.send_splits, route.recv_splits, route.group)
    assert route.gather is not None
    return received.index_select(0, route.gather)


def combine(outputs: torch.Tensor, route: Route) -> torch.Tensor:
    """The experts' `outputs` (rows sorted by local expert, as `dispatch` returned them) sent
    back to the ranks the rows came from: rows in the order `dispatch` was given them.
    Differentiable; its backward is `dispatch`'s exchange."""
    if route.group is None:
        return outputs
    assert route.order is not None
    back = outputs.index_select(0, route.order)
    return _AllToAll.apply(back, route.recv_splits, route.send_splits, route.group)
