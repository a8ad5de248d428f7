"""Gradients as views into one contiguous buffer, averaged over the data-parallel group in
buckets, in place, overlapped with the last backward.

`GradBuckets` owns, per dtype, one flat buffer holding every parameter's gradient (parameters in
reverse registration order, roughly the order their gradients become final in backward). Each
``param.grad`` is a view into it, so autograd accumulates the micro-batches' gradients in place
and nothing is allocated per step. The buffer is cut into buckets of ~`bucket_mb` MB
(contiguous ranges); a bucket's all-reduce runs on its range of the buffer itself: no packing
(`torch.cat`), no copy back, no second copy of the gradients alive during the reduction.

The executor's grad-sync protocol:

- ``begin_step()``: before the schedule; zeroes the buffer, (re)points every ``.grad`` at its
  view (the optimizer may have set them to None) and disarms the hooks, so accumulating over the
  first m - 1 micro-batches communicates nothing.
- ``arm(params)``: with several model chunks per stage (interleaved schedules), right before
  a chunk's last backward: arms the hooks of the parameters whose gradients are final after it,
  so that chunk's buckets reduce while the other chunks' backwards run.
- ``before_last_backward()``: right before this stage's last backward; arms the hooks.
- during that backward, ``register_post_accumulate_grad_hook`` reports each parameter whose
  gradient is final. Code that produces weight gradients itself (e.g. ``torch.autograd.grad``
  followed by an in-place ``param.grad.add_``, as zero-bubble schedules do) calls
  ``grads_ready(params)`` instead. When every parameter of a bucket is ready, the bucket is
  divided by dp and all-reduced asynchronously.
- ``finish()``: launches the buckets not launched yet (parameters this stage did not use keep a
  zero gradient), and waits for every all-reduce.

Buckets are launched strictly in bucket order (a ready bucket waits for the ones before it), so
every dp rank issues the same all-reduces in the same order whatever order hooks fire in. A
``.grad`` that was replaced by another tensor (not accumulated in place) is copied into its view
when its bucket launches, so the result is right either way.
`reduce_dtype` (--grad-reduce-dtype) narrows the reduction: a bucket is cast to it, reduced, and
the result cast back into the buffer when waited for (half the bytes in bf16 / fp16, one
transient half-size copy of the bucket in flight).
With a dp group of size 1 the buffer still serves (no per-step gradient allocation); nothing is
communicated. Under context parallelism the group is cp x dp (`Mesh.dp_cp_group`) and
`average_over` is dp: each cp rank's gradient is its tokens' share, so the reduction sums over
cp and averages over dp (one collective either way).

Sharded mode (``shard_over_dp``, used by the ZeRO-1 distributed optimizer, `optim/zero.py`):
every bucket is zero-padded to a multiple of dp and *reduce-scattered* instead of all-reduced,
so dp rank r ends up with the dp-averaged gradient of the r-th of the dp equal slices of each
bucket (``shard_range``); the rest of the buffer keeps this rank's unreduced gradient and must
not be read. Parameters given as ``last`` (the tied embedding) go into the last bucket(s),
which launch only in ``finish()`` after ``before_reduce()`` ran (the tied-embedding sum over the
first and last pipeline stage must precede the dp reduction, as slices differ between stages).
Gradient compression is refused in this mode.

Sharded gradients (``shard_over_dp(grads=True)``, ZeRO-2): there is no full buffer, only
``shards`` (per dtype, this rank's slices of the buckets back to back; ``Bucket.shard``).
``.grad`` is autograd's own tensor. In every micro-batch's backward (hooks always armed within
a step) a bucket whose gradients are all there is staged (copied into one padded bucket-sized
tensor, each ``.grad`` released), averaged, reduce-scattered and added into its shard when
waited for. Buckets launch in bucket order in rounds, one per micro-batch; a bucket not
complete holds the ones after it, whose gradients keep accumulating whole until they launch or
``finish()`` reduces what accumulated since each bucket's last launch. Deferred buckets (the
tied embedding) are reduced once, in ``finish()``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from megapar import device as _device
from megapar.data_parallel import shard_comm
from megapar.mesh import group_size


@dataclass
class Bucket:
    """A contiguous range of a gradient buffer, averaged in one all-reduce."""

    params: list[torch.nn.Parameter]
    """Parameters of the bucket, in buffer order."""
    ready: set[int] = field(default_factory=set)
    """ids of the parameters whose gradient is final in the current step."""
    flat: torch.Tensor | None = None
    """The bucket's range of the gradient buffer (a view)."""
    handle: object | None = None
    """The async work handle of the in-flight all-reduce."""
    start: int = 0
    """Offset of the bucket in its dtype's buffer."""
    padded: int = 0
    """Elements the bucket occupies in the buffer (numel, rounded up to a multiple of dp when
    sharded)."""
    deferred: bool = False
    """Sharded mode: launched only in finish(), after `before_reduce`."""
    shard: torch.Tensor | None = None
    """Sharded gradients (ZeRO-2): this rank's reduced slice of the bucket, persistent (a view
    into `GradBuckets.shards`)."""

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def bucket_layout(sizes: Sequence[tuple[int, torch.dtype]], bucket_mb: float, shards: int = 1,
                  late: Iterable[int] = ()) -> list[tuple[list[int], int]]:
    """How `GradBuckets` lays out parameters of these (numel, dtype), given in registration
    order: per bucket, (the parameters' indices in buffer order, the elements the bucket
    occupies). Parameters go in reverse order, cut into buckets of at most bucket_mb MB (a
    larger single parameter gets a bucket of its own), never mixing dtypes; each bucket is
    zero-padded to a multiple of `shards` (dp when sharded for ZeRO-1) and the `late` indices
    go into the last bucket(s). The ZeRO-1 planner (`megapar.plan`) counts bytes with it."""
    late = set(late)
    order = [i for i in range(len(sizes)) if i in late] + \
        [i for i in range(len(sizes)) if i not in late]  # reversed below: late ones go last
    limit = bucket_mb * 2**20
    buckets, current, size = [], [], 0
    for i in reversed(order):
        numel, dtype = sizes[i]
        nbytes = numel * dtype.itemsize
        if current and (dtype != sizes[current[0]][1] or size + nbytes > limit):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return [(idx, -(-sum(sizes[i][0] for i in idx) // shards) * shards) for idx in buckets]


def make_buckets(params: list[torch.nn.Parameter], bucket_mb: float, shards: int = 1,
                 late: Iterable[torch.nn.Parameter] = ()) -> list[Bucket]:
    """`params` cut into buckets as `bucket_layout` lays them out."""
    late_ids = {id(p) for p in late}
    layout = bucket_layout([(p.numel(), p.dtype) for p in params], bucket_mb, shards,
                           [i for i, p in enumerate(params) if id(p) in late_ids])
    return [Bucket([params[i] for i in idx], padded=padded) for idx, padded in layout]


def slice_pieces(numels: Sequence[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """For parameters of these sizes laid out back to back from 0 (a bucket), (index, start,
    end) of each one's elements inside the slice [lo, hi): ZeRO-1's pieces of a dp rank."""
    pieces, offset = [], 0
    for i, numel in enumerate(numels):
        start, end = max(offset, lo) - offset, min(offset + numel, hi) - offset
        if start < end:
            pieces.append((i, start, end))
        offset += numel
    return pieces


class GradBuckets:
    """`.grad` views into one buffer per dtype, averaged over `dp_group` in ~`bucket_mb` MB
    buckets, in place and overlapped with backward."""

    def __init__(self, params: Iterable[torch.nn.Parameter], dp_group, bucket_mb: float = 25.0,
                 compressor=None, reduce_dtype: torch.dtype | None = None,
                 average_over: int | None = None,
                 zero_layout: Iterable[torch.nn.Parameter] | None = None):
        """`zero_layout`: lay the buckets out as ZeRO-1's `shard_over_dp` will, with these
        parameters last, so that sharding keeps this buffer instead of making a second one."""
        if bucket_mb <= 0:
            raise ValueError(f"bucket size must be > 0 MB, got {bucket_mb}")
        if compressor is not None and reduce_dtype is not None:
            raise ValueError("give a gradient compressor or a reduce dtype, not both (the "
                             "fp16 / bf16 compressors are a reduction in that dtype)")
        self.reduce_dtype = reduce_dtype
        """Reduce in this dtype (a cast copy of the bucket, cast back when done); None: the
        buffer's own dtype."""
        self.group = dp_group
        self.dp = group_size(dp_group)
        self.average_over = average_over or self.dp
        """The sum over the group is divided by this (dp; the group may be cp x dp)."""
        self.params = [p for p in params if p.requires_grad]
        self.active = self.in_step = False
        self._armed: set[int] = set()
        """Parameters (ids) armed by `arm` this step, before the hooks of all are."""
        self.launched_in_step = self.launched_in_finish = 0
        """Buckets launched during the last step's backward, and by its `finish()`."""
        self.next_launch = 0
        self._handles = []
        self.compressor = compressor
        self.bucket_mb = bucket_mb
        self.dp_rank = dist.get_rank(dp_group) if self.dp > 1 else 0
        self.sharded = False
        """Reduce-scatter the buckets (ZeRO-1) instead of all-reducing them."""
        self.grads_sharded = False
        """ZeRO-2: only this rank's slices of the reduced gradients persist (`shards`)."""
        self.shards: dict[torch.dtype, torch.Tensor] = {}
        self._round: list[Bucket] = []
        """ZeRO-2: the buckets reduced once per micro-batch, in this order (all but deferred)."""
        self._flight: list[Bucket] = []
        """ZeRO-2: buckets with a reduction in flight, oldest first."""
        self.host_waits = bool(self.params) and _device.polls_host(self.params[0].device)
        """The buffer is on the CPU (gloo), where sharded reductions in flight are bounded
        (`_bound_copies`)."""
        self.before_reduce = None
        """Sharded mode: called in finish() before the deferred buckets launch."""
        self._deferred_ok = False
        """A `compression.py` compressor (synchronous reduction), or None (async all-reduce)."""
        self.bytes_sent = 0
        """Bytes this rank has put into dp reductions (all steps; payloads of the collectives)."""
        self.buckets = make_buckets(self.params, bucket_mb) if zero_layout is None else \
            make_buckets(self.params, bucket_mb, self.dp, zero_layout)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self._views: dict[int, torch.Tensor] = {}
        self._allocate()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        if self.dp > 1:
            # The parameters hold their hooks: a bound method would be a cycle through autograd
            # that the garbage collector cannot free, keeping the dp group alive to the
            # interpreter's exit (and a gloo group's threads with it).
            on_grad_ready = weakref.WeakMethod(self._on_grad_ready)

            def hook(param: torch.nn.Parameter) -> None:
                method = on_grad_ready()
                if method is not None:  # else this GradBuckets is gone: nothing to reduce
                    method(param)

            for p in self.params:
                self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def shard_over_dp(self, last: Iterable[torch.nn.Parameter] = (), before_reduce=None,
                      grads: bool = False) -> None:
        """Switch to reduce-scatter: buckets padded to a multiple of dp, rank r keeps slice r of
        each. `last` parameters are put in the last bucket(s), launched in finish() only after
        `before_reduce()` (e.g. the tied-embedding sync). `grads` (ZeRO-2): keep only the
        slices (`shards`); the full buffer is freed. Call before the first step."""
        if self.compressor is not None:
            raise ValueError(f"--grad-compression cannot be combined with --zero "
                             f"{2 if grads else 1}: the distributed optimizer reduce-scatters "
                             f"the gradient buffer, the compressors compress an all-reduce; use "
                             f"--grad-compression none")
        if self.in_step:
            raise RuntimeError("shard_over_dp() during a step")
        self.sharded, self.before_reduce = True, before_reduce
        late = {id(p) for p in last}
        buckets = make_buckets(self.params, self.bucket_mb, self.dp, last)
        same = [([id(p) for p in b.params], b.padded) for b in buckets] == \
            [([id(p) for p in b.params], b.padded) for b in self.buckets]
        if not same:  # laid out for plain dp: the buffer holds no gradient yet, and is freed
            self.buckets = buckets  # before the padded one is made (never two at once)
            self._views, self.buffers = {}, {}
            for p in self.params:
                p.grad = None
            self._allocate()
            self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for b in self.buckets:
            b.deferred = before_reduce is not None and any(id(p) in late for p in b.params)
        if grads:
            self._shard_grads()

    def _shard_grads(self) -> None:
        """ZeRO-2: one persistent buffer per dtype of this rank's slices (bucket order); the
        full gradient buffer and its views are dropped."""
        self.grads_sharded = True
        self._views, self.buffers = {}, {}
        for p in self.params:
            p.grad = None
        sizes: dict[torch.dtype, int] = {}
        for b in self.buckets:
            dtype = b.params[0].dtype
            sizes[dtype] = sizes.get(dtype, 0) + b.padded // self.dp
        devices = {b.params[0].dtype: b.params[0].device for b in self.buckets}
        self.shards = {dt: torch.zeros(n, dtype=dt, device=devices[dt])
                       for dt, n in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        self._round = [b for b in self.buckets if not b.deferred]
        for b in self.buckets:
            dtype = b.params[0].dtype
            b.flat, start = None, offsets[dtype]
            b.shard = self.shards[dtype][start:start + b.padded // self.dp]
            offsets[dtype] = start + b.padded // self.dp

    def buffer_sizes(self) -> dict[torch.dtype, int]:
        """Elements of the (full, padded) gradient buffer per dtype, allocated or not."""
        sizes: dict[torch.dtype, int] = {}
        for b in self.buckets:
            sizes[b.params[0].dtype] = sizes.get(b.params[0].dtype, 0) + b.padded
        return sizes

    def shard_range(self, b: Bucket) -> tuple[int, int]:
        """This rank's slice [lo, hi) of bucket `b` (relative to the bucket; whole when not
        sharded)."""
        if not self.sharded:
            return 0, b.padded
        size = b.padded // self.dp
        return self.dp_rank * size, (self.dp_rank + 1) * size

    def _allocate(self) -> None:
        """One zeroed buffer per dtype; bucket ranges and per-parameter views into it."""
        sizes: dict[torch.dtype, int] = {}
        for b in self.buckets:
            dtype = b.params[0].dtype
            sizes[dtype] = sizes.get(dtype, 0) + b.padded
        devices = {b.params[0].dtype: b.params[0].device for b in self.buckets}
        self.buffers = {dt: torch.zeros(n, dtype=dt, device=devices[dt])
                        for dt, n in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        for b in self.buckets:
            buffer, start = self.buffers[b.params[0].dtype], offsets[b.params[0].dtype]
            b.start, b.flat = start, buffer[start:start + b.padded]
            offset = 0
            for p in b.params:
                self._views[id(p)] = b.flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            offsets[b.params[0].dtype] = start + b.padded

    def grad_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The buffer view that is `param`'s gradient."""
        return self._views[id(param)]

    # protocol ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start a step: zero the buffer, point every .grad at its view, disarm the hooks."""
        for b in self.buckets:
            if b.handle is not None:
                raise RuntimeError("GradBuckets.begin_step() called while a previous step's "
                                   "all-reduce is still in flight; call finish() first")
            b.ready.clear()
        for buffer in self.buffers.values():
            buffer.zero_()
        for shard in self.shards.values():
            shard.zero_()
        for p in self.params:  # ZeRO-2: autograd's own tensors until the bucket is staged
            p.grad = None if self.grads_sharded else self._views[id(p)]
        self.next_launch = 0
        self._flight = []
        self.active = self._deferred_ok = False
        self._armed.clear()
        self.launched_in_step = self.launched_in_finish = 0
        self.in_step = True

    def arm(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Arm these parameters' hooks: their gradients become final during the next backward
        (one model chunk's last), before the others'."""
        if self.dp > 1:
            self._armed.update(id(p) for p in params)

    def before_last_backward(self) -> None:
        """Arm the hooks: gradients become final during the next backward."""
        self.active = self.dp > 1

    def grads_ready(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Declare these parameters' gradients final for this step (for code that accumulates
        weight gradients itself instead of through autograd's AccumulateGrad)."""
        if self.grads_sharded:  # ZeRO-2: reduced every micro-batch, armed or not
            ready = list(params) if self.in_step else []
        else:
            ready = [p for p in params if self.active or id(p) in self._armed]
        if not ready:
            return
        for p in ready:
            self._bucket_of[id(p)].ready.add(id(p))
        self._launch_ready()

    def finish(self) -> None:
        """Launch any bucket not launched yet and wait for all; the averages are in .grad."""
        if not self.in_step:
            raise RuntimeError("GradBuckets.finish() without begin_step(): call begin_step() "
                               "before each step's first backward (the executor does)")
        self.active = self.in_step = False
        self._armed.clear()
        if self.dp == 1:
            for b in self.buckets:
                self._adopt_replaced_grads(b)
            return
        if self.grads_sharded:
            return self._finish_sharded()
        for b in self.buckets:
            b.ready.update(id(p) for p in b.params)
        self._launch_ready()
        if self.next_launch < len(self.buckets):  # deferred buckets: tied sync first
            self.before_reduce()
            self._deferred_ok = True
            self._launch_ready()
        for b in self.buckets:
            b.handle.wait()
            b.handle = None

    # internals --------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if self.grads_sharded:  # ZeRO-2: every micro-batch's backward reduces
            if not self.in_step:
                return
        elif not (self.active or id(param) in self._armed):
            return
        self._bucket_of[id(param)].ready.add(id(param))
        self._launch_ready()

    def _launch_ready(self) -> None:
        if self.grads_sharded:
            return self._launch_round()
        while self.next_launch < len(self.buckets):
            b = self.buckets[self.next_launch]
            if len(b.ready) < len(b.params) or (b.deferred and not self._deferred_ok):
                return
            self._launch(b)
            self.next_launch += 1

    def _adopt_replaced_grads(self, b: Bucket) -> None:
        for p in b.params:
            view = self._views[id(p)]
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view

    MAX_COPIES_IN_FLIGHT = 1
    """Gloo's reduce-scatter and all-gather take up to two bucket-sized copies each (measured:
    30-54 MB and 46 MB for a 24 MB bucket; its in-place all-reduce none), held until the
    collective is waited for: at most this many are in flight (`_bound_copies`). NCCL runs them
    in place."""

    def _bound_copies(self) -> None:
        """Gloo, sharded: wait for the oldest reduce-scatters in flight until fewer than
        MAX_COPIES_IN_FLIGHT are, so their bucket copies are freed during the backward. Held
        until finish(), the copies of every bucket were at the OS peak: 0.4 GiB of GPT-2
        124M's 17 buckets at dp 2, more than ZeRO-1 saved there. NCCL keeps its handles to
        finish()."""
        if self.grads_sharded:  # rounds wrap: the launch order is kept instead
            self._flight = [b for b in self._flight if b.handle is not None]
            while len(self._flight) >= self.MAX_COPIES_IN_FLIGHT:
                b = self._flight.pop(0)
                b.handle.wait()  # the staged copy is freed here
                b.handle = None
            return
        flight = [b for b in self.buckets[:self.next_launch]
                  if b.handle is not None and not isinstance(b.handle, _Done)]
        for b in flight[:max(0, len(flight) - self.MAX_COPIES_IN_FLIGHT + 1)]:
            b.handle.wait()  # a cast copy is copied back here
            b.handle = _Done()

    def _launch(self, b: Bucket) -> None:
        if self.in_step:
            self.launched_in_step += 1
        else:
            self.launched_in_finish += 1
        if self.host_waits and self.sharded:
            self._bound_copies()
        if self.grads_sharded:
            return self._launch_staged(b)
        self._adopt_replaced_grads(b)
        if self.average_over > 1:
            b.flat.div_(self.average_over)
        if self.compressor is not None:
            self.bytes_sent += self.compressor.reduce(b.flat, b.params, self.group)
            b.handle = _Done()
            return
        cast = self.reduce_dtype is not None and self.reduce_dtype != b.flat.dtype
        wire = b.flat.to(self.reduce_dtype) if cast else b.flat
        self.bytes_sent += wire.numel() * wire.element_size()
        lo, hi = self.shard_range(b)
        if self.sharded:
            work = shard_comm.reduce_scatter(wire, wire[lo:hi], self.dp, self.group,
                                             self.host_waits)
        else:
            work = dist.all_reduce(wire, group=self.group, async_op=True)
        b.handle = _CastBack(work, wire[lo:hi], b.flat[lo:hi]) if cast else work


    def _launch_round(self) -> None:
        """ZeRO-2: launch the buckets of the current round (micro-batch) in bucket order while
        the next one's gradients are all there; after the last, a new round starts. A bucket
        waiting for an earlier one keeps accumulating in ``.grad`` (reduced later, whole)."""
        rnd = self._round
        while rnd:
            b = rnd[self.next_launch]
            if len(b.ready) < len(b.params):
                return
            b.ready.clear()
            self._launch(b)
            self.next_launch = (self.next_launch + 1) % len(rnd)

    def _finish_sharded(self) -> None:
        """ZeRO-2's finish: reduce what accumulated since each bucket's last reduction (the
        rest of the current round first, then the buckets before it, in bucket order; a bucket
        without any gradient since is skipped: its share is already in the shard), then the
        deferred buckets after `before_reduce()`, and wait for all. Which buckets hold a
        gradient depends only on the model and schedule, the same on every dp rank."""
        rnd, start = self._round, self.next_launch
        for b in rnd[start:] + rnd[:start]:
            if any(p.grad is not None for p in b.params):
                self._launch(b)
            b.ready.clear()
        deferred = [b for b in self.buckets if b.deferred]
        if deferred:
            self.before_reduce()
            for b in deferred:
                self._launch(b)
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
        self._flight = []

    def _stage(self, b: Bucket) -> torch.Tensor:
        """ZeRO-2: the bucket's gradients copied into one padded bucket-sized tensor (zeros for
        parameters without one), and each ``.grad`` released. A bucket of one parameter whose
        gradient fills it exactly and owns its whole storage (the embedding's) is staged as
        that gradient itself: no copy."""
        if len(b.params) == 1:
            g = b.params[0].grad
            if g is not None and g.numel() == b.padded and g.is_contiguous() and \
                    g.dtype == b.shard.dtype and g.device == b.shard.device and \
                    g.untyped_storage().nbytes() == g.numel() * g.element_size():
                b.params[0].grad = None
                return g.view(-1)
        staged = torch.empty(b.padded, dtype=b.shard.dtype, device=b.shard.device)
        offset = 0
        for p in b.params:
            view = staged[offset:offset + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            p.grad = None
            offset += p.numel()
        staged[offset:].zero_()
        return staged

    def _launch_staged(self, b: Bucket) -> None:
        """ZeRO-2: stage the bucket, reduce-scatter it into this rank's shard; the staged copy
        lives until the reduction is waited for."""
        if b.handle is not None:  # its previous micro-batch's reduction adds to the shard first
            b.handle.wait()
        staged = self._stage(b)
        if self.average_over > 1:
            staged.div_(self.average_over)
        cast = self.reduce_dtype is not None and self.reduce_dtype != staged.dtype
        wire = staged.to(self.reduce_dtype) if cast else staged
        del staged
        self.bytes_sent += wire.numel() * wire.element_size()
        lo, hi = self.shard_range(b)
        work = shard_comm.reduce_scatter(wire, wire[lo:hi], self.dp, self.group,
                                         self.host_waits)
        b.handle = _CastBack(work, wire[lo:hi], b.shard, keep=wire, add=True)
        self._flight.append(b)


class _CastBack:
    """The handle of a reduction run on a cast copy: waiting copies the result back (when
    `into` is given; `add`: adds it, as ZeRO-2 accumulates micro-batches into its shard) and
    releases the copy (`keep`: a tensor to hold until then)."""

    def __init__(self, work, result: torch.Tensor | None, into: torch.Tensor | None,
                 keep: torch.Tensor | None = None, add: bool = False):
        self.work, self.result, self.into, self.keep = work, result, into, keep
        self.add = add

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> bool:
        ok = self.work.wait()
        if self.into is not None and self.add:
            self.into.add_(self.result)
        elif self.into is not None:
            self.into.copy_(self.result)
        self.result = self.into = self.keep = None
        return ok


class _Done:
    """The handle of a reduction that has already completed."""

    def wait(self) -> bool:
        return True
