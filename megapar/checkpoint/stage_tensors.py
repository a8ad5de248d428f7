"""What a checkpoint keeps of a stage, and how its experts are made whole: the stage's
parameters and its buffers (the MoE routers' auxiliary-loss-free balancing bias: state that is
no parameter but decides the routing), and, under expert parallelism, every routed expert's
stacked weights and optimizer moments gathered over the ep group into the canonical whole
[E, ...] form on save (`whole_experts`), each ep rank's block taken back on load
(`own_experts`). Under expert tensor parallelism (each expert's weights split over tp,
`models.moe`) they are gathered over tp as well (by the one shard rule, its ``tp_parts``
included), so a checkpoint holds every expert whole in every layout and moves between
--expert-tensor-parallel-size 1 and tp as between any two layouts.

Buffers are replicated over every parallel axis (tp, dp, cp, ep), so a checkpoint keeps them as
it keeps a replicated parameter, with no optimizer state, marked ``"buffer": true`` in the
manifest (tools that map parameters, such as the Hugging Face export, skip them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapar.mesh import Mesh
from megapar.tensor_parallel.partition import join_shards, shard_of, tp_dim, tp_parts


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


def split_expert(param) -> bool:
    """Whether `param` is a routed expert's weight split over tp (expert tensor parallelism):
    a checkpoint keeps it whole (`whole_experts`), so its entry has no tp split."""
    return bool(getattr(param, "expert", False)) and tp_dim(param) is not None


def saved_tp_dim(param) -> int | None:
    """The tp dim `param` is split along in a checkpoint: its own, but None for an expert
    split over tp (kept whole, `split_expert`)."""
    return None if split_expert(param) else tp_dim(param)


def own_experts(whole: torch.Tensor, param, tp_rank: int = 0) -> torch.Tensor:
    """This rank's part of a whole tensor read for `param`: under ep its experts (block of
    dim 0), and of an expert split over tp, tp rank `tp_rank`'s shard of those."""
    ep_rank, ep = ep_shard(param)
    n = whole.shape[0] // ep
    mine = whole.narrow(0, ep_rank * n, n) if ep > 1 else whole
    if split_expert(param):
        dim = tp_dim(param)
        mine = shard_of(mine, dim, param.shape[dim], tp_rank, tp_parts(param))
    return mine


def gathers_experts(mesh: Mesh) -> bool:
    """Whether this rank takes part in `whole_experts`' gather: under ep > 1 or expert tensor
    parallelism, the ranks of the checkpoint writer's ep group, at every tp rank
    (expert-data-parallel rank 0: the block of the cp x dp index holding the writer, dp rank 0
    and cp rank 0, whose other ranks may have other cp and dp ranks, `Mesh`; they hold the
    experts' optimizer state, gathered there by the optimizer, and under ZeRO-3 keep a host
    copy of the experts' gathered weights)."""
    split = getattr(mesh, "ep", 1) > 1 or getattr(mesh, "etp", 1) > 1
    return split and mesh.edp_rank == 0


def whole_experts(model, mesh: Mesh, optim_tensors) -> dict[str, tuple[torch.Tensor, dict]]:
    """Under ep > 1, {name: (weights, {key: moment})} of every routed expert's stacked weights
    gathered whole over the ep group along dim 0, so a checkpoint holds all E experts, the
    same in every ep (the canonical form, as tp shards are gathered into it); under expert
    tensor parallelism each expert's tp slices gathered over tp first. Only the ep groups of
    the checkpoint's writer (`gathers_experts`, one per tp rank) gather (collective over those
    groups and their tp groups); the other ranks, and ep 1 without the split, get {}.

    `optim_tensors` must hold every expert's moments on those ranks: the optimizer gives them
    there (ZeRO-1 / 2 gather each expert bucket's slices to its expert-data-parallel rank 0,
    which is that group's; ZeRO-3 gathers each experts' unit's slices there too). A moment in
    host memory is gathered through `mesh.device` (the collectives' device) and returned in
    host memory. Under ZeRO-3 `model` is the `HostStage` of the gathered weights, which holds
    the experts on those ranks."""
    out: dict[str, tuple[torch.Tensor, dict]] = {}
    if not gathers_experts(mesh):
        return out

    def gathered(t: torch.Tensor, size: int, group) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t, group=group)
        return parts

    def whole(t: torch.Tensor, param) -> torch.Tensor:
        mine = t.detach().to(mesh.device).contiguous()
        if split_expert(param):  # each tp rank's slice of every expert: joined first
            shards = gathered(mine, mesh.tp, mesh.tp_group)
            mine = join_shards(shards, param.tp_dim, tp_parts(param)).contiguous()
        if ep_shard(param)[1] > 1:
            mine = torch.cat(gathered(mine, mesh.ep, mesh.ep_group))
        return mine.to(t.device)

    for name, param in model.named_parameters():
        if ep_shard(param)[1] > 1 or split_expert(param):
            moments = (optim_tensors or {}).get(name, {})
            out[name] = (
                whole(param, param),
                {k: whole(v, param) for k, v in sorted(moments.items())},
            )
    return out
