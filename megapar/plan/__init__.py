"""Plan a parallel layout before the cluster: predicted memory, bubble, communication and step
time for every (tp, pp, dp, micro-batch size, schedule, recompute, SP, ZeRO-1), ranked.

`layouts.py` enumerates and rejects with reasons, `params.py` counts parameters on meta-device
models, `memory.py` holds the activation formulas, `pipeline.py` asks megapar's simulator (or a
published formula) for bubbles and in-flight micro-batches, `estimate.py` combines them,
`report.py` ranks and prints. `megapar-plan` (megapar/cli/plan.py) is the command.
"""

from megapar.plan.estimate import Estimate, Problem, estimate, stage_memory
from megapar.plan.layouts import Candidate, check, enumerate_candidates, parse_candidate

__all__ = ["Candidate", "Estimate", "Problem", "check", "enumerate_candidates", "estimate",
           "parse_candidate", "stage_memory", "plan"]


def plan(problem: Problem, **space) -> tuple[list[Estimate], list]:
    """(every valid candidate's estimate, ranked; [(candidate, reason)] rejected)."""
    from megapar.plan.report import rank

    valid, rejected = enumerate_candidates(problem.config, problem.gpus, problem.gpus_per_node,
                                           problem.global_batch, seq_len=problem.seq_len,
                                           **space)
    return rank([estimate(problem, c) for c in valid]), rejected
