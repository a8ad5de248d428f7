"""ZeRO-3 (FSDP-style): each unit's parameters (`zero3_units.py`) sharded over the
data-parallel group, gathered for each use and freed after it; also the stage's grad sync.

Hooks attached from outside the model (the model knows nothing of this):

- forward: the chunk's pre-hook gathers the root and prefetches the first block; a block's
  pre-hook waits for its own gather and starts the next block's (async, overlapped with this
  block's compute); its post-hook frees it. After the chunk's forward the embedding unit is
  freed, and the *tail* (the root's final norm and head, or the whole root where it is not
  split) too unless a backward of the chunk's output is to come: that backward reads it
  first, so it stays gathered until then (FSDP2 keeps its root so: one gather of the tail
  per micro-batch, not two).
- backward: a hook on the unit's output gradient (it fires before the unit's backward runs)
  gathers the unit again and prefetches the block before it; an identity autograd function on
  the block's input frees the block once its input gradient is computed (nothing after that
  reads the weights: a weight gradient reads the activations only). When the chunk's backward
  starts the tail is waited for and the chunk's last block prefetched (its gather overlaps
  the head's backward). Where the root is split, the tail is freed once the backward has
  passed the last block, and the *embedding* prefetched when the first block's backward
  starts and waited for at its input gradient (a LayerNorm after the embedding reads its
  weight; an embedding's backward reads none). Both are freed when the micro-batch's
  backward ends.
- a recomputed forward (full recomputation) runs inside backward: the unit is gathered then,
  and its hooks neither free nor prefetch.

`keep=True` (``--zero3-keep-params``, torchtitan's ``reshard_after_forward=False``): a unit,
once gathered, stays gathered until the step's `finish()`: one gather per unit and step
instead of two per micro-batch, at the price of the stage's whole parameters during the step.

Gradients: a unit's full gradient buffer (``.grad`` views) is made when its backward first
gathers it. With ``reduce="step"`` (--zero3-reduce step) it accumulates all micro-batches of
the step (ZeRO-2's "keep full gradients until the last one"); when every parameter of the unit
is final (the executor's `GradSync` protocol: `begin_step`, `arm`, `before_last_backward`,
`grads_ready`, `finish`) it is divided by dp, reduce-scattered into `grad_shard` (async) and
freed once that is waited for: before the next unit's reduce-scatter is launched
(`MAX_REDUCES_IN_FLIGHT`, on gloo and NCCL alike), so the backward does not hold the stage's
whole gradient. With ``reduce="micro-batch"`` (DeepSpeed's stage 3) every micro-batch's
backward reduce-scatters each unit once its gradients are there, in rounds as ZeRO-2's buckets
(`LaunchOrder.launch_round`), into a staging slice added into `grad_shard`; the next
micro-batch's backward makes a new buffer (after the previous round's reductions are waited
for). Gradients reported once per step (ZB-H1's W, the tied embedding over stages) hold their
units, and those after them in the round, until then. Units launch in a fixed order (the
blocks from the last, then the root; `LaunchOrder`) whatever order hooks fire in, and gathers
are issued in program order, so every rank of the group issues the same collectives in the
same order (NCCL's rule). The root goes last and, with a tied embedding over pipeline stages
(`defer`), only after `before_reduce`.

Traffic per step without pp (m micro-batches): 2 m all-gathers of every unit but the tail
(m), and one reduce-scatter, m per micro-batch; with `keep`, one all-gather per unit.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from megapar import device as _device
from megapar.data_parallel.launch_order import LaunchOrder
from megapar.data_parallel.zero3_units import (
    FreeAfterBackward,
    Reduction,
    Unit,
    in_backward,
    stage_units,
)
from megapar.mesh import group_size

REDUCES = ("step", "micro-batch")
"""--zero3-reduce: when each unit's gradient is reduce-scattered (`ShardedParams`)."""


