"""The time a rank spends blocked in the collectives inside its own compute.

A forward or backward of a tensor- (or context-) parallel stage all-reduces or gathers over its
tp / cp group in the middle of its work; when one rank of the group is slow, the others wait
there, inside their compute. To tell the slow rank from the ranks that wait for it
(`megapar.diagnostics.straggler`), the pipeline executor marks its compute actions with
`counting()`, and the collectives of the parallel layers run inside `blocked(device)`: the time
spent in them while counting is added up, and `take()` returns and resets the sum.

On the CPU (gloo) a collective returns when it is done, so the host clock measures the wait.
On CUDA a collective only queues its kernel: the wait is the kernel's time (an NCCL kernel spins
until every rank has arrived), measured by a CUDA event before and after it, read by `take()`
(after the step, when the device has finished them). Nothing is timed outside `counting()`, so
a run that does not ask for it pays one flag test per collective.

The sum is per process (a module-level clock, like `megapar.faults.status`): one rank per
process.
"""

from __future__ import annotations

import contextlib
import time

import torch


class _Clock:
    def __init__(self) -> None:
        self.on = False
        self.inside = False  # in a blocked() already: a nested collective is not counted twice
        self.seconds = 0.0
        self.events: list[tuple] = []  # CUDA: (start, end) event pairs not read yet


_CLOCK = _Clock()


class counting:
    """Count the collectives run inside this block (the executor: around each compute action
    while its `count_comm_wait` is on; it enters none otherwise); `counting(False)` counts none
    inside the block."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def __enter__(self):
        self.before, _CLOCK.on = _CLOCK.on, self.enabled

    def __exit__(self, *exc) -> None:
        _CLOCK.on = self.before


_NOT_COUNTED = contextlib.nullcontext()


class _Timed:
    """A counted collective: its host time (CPU) or its CUDA event pair."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        _CLOCK.inside = True
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        _CLOCK.inside = False
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            _CLOCK.events.append((self.start, end))
        else:
            _CLOCK.seconds += time.perf_counter() - self.start


def blocked(device: torch.device):
    """Around one collective of the parallel layers (`with blocked(t.device): ...`): its time is
    counted inside `counting()`; elsewhere a shared no-op context."""
    if not _CLOCK.on or _CLOCK.inside:
        return _NOT_COUNTED
    return _Timed(device)


def take() -> float:
    """Seconds counted since the last call (CUDA: waits for the last counted kernel), and reset."""
    seconds, events = _CLOCK.seconds, _CLOCK.events
    _CLOCK.seconds, _CLOCK.events = 0.0, []
    if events:
        events[-1][1].synchronize()
        seconds += sum(start.elapsed_time(end) for start, end in events) / 1e3
    return seconds
