"""Time stamps for the executor's trace that are right on the device that does the work.

On the CPU an action has finished when its Python call returns, so `time.perf_counter` is the
clock. On CUDA a call returns as soon as its kernels are queued: host timestamps would measure
launch overhead, not work. There each stamp is a CUDA event recorded on the current stream, and
the stamps are turned into seconds on the `perf_counter` axis only when the step's timeline is
read (`StepClock.reader`): one wait for the step's last event then, none per action, none per
step while nobody reads the trace. The axis is anchored by an event recorded at the start of the
step together with a host reading; a step starts after the previous step's loss was read, so the
device is idle then and the anchor runs when it is recorded. So timelines from either device
share one clock and `gather_timeline` aligns them the same way.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


class StepClock:
    """`begin()` starts a step, `stamp()` marks a moment of it, `reader()` (after the step)
    gives the function that turns this step's stamps into seconds."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._origin = None  # (host seconds, CUDA event) recorded at begin()
        self._last = None  # the latest CUDA event of the step
        self.stamp = self._cuda_stamp if self.cuda else time.perf_counter

    def begin(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._origin, self._last = (time.perf_counter(), event), event

    def _cuda_stamp(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._last = event
        return event

    def reader(self) -> Callable[[object], float]:
        """Seconds on the perf_counter axis of this step's stamps. On CUDA the first call waits
        for the step's last event (so every stamp has a time)."""
        if not self.cuda or self._origin is None:
            return lambda stamp: stamp
        (host, origin), last, done = self._origin, self._last, []

        def seconds(stamp) -> float:
            if isinstance(stamp, float):
                return stamp
            if not done:
                last.synchronize()
                done.append(True)
            return host + origin.elapsed_time(stamp) / 1e3
        return seconds
