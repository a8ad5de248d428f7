"""Run one pipeline stage's program for a training (or evaluation) step: the runner.

The executor knows nothing about GPipe or 1F1B: it asks `messages.programs(name, pp, m)` for this
stage's *program* (the schedule's compute `Action`s with `MessageGroup`s between them), plans it
once per step size (`step_plan.plan_step`) and walks the plan in order
(`_walk`). A message group is issued as one ``batch_isend_irecv``; a compute first waits for the
received tensor it consumes (if any), then runs through a dict of handlers (`handlers`, the
executor's extension point), so a new compute kind is a new entry there, not a new loop. The
backward handlers and their helpers (freed outputs, B and W) are `megapar.pipeline.backward`,
the receives posted ahead and the V's hand-over `megapar.pipeline.step_inputs`, the trace's
readings and readers `trace.StepTrace`.

Model chunks: `stage` may be a `ModelChunks` (`stage.chunks`); every action names its chunk,
per-micro-batch state is kept per (mb, chunk) (`slot`), and each message's peer comes from the
chunk's virtual stage (`placement.peer_of`). In the V placement (ZB-V, DualPipeV) the turn from
one chunk to the other is on one rank: no message, the output (or input gradient) is handed
over in memory; the loss is then on rank 0.

Per in-flight micro-batch it keeps the input activation (a leaf that requires grad) and the
output (hidden states, or the loss on the last stage) until the micro-batch's backward; a sent
output's storage goes at once (its stand-in: `backward.stand_in_for`). Each loss is
backpropagated with the gradient ``loss_scale / m``, so `param.grad` accumulates the gradient of
the mean loss (the caller zeroes gradients between steps). A received message also frees the
sends it proves received (`messages.acknowledgements`).

One message path serves gloo and NCCL, the difference being data: on gloo, which moves a
message only once its receive is posted, the step queues each peer's receives in program order
(the order it sends in) and posts the next as soon as the previous one has arrived
(`post_ahead`: at most one ahead per peer); on NCCL the queues are empty and every receive is
issued where the program has it. One way to stamp time: a traced step writes a clock reading at
each index the plan gave its steps (`StepPlan.events` says which readings bound which event),
an untraced one (`trace=False`) skips the readings and keeps no events. `last_timeline` builds
the step's events from them when read, and `trace.gather_timeline` collects all stages' on
pp rank 0. With `count_comm_wait` the computes also count the time
they spend blocked in tp / cp collectives (`megapar.comm_wait`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from megapar.comm_wait import counting
from megapar.device import polls_host
from megapar.faults.status import action_line, set_action
from megapar.mesh import Mesh
from megapar.pipeline import messages
from megapar.pipeline.backward import (
    PendingWeightGrad,
    StageBackward,
    stand_in_for,
)
from megapar.pipeline.p2p import P2PTimeoutError, StageP2P, wait_work
from megapar.pipeline.schedules import (
    Action,
    chunks_per_rank,
    get_schedule,
    loss_in_flight,
    placement_of,
    stage_location,
)
from megapar.pipeline.step_inputs import StepInputs
from megapar.pipeline.step_plan import (
    SEND_ACT,
    SEND_GRAD,
    StagePlace,
    StepPlan,
    check_chunks,
    plan_step,
)
from megapar.pipeline.trace import StepClock, StepTrace
from megapar.tensor_parallel.weight_grad import store_of

__all__ = ["PipelineExecutor"]


class _SetAction:
    """Where no launcher shares a status line (or an action would not fit it): the line's
    interface over `status.set_action`, so the walk publishes every action one way
    (``line.value = said``, the text encoded by `status.encode_action`)."""

    __slots__ = ()

    def _say(self, said: bytes) -> None:
        set_action(said[:-1].decode())

    value = property(None, _say)


class PipelineExecutor(StageBackward, StepInputs, StepTrace):
    """Executes a named schedule on this rank's stage.

    `stage(hidden_or_None, batch)` returns hidden states of shape `act_shape`, or on the last stage
    the scalar mean loss of the micro-batch; `wire_dtype` narrows the messages between stages
    (cast back on receipt). `timeout_s` bounds every blocking wait (default: the run's,
    `mesh.timeout_s`; gloo; NCCL uses its process group's timeout). `trace` (an attribute, may
    be changed between steps) records the step's events for `last_timeline`.

    `handlers` (action kind -> the function that runs a compute) is the extension point: a
    wrapper may replace an entry for as long as it needs (fault injection, module tracing and
    the dry run's memory measure do).
    """

    def __init__(
        self,
        stage: nn.Module,
        mesh: Mesh,
        schedule: str,
        act_shape: tuple,
        act_dtype: torch.dtype = torch.float32,
        timeout_s: float | None = None,
        trace: bool = True,
        virtual_stages: int = 1,
        wire_dtype: torch.dtype | None = None,
    ):
        self.stage, self.mesh, self.trace = stage, mesh, trace
        self.schedule_name = schedule
        get_schedule(schedule)  # unknown names fail here
        self.virtual_stages = virtual_stages = chunks_per_rank(schedule, virtual_stages)
        self.chunks = list(getattr(stage, "chunks", [stage]))
        self.last_z_loss: torch.Tensor | None = None
        """The last training step's output z-loss term (--z-loss; the mean over its
        micro-batches, on every pp rank, as the loss), else None."""
        if len(self.chunks) != virtual_stages:
            raise ValueError(
                f"schedule {schedule!r} with --virtual-stages {virtual_stages} needs "
                f"a stage of {virtual_stages} model chunks; this rank holds "
                f"{len(self.chunks)} (build it with build_stage(virtual_stages=...))"
            )
        self.placement = placement_of(schedule)
        self.place = StagePlace(
            mesh.pp_rank, mesh.pp, virtual_stages, self.placement, mesh.stage_rank
        )
        """Where this rank's stage sits in the pipeline (what planning a step asks)."""
        self._chunk_count = virtual_stages  # `slot`
        last = mesh.pp * virtual_stages - 1
        self._loss_rank, loss_chunk = stage_location(last, mesh.pp, self.placement)
        """The pp rank that computes the loss (rank 0 in a V)."""
        self._loss_chunk = loss_chunk if self._loss_rank == mesh.pp_rank else None
        """The model chunk of this rank that computes the loss (the last virtual stage), or
        None."""
        self.timeout_s = timeout_s = timeout_s or mesh.timeout_s
        self.p2p = (
            StageP2P(mesh, act_shape, act_dtype, timeout_s, wire_dtype) if mesh.pp > 1 else None
        )
        self.weight_grads = store_of(stage)  # enabled in steps with a split backward
        # what a sent output's storage is replaced by (the first step makes it: a CUDA mesh may
        # be built where no GPU is)
        self._stand_in: torch.Tensor | None = None
        self._act_dtype = act_dtype
        self._act_numel = torch.Size(act_shape).numel()
        self.post_ahead = self.p2p is not None and polls_host(mesh.device)
        """Post each peer's next receive as soon as the previous one arrived (gloo: a message
        moves only once its receive is posted). NCCL runs a rank's operations in issue order,
        so there receives are issued where the program has them."""
        self.handlers = {
            "forward": self._forward,
            "backward": self._backward,
            "backward_input": self._backward_input,
            "backward_weight": self._backward_weight,
        }
        self._plans: dict[tuple, StepPlan] = {}  # (m, forward_only) -> see step_plan
        self.clock = StepClock(mesh.device)  # CUDA events on CUDA, perf_counter on the CPU
        # rank, stamps, events (`StepPlan.events`), reader
        self._last_trace: tuple[int, list, tuple, Callable[[Any], float]]
        self._last_trace = (mesh.pp_rank, [], (), float)
        self.count_comm_wait = False
        """Count the time the compute actions spend blocked in their tp / cp collectives
        (`megapar.comm_wait`; the straggler measure turns it on)."""
        self._reset([], 1.0, False)

    def _reset(self, micro_batches, loss_scale, forward_only) -> None:
        """The per-step state, empty (between steps) or for a step over `micro_batches`."""
        self._batches, self._loss_scale = micro_batches, loss_scale
        self._forward_only = forward_only
        # Per (mb, chunk), keyed by its slot (`slot`):
        self.inputs: dict[int, torch.Tensor] = {}
        """In a step, per slot (`slot`): the received activations (leaves) not yet consumed
        by their backward."""
        self.outputs: dict[int, torch.Tensor] = {}
        """In a step, per slot: the stage outputs (hidden states or the loss) not yet
        consumed by their backward (or, forward-only, by their send)."""
        # what a sent activation is taken by: a forward-only step keeps no graph
        self._take_output = self.outputs.pop if forward_only else self.outputs.get
        self._out_grads: dict[int, torch.Tensor] = {}  # received d(loss)/d(output)
        self._in_grads: dict[int, torch.Tensor] = {}  # d(loss)/d(input) to send upstream
        self._pending_w: dict[int, PendingWeightGrad] = {}  # B done, W not yet (zero bubble)
        self._losses: dict[int, torch.Tensor] = {}  # last stage: detached loss per mb
        self._z_losses: dict[int, torch.Tensor] = {}  # last stage: its output z-loss per mb
        self._z_on = not forward_only and any(
            getattr(c, "z_loss", 0.0) and c.training for c in self.chunks
        )
        """The step reports an output z-loss (`last_z_loss`): a training step of stage models
        with --z-loss, the same answer on every pp rank."""
        self._loss_grad = None  # what the losses are backpropagated with (_first_loss_grad)
        self._grad_sync, self._step_index, self._report_at = None, None, frozenset()
        self._ahead: dict[int, deque] = {}  # gloo: per peer rank, receives in program order
        self._recvs_issued: set[int] = set()  # receives issued so far (`PlannedMessage.uid`)
        self._line = _SetAction()  # the status line (`status.action_line`)
        self._stamps: list = []  # the step's clock readings (`StepPlan.events`)

    def slot(self, mb: int, chunk: int) -> int:
        """The key of micro-batch `mb`'s state in model chunk `chunk` (its input, output and
        gradients): one int, ``mb * chunks + chunk``, which a dictionary hashes for nothing
        where an (mb, chunk) tuple is built and hashed at every lookup."""
        return mb * self._chunk_count + chunk

    def virtual_stage(self, chunk: int) -> int:
        """The virtual stage of this rank's model chunk `chunk`."""
        return self.place.virtual_stage(chunk)

    def program(self, m: int, forward_only: bool = False, stage: int | None = None) -> tuple:
        """The program (computes and message groups) of `stage` (default: this rank's) for a
        step of `m` micro-batches."""
        return messages.programs(
            self.schedule_name, self.mesh.pp, m, self.virtual_stages, forward_only
        )[self.mesh.pp_rank if stage is None else stage]

    def step_plan(self, m: int, forward_only: bool = False) -> StepPlan:
        """What a step of `m` micro-batches needs from this rank's program, worked out once per
        (m, forward_only) and kept (`step_plan.plan_step`): a step's host work is then the
        program's actions alone."""
        key = (m, forward_only)
        plan = self._plans.get(key)
        if plan is None:
            program = self.program(m, forward_only)
            check_chunks(program, len(self.chunks), self.schedule_name)
            programs = (
                None
                if self.p2p is None
                else messages.programs(
                    self.schedule_name, self.mesh.pp, m, self.virtual_stages, forward_only
                )
            )
            plan = self._plans[key] = plan_step(program, programs, self.place, self.chunks)
        return plan

    # the step ------------------------------------------------------------------------------
    def run(
        self,
        micro_batches: list[dict],
        grad_sync=None,
        loss_scale: float = 1.0,
        forward_only: bool = False,
        loss_weight: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
        """One step over `micro_batches`; returns the mean loss (fp32 scalar) on every pp rank.

        `loss_weight` (``--loss-mean token``): set as the loss chunk's `loss_weight` for the
        step, so each micro-batch's loss is its labelled tokens' loss sum times it (None: their
        mean; `megapar.models.stage`).

        `grad_sync` (optional, ignored when `forward_only`) gets `begin_step()` before the
        program, `arm(params)` (where it has one) before each model chunk's last backward but
        the stage's last, with the parameters that chunk leaves final,
        `before_last_backward()` right before this stage's last backward (of a split
        backward: its last B; each chunk's last W then reports each weight gradient it
        finishes to `grad_sync.grads_ready`, so the reduction overlaps the W passes), and
        `finish()` after the program and the wait for outstanding sends (see "grad sync").
        """
        m = len(micro_batches)
        self._check_can_step(m)
        plan = self.step_plan(m, forward_only)
        self._set_loss_mode(m, loss_weight)
        self._begin(
            plan, micro_batches, None if forward_only else grad_sync, loss_scale, forward_only
        )
        try:
            self._sync_begin()
            if self.p2p is not None:
                self.p2p.begin_step()
                self._post_ahead(plan.posts)
            self._stamp_at(0)  # where the first wait (or send) starts
            with torch.set_grad_enabled(not forward_only):
                self._walk(plan)
            said = "evaluation: " if forward_only else ""
            set_action(f"{said}waiting for the sends of pp stage {self.mesh.pp_rank}")
            if self.p2p is not None:
                self.p2p.wait_sends()
            self._stamp_at(-3)
            self._sync_finish()
            self._stamp_at(-2)
            set_action(f"{said}loss broadcast from the last pipeline stage")
            loss = self._mean_loss(m)
            self._stamp_at(-1)
            return loss
        finally:
            self._end(plan)

    def _loss_stage(self):
        """This rank's model chunk that computes the loss, or None where it holds none."""
        return None if self._loss_chunk is None else self.chunks[self._loss_chunk]

    def _set_loss_mode(self, m: int, loss_weight: torch.Tensor | float | None = None) -> None:
        """The loss's chunk (`loss_grads_in_forward`, `megapar.models.stage`) makes its loss
        gradients in the forward only where one loss is in flight at a time (`loss_in_flight`),
        and weighs its loss with `loss_weight` for this step (`_end` clears it)."""
        chunk = self._loss_stage()
        if hasattr(chunk, "loss_weight"):
            chunk.loss_weight = loss_weight
        elif chunk is not None and loss_weight is not None:
            raise TypeError(
                f"a loss_weight (--loss-mean token) needs a megapar stage model as the last "
                f"chunk; {type(chunk).__name__} has no loss_weight attribute"
            )
        if hasattr(chunk, "loss_grads_in_forward"):
            held = loss_in_flight(self.schedule_name, self.mesh.pp, m, self.virtual_stages)
            chunk.loss_grads_in_forward = held <= 1

    def _check_can_step(self, m: int) -> None:
        if m == 0:
            raise ValueError("PipelineExecutor.run needs at least one micro-batch")
        if self.p2p is not None and (
            self.p2p.failed or self.p2p.pending_recvs or self.p2p.pending_sends
        ):
            raise RuntimeError(
                f"rank {self.mesh.rank} (pp stage {self.mesh.pp_rank}): the previous pipeline "
                f"step failed part-way, so messages of it are still in flight and this stage "
                f"is out of step with its neighbours; restart the run (resume from the last "
                f"checkpoint) instead of stepping again"
            )

    def _begin(self, plan: StepPlan, micro_batches, grad_sync, loss_scale, forward_only) -> None:
        """The step's state: empty slots, the status line, the clock and its stamps."""
        if self._stand_in is None and self.p2p is not None:
            self._stand_in = stand_in_for(self._act_dtype, self.mesh.device)
        self._reset(micro_batches, loss_scale, forward_only)
        self._report_at, self._grad_sync = plan.report_at, grad_sync
        self.weight_grads.take()
        self.weight_grads.enabled = not forward_only and plan.split_backward
        line = action_line(plan.longest)  # None: no launcher's line, or too short
        if line is not None:
            self._line = line
        if self.trace:  # the clock readings at the plan's indices (`StepPlan.events`)
            self._stamps = [None] * plan.readings
            self.clock.begin()

    def _end(self, plan: StepPlan) -> None:
        """After a step (also one that failed part-way): its trace kept, its state dropped."""
        stamps = self._stamps
        self._reset([], 1.0, False)
        chunk = self._loss_stage()
        if hasattr(chunk, "loss_weight"):  # the next step (an evaluation) sets its own
            chunk.loss_weight = None
        self.weight_grads.enabled = False  # forwards outside a step compute dW as usual
        self.weight_grads.take()
        self._last_trace = (
            self.mesh.pp_rank,
            stamps,
            plan.events if stamps else (),
            self.clock.reader(),
        )

    def _walk(self, plan: StepPlan) -> None:
        """The planned steps in order: each message group issued (its sent activations' storage
        freed); each compute after the wait for its message (or the V's hand-over) and any
        planned `grad_sync` call, its handler run between two clock stamps (p2p: set wherever a
        message is planned, as messages are planned only where there is a peer)."""
        handlers, p2p, line = self.handlers, cast("StageP2P", self.p2p), self._line
        stamps, clock, counted = self._stamps, self.clock.stamp, self.count_comm_wait
        inputs, out_grads, outputs, ahead = self.inputs, self._out_grads, self.outputs, self._ahead
        needs_grad, posted, traced = not self._forward_only, self._recvs_issued, self.trace
        stand_in = self._stand_in if self._act_numel > 1 else None  # one-element outputs kept
        take, pop_grad = self._take_output, self._in_grads.pop
        tensor: torch.Tensor | None  # a message's: None for a receive the group issues
        for group, action, kind, recv, hand_over, said, stamp, sync_at, report_at in plan.walk:
            if group is not None:  # the message group before the compute
                messages_, group_said, sent_acts, _, sent_at, issue = group  # PlannedGroup
                if issue is None or ahead:  # sends, or receives some of which may be posted
                    issue = []
                    for uid, code, slot, key, peer, carries, label in messages_:  # PlannedMessage
                        if code == SEND_ACT:
                            tensor = take(slot)
                        elif code == SEND_GRAD:
                            tensor = pop_grad(slot)
                        elif uid in posted:  # gloo: posted ahead already
                            continue
                        else:
                            tensor = None
                            posted.add(uid)
                        issue.append((key, tensor, peer, carries, label))
                if issue:
                    line.value = group_said
                    p2p.issue(issue)
                    if needs_grad and stand_in is not None:
                        for slot in sent_acts:
                            output = outputs[slot]  # its storage goes, its graph stays
                            if output._base is None:  # a view's storage is another tensor's
                                output.data = stand_in
                    if traced and sent_at is not None:  # the sends end here
                        stamps[sent_at] = clock()
                if kind is None:  # no compute follows the group
                    continue
            if recv is not None:  # wait for the message the compute consumes
                key, peer, recv_said, acks, slot, is_act = recv  # PlannedRecv
                line.value = recv_said
                tensor = p2p.wait_recv(key)  # traced: the wait ends at the compute's start
                for sent in acks:  # sends its arrival proves received
                    p2p.release(sent)
                if ahead and ahead[peer]:  # gloo: its next receive now (NCCL queues none)
                    self._post_next(peer)
                if is_act:  # a leaf: the setter is `requires_grad_` without its arg parsing
                    tensor.requires_grad = needs_grad
                    inputs[slot] = tensor
                else:
                    out_grads[slot] = tensor
            elif hand_over is not None:
                self._hand_over(hand_over, action)
            if sync_at is not None:
                if traced:  # the wait ends before the call (`trace_events`)
                    stamps[stamp - 1] = clock()
                self._sync_before(sync_at, plan)
            self._step_index = report_at  # a chunk's last weight-gradient action (`_ready`)
            line.value = said
            try:
                handler = handlers[kind]
            except KeyError:
                raise self._no_handler(kind) from None
            if traced:
                stamps[stamp] = clock()
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
            if traced:
                stamps[stamp + 1] = clock()

    # grad sync: every call a step makes to `grad_sync` -------------------------------------
    def _sync_begin(self) -> None:
        if self._grad_sync is not None:
            self._grad_sync.begin_step()

    def _sync_before(self, index: int, plan: StepPlan) -> None:
        """Before compute `index` (`WalkStep.sync_at`): the stage's last backward, or a
        chunk's last backward whose parameters are final after it."""
        grad_sync = self._grad_sync
        if grad_sync is None:
            return
        if index == plan.last_backward:
            grad_sync.before_last_backward()
        elif index in plan.arm_at:
            grad_sync.arm(plan.arm_at[index])  # a chunk's gradients final next

    def _ready(self):
        """`grad_sync.grads_ready` at a chunk's last weight-gradient action, else None."""
        if self._grad_sync is not None and self._step_index in self._report_at:
            return self._grad_sync.grads_ready
        return None

    def _sync_finish(self) -> None:
        if self._grad_sync is not None:
            collective = "all-reduce" if self._grad_sync.stage == 0 else "reduce-scatter"
            set_action(f"waiting for the data-parallel gradient {collective}")
            self._grad_sync.finish()

    # errors ---------------------------------------------------------------------------------
    def _no_handler(self, kind: str) -> NotImplementedError:
        return NotImplementedError(
            f"schedule {self.schedule_name!r} uses action {kind!r}, which PipelineExecutor has "
            f"no handler for; register one in executor.handlers"
        )

    def _failed_in(self, action: Action) -> str:
        """The note added to an exception of a compute handler (P2P timeouts name their own)."""
        chunk = f" (chunk {action.chunk})" if len(self.chunks) > 1 else ""
        return (
            f"[megapar] while running {action.kind} of micro-batch {action.mb} on pp "
            f"stage {self.mesh.pp_rank}{chunk} (rank {self.mesh.rank}), schedule "
            f"{self.schedule_name!r}"
        )

    # handlers ------------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        mb, chunk = a.mb, a.chunk
        key = mb * self._chunk_count + chunk  # `slot`, inline on the step's path
        x = self.inputs.get(key)
        out = self.chunks[chunk](x, self._batches[mb])
        if self._forward_only:  # no graph: the input is not needed any more
            self.inputs.pop(key, None)
        if chunk == self._loss_chunk:
            if out.dim() != 0:
                raise ValueError(
                    f"the last pipeline stage returned a tensor of shape {tuple(out.shape)} for "
                    f"micro-batch {mb}, not a scalar loss; every micro-batch needs 'labels'"
                )
            self._losses[mb] = out.detach().float()
            z = getattr(self.chunks[chunk], "last_z_loss", None)
            if self._z_on and z is not None:
                self._z_losses[mb] = z.float()
            if self._forward_only:
                return
        self.outputs[key] = out

    # loss ----------------------------------------------------------------------------------
    def _mean_loss(self, m: int) -> torch.Tensor:
        """Mean of the m micro-batch losses, broadcast from the last stage over the pp group."""
        last = self._loss_rank
        self.last_z_loss = None
        z_on = self._z_on  # the z-loss's mean rides with the loss's: one broadcast
        if self.mesh.pp_rank == last:
            loss = torch.stack([self._losses[i] for i in range(m)]).sum() / m
            if z_on:
                loss = torch.stack([loss, torch.stack(list(self._z_losses.values())).sum() / m])
        else:
            shape = (2,) if z_on else ()
            loss = torch.zeros(shape, dtype=torch.float32, device=self.mesh.device)
        if self.mesh.pp > 1:
            src = self.mesh.stage_rank(last)
            work = dist.broadcast(loss, src=src, group=self.mesh.pp_group, async_op=True)
            wait_work(
                work,
                self.mesh.device,
                self.timeout_s,
                f"rank {self.mesh.rank}: broadcast of the loss from the last pipeline "
                f"stage (rank {src})",
            )
        if z_on:
            self.last_z_loss = loss[1]
            return loss[0]
        return loss
