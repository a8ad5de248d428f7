"""The zero-bubble split of a stage's backward: B (input gradient) now, W (weight gradients) later.

`backward_input` computes d(loss)/d(input) only, the gradient the previous stage waits for, and
keeps what the weight gradients need: autograd's gradients at the nodes that lead to the
parameters (captured during B). `backward_weight` finishes from those captured gradients
without recomputing B's part of the graph, and adds the result IN PLACE into `param.grad`
(`grad += dw`), so `.grad` tensors that are views into a flat buffer (data-parallel buckets)
keep being those views. Built on torch.distributed.pipelining's own split
(`stage_backward_input` / `stage_backward_weight`, what its zero-bubble schedules run).

A stage without an input (the model's first slice) has no B to speed up: B does nothing and W
runs the whole backward (as torch does).
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight


class PendingWeightGrad:
    """What W of one micro-batch of one chunk needs from its B."""

    def __init__(self, output: torch.Tensor, grad: torch.Tensor | None, groups):
        self.output, self.grad, self.groups = output, grad, groups


def backward_input(output: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None,
                   params: list[torch.nn.Parameter]):
    """B: returns (d loss / d inp or None, the PendingWeightGrad for W). `grad` is None when
    `output` is the (scaled) loss."""
    if inp is None:
        return None, PendingWeightGrad(output, grad, None)
    grads, groups = stage_backward_input([output], None if grad is None else [grad], [inp],
                                         iter(params))
    return grads[0], PendingWeightGrad(None, None, groups)


def backward_weight(pending: PendingWeightGrad, params: list[torch.nn.Parameter]) -> None:
    """W: accumulate the weight gradients of one B into `param.grad`, in place."""
    if pending.groups is not None:
        stage_backward_weight(iter(params), pending.groups)
        return
    grads = torch.autograd.grad(pending.output, params, pending.grad, allow_unused=True)
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)
