"""Run one pipeline stage's program for a training (or evaluation) step.

The executor knows nothing about GPipe or 1F1B: it asks `messages.programs(name, pp, m)` for this
stage's *program* (the schedule's compute `Action`s with `MessageGroup`s between them) and runs it
in order. A message group is issued as one ``batch_isend_irecv``; a compute first waits for the
received tensor it consumes (if any), then runs through a dict of handlers (`self.handlers`), so
a new compute kind is a new entry there, not a new loop.

Model chunks (interleaved schedules): `stage` may be a `ModelChunks` (`stage.chunks`), and every
action names its chunk; per-micro-batch state is kept per (mb, chunk) (`slot`), and the peer
of each message comes from the chunk's virtual stage (`schedules.peer_of`), so activations wrap around
from the last rank to rank 0 for the next chunk. In the V placement (ZB-V, DualPipeV) the turn
from one chunk to the other is on one rank: no message, the output (or input gradient) is
handed over in memory; the loss is then on rank 0. Zero-bubble schedules split the backward into
``backward_input`` / ``backward_weight`` (the functions at the end of this module).

Per in-flight micro-batch it keeps the input activation (a leaf that requires grad, so its `.grad`
is what the previous stage needs) and the output (hidden states, or the loss on the last stage),
and frees both at the micro-batch's backward. The last stage backpropagates each loss with
the gradient ``loss_scale / m`` (what ``loss * loss_scale / m`` passes back), so `param.grad`
accumulates the gradient of the mean loss over the m micro-batches (the caller zeroes gradients
between steps). A received message also frees the
sends it proves received (`messages.acknowledgements`). On gloo, which moves a message only once
its receive is posted, each peer's next receive is posted as soon as the previous one has
arrived (`post_ahead`: in the peer's program order, which is the order it sends in, so pairing
by order is kept; at most one ahead per peer); NCCL issues receives where the program has them.

Every action is traced unless `trace=False`: a compute as its own event, the wait for its
message as a ``recv_act`` / ``recv_grad`` event before it, each sent message as a ``send_act`` /
``send_grad`` event spanning its group's issue. A traced step only writes clock stamps into a
list the plan sized, one where an event ends and the next starts, each at the index the plan
gave its step; which stamps bound which event is planned once (`trace_events`), and
`last_timeline` builds the last step's `Timeline` from them when it is read (empty when not
traced), and `gather.gather_timeline` aligns and collects all stages' timelines on pp rank 0.
With `count_comm_wait` the compute actions also count the time they
spend blocked in tp / cp collectives (`megapar.comm_wait`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from megapar.comm_wait import counting
from megapar.device import polls_host
from megapar.faults.status import action_line, encode_action, set_action
from megapar.mesh import Mesh
from megapar.pipeline import messages
from megapar.pipeline.p2p import P2PTimeoutError, StageP2P, wait_work
from megapar.pipeline.schedules import (
    Action,
    MessageGroup,
    chunks_per_rank,
    get_schedule,
    peer_of,
    placement_of,
    stage_location,
    virtual_stage,
)
from megapar.pipeline.timeline import COMPUTE_KINDS, Event, Timeline
from megapar.pipeline.trace import StepClock
from megapar.tensor_parallel.weight_grad import WeightGradStore, store_of

AUTOGRAD_KINDS = frozenset({"backward", "backward_input"})
"""Actions whose autograd backward accumulates parameter gradients; `before_last_backward`
precedes the last one, so the data-parallel buckets launch as gradients become final."""


class StepPlan(NamedTuple):
    """What a step needs from this rank's program, worked out once per step size
    (`PipelineExecutor.step_plan`)."""

    program: tuple
    """The computes and message groups, in order (`messages.programs`)."""
    last_backward: int | None
    """Index of the last action whose backward accumulates parameter gradients."""
    report_at: frozenset
    """Indices of each model chunk's last action that adds to its weight gradients, where it
    is a `backward_weight` (zero bubble) or a whole backward applying deferred products
    (DualPipeV): it reports the weights it finishes to `grad_sync.grads_ready`."""
    split_backward: bool
    """Whether the backward is split into B and W (the linear layers store (X, dY))."""
    acks: dict
    """(recv kind, mb, chunk) -> the sends it proves received (`messages.acknowledgements`)."""
    posts: dict
    """gloo: per peer rank, this rank's receives from it in program order."""
    arm_at: dict
    """Index of a model chunk's last backward (before the stage's last) -> the parameters whose
    gradients are final after it (those of no chunk with a later last backward): armed there
    (`grad_sync.arm`), so their buckets reduce while the other chunks' backwards run."""
    steps: tuple
    """Per program step, what the walk needs of it, worked out here so that a step does no
    peer or label arithmetic and no text formatting: a `PlannedGroup`, or a compute as the
    plain tuple of its `PlannedCompute` (unpacked at once by the walk)."""
    longest: int
    """The longest encoded status text of the plan (`status.action_line`)."""
    hooks: frozenset
    """Indices of the computes before which `grad_sync` may be called (`last_backward` and
    `arm_at`'s): a traced step ends the wait for their message before the call."""
    events: tuple
    """The events of a traced step, in the order they end: ((kind, mb, chunk), index of its
    start stamp, index of its end stamp), the indices into the step's list of stamps
    (`trace_events`)."""
    readings: int
    """How many clock readings a traced step takes (the length of its list of stamps)."""
    walk: tuple = ()
    """`steps` as the walk runs them: one plain tuple per compute, the message group before it
    folded in (one loop turn for both), and one with no compute for a group that no compute
    follows (`walk_of`)."""


