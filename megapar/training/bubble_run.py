"""What a pipeline-bubble measurement or simulation gives (`BubbleRun`), the per-action costs
read off a measured timeline, and the simulation of a schedule from costs. No torch:
megapar-bubble simulates from given costs before torch is imported; `training.bubble` measures
on the real engine and reads its timeline with these.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from megapar.pipeline.schedules import (
    Action,
    in_flight_peak,
    peer_of,
    placement_of,
    schedule_actions,
)
from megapar.pipeline.simulate import (
    Costs,
    simulate_schedule,
    split_backward,
    theoretical_bubble,
)
from megapar.pipeline.timeline import bubble_stats


@dataclass
class BubbleRun:
    """What a bubble measurement or simulation produced."""

    timeline: object
    """The step's Timeline (rows = pipeline stages)."""
    stats: dict
    """`bubble_stats(timeline)`."""
    theoretical: float | None
    """The schedule's published bubble formula (`simulate.theoretical_bubble`); None where it
    does not apply."""
    in_flight: list[int]
    """Peak micro-batches in flight per stage (forwarded, not yet backwarded)."""
    activation_mb: list[float] | None = None
    """Per stage, the peak MB of tensors autograd held for backward during the step."""
    costs: dict | None = None
    """Mean forward / backward (and B / W) / p2p milliseconds per action."""
    stage_costs: list[dict] | None = None
    """The same per stage, each from its own actions (stages differ: the last one computes the
    LM head and the loss)."""
    simulated: bool = False
    """Whether the timeline is a simulation's (`simulate`) rather than a measured step's."""

    def summary(self) -> dict:
        """The JSON line's fields. `measured_bubble` is the timeline's bubble, a simulation's
        too (the key `bubble_stats` and scripts read); `source` says which it is."""
        return {
            "source": "simulated" if self.simulated else "measured",
            "measured_bubble": self.stats["measured_bubble"],
            "theoretical_bubble": self.theoretical,
            "step_time_s": self.stats["step_time_s"],
            "per_stage_bubble": [r["bubble"] for r in self.stats["per_rank"]],
            "in_flight_peak": self.in_flight,
            "activation_mb": self.activation_mb,
            "costs_ms": self.costs,
            "stage_costs_ms": self.stage_costs,
        }


def theory(pp: int, m: int, schedule: str, virtual_stages: int, costs: dict) -> float | None:
    """The schedule's bubble formula; ZB-H1's uses the F, B and W costs. None where the formula
    does not apply (ZB-H1 with t_W > min(t_F, t_B) or m < pp): the table shows "-" and the
    JSON line null, as strict JSON has no NaN."""

    b, w = costs.get("bwd_input_ms"), costs.get("bwd_weight_ms")  # W may cost nothing
    value = theoretical_bubble(
        pp,
        m,
        schedule,
        virtual_stages,
        costs["fwd_ms"],
        1.0 if b is None else b,
        1.0 if w is None else w,
    )
    return None if math.isnan(value) else value


def equal_stage_bubble(pp: int, m: int, schedule: str, virtual_stages: int, costs: dict) -> float:
    """The schedule's own bubble with every stage at the mean `costs` (F, B, W) and free
    communication: what a V schedule (zb-v, dualpipev) reaches at these sizes, where its
    formula, the pipeline fill, is only a lower bound (reached with t_F = t_B = t_W and
    m >= floor(3 pp / 2), or 2 pp for dualpipev: `simulate.theoretical_bubble`)."""
    fwd = costs["fwd_ms"]
    b, w = costs.get("bwd_input_ms"), costs.get("bwd_weight_ms")
    b = fwd if b is None else b
    w = fwd if w is None else w
    equal = Costs(fwd, b + w, bwd_input_ms=b, bwd_weight_ms=w)
    timeline = simulate_schedule(schedule, pp, m, equal, virtual_stages)
    return bubble_stats(timeline)["measured_bubble"]