class ShardedParams:
    """The units of a stage (`stage.chunks` or the stage itself), sharded over `group`, with
    their hooks; also the stage's grad sync (ZeRO-3's kind of the `GradSync` protocol)."""

    stage = 3
    """The ZeRO stage this grad sync serves (`GradSync.stage`)."""
    sharded = True
    """The parameters, gradients and optimizer state are this rank's slices (`GradSync`)."""
    sharded_grads = True
    """The reduced gradients exist only as this rank's slices (`GradSync`)."""

    MAX_REDUCES_IN_FLIGHT = 1
    """Reduce-scatters left in flight when the next unit's is launched: the older ones are
    waited for first and their full gradient buffers dropped, on every backend (FSDP2's
    default `reduce_scatter_max_input_buffers`: one reduce-scatter overlaps the backward of
    the unit before it). At most two units' full gradients are then alive from the reductions
    (the one in flight and the one being reduced next) besides those autograd is filling.
    gloo: it also bounds the copies of whole buffers gloo holds until a collective is waited
    for (see `Zero1Buckets`). NCCL: the wait only orders the current stream after the
    collective (no host sync); ProcessGroupNCCL keeps its own reference to the input until
    the work is waited for (its tensor stash, which replaced ``recordStream``), and the
    buffer dropped after the wait returns to the caching allocator on the current stream,
    so only work ordered after the reduce-scatter can reuse it."""
    HOST_PIECE_MB = 16.0
    """gloo: a unit whose slice is larger than this is gathered and reduce-scattered
    synchronously, this many MB of each rank's slice at a time through a staging buffer (gloo
    holds up to two copies of a collective's whole buffer until it is waited for). NCCL runs
    every collective in place, whole."""

    def __init__(
        self,
        stage: nn.Module,
        group,
        average_over: int | None = None,
        keep: bool = False,
        persist_below: int = 0,
        offload: bool = False,
        reduce: str = "step",
    ):
        """`persist_below`: parameters with fewer elements go into one *persistent* unit of
        the stage, gathered at the stage's first forward of a step and kept until the step
        ends (DeepSpeed's stage3_param_persistence_threshold: biases and norms are not
        gathered per use). `offload` (--offload-params): each unit's shard is held in host
        memory and copied to a device staging shard for each gather (`Unit.host_shard`).
        `reduce` (--zero3-reduce, `REDUCES`): "step" reduces each unit's gradient once, after
        the last micro-batch's backward; "micro-batch" in every micro-batch's backward."""
        if reduce not in REDUCES:
            raise ValueError(f"--zero3-reduce {reduce!r}: choose one of {', '.join(REDUCES)}")
        self.per_micro_batch = reduce == "micro-batch"
        """Reduce-scatter every micro-batch, into a staging slice added into `grad_shard`."""
        self.offload = offload
        self.group = group
        self.dp = group_size(group)
        self.dp_rank = dist.get_rank(group) if self.dp > 1 else 0
        self.average_over = average_over or self.dp
        self.keep = keep
        self.persist_below = persist_below
        made = stage_units(stage, self.dp, self.dp_rank, persist_below, offload)
        self.chunks, self.roots, self.first = made.chunks, made.roots, made.first
        self.persistent = made.persistent
        """The unit of the parameters under `persist_below` elements (None: none)."""
        self.units: list[Unit] = made.units
        """Every unit, in the order their gradients reduce (`StageUnits.units`)."""
        if not self.units:
            raise ValueError("--zero 3: the stage has no trainable parameters to shard")
        self.params = [p for u in self.units for p in u.params]
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self.host_waits = _device.polls_host(self.params[0].device)
        self.piece = (
            int(self.HOST_PIECE_MB * 2**20) // self.params[0].element_size()
            if self.host_waits
            else None
        )
        """Elements per synchronous piece of a large unit's collectives (gloo), else None."""
        self.bytes_gathered = self.bytes_reduced = 0
        """Bytes this rank received from all-gathers (full buffers) / put into reduce-scatters."""
        self.active = self.in_step = False
        self._armed: set[int] = set()
        self.before_reduce = None
        self.order = LaunchOrder(self.units)
        """The fixed order the units' reductions launch in."""
        self._flight: list[Unit] = []
        """Units whose reduce-scatter is in flight, oldest first."""
        self._attach_hooks()

    @property
    def reduces_every_micro_batch(self) -> bool:
        """Whether every micro-batch's backward reduces (--zero3-reduce micro-batch)."""
        return self.per_micro_batch

    @property
    def next_launch(self) -> int:
        """Index of the next unit to launch (in its round, reducing per micro-batch)."""
        return self.order.next

    # the optimizer's view (ZeroOptimizer.state_tensors reads these) ------------------------
    @property
    def buckets(self) -> list[Unit]:
        """The units, as the optimizer reads `GradBuckets.buckets`."""
        return self.units

    def shard_range(self, u: Unit) -> tuple[int, int]:
        """This rank's slice [lo, hi) of unit `u`'s flat buffer."""
        return u.lo, u.hi

    def held_bytes(self) -> int:
        """Bytes of parameter and gradient shards this rank holds on its device between steps
        (without the parameter shards under --offload-params: they are in `host_bytes`)."""
        return sum(u.shard.untyped_storage().nbytes() + u.grad_shard.nbytes for u in self.units)

    def host_bytes(self) -> int:
        """Bytes of parameter shards this rank holds in host memory (--offload-params)."""
        return sum(u.host_shard.nbytes for u in self.units if u.host_shard is not None)

    # hooks ---------------------------------------------------------------------------------
    def _attach_hooks(self) -> None:
        me = weakref.ref(self)  # the modules hold the hooks: no cycle keeping the group alive

        def call(method, *args):
            obj = me()
            return None if obj is None else getattr(obj, method)(*args)

        for ci, chunk in enumerate(self.chunks):
            roots, first = self.roots[ci], self.first.get(ci)
            chunk.register_forward_pre_hook(
                lambda m, args, r=roots, f=first: call("_chunk_pre", r, f)
            )
            chunk.register_forward_hook(lambda m, args, out, r=roots: call("_chunk_post", r, out))
            tail, embed = roots
            if first is not None:
                last = first
                while last.next is not None:
                    last = last.next
                if tail is not None:
                    tail.last = last
                if embed is not None:
                    first.embedding = embed
                    last.tail = tail
        for u in self.units:
            if u.module not in self.chunks and u is not self.persistent:
                u.module.register_forward_pre_hook(lambda m, args, u=u: call("_block_pre", u, args))
                u.module.register_forward_hook(
                    lambda m, args, out, u=u: call("_block_post", u, out)
                )
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda p: call("_on_grad_ready", p))

    def gather(self, u: Unit | None) -> None:
        if u is None:
            return
        if not u.gathered and u.handle is None:
            self.bytes_gathered += u.nbytes
            u.launch_gather(self.group, self.piece)
        u.wait_gather()

    def prefetch(self, u: Unit | None) -> None:
        if u is not None and not u.gathered and u.handle is None:
            self.bytes_gathered += u.nbytes
            u.launch_gather(self.group, self.piece)

    def release(self, u: Unit | None) -> None:
        if u is not None and not self.keep and u.handle is None and u is not self.persistent:
            u.free()

    def _chunk_pre(self, roots: tuple, first: Unit | None) -> None:
        for u in (self.persistent, *roots):  # the persistent unit: once per step
            self.gather(u)
        self.prefetch(first)

    def _chunk_post(self, roots: tuple, out) -> None:
        """The chunk's forward is done: the embedding unit is freed; the tail too, unless a
        backward of this output will run (it is the first unit that backward reads, so it
        stays gathered until then, as FSDP2 keeps its root: one gather of the tail per
        micro-batch, not two)."""
        tail, embed = roots
        backward = (
            torch.is_grad_enabled()
            and isinstance(out, torch.Tensor)
            and out.requires_grad
            and (tail or embed)
        )
        if backward:
            out.register_hook(lambda g: self._root_backward(tail, embed))
        else:
            self.release(tail)
        self.release(embed)

    def _root_backward(self, tail: Unit | None, embed: Unit | None) -> None:
        """The chunk's backward starts: the tail is gathered (kept since the forward) and the
        chunk's last block prefetched, so its gather overlaps the head's backward (the
        embedding unit is prefetched when the first block's backward starts); both roots are
        freed when the backward ends."""
        if tail is not None:
            self.gather(tail)
            self._grads(tail)
            self.prefetch(tail.last)
        if self.persistent is not None:
            self._grads(self.persistent)

        def done() -> None:
            self.release(tail)
            self.release(embed)

        torch.autograd.Variable._execution_engine.queue_callback(done)

    def _block_input_ready(self, u: Unit) -> None:
        """A block's input gradient is complete: free it; at the first block, gather the
        chunk's embedding unit for the embedding's backward."""
        self.release(u)
        if u.embedding is not None:
            self.gather(u.embedding)
            self._grads(u.embedding)

    def _block_pre(self, u: Unit, args: tuple):
        if in_backward():  # recomputation: gathered by the backward hook
            self.gather(u)
            return None
        self.gather(u)
        self.prefetch(u.next)
        if (
            torch.is_grad_enabled()
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].requires_grad
        ):
            return (FreeAfterBackward.apply(args[0], lambda: self._block_input_ready(u)), *args[1:])
        return None

    def _block_post(self, u: Unit, out):
        if in_backward():
            return None
        self.release(u)
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: self._block_backward(u))
            if u.tail is not None:  # the tail's backward is done when this gradient is
                return FreeAfterBackward.apply(out, lambda: self.release(u.tail))
        return None

    def _block_backward(self, u: Unit) -> None:
        self.gather(u)
        self._grads(u)
        self.prefetch(u.prev if u.prev is not None else u.embedding)

    def _grads(self, u: Unit) -> None:
        """Make `u`'s full gradient buffer for a backward (if it has none); reducing per
        micro-batch, the reduce-scatters still in flight from an earlier round are waited for
        first, so their buffers are gone before the next round's are made (a deferred unit's
        buffer, made once and kept over the step, waits for none)."""
        if u.grad_full is None and not u.deferred:
            for v in [v for v in self._flight if v.launched_round < self.order.rounds]:
                self._wait_reduce(v)
        u.grads()

    # checkpoints ---------------------------------------------------------------------------
    def held_weights(self) -> list[torch.Tensor]:
        """This rank's parameter shards (what it holds of the weights between steps; on the
        host under --offload-params)."""
        return [u.shard if u.host_shard is None else u.host_shard for u in self.units]

    @torch.no_grad()
    def host_params(self, keep_on: bool) -> dict[int, torch.Tensor]:
        """id(param) -> a host copy of the gathered parameter, one unit gathered at a time
        (collective over the group); copies only where `keep_on` (the checkpoint writer)."""
        out = {}
        for u in self.units:
            was = u.gathered
            self.gather(u)
            if keep_on:
                for p in u.params:
                    out[id(p)] = p.detach().to("cpu", copy=True)
            if not was:
                u.free()
        return out

    @contextlib.contextmanager
    def whole(self):
        """Every unit gathered inside (e.g. for loading weights into the parameters); on
        exit each rank's shard is taken from the (possibly rewritten) full parameters and the
        units are freed. Collective."""
        with torch.no_grad():
            for u in self.units:
                self.gather(u)
        try:
            yield
        finally:
            with torch.no_grad():
                for u in self.units:
                    u.keep_shard()
                    u.free()

    # the GradSync protocol -------------------------------------------------------------------
    def defer(self, last: Iterable[nn.Parameter], before_reduce) -> None:
        """Units holding `last` (the tied embedding) reduce only in finish(), after
        `before_reduce()`; they are moved to the end of the launch order."""
        late = {id(p) for p in last}
        if before_reduce is None or not late:
            return
        self.before_reduce = before_reduce
        for u in self.units:
            u.deferred = any(id(p) in late for p in u.params)
        self.units = [u for u in self.units if not u.deferred] + [
            u for u in self.units if u.deferred
        ]
        self.order = LaunchOrder(self.units)

    def begin_step(self) -> None:
        """Start a step: no unit ready, the hooks disarmed (reducing per micro-batch, the
        gradient shards zeroed: the step's reductions are added into them)."""
        for u in self.units:
            if u.reduce_handle is not None:
                raise RuntimeError(
                    "ShardedParams.begin_step() while a reduce-scatter of the "
                    "previous step is in flight; call finish() first"
                )
            if self.per_micro_batch:
                u.grad_shard.zero_()
        self.order.reset()
        self.active = False
        self._armed.clear()
        self.in_step = True

    def arm(self, params: Iterable[nn.Parameter]) -> None:
        """Arm these parameters' hooks: their gradients become final during the next backward
        (one model chunk's last)."""
        self._armed.update(id(p) for p in params)

    def before_last_backward(self) -> None:
        """Arm every hook: gradients become final during the next backward."""
        self.active = True

    def grads_ready(self, params: Iterable[nn.Parameter]) -> None:
        """Declare these parameters' gradients final (code that accumulates weight gradients
        itself, as zero-bubble schedules' W)."""
        ready = [p for p in params if self._counts(p)]
        for p in ready:
            self._unit_of[id(p)].ready.add(id(p))
        if ready:
            self._launch_ready()

    def finish(self) -> None:
        """Launch the units not launched yet (a unit without a backward this step reduces a
        zero gradient), wait for every reduce-scatter; with `keep`, free every unit."""
        if not self.in_step:
            raise RuntimeError("ShardedParams.finish() without begin_step()")
        self.active = self.in_step = False
        self._armed.clear()
        if self.per_micro_batch:
            self.order.finish_rounds(
                self._launch,
                lambda u: u.grad_full is not None or any(p.grad is not None for p in u.params),
                self.before_reduce,
            )
        else:
            self.order.finish_step(self._launch, self.before_reduce)
        while self._flight:
            self._wait_reduce(self._flight[0])
        for u in self.units:
            if u.handle is not None:  # a prefetch nothing used (cannot happen in a schedule)
                u.wait_gather()
            if u.gathered:
                u.free()

    def _counts(self, p: nn.Parameter) -> bool:
        """Whether `p`'s gradient, reported now, is ready for a reduction: per micro-batch
        any time in a step, else in the last backward (or its chunk's, once armed)."""
        return self.in_step and (self.per_micro_batch or self.active or id(p) in self._armed)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if self._counts(p):
            self._unit_of[id(p)].ready.add(id(p))
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the units whose turn it is and whose gradients are all there (in rounds
        when reducing per micro-batch)."""
        if self.per_micro_batch:
            self.order.launch_round(self._launch)
        else:
            self.order.launch_ready(self._launch)

    def _launch(self, u: Unit) -> None:
        """Reduce-scatter `u`'s full gradient into its shard (per micro-batch: into a staging
        slice added into it), once the reductions in flight are fewer than
        `MAX_REDUCES_IN_FLIGHT` (the oldest waited for, their buffers freed). The buffer is
        detached from the unit at once: a later backward makes a new one."""
        while self._flight and (
            len(self._flight) >= self.MAX_REDUCES_IN_FLIGHT or u.reduce_handle is not None
        ):
            self._wait_reduce(self._flight[0])
        u.adopt_replaced_grads()
        flat = u.take_grads()
        if self.average_over > 1:
            flat.div_(self.average_over)
        self.bytes_reduced += flat.nbytes
        staging = torch.empty_like(u.grad_shard) if self.per_micro_batch else None
        work = u.reduce_scatter(
            flat, u.grad_shard if staging is None else staging, self.group, self.piece
        )
        u.reduce_handle = Reduction(
            work, flat, staging, u.grad_shard if staging is not None else None
        )
        u.launched_round = self.order.rounds
        self._flight.append(u)

    def _wait_reduce(self, u: Unit) -> None:
        assert u.reduce_handle is not None  # in flight
        u.reduce_handle.wait()
        u.reduce_handle = None
        self._flight.remove(u)


class HostStage:
    """A stand-in for a ZeRO-3 stage when it is saved: the stage's config and its parameters'
    host copies (`ShardedParams.host_params`), with their attributes (``tp_dim``, ``tied_to``,
    ...); parameters without a copy (on ranks that do not write) are left out; buffers: the
    stage's own."""

    def __init__(self, stage: nn.Module, copies: dict[int, torch.Tensor]):
        self.config = stage.config
        self.named_buffers = stage.named_buffers  # ZeRO-3 shards no buffer
        self._named = []
        for name, p in stage.named_parameters():
            if id(p) in copies:
                t = copies[id(p)]
                t.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_")})
                self._named.append((name, t))

    def named_parameters(self):
        return iter(self._named)
