"""The slow rank named: each rank's compute and wait time per step, compared over the world
once per log interval.

In a synchronous job every rank's step takes the same wall time: the ranks that need a slow
rank's results wait for it. What differs is how the time is spent. A rank's *compute* time is
its own work in the step, in its device's time (`Engine._compute_s`): on CUDA the time of its
forward and backward actions less the time they spent in their own tp / cp collectives
(`megapar.comm_wait`), where the other ranks of the group wait for the slowest; on the CPU the
CPU time of its computing thread (time blocked in a wait, or taken by other processes of a
shared host, is not its work). Its *wait* time is the rest of the step's wall time. A slow rank
has the larger compute time; the others the larger wait.

`StragglerDetector.add` keeps the sums of a rank's steps and its least compute time in one;
`report` (collective: one all-gather of four numbers per rank over the whole world, with the
run's timeout) compares them. The compute time compared is the least of the interval's steps:
interference (a page fault, a collector pause, a cache cold after a neighbour's job) only ever
adds time, and to some steps, while a slow device slows every step. A rank is *slow in an
interval* when that compute time is more than `factor` times the median of the ranks doing the
same work (the other ranks of its pipeline stage; a rank alone in its stage, whose work no other
rank does, against its own earlier intervals: `references`) and more than `MIN_EXCESS_S` above
it; it is *named* once it has been slow in `INTERVALS` log intervals in a row that hold
`MIN_STEPS` steps or more (at `--log-interval 1` each interval's least is one step's time, which
a loaded host scatters). The reasoning behind the thresholds is in docs/guides/faults.md.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megapar.device import wait
from megapar.mesh import Layout, Mesh

MIN_EXCESS_S = 0.05
"""Seconds per step a rank's compute time must exceed its reference by, besides the factor (on
tiny steps a ratio alone means little: 5 ms of jitter on a 10 ms step is 1.5x)."""
INTERVALS = 2
"""Consecutive log intervals a rank must be slow in to be named."""
MIN_STEPS = 4
"""Steps those intervals must hold together, at least: one step's compute time is one sample,
which a loaded host scatters (1.6-1.7x at `--log-interval 1` under torchrun); `INTERVALS`
intervals of 2 steps or more hold enough."""
HISTORY = 32
"""Intervals of its own a rank alone in its pipeline stage is compared with (the latest)."""


@dataclass(frozen=True)
class Straggler:
    """A rank named slow: its coordinates, its compute and wait time per step, the median."""

    rank: int
    tp: int
    cp: int
    pp: int
    dp: int
    compute_s: float
    """Its compute time in a step: the least of the interval's steps."""
    wait_s: float
    """Its wait time per step (the interval's mean)."""
    median_compute_s: float
    """The median compute time per step it was compared with."""
    compared_with: str = "stage"
    """"stage": the median over the other ranks of its pipeline stage; "own history": its own
    median over its earlier intervals, scaled by the other stages' change (a rank alone in its
    stage: `references`)."""

    def describe(self) -> str:
        """The log line's words for it."""
        ratio = (
            f" ({self.compute_s / self.median_compute_s:.1f}x)" if self.median_compute_s > 0 else ""
        )
        whose = "its stage's median" if self.compared_with == "stage" else "its own median"
        return (
            f"straggler rank {self.rank} (tp {self.tp} cp {self.cp} pp {self.pp} dp "
            f"{self.dp}): compute {self.compute_s:.3f} s/step vs {whose} "
            f"{self.median_compute_s:.3f} s{ratio}"
        )


@dataclass
class StragglerReport:
    """Every rank's compute and wait time per step over one log interval, and the ranks named."""

    steps: int
    """Steps in the interval."""
    compute_s: list[float]
    """Per global rank: compute seconds in a step, the least of the interval's steps (noise
    on a shared host only adds time; a slow device slows every step)."""
    wait_s: list[float]
    """Per global rank: wait seconds per step, the interval's mean."""
    stragglers: list[Straggler]
    """The ranks named slow (usually none)."""
    suspects: list[int]
    """The ranks slow in this interval but not (yet) in `INTERVALS` in a row."""

    def fields(self) -> dict:
        """The step log's fields (`--log-json`)."""
        slowest = max(range(len(self.compute_s)), key=self.compute_s.__getitem__)
        out: dict[str, Any] = {
            "compute_s_median": statistics.median(self.compute_s),
            "compute_s_max": self.compute_s[slowest],
            "compute_s_max_rank": slowest,
            "wait_s_median": statistics.median(self.wait_s),
        }
        if self.stragglers:
            out["stragglers"] = [vars(s) for s in self.stragglers]
        if self.suspects:
            out["straggler_suspects"] = self.suspects
        return out

    def line(self) -> str:
        """What the console log line adds ("" when no rank is named)."""
        return "; ".join(s.describe() for s in self.stragglers)


