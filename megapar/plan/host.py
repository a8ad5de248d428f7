"""Whether the state a job's local CPU ranks hold fits the memory this machine has left: the
check megapar-train and megapar-bubble make before they fork their ranks, so that a model far
larger than the machine is refused in one line instead of the kernel's OOM killer ending a
rank after minutes of start-up."""

from __future__ import annotations

from megapar.host_memory import host_memory_available
from megapar.plan.estimate import stage_states
from megapar.plan.layouts import Candidate
from megapar.plan.memory import GIB
from megapar.plan.problem import Problem


def local_state_bytes(p: Problem, c: Candidate, optimizer: bool = True) -> int:
    """Bytes every rank of layout `c` holds between steps, summed: each stage's most loaded
    rank's parameters, gradients and (with `optimizer`) optimizer state as the planner counts
    them (`estimate.stage_states`), times the tp x cp x dp ranks of the stage. Activations
    and ZeRO-3's gathered units are not counted: a lower bound of what the ranks need."""
    total = 0
    for s in stage_states(p, c):
        held = s.weights + s.grads + s.master + (s.optimizer if optimizer else 0)
        total += c.tp * c.cp * c.dp * held
    return total


def check_host_memory(
    p: Problem, c: Candidate, what: str, fix: str, optimizer: bool = True
) -> None:
    """ValueError (one line: the estimate, the memory available and `fix`) when the local
    ranks of `what` (the job, e.g. "llama-8b at --tp 1 x --pp 1 x --dp 1") would hold more than
    this machine has available (`host_memory.host_memory_available`; nothing is checked where it
    cannot be read)."""
    available = host_memory_available()
    if available is None:
        return
    need = local_state_bytes(p, c, optimizer)
    if need <= available:
        return
    ranks = c.tp * c.cp * c.pp * c.dp
    owner = f"{ranks} rank's" if ranks == 1 else f"{ranks} ranks'"
    state = "parameters, gradients and optimizer state" if optimizer else "parameters and gradients"
    raise ValueError(
        f"{what} needs at least {gib(need)} for its {owner} {state} "
        f"(megapar-plan's count, activations "
        f"not included), more than the {gib(available)} this machine has available; "
        f"{fix}"
    )


def gib(nbytes: float) -> str:
    """Bytes in GiB (MiB below one), as megapar-train's messages give memory."""
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:,.0f} MiB"
