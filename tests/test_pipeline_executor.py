"""The pipeline executor's machinery: tracing, timeline gathering, grad_sync hooks, failures.

Uses a toy stage (one linear layer + tanh, squared-error loss on the last stage) so the tests
are about the executor, not the model; numerical parity is in test_pipeline_parity.py.
"""

import itertools
import os
import time

import pytest
import torch
from torch import nn
from tp_utils import assert_close, make_mesh

from megapar.launcher import WorkerError, run_local
from megapar.mesh import Layout, Mesh
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.p2p import P2PTimeoutError
from megapar.pipeline.schedules import Action, get_schedule
from megapar.pipeline.trace import StepClock, gather_timeline

B, S, H = 2, 4, 8
SHAPE = (B, S, H)


class ToyStage(nn.Module):
    """tanh(linear(x)); the first stage reads batch["x"], the last returns mse to batch["y"]."""

    def __init__(self, mesh, sleep_s=0.0, fail_at_mb=None):
        super().__init__()
        torch.manual_seed(10 + mesh.pp_rank)
        self.lin = nn.Linear(H, H)
        self.mesh, self.sleep_s, self.fail_at_mb = mesh, sleep_s, fail_at_mb

    def forward(self, hidden, batch):
        if batch["mb"] == self.fail_at_mb:
            raise RuntimeError(f"boom in stage {self.mesh.pp_rank} at micro-batch {batch['mb']}")
        if self.mesh.is_first_stage:
            hidden = batch["x"]
        out = torch.tanh(self.lin(hidden))
        time.sleep(self.sleep_s)
        return ((out - batch["y"]) ** 2).mean() if self.mesh.is_last_stage else out


def toy_batches(m):
    gen = torch.Generator().manual_seed(0)
    return [{"mb": i, "x": torch.randn(SHAPE, generator=gen), "y": torch.randn(SHAPE, generator=gen)}
            for i in range(m)]


class RecordingSync:
    """A grad_sync that records when each hook is called (perf_counter)."""

    stage = 0

    def __init__(self):
        self.calls = []

    def begin_step(self):
        self.calls.append(("begin_step", time.perf_counter()))

    def before_last_backward(self):
        self.calls.append(("before_last_backward", time.perf_counter()))

    def finish(self):
        self.calls.append(("finish", time.perf_counter()))


def last_backward(events):
    return max(i for i, e in enumerate(events) if e.kind == "backward")


