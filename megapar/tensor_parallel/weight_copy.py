"""A parallel linear's weight read from a 16-bit copy made elsewhere: ZeRO-3 gathers the
blocks' linear weights in the autocast dtype (`data_parallel.zero3_half`), and a linear then
multiplies by that copy instead of casting its fp32 weight, whose gathered buffer is never
filled during a step.

Under autocast a linear casts its fp32 weight W to the autocast dtype (an elementwise rounding)
and multiplies; W's gradient comes back through the cast (``ToCopyBackward``: the 16-bit dW
cast up to fp32). The copy holds the same bits as that cast (each rank rounds its slice before
the gather), and `WeightCopy.read` hands it to the matmul through `_ReadCopy`, whose backward is
the cast's: every product and the weight's fp32 gradient are bit for bit those of the fp32
weight under autocast.
"""

from __future__ import annotations

import torch


class WeightCopy:
    """The 16-bit copy of one linear's weight (a view into a gathered buffer) and whether it
    holds this step's values (`live`)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        """The copy, [out, in] as the weight: a view into a buffer filled by a gather, with
        its own version counter (a re-gather into the buffer is not an in-place change of the
        values autograd saved: they are the same)."""
        self.live = False
        """The gathers fill the copy (inside a ZeRO-3 step); False: read the weight."""

    def read(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as the matmul takes it: the copy, its gradient flowing to `weight` in
        `weight`'s dtype. Only under autocast to the copy's dtype (what the copy stands for)."""
        kind = weight.device.type
        dtype = self.tensor.dtype
        if not torch.is_autocast_enabled(kind) or torch.get_autocast_dtype(kind) != dtype:
            raise RuntimeError(
                f"a ZeRO-3 step gathered this linear's weight in {dtype} for autocast to "
                f"{dtype}, but the forward runs without it: run a step's forwards under the "
                "precision's autocast"
            )
        if torch.is_grad_enabled() and weight.requires_grad:
            return _ReadCopy.apply(weight, self.tensor)
        return self.tensor


class _ReadCopy(torch.autograd.Function):
    """The copy, standing in for ``weight.to(copy.dtype)``: its gradient goes to `weight`, cast
    to `weight`'s dtype (the cast's backward)."""

    @staticmethod
    def forward(ctx, weight, copy):
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def weight_as_read(layer) -> torch.Tensor:
    """`layer.weight` as its matmul reads it: the 16-bit copy where a live one is attached
    (`layer.weight_copy`), else the weight itself."""
    copy: WeightCopy | None = layer.weight_copy
    if copy is None or not copy.live:
        return layer.weight
    return copy.read(layer.weight)
