"""The time a rank spends blocked in the collectives inside its own compute.

A forward or backward of a tensor- (or context-) parallel stage all-reduces or gathers over its
tp / cp group in the middle of its work; when one rank of the group is slow, the others wait
there, inside their compute. To tell the slow rank from the ranks that wait for it
(`megapar.training.straggler`), the pipeline executor marks its compute actions with
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
    def __init__(self):
        self.on = False
        self.inside = False  # in a blocked() already: a nested collective is not counted twice
        self.seconds = 0.0
        self.events: list[tuple] = []  # CUDA: (start, end) event pairs not read yet


_CLOCK = _Clock()


@contextlib.contextmanager
def counting(enabled: bool = True):
    """Count the collectives run inside this block (the executor: around a compute action)."""
    before = _CLOCK.on
    _CLOCK.on = enabled
    try:
        yield
    finally:
        _CLOCK.on = before


@contextlib.contextmanager
def blocked(device: torch.device):
    """Around one collective of the parallel layers: its time is counted inside `counting()`."""
    if not _CLOCK.on or _CLOCK.inside:
        yield
        return
    _CLOCK.inside = True
    try:
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            _CLOCK.events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            _CLOCK.seconds += time.perf_counter() - t0
    finally:
        _CLOCK.inside = False


def take() -> float:
    """Seconds counted since the last call (CUDA: waits for the last counted kernel), and reset."""
    seconds, events = _CLOCK.seconds, _CLOCK.events
    _CLOCK.seconds, _CLOCK.events = 0.0, []
    if events:
        events[-1][1].synchronize()
        seconds += sum(start.elapsed_time(end) for start, end in events) / 1e3
    return seconds
