"""What a checkpoint keeps of a stage, and how its experts are made whole: the stage's
parameters and its buffers (the MoE routers' auxiliary-loss-free balancing bias: state that is
no parameter but decides the routing), and, under expert parallelism, every routed expert's
stacked weights and optimizer moments gathered over the ep group into the canonical whole
[E, ...] form on save (`whole_experts`), each ep rank's block taken back on load
(`own_experts`).

Buffers are replicated over every parallel axis (tp, dp, cp, ep), so a checkpoint keeps them as
it keeps a replicated parameter, with no optimizer state, marked ``"buffer": true`` in the
manifest (tools that map parameters, such as the Hugging Face export, skip them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapar.mesh import Mesh


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


def own_experts(whole: torch.Tensor, param) -> torch.Tensor:
    """This ep rank's experts (block of dim 0) of a whole tensor read for `param`, if any."""
    ep_rank, ep = ep_shard(param)
    n = whole.shape[0] // ep
    return whole.narrow(0, ep_rank * n, n) if ep > 1 else whole


def gathers_experts(mesh: Mesh) -> bool:
    """Whether this rank takes part in `whole_experts`' gather: under ep > 1, the ranks of
    the checkpoint writer's ep group (expert-data-parallel rank 0: the block of the cp x dp
    index holding the writer, dp rank 0 and cp rank 0, whose other ranks may have other cp and
    dp ranks, `Mesh`; they hold the experts' optimizer state, gathered there by the optimizer,
    and under ZeRO-3 keep a host copy of the experts' gathered weights)."""
    return getattr(mesh, "ep", 1) > 1 and mesh.edp_rank == 0


def whole_experts(model, mesh: Mesh, optim_tensors) -> dict[str, tuple[torch.Tensor, dict]]:
    """Under ep > 1, {name: (weights, {key: moment})} of every routed expert's stacked weights
    gathered whole over the ep group along dim 0, so a checkpoint holds all E experts, the
    same in every ep (the canonical form, as tp shards are gathered into it). Only the ep
    group of the checkpoint's writer (`gathers_experts`) gathers (collective over that
    group); the other ranks and ep 1 get {}.

    `optim_tensors` must hold every expert's moments on those ranks: the optimizer gives them
    there (ZeRO-1 / 2 gather each expert bucket's slices to its expert-data-parallel rank 0,
    which is that group's; ZeRO-3 gathers each experts' unit's slices there too). A moment in
    host memory is gathered through `mesh.device` (the collectives' device) and returned in
    host memory. Under ZeRO-3 `model` is the `HostStage` of the gathered weights, which holds
    the experts on those ranks."""
    out: dict[str, tuple[torch.Tensor, dict]] = {}
    if not gathers_experts(mesh):
        return out

    def whole(t: torch.Tensor) -> torch.Tensor:
        mine = t.detach().to(mesh.device).contiguous()
        parts = [torch.empty_like(mine) for _ in range(mesh.ep)]
        dist.all_gather(parts, mine, group=mesh.ep_group)
        return torch.cat(parts).to(t.device)

    for name, param in model.named_parameters():
        if ep_shard(param)[1] > 1:
            moments = (optim_tensors or {}).get(name, {})
            out[name] = (whole(param), {k: whole(v) for k, v in sorted(moments.items())})
    return out