class PlannedGroup(NamedTuple):
    """A message group as the walk of `PipelineExecutor.run` issues it."""

    messages: tuple
    """Per message: (key = (kind, mb, chunk), peer's global rank, what travels, label)."""
    doing: str
    """What the rank is doing while the group is issued (`set_action`)."""
    said: bytes
    """`doing` encoded for the shared status line (`status.encode_action`)."""
    sent_acts: tuple
    """The slot (`PipelineExecutor.slot`) of every activation the group sends (its output's
    storage is freed)."""
    sends: tuple
    """(kind, mb, chunk) of every send, for the trace."""
    ops: tuple
    """Per message, what the walk does with it: (SEND_ACT / SEND_GRAD / RECV, slot of (mb, chunk),
    key, peer's global rank, what travels, label)."""
    received: tuple | None
    """A group of receives only: what `p2p.issue` takes for it where no receive is posted
    ahead (the same every step), else None."""
    stamp: int | None = None
    """A group that sends: the index of the clock reading at its end in a traced step's
    stamps (`trace_events`), else None."""


SEND_ACT, SEND_GRAD, RECV = 0, 1, 2
"""`PlannedGroup.ops` codes."""


class PlannedRecv(NamedTuple):
    """The received message a compute waits for (the walk unpacks it as a plain tuple)."""

    key: tuple
    """(kind, mb, chunk) of the receive."""
    peer: int
    """The sender's global rank."""
    doing: str
    """What the wait is (`set_action`)."""
    said: bytes
    """`doing` encoded (`status.encode_action`)."""
    acks: tuple
    """(kind, mb, chunk) of the sends its arrival proves received."""
    at: tuple
    """The slot of (mb, chunk) (`PipelineExecutor.slot`): where the received tensor is kept."""
    is_act: bool
    """An activation (the compute's input leaf), else an output gradient."""


class PlannedCompute(NamedTuple):
    """A compute action and the message it waits for; the walk unpacks it as a plain tuple, in
    this order."""

    index: int
    """Its position in the program."""
    action: Action
    kind: str
    """The action's kind: its handler (`PipelineExecutor.handlers`)."""
    key: tuple
    """(kind, mb, chunk) of the action: its trace entry."""
    recv: tuple | None
    """The `PlannedRecv` (a plain tuple) it waits for, or None when it consumes no message."""
    hand_over: tuple | None
    """(kind, slot of the same micro-batch in the source chunk) where the compute takes its
    input from another chunk of this rank (the V's turn: no message), else None."""
    doing: str
    """What the rank is doing while the compute runs (`set_action`)."""
    said: bytes
    """`doing` encoded (`status.encode_action`)."""
    stamp: int = 0
    """The index of the clock reading at its start in a traced step's stamps (its end is the
    next; the reading before its `grad_sync` call, where it has one, the one before)."""