def traced_worker(pp, m, schedule):
    mesh = make_mesh(pp=pp)
    stage = ToyStage(mesh, sleep_s=0.01)
    executor = PipelineExecutor(stage, mesh, schedule, SHAPE, timeout_s=30)
    sync = RecordingSync()
    clock, readings = executor.clock.stamp, []
    executor.clock.stamp = lambda: readings.append(None) or clock()
    loss = executor.run(toy_batches(m), grad_sync=sync)
    local = executor.last_timeline
    expected = [(a.kind, a.mb) for a in get_schedule(schedule)(pp, m, mesh.pp_rank)]
    events = local.for_rank(mesh.pp_rank)
    # One clock reading where an event ends and the next starts (not two per event): each
    # event's end, each compute's start, the step's start, the loss broadcast's start and the
    # reading before the grad_sync call of the last backward.
    computes = sum(e.kind in ("forward", "backward") for e in events)
    assert len(readings) <= len(events) + computes + 3, (len(readings), len(events))
    for wait, compute in itertools.pairwise(events):  # a wait ends as its compute starts
        if wait.kind.startswith("recv") and compute is not events[last_backward(events)]:
            assert wait.end == compute.start, (wait, compute)
    assert [(e.kind, e.mb) for e in events] == expected + [("wait", None), ("loss_broadcast", None)]
    assert all(a.end <= b.start for a, b in itertools.pairwise(events)), "events overlap"
    # grad_sync hooks: begin before the first action, before_last_backward right before the last
    # backward, finish after the end-of-step wait for sends.
    calls = dict(sync.calls)
    assert [c for c, _ in sync.calls] == ["begin_step", "before_last_backward", "finish"]
    last_b = last_backward(events)
    assert calls["begin_step"] <= events[0].start
    assert events[last_b - 1].end <= calls["before_last_backward"] <= events[last_b].start
    wait = next(e for e in events if e.kind == "wait")
    assert wait.end <= calls["finish"]
    grads = [p.grad.clone() for p in stage.parameters()]
    # Evaluation: forwards only, no graph, same loss, gradients untouched.
    eval_loss = executor.run(toy_batches(m), forward_only=True)
    kinds = {e.kind for e in executor.last_timeline.events}
    assert kinds <= {"recv_act", "forward", "send_act", "wait", "loss_broadcast"}
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, stage.parameters()))
    gathered = gather_timeline(local, mesh)
    return {"loss": loss.item(), "eval_loss": eval_loss.item(), "local": local,
            "gathered": gathered}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_timeline_per_action_and_gathered_on_rank0(schedule):
    pp, m = 3, 4
    results = run_local(traced_worker, pp, pp, m, schedule)
    losses = {r["loss"] for r in results}
    assert len(losses) == 1, f"loss not broadcast to every stage: {losses}"
    assert results[0]["eval_loss"] == pytest.approx(results[0]["loss"], rel=1e-6)
    gathered = results[0]["gathered"]
    assert all(r["gathered"] is None for r in results[1:])
    assert gathered.ranks() == list(range(pp))
    for stage, r in enumerate(results):
        mine = r["local"].for_rank(stage)
        theirs = gathered.for_rank(stage)
        assert [(e.kind, e.mb) for e in theirs] == [(e.kind, e.mb) for e in mine]
        # Same durations after the clock shift.
        assert all(abs(a.duration - b.duration) < 1e-6 for a, b in zip(mine, theirs))
    # Forked ranks share one clock, so what the alignment shifted a stage by, against stage 0,
    # is its error: the smallest message latency it saw, never negative (milliseconds when the
    # machine is loaded, e.g. beside another test under pytest -n 2).
    def shift(stage):
        return results[stage]["local"].for_rank(stage)[0].start - \
            gathered.for_rank(stage)[0].start
    error = [shift(stage) - shift(0) for stage in range(pp)]
    assert min(error) >= -1e-6, error
    # Aligned clocks: a micro-batch's forward on stage s+1 starts after it ended on stage s,
    # and its backward on stage s starts after it ended on stage s+1 (10 ms forwards; 2 ms of
    # slack beyond the alignment's own error).
    slack = 2e-3 + max(error)

    def span(stage, kind, mb):
        return next(e for e in gathered.for_rank(stage) if e.kind == kind and e.mb == mb)
    for s in range(pp - 1):
        for mb in range(m):
            assert span(s + 1, "forward", mb).start >= span(s, "forward", mb).end - slack
            assert span(s, "backward", mb).start >= span(s + 1, "backward", mb).end - slack


def pending_sends_worker(schedule, m):
    mesh = make_mesh(pp=2)
    stage = ToyStage(mesh)
    executor = PipelineExecutor(stage, mesh, schedule, SHAPE, timeout_s=30)
    seen, forward = [], stage.forward
    stage.forward = lambda h, b: (seen.append(executor.p2p.pending_sends), forward(h, b))[1]
    executor.run(toy_batches(m))
    assert executor.p2p.pending_sends == 0, "sends left unwaited after the step"
    return max(seen)


def test_sent_buffers_are_freed_once_the_peer_acknowledged_them():
    m = 8
    # 1F1B: a sent activation is freed when its gradient comes back (and a sent gradient when
    # the next activation arrives), so at most one send is outstanding at any forward.
    assert run_local(pending_sends_worker, 2, "1f1b", m) == [1, 1]
    # GPipe: nothing comes back before all forwards are done; stage 0 holds every activation.
    assert run_local(pending_sends_worker, 2, "gpipe", m) == [m - 1, 0]


