"""Plan a parallel layout before the cluster: predicted memory, bubble, communication and step
time for every layout (tp, cp, pp, dp, ep, micro-batch size, schedule, recompute, SP, ZeRO
0-3, offload), ranked.

`layouts.py` enumerates and rejects with reasons (ep for a mixture of experts), `params.py`
counts parameters on meta-device models, `state.py` and `slices.py` the state a rank holds,
`memory.py` holds the activation formulas (`experts.py` a MoE layer's routed tokens and its
all-to-all bytes), `pipeline.py` asks megapar's simulator (or a
published formula) for bubbles and in-flight micro-batches, `timing.py` prices each model chunk
(`context_parallel.py` its cp attention), `estimate.py` combines them for a `problem.py`
`Problem`, `search.py` searches every layout (`plan`), `report.py` ranks and prints.
`megapar-plan` (megapar/cli/plan.py) is the command.
"""

from megapar.plan.estimate import Estimate, Shared, estimate, stage_memory
from megapar.plan.layouts import Candidate, check, enumerate_candidates, parse_candidate
from megapar.plan.problem import Problem
from megapar.plan.search import SIMULATED_LEADERS, Search, cycle_collection_paused, plan, search

__all__ = [
    "SIMULATED_LEADERS",
    "Candidate",
    "Estimate",
    "Problem",
    "Search",
    "Shared",
    "check",
    "cycle_collection_paused",
    "enumerate_candidates",
    "estimate",
    "parse_candidate",
    "plan",
    "search",
    "stage_memory",
]
