"""The grad-sync protocol: how a stage's gradients are reduced over the data-parallel group
during a step, and the one place its kind is chosen (`build_grad_sync`).

The pipeline executor drives a `GradSync` through each training step (`begin_step`, `arm` /
`before_last_backward` before the backwards that make gradients final, `grads_ready` from code
that accumulates weight gradients itself, `finish` after the schedule); autograd's hooks report
the other gradients. One class per kind implements it:

- all-reduce (``--zero 0``, or dp x cp = 1): `buckets.GradBuckets`; after `finish` every
  averaged gradient is in ``.grad``;
- ZeRO-1: `zero_buckets.Zero1Buckets`; this rank's slice of each bucket is averaged (the rest
  of the buffer unreduced);
- ZeRO-2: `zero_buckets.Zero2Buckets`; only this rank's slices exist, in persistent shards;
- ZeRO-3: `sharded_params.ShardedParams`; only this rank's slices of each unit's gradient.

Under expert parallelism (ep > 1) the all-reduce and ZeRO-1 / ZeRO-2 kinds put expert parameters
(`megapar.expert_parallel.is_expert`) into buckets of their own, reduced over
`Mesh.expert_dp_group` (the ranks holding the same experts) instead of the cp x dp group, in the
one launch order of all buckets; ZeRO-3 puts them into units of their own, sharded, gathered and
reduce-scattered over that group, each led by its block's unit (`zero3_units.UnitMaker`).

The sharded kinds also take `defer(last, before_reduce)` from the distributed optimizer's
`attach`: the tied embedding's gradient is reduced last, after its sum over the first and last
pipeline stage. The all-reduce kind takes it from the step (`TrainStep`) when its reduction
rounds (`GradBuckets.defers_last`: a compressor, or a 16-bit `reduce_dtype`, is not linear, so it
must reduce the stages' sum, as pp 1 does); exact, it reduces each stage's share and the step
sums them afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from megapar.data_parallel.buckets import GradBuckets
from megapar.data_parallel.sharded_params import ShardedParams
from megapar.data_parallel.zero3_half import half_weights
from megapar.data_parallel.zero_buckets import Zero1Buckets, Zero2Buckets
from megapar.expert_parallel import is_expert
from megapar.tensor_parallel.partition import shared_embedding_params
from megapar.tensor_parallel.sequence_parallel import sequence_parallel_params


class GradSync(Protocol):
    """A stage's gradient synchronisation over the data-parallel group, driven by the
    executor once per training step. Besides these, the training step reads what only some
    kinds have where they have it: the all-reduce's `GradBuckets.defers_last` and
    `compressor`, ZeRO-3's `ShardedParams.float8` and `step_scope`."""

    @property
    def stage(self) -> int:
        """The ZeRO stage served: 0 (all-reduce), 1, 2 or 3."""

    @property
    def sharded(self) -> bool:
        """The optimizer state is this rank's slices: the distributed optimizer attaches to it
        (`ZeroOptimizer.attach`) and steps, clips and checks only those slices."""

    @property
    def sharded_grads(self) -> bool:
        """After `finish` the reduced gradients exist only as this rank's slices (ZeRO-2,
        ZeRO-3): what is partial over tp is summed on the optimizer's pieces."""

    @property
    def reduces_every_micro_batch(self) -> bool:
        """Every micro-batch's backward reduces (ZeRO-2, ZeRO-3 with --zero3-reduce
        micro-batch), not only the last one's."""

    in_step: bool
    """Between `begin_step` and `finish`."""

    @property
    def buckets(self) -> Sequence[Any]:
        """The units of reduction, in launch order: buckets of `.grad` views (all-reduce,
        ZeRO-1/2) or ZeRO-3's units; the optimizer and the dry run read them."""

    def begin_step(self) -> None:
        """Before the step's first backward: zero the gradients this sync owns, disarm the
        hooks (nothing is reduced while the first micro-batches accumulate, except by the
        kinds that reduce every micro-batch)."""

    def arm(self, params: Iterable[nn.Parameter]) -> None:
        """Right before a model chunk's last backward (several chunks per stage): these
        parameters' gradients become final in it, so their reductions may start then."""

    def before_last_backward(self) -> None:
        """Right before the stage's last backward: every gradient becomes final in it."""

    def grads_ready(self, params: Iterable[nn.Parameter]) -> None:
        """These parameters' gradients are final (from code that accumulates weight gradients
        itself, e.g. zero-bubble schedules' W, instead of through autograd's hooks)."""

    def finish(self) -> None:
        """After the schedule: launch every reduction not launched yet and wait for all."""

    def reduced_part(self, param: nn.Parameter) -> torch.Tensor:
        """What this rank holds of `param`'s reduced gradient once `finish` returned, in place:
        all of it (all-reduce), or the slice of a bucket or unit `param` has to itself (ZeRO:
        the tied embedding's, laid out so that the first and the last stage cut it alike)."""

    def defer(self, last: Iterable[nn.Parameter], before_reduce) -> None:
        """The buckets or units holding `last` (the tied embedding's parameters) reduce only
        in `finish`, after `before_reduce()` (their sum over the first and last stage); called
        before the first step."""