def mean_costs(timeline, schedule: str = "1f1b") -> dict:
    """Per-action costs (ms) for the simulator: mean forward and backward (for zero-bubble
    schedules also B = backward_input and W = backward_weight, and backward = B + W), and the
    point-to-point
    latency: for each receive, the time from when both its send and the receive had started to
    when the receive ended (so waiting for the other stage to get to its send is left out);
    the median over all messages of the (clock-aligned) step."""

    def mean(kind):
        d = [e.end - e.start for e in timeline.events if e.kind == kind]
        return 1e3 * sum(d) / len(d) if d else 0.0

    pp = len(timeline.ranks())
    chunks = 1 + max((e.chunk for e in timeline.events), default=0)
    placement = placement_of(schedule)
    sends = {
        (e.kind, e.rank, e.mb, e.chunk): e
        for e in timeline.events
        if e.kind in ("send_act", "send_grad")
    }
    latencies = []
    for e in timeline.events:
        if e.kind in ("recv_act", "recv_grad"):
            peer = peer_of(e.rank, Action(e.kind, e.mb, e.chunk), pp, chunks, placement)
            send = sends.get(("send_" + e.kind[5:], *peer[:1], e.mb, peer[1])) if peer else None
            if send is not None:
                latencies.append(1e3 * max(0.0, e.end - max(e.start, send.start)))
    costs = {
        "fwd_ms": mean("forward"),
        "bwd_ms": mean("backward"),
        "p2p_ms": statistics.median(latencies) if latencies else 0.0,
    }
    if any(e.kind == "backward_input" for e in timeline.events):
        # B: the backward with the linear layers' weight products deferred; W: those products
        costs["bwd_input_ms"], costs["bwd_weight_ms"] = (
            mean("backward_input"),
            mean("backward_weight"),
        )
        costs["bwd_ms"] = costs["bwd_input_ms"] + costs["bwd_weight_ms"]
    return costs


def stage_costs(timeline, p2p_ms: float) -> list[dict]:
    """Per stage (in rank order), the mean forward and backward (and B / W where the schedule
    splits it) milliseconds of that stage's own actions; `p2p_ms` for every stage."""
    out = []
    for rank in timeline.ranks():

        def mean(kind, rank=rank):
            d = [e.end - e.start for e in timeline.events if e.kind == kind and e.rank == rank]
            return 1e3 * sum(d) / len(d) if d else None

        costs = {
            "fwd_ms": mean("forward") or 0.0,
            "bwd_ms": mean("backward") or 0.0,
            "p2p_ms": p2p_ms,
        }
        b, w = mean("backward_input"), mean("backward_weight")
        if b is not None or w is not None:
            costs.update(
                bwd_input_ms=b or 0.0, bwd_weight_ms=w or 0.0, bwd_ms=(b or 0.0) + (w or 0.0)
            )
        out.append(costs)
    return out


def simulate(
    pp: int,
    m: int,
    schedule: str,
    fwd_ms: float,
    bwd_ms: float,
    p2p_ms: float = 0.0,
    virtual_stages: int = 1,
    bwd_input_ms: float | None = None,
    bwd_weight_ms: float | None = None,
    stage_costs: list[dict] | None = None,
) -> BubbleRun:
    """The same timeline and table computed from per-action costs, without processes.
    B and W not given split the backward (`simulate.split_backward`). `stage_costs` (one dict
    of the same keys per stage, e.g. `BubbleRun.stage_costs` of a measurement) simulates stages
    that differ; the other cost arguments then only feed the published formula."""

    bwd_input_ms, bwd_weight_ms = split_backward(bwd_ms, bwd_input_ms, bwd_weight_ms)
    costs = {
        "fwd_ms": fwd_ms,
        "bwd_ms": bwd_ms,
        "p2p_ms": p2p_ms,
        "bwd_input_ms": bwd_input_ms,
        "bwd_weight_ms": bwd_weight_ms,
    }
    per_stage = [Costs(**c) for c in stage_costs] if stage_costs else Costs(**costs)
    timeline = simulate_schedule(schedule, pp, m, per_stage, virtual_stages)
    in_flight = [
        in_flight_peak(schedule_actions(schedule, pp, m, s, virtual_stages)) for s in range(pp)
    ]
    return BubbleRun(
        timeline,
        bubble_stats(timeline),
        theory(pp, m, schedule, virtual_stages, costs),
        in_flight,
        costs=costs,
        stage_costs=stage_costs,
        simulated=True,
    )
