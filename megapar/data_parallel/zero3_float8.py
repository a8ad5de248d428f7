"""ZeRO-3's float8 all-gather: the weights of tensorwise `--fp8` linears gathered as float8
bytes instead of fp32 (torchao's ``enable_fsdp_float8_all_gather`` for FSDP2, for megapar's
units).

A float8 linear casts its weight to float8 before each product anyway, with one scale for the
whole weight (tensorwise; the amax MAX-reduced over tp, `tensor_parallel.fp8`). The cast is
elementwise, so each rank can cast its own slice of the weight with the weight's scale and the
ranks gather the float8 bytes: the same float8 weight, bit for bit, for a quarter of the bytes
an fp32 gather moves and holds. A stage's float8 weights therefore form units of their own
(`UnitMaker`: a block's *float8 unit*, gathered, freed and reduced with the block's unit, as
an experts' unit is), and while a step runs (`Float8Gather.step`):

- once, at the step's start, each weight's piece in this rank's shard is measured (its amax),
  the amaxes of the whole stage are MAX-reduced in one all-reduce over the unit group (cp x
  dp: each rank holds a piece of every weight) and one over tp (the weights are tp shards),
  and each weight's scale is made from its amax (torchao's `amax_to_scale`);
- each gather of a float8 unit casts this rank's slice to a float8 shard with those scales
  (torchao's `hp_tensor_and_scale_to_float8`; 1 byte an element, freed when the gather is
  done, as FSDP2 casts in its pre-all-gather) and all-gathers the shards as bytes into a
  float8 buffer (`Unit.launch_gather`), freed and re-gathered as the fp32 buffers are; the
  fp32 buffer is never gathered;
- the step's `Fp8WeightCache` holds each weight's float8 tensor, a view into that buffer with
  its scale, which the float8 matmul takes instead of casting (forward and dX: tensorwise
  casts the weight once for both); the weight's fp32 values are not read.

Gradients are unchanged: each weight's gradient accumulates in its unit's fp32 gradient buffer
and is reduce-scattered as before. Outside a step (evaluation, checkpoints, `whole()`) and
where this is off (rowwise scales, --compile'd blocks, which cast inside the traced graph, and
--offload-params, whose shards are on the host) the units gather fp32 as any other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megapar.data_parallel.buckets import slice_pieces
from megapar.tensor_parallel.fp8 import Fp8Spec, Fp8WeightCache, scale_of, to_float8, weight_slot


def float8_weights(stage: nn.Module) -> dict[int, Fp8Spec]:
    """id(weight) -> its layer's `Fp8Spec`, for the stage's tensorwise float8 linears (the
    weights ZeRO-3 can gather in float8)."""
    out = {}
    for module in stage.modules():
        spec = getattr(module, "fp8", None)
        if isinstance(spec, Fp8Spec) and _tensorwise(spec):
            out[id(module.weight)] = spec
    return out


def _tensorwise(spec: Fp8Spec) -> bool:
    config_mod = spec.ao[0]
    cast = spec.config.cast_config_weight
    tensorwise = config_mod.ScalingGranularity.TENSORWISE
    return cast.scaling_granularity is tensorwise and (
        spec.config.cast_config_weight_for_grad_input == cast
    )


class Float8Shard:
    """A float8 unit's float8 state: each weight's spec, piece of this rank's shard and scale
    of the step, the float8 shard a gather sends (this rank's slice cast with each weight's
    scale, made for each gather and freed when it is done, as FSDP2 casts in its pre-all-gather)
    and the float8 buffer the gather fills."""

    def __init__(self, params: list[nn.Parameter], specs: list[Fp8Spec], unit_range, padded):
        """`params` and their `specs` in the unit's order, laid out back to back in a flat
        buffer of `padded` elements of which this rank holds `unit_range` [lo, hi)."""
        self.params, self.specs = params, specs
        """The unit's parameters (in its order) and each one's layer's `Fp8Spec`."""
        self.active = False
        """A step is running (`Float8Gather.step`): gathers move `shard` into `full`."""
        lo, hi = unit_range
        self.pieces = [(0, 0)] * len(params)
        """Per parameter, the [lo, hi) of its piece in this rank's shard (empty: none)."""
        offsets = [0, *accumulate(p.numel() for p in params)]
        for i, start, end in slice_pieces([p.numel() for p in params], lo, hi):
            self.pieces[i] = (offsets[i] + start - lo, offsets[i] + end - lo)
        self.scales: list[torch.Tensor] = []
        """Per parameter, its float8 scale in this step (`Float8Gather.step` sets them)."""
        device = params[0].device
        self.shard = torch.zeros(hi - lo, dtype=torch.uint8, device=device)
        """This rank's slice of the unit in float8 (as bytes); storage of size 0 but while a
        gather of it runs."""
        self.full = torch.zeros(padded, dtype=torch.uint8, device=device)
        """The gathered float8 weights (as bytes); storage of size 0 while freed."""
        self.weights_t = []
        """Per parameter, its float8 W^T [K, N]: a view into `full` (made while it has
        storage; it sees the bytes each gather writes there)."""
        for p, spec, offset in zip(params, specs, offsets[:-1], strict=True):
            dtype = spec.config.cast_config_weight.target_dtype
            view = self.full[offset : offset + p.numel()].view(dtype).view(p.shape).t()
            self.weights_t.append(view)
        self.nbytes = self.full.untyped_storage().nbytes()
        self.itemsize = 1
        """Bytes an element of `full` and `shard` takes."""
        self.shard_nbytes = self.shard.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.shard.untyped_storage().resize_(0)

    @torch.no_grad()
    def cast(self, shard: torch.Tensor) -> None:
        """Fill `self.shard` with the fp32 `shard` cast to float8, each weight's piece with its
        scale (torchao's `hp_tensor_and_scale_to_float8`); the padding is zero."""
        self.shard.untyped_storage().resize_(self.shard_nbytes)
        self.shard.zero_()
        for (lo, hi), scale, spec in zip(self.pieces, self.scales, self.specs, strict=True):
            if hi > lo:
                cast = spec.config.cast_config_weight
                role = spec.ao[1].GemmInputRole.WEIGHT
                f8 = to_float8(shard[lo:hi], scale, cast, role, None, spec)
                self.shard[lo:hi].copy_(f8._data.view(torch.uint8))

    def drop_shard(self) -> None:
        """Free the float8 shard (its gather is done)."""
        self.shard.untyped_storage().resize_(0)