def repeated_steps_worker(schedule):
    from megapar.pipeline import messages

    mesh = make_mesh(pp=2)
    executor = PipelineExecutor(ToyStage(mesh), mesh, schedule, SHAPE, timeout_s=30)
    calls, acknowledgements = [], messages.acknowledgements
    messages.acknowledgements = lambda *a: (calls.append(a[1:2]), acknowledgements(*a))[1]
    try:
        losses = [float(executor.run(toy_batches(m))) for m in (4, 4, 4, 2, 4)]
    finally:
        messages.acknowledgements = acknowledgements
    return len(calls), losses


def test_a_steps_acknowledgements_are_worked_out_once_per_step_size():
    """The acknowledgements (O(m^2) Python) and the rest of a step's plan are kept per step
    size: five steps of sizes 4, 4, 4, 2, 4 work them out twice, with the same losses as a
    fresh executor gives."""
    for rank, (calls, losses) in enumerate(run_local(repeated_steps_worker, 2, "1f1b")):
        assert calls == 2, f"rank {rank}: acknowledgements worked out {calls} times"
        # no optimizer: every step of the same micro-batches gives the same loss
        assert losses[:3] == [losses[0]] * 3 and losses[4] == losses[0] != losses[3]


def failing_worker():
    mesh = make_mesh(pp=3)
    stage = ToyStage(mesh, fail_at_mb=2 if mesh.pp_rank == 1 else None)
    PipelineExecutor(stage, mesh, "1f1b", SHAPE).run(toy_batches(4))  # default (long) timeout


def test_stage_that_raises_fails_the_run_fast_naming_the_rank():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_local(failing_worker, 3, timeout_s=60)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert message.startswith("rank 1 failed: RuntimeError: boom in stage 1 at micro-batch 2")
    assert "while running forward of micro-batch 2 on pp stage 1" in message


def step_after_failure_worker():
    mesh = make_mesh(pp=2)
    stage = ToyStage(mesh, fail_at_mb=2 if mesh.pp_rank == 1 else None)
    executor = PipelineExecutor(stage, mesh, "1f1b", SHAPE, timeout_s=3)
    with pytest.raises(Exception):  # stage 1 raises, stage 0 times out waiting for it
        executor.run(toy_batches(4))
    stage.fail_at_mb = None
    with pytest.raises(RuntimeError) as info:  # never a step on out-of-step messages
        executor.run(toy_batches(4))
    return str(info.value)


def test_a_step_after_a_failed_step_is_refused():
    for rank, message in enumerate(run_local(step_after_failure_worker, 2, timeout_s=60)):
        assert message.startswith(f"rank {rank} (pp stage {rank}): the previous pipeline step "
                                  f"failed part-way"), message
        assert "restart the run" in message


def timeout_worker(flag):
    mesh = make_mesh(pp=2)
    if mesh.pp_rank == 0:  # never runs its schedule, so stage 1's first receive must time out
        deadline = time.monotonic() + 20
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)  # stay alive (a dead peer would close the connection instead)
        return None
    start = time.monotonic()
    try:
        PipelineExecutor(ToyStage(mesh), mesh, "gpipe", SHAPE, timeout_s=1.0).run(toy_batches(2))
    except P2PTimeoutError as exc:
        return str(exc), time.monotonic() - start
    finally:
        open(flag, "w").close()  # a timed-out gloo pair is closed: no barrier possible, use a file
    return None


def test_receive_timeout_names_rank_peer_and_micro_batch(tmp_path):
    _, result = run_local(timeout_worker, 2, str(tmp_path / "done"), timeout_s=60)
    assert result is not None, "stage 1 did not time out"
    message, elapsed = result
    assert 0.9 <= elapsed < 5, elapsed
    assert "rank 1 (pp stage 1): receiving the activation of micro-batch 0 from rank 0 did not " \
        "complete within 1 s" in message


def test_single_stage_runs_without_processes_and_matches_direct_loss():
    mesh = Mesh(Layout())
    stage = ToyStage(mesh)
    batches = toy_batches(3)
    loss = PipelineExecutor(stage, mesh, "1f1b", SHAPE).run(batches, loss_scale=4.0)
    grads = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    direct = [stage(None, b) for b in batches]
    (sum(direct) * 4.0 / 3).backward()  # loss_scale scales the gradients, not the loss
    assert loss.item() == pytest.approx((sum(direct) / 3).item(), rel=1e-6)
    for g, p in zip(grads, stage.parameters()):
        assert_close(g, p.grad, what="single-stage gradient")


