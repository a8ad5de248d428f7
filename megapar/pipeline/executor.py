"""Run one pipeline stage's schedule for a training (or evaluation) step.

The executor knows nothing about GPipe or 1F1B: it asks `get_schedule(name)(pp, m, stage)` for this
stage's list of `Action`s and runs them in order, dispatching on `Action.kind` through a dict of
handlers (`self.handlers`). A new action kind (the zero-bubble ``backward_input`` /
``backward_weight``) is a new entry in that dict; the loop does not change.

Model chunks (interleaved schedules): `stage` may be a `ModelChunks` (`stage.chunks`), and every
action names its chunk; per-micro-batch state is keyed by (mb, chunk), and the peer of each
send / receive comes from the chunk's virtual stage (`schedules.peer_of`), so activations wrap
around from the last rank to rank 0 for the next chunk. Zero-bubble schedules split the backward
into ``backward_input`` / ``backward_weight`` (`megapar.pipeline.split_backward`).

Per in-flight micro-batch it keeps the input activation (a leaf that requires grad, so its `.grad`
is what the previous stage needs) and the output (hidden states, or the loss on the last stage),
and frees both at the micro-batch's backward. The last stage backpropagates
``loss * loss_scale / m``, so `param.grad` accumulates the gradient of the mean loss over the m
micro-batches (the caller zeroes gradients between steps).

What the schedules imply about messages is worked out once per step (`messages.py`): a received
message frees the sends it proves received, and (on gloo) posts the next receive of its channel
ahead of time, so messages land while the stage computes.

Every action is traced unless `trace=False` (two clock reads and a tuple append per action; cost
in benchmarks/tracing_overhead.py); `last_timeline` turns the last step into a `Timeline` (empty
when not traced), and `gather.gather_timeline` aligns and collects all stages' timelines on pp rank 0.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from megapar.device import DEFAULT_TIMEOUT_S
from megapar.diagnostics import set_action
from megapar.mesh import Mesh
from megapar.pipeline.clock import StepClock
from megapar.pipeline.p2p import P2PTimeoutError, StageP2P, wait_work
from megapar.pipeline import messages, split_backward
from megapar.tensor_parallel.weight_grad import WeightGradStore
from megapar.tensor_parallel.weight_grad import attach as attach_weight_grad_store
from megapar.pipeline.schedules import (
    Action, get_schedule, peer_of, placement_of, schedule_actions, virtual_stage,
)
from megapar.pipeline.timeline import Event, Timeline

FORWARD_KINDS = frozenset({"recv_act", "forward", "send_act"})
"""The actions an evaluation (forward-only) step keeps from the schedule."""
WEIGHT_GRAD_KINDS = frozenset({"backward", "backward_weight"})
"""Actions that accumulate parameter gradients; `before_last_backward` precedes the last one."""


class PipelineExecutor:
    """Executes a named schedule on this rank's stage.

    `stage(hidden_or_None, batch)` returns hidden states of shape `act_shape`, or on the last stage
    the scalar mean loss of the micro-batch; `wire_dtype` narrows the messages between stages
    (cast back on receipt). `timeout_s` bounds every blocking wait. `trace`
    (an attribute, may be changed between steps) records the step's events for `last_timeline`.
    """

    def __init__(self, stage: nn.Module, mesh: Mesh, schedule: str, act_shape: tuple,
                 act_dtype: torch.dtype = torch.float32, timeout_s: float = DEFAULT_TIMEOUT_S,
                 trace: bool = True, virtual_stages: int = 1,
                 wire_dtype: torch.dtype | None = None):
        self.stage, self.mesh, self.trace = stage, mesh, trace
        self.schedule_name = schedule
        get_schedule(schedule)  # unknown names fail here
        self.schedule_fn = functools.partial(schedule_actions, schedule,
                                             virtual_stages=virtual_stages)
        self.chunks = list(getattr(stage, "chunks", [stage]))
        if len(self.chunks) != virtual_stages:
            raise ValueError(f"schedule {schedule!r} with --virtual-stages {virtual_stages} needs "
                             f"a stage of {virtual_stages} model chunks; this rank holds "
                             f"{len(self.chunks)} (build it with build_stage(virtual_stages=...))")
        self.placement = placement_of(schedule)
        self.timeout_s = timeout_s
        self.p2p = (StageP2P(mesh, act_shape, act_dtype, timeout_s, wire_dtype)
                    if mesh.pp > 1 else None)
        self.weight_grads = WeightGradStore()  # enabled only in steps with a split backward
        attach_weight_grad_store(stage, self.weight_grads)
        self.handlers = {
            "recv_act": self._recv_act, "forward": self._forward, "send_act": self._send_act,
            "recv_grad": self._recv_grad, "backward": self._backward, "send_grad": self._send_grad,
            "backward_input": self._backward_input, "backward_weight": self._backward_weight,
        }
        self._trace: list[tuple] = []
        self.clock = StepClock(mesh.device)  # CUDA events on CUDA, perf_counter on the CPU
        self.last_timeline = Timeline([])
        self._peer_note = {k: f" ({'from' if k.startswith('recv') else 'to'} rank {r})"
                      for k, r in (("recv_act", mesh.prev_stage_rank),
                                   ("send_grad", mesh.prev_stage_rank),
                                   ("recv_grad", mesh.next_stage_rank),
                                   ("send_act", mesh.next_stage_rank)) if r is not None}
        self._reset([], 1.0, False)

    def _reset(self, micro_batches, loss_scale, forward_only) -> None:
        self._batches, self._loss_scale, self._forward_only = micro_batches, loss_scale, forward_only
        # Per (mb, chunk):
        self._inputs: dict[tuple, torch.Tensor] = {}     # received activations (leaves)
        self._outputs: dict[tuple, torch.Tensor] = {}    # stage outputs (hidden or loss)
        self._out_grads: dict[tuple, torch.Tensor] = {}  # received d(loss)/d(output)
        self._in_grads: dict[tuple, torch.Tensor] = {}   # d(loss)/d(input) to send upstream
        self._pending_w: dict[tuple, object] = {}        # B done, W not yet (zero bubble)
        self._losses: dict[int, torch.Tensor] = {}       # last stage: detached loss per mb
        self._acks: dict[tuple, list[tuple]] = {}        # see messages.acknowledgements
        self._next_post: dict[Action, Action] = {}       # see messages.early_receives

    # the step ------------------------------------------------------------------------------
    def run(self, micro_batches: list[dict], grad_sync=None, loss_scale: float = 1.0,
            forward_only: bool = False) -> torch.Tensor:
        """One step over `micro_batches`; returns the mean loss (fp32 scalar) on every pp rank.

        `grad_sync` (optional, ignored when `forward_only`) gets `begin_step()` before the
        schedule, `before_last_backward()` right before this stage's last backward action, and
        `finish()` after the schedule and the wait for outstanding sends.
        """
        m = len(micro_batches)
        if m == 0:
            raise ValueError("PipelineExecutor.run needs at least one micro-batch")
        if self.p2p is not None and (self.p2p.failed or self.p2p.posted_recvs
                                     or self.p2p.pending_sends):
            raise RuntimeError(
                f"rank {self.mesh.rank} (pp stage {self.mesh.pp_rank}): the previous pipeline "
                f"step failed part-way, so messages of it are still in flight and this stage "
                f"is out of step with its neighbours; restart the run (resume from the last "
                f"checkpoint) instead of stepping again")
        actions = self._actions(m, self.mesh.pp_rank, forward_only)
        if forward_only:
            grad_sync = None
        self._check_actions(actions)
        last_backward = max((i for i, a in enumerate(actions) if a.kind in WEIGHT_GRAD_KINDS),
                            default=None)
        self._trace = []
        self._reset(micro_batches, loss_scale, forward_only)
        self.weight_grads.take()
        self.weight_grads.enabled = not forward_only and any(
            a.kind == "backward_input" for a in actions)
        self._acks = messages.acknowledgements(
            actions, self.mesh.pp_rank, self._peer,
            lambda rank: self._actions(m, rank, forward_only))
        first_posts, self._next_post = messages.early_receives(actions) \
            if self.p2p is not None and self.p2p.can_post_early else ([], {})
        trace, record, clock = self._trace, self.trace, self.clock.stamp
        if record:
            self.clock.begin()
        try:
            if grad_sync is not None:
                grad_sync.begin_step()
            for a in first_posts:
                self.p2p.post_recv(a.kind, a.mb, **self._route(a))
            with torch.set_grad_enabled(not forward_only):
                for i, action in enumerate(actions):
                    if i == last_backward and grad_sync is not None:
                        grad_sync.before_last_backward()
                    start = clock() if record else 0.0
                    self._dispatch(action)
                    if record:
                        trace.append((action.kind, action.mb, action.chunk, start, clock()))
            start = clock() if record else 0.0
            set_action(f"waiting for the sends of pp stage {self.mesh.pp_rank}")
            if self.p2p is not None:
                self.p2p.wait_sends()
            if record:
                trace.append(("wait", None, 0, start, clock()))
            if grad_sync is not None:
                set_action("waiting for the data-parallel gradient all-reduce")
                grad_sync.finish()
            start = clock() if record else 0.0
            set_action("loss broadcast from the last pipeline stage")
            loss = self._mean_loss(m)
            if record:
                trace.append(("loss_broadcast", None, 0, start, clock()))
            return loss
        finally:
            self._reset([], 1.0, False)
            self.weight_grads.enabled = False  # forwards outside a step compute dW as usual
            self.weight_grads.take()
            rank, at = self.mesh.pp_rank, self.clock.resolve
            if trace:
                self.clock.finish()
            self.last_timeline = Timeline([Event(rank, k, mb, at(s), at(e), c)
                                           for k, mb, c, s, e in trace])

    def _dispatch(self, action: Action) -> None:
        set_action(f"{action.kind} of micro-batch {action.mb} on pp stage {self.mesh.pp_rank}"
                   f"{self._peer_note.get(action.kind, '')}")
        handler = self.handlers.get(action.kind)
        if handler is None:
            raise NotImplementedError(
                f"schedule {self.schedule_name!r} uses action {action.kind!r}, which "
                f"PipelineExecutor has no handler for; register one in executor.handlers")
        try:
            handler(action)
        except P2PTimeoutError:
            raise
        except Exception as exc:
            chunk = f" (chunk {action.chunk})" if len(self.chunks) > 1 else ""
            exc.add_note(f"[megapar] while running {action.kind} of micro-batch {action.mb} on "
                         f"pp stage {self.mesh.pp_rank}{chunk} (rank {self.mesh.rank}), schedule "
                         f"{self.schedule_name!r}")
            raise

    def _actions(self, m: int, stage: int, forward_only: bool) -> list[Action]:
        actions = self.schedule_fn(self.mesh.pp, m, stage)
        return [a for a in actions if a.kind in FORWARD_KINDS] if forward_only else actions

    def _peer(self, rank: int, a: Action) -> tuple[int, int] | None:
        return peer_of(rank, a, self.mesh.pp, len(self.chunks), self.placement)

    def _after_receive(self, recv: Action) -> None:
        """Free the sends `recv` proves received; post the next receive of its channel."""
        for kind, mb, chunk in self._acks.get((recv.kind, recv.mb, recv.chunk), ()):
            self.p2p.release(kind, mb, chunk)
        after = self._next_post.get(recv)
        if after is not None:
            self.p2p.post_recv(after.kind, after.mb, **self._route(after))

    def _check_actions(self, actions: list[Action]) -> None:
        chunks = {a.chunk for a in actions}
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

    def _route(self, a: Action) -> dict:
        """p2p keyword arguments of a chunked message (none with one chunk per rank)."""
        if len(self.chunks) == 1 and self.placement == "loop":
            return {}
        where = self._peer(self.mesh.pp_rank, a)
        return {"chunk": a.chunk, ("to" if a.kind.startswith("send") else "source"): where}

    # handlers ------------------------------------------------------------------------------
    def _recv_act(self, a: Action) -> None:
        x = self.p2p.recv_act(a.mb, **self._route(a))
        self._after_receive(a)
        self._inputs[a.mb, a.chunk] = x.requires_grad_(not self._forward_only)

    def _forward(self, a: Action) -> None:
        key = (a.mb, a.chunk)
        x = self._inputs.get(key)
        if x is None and not self._is_first(a):
            raise RuntimeError(f"forward of micro-batch {a.mb} (chunk {a.chunk}) on pp stage "
                               f"{self.mesh.pp_rank} before its activation was received; the "
                               f"schedule is wrong")
        out = self.chunks[a.chunk](x, self._batches[a.mb])
        if self._forward_only:  # no graph: the input is not needed any more
            self._inputs.pop(key, None)
        if self._is_last(a):
            if out.dim() != 0:
                raise ValueError(
                    f"the last pipeline stage returned a tensor of shape {tuple(out.shape)} for "
                    f"micro-batch {a.mb}, not a scalar loss; every micro-batch needs 'labels'")
            self._losses[a.mb] = out.detach().float()
            if self._forward_only:
                return
            out = out * self._loss_scale / len(self._batches)  # what backward differentiates
        self._outputs[key] = out

    def _send_act(self, a: Action) -> None:
        key = (a.mb, a.chunk)
        out = self._outputs.pop(key) if self._forward_only else self._outputs[key]
        self.p2p.send_act(out, a.mb, **self._route(a))

    def _recv_grad(self, a: Action) -> None:
        self._out_grads[a.mb, a.chunk] = self.p2p.recv_grad(a.mb, **self._route(a))
        self._after_receive(a)

    def _backward(self, a: Action) -> None:
        key = (a.mb, a.chunk)
        out = self._outputs.pop(key)
        grad = None if self._is_last(a) else self._out_grads.pop(key)
        torch.autograd.backward(out, grad_tensors=grad)
        x = self._inputs.pop(key, None)
        if x is not None:
            self._in_grads[key] = self._input_grad(a, x.grad)

    def _input_grad(self, a: Action, grad) -> torch.Tensor:
        if grad is None:
            raise RuntimeError(f"pp stage {self.mesh.pp_rank}: the output of micro-batch {a.mb} "
                               f"(chunk {a.chunk}) does not depend on the received activation")
        return grad

    def _backward_input(self, a: Action) -> None:
        """B: the gradient w.r.t. the chunk's input only (sent upstream next); W comes later."""
        key = (a.mb, a.chunk)
        out = self._outputs.pop(key)
        grad = None if self._is_last(a) else self._out_grads.pop(key)
        x = self._inputs.pop(key, None)
        dx, self._pending_w[key] = split_backward.backward_input(out, grad, x,
                                                                 self.weight_grads)
        if x is not None:
            self._in_grads[key] = self._input_grad(a, dx)

    def _backward_weight(self, a: Action) -> None:
        """W: the chunk's weight gradients of one micro-batch, added in place to `.grad`."""
        split_backward.backward_weight(self._pending_w.pop((a.mb, a.chunk)))

    def _send_grad(self, a: Action) -> None:
        self.p2p.send_grad(self._in_grads.pop((a.mb, a.chunk)), a.mb, **self._route(a))

    # loss ----------------------------------------------------------------------------------
    def _mean_loss(self, m: int) -> torch.Tensor:
        """Mean of the m micro-batch losses, broadcast from the last stage over the pp group."""
        if self.mesh.is_last_stage:
            loss = torch.stack([self._losses[i] for i in range(m)]).sum() / m
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        if self.mesh.pp > 1:
            src = self.mesh.stage_rank(self.mesh.pp - 1)
            work = dist.broadcast(loss, src=src, group=self.mesh.pp_group, async_op=True)
            wait_work(work, self.timeout_s, f"rank {self.mesh.rank}: broadcast of the loss from "
                                            f"the last pipeline stage (rank {src})")
        return loss
