"""Muon under ZeRO 1 / 2 / 3: whole matrices orthogonalised from the dp-sharded pieces a
`ZeroOptimizer` steps.

Muon's Newton-Schulz iteration needs each matrix whole, and a ZeRO rank holds only its slices of
the gradient buffer (pieces, cut inside parameters). Two ways, the same result:

- `muon_whole` (the default): each bucket holding Muon matrices is all-gathered over its dp
  group, and every rank orthogonalises every matrix of its stage;
- `muon_split` (`--muon-distributed`): each matrix is orthogonalised by one rank of the dp
  group, its owner (`plan_muon` assigns the owners once, at attach, balanced by Newton-Schulz
  cost), with one all-to-all carrying each piece's update to its owner and one carrying the
  result back.

Each is the `whole` hook of the optimizer's inner Muon (`optim/muon.py`), called with this
rank's Muon pieces and their updates U, returning each piece's part of the orthogonalised O
and its learning-rate ratio; both are collective over the dp (x cp) group and tp. `opt` is
the attached `ZeroOptimizer` (its pieces, buckets and Muon settings; typed `Any` here, as
`zero.py` imports this module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megapar.data_parallel import shard_comm
from megapar.mesh import group_size
from megapar.optim.muon import (
    muon_ratio,
    ns_cost,
    owner_updates,
    place_owners,
    slices_held,
    whole_updates,
)


@torch.no_grad()
def muon_whole(
    opt: Any, pieces: list[torch.Tensor], updates: list[torch.Tensor]
) -> list[tuple[torch.Tensor, float]]:
    """Muon on pieces: (this rank's piece of O, ratio) for each of its Muon pieces and their
    updates U. Each bucket holding Muon matrices is all-gathered over its group (every
    rank's pieces' U in a bucket-sized buffer laid out as the parameter buffer), so every
    rank has each matrix's (tp shard of) U; then `muon.whole_updates` (the tp all-gathers,
    NS) for every Muon matrix of the stage, in the same order on every rank. Collective
    over the dp (x cp) group and tp."""
    piece_of = {id(t): (p, s, e) for t, (p, s, e) in zip(opt.pieces, opt._piece_of)}
    buckets = [b for b in opt.grad_sync.buckets if any(id(p) in opt.muon_ids for p in b.params)]
    device = (opt.pieces or opt.params)[0].device
    flats = {id(b): torch.zeros(b.padded, dtype=b.params[0].dtype, device=device) for b in buckets}
    at = {}
    for b in buckets:
        for p in b.params:
            at[id(p)] = (b, opt._offset[id(p)])
    for t, u in zip(pieces, updates):
        p, s, e = piece_of[id(t)]
        b, offset = at[id(p)]
        flats[id(b)][offset + s : offset + e] = u.reshape(-1)
    host = opt.grad_sync.host_waits
    for b in buckets:
        shard_comm.all_gather(flats[id(b)], b.group_size, b.group, host).wait()
    matrices = [p for b in buckets for p in b.params if id(p) in opt.muon_ids]
    whole = [
        flats[id(at[id(p)][0])][at[id(p)][1] : at[id(p)][1] + p.numel()].view_as(p)
        for p in matrices
    ]
    done = dict(
        zip(
            (id(p) for p in matrices),
            whole_updates(matrices, whole, opt.tp_group, opt.muon_adjust_lr, opt.muon_ns_dtype),
        )
    )
    out = []
    for t in pieces:
        p, s, e = piece_of[id(t)]
        o, ratio = done[id(p)]
        out.append((o.reshape(-1)[s:e], ratio))
    return out


def plan_muon(opt: Any) -> MuonPlan | None:
    """The distributed Muon's plan, the same on every rank of the dp group: each Muon
    matrix's owner (`muon.place_owners`: balanced by Newton-Schulz cost, each matrix on
    the dp rank whose slices hold the most of it where the balance allows; tp ranks have
    the same matrices, whole shapes and bucket layout, so a matrix's owners across tp
    form one tp group), and the element ranges of the two all-to-alls (`muon_split`).
    None without Muon matrices."""
    buckets = [b for b in opt.grad_sync.buckets if any(id(p) in opt.muon_ids for p in b.params)]
    if not buckets:
        return None
    group, n = buckets[0].group, buckets[0].group_size
    ranks = dist.get_process_group_ranks(group)
    for b in buckets:
        if (
            dist.get_process_group_ranks(b.group) != ranks
            or b.params[0].dtype != buckets[0].params[0].dtype
        ):
            raise ValueError("distributed Muon needs its matrices' buckets in one dp group")
    me = dist.get_rank(group)
    matrices, held = [], []
    for b in buckets:
        each = slices_held([p.numel() for p in b.params], b.padded, n)
        for p, parts in zip(b.params, each):
            if id(p) in opt.muon_ids:
                matrices.append((b, p))
                held.append(parts)
    tp = group_size(opt.tp_group)
    slots = place_owners([ns_cost(p) for _, p in matrices], held, tp)
    owners = [slot // tp for slot in slots]
    local_base, at = {}, 0
    for b in buckets:
        local_base[id(b)] = at
        at += b.padded // n
    owned, whole_at, size, tp_owners = [], {}, 0, []
    for (_, p), r, slot in zip(matrices, owners, slots):
        if r == me:
            owned.append((p, size))
            tp_owners.append(slot % tp)
            whole_at[id(p)] = size
            size += p.numel()

    def overlap(b, p, rank: int) -> tuple[int, int]:
        """Positions [lo, hi) of matrix `p`'s elements inside `rank`'s slice of `b`."""
        slice_size, start = b.padded // n, opt._offset[id(p)]
        lo, hi = max(start, rank * slice_size), min(start + p.numel(), (rank + 1) * slice_size)
        return lo - start, hi - start

    send: list[tuple[int, int]] = []
    recv: list[tuple[int, int]] = []
    send_splits, recv_splits = [], []
    local_at = {
        id(p): local_base[id(b)] + opt._offset[id(p)] - me * (b.padded // n) for b, p in matrices
    }
    for peer in range(n):
        spans = [overlap(b, p, me) + (id(p),) for b, p in matrices]
        spans = [(lo, hi, i) for (lo, hi, i), r in zip(spans, owners) if r == peer]
        send += [(local_at[i] + lo, hi - lo) for lo, hi, i in spans if hi > lo]
        send_splits.append(sum(max(0, hi - lo) for lo, hi, _ in spans))
        spans = [overlap(b, p, peer) + (id(p),) for b, p in matrices]
        spans = [(lo, hi, i) for (lo, hi, i), r in zip(spans, owners) if r == me]
        recv += [(whole_at[i] + lo, hi - lo) for lo, hi, i in spans if hi > lo]
        recv_splits.append(sum(max(0, hi - lo) for lo, hi, _ in spans))
    return MuonPlan(
        group=group,
        owner={id(p): r for (_, p), r in zip(matrices, owners)},
        owned=owned,
        tp_owners=tp_owners,
        local_at=local_at,
        send=send,
        recv=recv,
        send_splits=send_splits,
        recv_splits=recv_splits,
        whole_size=size,
        local_size=at,
        dtype=buckets[0].params[0].dtype,
        device=opt.param_buffers[next(iter(opt.param_buffers))].device,
    )


@torch.no_grad()
def muon_split(
    opt: Any, pieces: list[torch.Tensor], updates: list[torch.Tensor]
) -> list[tuple[torch.Tensor, float]]:
    """Distributed Muon on pieces: (this rank's piece of O, ratio) for each of its Muon
    pieces and their updates U. One all-to-all over the dp group sends each piece's U to
    its matrix's owner (`muon_plan`), the owners gather their matrices over tp and
    orthogonalise them (`muon.whole_updates`: each matrix by one rank of the dp group, by
    the tp ranks of that one), and a second all-to-all returns each piece's O. Collective
    over the dp (x cp) group (every rank issues both, in the same order) and the owners'
    tp groups (the same matrices in the same order on each)."""
    plan = opt.muon_plan
    assert plan is not None
    local = torch.zeros(plan.local_size, dtype=plan.dtype, device=plan.device)
    piece_of = {id(t): (p, s, e) for t, (p, s, e) in zip(opt.pieces, opt._piece_of)}
    spans = []
    for t, u in zip(pieces, updates):
        p, s, e = piece_of[id(t)]
        at = plan.local_at[id(p)] + s
        spans.append((at, e - s))
        local[at : at + e - s] = u.reshape(-1)
    whole = torch.empty(plan.whole_size, dtype=plan.dtype, device=plan.device)
    _exchange(local, plan.send, whole, plan.recv, plan, forward=True)
    matrices: list[torch.Tensor] = [p for p, _ in plan.owned]
    views = [whole[at : at + p.numel()].view_as(p) for p, at in plan.owned]
    done = owner_updates(
        matrices, views, plan.tp_owners, opt.tp_group, opt.muon_adjust_lr, opt.muon_ns_dtype
    )
    del views
    for (p, at), o in zip(plan.owned, done):
        whole[at : at + p.numel()] = o.reshape(-1)
    _exchange(whole, plan.recv, local, plan.send, plan, forward=False)
    return [
        (local[at : at + n], muon_ratio(piece_of[id(t)][0], opt.muon_adjust_lr))
        for t, (at, n) in zip(pieces, spans)
    ]


@dataclass
class MuonPlan:
    """Distributed Muon's plan for one rank (`plan_muon`): `owner` (id of each
    Muon matrix -> the dp rank that orthogonalises it); `owned` (this rank's matrices and
    their offsets in the whole buffer, those matrices back to back); `local_at` (each
    matrix's offset in the local buffer, this rank's slices of the Muon buckets back to back,
    negative where the slice starts inside it); `send` / `recv`: the (offset, length) ranges
    of the local buffer sent and of the whole buffer received by the first all-to-all (by
    peer, `*_splits` elements each; the second all-to-all runs it backwards)."""

    group: Any
    owner: dict[int, int]
    owned: list[tuple[nn.Parameter, int]]
    tp_owners: list[int]
    local_at: dict[int, int]
    send: list[tuple[int, int]]
    recv: list[tuple[int, int]]
    send_splits: list[int]
    recv_splits: list[int]
    whole_size: int
    local_size: int
    dtype: torch.dtype
    device: torch.device


def _exchange(
    source: torch.Tensor,
    out_of: list[tuple[int, int]],
    target: torch.Tensor,
    into: list[tuple[int, int]],
    plan: MuonPlan,
    forward: bool,
) -> None:
    """One all-to-all of distributed Muon over `plan.group`: the ranges `out_of` (offset,
    length) of `source`, back to back, go to the peers (`plan.send_splits` elements each
    forward, `plan.recv_splits` back), and what comes in lands in the ranges `into` of
    `target`."""
    sent, came = plan.send_splits, plan.recv_splits
    if not forward:
        sent, came = came, sent
    wire = [source[at : at + n] for at, n in out_of]
    out = torch.cat(wire) if wire else source.new_zeros(0)
    received = torch.empty(sum(came), dtype=plan.dtype, device=plan.device)
    dist.all_to_all_single(received, out, came, sent, group=plan.group)
    k = 0
    for at, n in into:
        target[at : at + n] = received[k : k + n]
        k += n
