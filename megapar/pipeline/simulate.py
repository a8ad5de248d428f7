"""Every stage's pipeline schedule run together without processes, on a cost model (timing);
`nccl_rules` holds the issued messages to NCCL's point-to-point rules.

Each stage executes its `Action`s in program order on its own clock, with the communication
semantics of `megapar.pipeline.schedules`: sends are non-blocking (the sender pays `send_ms`,
default 0), receives block until the matching message has arrived. A message arrives `p2p_ms`
after its send has been issued (the end of the send action). Compute actions take `fwd_ms` /
`bwd_ms`. The result is a `Timeline` (seconds), ready for `bubble_stats`, Chrome traces and Gantt
plots.

The simulation is exact for this model: every time is determined by program order and message
arrival, so the order in which stages are advanced does not matter. If no stage can advance the
schedule deadlocks (`DeadlockError`); if a channel's messages do not pair up (counts, or the
micro-batch order on one directed channel) the schedules are inconsistent (`CommMismatchError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megapar.pipeline.actions import RECEIVE_KINDS, Action
from megapar.pipeline.placement import peer_of, placement_of
from megapar.pipeline.schedules import get_schedule, schedule_actions
from megapar.pipeline.timeline import Event, Timeline

Channel = tuple[int, int, str, int]
Schedules = Sequence[Sequence[Action]]
"""Every stage's actions, in order (lists or tuples)."""


class ScheduleError(RuntimeError):
    """A set of per-stage schedules that cannot run together."""


class DeadlockError(ScheduleError):
    """Every unfinished stage is blocked in a receive whose matching send can never be issued."""


class CommMismatchError(ScheduleError):
    """Sends and receives do not pair up: missing peer, count mismatch or order mismatch."""


def split_backward(
    bwd_ms: float, bwd_input_ms: float | None, bwd_weight_ms: float | None
) -> tuple[float, float]:
    """(B, W): a zero-bubble schedule's backward split into the input gradient (B) and the
    weight gradients (W). A half given is kept; one not given is what the other leaves of the
    backward (`bwd_ms` - the other), or half the backward when neither is given."""
    if bwd_input_ms is None:
        bwd_input_ms = bwd_ms / 2 if bwd_weight_ms is None else bwd_ms - bwd_weight_ms
    if bwd_weight_ms is None:
        bwd_weight_ms = bwd_ms - bwd_input_ms
    return bwd_input_ms, bwd_weight_ms


@dataclass
class Costs:
    """Cost model of one micro-batch on one stage (the same for every stage, or one per stage)."""

    fwd_ms: float = 1.0
    """Duration of a forward."""
    bwd_ms: float = 2.0
    """Duration of a full backward; backward_input and backward_weight split it unless given
    below (`split_backward`)."""
    p2p_ms: float = 0.0
    """Latency from the end of a send to the arrival of the message at the receiver."""
    send_ms: float = 0.0
    """Time the sender spends issuing a (non-blocking) send."""
    bwd_input_ms: float | None = None
    """Duration of a backward_input (B: the input gradient); default bwd_ms less W when W is
    given, else bwd_ms / 2."""
    bwd_weight_ms: float | None = None
    """Duration of a backward_weight (W: the weight gradients); default bwd_ms less B when B is
    given, else bwd_ms / 2."""

    def duration_ms(self, kind: str) -> float:
        """Time an action of `kind` occupies its stage, excluding any wait for a message."""
        if kind == "forward":
            return self.fwd_ms
        if kind == "backward":
            return self.bwd_ms
        if kind in ("backward_input", "backward_weight"):
            b, w = split_backward(self.bwd_ms, self.bwd_input_ms, self.bwd_weight_ms)
            return b if kind == "backward_input" else w
        if kind in ("send_act", "send_grad"):
            return self.send_ms
        return 0.0


StageCosts = Costs | Sequence[Costs]
"""One stage's costs: the same for all its chunks, or one per model chunk."""


def _channel(
    stage: int, action: Action, pp: int, chunks: int = 1, placement: str = "loop"
) -> Channel | None:
    """The directed channel an action sends on or receives from (None for compute). With one
    chunk per rank a missing neighbour is reported as stage -1 or pp."""
    if action.kind not in ("send_act", "recv_act", "send_grad", "recv_grad"):
        return None
    what = action.kind.split("_")[1]
    peer = peer_of(stage, action, pp, chunks, placement)
    if peer is None:
        step = 1 if action.kind in ("send_act", "recv_grad") else -1
        peer = (stage + step, action.chunk)
    if action.kind.startswith("send"):
        return (stage, peer[0], what, peer[1])
    return (peer[0], stage, what, action.chunk)