class PipelineExecutor:
    """Executes a named schedule on this rank's stage.

    `stage(hidden_or_None, batch)` returns hidden states of shape `act_shape`, or on the last stage
    the scalar mean loss of the micro-batch; `wire_dtype` narrows the messages between stages
    (cast back on receipt). `timeout_s` bounds every blocking wait (default: the run's,
    `mesh.timeout_s`; gloo; NCCL uses its process group's timeout). `trace` (an attribute, may
    be changed between steps) records the step's events for `last_timeline`.
    """

    def __init__(self, stage: nn.Module, mesh: Mesh, schedule: str, act_shape: tuple,
                 act_dtype: torch.dtype = torch.float32, timeout_s: float | None = None,
                 trace: bool = True, virtual_stages: int = 1,
                 wire_dtype: torch.dtype | None = None):
        self.stage, self.mesh, self.trace = stage, mesh, trace
        self.schedule_name = schedule
        get_schedule(schedule)  # unknown names fail here
        self.virtual_stages = virtual_stages = chunks_per_rank(schedule, virtual_stages)
        self.chunks = list(getattr(stage, "chunks", [stage]))
        if len(self.chunks) != virtual_stages:
            raise ValueError(f"schedule {schedule!r} with --virtual-stages {virtual_stages} needs "
                             f"a stage of {virtual_stages} model chunks; this rank holds "
                             f"{len(self.chunks)} (build it with build_stage(virtual_stages=...))")
        self.placement = placement_of(schedule)
        self._chunk_count = virtual_stages  # `slot`
        self._loss_chunk = next((c for c in range(virtual_stages) if virtual_stage(
            mesh.pp_rank, c, mesh.pp, self.placement) == mesh.pp * virtual_stages - 1), None)
        """The model chunk of this rank that computes the loss (the last virtual stage), or
        None."""
        self.timeout_s = timeout_s = timeout_s or mesh.timeout_s
        self.p2p = (StageP2P(mesh, act_shape, act_dtype, timeout_s, wire_dtype)
                    if mesh.pp > 1 else None)
        self.weight_grads = store_of(stage)  # enabled in steps with a split backward
        self._stand_in = None  # what a sent output's storage is replaced by (the first step
        self._act_dtype = act_dtype  # makes it: a CUDA mesh may be built where no GPU is)
        self._act_numel = torch.Size(act_shape).numel()
        self.post_ahead = self.p2p is not None and polls_host(mesh.device)
        """Post each peer's next receive as soon as the previous one arrived (gloo: a message
        moves only once its receive is posted). NCCL runs a rank's operations in issue order,
        so there receives are issued where the program has them."""
        self.handlers = {
            "forward": self._forward, "backward": self._backward,
            "backward_input": self._backward_input, "backward_weight": self._backward_weight,
        }
        self._plans: dict[tuple, StepPlan] = {}  # (m, forward_only) -> see step_plan
        self.clock = StepClock(mesh.device)  # CUDA events on CUDA, perf_counter on the CPU
        self._last_trace = (mesh.pp_rank, [], (), float)  # rank, stamps, events, reader
        self.count_comm_wait = False
        """Count the time the compute actions spend blocked in their tp / cp collectives
        (`megapar.comm_wait`; the straggler measure turns it on)."""
        self.after_group = None
        """Called with each `PlannedGroup` of a step right after the walk issued it (or found
        all of its receives posted ahead already), or None: a probe for tests and the dry
        run's memory measure."""
        self._reset([], 1.0, False)

    def _reset(self, micro_batches, loss_scale, forward_only) -> None:
        self._batches, self._loss_scale = micro_batches, loss_scale
        self._forward_only = forward_only
        # Per (mb, chunk), keyed by its slot (`slot`):
        self._inputs: dict[int, torch.Tensor] = {}     # received activations (leaves)
        self._outputs: dict[int, torch.Tensor] = {}    # stage outputs (hidden or loss)
        # what a sent activation is taken by: a forward-only step keeps no graph
        self._take_output = self._outputs.pop if forward_only else self._outputs.get
        self._out_grads: dict[int, torch.Tensor] = {}  # received d(loss)/d(output)
        self._in_grads: dict[int, torch.Tensor] = {}   # d(loss)/d(input) to send upstream
        self._pending_w: dict[int, object] = {}        # B done, W not yet (zero bubble)
        self._losses: dict[int, torch.Tensor] = {}       # last stage: detached loss per mb
        self._loss_grad = None  # what the losses are backpropagated with (_first_loss_grad)
        self._grad_sync, self._step_index, self._report_at = None, None, frozenset()
        self._ahead: dict[int, list[Action]] = {}        # per peer rank, receives in order
        self._recvs_issued: set[tuple] = set()           # (kind, mb, chunk) issued so far
        self._line = None  # the shared status line in a step (`status.action_line`), or None

    def slot(self, mb: int, chunk: int) -> int:
        """The key of micro-batch `mb`'s state in model chunk `chunk` (its input, output and
        gradients): one int, ``mb * chunks + chunk``, which a dictionary hashes for nothing
        where an (mb, chunk) tuple is built and hashed at every lookup."""
        return mb * self._chunk_count + chunk

    def program(self, m: int, forward_only: bool = False, stage: int | None = None) -> tuple:
        """The program (computes and message groups) of `stage` (default: this rank's) for a
        step of `m` micro-batches."""
        return messages.programs(self.schedule_name, self.mesh.pp, m, self.virtual_stages,
                                 forward_only)[self.mesh.pp_rank if stage is None else stage]

    def step_plan(self, m: int, forward_only: bool = False) -> StepPlan:
        """What a step of `m` micro-batches needs from this rank's program, worked out once per
        (m, forward_only) and kept: a step's host work is then the program's actions alone
        (the acknowledgements alone cost O(m^2) Python per step: 14 ms at pp 16, m 256)."""
        key = (m, forward_only)
        if key not in self._plans:
            program = self.program(m, forward_only)
            self._check_chunks(program)
            actions = [(i, a) for i, a in enumerate(program) if isinstance(a, Action)]
            posts: dict[int, list] = {}
            acks: dict[tuple, list[tuple]] = {}
            if self.p2p is not None:
                acks = messages.acknowledgements(
                    messages.programs(self.schedule_name, self.mesh.pp, m, self.virtual_stages,
                                      forward_only), self.mesh.pp_rank, self._peer)
                for step in program:
                    for a in step.messages if isinstance(step, MessageGroup) else ():
                        if a.kind.startswith("recv"):
                            rank = self.mesh.stage_rank(self._peer(self.mesh.pp_rank, a)[0])
                            posts.setdefault(rank, []).append(a)
            last_backward = max((i for i, a in actions if a.kind in AUTOGRAD_KINDS),
                                default=None)
            steps = tuple(self._plan_group(step) if isinstance(step, MessageGroup)
                          else tuple(self._plan_compute(i, step, acks))
                          for i, step in enumerate(program))
            arm_at = self._chunk_arming(actions, last_backward)
            report_at = self._report_points(actions)
            hooks = frozenset(arm_at) | ({last_backward} if last_backward is not None else set())
            events, at, readings = trace_events(steps, hooks)
            steps = tuple(step._replace(stamp=at[k]) if isinstance(step, PlannedGroup)
                          else step[:-1] + (at[k],) for k, step in enumerate(steps))
            saids = [step.said if isinstance(step, PlannedGroup) else step[7] for step in steps]
            saids += [step[4][3] for step in steps
                      if not isinstance(step, PlannedGroup) and step[4] is not None]
            self._plans[key] = StepPlan(
                program=program,
                last_backward=last_backward,
                report_at=report_at,
                split_backward=any(a.kind == "backward_input" for _, a in actions),
                acks=acks, posts={rank: tuple(recvs) for rank, recvs in posts.items()},
                arm_at=arm_at,
                steps=steps, longest=max((len(said) for said in saids), default=0),
                hooks=hooks, events=events, readings=readings,
                walk=walk_of(steps, hooks, report_at))
        return self._plans[key]

    @staticmethod
    def _report_points(actions: list) -> frozenset:
        """`StepPlan.report_at`: per chunk, its last backward or W, where the step splits the
        backward (only then are weight products deferred)."""
        if not any(a.kind == "backward_input" for _, a in actions):
            return frozenset()
        last = {}
        for i, a in actions:
            if a.kind in ("backward", "backward_weight"):
                last[a.chunk] = i
        return frozenset(last.values())

    def _plan_group(self, group: MessageGroup) -> PlannedGroup:
        planned = []
        for a in group.messages:
            peer, peer_chunk = self._peer(self.mesh.pp_rank, a)
            message = (a.kind[5:], a.mb, peer_chunk if a.kind.startswith("send") else a.chunk)
            planned.append(((a.kind, a.mb, a.chunk), self.mesh.stage_rank(peer), message, str(a)))
        peers = sorted({rank for _, rank, _, _ in planned})
        doing = (f"{group.name} {group} on pp stage {self.mesh.pp_rank} (with rank"
                 f"{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))})")
        codes = {"send_act": SEND_ACT, "send_grad": SEND_GRAD}
        ops = tuple((codes.get(key[0], RECV), self.slot(*key[1:]), key, rank, message, label)
                    for key, rank, message, label in planned)
        return PlannedGroup(
            tuple(planned), doing, encode_action(doing),
            tuple(self.slot(a.mb, a.chunk) for a in group.messages if a.kind == "send_act"),
            tuple((a.kind, a.mb, a.chunk) for a in group.messages if a.kind.startswith("send")),
            ops, None if any(op[0] != RECV for op in ops) else
            tuple((key, None, rank, message, label) for _, _, key, rank, message, label in ops))

    def _plan_compute(self, i: int, a: Action, acks: dict) -> PlannedCompute:
        doing = f"{a.kind} of micro-batch {a.mb} on pp stage {self.mesh.pp_rank}"
        planned = PlannedCompute(i, a, a.kind, (a.kind, a.mb, a.chunk), None, None, doing,
                                 encode_action(doing))
        if a.kind == "forward" and not self._is_first(a):
            kind = "recv_act"
        elif a.kind in ("backward", "backward_input") and not self._is_last(a):
            kind = "recv_grad"
        else:
            return planned
        key = (kind, a.mb, a.chunk)
        peer_stage, peer_chunk = self._peer(self.mesh.pp_rank, Action(*key))
        if peer_stage == self.mesh.pp_rank:  # the V's turn: in memory
            return planned._replace(hand_over=(kind, self.slot(a.mb, peer_chunk)))
        peer = self.mesh.stage_rank(peer_stage)
        waiting = f"{kind} of micro-batch {a.mb} on pp stage {self.mesh.pp_rank} (from rank {peer})"
        recv = PlannedRecv(key, peer, waiting, encode_action(waiting), tuple(acks.get(key, ())),
                           self.slot(a.mb, a.chunk), kind == "recv_act")
        return planned._replace(recv=tuple(recv))

    def _chunk_arming(self, actions: list, last_backward: int | None) -> dict:
        """`StepPlan.arm_at`: with several model chunks, each chunk's last backward before the
        stage's last, and the parameters it leaves final (a parameter two chunks share is
        final only after the later one)."""
        last_of = {}
        for i, a in actions:
            if a.kind in AUTOGRAD_KINDS:
                last_of[a.chunk] = i
        if len(last_of) < 2:
            return {}
        owner = {}  # id(param) -> (index of its last backward, param)
        for chunk, index in last_of.items():
            for p in self.chunks[chunk].parameters():
                if p.requires_grad and index > owner.get(id(p), (-1, None))[0]:
                    owner[id(p)] = (index, p)
        arm_at: dict[int, list] = {}
        for index, p in owner.values():
            if index != last_backward:
                arm_at.setdefault(index, []).append(p)
        return {index: tuple(params) for index, params in arm_at.items()}

    # the step ------------------------------------------------------------------------------
    def run(self, micro_batches: list[dict], grad_sync=None, loss_scale: float = 1.0,
            forward_only: bool = False) -> torch.Tensor:
        """One step over `micro_batches`; returns the mean loss (fp32 scalar) on every pp rank.

        `grad_sync` (optional, ignored when `forward_only`) gets `begin_step()` before the
        program, `arm(params)` (where it has one) before each model chunk's last backward but
        the stage's last, with the parameters that chunk leaves final,
        `before_last_backward()` right before this stage's last backward (of a split
        backward: its last B; each chunk's last W then reports each weight gradient it
        finishes to `grad_sync.grads_ready`, so the reduction overlaps the W passes), and
        `finish()` after
        the program and the wait for outstanding sends.
        """
        m = len(micro_batches)
        if m == 0:
            raise ValueError("PipelineExecutor.run needs at least one micro-batch")
        if self.p2p is not None and (self.p2p.failed or self.p2p.pending_recvs
                                     or self.p2p.pending_sends):
            raise RuntimeError(
                f"rank {self.mesh.rank} (pp stage {self.mesh.pp_rank}): the previous pipeline "
                f"step failed part-way, so messages of it are still in flight and this stage "
                f"is out of step with its neighbours; restart the run (resume from the last "
                f"checkpoint) instead of stepping again")
        plan = self.step_plan(m, forward_only)
        if self._stand_in is None and self.p2p is not None:
            self._stand_in = stand_in_for(self._act_dtype, self.mesh.device)
        last_backward = plan.last_backward
        if forward_only:
            grad_sync = None
        self._reset(micro_batches, loss_scale, forward_only)
        self._report_at = plan.report_at
        self._grad_sync = grad_sync
        self.weight_grads.take()
        self.weight_grads.enabled = not forward_only and plan.split_backward
        record, clock = self.trace, self.clock.stamp
        # a traced step's clock readings, each at its index (`StepPlan.events`)
        stamps = [None] * plan.readings if record else None
        if record:
            self.clock.begin()
        try:
            if grad_sync is not None:
                grad_sync.begin_step()
            if self.p2p is not None:
                self.p2p.begin_step()
                if self.post_ahead:
                    self._post_ahead(plan.posts)
            handlers, p2p, after_group = self.handlers, self.p2p, self.after_group
            counted, arm_at, post_ahead = self.count_comm_wait, plan.arm_at, self.post_ahead
            inputs, out_grads, needs_grad = self._inputs, self._out_grads, not forward_only
            self._line = line = action_line(plan.longest)  # None: set_action
            take = pop_grad = send = release = posted = outputs = stand_in = None
            if p2p is not None:  # what the message groups need
                take, pop_grad, send = self._take_output, self._in_grads.pop, p2p.issue
                release = p2p.release
                posted = self._recvs_issued if post_ahead else None
                # backward needs the graph, not the sent values: a sent output's storage goes
                outputs = None if forward_only or self._act_numel < 2 else self._outputs
                stand_in = self._stand_in
            if record:
                stamps[0] = clock()  # where the first wait (or send) starts
            with torch.set_grad_enabled(not forward_only):
                for group, i, action, kind, recv, hand_over, doing, said, at_clock, hook, \
                        reports in plan.walk:
                    if group is not None:  # the message group before the compute
                        ops, issue, gdoing, gsaid, sent_acts, sent_at, planned = group
                        if issue is None or posted is not None:  # sends, or gloo's receives
                            issue = []
                            for op, at, key, rank, message, label in ops:
                                if op == SEND_ACT:
                                    issue.append((key, take(at), rank, message, label))
                                elif op == SEND_GRAD:
                                    issue.append((key, pop_grad(at), rank, message, label))
                                elif posted is None:  # NCCL: every receive where it is
                                    issue.append((key, None, rank, message, label))
                                elif key not in posted:  # gloo: not posted ahead already
                                    posted.add(key)
                                    issue.append((key, None, rank, message, label))
                        if issue:
                            if line is not None:
                                line.value = gsaid
                            else:
                                set_action(gdoing)
                            send(issue)
                            if outputs is not None:
                                for at in sent_acts:
                                    output = outputs[at]
                                    if output._base is None:  # as `free_output`
                                        output.data = stand_in
                            if sent_at is not None and record:  # traced: the sends end here
                                stamps[sent_at] = clock()
                        if after_group is not None:
                            after_group(planned)
                        if kind is None:  # no compute follows the group
                            continue
                    if recv is not None:  # wait for the message the compute consumes
                        rkey, peer, rdoing, rsaid, acks, at, is_act = recv
                        if line is not None:
                            line.value = rsaid
                        else:
                            set_action(rdoing)
                        tensor = p2p.wait_recv(rkey)  # traced: ends at the compute's start
                        for sent in acks:  # sends its arrival proves received
                            release(sent)
                        if post_ahead:
                            self._post_next(peer)
                        if is_act:  # a leaf: the setter is `requires_grad_` without its
                            tensor.requires_grad = needs_grad  # argument parsing
                            inputs[at] = tensor
                        else:
                            out_grads[at] = tensor
                    elif hand_over is not None:
                        self._hand_over(*hand_over, action)
                    if reports:  # a chunk's last weight-gradient action (`_ready`)
                        self._step_index = i
                    if hook:
                        if record:  # the wait ends before the call (`trace_events`)
                            stamps[at_clock - 1] = clock()
                        if grad_sync is None:
                            pass
                        elif i == last_backward:
                            grad_sync.before_last_backward()
                        elif i in arm_at:
                            grad_sync.arm(arm_at[i])  # a chunk's gradients final next
                    if line is not None:
                        line.value = said
                    else:
                        set_action(doing)
                    try:
                        handler = handlers[kind]
                    except KeyError:
                        raise self._no_handler(kind) from None
                    if record:
                        stamps[at_clock] = clock()
                    try:
                        if counted:  # the straggler measure: tp / cp waits inside the compute
                            with counting():
                                handler(action)
                        else:
                            handler(action)
                    except P2PTimeoutError:
                        raise
                    except Exception as exc:
                        exc.add_note(self._failed_in(action))
                        raise
                    if record:
                        stamps[at_clock + 1] = clock()
                    if reports:
                        self._step_index = None
            set_action(f"waiting for the sends of pp stage {self.mesh.pp_rank}")
            if self.p2p is not None:
                self.p2p.wait_sends()
            if record:
                stamps[-3] = clock()
            if grad_sync is not None:
                set_action("waiting for the data-parallel gradient all-reduce")
                grad_sync.finish()
            if record:
                stamps[-2] = clock()
            set_action("loss broadcast from the last pipeline stage")
            loss = self._mean_loss(m)
            if record:
                stamps[-1] = clock()
            return loss
        finally:
            self._reset([], 1.0, False)
            self.weight_grads.enabled = False  # forwards outside a step compute dW as usual
            self.weight_grads.take()
            self._last_trace = (self.mesh.pp_rank, stamps or [], plan.events if record else (),
                                self.clock.reader())

    @property
    def last_timeline(self) -> Timeline:
        """The last step's events (empty when it was not traced), read when asked for: on CUDA
        that is when the step's events are waited for, not during the step."""
        rank, stamps, events, at = self._last_trace
        seconds = [None if stamp is None else at(stamp) for stamp in stamps]
        return Timeline([Event(rank, k, mb, seconds[s], seconds[e], c)
                         for (k, mb, c), s, e in events  # a step that failed part-way:
                         if seconds[e] is not None and seconds[s] is not None])  # those ended

    @property
    def last_compute_s(self) -> float:
        """Seconds the last step's compute actions took (0 when it was not traced); on CUDA
        read as `last_timeline` is."""
        _, stamps, events, at = self._last_trace
        return sum(at(stamps[e]) - at(stamps[s]) for (kind, _, _), s, e in events
                   if kind in COMPUTE_KINDS and stamps[e] is not None and stamps[s] is not None)

    def _no_handler(self, kind: str) -> NotImplementedError:
        return NotImplementedError(
            f"schedule {self.schedule_name!r} uses action {kind!r}, which PipelineExecutor has "
            f"no handler for; register one in executor.handlers")

    def _failed_in(self, action: Action) -> str:
        """The note added to an exception of a compute handler (P2P timeouts name their own)."""
        chunk = f" (chunk {action.chunk})" if len(self.chunks) > 1 else ""
        return (f"[megapar] while running {action.kind} of micro-batch {action.mb} on pp "
                f"stage {self.mesh.pp_rank}{chunk} (rank {self.mesh.rank}), schedule "
                f"{self.schedule_name!r}")

    def _peer(self, rank: int, a: Action) -> tuple[int, int] | None:
        return peer_of(rank, a, self.mesh.pp, len(self.chunks), self.placement)

    def _check_chunks(self, program) -> None:
        chunks = {a.chunk for step in program
                  for a in (step.messages if isinstance(step, MessageGroup) else (step,))}
        if max(chunks, default=0) >= len(self.chunks):
            raise NotImplementedError(
                f"schedule {self.schedule_name!r} uses model chunks {sorted(chunks)}, but this "
                f"rank holds {len(self.chunks)} chunk(s); build the stage with as many "
                f"virtual stages as the schedule uses")

    def _vs(self, a: Action) -> int:
        return virtual_stage(self.mesh.pp_rank, a.chunk, self.mesh.pp, self.placement)

    def _is_first(self, a: Action) -> bool:
        return self._vs(a) == 0

    def _is_last(self, a: Action) -> bool:
        return self._vs(a) == self.mesh.pp * len(self.chunks) - 1

    # messages ------------------------------------------------------------------------------
    def _message(self, a: Action) -> tuple:
        """What `p2p.issue` takes for message action `a`: (key, tensor to send or None, peer
        rank, what travels, label)."""
        peer, peer_chunk = self._peer(self.mesh.pp_rank, a)
        rank = self.mesh.stage_rank(peer)
        if a.kind == "send_act":
            take = self._outputs.pop if self._forward_only else self._outputs.get
            tensor, message = take(self.slot(a.mb, a.chunk)), ("act", a.mb, peer_chunk)
        elif a.kind == "send_grad":
            tensor = self._in_grads.pop(self.slot(a.mb, a.chunk))
            message = ("grad", a.mb, peer_chunk)
        else:
            tensor, message = None, (a.kind[5:], a.mb, a.chunk)
        return (a.kind, a.mb, a.chunk), tensor, rank, message, str(a)

    def _post_ahead(self, posts: dict[int, tuple]) -> None:
        """gloo: every peer's receives in program order, and the first of each posted now."""
        self._ahead = {rank: list(recvs) for rank, recvs in posts.items()}
        for rank in self._ahead:
            self._post_next(rank)

    def _post_next(self, rank: int) -> None:
        """Post the next receive from peer `rank` unless its group has issued it: a peer's
        receives are posted in program order (the order it sends in), at most one ahead."""
        queue = self._ahead.get(rank)
        while queue and (queue[0].kind, queue[0].mb, queue[0].chunk) in self._recvs_issued:
            queue.pop(0)
        if queue:
            a = queue.pop(0)
            self._recvs_issued.add((a.kind, a.mb, a.chunk))
            self.p2p.issue([self._message(a)])

    def _hand_over(self, kind: str, source: int, a: Action) -> None:
        """In-memory handover between two chunks of this rank (no message): the forward of
        `a`'s chunk takes the output of slot `source` (the same micro-batch's, of the other
        chunk) as its input leaf, the backward its input gradient."""
        slot = self.slot(a.mb, a.chunk)
        if kind == "recv_act":
            take = self._outputs.pop if self._forward_only else self._outputs.get
            out = take(source)
            self._inputs[slot] = out.detach().requires_grad_(not self._forward_only)
        else:
            self._out_grads[slot] = self._in_grads.pop(source)

    # handlers ------------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        mb, chunk = a.mb, a.chunk
        key = mb * self._chunk_count + chunk
        x = self._inputs.get(key)
        out = self.chunks[chunk](x, self._batches[mb])
        if self._forward_only:  # no graph: the input is not needed any more
            self._inputs.pop(key, None)
        if chunk == self._loss_chunk:
            if out.dim() != 0:
                raise ValueError(
                    f"the last pipeline stage returned a tensor of shape {tuple(out.shape)} for "
                    f"micro-batch {mb}, not a scalar loss; every micro-batch needs 'labels'")
            self._losses[mb] = out.detach().float()
            if self._forward_only:
                return
        self._outputs[key] = out

    def _backward(self, a: Action) -> None:
        key = a.mb * self._chunk_count + a.chunk
        out = self._outputs.pop(key)
        if a.chunk == self._loss_chunk:
            grad = self._loss_grad if self._loss_grad is not None else self._first_loss_grad(out)
        else:
            grad = self._out_grads.pop(key)
        backward(out, grad)
        store = self.weight_grads  # deferring only in a step with split backwards (DualPipeV):
        if store.enabled and len(store):  # a whole backward there applies what it deferred
            WeightGradStore.apply(store.take(), self._ready())
        x = self._inputs.pop(key, None)
        if x is not None:
            grad = x.grad
            if grad is None:
                self._no_input_grad(a)
            self._in_grads[key] = grad

    def _first_loss_grad(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient a micro-batch's loss is backpropagated with, made at the step's first:
        what autograd would pass back through ``loss * loss_scale / m`` (ones / m, times the
        scale: the same operations in the same order, so the same bits), so the forward needs
        no scaling operation per micro-batch."""
        grad = torch.ones_like(loss) / len(self._batches)
        scale = self._loss_scale
        if isinstance(scale, torch.Tensor) or scale != 1.0:  # x * 1.0 is x
            grad = grad * scale
        self._loss_grad = grad
        return grad

    def _no_input_grad(self, a: Action) -> None:
        raise RuntimeError(f"pp stage {self.mesh.pp_rank}: the output of micro-batch {a.mb} "
                           f"(chunk {a.chunk}) does not depend on the received activation")

    def _backward_input(self, a: Action) -> None:
        """B: the gradient w.r.t. the chunk's input only (sent upstream next); W comes later."""
        key = a.mb * self._chunk_count + a.chunk
        out = self._outputs.pop(key)
        if a.chunk == self._loss_chunk:
            grad = self._loss_grad if self._loss_grad is not None else self._first_loss_grad(out)
        else:
            grad = self._out_grads.pop(key)
        x = self._inputs.pop(key, None)
        dx, self._pending_w[key] = backward_input(out, grad, x, self.weight_grads)
        if x is not None:
            if dx is None:
                self._no_input_grad(a)
            self._in_grads[key] = dx

    def _backward_weight(self, a: Action) -> None:
        """W: the chunk's weight gradients of one micro-batch, added in place to `.grad`; a
        chunk's last W reports each finished weight to the data-parallel reduction."""
        backward_weight(self._pending_w.pop(a.mb * self._chunk_count + a.chunk),
                        self._grad_sync.grads_ready if self._grad_sync is not None
                        and self._step_index in self._report_at else None)  # `_ready`

    def _ready(self):
        """`grad_sync.grads_ready` at a chunk's last weight-gradient action, else None."""
        if self._grad_sync is not None and self._step_index in self._report_at:
            return self._grad_sync.grads_ready
        return None

    # loss ----------------------------------------------------------------------------------
    def _mean_loss(self, m: int) -> torch.Tensor:
        """Mean of the m micro-batch losses, broadcast from the last stage over the pp group."""
        last = stage_location(self.mesh.pp * len(self.chunks) - 1, self.mesh.pp,
                              self.placement)[0]  # rank 0 in a V
        if self.mesh.pp_rank == last:
            loss = torch.stack([self._losses[i] for i in range(m)]).sum() / m
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        if self.mesh.pp > 1:
            src = self.mesh.stage_rank(last)
            work = dist.broadcast(loss, src=src, group=self.mesh.pp_group, async_op=True)
            wait_work(work, self.mesh.device, self.timeout_s,
                      f"rank {self.mesh.rank}: broadcast of the loss from the last pipeline "
                      f"stage (rank {src})")
        return loss


def trace_events(steps: tuple, hooks: frozenset = frozenset()) -> tuple:
    """`StepPlan.events` of the planned `steps`: which stamps of a traced step bound which event.

    A traced step reads the clock once at each point where one event ends and the next starts:
    before the walk (stamp 0), right before and right after each compute's handler, after each
    group that sends, after the wait for outstanding sends, and around the loss broadcast; and
    before the `grad_sync` calls of the computes in `hooks` (`StepPlan.hooks`). A compute is the
    interval of its handler; the wait for the message it consumes runs from the previous stamp
    to the compute's start, or to the stamp before its `grad_sync` call (so it holds the issue
    of receive-only groups and the step's bookkeeping in between: time that is no compute), and
    each send of a group from the previous stamp to the group's end. Returns ((kind, mb, chunk),
    start, end) per event in the order they end, the indices into the step's stamps; per step,
    the index of the reading it takes (a compute: at its start; a group that sends: at its end;
    else None); and how many readings a step takes (the last three: the sends' wait's end, the
    loss broadcast's start and end)."""
    events, at, last, n = [], [], 0, 1
    for step in steps:
        if step.__class__ is PlannedGroup:
            if step.sends:
                events += [(key, last, n) for key in step.sends]
                at.append(n)
                last, n = n, n + 1
            else:
                at.append(None)
            continue
        index, key, recv = step[0], step[3], step[4]
        if index in hooks:
            n += 1
        if recv is not None:
            events.append((recv[0], last, n - 1 if index in hooks else n))
        events.append((key, n, n + 1))
        at.append(n)
        last, n = n + 1, n + 2
    events += [(("wait", None, 0), last, n), (("loss_broadcast", None, 0), n + 1, n + 2)]
    return tuple(events), tuple(at), n + 3


def walk_of(steps: tuple, hooks: frozenset = frozenset(),
            reports: frozenset = frozenset()) -> tuple:
    """`StepPlan.walk` of the planned `steps` (their stamps set): per compute, (the group before
    it as the walk issues it, or None; the compute's `PlannedCompute` fields but its key;
    whether `grad_sync` may be called before it (`hooks`); whether it reports finished weights
    (`reports`: `StepPlan.report_at`)); a group no compute follows gets an
    entry of its own with no compute (kind None). A group as the walk issues it: (its ops, what
    `p2p.issue` takes for it where that is the same every step (receives only, none posted
    ahead) or None, its status text and that encoded, the slots of the activations it
    sends, the index of the clock reading at its end or None, the `PlannedGroup`)."""
    walk, group = [], None
    for step in steps:
        if step.__class__ is PlannedGroup:
            if group is not None:
                walk.append((group,) + (None,) * 10)
            group = (step.ops, step.received, step.doing, step.said, step.sent_acts, step.stamp,
                     step)
            continue
        index, action, kind, _, recv, hand_over, doing, said, stamp = step
        walk.append((group, index, action, kind, recv, hand_over, doing, said, stamp,
                     index in hooks, index in reports))
        group = None
    if group is not None:
        walk.append((group,) + (None,) * 10)
    return tuple(walk)


# --- a stage's backward: whole, or split into B and W -------------------------------------------
_FREED: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> the one-element stand-in


def free_output(output: torch.Tensor, stand_in: torch.Tensor | None = None) -> None:
    """Release the storage of a sent output, keeping its autograd graph (a no-op for views,
    whose storage is another tensor's). Every freed output of a dtype and device shares one
    one-element stand-in (`stand_in_for`; pass it when known), which nothing reads or writes
    (the backward runs from the graph)."""
    if output._base is None and output.numel() > 1:
        output.data = stand_in_for(output.dtype, output.device) if stand_in is None else stand_in


def stand_in_for(dtype: torch.dtype, device) -> torch.Tensor:
    """The one-element tensor every freed output of `dtype` on `device` shares."""
    key = (dtype, torch.device(device))
    stand_in = _FREED.get(key)
    if stand_in is None:
        stand_in = _FREED[key] = torch.empty((1,), dtype=dtype, device=device)
    return stand_in


def backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """`torch.autograd.backward(output, grad)`, also for an output freed by `free_output`
    (autograd checks `grad` against the shape the output had when it was made)."""
    if grad is None:
        torch.autograd.backward(output)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True)  # keep_graph, create_graph, inputs,
    # allow_unreachable, accumulate_grad: what torch.autograd.backward passes


class PendingWeightGrad:
    """What W of one micro-batch of one chunk needs from its B: the deferred products."""

    def __init__(self, entries: list):
        self.entries = entries


def backward_input(output: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None,
                   store: WeightGradStore):
    """B: returns (d loss / d inp or None, the PendingWeightGrad for W). `grad` is None when
    `output` is the (scaled) loss; `store` must be enabled and attached to the stage's linear
    layers before their forward."""
    if len(store):
        raise RuntimeError("the weight-gradient store holds products of another backward; "
                           "every B must be followed by taking its products")
    backward(output, grad)
    return (inp.grad if inp is not None else None), PendingWeightGrad(store.take())


def backward_weight(pending: PendingWeightGrad, ready=None) -> None:
    """W: accumulate the weight gradients of one B into `param.grad`, in place. `ready`
    (optional) is called with [weight] as soon as a weight's gradient has been added (the last
    W of a step: its gradient is then final)."""
    WeightGradStore.apply(pending.entries, ready)
    pending.entries = []
