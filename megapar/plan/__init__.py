"""Plan a parallel layout before the cluster: predicted memory, bubble, communication and step
time for every (tp, pp, dp, micro-batch size, schedule, recompute, SP, ZeRO-1), ranked.

`layouts.py` enumerates and rejects with reasons (ep for a mixture of experts), `params.py`
counts parameters on meta-device models, `state.py` and `slices.py` the state a rank holds,
`memory.py` holds the activation formulas (`experts.py` a MoE layer's routed tokens and its
all-to-all bytes), `pipeline.py` asks megapar's simulator (or a
published formula) for bubbles and in-flight micro-batches, `timing.py` prices each model chunk
(`context_parallel.py` its cp attention), `estimate.py` combines them for a `problem.py`
`Problem`, `report.py` ranks and prints. `megapar-plan` (megapar/cli/plan.py) is the command.
"""

import gc
from contextlib import contextmanager

from megapar.plan.estimate import Estimate, Shared, estimate, stage_memory
from megapar.plan.layouts import Candidate, check, enumerate_candidates, parse_candidate
from megapar.plan.problem import Problem
from megapar.plan.report import rank

__all__ = [
    "Candidate",
    "Estimate",
    "Problem",
    "check",
    "cycle_collection_paused",
    "enumerate_candidates",
    "estimate",
    "parse_candidate",
    "plan",
    "stage_memory",
]


SIMULATED_LEADERS = 64
"""`plan` ranks every candidate with the bubble formula, then simulates the schedules of this
many leaders and ranks again: the search stays seconds long for any GPU count."""


def plan(problem: Problem, **space) -> tuple[list[Estimate], list]:
    """(every valid candidate's estimate, ranked; [(candidate, reason)] rejected). The leading
    `SIMULATED_LEADERS` have simulated bubbles, the rest their formula's."""

    with cycle_collection_paused():
        valid, rejected = enumerate_candidates(problem, **space)
        shared = Shared()  # what the candidates' estimates have in common, done once
        first = rank([estimate(problem, c, simulate=False, shared=shared) for c in valid])
        leaders = [estimate(problem, e.candidate, shared=shared) for e in first[:SIMULATED_LEADERS]]
        return rank(leaders + first[SIMULATED_LEADERS:]), rejected


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
