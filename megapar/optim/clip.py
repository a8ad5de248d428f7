"""Global gradient-norm clipping across tensor, pipeline and data parallelism.

The norm is the L2 norm of the whole model's gradient, each parameter counted once:

- a tp-sharded parameter contributes its shard on every tp rank (shards are disjoint; padding
  rows of a vocab-parallel tensor have zero gradient);
- a tp-replicated parameter (tp_dim None, e.g. LayerNorm) is counted on tp rank 0 only;
- a tied copy (`param.tied_to`, the last stage's LM head) is not counted: after the tied sync
  its gradient equals the embedding's, which the first stage counts;
- the sum of squares is reduced over the model-parallel group (tp x pp). Gradients are already
  averaged over dp, so every dp replica computes the same norm and nothing crosses dp;
- expert parameters (`megapar.expert_parallel`) differ between the ranks of an ep group: under
  ep > 1 their squares are summed apart and all-reduced over the ep group first.

The squares are summed in fp64 (`sum_of_squares`), the ranks' sums all-reduced in fp64: an fp32
square is exact in fp64 and the sum's rounding (about 1e-16 relative per addition) is far below
fp32's, so the same gradients give the same fp32 clipping factor however they are cut into
buckets, ZeRO slices or units, and summed in whatever order (in fp32 a change of
`--grad-bucket-mb` moved a bf16 run's norm in the 7th digit and its loss in the 6th by step 4).
torch's CPU norm kernel adds a tensor's squares into one running sum (pytorch/pytorch#169237),
whose error grows with the tensor's size, so a CPU tensor is still normed in pieces of
`CPU_NORM_PIECE` elements.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megapar.expert_parallel import is_expert
from megapar.mesh import Mesh, all_reduce

CPU_NORM_PIECE = 1 << 14
"""Elements per piece of a CPU tensor whose norm `sum_of_squares` takes on its own (short
enough that torch's CPU kernel's running sum of its squares stays at its dtype's rounding)."""


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of every element of `tensors` (fp64, 0-d): `squares_each`
    summed. `tensors` must not be empty."""
    return squares_each(tensors).sum()


def squares_each(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's sum of the squares of its elements (fp64, one element a tensor), from one
    foreach norm accumulated in fp64 (CUDA's fused kernel reads each tensor in its own dtype),
    each CPU tensor cut into pieces of at most `CPU_NORM_PIECE` elements (views, no copy;
    CUDA reduces a whole tensor in a tree, so its tensors go whole) whose squares are added
    back in order. `tensors` must not be empty."""
    pieces, owner = [], []
    for i, t in enumerate(tensors):
        if t.device.type == "cpu" and t.numel() > CPU_NORM_PIECE:
            cut = t.reshape(-1).split(CPU_NORM_PIECE)
            pieces.extend(cut)
            owner.extend([i] * len(cut))
        else:
            pieces.append(t)
            owner.append(i)
    sq = torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64)).square()
    if len(pieces) == len(tensors):
        return sq
    each = torch.zeros(len(tensors), dtype=torch.float64)  # CPU: index_add_ adds in order
    return each.index_add_(0, torch.tensor(owner), sq)


def is_counted(param: nn.Parameter, mesh: Mesh) -> bool:
    """Whether this rank adds `param`'s gradient to the global norm (each parameter once)."""
    if getattr(param, "tied_to", None) is not None:
        return False
    return getattr(param, "tp_dim", None) is not None or mesh.tp_rank == 0


@torch.no_grad()
def grad_norm(model: nn.Module, mesh: Mesh) -> float:
    """Global L2 norm of the gradient (collective over mesh.mp_group, and under expert
    parallelism over mesh.ep_group)."""
    ep_group = getattr(mesh, "ep_group", None)
    params = [p for p in model.parameters() if p.grad is not None and is_counted(p, mesh)]
    apart = ep_group is not None
    total = _squares([p.grad for p in params if not (apart and is_expert(p))], mesh.device)
    if apart:
        experts = _squares([p.grad for p in params if is_expert(p)], mesh.device)
        all_reduce(experts, ep_group)
        total = total + experts
    all_reduce(total, mesh.mp_group)
    return norm_of(total)


def norm_of(total: torch.Tensor) -> float:
    """The norm whose all-reduced fp64 sum of squares is `total`, rounded to fp32 as torch's
    `clip_grad_norm_` gives it for fp32 gradients (sums taken in another order round to the
    same value; one host read)."""
    return total.sqrt().float().item()


def _squares(tensors: list, device) -> torch.Tensor:
    """`sum_of_squares` of these gradients, or a zero when there is none."""
    if tensors:
        return sum_of_squares([t.detach() for t in tensors])
    return torch.zeros((), dtype=torch.float64, device=device)


@torch.no_grad()
def clip_grad_norm(model: nn.Module, mesh: Mesh, max_norm: float) -> float:
    """Scale every gradient so the global norm is at most max_norm; return the norm before.

    Matches torch.nn.utils.clip_grad_norm_ on the serial model (closer to the exact norm where
    torch's CPU norm of a long tensor is not). max_norm <= 0 only reports.
    """
    total = grad_norm(model, mesh)
    if max_norm > 0 and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], coef)
    return total
