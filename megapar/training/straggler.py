"""The slow rank named: each rank's compute and wait time per step, compared over the world
once per log interval.

In a synchronous job every rank's step takes the same wall time: the ranks that need a slow
rank's results wait for it. What differs is how the time is spent. A rank's *compute* time is
the time of its forward and backward computations (the pipeline executor's compute actions)
minus the time they spent blocked in their own tp / cp collectives (`megapar.comm_wait`); its
*wait* time is the rest of the step (waiting for pipeline messages, for the data-parallel
gradient reduction, for the collectives inside compute, and the optimizer's short work). A
slow rank has the larger compute time; the others the larger wait.

`StragglerDetector.add` keeps the sums of a rank's steps; `report` (collective: one all-gather
of three numbers per rank over the whole world, with the run's timeout) compares them. A rank
is *slow in an interval* when its compute time per step is more than `factor` times the median
of the ranks doing the same work (the other ranks of its pipeline stage; when it is its stage's
only rank, every other rank) and more than `MIN_EXCESS_S` above it; it is *named* once it has
been slow in `INTERVALS` log intervals in a row. The reasoning behind the thresholds is in
docs/guides/faults.md.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapar.device import wait
from megapar.mesh import Layout, Mesh

MIN_EXCESS_S = 0.05
"""Seconds per step a rank's compute time must exceed its reference by, besides the factor (a
descheduled process on a busy host, a timer's jitter on tiny steps)."""
INTERVALS = 2
"""Consecutive log intervals a rank must be slow in to be named."""


@dataclass(frozen=True)
class Straggler:
    """A rank named slow: its coordinates, its compute and wait time per step, the median."""

    rank: int
    tp: int
    cp: int
    pp: int
    dp: int
    compute_s: float
    """Its compute time per step (mean over the interval)."""
    wait_s: float
    """Its wait time per step."""
    median_compute_s: float
    """The median compute time per step of the ranks it was compared with."""

    def describe(self) -> str:
        return (f"straggler rank {self.rank} (tp {self.tp} cp {self.cp} pp {self.pp} dp "
                f"{self.dp}): compute {self.compute_s:.3f} s/step vs median "
                f"{self.median_compute_s:.3f} s ({self.compute_s / self.median_compute_s:.1f}x)"
                if self.median_compute_s > 0 else
                f"straggler rank {self.rank} (tp {self.tp} cp {self.cp} pp {self.pp} dp "
                f"{self.dp}): compute {self.compute_s:.3f} s/step vs median 0 s")


@dataclass
class StragglerReport:
    """Every rank's compute and wait time per step over one log interval, and the ranks named."""

    steps: int
    """Steps in the interval."""
    compute_s: list[float]
    """Per global rank: compute seconds per step."""
    wait_s: list[float]
    """Per global rank: wait seconds per step."""
    stragglers: list[Straggler]
    """The ranks named slow (usually none)."""

    def fields(self) -> dict:
        """The step log's fields (`--log-json`)."""
        slowest = max(range(len(self.compute_s)), key=self.compute_s.__getitem__)
        out = {"compute_s_median": statistics.median(self.compute_s),
               "compute_s_max": self.compute_s[slowest], "compute_s_max_rank": slowest,
               "wait_s_median": statistics.median(self.wait_s)}
        if self.stragglers:
            out["stragglers"] = [vars(s) for s in self.stragglers]
        return out

    def line(self) -> str:
        """What the console log line adds ("" when no rank is named)."""
        return "; ".join(s.describe() for s in self.stragglers)


def slow_ranks(compute_s: list[float], layout: Layout, factor: float,
               min_excess_s: float = MIN_EXCESS_S) -> dict[int, float]:
    """{rank: the median it was compared with} of the ranks slow in one interval: compute time
    per step above `factor` x the median of the ranks of its pipeline stage (every other rank
    when it is alone there) and above it by more than `min_excess_s`."""
    stage = [layout.coords4(r)[2] for r in range(len(compute_s))]
    out = {}
    for rank, mine in enumerate(compute_s):
        peers = [c for r, c in enumerate(compute_s) if r != rank and stage[r] == stage[rank]]
        peers = peers or [c for r, c in enumerate(compute_s) if r != rank]
        if not peers:
            continue
        reference = statistics.median(peers)
        if mine > factor * reference and mine - reference > min_excess_s:
            out[rank] = reference
    return out


class StragglerDetector:
    """One rank's step times, and the collective comparison over the world (see the module)."""

    def __init__(self, mesh: Mesh, factor: float, min_excess_s: float = MIN_EXCESS_S,
                 intervals: int = INTERVALS):
        self.mesh, self.factor = mesh, factor
        self.min_excess_s, self.intervals = min_excess_s, intervals
        self.streak = [0] * mesh.layout.world_size
        """Per rank: the log intervals in a row it has been slow in."""
        self._steps, self._wall, self._compute = 0, 0.0, 0.0

    def add(self, wall_s: float, compute_s: float) -> None:
        """One step of this rank: its wall time and compute time, in seconds."""
        self._steps += 1
        self._wall += wall_s
        self._compute += compute_s

    def report(self) -> StragglerReport | None:
        """Every rank's times since the last report, compared (collective over the world:
        every rank calls it at the same step). None when no step was added."""
        mesh = self.mesh
        mine = torch.tensor([self._steps, self._wall, self._compute], dtype=torch.float64,
                            device=mesh.device)
        everyone = torch.zeros(mesh.layout.world_size * 3, dtype=torch.float64,
                               device=mesh.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        wait(gather(everyone, mine, async_op=True), mesh.device,
             mesh.timeout_s, f"rank {mesh.rank}: gathering every rank's step times (straggler "
             f"detection)")
        self._steps, self._wall, self._compute = 0, 0.0, 0.0
        rows = everyone.reshape(-1, 3).cpu().tolist()
        if any(steps < 1 for steps, _, _ in rows):
            return None
        compute = [c / steps for steps, _, c in rows]
        waits = [max(w - c, 0.0) / steps for steps, w, c in rows]
        slow = slow_ranks(compute, mesh.layout, self.factor, self.min_excess_s)
        self.streak = [self.streak[r] + 1 if r in slow else 0 for r in range(len(rows))]
        named = []
        for rank, reference in sorted(slow.items()):
            if self.streak[rank] >= self.intervals:
                tp, cp, pp, dp = mesh.layout.coords4(rank)
                named.append(Straggler(rank, tp, cp, pp, dp, compute[rank], waits[rank],
                                       reference))
        return StragglerReport(int(rows[0][0]), compute, waits, named)