class _Simulator:
    """State of one simulation: program counters, clocks and in-flight messages."""

    def __init__(
        self,
        schedules: Schedules,
        costs: Costs | Sequence[StageCosts],
        placement: str = "loop",
        events: bool = True,
    ) -> None:
        self.schedules = schedules
        self.pp = len(schedules)
        self.costs: list[StageCosts] = (
            [costs] * self.pp if isinstance(costs, Costs) else list(costs)
        )
        if len(self.costs) != self.pp:
            raise ValueError(f"{len(self.costs)} per-stage costs for {self.pp} stages")
        self.chunks = 1 + max((a.chunk for acts in schedules for a in acts), default=0)
        self.placement = placement
        # Each action's channel and duration, worked out once per (stage, kind, chunk): they
        # depend on nothing else.
        self.channels: list[list[Channel | None]] = []
        self.durations: list[list[float]] = []
        self.receives: list[list[bool]] = []
        self.p2p_ms = [(c if isinstance(c, Costs) else c[0]).p2p_ms for c in self.costs]
        for stage, (actions, cost) in enumerate(zip(schedules, self.costs)):
            known: dict[tuple[str, int], tuple[Channel | None, float]] = {}
            for a in actions:
                if (a.kind, a.chunk) not in known:
                    chunk_cost = cost if isinstance(cost, Costs) else cost[a.chunk]
                    known[a.kind, a.chunk] = (
                        self.channel(stage, a),
                        chunk_cost.duration_ms(a.kind),
                    )
            self.channels.append([known[a.kind, a.chunk][0] for a in actions])
            self.durations.append([known[a.kind, a.chunk][1] for a in actions])
            self.receives.append([a.kind in RECEIVE_KINDS for a in actions])
        self.pc = [0] * self.pp
        self.clock_ms = [0.0] * self.pp
        self.sent: dict[Channel, list[tuple[Action, float]]] = {}
        self.received: dict[Channel, int] = {}
        self.times: list[list[tuple[float, float]]] = [[] for _ in range(self.pp)]
        self.events: list[Event] | None = [] if events else None

    def check_peers(self) -> None:
        """Every send and receive must name a stage that exists."""
        for stage, actions in enumerate(self.schedules):
            for action, channel in zip(actions, self.channels[stage]):
                if channel is None:
                    continue
                peer = channel[0] if channel[1] == stage else channel[1]
                if not 0 <= peer < self.pp:
                    raise CommMismatchError(
                        f"stage {stage} has {action} ({action.kind}) but there "
                        f"is no stage {peer} (pp={self.pp})"
                    )

    def channel(self, stage: int, action: Action) -> Channel | None:
        return _channel(stage, action, self.pp, self.chunks, self.placement)

    def done(self, stage: int) -> bool:
        return self.pc[stage] == len(self.schedules[stage])

    def next_action(self, stage: int) -> Action:
        return self.schedules[stage][self.pc[stage]]

    def advance(self, stage: int) -> bool:
        """Execute the stage's actions in order until one blocks in a receive whose message has
        not been sent yet, or the program ends; whether any action ran."""
        actions, channels, durations, receives = (
            self.schedules[stage],
            self.channels[stage],
            self.durations[stage],
            self.receives[stage],
        )
        times, events = self.times[stage], self.events
        first = pc = self.pc[stage]
        clock, p2p_ms = self.clock_ms[stage], self.p2p_ms[stage]
        while pc < len(actions):
            action, channel, start = actions[pc], channels[pc], clock
            if receives[pc]:
                assert channel is not None  # every receive kind has one (`_channel`)
                queue, index = self.sent.get(channel, ()), self.received.get(channel, 0)
                if index >= len(queue):
                    break
                sent_action, arrival = queue[index]
                if sent_action.mb != action.mb:
                    raise CommMismatchError(
                        f"order mismatch on channel stage {channel[0]} -> stage {channel[1]} "
                        f"({channel[2]}): message #{index} is {sent_action} but stage {stage} "
                        f"receives {action}"
                    )
                self.received[channel] = index + 1
                clock = max(start, arrival)
            else:
                clock = start + durations[pc]
                if channel is not None:
                    self.sent.setdefault(channel, []).append((action, clock + p2p_ms))
            times.append((start / 1e3, clock / 1e3))
            if events is not None:
                events.append(
                    Event(stage, action.kind, action.mb, start / 1e3, clock / 1e3, action.chunk)
                )
            pc += 1
        self.pc[stage], self.clock_ms[stage] = pc, clock
        return pc > first

    def stuck_error(self) -> ScheduleError:
        """The error to raise when no stage can advance."""
        waiting = []
        for stage in range(self.pp):
            if self.done(stage):
                continue
            action = self.next_action(stage)
            channel = self.channel(stage, action)  # a stage only blocks in a receive
            assert channel is not None
            sender = channel[0]
            if self.done(sender):
                return CommMismatchError(
                    f"stage {stage} waits for {action} ({action.kind}) but stage {sender} "
                    f"finished its schedule without sending it"
                )
            waiting.append(
                f"stage {stage} blocked at {action} (waiting for stage {sender}, "
                f"which is blocked at {self.next_action(sender)})"
            )
        return DeadlockError("pipeline schedule deadlocks: " + "; ".join(waiting))

    def check_all_received(self) -> None:
        for (src, dst, what, chunk), queue in sorted(self.sent.items()):
            received = self.received.get((src, dst, what, chunk), 0)
            if received != len(queue):
                extra = " ".join(str(a) for a, _ in queue[received:])
                raise CommMismatchError(
                    f"stage {src} sent {len(queue)} {what} messages to stage {dst}, which "
                    f"received only {received}; never received: {extra}"
                )

    def run(self) -> Timeline | None:
        """The step's `Timeline` (None when built without events: see `times`)."""
        self.check_peers()
        while not all(self.done(s) for s in range(self.pp)):
            progressed = False
            for stage in range(self.pp):
                progressed = self.advance(stage) or progressed
            if not progressed:
                raise self.stuck_error()
        self.check_all_received()
        return None if self.events is None else Timeline(self.events)


