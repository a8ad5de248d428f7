"""The planner's search: every valid layout of a `Problem` estimated and ranked, the leaders'
pipelines simulated (`plan`, `search`)."""

import gc
from contextlib import contextmanager
from dataclasses import dataclass

from megapar.plan.estimate import Estimate, Shared, cannot_fit, estimate
from megapar.plan.layouts import enumerate_candidates
from megapar.plan.problem import Problem
from megapar.plan.report import rank

SIMULATED_LEADERS = 64
"""`plan` ranks every candidate with the bubble formula, then simulates the schedules of this
many leaders and ranks again: the search stays seconds long for any GPU count."""


def plan(problem: Problem, **space) -> tuple[list[Estimate], list]:
    """(every valid candidate's estimate, ranked; [(candidate, reason)] rejected). The leading
    `SIMULATED_LEADERS` have simulated bubbles, the rest their formula's."""
    found = search(problem, **space)
    return found.estimates, found.rejected


@dataclass
class Search:
    """What `search` found."""

    estimates: list[Estimate]
    """Ranked (`report.rank`): every valid layout's estimate, or with `shown` every one but
    those dropped as not fitting."""
    valid: int
    """How many layouts are valid (estimated or dropped)."""
    rejected: list
    """[(candidate, reason)] of the invalid layouts."""


def search(problem: Problem, shown: int | None = None, **space) -> Search:
    """`plan`'s search over `space` (`enumerate_candidates`' options). With `shown`, the rows
    the caller reads from the top of the ranking (a table's, the layouts verified), layouts
    that provably do not fit a GPU (`estimate.cannot_fit`) are dropped before their estimate,
    as long as that leaves the ranking's first `shown` rows and the simulated leaders as they
    are: where fewer than `SIMULATED_LEADERS` layouts fit in the first ranking, or fewer than
    `shown` in the last, every layout is estimated. Dropped layouts fit nowhere, so they rank
    below every layout that fits (`report.rank`), which the sort, stable, leaves in order."""
    with cycle_collection_paused():
        valid, rejected = enumerate_candidates(problem, **space)
        shared = Shared()  # what the candidates' estimates have in common, done once
        dropped = set()
        if shown is not None:
            dropped = {i for i, c in enumerate(valid) if cannot_fit(problem, c, shared)}
        first_pass = {
            i: estimate(problem, c, simulate=False, shared=shared)
            for i, c in enumerate(valid)
            if i not in dropped
        }
        while True:
            first = rank(list(first_pass.values()))  # in the candidates' order, sorted stably
            leaders = [
                estimate(problem, e.candidate, shared=shared) for e in first[:SIMULATED_LEADERS]
            ]
            ranked = rank(leaders + first[SIMULATED_LEADERS:])
            if not dropped or (
                sum(e.fits for e in first) >= SIMULATED_LEADERS
                and sum(e.fits for e in ranked) >= (shown or 0)
            ):
                return Search(ranked, len(valid), rejected)
            for i in sorted(dropped):  # too few fit: the dropped estimated too, in their place
                first_pass[i] = estimate(problem, valid[i], simulate=False, shared=shared)
            first_pass = dict(sorted(first_pass.items()))
            dropped = set()


@contextmanager
def cycle_collection_paused():
    """Python's cycle collector off inside: a plan makes millions of small objects without
    cycles (actions, events, message programs; reference counting frees them), and the
    collector's full passes over the ones the caches keep would cost as much as the planning."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
