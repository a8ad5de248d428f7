"""What the planner needs from a pipeline schedule: its bubble and its in-flight micro-batches.

A schedule registered in `megapar.pipeline.schedules.SCHEDULES` is *run*: its action lists are
generated and played on megapar's simulator (`megapar.pipeline.simulate`), and the in-flight
count is read off the actions (`in_flight_peak`). A schedule the planner models but megapar does
not implement yet falls back to its published formula. Every result says which was used
("simulated" or "formula"), so a plan never passes a formula off as a simulation.

Every stage's action list comes from `schedules.stage_actions(name, pp, m, v)` (cached: the
bubble, the in-flight counts and the message programs of one candidate share it); zero-bubble
schedules split the backward into B and W, timed with the simulator's `bwd_input_ms` /
`bwd_weight_ms` when its `Costs` has them. What a stage holds is computed for all stages of a
(schedule, pp, m, v) at once and cached, so candidates that differ only in their memory options
(recompute, sp, ZeRO, offload, micro-batch size at the same m) share it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from functools import lru_cache

from megapar.pipeline import messages, schedules
from megapar.pipeline import schedules as sched
from megapar.pipeline import simulate as sim
from megapar.pipeline.placement import placement_of
from megapar.pipeline.schedules import in_flight_peak
from megapar.pipeline.timeline import bubble_stats

MAX_SIMULATED_ACTIONS = 4096
"""Above pp x m x v this many forwards the bubble is the formula's (the simulator is pure
Python)."""
MAX_HELD_FORWARDS = 16384
"""Up to pp x m x v this many forwards, what a stage holds is read off the programs the
executor runs (`messages.held`, what the dry run counts; its cost at the bound:
docs/performance.md, "The planner's speed"); above, off each stage's own action list
(`order_held`), an estimate."""


def _registered(name: str) -> bool:
    return name in schedules.SCHEDULES


def _actions(name: str, pp: int, m: int, stage: int, v: int):
    """The stage's action list, or None when megapar cannot generate this schedule."""

    if not _registered(name):
        return None
    return schedules.stage_actions(name, pp, m, v)[stage]


def loss_grads_in_forward(p, c) -> bool:
    """Whether the chunked loss makes its gradients in the forward for Problem `p` and
    Candidate `c`, as the executor decides (`PipelineExecutor._set_loss_mode`): at tp 1 with
    `loss_chunk_tokens` > 0, where the schedule holds one loss in flight at a time (all but
    GPipe; `schedules.loss_in_flight`)."""
    if not p.loss_chunk_tokens or c.tp != 1:
        return False
    if not _registered(c.schedule):
        return c.schedule != "gpipe"
    m = p.global_batch // (c.mbs * c.dp)
    return sched.loss_in_flight(c.schedule, c.pp, m, c.v) <= 1


def formula_bubble(
    name: str, pp: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0
) -> float:
    """Idle share of the step with equal stages and free communication.

    GPipe and 1F1B: (p-1)/(m+p-1). Interleaved 1F1B (Narayanan et al. 2021): (p-1)/(v m+p-1)
    from m = p on, below it `simulate.interleaved_bubble`'s exact count.
    ZB-H1: `simulate.zb_h1_bound`, (p-1) max(t_F, t_B, t_F + t_B - t_W) idle against
    m (t_F + t_B + t_W) of work, t_B the input-gradient and t_W the weight-gradient half: Qi et
    al. 2024's (p-1)(t_F + t_B - t_W) where t_W <= min(t_F, t_B), exact from m = p on.
    ZB-V and DualPipeV (two chunks per rank, each half a stage): the pipeline fill, (p-1) t_F / 2,
    against the same work; a lower bound, which ZB-V reaches at t_F = t_B = t_W from
    m = floor(3 p / 2) on."""
    if name in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    if name == "interleaved":
        return sim.interleaved_bubble(pp, m, v)
    if name in ("zb-v", "dualpipev"):
        idle = (pp - 1) * t_f / 2
        return idle / (m * (t_f + t_b + t_w) + idle)
    if name == "zb-h1":
        return sim.zb_h1_bound(pp, m, t_f, t_b, t_w)
    raise ValueError(f"no bubble formula for schedule {name!r}")


