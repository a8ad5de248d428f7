"""The order in which a stage's gradient reductions are launched, whatever order gradients
become final in: every rank of the data-parallel group must issue the same collectives in the
same order (NCCL's rule), but autograd's hooks fire in an order that may differ between ranks.

`LaunchOrder` keeps a fixed list of *items* (`GradBuckets`' buckets, ZeRO-3's units): each has
``params``, a ``ready`` set (ids of the parameters whose gradient is there) and ``deferred``
(launched only after the step's `before_reduce`, e.g. the tied-embedding sum over pipeline
stages). An item is launched once it is complete and every item before it was launched:

- once a step (`launch_ready`, `finish_step`): each item is reduced once, in the last
  backward, and `finish_step` launches the rest (a parameter without a backward keeps a zero
  gradient), the deferred items last;
- in rounds (`launch_round`, `finish_rounds`; ZeRO-2, ZeRO-3 per micro-batch): every
  micro-batch's backward reduces the non-deferred items in order, one round per micro-batch;
  an item not complete holds the ones after it, whose gradients keep accumulating until they
  launch or `finish_rounds` reduces what accumulated since each item's last launch.

The owner passes its launch function to each call (so a wrapper installed on the owner, as
tests and the dry run do, is the one called).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar


class Item(Protocol):
    """What `LaunchOrder` orders: a bucket or a unit."""

    params: list
    ready: set[int]
    deferred: bool


T = TypeVar("T", bound=Item)
"""The kind of item a `LaunchOrder` orders (`Bucket` or `Unit`)."""


class LaunchOrder(Generic[T]):
    """A fixed launch order over `items` and the position reached in the current step."""

    def __init__(self, items: Sequence[T]):
        self.items = list(items)
        self.next = 0
        """Index (into `items`, or into `round_items` in rounds) of the next item to launch."""
        self.rounds = 0
        """Rounds (every non-deferred item launched once) completed in this step."""
        self.deferred_ok = False
        """The step's `before_reduce` ran: deferred items may launch."""

    @property
    def round_items(self) -> list[T]:
        """The items reduced in each round (all but the deferred ones), in order."""
        return [i for i in self.items if not i.deferred]

    def reset(self) -> None:
        """A new step: nothing launched, every ready set empty."""
        for item in self.items:
            item.ready.clear()
        self.next = self.rounds = 0
        self.deferred_ok = False

    def launched_all(self) -> bool:
        """Whether every item was launched once this step (once-a-step mode)."""
        return self.next >= len(self.items)

    def launch_ready(self, launch: Callable[[T], None]) -> None:
        """Once a step: launch the items, in order, while the next one is complete (and, if
        deferred, allowed)."""
        while self.next < len(self.items):
            item = self.items[self.next]
            if len(item.ready) < len(item.params) or (item.deferred and not self.deferred_ok):
                return
            launch(item)
            self.next += 1

    def finish_step(self, launch: Callable[[T], None], before_reduce) -> None:
        """Once a step, at its end: every item counts as complete; launch what is left, the
        deferred items after `before_reduce()`."""
        for item in self.items:
            item.ready.update(id(p) for p in item.params)
        self.launch_ready(launch)
        if not self.launched_all():
            before_reduce()
            self.deferred_ok = True
            self.launch_ready(launch)

    def launch_round(self, launch: Callable[[T], None]) -> None:
        """In rounds: launch the current round's items in order while the next one is complete
        (its ready set cleared); after the last a new round starts."""
        rnd = self.round_items
        while rnd:
            item = rnd[self.next]
            if len(item.ready) < len(item.params):
                return
            item.ready.clear()
            launch(item)
            self.next = (self.next + 1) % len(rnd)
            self.rounds += self.next == 0

    def finish_rounds(
        self, launch: Callable[[T], None], has_grad: Callable[[T], bool], before_reduce
    ) -> None:
        """In rounds, at the step's end: reduce what accumulated since each item's last launch
        (the rest of the current round first, then the items before it; an item without any
        gradient since, `has_grad`, is skipped: its share is reduced already), then the
        deferred items after `before_reduce()`. Which items hold a gradient depends only on the
        model and the schedule, the same on every rank of the group."""
        rnd, start = self.round_items, self.next
        for item in rnd[start:] + rnd[:start]:
            if has_grad(item):
                launch(item)
            item.ready.clear()
        deferred = [i for i in self.items if i.deferred]
        if deferred:
            before_reduce()
            for item in deferred:
                launch(item)
