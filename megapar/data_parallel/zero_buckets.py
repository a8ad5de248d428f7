"""The ZeRO-1 and ZeRO-2 grad syncs: `GradBuckets`' buckets reduce-scattered over the
data-parallel group instead of all-reduced, for the distributed optimizer (`optim/zero.py`).

ZeRO-1 (`Zero1Buckets`): every bucket is zero-padded to a multiple of dp and
*reduce-scattered*, so dp rank r ends up with the dp-averaged gradient of the r-th of the dp
equal slices of each bucket (``shard_range``); the rest of the buffer keeps this rank's
unreduced gradient and must not be read. Parameters given as ``last`` (the tied embedding) go
into the last bucket(s), which, once `defer` named a ``before_reduce``, launch only in
``finish()`` after it ran (the tied-embedding sum over the first and last pipeline stage must
precede the dp reduction, as slices differ between stages). Gradient compression is refused.
Under bf16 / fp16 the blocks' linear weights (`half_params`) are laid out in buckets of their
own (`bucket_layout`'s `apart`: still in the order their gradients become final), whose
parameters the optimizer all-gathers in 16 bits (`optim/zero.py`).

ZeRO-2 (`Zero2Buckets`): there is no full buffer, only ``shards`` (per dtype, this rank's
slices of the buckets back to back; ``Bucket.shard``). ``.grad`` is autograd's own tensor. In
every micro-batch's backward (hooks always armed within a step) a bucket whose gradients are
all there is staged (copied into one padded bucket-sized tensor, each ``.grad`` released),
averaged, reduce-scattered and added into its shard when waited for. Buckets launch in bucket
order in rounds, one per micro-batch (`LaunchOrder.launch_round`); a bucket not complete holds
the ones after it, whose gradients keep accumulating whole until they launch or ``finish()``
reduces what accumulated since each bucket's last launch. Deferred buckets (the tied
embedding) are reduced once, in ``finish()``.

On gloo, which copies a collective's whole buffer and holds the copies until it is waited for,
at most `MAX_COPIES_IN_FLIGHT` reduce-scatters are left in flight (`_bound_copies`), so their
copies are freed during the backward; NCCL runs them in place and keeps its handles to
``finish()``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megapar.data_parallel import shard_comm
from megapar.data_parallel.buckets import Bucket, CastBack, Done, GradBuckets


class Zero1Buckets(GradBuckets):
    """ZeRO-1's grad sync: the gradient buffer's buckets, padded to a multiple of dp, each
    reduce-scattered so this rank keeps the average of its slice."""

    stage = 1
    sharded = True
    """The optimizer state is sharded over dp: this rank's slices of each bucket."""

    MAX_COPIES_IN_FLIGHT = 1
    """Gloo's reduce-scatter and all-gather take up to two bucket-sized copies each, held until
    the collective is waited for: at most this many are in flight (`_bound_copies`; the
    optimizer's all-gathers too). NCCL runs them in place."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        dp_group,
        bucket_mb: float = 25.0,
        compressor=None,
        reduce_dtype: torch.dtype | None = None,
        average_over: int | None = None,
        last: Iterable[torch.nn.Parameter] = (),
        expert_group=None,
        half: torch.dtype | None = None,
        half_params: Iterable[torch.nn.Parameter] = (),
    ):
        """`last`: the parameters laid out in the last bucket(s), deferred by `defer`;
        `expert_group` as `GradBuckets`'; `half_params` (with `half`, the autocast dtype): the
        weights autocast reads in `half` (`zero3_half.half_weights`), laid out in buckets of
        their own (`Bucket.half`), which the optimizer all-gathers in `half` after a step."""
        if half is not None:
            self.half = half
            self.half_params = list(half_params)
        if compressor is not None:
            raise ValueError(
                f"--grad-compression cannot be combined with --zero "
                f"{self.stage}: the distributed optimizer reduce-scatters the "
                f"gradient buffer, the compressors compress an all-reduce; use "
                f"--grad-compression none"
            )
        super().__init__(
            params, dp_group, bucket_mb, None, reduce_dtype, average_over, last, expert_group
        )

    def _layout(self, last: Iterable[torch.nn.Parameter]) -> list[Bucket]:
        """`bucket_layout`'s buckets padded to a multiple of dp, `last` in the last ones."""
        return self._make_buckets(True, last)

    def shard_range(self, b: Bucket) -> tuple[int, int]:
        """This rank's slice [lo, hi) of bucket `b` (relative to the bucket)."""
        size = b.padded // b.group_size
        return b.group_rank * size, (b.group_rank + 1) * size

    def reduced_part(self, param: torch.nn.Parameter) -> torch.Tensor:
        """What this rank holds of `param`'s reduced gradient once `finish` returned, in
        place: its slice of the bucket `param` has to itself (the tied embedding's: `last`,
        laid out alone), padding included."""
        b = self._bucket_of[id(param)]
        if len(b.params) != 1:
            raise ValueError(
                f"{type(self).__name__}.reduced_part: the parameter shares its bucket with "
                f"{len(b.params) - 1} other(s), so its slices are not its own; only `last` "
                f"parameters are laid out alone"
            )
        return self._slice(b)

    def _slice(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced slice of bucket `b` (in the full buffer)."""
        assert b.flat is not None  # a view of the full buffer (ZeRO-1)
        lo, hi = self.shard_range(b)
        return b.flat[lo:hi]

    def _bound_copies(self) -> None:
        """Gloo: wait for the oldest reduce-scatters in flight until fewer than
        MAX_COPIES_IN_FLIGHT are, so their bucket copies are freed during the backward."""
        flight = [
            b
            for b in self.buckets[: self.order.next]
            if b.handle is not None and not isinstance(b.handle, Done)
        ]
        for b in flight[: max(0, len(flight) - self.MAX_COPIES_IN_FLIGHT + 1)]:
            assert b.handle is not None  # in flight
            b.handle.wait()  # a cast copy is copied back here
            b.handle = Done()

    def _reduce(self, b: Bucket) -> None:
        """Average the bucket over the group into this rank's slice of it: an async
        reduce-scatter in place (on a cast copy under `reduce_dtype`)."""
        if self.host_waits:
            self._bound_copies()
        self._adopt_replaced_grads(b)
        assert b.flat is not None  # a view of the full buffer (ZeRO-1)
        if self.average_over > 1:
            b.flat.div_(self.average_over)
        wire, cast = self._on_wire(b.flat)
        lo, hi = self.shard_range(b)
        work = shard_comm.reduce_scatter(wire, wire[lo:hi], b.group_size, b.group, self.host_waits)
        b.handle = CastBack(work, wire[lo:hi], b.flat[lo:hi]) if cast else work


class Zero2Buckets(Zero1Buckets):
    """ZeRO-2's grad sync: ZeRO-1's bucket layout without the full buffer; every micro-batch
    stages each complete bucket and reduce-scatters it into this rank's persistent shard."""

    stage = 2
    sharded_grads = True
    """The reduced gradients exist only as this rank's slices (`shards`)."""
    reduces_every_micro_batch = True
    """Every micro-batch's backward reduce-scatters the buckets complete in it."""

    def __init__(self, *args, **kwargs) -> None:
        self.shards: dict[torch.dtype, torch.Tensor] = {}
        """Per dtype, this rank's slices of the reduced gradients, bucket after bucket."""
        self._flight: list[Bucket] = []
        """Buckets with a reduction in flight, oldest first."""
        super().__init__(*args, **kwargs)

    def _allocate(self) -> None:
        """One persistent zeroed buffer per dtype of this rank's slices (bucket order), each
        bucket's `shard` a view into it; no full buffer, no ``.grad`` views."""
        sizes: dict[torch.dtype, int] = {}
        for b in self.buckets:
            dtype = b.params[0].dtype
            sizes[dtype] = sizes.get(dtype, 0) + b.padded // b.group_size
        devices = {b.params[0].dtype: b.params[0].device for b in self.buckets}
        self.shards = {dt: torch.zeros(n, dtype=dt, device=devices[dt]) for dt, n in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        for b in self.buckets:
            dtype, start = b.params[0].dtype, offsets[b.params[0].dtype]
            size = b.padded // b.group_size
            b.flat, b.shard = None, self.shards[dtype][start : start + size]
            offsets[dtype] = start + size
        for p in self.params:
            p.grad = None

    def _slice(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced slice of bucket `b`: its shard."""
        assert b.shard is not None  # set by _allocate
        return b.shard

    def begin_step(self) -> None:
        """Start a step: zero the shards; ``.grad`` is autograd's own until a bucket is
        staged."""
        super().begin_step()
        for shard in self.shards.values():
            shard.zero_()
        self._flight = []

    def _point_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def _counts(self, param: torch.nn.Parameter) -> bool:
        """Any micro-batch's gradient counts within a step, armed or not."""
        return self.in_step

    def _launch_ready(self) -> None:
        self.order.launch_round(self._launch)

    def _finish_launches(self) -> None:
        self.order.finish_rounds(
            self._launch, lambda b: any(p.grad is not None for p in b.params), self.before_reduce
        )

    def finish(self) -> None:
        """Reduce what accumulated since each bucket's last reduction (`finish_rounds`), the
        deferred buckets after `before_reduce()`, and wait for all; the averages of this
        rank's slices are in `shards`."""
        super().finish()
        self._flight = []

    def _bound_copies(self) -> None:
        """Gloo: as ZeRO-1's, but rounds wrap, so the launch order is kept instead."""
        self._flight = [b for b in self._flight if b.handle is not None]
        while len(self._flight) >= self.MAX_COPIES_IN_FLIGHT:
            b = self._flight.pop(0)
            assert b.handle is not None  # in flight
            b.handle.wait()  # the staged copy is freed here
            b.handle = None

    def _stage(self, b: Bucket) -> torch.Tensor:
        """The bucket's gradients copied into one padded bucket-sized tensor (zeros for
        parameters without one), and each ``.grad`` released. A bucket of one parameter whose
        gradient fills it exactly and owns its whole storage (the embedding's) is staged as
        that gradient itself: no copy."""
        assert b.shard is not None  # set by _allocate
        if len(b.params) == 1:
            g = b.params[0].grad
            if (
                g is not None
                and g.numel() == b.padded
                and g.is_contiguous()
                and g.dtype == b.shard.dtype
                and g.device == b.shard.device
                and g.untyped_storage().nbytes() == g.numel() * g.element_size()
            ):
                b.params[0].grad = None
                return g.view(-1)
        staged = torch.empty(b.padded, dtype=b.shard.dtype, device=b.shard.device)
        offset = 0
        for p in b.params:
            view = staged[offset : offset + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            p.grad = None
            offset += p.numel()
        staged[offset:].zero_()
        return staged

    def _reduce(self, b: Bucket) -> None:
        """Stage the bucket, reduce-scatter it into this rank's shard (added when waited for);
        the staged copy lives until then."""
        if self.host_waits:
            self._bound_copies()
        if b.handle is not None:  # its previous micro-batch's reduction adds to the shard first
            b.handle.wait()
        staged = self._stage(b)
        if self.average_over > 1:
            staged.div_(self.average_over)
        wire, _ = self._on_wire(staged)
        del staged
        lo, hi = self.shard_range(b)
        work = shard_comm.reduce_scatter(wire, wire[lo:hi], b.group_size, b.group, self.host_waits)
        b.handle = CastBack(work, wire[lo:hi], b.shard, keep=wire, add=True)
        self._flight.append(b)
