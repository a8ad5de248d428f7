"""Time stamps for the executor's trace that are right on the device that does the work.

On the CPU an action has finished when its Python call returns, so `time.perf_counter` is the
clock. On CUDA a call returns as soon as its kernels are queued: host timestamps would measure
launch overhead, not work. There each stamp is a CUDA event recorded on the current stream, and
`resolve` turns the events into seconds on the `perf_counter` axis once the step is over (one
synchronisation at the end, none per action), anchored by an event recorded together with a host
reading at the start of the step. So timelines from either device share one clock and
`gather_timeline` aligns them the same way.
"""

from __future__ import annotations

import time

import torch


class StepClock:
    """`stamp()` during a step, `resolve(stamps)` after it; `begin()` starts a step."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.device = torch.device(device)
        self._origin = None  # (host seconds, CUDA event) recorded at begin()
        self.stamp = self._cuda_stamp if self.cuda else time.perf_counter

    def begin(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the anchor event completes at `now`
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._origin = (time.perf_counter(), event)

    def _cuda_stamp(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self, stamp) -> float:
        """Seconds on the perf_counter axis of a stamp (an event: after `finish`)."""
        if not self.cuda or isinstance(stamp, float):
            return stamp
        host, origin = self._origin
        return host + origin.elapsed_time(stamp) / 1e3

    def finish(self) -> None:
        """Wait for the step's recorded events (CUDA), so `resolve` can read them."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
