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

Each rank's sum of squares (`sum_of_squares`) is accurate to fp32 rounding whatever the tensors'
sizes, so a gradient has the same norm however a layout shards it: torch's CPU norm kernel adds a
tensor's squares into one running fp32 sum (pytorch/pytorch#169237), whose error grows with the
tensor's size, so a CPU tensor is normed in pieces of `CPU_NORM_PIECE` elements.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megapar.expert_parallel import is_expert
from megapar.mesh import Mesh, all_reduce

CPU_NORM_PIECE = 1 << 14
"""Elements per piece of a CPU tensor whose norm `sum_of_squares` takes on its own (short
enough for torch's CPU kernel to sum its squares to fp32 rounding)."""


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of every element of `tensors` (fp32, 0-d), from one foreach
    norm over the tensors, each CPU tensor cut into pieces of at most `CPU_NORM_PIECE` elements
    (views, no copy; CUDA reduces a whole tensor in a tree, to fp32 rounding, so its tensors go
    whole). `tensors` must not be empty."""
    pieces = []
    for t in tensors:
        t = t if t.dtype == torch.float32 else t.float()
        if t.device.type == "cpu" and t.numel() > CPU_NORM_PIECE:
            pieces.extend(t.reshape(-1).split(CPU_NORM_PIECE))
        else:
            pieces.append(t)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(pieces))).pow(2)


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
    return math.sqrt(total.item())


def _squares(tensors: list, device) -> torch.Tensor:
    """`sum_of_squares` of these gradients, or a zero when there is none."""
    if tensors:
        return sum_of_squares([t.detach() for t in tensors])
    return torch.zeros((), dtype=torch.float32, device=device)


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
