"""What a checkpoint keeps of a stage, and how its routed experts are laid out: the stage's
parameters and its buffers (the MoE routers' auxiliary-loss-free balancing bias: state that is
no parameter but decides the routing), and every routed expert's stacked weights and optimizer
moments in one form whatever the run's ep and expert tensor parallelism: the whole [E, ...]
stack split along the expert dim (dim 0) over the checkpoint's tp shard files, tp rank r's
file holding experts [r * L, (r + 1) * L) for L = ceil(E / tp) (zero padded past E, as a
vocabulary is), so each expert is written once per checkpoint and the writing is spread over
the tp ranks (`saved_expert`; at tp 1 the one file holds them whole, ``tp_dim`` None).

On save each tp rank's block is made from what the ranks hold (`expert_blocks`): under
expert parallelism the ep ranks' blocks gathered over the ep group; under expert tensor
parallelism (each expert's weights split over tp, `models.moe`) every tp rank's slices of the
block exchanged over tp (one all-to-all) and joined (by the one shard rule, its ``tp_parts``
included). On load a rank reads only its own part: its ep block's rows of the stack from the
files holding them, and under expert tensor parallelism only its tp slice of those
(`checkpoint.distributed`, `ShardReader.rows`; `own_experts` is that part of a stack read
whole), so a checkpoint moves between any ep, tp and --expert-tensor-parallel-size (1 or tp),
as between any two layouts. A checkpoint whose expert entries have ``tp_dim`` None (an older
megapar's: each stack whole in every tp file) is read as such (the rows from the rank's own
tp file).

Buffers are replicated over every parallel axis (tp, dp, cp, ep), so a checkpoint keeps them as
it keeps a replicated parameter, with no optimizer state, marked ``"buffer": true`` in the
manifest (tools that map parameters, such as the Hugging Face export, skip them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapar.mesh import Mesh
from megapar.tensor_parallel.partition import (
    full_shape,
    join_shards,
    local_size,
    shard_of,
    tp_dim,
    tp_parts,
)


def stage_tensors(model) -> list[tuple[str, torch.Tensor, bool]]:
    """(canonical name, tensor, is a buffer) of every tensor a checkpoint keeps of `model` (a
    stage, `ModelChunks`, or ZeRO-3's `HostStage`): its parameters, then its buffers."""
    named = [(n, p, False) for n, p in model.named_parameters()]
    buffers = getattr(model, "named_buffers", None)
    if buffers is not None:
        named += [(n, b, True) for n, b in buffers()]
    return named


def ep_shard(param) -> tuple[int, int]:
    """(ep rank, ep) of a routed expert's stacked weights under expert parallelism (block ep
    rank of ep of dim 0 of the whole [E, ...] tensor, `expert_parallel.mark_expert`); (0, 1)
    for every other parameter."""
    return getattr(param, "ep_shard", (0, 1))


def is_routed_expert(param) -> bool:
    """Whether `param` is a routed expert's stacked weights (`expert_parallel.mark_expert`):
    a checkpoint keeps it split along the expert dim over its tp files (`saved_expert`)."""
    return bool(getattr(param, "expert", False))


def split_expert(param) -> bool:
    """Whether `param` is a routed expert's weight split over tp (expert tensor parallelism)."""
    return is_routed_expert(param) and tp_dim(param) is not None


def saved_tp_dim(param) -> int | None:
    """The tp dim `param` is read from a checkpoint split along: its own, but None for a
    routed expert (its stack is indexed whole: the rank's rows of it, `own_experts`)."""
    return None if is_routed_expert(param) else tp_dim(param)


def whole_expert_shape(param) -> list[int]:
    """The whole [E, ...] shape of a routed expert's stack (`param` is an ep rank's block of
    it, under expert tensor parallelism a tp slice of each expert of that block)."""
    shape = list(full_shape(param))
    shape[0] *= ep_shard(param)[1]
    return shape


def saved_expert(whole: list[int], tp: int) -> tuple[int | None, list[int]]:
    """(tp_dim, local shape) of a routed expert's stack of whole shape `whole` [E, ...] in a
    checkpoint of `tp` shard files per stage: split along the experts (dim 0), each file
    ceil(E / tp) of them (zero padded past E); at tp 1 whole (tp_dim None)."""
    if tp == 1:
        return None, list(whole)
    return 0, [local_size(whole[0], tp), *whole[1:]]


def own_experts(whole: torch.Tensor, param, tp_rank: int = 0) -> torch.Tensor:
    """This rank's part of a whole tensor read for `param`: under ep its experts (block of
    dim 0), and of an expert split over tp, tp rank `tp_rank`'s shard of those (what
    `ShardReader.rows` reads alone)."""
    ep_rank, ep = ep_shard(param)
    n = whole.shape[0] // ep
    mine = whole.narrow(0, ep_rank * n, n) if ep > 1 else whole
    if split_expert(param):
        dim = tp_dim(param)
        mine = shard_of(mine, dim, param.shape[dim], tp_rank, tp_parts(param))
    return mine


def gathers_experts(mesh: Mesh) -> bool:
    """Whether this rank takes part in `expert_blocks`' collectives: under ep > 1 or expert
    tensor parallelism, the ranks of the checkpoint writer's ep group, at every tp rank
    (expert-data-parallel rank 0: the block of the cp x dp index holding the writer, dp rank 0
    and cp rank 0, whose other ranks may have other cp and dp ranks, `Mesh`; they hold the
    experts' optimizer state, gathered there by the optimizer, and under ZeRO-3 keep a host
    copy of the experts' gathered weights)."""
    split = getattr(mesh, "ep", 1) > 1 or getattr(mesh, "etp", 1) > 1
    return split and mesh.edp_rank == 0


def expert_blocks(
    model, mesh: Mesh, optim_tensors, writes: bool = True
) -> dict[str, tuple[torch.Tensor, dict]]:
    """{name: (block, {key: moment block})} of every routed expert's stacked weights: this tp
    rank's block of the whole [E, ...] stack as its checkpoint file holds it (`saved_expert`:
    experts [tp_rank * L, (tp_rank + 1) * L), zero padded past E; the whole stack at tp 1).

    Under ep > 1 or expert tensor parallelism only the ranks of the checkpoint writer's ep
    groups (`gathers_experts`, one per tp rank) make them (collective over those ep groups and
    their tp groups): the block's experts broadcast over ep by the ep ranks holding them (no
    rank receives more than its block); under expert tensor parallelism each tp rank's slices
    of every expert all-gathered over ep, then one all-to-all over tp gives each tp rank every
    rank's slices of its block's experts, joined (no rank holds every expert whole).
    Otherwise (the experts whole on every tp rank) a rank that `writes` takes its block of its
    own stack, without communication; the other ranks, and tp 1 without ep or the split, get
    {}.

    `optim_tensors` must hold every expert's moments on the gathering ranks: the optimizer
    gives them there (ZeRO-1 / 2 gather each expert bucket's slices to its expert-data-parallel
    rank 0, which is that group's; ZeRO-3 gathers each experts' unit's slices there too). A
    moment in host memory is exchanged through `mesh.device` (the collectives' device) and
    returned in host memory. Under ZeRO-3 `model` is the `HostStage` of the gathered weights,
    which holds the experts on those ranks."""
    out: dict[str, tuple[torch.Tensor, dict]] = {}
    collective = gathers_experts(mesh)
    if not (collective or (writes and mesh.tp > 1)):
        return out
    tp, tp_rank = mesh.tp, mesh.tp_rank

    def padded(t: torch.Tensor, rows: int) -> torch.Tensor:
        if t.shape[0] == rows:
            return t
        out = t.new_zeros((rows, *t.shape[1:]))
        out[: t.shape[0]] = t
        return out

    def block(t: torch.Tensor, param) -> torch.Tensor:
        whole = whole_expert_shape(param)
        local = saved_expert(whole, tp)[1][0]
        mine = t.detach()
        if not collective:  # every expert here, whole: this rank's block of them
            start = min(whole[0], tp_rank * local)
            stop = min(whole[0], start + local)
            return padded(mine.narrow(0, start, stop - start), local)
        mine = mine.to(mesh.device).contiguous()
        if split_expert(param):  # every tp rank's slices of this rank's block, joined
            mine = padded(rows(mine, param, 0, whole[0]), local * tp)
            got = torch.empty_like(mine)
            dist.all_to_all_single(got, mine, group=mesh.tp_group)
            mine = join_shards(list(got.chunk(tp)), param.tp_dim, tp_parts(param))
        else:
            start = min(whole[0], tp_rank * local)
            mine = padded(rows(mine, param, start, min(whole[0], start + local)), local)
        return mine.contiguous().to(t.device)

    def rows(mine: torch.Tensor, param, start: int, stop: int) -> torch.Tensor:
        """Experts [start, stop) of the whole stack, from the ep ranks holding them: all of
        them all-gathered over ep, a part broadcast by each ep rank holding some of it."""
        ep = ep_shard(param)[1]
        if ep == 1:
            return mine.narrow(0, start, stop - start)
        n = mine.shape[0]  # experts per ep rank
        if (start, stop) == (0, n * ep):
            parts = [torch.empty_like(mine) for _ in range(ep)]
            dist.all_gather(parts, mine, group=mesh.ep_group)
            return torch.cat(parts)
        group = mesh.ep_group
        assert group is not None  # ep > 1
        parts = []
        for j in range(start // n, ep):  # ep rank j holds experts [j n, (j + 1) n)
            lo, hi = max(start, j * n), min(stop, (j + 1) * n)
            if lo >= hi:
                break
            if j == mesh.ep_rank:
                part = mine.narrow(0, lo - j * n, hi - lo).contiguous()
            else:
                part = mine.new_empty((hi - lo, *mine.shape[1:]))
            dist.broadcast(part, dist.get_global_rank(group, j), group=group)
            parts.append(part)
        return torch.cat(parts) if parts else mine.narrow(0, 0, 0)

    for name, param in model.named_parameters():
        if is_routed_expert(param):
            moments = (optim_tensors or {}).get(name, {})
            out[name] = (
                block(param, param),
                {k: block(v, param) for k, v in sorted(moments.items())},
            )
    return out