def simulate(
    schedules: Schedules, costs: Costs | Sequence[StageCosts] | None = None, placement: str = "loop"
) -> Timeline:
    """Run `schedules[s]` on stage s for every s; the timeline of the step (times in seconds).
    `costs`: one cost model for every stage, or a list with one per stage (stages that differ,
    e.g. the last one with the LM head, measured each on its own), where a stage's may be a
    list with one per model chunk (an interleaved rank's chunks differ: the head is on the last
    virtual stage only; messages take the first chunk's `p2p_ms`). The number of chunks per rank
    is read off the actions; `placement` maps them to virtual stages (see
    `megapar.pipeline.placement.PLACEMENTS`)."""
    if not schedules:
        raise ValueError("simulate needs at least one stage's schedule")
    timeline = _Simulator(schedules, costs or Costs(), placement).run()
    assert timeline is not None  # built with events
    return timeline


def action_times(
    schedules: Schedules, costs: Costs | Sequence[StageCosts] | None = None, placement: str = "loop"
) -> list[list[tuple[float, float]]]:
    """`simulate` without the `Timeline`: each stage's (start, end) of every action, in
    program order (seconds)."""
    if not schedules:
        raise ValueError("action_times needs at least one stage's schedule")
    simulator = _Simulator(schedules, costs or Costs(), placement, events=False)
    simulator.run()
    return simulator.times


def simulate_schedule(
    name: str,
    pp: int,
    m: int,
    costs: Costs | Sequence[StageCosts] | None = None,
    virtual_stages: int = 1,
) -> Timeline:
    """Simulate the named schedule (see `SCHEDULES`) with pp stages and m micro-batches."""
    return simulate(
        [schedule_actions(name, pp, m, stage, virtual_stages) for stage in range(pp)],
        costs,
        placement_of(name),
    )