@pytest.mark.parametrize("zero, collective", [(0, "all-reduce"), (1, "reduce-scatter"),
                                              (2, "reduce-scatter"), (3, "reduce-scatter")])
def test_the_status_line_names_the_gradient_collective_waited_for(zero, collective):
    """While the grad sync finishes, a rank's status names the collective it waits in: ZeRO's
    reduce-scatter, not the all-reduce of --zero 0 (it said all-reduce under ZeRO too)."""
    from megapar.faults.status import set_step, status

    class Sync(RecordingSync):
        stage = zero

        def finish(self):
            self.calls.append(("finish", status()))

    mesh = Mesh(Layout())
    sync = Sync()
    set_step(4)  # the process's step state: set here, not left from an earlier test's run
    try:
        PipelineExecutor(ToyStage(mesh), mesh, "1f1b", SHAPE).run(toy_batches(2), grad_sync=sync)
    finally:
        set_step(None)
    assert sync.calls[-1] == ("finish",
                              f"step 4, waiting for the data-parallel gradient {collective}")


def test_unknown_action_kind_names_the_missing_handler():
    mesh = Mesh(Layout())
    executor = PipelineExecutor(ToyStage(mesh), mesh, "gpipe", SHAPE)
    del executor.handlers["backward_input"]  # as if the kind had no handler yet
    executor.program = lambda m, forward_only: (Action("forward", 0), Action("backward_input", 0))
    with pytest.raises(NotImplementedError, match="'backward_input'.*register one"):
        executor.run(toy_batches(1))
    assert [e.kind for e in executor.last_timeline.events] == ["forward"]


def freed_outputs_worker():
    mesh = make_mesh(pp=3)
    executor = PipelineExecutor(ToyStage(mesh), mesh, "1f1b", SHAPE, timeout_s=30)
    seen, sent, issue = [], [], executor.p2p.issue

    def recorded_issue(group):
        issue(group)
        sent.extend((key, executor.p2p._sends[key][1].numel()) for key, *_ in group
                    if key[0] == "send_act")

    def checked(handler):  # at the next compute, the groups before it are issued
        def run(action):
            while sent:  # sent: the stage keeps the graph, not the values
                key, payload = sent.pop(0)
                seen.append((executor.outputs[executor.slot(*key[1:])].numel(), payload))
            handler(action)
        return run

    executor.p2p.issue = recorded_issue
    executor.handlers = {kind: checked(h) for kind, h in executor.handlers.items()}
    loss = executor.run(toy_batches(4))
    return seen, float(loss), executor.p2p.issued


def test_a_training_step_keeps_no_record_of_its_groups():
    """Only a checker that asks (`StageP2P.issued = []`) gets the step's groups recorded; a
    training step keeps no `Op` per message alive to the next step."""
    for stage, (_, _, issued) in enumerate(run_local(freed_outputs_worker, 3)):
        assert issued is None, stage


def test_a_sent_output_is_freed_and_backward_still_runs():
    """Megatron's deallocate_output_tensor: once a stage's output activation is sent, its
    storage goes (the send holds its own reference until it completes); backward runs from the
    graph alone, with the same numbers (parity tests)."""
    results = run_local(freed_outputs_worker, 3)
    for stage, (seen, _, _) in enumerate(results):
        assert seen == ([(1, B * S * H)] * 4 if stage < 2 else []), (stage, seen)
    assert len({loss for _, loss, _ in results}) == 1


