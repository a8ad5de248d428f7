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
| backward | re-gather X (async, once per shared X) while dX_i = dY_i W_i; dW_i = dY_i^T X |
|          | the summed dX reduce-scattered once, by the gather's own backward (as before) |

So per block the two whole-sequence inputs become slices (1 / t of them), for one all-gather
more per shared X in the backward (s b h / t elements sent per rank). Layers may also read
column ranges of one gathered X (DeepSeek-V3's q_b and kv_b read the q latent and the kv latent
of the latents that enter MLA's tp region together): `split_keeping_shard` splits X along its
last dim and tags each part with its columns of X's shard (`ShardColumns`), so those layers
save X's slice once between them, re-gather X once, and each reads its columns of it.

The re-gather starts in the backward of whichever reader autograd runs first, asynchronously,
and is waited for after that reader's input-gradient matmul (Megatron's overlap): the same
graph on every tp rank, so the same order of collectives on every rank (NCCL's rule), none
issued while it is in flight; the wait orders the stream on NCCL (no host sync) and is bounded
by the group's timeout on gloo.

The slice is saved through `ctx.save_for_backward` (what saved-tensor hooks and the dry run
see), cast once to the autocast dtype where autocast is on: what a plain linear would have
saved, 1 / t of it. Where this cannot apply the layers keep the gathered X as before
(`regathers`): zero-bubble deferred weight gradients (the store keeps X until W), float8
linears (torchao saves its own casts), full recomputation (the block is rebuilt in the
backward anyway), torch.compile'd blocks (the tag on X is not traced).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapar import device as _device
from megapar.comm_wait import blocked
from megapar.mesh import group_size
from megapar.tensor_parallel.sequence_parallel import (
    all_gather_flat,
    gather_buffer,
    gather_from_sequence_parallel_region,
    in_sequence_order,
)


class SequenceShard:
    """This rank's slice of one gathered X, shared by the layers that read X: the slice they
    save, the re-gathered X while their backwards run, and how many have yet to run."""

    def __init__(self, local: torch.Tensor, group) -> None:
        self.group = group
        self._local: torch.Tensor | None = local.detach()
        self._saved: torch.Tensor | None = None
        self._whole: torch.Tensor | None = None
        self._pending: tuple | None = None  # the re-gather in flight (`start`)
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

    def start(self, saved: torch.Tensor) -> None:
        """A reader's backward, before its input-gradient matmul: launch the all-gather of
        `saved` (its saved slice) unless a reader already did (once per shared X)."""
        if self._whole is None and self._pending is None:
            self._pending = _start_gather(saved, self.group)
            self.gathers += 1

    def whole(self) -> torch.Tensor:
        """X re-gathered: `start`'s all-gather waited for (never forever: on gloo the process
        group's timeout, on NCCL the stream ordered after it, as `megapar.device.wait`)."""
        if self._whole is None:
            assert self._pending is not None, "whole() before start()"
            self._whole, self._pending = _finish_gather(self._pending, self.group), None
        return self._whole

    def done(self) -> None:
        """A reader's backward finished; after the last, the re-gathered X is dropped."""
        self.readers -= 1
        if self.readers == 0:
            self._whole, self._saved = None, None


class ShardColumns:
    """Columns [start, stop) of the last dim of a `SequenceShard`'s X, for a layer that reads
    that part of X (`split_keeping_shard`): it saves and re-gathers X's whole slice, shared
    with the readers of X's other parts, and reads its columns of the re-gathered X."""

    def __init__(self, shard: SequenceShard, start: int, stop: int) -> None:
        self.shard = shard
        self.columns = slice(start, stop)

    def read(self) -> torch.Tensor:
        """A reader's forward: X's slice to save (`SequenceShard.read`), all its columns."""
        return self.shard.read()

    def start(self, saved: torch.Tensor) -> None:
        """`SequenceShard.start`: launch the re-gather of X unless a reader already did."""
        self.shard.start(saved)

    def whole(self) -> torch.Tensor:
        """This part of the re-gathered X: its columns (a view)."""
        return self.shard.whole()[..., self.columns]

    def done(self) -> None:
        """`SequenceShard.done`."""
        self.shard.done()


Shard = SequenceShard | ShardColumns
"""What a column-parallel layer reading a gathered X (or a part of it) keeps and re-gathers."""


def _start_gather(x: torch.Tensor, group) -> tuple:
    """`sequence_parallel.gather_sequence`'s all-gather, launched asynchronously."""
    x = x.contiguous()
    out = gather_buffer(x, group_size(group))
    return all_gather_flat(out, x, group, async_op=True), out, x


def _finish_gather(pending: tuple, group) -> torch.Tensor:
    """The gathered [b, s, ...] of `_start_gather`'s all-gather, once it completed (the ranks'
    slices put in sequence order: with b > 1 one copy, as `gather_sequence`)."""
    work, out, x = pending
    timeout_s = _device.process_group_timeout_s(group) or _device.DEFAULT_TIMEOUT_S
    with blocked(x.device):
        _device.wait(
            work,
            x.device,
            timeout_s,
            lambda: (
                f"rank {dist.get_rank()}: the --sp-regather all-gather of a layer's input "
                f"in the backward"
            ),
        )
    return in_sequence_order(out, x, group_size(group))


def gather_keeping_shard(x: torch.Tensor, group) -> torch.Tensor:
    """X all-gathered along the sequence (its gradient reduce-scattered in the backward, as
    `gather_from_sequence_parallel_region`), tagged with its `SequenceShard` (`shard_of`)."""
    whole = gather_from_sequence_parallel_region(x, group)
    whole.sp_shard = SequenceShard(x, group)  # type: ignore[attr-defined]  # a tag on the tensor
    return whole


def split_keeping_shard(x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """x split along its last dim into parts of `sizes` (views); where x carries a
    `SequenceShard` (`gather_keeping_shard`), each part carries its columns of it
    (`ShardColumns`), so the layers that read the parts keep only x's slice (once between
    them) and re-gather x once in the backward."""
    parts = x.split(sizes, dim=-1)
    shard = shard_of(x)
    if isinstance(shard, SequenceShard):
        start = 0
        for part, n in zip(parts, sizes, strict=True):
            part.sp_shard = ShardColumns(shard, start, start + n)  # a tag on the view
            start += n
    return parts


def shard_of(x: torch.Tensor) -> Shard | None:
    """The `SequenceShard` of a tensor made by `gather_keeping_shard`, the `ShardColumns` of a
    part of one (`split_keeping_shard`), else None."""
    return getattr(x, "sp_shard", None)


class _RegatheredLinear(torch.autograd.Function):
    """F.linear of the gathered X that saves only this rank's slice of X and re-gathers it for
    the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, shard: Shard):
        ctx.save_for_backward(shard.read(), weight)
        ctx.shard, ctx.has_bias = shard, bias is not None
        return F.linear(x, weight, bias)  # autocast (if on) casts here, as for F.linear

    @staticmethod
    def backward(ctx, grad_out):
        local, weight = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            ctx.shard.start(local)  # the re-gather runs while dX is computed
        grad_x = grad_out.matmul(weight.to(grad_out.dtype)) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            x = ctx.shard.whole()
            g = grad_out.reshape(-1, grad_out.shape[-1])
            grad_w = g.t().matmul(x.reshape(-1, x.shape[-1]).to(g.dtype))
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        ctx.shard.done()
        return grad_x, grad_w, grad_b, None


def regathered_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shard: Shard
) -> torch.Tensor:
    """X W^T + b (X from `gather_keeping_shard`, or a part of it from `split_keeping_shard`),
    keeping only `shard`'s slice for backward."""
    return _RegatheredLinear.apply(x, weight, bias, shard)
