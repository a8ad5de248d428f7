"""Gradients as views into one contiguous buffer, averaged over the data-parallel group in
buckets, in place, overlapped with the last backward: the all-reduce grad sync (``--zero 0``)
and the buffer and buckets the ZeRO-1 / ZeRO-2 kinds (`zero_buckets.py`) build on.

`GradBuckets` owns, per dtype, one flat buffer holding every parameter's gradient (parameters in
reverse registration order, roughly the order their gradients become final in backward). Each
``param.grad`` is a view into it, so autograd accumulates the micro-batches' gradients in place
and nothing is allocated per step. The buffer is cut into buckets of ~`bucket_mb` MB
(contiguous ranges); a bucket's all-reduce runs on its range of the buffer itself: no packing
(`torch.cat`), no copy back, no second copy of the gradients alive during the reduction.

It implements the executor's `GradSync` protocol (`grad_sync.py`):

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

Buckets are launched strictly in bucket order (`LaunchOrder`: a ready bucket waits for the ones
before it), so every dp rank issues the same all-reduces in the same order whatever order hooks
fire in. A ``.grad`` that was replaced by another tensor (not accumulated in place) is copied
into its view when its bucket launches, so the result is right either way.
`reduce_dtype` (--grad-reduce-dtype) narrows the reduction: a bucket is cast to it, reduced, and
the result cast back into the buffer when waited for (half the bytes in bf16 / fp16, one
transient half-size copy of the bucket in flight). A `compression.py` compressor reduces a
bucket synchronously instead. Either rounds, so at pp > 1 the tied embedding's buckets wait
for its sum over the first and last stage (`defers_last`), as the ZeRO kinds' always do.
With a dp group of size 1 the buffer still serves (no per-step gradient allocation); nothing is
communicated. Under context parallelism the group is cp x dp (`Mesh.dp_cp_group`) and
`average_over` is dp: each cp rank's gradient is its tokens' share, so the reduction sums over
cp and averages over dp (one collective either way).

Expert parameters (`megapar.expert_parallel.is_expert`) under expert parallelism (an
`expert_group` given: `Mesh.expert_dp_group`) go into buckets of their own, never mixed with
dense ones (as dtypes are not mixed), each reduced over that group instead (`Bucket.group`),
averaged over the same dp: an expert's gradient already sums the tokens of its ep group. The
buckets keep one launch order, so every rank issues both groups' reductions in the same order.
A compressor (PowerSGD's state is per parameter) reduces each bucket over the bucket's group;
a bucket whose group is one rank is not compressed (nothing to reduce: it stays exact).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megapar import device as _device
from megapar.data_parallel.launch_order import LaunchOrder
from megapar.expert_parallel import is_expert
from megapar.mesh import group_size


class Handle(Protocol):
    """A reduction in flight: a torch work handle, `CastBack`, `Done`, ..."""

    def wait(self) -> Any: ...


@dataclass
class Bucket:
    """A contiguous range of a gradient buffer, averaged in one all-reduce."""

    params: list[torch.nn.Parameter]
    """Parameters of the bucket, in buffer order."""
    ready: set[int] = field(default_factory=set)
    """ids of the parameters whose gradient is final in the current step."""
    flat: torch.Tensor | None = None
    """The bucket's range of the gradient buffer (a view)."""
    handle: Handle | None = None
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
    group: Any = None
    """The group the bucket is reduced over: the grad sync's dp group, or for expert
    parameters its expert-data-parallel group (`GradBuckets`)."""
    group_size: int = 1
    """The size of `group` (its shards when sharded)."""
    group_rank: int = 0
    """This rank's place in `group` (its slice when sharded)."""
    half: bool = False
    """ZeRO-1 / 2: the bucket holds only weights autocast reads in 16 bits (the blocks'
    linear weights, `Zero1Buckets`' `half`), whose parameters the optimizer all-gathers in
    16 bits after a step."""

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def bucket_layout(
    sizes: Sequence[tuple[int, torch.dtype]],
    bucket_mb: float,
    shards: int = 1,
    late: Iterable[int] = (),
    experts: Iterable[int] = (),
    expert_shards: int = 1,
    apart: Iterable[int] = (),
    late_alone: bool = False,
) -> list[tuple[list[int], int]]:
    """How `GradBuckets` lays out parameters of these (numel, dtype), given in registration
    order: per bucket, (the parameters' indices in buffer order, the elements the bucket
    occupies). Parameters go in reverse order, cut into buckets of at most bucket_mb MB (a
    larger single parameter gets a bucket of its own), never mixing dtypes nor the `experts`
    indices with the others; each bucket is zero-padded to a multiple of `shards` (dp when
    sharded for ZeRO-1; an experts' bucket: `expert_shards`) and the `late` indices go into the
    last bucket(s); `late_alone`: each in a bucket of its own (ZeRO-1 / 2's tied embedding, so
    that its copies on the first and last stage are cut into the same slices). The ZeRO-1
    planner (`megapar.plan`) counts bytes with it.

    The `apart` indices (ZeRO-1 / 2's 16-bit gathered weights) fill buckets of their own beside
    the others': two buckets are open at a time, one for `apart` parameters and one for the
    rest, each closed when full (or, for the rest, at a change of dtype or expert kind), and
    buckets are listed in the order they close, the ones still open at the end by their last
    parameter: the order their gradients become complete in, as without `apart`."""
    late, experts, apart = set(late), set(experts), set(apart)
    order = [i for i in range(len(sizes)) if i in late] + [
        i for i in range(len(sizes)) if i not in late
    ]  # reversed below: late ones go last
    limit = bucket_mb * 2**20
    buckets: list[list[int]] = []
    current: dict[bool, list[int]] = {False: [], True: []}
    size = {False: 0, True: 0}
    last: dict[bool, int] = {}
    for at, i in enumerate(reversed(order)):
        numel, dtype = sizes[i]
        nbytes = numel * dtype.itemsize
        kind = i in apart
        open_ = current[kind]
        if open_ and (
            dtype != sizes[open_[0]][1]
            or (i in experts) != (open_[0] in experts)
            or size[kind] + nbytes > limit
            or (late_alone and (i in late or open_[0] in late))
        ):
            buckets.append(open_)
            current[kind], size[kind] = [], 0
        current[kind].append(i)
        size[kind] += nbytes
        last[kind] = at
    for kind in sorted((k for k in current if current[k]), key=last.__getitem__):
        buckets.append(current[kind])
    out = []
    for idx in buckets:
        n = expert_shards if idx[0] in experts else shards
        out.append((idx, -(-sum(sizes[i][0] for i in idx) // n) * n))
    return out


def make_buckets(
    params: list[torch.nn.Parameter],
    bucket_mb: float,
    shards: int = 1,
    late: Iterable[torch.nn.Parameter] = (),
    experts: Iterable[torch.nn.Parameter] = (),
    expert_shards: int = 1,
    apart: Iterable[torch.nn.Parameter] = (),
    late_alone: bool = False,
) -> list[Bucket]:
    """`params` cut into buckets as `bucket_layout` lays them out; the buckets of `apart`
    parameters are marked `Bucket.half`."""
    late_ids, expert_ids = {id(p) for p in late}, {id(p) for p in experts}
    apart_ids = {id(p) for p in apart}
    layout = bucket_layout(
        [(p.numel(), p.dtype) for p in params],
        bucket_mb,
        shards,
        [i for i, p in enumerate(params) if id(p) in late_ids],
        [i for i, p in enumerate(params) if id(p) in expert_ids],
        expert_shards,
        [i for i, p in enumerate(params) if id(p) in apart_ids],
        late_alone,
    )
    return [
        Bucket([params[i] for i in idx], padded=padded, half=id(params[idx[0]]) in apart_ids)
        for idx, padded in layout
    ]


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
    """`.grad` views into one buffer per dtype, all-reduced over `dp_group` in ~`bucket_mb` MB
    buckets, in place and overlapped with backward: the grad sync without ZeRO (the ZeRO-1 /
    ZeRO-2 kinds subclass it). Expert parameters' buckets reduce over `expert_group` when one
    is given (expert parallelism)."""

    stage = 0
    """The ZeRO stage this grad sync serves (`GradSync.stage`)."""
    sharded = False
    """Whether the buckets are reduce-scattered, each rank keeping its slices (`GradSync`)."""
    sharded_grads = False
    """Whether the reduced gradients exist only as this rank's slices (`GradSync`)."""
    reduces_every_micro_batch = False
    """Whether every micro-batch's backward reduces (`GradSync`)."""
    half: torch.dtype | None = None
    """ZeRO-1 / 2: the dtype the optimizer all-gathers `half_params` in after a step (the
    autocast dtype); None: fp32 gathers only (`Zero1Buckets`)."""
    half_params: Sequence[torch.nn.Parameter] = ()
    """The parameters laid out in buckets of their own (`Bucket.half`) to be all-gathered in
    `half`; empty: none."""

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
    ):
        """`last`: parameters laid out in the last bucket(s), to be deferred by `defer` (the
        tied embedding: the ZeRO kinds' always, this kind's only where its reduction rounds,
        `rounds`: a `compressor`, or a `reduce_dtype` narrower than a gradient; ignored
        otherwise). `expert_group`: the group expert parameters reduce over
        (`Mesh.expert_dp_group` under expert parallelism); None: they reduce over dp."""
        if bucket_mb <= 0:
            raise ValueError(f"bucket size must be > 0 MB, got {bucket_mb}")
        if compressor is not None and reduce_dtype is not None:
            raise ValueError(
                "give a gradient compressor or a reduce dtype, not both (the "
                "fp16 / bf16 compressors are a reduction in that dtype)"
            )
        self.reduce_dtype = reduce_dtype
        """Reduce in this dtype (a cast copy of the bucket, cast back when done); None: the
        buffer's own dtype."""
        self.group = dp_group
        self.dp = group_size(dp_group)
        self.average_over = average_over or self.dp
        """The sum over the group is divided by this (dp; the group may be cp x dp)."""
        self.params = [p for p in params if p.requires_grad]
        self.rounds = compressor is not None or (
            reduce_dtype is not None and any(p.dtype != reduce_dtype for p in self.params)
        )
        """The reduction is not the exact sum: a compressor, or a cast to `reduce_dtype` (what
        a sum of shares reduced apart is not equal to the reduced sum under: `defers_last`)."""
        self.active = self.in_step = False
        self._armed: set[int] = set()
        """Parameters (ids) armed by `arm` this step, before the hooks of all are."""
        self.launched_in_step = self.launched_in_finish = 0
        """Buckets launched during the last step's backward, and by its `finish()`."""
        self.compressor = compressor
        """A `compression.py` compressor (a synchronous reduction), or None (async)."""
        self.bucket_mb = bucket_mb
        self.dp_rank = dist.get_rank(dp_group) if self.dp > 1 else 0
        self.expert_group = expert_group
        """The group expert parameters reduce over; None: dp's, as the others."""
        self.host_waits = bool(self.params) and _device.polls_host(self.params[0].device)
        """The buffer is on the CPU (gloo), where sharded reductions in flight are bounded."""
        self.before_reduce = None
        """Sharded kinds: called in finish() before the deferred buckets launch."""
        self.bytes_sent = 0
        """Bytes this rank has put into dp reductions (all steps; payloads of the collectives)."""
        self.buckets = self._layout(last)
        self.order = LaunchOrder(self.buckets)
        """The fixed order the buckets launch in."""
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self._views: dict[int, torch.Tensor] = {}
        self._place()
        self._allocate()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        if self.dp > 1:
            self._attach_hooks()

    @property
    def defers_last(self) -> bool:
        """Whether the tied embedding's buckets (`last`) must be deferred (`defer`) until its
        sum over the first and last pipeline stage: a reduction that rounds (`rounds`:
        PowerSGD's low-rank factors, the fp16 / bf16 compressors' or `reduce_dtype`'s cast)
        is not linear, so reducing each stage's share and summing afterwards is not reducing
        the sum, as pp 1 does. The exact all-reduce reduces without waiting (the tied sum
        follows `finish`)."""
        return self.rounds and self.dp > 1

    def _layout(self, last: Iterable[torch.nn.Parameter]) -> list[Bucket]:
        """The buckets: `bucket_layout`'s, unpadded; `last` in the last one(s) when they are
        to be deferred (a reduction that `rounds`)."""
        return self._make_buckets(False, last if self.rounds else ())

    def defer(self, last: Iterable[torch.nn.Parameter], before_reduce) -> None:
        """The buckets holding `last` (as laid out) launch only in finish(), after
        `before_reduce()` (the tied-embedding sync). Call before the first step."""
        if self.in_step:
            raise RuntimeError("defer() during a step")
        last = list(last)
        laid = self._layout(last)
        if [[id(p) for p in b.params] for b in laid] != [
            [id(p) for p in b.params] for b in self.buckets
        ]:
            raise ValueError(
                f"{type(self).__name__} was laid out with other `last` parameters "
                f"than it is deferred with: build it with the same `last` "
                f"(build_grad_sync does)"
            )
        late = {id(p) for p in last}
        self.before_reduce = before_reduce
        for b in self.buckets:
            b.deferred = before_reduce is not None and any(id(p) in late for p in b.params)

    def _make_buckets(self, sharded: bool, last: Iterable[torch.nn.Parameter]) -> list[Bucket]:
        """`make_buckets`' buckets (padded to their group's size when `sharded`), each with
        the group it reduces over: the expert group for expert parameters when there is one,
        else dp."""
        experts = [p for p in self.params if is_expert(p)] if self.expert_group is not None else []
        edp = group_size(self.expert_group)
        buckets = make_buckets(
            self.params,
            self.bucket_mb,
            self.dp if sharded else 1,
            last,
            experts,
            edp if sharded else 1,
            self.half_params,
            late_alone=sharded,
        )
        for b in buckets:
            if experts and is_expert(b.params[0]):
                rank = dist.get_rank(self.expert_group) if edp > 1 else 0
                b.group, b.group_size, b.group_rank = self.expert_group, edp, rank
            else:
                b.group, b.group_size, b.group_rank = self.group, self.dp, self.dp_rank
        return buckets

    def _attach_hooks(self) -> None:
        """A post-accumulate-grad hook on every parameter, reporting it to `_on_grad_ready`."""
        # The parameters hold their hooks: a bound method would be a cycle through autograd
        # that the garbage collector cannot free, keeping the dp group alive to the
        # interpreter's exit (and a gloo group's threads with it).
        on_grad_ready = weakref.WeakMethod(self._on_grad_ready)

        def hook(param: torch.nn.Parameter) -> None:
            method = on_grad_ready()
            if method is not None:  # else this GradBuckets is gone: nothing to reduce
                method(param)

        for p in self.params:
            p.register_post_accumulate_grad_hook(hook)

    @property
    def next_launch(self) -> int:
        """Index of the next bucket to launch (in its round, for the kinds reducing in
        rounds)."""
        return self.order.next

    def buffer_sizes(self) -> dict[torch.dtype, int]:
        """Elements of the (full, padded) gradient buffer per dtype, allocated or not."""
        sizes: dict[torch.dtype, int] = {}
        for b in self.buckets:
            sizes[b.params[0].dtype] = sizes.get(b.params[0].dtype, 0) + b.padded
        return sizes

    def shard_range(self, b: Bucket) -> tuple[int, int]:
        """This rank's slice [lo, hi) of bucket `b`, relative to the bucket: all of it here."""
        return 0, b.padded

    def reduced_part(self, param: torch.nn.Parameter) -> torch.Tensor:
        """What this rank holds of `param`'s reduced gradient once `finish` returned, in
        place: here all of it (its ``.grad`` view)."""
        return self._views[id(param)]

    def _place(self) -> None:
        """Each bucket's offset (`Bucket.start`) in its dtype's buffer."""
        offsets: dict[torch.dtype, int] = {}
        for b in self.buckets:
            dtype = b.params[0].dtype
            b.start = offsets.get(dtype, 0)
            offsets[dtype] = b.start + b.padded

    def _allocate(self) -> None:
        """One zeroed buffer per dtype; bucket ranges and per-parameter views into it."""
        devices = {b.params[0].dtype: b.params[0].device for b in self.buckets}
        self.buffers = {
            dt: torch.zeros(n, dtype=dt, device=devices[dt])
            for dt, n in self.buffer_sizes().items()
        }
        for b in self.buckets:
            b.flat = self.buffers[b.params[0].dtype][b.start : b.start + b.padded]
            offset = 0
            for p in b.params:
                self._views[id(p)] = b.flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()

    # the GradSync protocol --------------------------------------------------------------
    def begin_step(self) -> None:
        """Start a step: zero the buffer, point every .grad at its view, disarm the hooks."""
        for b in self.buckets:
            if b.handle is not None:
                raise RuntimeError(
                    f"{type(self).__name__}.begin_step() called while a previous "
                    f"step's reduction is still in flight; call finish() first"
                )
        self.order.reset()
        for buffer in self.buffers.values():
            buffer.zero_()
        self._point_grads()
        self.active = False
        self._armed.clear()
        self.launched_in_step = self.launched_in_finish = 0
        self.in_step = True

    def _point_grads(self) -> None:
        """Every ``.grad`` its view of the buffer."""
        for p in self.params:
            p.grad = self._views[id(p)]

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
        ready = [p for p in params if self._counts(p)]
        if not ready:
            return
        for p in ready:
            self._bucket_of[id(p)].ready.add(id(p))
        self._launch_ready()

    def finish(self) -> None:
        """Launch any bucket not launched yet and wait for all; the averages are in .grad."""
        if not self.in_step:
            raise RuntimeError(
                f"{type(self).__name__}.finish() without begin_step(): call "
                f"begin_step() before each step's first backward (the executor "
                f"does)"
            )
        self.active = self.in_step = False
        self._armed.clear()
        if self.dp == 1:
            for b in self.buckets:
                self._adopt_replaced_grads(b)
            return
        self._finish_launches()
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None

    # internals --------------------------------------------------------------------------
    def _counts(self, param: torch.nn.Parameter) -> bool:
        """Whether `param`'s gradient, reported now, is final: in the last backward, or its
        chunk's once armed."""
        return self.active or id(param) in self._armed

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if self._counts(param):
            self._bucket_of[id(param)].ready.add(id(param))
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the buckets whose turn it is and whose gradients are all there."""
        self.order.launch_ready(self._launch)

    def _finish_launches(self) -> None:
        """finish(): launch every bucket not launched yet (deferred ones after
        `before_reduce`)."""
        self.order.finish_step(self._launch, self.before_reduce)

    def _adopt_replaced_grads(self, b: Bucket) -> None:
        for p in b.params:
            view = self._views[id(p)]
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view

    def _launch(self, b: Bucket) -> None:
        """Count the launch, then start the bucket's reduction (`_reduce`)."""
        if self.in_step:
            self.launched_in_step += 1
        else:
            self.launched_in_finish += 1
        self._reduce(b)

    def _on_wire(self, flat: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """What goes into the collective for `flat` (cast to `reduce_dtype` when that differs,
        then True), its bytes counted in `bytes_sent`."""
        cast = self.reduce_dtype is not None and self.reduce_dtype != flat.dtype
        wire = flat.to(self.reduce_dtype) if cast else flat
        self.bytes_sent += wire.numel() * wire.element_size()
        return wire, cast

    def _reduce(self, b: Bucket) -> None:
        """Average the bucket's range of the buffer over the group: an async all-reduce in
        place (on a cast copy under `reduce_dtype`), or the compressor's reduction. Over a
        one-rank group (the experts' at dp x cp == ep) the bucket is its own sum: no
        collective, no cast, the gradient stays exact."""
        self._adopt_replaced_grads(b)
        assert b.flat is not None  # a view of the full buffer (all-reduce)
        if self.average_over > 1:
            b.flat.div_(self.average_over)
        if b.group_size == 1:
            b.handle = Done()
            return
        if self.compressor is not None:
            self.bytes_sent += self.compressor.reduce(b.flat, b.params, b.group)
            b.handle = Done()
            return
        wire, cast = self._on_wire(b.flat)
        work = dist.all_reduce(wire, group=b.group, async_op=True)
        b.handle = CastBack(work, wire, b.flat) if cast else work


class CastBack:
    """The handle of a reduction run on a cast copy: waiting copies the result back (when
    `into` is given; `add`: adds it, as ZeRO-2 accumulates micro-batches into its shard) and
    releases the copy (`keep`: a tensor to hold until then)."""

    def __init__(
        self,
        work,
        result: torch.Tensor | None,
        into: torch.Tensor | None,
        keep: torch.Tensor | None = None,
        add: bool = False,
    ):
        self.work, self.result, self.into, self.keep = work, result, into, keep
        self.add = add

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> bool:
        ok = self.work.wait()
        if self.into is not None:
            assert self.result is not None  # given with `into`, dropped with it
            if self.add:
                self.into.add_(self.result)
            else:
                self.into.copy_(self.result)
        self.result = self.into = self.keep = None
        return ok


class Done:
    """The handle of a reduction that has already completed."""

    def wait(self) -> bool:
        return True
