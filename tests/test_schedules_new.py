"""Interleaved 1F1B and ZB-H1: torch's own schedules as the reference order, deadlock freedom
over a grid, hand-computed simulations, constraints, and the split backward (B then W)."""

import contextlib
import itertools
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from megapar.pipeline import backward as split_backward
from megapar.pipeline.schedules import SCHEDULES as SCHEDULE_NAMES
from megapar.pipeline.schedules import (
    check_schedule,
    format_schedule,
    in_flight_peak,
    interleaved_1f1b,
    schedule_actions,
    zb_h1,
)
from megapar.pipeline.simulate import (
    Costs,
    ScheduleError,
    simulate_schedule,
    theoretical_bubble,
    zb_h1_bound,
)
from megapar.pipeline.timeline import bubble_stats
from megapar.plan.pipeline import formula_bubble

COMPUTE = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
NEW = (("interleaved", 2), ("interleaved", 3), ("zb-h1", 1))


def torch_order(cls, pp, m, v):
    """torch's per-rank compute order as (kind letter, micro-batch, chunk), from the schedule
    class's own `_calculate_single_rank_operations` (what its `pipeline_order` is built from;
    the constructor needs real pipeline stages and a process group, the order does not)."""
    rounds = max(1, m // pp)
    state = SimpleNamespace(n_local_stages=v, pp_group_size=pp, _n_microbatches=m,
                            microbatches_per_round=m // rounds)
    return [[(a.computation_type.value, a.microbatch_index, a.stage_index // pp)
             for a in cls._calculate_single_rank_operations(state, rank) if a is not None]
            for rank in range(pp)]


def ours(name, pp, m, v):
    return [[(COMPUTE[a.kind], a.mb, a.chunk) for a in schedule_actions(name, pp, m, r, v)
             if a.kind in COMPUTE] for r in range(pp)]


def torch_single_order(cls, pp, m):
    """torch's per-rank compute order of a one-stage-per-rank schedule, from the class's
    `_get_pipeline_order` (its `pipeline_order`; no stage or process group needed)."""
    order = cls._get_pipeline_order(SimpleNamespace(_num_stages=pp, _n_microbatches=m))
    return [[(a.computation_type.value, a.microbatch_index, 0) for a in order[rank]
             if a is not None and a.computation_type.value in "FB"] for rank in range(pp)]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_gpipe_and_1f1b_equal_torchs_pipeline_order(pp):
    for m in range(1, 4 * pp + 1):
        assert ours("gpipe", pp, m, 1) == torch_single_order(ScheduleGPipe, pp, m), (pp, m)
    # torch's Schedule1F1B.pipeline_order (a picture of the schedule; its run does not read
    # it) numbers the last rank's forwards 1..m and gives m < pp ranks p - 1 - r warmup
    # forwards; its other ranks at m >= pp are the order it runs: Megatron's 1F1B
    for m in range(pp, 4 * pp + 1):
        assert ours("1f1b", pp, m, 1)[:-1] == torch_single_order(Schedule1F1B, pp, m)[:-1], \
            (pp, m)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_equals_torch_interleaved_1f1b(pp, v):
    for m in sorted({pp, 2 * pp, 4 * pp, 1, pp - 1} - {0}):
        assert ours("interleaved", pp, m, v) == torch_order(ScheduleInterleaved1F1B, pp, m, v), \
            (pp, m, v)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zb_h1_equals_torch_zero_bubble_with_one_chunk(pp):
    # torch's ScheduleInterleavedZeroBubble with one stage per rank is ZB-H1 (its docstring
    # cites Qi et al.); its bubble-padding pass only inserts idle slots, never reorders.
    for m in range(1, 4 * pp + 1):
        assert ours("zb-h1", pp, m, 1) == torch_order(ScheduleInterleavedZeroBubble, pp, m, 1), \
            (pp, m)


def test_every_new_schedule_is_deadlock_free_and_complete():
    """The all-rank simulator runs every stage's list for p in 2..8, m in 1..4p; m that a
    schedule cannot take is rejected with a ValueError saying why (and nothing else fails)."""
    ran = rejected = 0
    for name, v in NEW:
        for pp in range(2, 9):
            for m in range(1, 4 * pp + 1):
                try:
                    check_schedule(name, pp, m, v)
                except ValueError as exc:
                    assert "divisible" in str(exc) and name == "interleaved", (name, pp, m)
                    rejected += 1
                    continue
                timeline = simulate_schedule(name, pp, m, Costs(1, 2), v)  # raises on deadlock
                kinds = [e.kind for e in timeline.events]
                backward = "backward" if name == "interleaved" else "backward_input"
                assert kinds.count("forward") == kinds.count(backward) == pp * m * v
                if name == "zb-h1":
                    assert kinds.count("backward_weight") == pp * m
                ran += 1
    assert ran > 250 and rejected > 0


def test_interleaved_rejects_bad_arguments_clearly():
    with pytest.raises(ValueError, match="divisible by 2"):
        interleaved_1f1b(4, 9, 0, 2)
    with pytest.raises(ValueError, match="--virtual-stages >= 2"):
        interleaved_1f1b(4, 8, 0, 1)
    with pytest.raises(ValueError, match="--pp >= 2"):
        interleaved_1f1b(1, 8, 0, 2)
    with pytest.raises(ValueError, match="needs --schedule interleaved"):
        schedule_actions("1f1b", 2, 4, 0, virtual_stages=2)



def test_theoretical_bubble_refuses_a_schedule_it_has_no_formula_for():
    """A misspelt schedule got 1F1B's formula back ("zbh1" at pp 4, m 8: 0.273, where ZB-H1's
    is 0.111); it is a ValueError naming the schedules, as `schedule_actions` says it."""
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zbh1'; valid schedules: "
                                         "1f1b, dualpipev, gpipe, interleaved, zb-h1, zb-v"):
        theoretical_bubble(4, 8, "zbh1")
    assert theoretical_bubble(4, 8, "gpipe") == theoretical_bubble(4, 8, "1f1b") == 3 / 11

def test_other_tools_schedule_names_are_answered_with_megapars():
    """torch's class names, Megatron's and the papers' spellings got only the list of names;
    each known one is named as megapar's schedule, which exists, and others get nothing."""
    from megapar.pipeline.schedules import OTHER_NAMES, schedule_named_elsewhere
    from megapar.training.config import choice_problem

    for theirs, ours in [("ScheduleGPipe", "gpipe"), ("Schedule1F1B", "1f1b"),
                         ("ScheduleInterleaved1F1B", "interleaved --virtual-stages V"),
                         ("ScheduleInterleavedZeroBubble", "zb-h1"), ("ZB_H1", "zb-h1"),
                         ("ScheduleZBVZeroBubble", "zb-v"), ("ScheduleDualPipeV", "dualpipev"),
                         ("PipeDream-Flush", "1f1b")]:
        assert schedule_named_elsewhere(theirs).startswith(
            f"{theirs!r} is megapar's --schedule {ours}"), theirs
    for said in OTHER_NAMES.values():
        if "--schedule " not in said:  # (Megatron's no-pipelining schedule: --pp 1 names none)
            assert said.endswith("there drop --schedule; at --pp 2 or more choose one of its "
                                 "pipelines"), said
            continue
        named = said.split("--schedule ", 1)[1].split()[0]
        assert named in SCHEDULE_NAMES, said
    # Megatron's no-pipelining function was the list of names alone (a bubble tryout)
    assert schedule_named_elsewhere("forward_backward_no_pipelining").startswith(
        "'forward_backward_no_pipelining': Megatron's schedule without a pipeline")
    assert schedule_named_elsewhere("bogus") == ""
    with pytest.raises(ValueError, match="'Schedule1F1B' is megapar's --schedule 1f1b"):
        theoretical_bubble(4, 8, "Schedule1F1B")
    assert choice_problem("schedule", "DualPipeV").endswith(
        "; 'DualPipeV' is megapar's --schedule dualpipev")


def test_spelled_out_orders():
    assert format_schedule(zb_h1(2, 2, 0)) == "F0 SA0 F1 SA1 RG0 BI0 BW0 RG1 BI1 BW1"
    assert format_schedule(zb_h1(2, 2, 1)) == "RA0 F0 BI0 SG0 RA1 F1 BI1 SG1 BW0 BW1"
    # Chunk 1 of the last rank receives from rank 0's chunk 1 and is the model's end (no send).
    assert format_schedule(interleaved_1f1b(2, 2, 1, 2)) == (
        "RA0 F0 SA0 RA1 F1 SA1 RA0@1 F0@1 B0@1 SG0@1 RA1@1 F1@1 B1@1 SG1@1 "
        "RG0 B0 SG0 RG1 B1 SG1")


def test_simulated_interleaved_by_hand():
    # pp=2, m=2, V=2, f=1, b=2 per chunk. Virtual stages r0c0 -> r1c0 -> r0c1 -> r1c1.
    # r0: F0 [0,1] F1 [1,2] F0@1 [2,3] F1@1 [3,4]; r1: F0 [1,2] F1 [2,3] F0@1 [3,4] B0@1 [4,6]
    # F1@1 [6,7] B1@1 [7,9] B0 [9,11] (grad from r0's B0@1 at 8) B1 [11,13];
    # r0: B0@1 [6,8] B1@1 [9,11] B0 [11,13] B1 [13,15]. Step 15 ms, busy 12: bubble 1/5.
    stats = bubble_stats(simulate_schedule("interleaved", 2, 2, Costs(1, 2), 2))
    assert stats["step_time_s"] == pytest.approx(15e-3)
    assert stats["measured_bubble"] == pytest.approx(0.2)
    assert theoretical_bubble(2, 2, "interleaved", 2) == pytest.approx(0.2)
    # fewer micro-batches than stages (megapar runs any m <= pp): the forwards take v pp + m - 1
    # chunk slots, the backwards as many, so the step is (v pp + m - 1)(f + b) and the bubble
    # (v (pp - m) + m - 1) / (v pp + m - 1); the paper's (pp-1) / (v m + pp-1) was below what
    # any schedule reaches (pp 4, m 1: the ranks take turns, 75 % idle; it said 60 %)
    for pp, m, v in [(4, 1, 2), (4, 2, 2), (4, 3, 3), (8, 4, 2), (4, 4, 2)]:
        stats = bubble_stats(simulate_schedule("interleaved", pp, m, Costs(1, 2), v))
        assert stats["step_time_s"] == pytest.approx((v * pp + m - 1) * 3e-3)
        assert theoretical_bubble(pp, m, "interleaved", v) == pytest.approx(
            stats["measured_bubble"]) == pytest.approx((v * (pp - m) + m - 1) / (v * pp + m - 1))
    assert theoretical_bubble(4, 1, "interleaved", 2) == pytest.approx(3 / 4)


def test_simulated_zb_h1_by_hand():
    # pp=2, m=2, F=B=W=1. r0: F0 [0,1] F1 [1,2] BI0 [3,4] BW0 [4,5] BI1 [5,6] BW1 [6,7];
    # r1: F0 [1,2] BI0 [2,3] F1 [3,4] BI1 [4,5] BW0 [5,6] BW1 [6,7]. 7 ms, busy 6: bubble 1/7,
    # the paper's (p-1)(tF+tB-tW) / (m(tF+tB+tW) + (p-1)(tF+tB-tW)) = 1 / 7.
    costs = Costs(fwd_ms=1, bwd_input_ms=1, bwd_weight_ms=1)
    stats = bubble_stats(simulate_schedule("zb-h1", 2, 2, costs))
    assert stats["step_time_s"] == pytest.approx(7e-3)
    assert stats["measured_bubble"] == pytest.approx(1 / 7)
    assert theoretical_bubble(2, 2, "zb-h1", fwd_ms=1, bwd_input_ms=1, bwd_weight_ms=1) == \
        pytest.approx(1 / 7)
    # The issue's case, F = B = 1, W = 2 at pp 4, m 4: the paper's count would be 0 %, but the
    # fill alone leaves 3 ms per stage (15.8 %): no formula is shown.
    stats = bubble_stats(simulate_schedule("zb-h1", 4, 4, Costs(1, bwd_input_ms=1, bwd_weight_ms=2)))
    assert stats["measured_bubble"] == pytest.approx(3 / 19)
    nan = theoretical_bubble(4, 4, "zb-h1", fwd_ms=1, bwd_input_ms=1, bwd_weight_ms=2)
    assert nan != nan


def test_zb_h1_formula_where_it_applies_and_the_bound_everywhere():
    """Over pp x m x (F, B, W): the simulated bubble equals `zb_h1_bound`, (p-1) max(F, B,
    F+B-W) idle per stage, at every m >= pp and is above it below; the paper's formula equals
    the simulator where W <= min(F, B) and m >= pp and is NaN everywhere else (where it would be
    below the bound, as at F = B = 1, W = 2)."""
    grid = (0.5, 1, 2)
    shown = 0
    for pp, m in [(2, 1), (2, 2), (3, 6), (4, 3), (4, 4), (5, 10), (8, 8), (8, 32)]:
        for f, b, w in itertools.product(grid, grid, grid):
            costs = Costs(fwd_ms=f, bwd_input_ms=b, bwd_weight_ms=w)
            got = bubble_stats(simulate_schedule("zb-h1", pp, m, costs))["measured_bubble"]
            bound = zb_h1_bound(pp, m, f, b, w)
            assert got == pytest.approx(bound, abs=1e-12) if m >= pp else got > bound + 1e-4, \
                (pp, m, f, b, w)
            paper = theoretical_bubble(pp, m, "zb-h1", fwd_ms=f, bwd_input_ms=b, bwd_weight_ms=w)
            if m >= pp and w <= min(f, b):
                assert paper == pytest.approx(got, abs=1e-12), (pp, m, f, b, w)
                shown += 1
            else:
                assert paper != paper, (pp, m, f, b, w)  # NaN: "-" in the table
            assert formula_bubble("zb-h1", pp, m, 1, f, b, w) == bound


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_simulated_bubbles_equal_the_formulas(pp, m):
    for name, v in NEW:
        if name == "interleaved" and m % pp:
            continue
        stats = bubble_stats(simulate_schedule(name, pp, m, Costs(1, 2), v))
        assert stats["measured_bubble"] == pytest.approx(
            theoretical_bubble(pp, m, name, v, 1, 1, 1), abs=1e-12), (name, v)
    one = bubble_stats(simulate_schedule("1f1b", pp, m, Costs(1, 2)))["measured_bubble"]
    inter = bubble_stats(simulate_schedule("interleaved", pp, m, Costs(1, 2), 2))
    assert inter["measured_bubble"] < one


def test_in_flight_of_zb_h1_is_1f1bs():
    # ZB-H1 keeps 1F1B's activation memory: at most pp - stage micro-batches in flight.
    for pp, m in [(2, 4), (4, 8), (4, 3)]:
        for s in range(pp):
            assert in_flight_peak(zb_h1(pp, m, s)) == min(pp - s, m)


def _mlp(store=None):
    from megapar.mesh import Layout, Mesh
    from megapar.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megapar.tensor_parallel.weight_grad import attach

    torch.manual_seed(0)
    mesh = Mesh(Layout(1), 0)
    net = torch.nn.Sequential(ColumnParallelLinear(4, 8, mesh), torch.nn.LayerNorm(8),
                              torch.nn.Tanh(), RowParallelLinear(8, 3, mesh))
    for p in net.parameters():
        torch.nn.init.normal_(p)
    assert attach(net, store) == 2
    return net


@pytest.mark.parametrize("autocast", [False, True])
def test_split_backward_equals_backward_and_accumulates_in_place(autocast):
    from megapar.tensor_parallel.weight_grad import WeightGradStore

    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else \
        contextlib.nullcontext
    x = torch.randn(2, 5, 4, requires_grad=True)
    g = torch.randn(2, 5, 3, dtype=torch.bfloat16 if autocast else torch.float32)
    ref = _mlp()
    with ctx():
        ref(x).backward(g)
    want_x, want = x.grad.clone(), [p.grad.clone() for p in ref.parameters()]

    store = WeightGradStore()
    net = _mlp(store)
    params = list(net.parameters())
    existing = [torch.ones_like(p) for p in params]  # e.g. views into a flat buffer
    for p, e in zip(params, existing):
        p.grad = e
    x2 = x.detach().requires_grad_(True)
    store.enabled = True
    with ctx():
        out = net(x2)
        dx, pending = split_backward.backward_input(out, g, x2, store)
    torch.testing.assert_close(dx, want_x, rtol=0, atol=0)
    linear_weights = {id(net[0].weight), id(net[3].weight)}
    for p, w in zip(params, want):  # B: everything but the two linear weights' dW = dY^T X
        if id(p) in linear_weights:
            assert bool((p.grad == 1).all()), "B computed a deferred weight gradient"
        else:
            torch.testing.assert_close(p.grad, w + 1.0, rtol=0, atol=0)
    assert len(pending.entries) == 2 and len(store) == 0
    with ctx():
        split_backward.backward_weight(pending)
    for p, e, w in zip(params, existing, want):
        assert p.grad is e  # accumulated in place
        torch.testing.assert_close(p.grad, w + 1.0, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_split_backward_of_a_model_stage_under_recompute(recompute):
    # Activation checkpointing hands saved tensors back as recomputed stand-ins: W must still
    # add into the parameters' own .grad (it once set .grad on a stand-in under "full").
    from megapar.mesh import Layout, Mesh
    from megapar.models import GPT2Config
    from megapar.pipeline.partition import build_stage
    from megapar.tensor_parallel.weight_grad import WeightGradStore, attach

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": (ids * 3 + 1) % 64}
    ref = build_stage(cfg, Mesh(Layout()), 1, recompute)
    ref(None, batch).backward()
    model, store = build_stage(cfg, Mesh(Layout()), 1, recompute), WeightGradStore()
    assert attach(model, store) == 8
    store.enabled = True
    _, pending = split_backward.backward_input(model(None, batch), None, None, store)
    assert len(pending.entries) == 8
    split_backward.backward_weight(pending)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_disabled_or_absent_store_is_an_ordinary_linear():
    from megapar.tensor_parallel.weight_grad import WeightGradStore

    store = WeightGradStore()  # attached, not enabled: forwards outside a split step
    net = _mlp(store)
    x = torch.randn(3, 4, requires_grad=True)
    net(x).sum().backward()
    assert len(store) == 0 and all(p.grad is not None for p in net.parameters())
    ref = _mlp()
    ref(x.detach().requires_grad_(True)).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_schedule_error_is_raised_for_inconsistent_chunks():
    from megapar.pipeline.simulate import simulate
    stages = [schedule_actions("interleaved", 2, 2, r, 2) for r in range(2)]
    stages[1] = [a for a in stages[1] if not (a.kind == "send_grad" and a.chunk == 1)]
    with pytest.raises(ScheduleError):
        simulate(stages)


def test_messages_pair_in_issue_order_per_rank_pair():
    """NCCL ignores p2p tags: messages between two ranks pair up in issue order. Every schedule
    sends on each directed rank pair (whatever the kind or chunk) in exactly the order the
    receiver receives, so the per-chunk tags gloo uses are a safety net, not a requirement."""
    from megapar.pipeline.schedules import peer_of, placement_of

    for name, v in (("1f1b", 1), ("gpipe", 1)) + NEW:
        for pp in range(2, 9):
            for m in range(1, 4 * pp + 1):
                if name == "interleaved" and m % max(1, m // pp):
                    continue
                sends, recvs = {}, {}
                for r in range(pp):
                    for a in schedule_actions(name, pp, m, r, v):
                        if a.kind.startswith(("send", "recv")):
                            peer, chunk = peer_of(r, a, pp, v, placement_of(name))
                            if a.kind.startswith("send"):
                                sends.setdefault((r, peer), []).append((a.kind[5:], a.mb, chunk))
                            else:
                                recvs.setdefault((peer, r), []).append((a.kind[5:], a.mb, a.chunk))
                assert sends == recvs, (name, v, pp, m)
