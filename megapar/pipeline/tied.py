"""Keep the tied word embedding equal on the first and the last pipeline stage.

GPT-2 and BERT use the word embedding twice: as the input embedding (first stage,
``embed.word.weight``) and as the output projection (last stage). With pp > 1 these live on
different ranks, so the last stage holds a copy (``head.weight``, ``tied_to="embed.word.weight"``)
initialised identically. Each copy only sees its own half of the gradient: the first stage the
embedding-lookup part, the last stage the LM-head part. The true gradient of the shared weight is
their sum. Summing the two gradients over `mesh.embedding_group` (only the first and last stage of
each tp/dp position are in it) gives both copies the same full gradient, so the same optimizer
update keeps them bitwise equal, exactly as if they were one tensor. In the V placement (ZB-V,
DualPipeV) the first and the last virtual stage are both on pp rank 0, as two chunks: there the
two copies are summed in place, and the last rank holds none.

Call `sync_tied_embeddings` after the pipeline schedule (all gradients accumulated) and before
gradient clipping and the optimizer step.

Where the sum runs *before* the data-parallel reduction (ZeRO, and the all-reduce that rounds:
compressed or in 16 bits), each end then reduces its copy in its own collective, whose order of
summation is not the other end's (a ring's depends on where the tensor lies in its bucket or
unit, and on the communicator), so the two results may differ in the last bits and the copies
drift apart step by step. `equal_tied_grads` then gives the last stage the first stage's reduced
gradient (a broadcast over the embedding group of the part each rank holds; in the V placement,
a copy), which makes the copies bitwise equal again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megapar.device import wait
from megapar.mesh import Mesh
from megapar.tensor_parallel.partition import shared_embedding_params


def _embedding_group(mesh: Mesh):
    """`mesh.embedding_group`, which a rank holding a shared embedding that is not in the V
    placement is in; RuntimeError where it is not."""
    if mesh.embedding_group is None:
        raise RuntimeError(
            f"rank {mesh.rank} (pp stage {mesh.pp_rank}) holds a shared embedding but is in no "
            f"embedding group; only the first and last pipeline stage may hold one"
        )
    return mesh.embedding_group


def sync_tied_embeddings(model: nn.Module, mesh: Mesh) -> int:
    """Sum the tied embedding's gradient over the first and last stage; returns how many
    parameters were synchronised (0 when pp == 1 or this stage holds no tied copy). Waits at
    most the run's timeout (`mesh.timeout_s`)."""
    if mesh.pp == 1:
        return 0
    params = shared_embedding_params(model)
    if not params:
        return 0
    if len(params) == 2:  # both ends on this rank (the V placement): sum here, no message
        embedding, copy = params
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        assert embedding.grad is not None and copy.grad is not None  # set just above
        total = embedding.grad + copy.grad
        embedding.grad.copy_(total)
        copy.grad.copy_(total)
        return 2
    group = _embedding_group(mesh)
    for p in params:
        if p.grad is None:  # e.g. nothing ran backward: take part anyway, the peer is waiting
            p.grad = torch.zeros_like(p)
        work = dist.all_reduce(p.grad, group=group, async_op=True)
        wait(
            work,
            mesh.device,
            mesh.timeout_s,
            f"rank {mesh.rank}: all-reduce of the tied embedding gradient with the other end "
            f"of the pipeline",
            hint="; the first or last stage probably failed, or only one "
            "of them called sync_tied_embeddings",
        )
    return len(params)


def equal_tied_grads(parts: list[torch.Tensor], mesh: Mesh) -> int:
    """Make this rank's `parts` of the tied embedding's reduced gradient (the grad sync's
    `reduced_part` of each `shared_embedding_params`, in their order: the embedding's before
    its copy) the first stage's: broadcast from the first stage over `mesh.embedding_group`,
    or, with both on this rank (the V placement), the copy's overwritten by the embedding's.
    Call after the data-parallel reduction that followed `sync_tied_embeddings`; the part each
    rank holds must be the same slice on both ends (the whole gradient, or ZeRO's slice of a
    bucket or unit the parameter has to itself). Returns the tensors made equal (0: pp == 1 or
    no copy here)."""
    if mesh.pp == 1 or not parts:
        return 0
    if len(parts) == 2:  # the V placement: both copies here
        parts[1].copy_(parts[0])
        return 1
    group = _embedding_group(mesh)
    work = dist.broadcast(parts[0], src=mesh.stage_rank(0), group=group, async_op=True)
    wait(
        work,
        mesh.device,
        mesh.timeout_s,
        f"rank {mesh.rank}: broadcast of the tied embedding's reduced gradient from the first "
        f"stage to the last",
        hint="; the first or last stage probably failed",
    )
    return 1