def _median_without(values: list[float], i: int) -> float:
    """The median of sorted `values` without its i-th element (at least two values)."""
    n = len(values) - 1

    def at(j: int) -> float:
        return values[j] if j < i else values[j + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def references(
    compute_s: list[float], layout: Layout, history: list[list[float]] | None = None
) -> list[tuple[float, str] | None]:
    """Per rank, what its compute time per step is compared with, and how it was found: the
    median of the other ranks of its pipeline stage ("stage": they do the same work), or, for
    a rank alone in its stage (a pipeline without tp / cp / dp, whose stages do different
    work), the median of its own earlier intervals in `history`, scaled by the median change
    of the other stages' times against theirs (a larger batch slows every stage alike)
    ("own history"; None before there is one)."""
    stages: dict[int, list[int]] = {}
    for rank in range(len(compute_s)):
        stages.setdefault(layout.coords4(rank)[2], []).append(rank)
    out: list[tuple[float, str] | None] = [None] * len(compute_s)
    own = {
        ranks[0]: statistics.median(history[ranks[0]])
        for ranks in stages.values()
        if len(ranks) == 1 and history and history[ranks[0]]
    }
    change = {r: compute_s[r] / before for r, before in own.items() if before > 0}
    for rank, before in own.items():  # scaled by how the other stages' times changed
        others = sorted(c for r, c in change.items() if r != rank)
        out[rank] = (before * (statistics.median(others) if others else 1.0), "own history")
    for ranks in stages.values():
        if len(ranks) == 1:
            continue
        order = sorted(ranks, key=compute_s.__getitem__)
        values = [compute_s[r] for r in order]
        for i, rank in enumerate(order):
            out[rank] = (_median_without(values, i), "stage")
    return out


def slow_ranks(
    compute_s: list[float],
    layout: Layout,
    factor: float,
    min_excess_s: float = MIN_EXCESS_S,
    history: list[list[float]] | None = None,
) -> dict[int, tuple[float, str]]:
    """{rank: (reference, how)} of the ranks slow in one interval: compute time per step above
    `factor` x its reference (`references`) and above it by more than `min_excess_s`."""
    out = {}
    for rank, ref in enumerate(references(compute_s, layout, history)):
        if (
            ref is not None
            and compute_s[rank] > factor * ref[0]
            and compute_s[rank] - ref[0] > min_excess_s
        ):
            out[rank] = ref
    return out


class StragglerDetector:
    """One rank's step times, and the collective comparison over the world (see the module)."""

    def __init__(
        self,
        mesh: Mesh,
        factor: float,
        min_excess_s: float = MIN_EXCESS_S,
        intervals: int = INTERVALS,
        min_steps: int = MIN_STEPS,
    ):
        self.mesh, self.factor = mesh, factor
        self.min_excess_s, self.intervals, self.min_steps = min_excess_s, intervals, min_steps
        self.streak = [0] * mesh.layout.world_size
        """Per rank: the log intervals in a row it has been slow in."""
        self.streak_steps = [0] * mesh.layout.world_size
        """Per rank: the steps those intervals held."""
        self.history: list[list[float]] = [[] for _ in range(mesh.layout.world_size)]
        """Per rank alone in its pipeline stage: its compute time per step in the intervals it
        was not slow in, the first (warm-up) left out."""
        self._intervals = 0
        stage_size = mesh.layout.world_size // mesh.layout.pp
        self._alone = stage_size == 1  # every rank alone in its stage: a pure pipeline
        self._steps, self._wall, self._compute, self._least = 0, 0.0, 0.0, math.inf

    def add(self, wall_s: float, compute_s: float) -> None:
        """One step of this rank: its wall time and compute time, in seconds."""
        self._steps += 1
        self._wall += wall_s
        self._compute += compute_s
        self._least = min(self._least, compute_s)

    def report(self) -> StragglerReport | None:
        """Every rank's times since the last report, compared (collective over the world:
        every rank calls it at the same step). None when no step was added."""
        mesh = self.mesh
        mine = torch.tensor(
            [self._steps, self._wall, self._compute, self._least],
            dtype=torch.float64,
            device=mesh.device,
        )
        everyone = torch.zeros(mesh.layout.world_size * 4, dtype=torch.float64, device=mesh.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        wait(
            gather(everyone, mine, async_op=True),
            mesh.device,
            mesh.timeout_s,
            f"rank {mesh.rank}: gathering every rank's step times (straggler detection)",
        )
        self._steps, self._wall, self._compute, self._least = 0, 0.0, 0.0, math.inf
        rows = everyone.reshape(-1, 4).cpu().tolist()
        if any(steps < 1 for steps, *_ in rows):
            return None
        compute = [least for *_, least in rows]
        waits = [max(w - c, 0.0) / steps for steps, w, c, _ in rows]
        slow = slow_ranks(compute, mesh.layout, self.factor, self.min_excess_s, self.history)
        steps = int(rows[0][0])
        self.streak = [self.streak[r] + 1 if r in slow else 0 for r in range(len(rows))]
        self.streak_steps = [
            self.streak_steps[r] + steps if r in slow else 0 for r in range(len(rows))
        ]
        self._intervals += 1
        named, suspects = [], []
        for rank in range(len(rows)):
            if (
                rank in slow
                and self.streak[rank] >= self.intervals
                and self.streak_steps[rank] >= self.min_steps
            ):
                tp, cp, pp, dp = mesh.layout.coords4(rank)
                reference, how = slow[rank]
                named.append(
                    Straggler(rank, tp, cp, pp, dp, compute[rank], waits[rank], reference, how)
                )
            elif rank in slow:
                suspects.append(rank)
            elif rank not in slow and self._intervals > 1 and self._alone:
                self.history[rank] = [*self.history[rank][-HISTORY + 1 :], compute[rank]]
        return StragglerReport(steps, compute, waits, named, suspects)
