"""Sequence parallelism that keeps only this rank's slice of a column-parallel layer's input
(`--sp-regather`, Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication` with
sequence_parallel=True).

Under sequence parallelism a column-parallel layer all-gathers its input X along the sequence.
A plain linear then saves the gathered X ([b, s, h], whole) for its weight gradient. Here the
layers that read one gathered X (q, k and v; gate and up; GPT-2's fused qkv; fc) keep only this
rank's [b, s / t, h] slice instead, and the first of them to run its backward all-gathers it
again; the others reuse that copy, which is dropped after the last one:

| step     | what runs                                                                     |
|----------|-------------------------------------------------------------------------------|
| forward  | gather X (`gather_keeping_shard`), Y_i = X W_i^T + b_i, keep my slice of X    |
| backward | dX_i = dY_i W_i; re-gather X once per shared X; dW_i = dY_i^T X; db_i         |
|          | the summed dX reduce-scattered once, by the gather's own backward (as before) |

So per block the two whole-sequence inputs become slices (1 / t of them), for one all-gather
more per shared X in the backward (s b h / t elements sent per rank). The re-gather runs in the
backward of whichever reader autograd runs first: the same graph on every tp rank, so the same
order of collectives on every rank (NCCL's rule); it waits on nothing but the collective.

The slice is saved through `ctx.save_for_backward` (what saved-tensor hooks and the dry run
see), cast once to the autocast dtype where autocast is on: what a plain linear would have
saved, 1 / t of it. Where this cannot apply the layers keep the gathered X as before
(`regathers`): zero-bubble deferred weight gradients (the store keeps X until W), float8
linears (torchao saves its own casts), full recomputation (the block is rebuilt in the
backward anyway), torch.compile'd blocks (the tag on X is not traced).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapar.tensor_parallel.sequence_parallel import (
    gather_from_sequence_parallel_region,
    gather_sequence,
)


class SequenceShard:
    """This rank's slice of one gathered X, shared by the layers that read X: the slice they
    save, the re-gathered X while their backwards run, and how many have yet to run."""

    def __init__(self, local: torch.Tensor, group) -> None:
        self.group = group
        self._local: torch.Tensor | None = local.detach()
        self._saved: torch.Tensor | None = None
        self._whole: torch.Tensor | None = None
        self.readers = 0
        """Readers whose backward has not run yet."""
        self.gathers = 0
        """Re-gathers made (one per backward of the shared X)."""

    def read(self) -> torch.Tensor:
        """A reader's forward: the slice to save (in the autocast dtype where autocast is on,
        cast once for all readers)."""
        self.readers += 1
        if self._saved is None:
            assert self._local is not None, "a reader joined after the backward began"
            local, device = self._local, self._local.device.type
            if torch.is_autocast_enabled(device):
                local = local.to(torch.get_autocast_dtype(device))
            self._saved, self._local = local, None
        return self._saved

    def whole(self, saved: torch.Tensor) -> torch.Tensor:
        """A reader's backward: X re-gathered from `saved` (its saved slice), once for all."""
        if self._whole is None:
            self._whole = gather_sequence(saved, self.group)
            self.gathers += 1
        return self._whole

    def done(self) -> None:
        """A reader's backward finished; after the last, the re-gathered X is dropped."""
        self.readers -= 1
        if self.readers == 0:
            self._whole, self._saved = None, None


def gather_keeping_shard(x: torch.Tensor, group) -> torch.Tensor:
    """X all-gathered along the sequence (its gradient reduce-scattered in the backward, as
    `gather_from_sequence_parallel_region`), tagged with its `SequenceShard` (`shard_of`)."""
    whole = gather_from_sequence_parallel_region(x, group)
    whole.sp_shard = SequenceShard(x, group)  # type: ignore[attr-defined]  # a tag on the tensor
    return whole


def shard_of(x: torch.Tensor) -> SequenceShard | None:
    """The `SequenceShard` of a tensor made by `gather_keeping_shard`, else None."""
    return getattr(x, "sp_shard", None)


class _RegatheredLinear(torch.autograd.Function):
    """F.linear of the gathered X that saves only this rank's slice of X and re-gathers it for
    the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, shard: SequenceShard):
        ctx.save_for_backward(shard.read(), weight)
        ctx.shard, ctx.has_bias = shard, bias is not None
        return F.linear(x, weight, bias)  # autocast (if on) casts here, as for F.linear

    @staticmethod
    def backward(ctx, grad_out):
        local, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight.to(grad_out.dtype)) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            x = ctx.shard.whole(local)
            g = grad_out.reshape(-1, grad_out.shape[-1])
            grad_w = g.t().matmul(x.reshape(-1, x.shape[-1]).to(g.dtype))
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        ctx.shard.done()
        return grad_x, grad_w, grad_b, None


def regathered_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shard: SequenceShard
) -> torch.Tensor:
    """X W^T + b (X from `gather_keeping_shard`), keeping only `shard`'s slice for backward."""
    return _RegatheredLinear.apply(x, weight, bias, shard)
