"""ZeRO-3's gradient reductions: the `GradSync` protocol over a stage's units
(`zero3_units.py`); `ShardedParams` (`sharded_params.py`) adds the gathers and hooks.

A unit's full gradient buffer (``.grad`` views) is made when its backward first gathers it.
With ``reduce="step"`` (--zero3-reduce step) it accumulates all micro-batches of the step
(ZeRO-2's "keep full gradients until the last one"); when every parameter of the unit is final
(the executor's `GradSync` protocol: `begin_step`, `arm`, `before_last_backward`,
`grads_ready`, `finish`) it is divided by dp, reduce-scattered over the unit's group into
`grad_shard` (async) and freed once that is waited for: before the next unit's reduce-scatter
is launched (`MAX_REDUCES_IN_FLIGHT`, on gloo and NCCL alike), so the backward does not hold
the stage's whole gradient. With ``reduce="micro-batch"`` (DeepSpeed's stage 3) every
micro-batch's backward reduce-scatters each unit once its gradients are there, in rounds as
ZeRO-2's buckets (`LaunchOrder.launch_round`), into a staging slice added into `grad_shard`;
the next micro-batch's backward makes a new buffer (after the previous round's reductions are
waited for). Gradients reported once per step (ZB-H1's W, the tied embedding over stages) hold
their units, and those after them in the round, until then.

Units launch in a fixed order (the blocks from the last, then the root; a unit's experts just
before it; `LaunchOrder`) whatever order hooks fire in, so every rank issues the same
reductions in the same order, over both groups under expert parallelism (an expert unit's
over the expert-data-parallel group, the others' over cp x dp; every gradient divided by dp:
the mean over the global batch in both, as `GradBuckets`). The root goes last and, with a tied
embedding over pipeline stages (`defer`), only after `before_reduce`.

A unit whose group is this rank alone (`Unit.alone`: an experts' unit where ep = cp x dp) has
neither buffer nor reduction: its ``.grad`` are views into its `grad_shard`, zeroed when the
step begins, where autograd accumulates every micro-batch, and `finish` divides it by dp (the
step's sum divided once; reducing per micro-batch, the other units add each micro-batch's
quotient instead: the same bit for bit at a power-of-two dp, else within rounding). It keeps
its place in the launch order (its launch does nothing), so the collectives around it are
issued as before, in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from megapar.data_parallel.launch_order import LaunchOrder
from megapar.data_parallel.zero3_units import Reduction, Unit

REDUCES = ("step", "micro-batch")
"""--zero3-reduce: when each unit's gradient is reduce-scattered (`UnitGradSync`)."""


class UnitGradSync:
    """The reductions of a stage's units (ZeRO-3's kind of the `GradSync` protocol), each
    over its unit's group; `ShardedParams` is one with the gathers and hooks."""

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

    def __init__(self, units: list[Unit], average_over: int, reduce: str = "step"):
        """`units` in the order their gradients reduce; each gradient is divided by
        `average_over` (dp) before its reduce-scatter. `reduce` (--zero3-reduce, `REDUCES`):
        "step" reduces each unit's gradient once, after the last micro-batch's backward;
        "micro-batch" in every micro-batch's backward."""
        if reduce not in REDUCES:
            raise ValueError(f"--zero3-reduce {reduce!r}: choose one of {', '.join(REDUCES)}")
        self.per_micro_batch = reduce == "micro-batch"
        """Reduce-scatter every micro-batch, into a staging slice added into `grad_shard`."""
        self.units = units
        """Every unit, in the order their gradients reduce (`StageUnits.units`)."""
        self.average_over = average_over
        self.params = [p for u in units for p in u.params]
        self._unit_of = {id(p): u for u in units for p in u.params}
        self.piece: int | None = None
        """Elements per synchronous piece of a large unit's collectives (gloo), else None."""
        self.active = self.in_step = False
        self._armed: set[int] = set()
        self.before_reduce = None
        self.order = LaunchOrder(units)
        """The fixed order the units' reductions launch in."""
        self._flight: list[Unit] = []
        """Units whose reduce-scatter is in flight, oldest first."""

    @property
    def reduces_every_micro_batch(self) -> bool:
        """Whether every micro-batch's backward reduces (--zero3-reduce micro-batch)."""
        return self.per_micro_batch

    def _grads(self, u: Unit) -> None:
        """Make the full gradient buffers of `u` and its experts' unit for a backward (where
        there are none); reducing per micro-batch, the reduce-scatters still in flight from an
        earlier round are waited for first, so their buffers are gone before the next round's
        are made (a deferred unit's buffer, made once and kept over the step, waits for none)."""
        for v in u.members():
            if v.grad_full is None and not (v.deferred or v.alone):
                for w in [w for w in self._flight if w.launched_round < self.order.rounds]:
                    self._wait_reduce(w)
            v.grads()

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
            if self.per_micro_batch or u.alone:
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
        zero gradient), wait for every reduce-scatter; free every unit still gathered."""
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
            if u.alone:  # its gradient is in its shard already: averaged as the reduced ones
                u.adopt_replaced_grads()
                if self.average_over > 1:
                    u.grad_shard.div_(self.average_over)
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
        """Reduce-scatter `u`'s full gradient over its group into its shard (per micro-batch:
        into a staging slice added into it), once the reductions in flight are fewer than
        `MAX_REDUCES_IN_FLIGHT` (the oldest waited for, their buffers freed). The buffer is
        detached from the unit at once: a later backward makes a new one. A unit whose group
        is this rank `alone` reduces nothing (its gradient accumulates in its shard, divided in
        `finish`); it keeps its place in the order, so the launches around it are the same."""
        if u.alone:
            return
        while self._flight and (
            len(self._flight) >= self.MAX_REDUCES_IN_FLIGHT or u.reduce_handle is not None
        ):
            self._wait_reduce(self._flight[0])
        u.adopt_replaced_grads()
        flat = u.take_grads()
        if self.average_over > 1:
            flat.div_(self.average_over)
        staging = torch.empty_like(u.grad_shard) if self.per_micro_batch else None
        work = u.reduce_scatter(flat, u.grad_shard if staging is None else staging, self.piece)
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
