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
    """Each tensor's sum of the squares of its elements (fp64, one element a tensor), each
    accumulated in fp64. `tensors` must not be empty and share one device. Off the CPU one
    foreach norm (CUDA's fused kernel reads each tensor in its own dtype and reduces a whole
    tensor in a tree); on the CPU `_cpu_squares_each`."""
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).square()
    return _cpu_squares_each(tensors)


CPU_NORM_STAGE = 64 * CPU_NORM_PIECE
"""Elements of a CPU tensor cast to fp64 at a time (8 MiB), a whole number of pieces."""


def _cpu_squares_each(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`squares_each` on the CPU: each tensor cut into pieces of at most `CPU_NORM_PIECE`
    elements, each piece normed in fp64, the pieces' squares added back in order. The fp64
    copies go through one staging buffer, `CPU_NORM_STAGE` elements at a time, and the norms
    into one preallocated vector, so the tensors made do not grow with the pieces: a copy and
    a norm per piece (a foreach norm's) leave a hole under a live norm per piece in glibc's
    heap, which the next copy may not fit (docs/performance.md, "At the peak the OS sees")."""
    cpu, f64 = tensors[0].device, torch.float64
    counts = [max(1, -(-t.numel() // CPU_NORM_PIECE)) for t in tensors]
    norms = torch.zeros(sum(counts), dtype=f64, device=cpu)  # an empty tensor's piece: 0
    staging = torch.empty(
        min(max(t.numel() for t in tensors), CPU_NORM_STAGE), dtype=f64, device=cpu
    )
    at = 0
    for t in tensors:
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), CPU_NORM_STAGE):
            part = staging[: min(CPU_NORM_STAGE, flat.numel() - start)]
            part.copy_(flat[start : start + part.numel()])
            rows, rest = divmod(part.numel(), CPU_NORM_PIECE)
            if rows:
                whole = part[: rows * CPU_NORM_PIECE].view(rows, CPU_NORM_PIECE)
                torch.linalg.vector_norm(whole, dim=1, out=norms[at : at + rows])
            if rest:
                torch.linalg.vector_norm(part[rows * CPU_NORM_PIECE :], out=norms[at + rows])
            at += rows + (rest > 0)
        at += flat.numel() == 0
    sq = norms.square_()
    if len(norms) == len(tensors):
        return sq
    owner = torch.arange(len(tensors), device=cpu).repeat_interleave(
        torch.tensor(counts, device=cpu), output_size=len(norms)
    )
    each = torch.zeros(len(tensors), dtype=f64, device=cpu)  # CPU: index_add_ adds in order
    return each.index_add_(0, owner, sq)


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
    total = squares_of([p.grad for p in params if not (apart and is_expert(p))], mesh.device)
    if apart:
        experts = squares_of([p.grad for p in params if is_expert(p)], mesh.device)
        all_reduce(experts, ep_group)
        total = total + experts
    all_reduce(total, mesh.mp_group)
    return norm_of(total)


def norm_of(total: torch.Tensor) -> float:
    """The norm whose all-reduced fp64 sum of squares is `total`, rounded to fp32 as torch's
    `clip_grad_norm_` gives it for fp32 gradients (sums taken in another order round to the
    same value; one host read)."""
    return total.sqrt().float().item()


def squares_of(tensors: list, device) -> torch.Tensor:
    """`sum_of_squares` of these gradients, or an fp64 zero on `device` when there is none."""
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
    scale_to(max_norm, total, [p.grad for p in model.parameters() if p.grad is not None])
    return total


def scale_to(max_norm: float, norm: float, grads: list[torch.Tensor]) -> None:
    """torch's `clip_grad_norm_` rule on gradients whose global norm is `norm`: each multiplied
    by max_norm / (norm + 1e-6) where that is below one; none where max_norm <= 0 (report
    only) or the norm is not finite (the step is skipped or stopped elsewhere)."""
    if max_norm > 0 and math.isfinite(norm) and grads:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
