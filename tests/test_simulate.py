"""The process-free pipeline simulator: hand-computed step times, exact bubbles, broken schedules."""

import pytest

from megapar.pipeline.schedules import Action, gpipe, schedule_actions
from megapar.pipeline.simulate import (
    CommMismatchError,
    Costs,
    DeadlockError,
    action_times,
    simulate,
    simulate_schedule,
    theoretical_bubble,
)
from megapar.pipeline.timeline import bubble_stats

# Schedules with one chunk per rank and a full backward (the newer ones: test_schedules_new.py).
ONE_CHUNK_BACKWARD = ("1f1b", "gpipe")


def _parse(text):
    """'F0 SA0 RG0' -> actions (test shorthand)."""
    kinds = {"F": "forward", "B": "backward", "RA": "recv_act", "SA": "send_act",
             "RG": "recv_grad", "SG": "send_grad"}
    out = []
    for tok in text.split():
        head = tok.rstrip("0123456789")
        out.append(Action(kinds[head], int(tok[len(head):])))
    return out


@pytest.mark.parametrize("name", ONE_CHUNK_BACKWARD)
def test_pp2_m2_no_latency_by_hand(name):
    # fwd=1, bwd=2, p2p=0, pp=2, m=2.
    # GPipe: stage0 F0[0,1] F1[1,2]; stage1 F0[1,2] F1[2,3] B0[3,5] B1[5,7];
    #        stage0 B0[5,7] B1[7,9]                                        -> step 9 ms.
    # 1F1B:  stage0 F0[0,1] F1[1,2]; stage1 F0[1,2] B0[2,4] F1[4,5] B1[5,7];
    #        stage0 B0[4,6] B1[7,9]                                        -> step 9 ms.
    # Each stage computes 2*(1+2) = 6 ms, so each is idle 3 ms: bubble 1/3 = (2-1)/(2+2-1).
    timeline = simulate_schedule(name, 2, 2, Costs(fwd_ms=1, bwd_ms=2, p2p_ms=0))
    stats = bubble_stats(timeline)
    assert stats["step_time_s"] == pytest.approx(9e-3, rel=1e-12)
    for row in stats["per_rank"]:
        assert row["busy_s"] == pytest.approx(6e-3, rel=1e-12)
        assert row["bubble"] == pytest.approx(1 / 3, rel=1e-12)


def test_pp2_m2_with_latency_by_hand():
    costs = Costs(fwd_ms=1, bwd_ms=2, p2p_ms=0.5)
    # GPipe: stage0 F0[0,1] F1[1,2] (acts arrive 1.5, 2.5); stage1 F0[1.5,2.5] F1[2.5,3.5]
    #        B0[3.5,5.5] B1[5.5,7.5] (grads arrive 6, 8); stage0 B0[6,8] B1[8,10] -> 10 ms.
    gp = simulate_schedule("gpipe", 2, 2, costs)
    assert gp.step_time == pytest.approx(10e-3, rel=1e-12)
    # 1F1B: stage1 F0[1.5,2.5] B0[2.5,4.5] F1[4.5,5.5] B1[5.5,7.5] (grads arrive 5, 8);
    #       stage0 F0[0,1] F1[1,2] B0[5,7] B1[8,10] -> 10 ms.
    ofob = simulate_schedule("1f1b", 2, 2, costs)
    assert ofob.step_time == pytest.approx(10e-3, rel=1e-12)
    b0 = [e for e in ofob.events if e.rank == 0 and e.kind == "backward"]
    assert [(e.mb, e.start, e.end) for e in b0] == [
        (0, pytest.approx(5e-3), pytest.approx(7e-3)), (1, pytest.approx(8e-3), pytest.approx(10e-3))]
    # The blocking recv on stage 0 waits from the end of F1 (2 ms) until RG0 arrives (5 ms).
    rg0 = next(e for e in ofob.events if e.rank == 0 and e.kind == "recv_grad" and e.mb == 0)
    assert (rg0.start, rg0.end) == (pytest.approx(2e-3), pytest.approx(5e-3))