@lru_cache(maxsize=4096)
def bubble(
    name: str, pp: int, m: int, v: int = 1, bwd_ratio: float = 2.0, simulate: bool = True
) -> tuple[float, str]:
    """(idle share of the step, "simulated" | "formula" | "no pipeline") with
    t_B = bwd_ratio x t_F per micro-batch (the B and W halves of a split backward equal);
    `simulate=False`: the formula whatever the size."""
    if pp == 1:
        return 0.0, "no pipeline"
    if simulate and _registered(name) and pp * m * v <= MAX_SIMULATED_ACTIONS:
        schedules = [_actions(name, pp, m, s, v) for s in range(pp)]
        if all(a is not None for a in schedules):
            return _simulated(schedules, bwd_ratio, v, name), "simulated"
    half = bwd_ratio / 2
    return formula_bubble(name, pp, m, v, 1.0, half, half), "formula"


def _simulated(schedules, bwd_ratio: float, v: int, name: str) -> float:
    # Chunks of an interleaved schedule each do 1/v of the stage's work.
    costs = {"fwd_ms": 1.0 / v, "bwd_ms": bwd_ratio / v}
    names = {f.name for f in dataclasses.fields(sim.Costs)}
    if "bwd_input_ms" in names:
        costs.update(bwd_input_ms=bwd_ratio / (2 * v), bwd_weight_ms=bwd_ratio / (2 * v))
    kwargs = {}
    if "placement" in inspect.signature(sim.simulate).parameters:
        kwargs["placement"] = getattr(sched, "placement_of", lambda n: "loop")(name)
    timeline = sim.simulate(schedules, sim.Costs(**costs), **kwargs)
    return float(bubble_stats(timeline)["measured_bubble"])


RESOLUTION = 1e-3
"""`simulated_step` rounds every cost up to this share of the longest chunk's forward (so that
layouts whose costs differ by less share one simulation; never down: the step is not
underestimated)."""


def simulated_step(name: str, pp: int, m: int, v: int, costs) -> float | None:
    """Seconds of the schedule's micro-batches on megapar's simulator, each model chunk of each
    rank at its own cost: `costs[stage][chunk]` = (F, B, W) seconds of one micro-batch (a
    schedule that does not split the backward runs B + W in one); None for a schedule megapar
    does not run, or above `MAX_SIMULATED_ACTIONS` forwards."""
    if not (_registered(name) and pp * m * v <= MAX_SIMULATED_ACTIONS):
        return None
    unit = max(f for row in costs for f, _, _ in row) * RESOLUTION
    steps = tuple(
        tuple(tuple(math.ceil(x / unit) for x in chunk) for chunk in row) for row in costs
    )
    return _simulated_steps(name, pp, m, v, steps) * unit


@lru_cache(maxsize=4096)
def _simulated_steps(name: str, pp: int, m: int, v: int, steps) -> float:
    """`simulated_step` in whole units of cost (cached)."""
    per_stage = [
        [
            sim.Costs(float(f), float(b + w), bwd_input_ms=float(b), bwd_weight_ms=float(w))
            for f, b, w in row
        ]
        for row in steps
    ]
    times = sim.action_times(
        [_actions(name, pp, m, s, v) for s in range(pp)], per_stage, placement_of(name)
    )
    return 1e3 * max(end for stage in times for _, end in stage[-1:])


@lru_cache(maxsize=4096)
def stage_held(name: str, pp: int, m: int, v: int, stage: int):
    """What a stage holds at every point of its program: the distinct (micro-batches in flight
    per chunk, message buffers). Up to `MAX_HELD_FORWARDS`, exactly what the executor holds
    (`megapar.pipeline.messages.held` of the programs it runs, which the dry run counts too);
    above, `order_held`'s estimate; None for a schedule megapar does not run (the formula of
    `in_flight` applies: its count spread over the chunks)."""
    if not _registered(name):
        return None
    if not held_is_exact(pp, m, v):
        return order_held(name, pp, m, v, stage)
    return _held_exact(name, pp, m, v)[stage]


@lru_cache(maxsize=64)
def _held_exact(name: str, pp: int, m: int, v: int) -> tuple[frozenset, ...]:
    """`messages.held` of every stage's program (computed together: they share work)."""
    return tuple(messages.held_stages(messages.programs(name, pp, m, v), placement_of(name)))


