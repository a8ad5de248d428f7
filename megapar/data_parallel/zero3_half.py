"""ZeRO-3's 16-bit all-gather: under bf16 / fp16 autocast, the weights of the blocks' parallel
linears gathered in the autocast dtype instead of fp32 (what FSDP2's
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` does for every parameter, here for the
weights autocast casts anyway).

Autocast casts a linear's fp32 weight to the autocast dtype before each product. The cast is
an elementwise rounding, so each rank can round its own slice and the ranks gather the 16-bit
values: the same 16-bit weight, bit for bit, for half the bytes an fp32 gather moves and holds.
A block's linear weights therefore form a unit of their own (`UnitMaker`: the block's *16-bit
unit*, gathered, freed and reduced with the block's unit, as a float8 unit is), and while a step
runs (`HalfGather.step`):

- each gather of a 16-bit unit rounds this rank's slice to a 16-bit shard (freed when the gather
  is done, as FSDP2 casts in its pre-all-gather) and all-gathers it into a 16-bit buffer,
  freed and re-gathered as the fp32 buffers are; the fp32 buffer is never gathered. Under
  --offload-params the slice is the fp32 host master copied to the device staging shard as for
  an fp32 gather, rounded there and the staging shard freed before the gather (not rounded on
  the host, which would cost host time on every gather: docs/guides/precision-zero.md);
- each linear reads its weight's view into that buffer (`tensor_parallel.weight_copy`) in place
  of autocast's cast, its gradient flowing to the fp32 weight through the cast's backward.

Gradients are unchanged: each weight's fp32 gradient accumulates in its unit's fp32 gradient
buffer and is reduce-scattered as before (FSDP2's ``reduce_dtype=torch.float32``). The other
parameters (norms, biases, embeddings, the head) are read in fp32 by ops autocast runs in fp32
or does not cast (an embedding's output keeps its weight's dtype), so they gather in fp32.
--compile'd blocks trace the copy's read (its live flag and autograd function). Outside a step
(evaluation, checkpoints, `whole()`) and where this is off (float8 linears, which cast the fp32
weight to float8 or gather float8: `zero3_float8.py`) the units gather fp32 as any other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from megapar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megapar.tensor_parallel.weight_copy import WeightCopy


def half_weights(stage: nn.Module) -> dict[int, ColumnParallelLinear | RowParallelLinear]:
    """id(weight) -> its linear, for the column- and row-parallel linears in the stage's blocks
    (``chunk.layers``) that are not float8: the weights ZeRO-3 can gather in 16 bits."""
    out: dict[int, ColumnParallelLinear | RowParallelLinear] = {}
    for chunk in getattr(stage, "chunks", [stage]):
        layers = getattr(chunk, "layers", None)
        if layers is None:
            continue
        for module in layers.modules():
            linear = isinstance(module, ColumnParallelLinear | RowParallelLinear)
            if linear and module.fp8 is None and module.weight.requires_grad:
                out[id(module.weight)] = module
    return out


class HalfShard:
    """A 16-bit unit's 16-bit state: the 16-bit shard a gather sends (this rank's slice
    rounded, made for each gather and freed when it is done) and the 16-bit buffer the gather
    fills, which each linear of the unit reads its weight from (`WeightCopy`)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        linears: list[ColumnParallelLinear | RowParallelLinear],
        dtype: torch.dtype,
        unit_range: tuple[int, int],
        padded: int,
    ):
        """`params` (each read by the linear at the same place in `linears`) laid out back to
        back in a flat buffer of `padded` elements of which this rank holds `unit_range`
        [lo, hi); gathered in `dtype`."""
        lo, hi = unit_range
        device = params[0].device
        self.active = False
        """A step is running (`HalfGather.step`): gathers move `shard` into `full`."""
        self.shard = torch.zeros(hi - lo, dtype=dtype, device=device)
        """This rank's slice of the unit in `dtype`; storage of size 0 but while a gather of it
        runs."""
        self.full = torch.zeros(padded, dtype=dtype, device=device)
        """The gathered 16-bit weights; storage of size 0 while freed."""
        self.copies: list[WeightCopy] = []
        """Per parameter, its `WeightCopy` (attached to its linear): a view into `full`."""
        offset = 0
        for p, linear in zip(params, linears, strict=True):
            # .data: a view with a version counter of its own (see `WeightCopy.tensor`)
            copy = WeightCopy(self.full[offset : offset + p.numel()].view(p.shape).data)
            linear.weight_copy = copy
            self.copies.append(copy)
            offset += p.numel()
        self.nbytes = self.full.untyped_storage().nbytes()
        self.itemsize = self.full.element_size()
        """Bytes an element of `full` and `shard` takes."""
        self.shard_nbytes = self.shard.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.shard.untyped_storage().resize_(0)

    @torch.no_grad()
    def cast(self, shard: torch.Tensor) -> None:
        """Fill `self.shard` with the fp32 `shard` rounded to the 16-bit dtype (as autocast's
        cast of the weight rounds it)."""
        self.shard.untyped_storage().resize_(self.shard_nbytes)
        self.shard.copy_(shard)

    def drop_shard(self) -> None:
        """Free the 16-bit shard (its gather is done)."""
        self.shard.untyped_storage().resize_(0)

    def live(self, on: bool) -> None:
        """Start (True) or end a step: gathers move 16 bits and the linears read the copies."""
        self.active = on
        for copy in self.copies:
            copy.live = on


class HalfGather:
    """The 16-bit units of a stage (`Unit.cast` a `HalfShard`) and the step in which they
    gather 16 bits (`step`)."""

    def __init__(self, units: list):
        self.units = [u for u in units if isinstance(u.cast, HalfShard)]

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step's 16-bit gathers; on leaving, every unit still gathered in 16
        bits is freed and gathers are fp32 again."""
        for u in self.units:  # gathered in fp32 (by a caller outside a step): free it first
            u.settle()
            u.cast.live(True)
        try:
            yield
        finally:
            for u in self.units:
                u.settle()
                u.cast.live(False)