def theoretical_bubble(
    pp: int,
    m: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    fwd_ms: float = 1.0,
    bwd_input_ms: float = 1.0,
    bwd_weight_ms: float = 1.0,
) -> float:
    """Idle fraction with equal stages and free communication (published formulas; a schedule
    not in `schedules.SCHEDULES` is a ValueError):
    - GPipe / 1F1B (Huang et al. 2019; Narayanan et al. 2021): (pp-1) / (m + pp-1);
    - interleaved 1F1B with V chunks per rank (Narayanan et al. 2021): (pp-1) / (V m + pp-1)
      for m >= pp; with fewer micro-batches than stages `interleaved_bubble`'s exact count;
    - ZB-H1 (Qi et al. 2024, section 2): the bubble is (pp-1)(t_F + t_B - t_W) per stage next to
      m (t_F + t_B + t_W) of compute; t_F = `fwd_ms`, t_B = `bwd_input_ms`, t_W = `bwd_weight_ms`
      (ignored by the other schedules, whose bubble does not depend on the costs). The paper
      draws it with t_F = t_B = t_W. It is exact where t_W <= min(t_F, t_B) and m >= pp;
      elsewhere it is below what the schedule reaches (below `zb_h1_bound` when
      t_W > min(t_F, t_B)) and this returns NaN (the simulator, `simulate_schedule`, covers
      every case);
    - ZB-V and DualPipeV (two chunks per rank in a V; the costs are a chunk's): the pipeline
      fill, (pp-1) t_F next to 2 m (t_F + t_B + t_W) of compute: megapar's own lower bound,
      not a formula from the papers, argued here. No schedule of two chunks per
      rank does better with a synchronous step (the last rank cannot start before pp - 1 chunk
      forwards, and then has all its work to do); ZB-V reaches it when t_F = t_B = t_W and
      m >= floor(3 pp / 2) (DualPipeV at every m >= 2 pp it takes); fewer micro-batches and
      other costs leave more (the simulator gives it).
    """
    if pp < 1 or m < 1:
        raise ValueError(f"theoretical_bubble needs pp >= 1 and m >= 1, got pp={pp} m={m}")
    get_schedule(schedule)  # a name it has no formula for: ValueError naming the schedules
    if schedule == "interleaved":
        return interleaved_bubble(pp, m, virtual_stages)
    if schedule in ("zb-v", "dualpipev"):
        fill = (pp - 1) * fwd_ms
        return fill / (2 * m * (fwd_ms + bwd_input_ms + bwd_weight_ms) + fill)
    if schedule == "zb-h1":
        if m < pp or bwd_weight_ms > min(fwd_ms, bwd_input_ms):
            return float("nan")
        idle = (pp - 1) * (fwd_ms + bwd_input_ms - bwd_weight_ms)
        return idle / (m * (fwd_ms + bwd_input_ms + bwd_weight_ms) + idle)
    return (pp - 1) / (m + pp - 1)


def zb_h1_bound(pp: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """ZB-H1's idle share with an idle time of (pp-1) max(t_F, t_B, t_F + t_B - t_W) per stage
    next to m (t_F + t_B + t_W) of compute.

    Every stage does the same work, so each is idle as long as the least idle one. The last
    stage waits (pp-1) t_F for its first forward; the first, which may hold at most pp
    micro-batches in flight as under 1F1B, has nothing to do between its last warmup forward
    and its first B, which comes (pp-1) t_B later. Where t_W <= min(t_F, t_B) the third term
    (the paper's) is the largest. A lower bound at every m; the simulator reaches it at every
    m >= pp (`tests/test_schedules_new.py` checks a grid of sizes and costs)."""
    idle = (pp - 1) * max(t_f, t_b, t_f + t_b - t_w)
    return idle / (m * (t_f + t_b + t_w) + idle)


def interleaved_bubble(pp: int, m: int, v: int) -> float:
    """Interleaved 1F1B's idle share with equal chunks and free communication.

    From m = pp on, Narayanan et al. 2021's (pp-1) / (v m + pp-1). With m < pp (which the
    paper, like Megatron, does not run) a round of pp micro-batches is not full: each
    micro-batch goes on to its next chunk as soon as it comes back to rank 0, so the forwards
    take v pp + m - 1 chunk-forward slots (the first micro-batch's v pp chunks in a row, the
    others one slot behind each other) and the backwards as many, against v m of work per
    rank: (v (pp - m) + m - 1) / (v pp + m - 1), which is the paper's at m = pp and the
    simulator's count at every m <= pp (`tests/test_schedules_new.py`). The paper's formula
    below pp would be below what any schedule reaches: at m = 1 the ranks take turns, idle
    (pp - 1) / pp, where it gives (pp - 1) / (v + pp - 1)."""
    if m >= pp:
        return (pp - 1) / (v * m + pp - 1)
    return (v * (pp - m) + m - 1) / (v * pp + m - 1)
