"""Global gradient-norm clipping across tensor, pipeline and data parallelism.

The norm is the L2 norm of the whole model's gradient, each parameter counted once:

- a tp-sharded parameter contributes its shard on every tp rank (shards are disjoint; padding
  rows of a vocab-parallel tensor have zero gradient);
- a tp-replicated parameter (tp_dim None, e.g. LayerNorm) is counted on tp rank 0 only;
- a tied copy (`param.tied_to`, the last stage's LM head) is not counted: after the tied sync
  its gradient equals the embedding's, which the first stage counts;
- the sum of squares is reduced over the model-parallel group (tp x pp). Gradients are already
  averaged over dp, so every dp replica computes the same norm and nothing crosses dp.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megapar.mesh import Mesh, all_reduce


def _counted(param: nn.Parameter, mesh: Mesh) -> bool:
    if getattr(param, "tied_to", None) is not None:
        return False
    return getattr(param, "tp_dim", None) is not None or mesh.tp_rank == 0


@torch.no_grad()
def grad_norm(model: nn.Module, mesh: Mesh) -> float:
    """Global L2 norm of the gradient (collective over mesh.mp_group)."""
    grads = [p.grad.detach() for p in model.parameters()
             if p.grad is not None and _counted(p, mesh)]
    if grads:  # foreach kernels: one norm per tensor, then the norm of the norms
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        total = torch.linalg.vector_norm(torch.stack(norms)).pow(2)
    else:
        total = torch.zeros((), dtype=torch.float32, device=mesh.device)
    all_reduce(total, mesh.mp_group)
    return math.sqrt(total.item())


@torch.no_grad()
def clip_grad_norm(model: nn.Module, mesh: Mesh, max_norm: float) -> float:
    """Scale every gradient so the global norm is at most max_norm; return the norm before.

    Matches torch.nn.utils.clip_grad_norm_ on the serial model. max_norm <= 0 only reports.
    """
    total = grad_norm(model, mesh)
    if max_norm > 0 and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None],
                                coef)
    return total