class Float8Gather:
    """The float8 units of a stage (`Unit.float8` set) and the step in which they gather
    float8 (`step`)."""

    def __init__(self, units: list, tp_group):
        self.units = [u for u in units if isinstance(u.cast, Float8Shard)]
        self.tp_group = tp_group
        """The group the weights are split over (tp), over which their amax is reduced too;
        None at tp 1."""

    @contextlib.contextmanager
    def step(self, cache: Fp8WeightCache) -> Iterator[None]:
        """One optimizer step's float8 gathers: every weight's scale made (collective), its
        float8 tensor put in `cache` (kept while its `per_step` runs); on leaving, every unit
        still gathered in float8 is freed and gathers are fp32 again."""
        with cache.per_step():
            if self.units:
                self._scales(cache)
            try:
                yield
            finally:
                for u in self.units:
                    u.settle()
                    u.cast.active = False

    @torch.no_grad()
    def _scales(self, cache: Fp8WeightCache) -> None:
        """Each float8 weight's scale from its amax, MAX-reduced over the units' group and tp
        (one all-reduce each for the stage), and its float8 tensor in `cache`."""
        for u in self.units:  # gathered in fp32 (by a caller outside a step): free it first
            u.settle()
        amaxes = torch.stack(
            [
                _piece_amax(u.shard, lo, hi, spec)
                for u in self.units
                for (lo, hi), spec in zip(u.cast.pieces, u.cast.specs, strict=True)
            ]
        )
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=self.units[0].group)
        if self.tp_group is not None:
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=self.tp_group)
        at = 0
        for u in self.units:
            f8 = u.cast
            f8.scales = [
                scale_of(amaxes[at + j].clone(), spec.config.cast_config_weight, spec)
                for j, spec in enumerate(f8.specs)
            ]
            at += len(f8.specs)
            for p, w_t, scale, spec in zip(f8.params, f8.weights_t, f8.scales, f8.specs):
                slot = weight_slot(id(p), spec.config.cast_config_weight, 0, spec)
                cache.casts[slot] = _weight(w_t, p, scale, spec)
            f8.active = True


def _piece_amax(shard: torch.Tensor, lo: int, hi: int, spec: Fp8Spec) -> torch.Tensor:
    """The amax of shard[lo:hi] as torchao measures a tensorwise operand (0 when empty)."""
    if hi == lo:
        return shard.new_zeros(())
    tensorwise = spec.ao[0].ScalingGranularity.TENSORWISE
    return spec.ao[2].tensor_to_amax(shard[lo:hi], False, None, tensorwise, None)


def _weight(data: torch.Tensor, p: nn.Parameter, scale, spec: Fp8Spec) -> Any:
    """Weight `p`'s float8 tensor as the matmul takes it (W^T, [K, N]): its bytes `data` in
    the float8 buffer (valid while the unit is gathered) with its scale."""
    tensor_mod = spec.ao[1]
    return tensor_mod.Float8TrainingTensor(
        data, scale, p.dtype, spec.mm_config, tensor_mod.GemmInputRole.WEIGHT, None
    )