@pytest.mark.parametrize("name", ONE_CHUNK_BACKWARD)
@pytest.mark.parametrize("pp", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
@pytest.mark.parametrize("fwd,bwd", [(1, 1), (1, 2), (3, 1)])
def test_bubble_is_exactly_theoretical_without_latency(name, pp, m, fwd, bwd):
    # With p2p=0 and equal stages, both schedules take (m+pp-1)*(fwd+bwd), for ANY fwd/bwd ratio:
    # GPipe: the last stage finishes forwards at (m+pp-1)*fwd; gradients then ripple back one
    # bwd per stage, so stage 0 ends its last backward (m+pp-1)*bwd later. 1F1B reorders the same
    # dependency chains and has the same critical path. Each stage computes m*(fwd+bwd), so every
    # stage's bubble is exactly (pp-1)/(m+pp-1).
    timeline = simulate_schedule(name, pp, m, Costs(fwd_ms=fwd, bwd_ms=bwd, p2p_ms=0))
    stats = bubble_stats(timeline)
    assert stats["step_time_s"] == pytest.approx((m + pp - 1) * (fwd + bwd) / 1e3, rel=1e-12)
    for row in stats["per_rank"]:
        assert row["bubble"] == pytest.approx(theoretical_bubble(pp, m), rel=1e-9, abs=1e-12)
    assert stats["measured_bubble"] == pytest.approx(theoretical_bubble(pp, m), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gpipe_latency_adds_one_round_trip(pp, m):
    # GPipe with latency c: the forward wave crosses pp-1 links and the backward wave crosses
    # them again, each once on the critical path: (m+pp-1)*(f+b) + 2*(pp-1)*c.
    f, b, c = 1.0, 2.0, 0.25
    timeline = simulate_schedule("gpipe", pp, m, Costs(fwd_ms=f, bwd_ms=b, p2p_ms=c))
    assert timeline.step_time == pytest.approx(((m + pp - 1) * (f + b) + 2 * (pp - 1) * c) / 1e3)


def test_1f1b_steady_state_pays_latency_every_round():
    # In 1F1B stage 0 waits for each gradient in steady state, so latency is on the critical path
    # more than once: with many micro-batches it is slower than GPipe under the same latency.
    costs = Costs(fwd_ms=1, bwd_ms=2, p2p_ms=0.25)
    assert (simulate_schedule("1f1b", 4, 8, costs).step_time
            > simulate_schedule("gpipe", 4, 8, costs).step_time)


def test_send_cost_delays_sender():
    # pp=2, m=1, send_ms=0.5, p2p=0: stage0 F0[0,1] SA0[1,1.5]; stage1 F0[1.5,2.5] B0[2.5,4.5]
    # SG0[4.5,5]; stage0 B0[5,7] -> 7 ms.
    timeline = simulate_schedule("gpipe", 2, 1, Costs(fwd_ms=1, bwd_ms=2, send_ms=0.5))
    assert timeline.step_time == pytest.approx(7e-3)


def test_cycle_raises_deadlock():
    # Stage 0 waits for a gradient before it ever forwards; stage 1 waits for the activation.
    schedules = [_parse("RG0 F0 SA0 B0"), _parse("RA0 F0 B0 SG0")]
    with pytest.raises(DeadlockError, match=r"stage 0 blocked at RG0.*stage 1 blocked at RA0"):
        simulate(schedules)


def test_order_mismatch_on_channel():
    schedules = [_parse("F1 SA1 F0 SA0 RG0 B0 RG1 B1"), gpipe(2, 2, 1)]
    with pytest.raises(CommMismatchError, match="order mismatch.*SA1.*RA0"):
        simulate(schedules)


def test_unreceived_send():
    schedules = [_parse("F0 SA0 F1 SA1 RG0 B0"), _parse("RA0 F0 B0 SG0")]
    with pytest.raises(CommMismatchError, match=r"sent 2 act messages to stage 1.*received only 1.*SA1"):
        simulate(schedules)


def test_receive_without_send():
    schedules = [_parse("F0 SA0 RG0 B0 RG1"), _parse("RA0 F0 B0 SG0")]
    with pytest.raises(CommMismatchError, match="stage 0 waits for RG1.*stage 1 finished"):
        simulate(schedules)


def test_missing_peer():
    with pytest.raises(CommMismatchError, match="no stage 1"):
        simulate([_parse("F0 SA0 B0")])
    with pytest.raises(CommMismatchError, match="no stage -1"):
        simulate([_parse("RA0 F0 B0")])


def test_theoretical_bubble():
    assert theoretical_bubble(1, 5) == 0.0
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError):
        theoretical_bubble(0, 1)
    with pytest.raises(ValueError, match="at least one"):
        simulate([])


def test_stages_with_their_own_costs_by_hand():
    """pp=2, m=1, 1F1B: stage 0 F=1 B=2, stage 1 F=3 B=4 (e.g. it has the LM head), p2p 0.5.
    F0 [0, 1]; F1 [1.5, 4.5]; B1 [4.5, 8.5]; B0 [9, 11]: step 11, stage 0 busy 3, stage 1 busy 7."""
    from megapar.pipeline.simulate import Costs, simulate_schedule
    from megapar.pipeline.timeline import bubble_stats

    costs = [Costs(fwd_ms=1, bwd_ms=2, p2p_ms=0.5), Costs(fwd_ms=3, bwd_ms=4, p2p_ms=0.5)]
    stats = bubble_stats(simulate_schedule("1f1b", 2, 1, costs))
    assert stats["step_time_s"] == pytest.approx(11e-3)
    assert [r["busy_s"] for r in stats["per_rank"]] == pytest.approx([3e-3, 7e-3])
    with pytest.raises(ValueError, match="2 per-stage costs for 3 stages"):
        simulate_schedule("1f1b", 3, 1, costs)


def test_measured_stage_costs_are_each_stages_own():
    from megapar.pipeline.timeline import Event, Timeline
    from megapar.training.bubble import stage_costs

    ms = 1e-3
    timeline = Timeline([Event(0, "forward", 0, 0, 1 * ms), Event(1, "forward", 0, 1 * ms, 4 * ms),
                         Event(1, "backward_input", 0, 4 * ms, 6 * ms),
                         Event(1, "backward_weight", 0, 6 * ms, 9 * ms),
                         Event(0, "backward_input", 0, 9 * ms, 9 * ms),
                         Event(0, "backward_weight", 0, 9 * ms, 14 * ms)])
    first, last = stage_costs(timeline, 0.25)
    assert first == pytest.approx({"fwd_ms": 1, "bwd_ms": 5, "p2p_ms": 0.25, "bwd_input_ms": 0,
                                   "bwd_weight_ms": 5})
    assert last == pytest.approx({"fwd_ms": 3, "bwd_ms": 5, "p2p_ms": 0.25, "bwd_input_ms": 2,
                                  "bwd_weight_ms": 3})


def test_costs_per_chunk():
    """A stage's costs may be one per model chunk (the LM head on the last virtual stage makes
    that chunk dearer): equal chunk costs give the stage's timeline, and a dearer chunk adds
    its extra work m times to its rank's busy time and lengthens the step."""
    pp, m, v = 2, 4, 2
    plain = Costs(1.0, 2.0)
    same = [[plain, plain] for _ in range(pp)]
    assert action_times([schedule_actions("interleaved", pp, m, s, v) for s in range(pp)],
                        same) == action_times(
        [schedule_actions("interleaved", pp, m, s, v) for s in range(pp)], plain)
    dear = [[plain, plain], [plain, Costs(2.0, 4.0)]]  # rank 1's chunk 1: the last stage
    base = bubble_stats(simulate_schedule("interleaved", pp, m, plain, v))
    head = bubble_stats(simulate_schedule("interleaved", pp, m, dear, v))
    extra = m * (1.0 + 2.0) / 1e3  # seconds
    assert head["per_rank"][1]["busy_s"] == pytest.approx(base["per_rank"][1]["busy_s"] + extra)
    assert head["per_rank"][0]["busy_s"] == pytest.approx(base["per_rank"][0]["busy_s"])
    assert head["step_time_s"] >= base["step_time_s"] + extra