def held_is_exact(pp: int, m: int, v: int) -> bool:
    """Whether `stage_held` is the executor's own count at this size (else an estimate)."""
    return pp * m * v <= MAX_HELD_FORWARDS


@lru_cache(maxsize=4096)
def order_held(name: str, pp: int, m: int, v: int, stage: int) -> frozenset:
    """`stage_held` without the programs' global clock (for sizes too large to simulate): the
    micro-batches in flight per chunk at every point of the stage's own action list (exact:
    the executor runs the computes in this order) and, estimated, every in-flight output's
    message held (the executor frees a sent output once a later message proves the peer has it,
    and also holds the receives it posts ahead). Its error against the executor's count is in
    docs/guides/planner.md."""
    actions = schedules.stage_actions(name, pp, m, v)[stage]
    placement = placement_of(name)
    sends = [sched.virtual_stage(stage, c, pp, placement) < pp * v - 1 for c in range(v)]
    counts, seen = [0] * v, set()
    outputs = 0  # in flight on the chunks that send their output: sum(counts where sends)
    for a in actions:
        if a.kind == "forward":
            step = 1
        elif a.kind in ("backward", "backward_input"):
            step = -1
        else:
            continue
        counts[a.chunk] += step
        if sends[a.chunk]:
            outputs += step
        seen.add((tuple(counts), outputs))
    return frozenset(seen)


def chunk_counts(name: str, pp: int, m: int, v: int, stage: int) -> list[float]:
    """The formula's peak micro-batches in flight on each model chunk of `stage`: interleaved
    1F1B's warmup forwards (and the first steady one) run chunk by chunk in rounds of pp
    micro-batches, so the first chunk holds more; other schedules have one chunk."""
    total = in_flight(name, pp, m, v, simulate=False)[0][stage] * v
    if name in V_COUNTS:  # the V's peak: chunk 0 holds the warmup, chunk 1 stage + 1
        first, second = V_COUNTS[name](pp, m, stage)
        return [float(first), float(second)]
    if name != "interleaved":
        return [total / v] * v
    counts = [0.0] * v
    for j in range(int(total)):
        counts[(j // pp) % v] += 1
    return counts


V_COUNTS = {
    "zb-v": lambda pp, m, s: (min(2 * pp - 1 - s, m), min(s + 1, m)),
    "dualpipev": lambda pp, m, s: (min(2 * pp - s, m), min(s + 1, m)),
}
"""The V schedules' peak micro-batches in flight on (chunk 0, chunk 1) of stage s, read off
their orders at m >= 2 pp (ZB-V: 2 pp chunk-micro-batches on every rank, pp whole stages, as
1F1B's first stage; DualPipeV one more)."""


@lru_cache(maxsize=4096)
def in_flight(
    name: str, pp: int, m: int, v: int = 1, simulate: bool = True
) -> tuple[tuple[float, ...], str]:
    """Per stage, the peak of stored activations in units of *whole-stage* micro-batches (an
    interleaved chunk counts 1/v), and "simulated" (read off the actions) or "formula"
    (`simulate=False`: the formula whatever the size)."""
    if simulate and _registered(name) and pp * m * v <= MAX_SIMULATED_ACTIONS:
        per_stage = [_actions(name, pp, m, s, v) for s in range(pp)]
        if all(a is not None for a in per_stage):
            return tuple(in_flight_peak(a) / v for a in per_stage), "simulated"
    counts: list[float]
    if name == "gpipe":
        counts = [m] * pp
    elif name in ("1f1b", "zb-h1"):  # ZB-H1 keeps 1F1B's warmup, hence its memory
        counts = [min(pp - s, m) for s in range(pp)]
    elif name == "interleaved":  # Megatron's warmup: 2 (p - s - 1) + (v - 1) p chunks, + 1
        counts = [min(2 * (pp - s - 1) + (v - 1) * pp + 1, m * v) / v for s in range(pp)]
    elif name in V_COUNTS:  # two half-stage chunks
        counts = [sum(V_COUNTS[name](pp, m, s)) / 2 for s in range(pp)]
    else:
        raise ValueError(f"no in-flight formula for schedule {name!r}")
    return tuple(float(c) for c in counts), "formula"