def summed_before_reduction(model: nn.Module, mesh) -> list[nn.Parameter]:
    """The parameters whose gradient is a sum of shares taken on other ranks than dp's, which
    a reduction that rounds (the all-reduce kind's compressors, a 16-bit reduce dtype:
    `GradBuckets.defers_last`) must reduce only once summed, as one process has it: the tied
    embedding (`shared_embedding`) over the first and last stage, and with tp > 1 the
    parameters partial over tp (sequence parallelism's replicated ones, Llama's whole k / v).
    Laid out last, in this order; the step defers them (`TrainStep`)."""
    last = list(shared_embedding_params(model)) if mesh.pp > 1 else []
    if mesh.tp > 1:
        seen = {id(p) for p in last}
        last += [p for p in sequence_parallel_params(model) if id(p) not in seen]
    return last


def build_grad_sync(
    model: nn.Module,
    mesh,
    zero: int = 0,
    bucket_mb: float = 25.0,
    compressor=None,
    reduce_dtype: torch.dtype | None = None,
    zero3_keep_params: bool = False,
    zero3_persistence_threshold: int = 0,
    offload_params: bool = False,
    zero3_reduce: str = "step",
    zero3_float8: bool = False,
    zero3_half: torch.dtype | None = None,
    zero12_half: torch.dtype | None = None,
) -> GradSync:
    """The grad sync of `model` (this rank's stage) over `mesh.dp_cp_group`, summed over cp
    and averaged over dp: the all-reduce kind when `zero` is 0 or there is no rank to shard
    over (dp x cp = 1), else the ZeRO-`zero` kind (the tied embedding laid out last, to be
    deferred by the optimizer's `attach`; in the all-reduce kind only where its reduction
    rounds, a compressor or a 16-bit `reduce_dtype`, to be deferred by the step).
    `compressor` (a `compression.py` compressor) replaces `reduce_dtype`; the zero3 options
    are `ShardedParams`' (`zero3_float8`: its
    `float8`; `zero3_half`: its `half`). `zero12_half` (ZeRO-1 / 2): the autocast dtype the
    optimizer all-gathers the blocks' non-float8 linear weights in (`zero3_half.half_weights`,
    experts' left out), laid out in buckets of their own; None: every bucket gathers fp32.
    Under ep > 1 expert parameters reduce over `mesh.expert_dp_group` (ZeRO-3: are sharded
    over it)."""
    group, dp = mesh.dp_cp_group, mesh.dp
    experts = mesh.expert_dp_group if getattr(mesh, "ep", 1) > 1 else None
    if compressor is not None:
        reduce_dtype = None
        if hasattr(compressor, "name_params"):  # PowerSGD: Q seeded by canonical name
            compressor.name_params(model.named_parameters())
    params = list(model.parameters())
    if zero == 0 or mesh.dp * mesh.cp == 1:
        return GradBuckets(
            params,
            group,
            bucket_mb,
            compressor,
            reduce_dtype,
            average_over=dp,
            last=summed_before_reduction(model, mesh),
            expert_group=experts,
        )
    # the tied embedding (`shared_embedding`), summed over stages before its reduction; the
    # sharded kinds sum what is partial over tp on their slices, once reduced (exact)
    last = shared_embedding_params(model) if mesh.pp > 1 else []
    if zero == 3:
        return ShardedParams(
            model,
            group,
            average_over=dp,
            keep=zero3_keep_params,
            persist_below=zero3_persistence_threshold,
            offload=offload_params,
            reduce=zero3_reduce,
            expert_group=experts,
            float8=zero3_float8,
            half=zero3_half,
        )
    kinds = {1: Zero1Buckets, 2: Zero2Buckets}
    if zero not in kinds:
        raise ValueError(f"--zero {zero} is not supported; use 0, 1, 2 or 3")
    half_params = (
        [m.weight for m in half_weights(model).values() if not is_expert(m.weight)]
        if zero12_half is not None
        else []
    )
    return kinds[zero](
        params,
        group,
        bucket_mb,
        compressor,
        reduce_dtype,
        average_over=dp,
        last=last,
        expert_group=experts,
        half=zero12_half if half_params else None,
        half_params=half_params,
    )