def test_every_executor_of_a_stage_defers_weight_gradients():
    """The engine keeps one executor per sequence length; they share the stage's weight-gradient
    store, so a second one does not turn the first one's zero-bubble deferral off."""
    from megapar.models import GPT2Config
    from megapar.pipeline.partition import build_stage

    mesh = Mesh(Layout())
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = build_stage(config, mesh, seed=0)
    ids = {s: torch.randint(0, 64, (2, s), generator=torch.Generator().manual_seed(s))
           for s in (8, 16)}
    first = PipelineExecutor(model, mesh, "zb-h1", (2, 16, 16))
    counts = [first.weight_grads.deferred]
    first.run([{"input_ids": ids[16], "labels": ids[16]}])
    counts.append(first.weight_grads.deferred)
    second = PipelineExecutor(model, mesh, "zb-h1", (2, 8, 16))
    second.run([{"input_ids": ids[8], "labels": ids[8]}])
    counts.append(second.weight_grads.deferred)
    first.run([{"input_ids": ids[16], "labels": ids[16]}])
    counts.append(first.weight_grads.deferred)
    linears = sum(hasattr(m, "weight_grad_store") for m in model.modules())
    assert counts == [0, linears, 2 * linears, 3 * linears]


def posted_ahead_worker(schedule, v, ahead):
    """One step with gloo's receives posted ahead (`ahead`) or where the program issues them
    (NCCL's order); what was issued, per peer, and the numbers."""
    from test_nccl_rules import ToyChunks

    mesh = make_mesh(pp=2)
    executor = PipelineExecutor(ToyChunks(mesh, v), mesh, schedule, (2, 4), virtual_stages=v,
                                timeout_s=30)
    assert executor.post_ahead  # the tests run on gloo
    executor.post_ahead = ahead
    executor.p2p.issued = []  # record the groups issued
    gen = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(2, 4, generator=gen), "y": torch.randn(2, 4, generator=gen)}
               for _ in range(4)]
    loss = executor.run(batches)
    grads = [p.grad.clone() for p in executor.stage.parameters()]
    receives = [op.label for group in executor.p2p.issued for op in group if not op.send]
    program = [a for step in executor.program(4) if hasattr(step, "messages")
               for a in step.messages if a.kind.startswith("recv")]
    groups = [" ".join(op.label for op in group) for group in executor.p2p.issued]
    return float(loss), grads, receives, [str(a) for a in program], groups


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2)])
def test_receives_posted_ahead_on_gloo_keep_each_peers_order_and_every_number(schedule, v):
    ahead = run_local(posted_ahead_worker, 2, schedule, v, True)
    ordered = run_local(posted_ahead_worker, 2, schedule, v, False)
    for (loss, grads, receives, program, groups), (loss2, grads2, receives2, _, groups2) in \
            zip(ahead, ordered):
        assert loss == loss2 and all(torch.equal(a, b) for a, b in zip(grads, grads2))
        assert receives == receives2 == program  # the one peer's receives in program order
        assert groups != groups2  # ahead: receives go out on their own, before their groups


def status_line_worker():
    import ctypes

    from megapar.faults import status

    mesh = make_mesh(pp=2)
    line = ctypes.create_string_buffer(256)  # the launcher's line, as in a worker
    status.begin(line)
    status.set_step(3)
    executor = PipelineExecutor(ToyStage(mesh), mesh, "1f1b", SHAPE, timeout_s=30)
    seen = []

    def reading(call):
        def read(*args):
            seen.append((line.value.decode(), status.status()))
            return call(*args)
        return read

    executor.handlers = {kind: reading(h) for kind, h in executor.handlers.items()}
    executor.p2p.wait_recv = reading(executor.p2p.wait_recv)
    executor.run(toy_batches(2))
    training = seen[:], line.value.decode()
    seen.clear()
    executor.run(toy_batches(2), forward_only=True)
    return training, (seen, line.value.decode())


