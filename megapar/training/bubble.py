"""Measure the pipeline bubble of the real engine, or simulate it from per-action costs.

`measure()` runs the executor on real processes (one per rank) for a few steps of a model whose
stages are equal and compute-bound (a small vocabulary, so the embedding and head add little),
and returns pp rank 0's view of the last step's timeline, aligned across stages.
`simulate()` computes the same timeline from costs without processes.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from megapar.device import keep_freed_host_memory
from megapar.launcher import run_local
from megapar.mesh import Mesh
from megapar.models import GPT2Config
from megapar.models.config import config_from_dict
from megapar.models.recipes import resolve_model
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.partition import build_stage
from megapar.pipeline.schedules import (
    Action,
    check_schedule,
    chunks_per_rank,
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
from megapar.pipeline.timeline import Timeline, bubble_stats
from megapar.pipeline.trace import gather_timeline


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

    def summary(self) -> dict:
        return {
            "measured_bubble": self.stats["measured_bubble"],
            "theoretical_bubble": self.theoretical,
            "step_time_s": self.stats["step_time_s"],
            "per_stage_bubble": [r["bubble"] for r in self.stats["per_rank"]],
            "in_flight_peak": self.in_flight,
            "activation_mb": self.activation_mb,
            "costs_ms": self.costs,
            "stage_costs_ms": self.stage_costs,
        }


def bench_config(model: str | None, pp: int, virtual_stages: int = 1):
    """The model to measure: a recipe, or by default a compute-bound GPT-2 with 2 blocks per
    stage (one per chunk with V=2, V per rank beyond) and a 256-token vocabulary (so stages
    are nearly equal)."""

    if model:
        return resolve_model(model)
    return GPT2Config(
        vocab_size=256,
        n_positions=256,
        n_embd=512,
        n_layer=max(2, virtual_stages) * pp,
        n_head=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


class _HeldBytes:
    """Bytes of activations autograd holds for backward: now, and the peak of the step.
    Tensors that share storage with a parameter (weights saved by linear layers) are not
    activations and are left out."""

    def __init__(self, params):
        self.now = self.peak = 0
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}

    def pack(self, t):
        if t.untyped_storage().data_ptr() in self.param_storages:
            return _Held(self, t, counted=False)
        return _Held(self, t)

    @staticmethod
    def unpack(held):
        return held.tensor


class _Held:
    def __init__(self, owner: _HeldBytes, t: torch.Tensor, counted: bool = True):
        self.owner, self.tensor = owner, t
        self.bytes = t.numel() * t.element_size() if counted else 0
        owner.now += self.bytes
        owner.peak = max(owner.peak, owner.now)

    def __del__(self):
        self.owner.now -= self.bytes


def _worker(config_dict, tp, pp, m, schedule, steps, mbs, seq_len, virtual_stages=1, cp=1):
    config = config_from_dict(config_dict)
    mesh = Mesh.from_env(tp, pp, 1, cp=cp)
    model = build_stage(
        config,
        mesh,
        seed=0,
        virtual_stages=chunks_per_rank(schedule, virtual_stages),
        placement=placement_of(schedule),
    )
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, config.vocab_size, (mbs, seq_len + 1), generator=gen) for _ in range(m)]
    micro = [
        {"input_ids": t[:, :-1].to(mesh.device), "labels": t[:, 1:].to(mesh.device)} for t in ids
    ]
    executor = PipelineExecutor(
        model,
        mesh,
        schedule,
        (mbs, seq_len // cp, config.hidden_size),
        virtual_stages=virtual_stages,
    )
    keep_freed_host_memory()  # the model is built: the steps' tensors are kept
    held = _HeldBytes(model.parameters())
    timeline = None
    for _step in range(steps + 1):  # step 0 warms up
        model.zero_grad(set_to_none=True)
        held.peak = held.now
        with torch.autograd.graph.saved_tensors_hooks(held.pack, held.unpack):
            executor.run(micro)
        timeline = gather_timeline(executor.last_timeline, mesh)
    peak = in_flight_peak(schedule_actions(schedule, pp, m, mesh.pp_rank, virtual_stages))
    parts = gather_stage_info(mesh, [float(peak), held.peak / 2**20])
    if mesh.rank != 0:
        return None
    return timeline.to_json(), [int(p[0]) for p in parts], [float(p[1]) for p in parts]


def gather_stage_info(mesh, values: list[float]) -> list[list[float]]:
    """Every pp stage's `values` (same length everywhere), in stage order; collective over
    the pp group, on the mesh device (NCCL rejects CPU tensors)."""
    info = torch.tensor(values, dtype=torch.float64, device=mesh.device)
    if mesh.pp_group is None:
        return [info.tolist()]
    parts = [torch.zeros_like(info) for _ in range(mesh.pp)]
    torch.distributed.all_gather(parts, info, group=mesh.pp_group)
    return [p.tolist() for p in parts]


def measure(
    pp: int,
    m: int,
    schedule: str,
    tp: int = 1,
    model: str | None = None,
    steps: int = 3,
    micro_batch_size: int = 4,
    seq_len: int = 64,
    virtual_stages: int = 1,
    cp: int = 1,
) -> BubbleRun:
    """Run the real engine on pp*tp*cp local processes; the last of `steps` steps' timeline
    (cp rank 0's pipeline; the cp ranks' costs include their attention exchanges).

    activation_mb is, per stage, the peak of the tensors autograd held for backward during
    the step (parameters included when saved): what the schedule's in-flight count bounds."""
    check_schedule(schedule, pp, m, virtual_stages)
    config = bench_config(model, pp, chunks_per_rank(schedule, virtual_stages))
    results = run_local(
        _worker,
        pp * tp * cp,
        config.to_dict(),
        tp,
        pp,
        m,
        schedule,
        steps,
        micro_batch_size,
        seq_len,
        virtual_stages,
        cp,
        timeout_s=600,
    )
    timeline_json, in_flight, act = results[0]
    timeline = Timeline.from_json(timeline_json)
    stats = bubble_stats(timeline)
    costs = mean_costs(timeline, schedule)
    return BubbleRun(
        timeline,
        stats,
        theory(pp, m, schedule, virtual_stages, costs),
        in_flight,
        act,
        costs=costs,
        stage_costs=stage_costs(timeline, costs["p2p_ms"]),
    )


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
    )
