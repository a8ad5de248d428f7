"""The executor's trace of a real step: time stamps right on the device that does the work
(`StepClock`), and every stage's events gathered on pp rank 0 on one clock
(`gather_timeline`, after a traced step: megapar-train's bubble logging, megapar-bubble; its
collectives run over the pp group only, on the mesh device, each with a timeout).

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
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from megapar.mesh import Mesh
from megapar.pipeline.actions import ACTION_KINDS
from megapar.pipeline.p2p import wait_work
from megapar.pipeline.timeline import COMPUTE_KINDS, Event, Timeline


class StepClock:
    """`begin()` starts a step, `stamp()` marks a moment of it, `reader()` (after the step)
    gives the function that turns this step's stamps into seconds."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        # (host seconds, CUDA event) recorded at begin()
        self._origin: tuple[float, torch.cuda.Event] | None = None
        self._last: torch.cuda.Event | None = None  # the latest CUDA event of the step
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
            return lambda stamp: cast(float, stamp)  # perf_counter seconds already
        (host, origin), last = self._origin, self._last
        assert last is not None  # begin() recorded one
        done: list[bool] = []

        def seconds(stamp) -> float:
            if isinstance(stamp, float):
                return stamp
            if not done:
                last.synchronize()
                done.append(True)
            return host + origin.elapsed_time(stamp) / 1e3

        return seconds


# --- every stage's trace on pp rank 0 -----------------------------------------------------------
TRACE_KINDS = (*ACTION_KINDS, "wait", "loss_broadcast")
"""Event kinds `gather_timeline` can encode (as their index in this tuple)."""


class StepTrace:
    """The trace side of `PipelineExecutor`: a traced step's clock readings (`_stamp_at`) and
    the last step's events and compute seconds built from them when read (`last_timeline`,
    `last_compute_s`)."""

    # What the executor sets (`PipelineExecutor.__init__`, `_reset` and `_end`), declared
    # for the methods here:
    trace: bool
    clock: StepClock
    _stamps: list
    _last_trace: tuple[int, list, tuple, Callable[[Any], float]]

    def _stamp_at(self, index: int) -> None:
        """A traced step's clock reading at `index` of its stamps; the walk does the same
        inline (``if traced: stamps[at] = clock()``) at its several readings per compute."""
        if self.trace:
            self._stamps[index] = self.clock.stamp()

    @property
    def last_timeline(self) -> Timeline:
        """The last step's events (empty when it was not traced), read when asked for: on CUDA
        that is when the step's events are waited for, not during the step."""
        rank, stamps, events, at = self._last_trace
        seconds = [None if stamp is None else at(stamp) for stamp in stamps]
        return Timeline(
            [
                Event(rank, k, mb, seconds[s], seconds[e], c)
                for (k, mb, c), s, e in events  # a step that failed part-way:
                if seconds[e] is not None and seconds[s] is not None
            ]
        )  # those ended

    @property
    def last_compute_s(self) -> float:
        """Seconds the last step's compute actions took (0 when it was not traced); on CUDA
        read as `last_timeline` is."""
        _, stamps, events, at = self._last_trace
        return sum(
            at(stamps[e]) - at(stamps[s])
            for (kind, _, _), s, e in events
            if kind in COMPUTE_KINDS and stamps[e] is not None and stamps[s] is not None
        )


def gather_timeline(timeline: Timeline, mesh: Mesh, sync_rounds: int = 8):
    """Every pp stage's events on pp rank 0 (a `Timeline`), None on the other ranks.

    Collective over `mesh.pp_group`; each wait lasts at most the run's timeout
    (`mesh.timeout_s`). Clocks are aligned to pp rank 0's: rank 0 broadcasts its
    clock reading `sync_rounds` times; a receiver's reading minus rank 0's is its clock offset
    plus the message latency, never less (the message cannot arrive before it was sent), so the
    minimum over the rounds is the offset, off by the smallest latency seen (microseconds), and
    robust to a rank being descheduled in one round. Events travel as float64 tensors
    [kind, mb, chunk, start, end] (mb -1 for None), no pickled objects.
    """
    if mesh.pp == 1:
        return Timeline(list(timeline.events))
    group, root, timeout_s = mesh.pp_group, mesh.stage_rank(0), mesh.timeout_s
    dev = mesh.device  # NCCL collectives need tensors on the GPU
    offset = float("inf")
    for _ in range(sync_rounds):
        stamp = torch.tensor([time.perf_counter()], dtype=torch.float64, device=dev)
        wait_work(
            dist.broadcast(stamp, src=root, group=group, async_op=True),
            dev,
            timeout_s,
            f"rank {mesh.rank}: clock alignment of gather_timeline",
        )
        offset = min(offset, time.perf_counter() - stamp.item())
    if mesh.is_first_stage:
        offset = 0.0
    rows = torch.tensor(
        [
            [
                TRACE_KINDS.index(e.kind),
                -1 if e.mb is None else e.mb,
                e.chunk,
                e.start - offset,
                e.end - offset,
            ]
            for e in timeline.events
        ],
        dtype=torch.float64,
        device=dev,
    ).reshape(-1, 5)
    counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(mesh.pp)]
    wait_work(
        dist.all_gather(counts, torch.tensor([len(rows)], device=dev), group=group, async_op=True),
        dev,
        timeout_s,
        f"rank {mesh.rank}: gathering timeline sizes",
    )
    longest = max(int(c) for c in counts)
    padded = torch.zeros(longest, 5, dtype=torch.float64, device=dev)
    padded[: len(rows)] = rows
    parts = [torch.zeros_like(padded) for _ in range(mesh.pp)] if mesh.is_first_stage else None
    wait_work(
        dist.gather(padded, parts, dst=root, group=group, async_op=True),
        dev,
        timeout_s,
        f"rank {mesh.rank}: gathering timelines on pp rank 0",
    )
    if not mesh.is_first_stage:
        return None
    assert parts is not None  # gathered into on the first stage
    events = []
    for stage, (part, count) in enumerate(zip(parts, counts)):
        for kind, mb, chunk, start, end in part[: int(count)].cpu().tolist():
            events.append(
                Event(
                    stage,
                    TRACE_KINDS[int(kind)],
                    None if mb < 0 else int(mb),
                    start,
                    end,
                    int(chunk),
                )
            )
    return Timeline(events)