def test_the_status_line_names_every_wait_and_compute_of_a_step():
    """The walk publishes each action's pre-encoded text into the shared line; what the
    launcher reads (the line) and what the rank says (status()) name the step and action."""
    (stage0, eval0), (stage1, eval1) = run_local(status_line_worker, 2)
    for seen, _ in (stage0, stage1, eval0, eval1):
        assert all(line == said for line, said in seen), seen
    assert [line for line, _ in stage1[0]] == [
        "step 3, recv_act of micro-batch 0 on pp stage 1 (from rank 0)",
        "step 3, forward of micro-batch 0 on pp stage 1",
        "step 3, backward of micro-batch 0 on pp stage 1",
        "step 3, recv_act of micro-batch 1 on pp stage 1 (from rank 0)",
        "step 3, forward of micro-batch 1 on pp stage 1",
        "step 3, backward of micro-batch 1 on pp stage 1"]
    assert [line for line, _ in stage0[0]][:2] == [
        "step 3, forward of micro-batch 0 on pp stage 0",
        "step 3, forward of micro-batch 1 on pp stage 0"]
    assert stage0[1] == stage1[1] == "step 3, loss broadcast from the last pipeline stage"
    # an evaluation's forwards say so: a rank stopped in one was named with a training action
    assert [line for line, _ in eval1[0]] == [
        "step 3, evaluation: recv_act of micro-batch 0 on pp stage 1 (from rank 0)",
        "step 3, evaluation: forward of micro-batch 0 on pp stage 1",
        "step 3, evaluation: recv_act of micro-batch 1 on pp stage 1 (from rank 0)",
        "step 3, evaluation: forward of micro-batch 1 on pp stage 1"]
    assert eval0[1] == eval1[1] == "step 3, evaluation: loss broadcast from the last pipeline stage"


@pytest.mark.parametrize("loss_scale,m", [(1.0, 3), (8.0, 3), (3.7, 7), (0.3, 3)])
def test_the_losses_are_backpropagated_as_loss_times_scale_over_m_to_the_bit(loss_scale, m):
    """The last stage backpropagates each loss with one gradient made a step (ones / m, times
    the scale): the gradients equal, bit for bit, those of (loss * scale / m).backward() per
    micro-batch in the schedule's order (at 3.7 / 7 and 0.3 / 3, ones * (scale / m) or
    ones * scale / m would differ in the last bit)."""
    mesh = Mesh(Layout())
    stage = ToyStage(mesh)
    batches = toy_batches(m)
    PipelineExecutor(stage, mesh, "1f1b", SHAPE).run(batches, loss_scale=loss_scale)
    got = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad()
    for batch in batches:  # 1F1B on one stage: F0 B0 F1 B1 ...
        (stage(None, batch) * loss_scale / len(batches)).backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(got, stage.parameters()))


class FakeCudaEvent:
    """A CUDA event on a fake device clock that advances 1 ms at every record."""

    now, waited = [0.0], []

    def __init__(self, enable_timing=False):
        self.ms = None

    def record(self):
        FakeCudaEvent.now[0] += 1.0
        self.ms = FakeCudaEvent.now[0]

    def synchronize(self):
        FakeCudaEvent.waited.append(self)

    def elapsed_time(self, other):
        return other.ms - self.ms


def test_a_traced_step_on_cuda_stamps_events_read_only_with_the_timeline(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    FakeCudaEvent.waited.clear()
    mesh = Mesh(Layout())
    executor = PipelineExecutor(ToyStage(mesh), mesh, "1f1b", SHAPE)
    executor.clock = clock = StepClock("cpu")
    clock.cuda, clock.stamp = True, clock._cuda_stamp  # the CUDA path, on fake events
    executor.run(toy_batches(3))
    assert FakeCudaEvent.waited == []  # no wait for the device during the step
    events = executor.last_timeline.events
    assert FakeCudaEvent.waited == [clock._last]  # one wait, for the step's last stamp
    host = clock._origin[0]  # recorded at 1 ms on the device clock
    starts = [round((e.start - host) * 1e3, 6) for e in events]
    ends = [round((e.end - host) * 1e3, 6) for e in events]
    assert [(e.kind, e.mb) for e in events] == [
        ("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1), ("forward", 2),
        ("backward", 2), ("wait", None), ("loss_broadcast", None)]
    # one record per stamp: the walk's start (1), each compute's start and end, one before the
    # last backward's grad_sync call (12), the wait's end (the last compute's end is its start)
    assert list(zip(starts, ends)) == [(2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (13, 14),
                                       (14, 15), (16, 17)]
    assert executor.last_compute_s == pytest.approx(6e-3)
