"""Pipeline schedules as data: structure, send/recv pairing, in-flight bounds, validation."""

import pytest

from megapar.pipeline.schedules import (
    ACTION_KINDS,
    Action,
    format_schedule,
    get_schedule,
    gpipe,
    in_flight_peak,
    one_f_one_b,
)
from megapar.pipeline.simulate import simulate

# Schedules with one chunk per rank and a full backward (the newer ones: test_schedules_new.py).
ONE_CHUNK_BACKWARD = ("1f1b", "gpipe")

GRID = [(pp, m) for pp in (1, 2, 3, 4) for m in sorted({1, 2, pp, 2 * pp + 1})]


def _all_stages(name, pp, m):
    return [get_schedule(name)(pp, m, s) for s in range(pp)]


@pytest.mark.parametrize("name", ONE_CHUNK_BACKWARD)
@pytest.mark.parametrize("pp,m", GRID)
def test_every_microbatch_forwarded_then_backwarded_once(name, pp, m):
    for stage, actions in enumerate(_all_stages(name, pp, m)):
        fwd = [i for i, a in enumerate(actions) if a.kind == "forward"]
        bwd = [i for i, a in enumerate(actions) if a.kind == "backward"]
        assert sorted(actions[i].mb for i in fwd) == list(range(m))
        assert sorted(actions[i].mb for i in bwd) == list(range(m))
        for mb in range(m):
            f = next(i for i in fwd if actions[i].mb == mb)
            b = next(i for i in bwd if actions[i].mb == mb)
            assert f < b, f"stage {stage}: B{mb} before F{mb}"
        assert all(a.chunk == 0 for a in actions)


@pytest.mark.parametrize("name", ONE_CHUNK_BACKWARD)
@pytest.mark.parametrize("pp,m", GRID)
def test_communication_around_compute(name, pp, m):
    for stage, actions in enumerate(_all_stages(name, pp, m)):
        kinds = {a.kind for a in actions}
        assert ("recv_act" in kinds) == (stage > 0)
        assert ("send_grad" in kinds) == (stage > 0)
        assert ("send_act" in kinds) == (stage < pp - 1)
        assert ("recv_grad" in kinds) == (stage < pp - 1)
        for i, a in enumerate(actions):
            if a.kind == "forward":
                if stage > 0:
                    assert actions[i - 1] == Action("recv_act", a.mb)
                if stage < pp - 1:
                    assert actions[i + 1] == Action("send_act", a.mb)
            if a.kind == "backward":
                if stage < pp - 1:
                    assert actions[i - 1] == Action("recv_grad", a.mb)
                if stage > 0:
                    assert actions[i + 1] == Action("send_grad", a.mb)


@pytest.mark.parametrize("name", ONE_CHUNK_BACKWARD)
@pytest.mark.parametrize("pp,m", GRID)
def test_sends_match_receives_per_channel(name, pp, m):
    stages = _all_stages(name, pp, m)

    def mbs(stage, kind):
        return [a.mb for a in stages[stage] if a.kind == kind]

    for s in range(pp - 1):
        # Activations s -> s+1 and gradients s+1 -> s: same micro-batches, same order.
        assert mbs(s, "send_act") == mbs(s + 1, "recv_act")
        assert len(mbs(s, "send_act")) == m
        assert mbs(s + 1, "send_grad") == mbs(s, "recv_grad")
        assert len(mbs(s + 1, "send_grad")) == m


@pytest.mark.parametrize("name", ONE_CHUNK_BACKWARD)
@pytest.mark.parametrize("pp,m", GRID)
def test_all_ranks_finish_in_simulation(name, pp, m):
    timeline = simulate(_all_stages(name, pp, m))
    assert timeline.ranks() == list(range(pp))
    assert sum(e.kind == "backward" for e in timeline.events) == pp * m


@pytest.mark.parametrize("pp,m", GRID)
def test_in_flight_peak(pp, m):
    for stage in range(pp):
        assert in_flight_peak(one_f_one_b(pp, m, stage)) == min(pp - stage, m)
        assert in_flight_peak(gpipe(pp, m, stage)) == m


def test_gpipe_order_spelled_out():
    assert format_schedule(gpipe(2, 2, 0)) == "F0 SA0 F1 SA1 RG0 B0 RG1 B1"
    assert format_schedule(gpipe(2, 2, 1)) == "RA0 F0 RA1 F1 B0 SG0 B1 SG1"


def test_1f1b_phases_spelled_out():
    # pp=3, m=4, stage 0: warmup 2 forwards, 2 steady (F, B) pairs, 2 cooldown backwards.
    assert format_schedule(one_f_one_b(3, 4, 0)) == (
        "F0 SA0 F1 SA1 F2 SA2 RG0 B0 F3 SA3 RG1 B1 RG2 B2 RG3 B3")
    # Last stage: no warmup, strictly alternating.
    assert format_schedule(one_f_one_b(3, 4, 2)) == (
        "RA0 F0 B0 SG0 RA1 F1 B1 SG1 RA2 F2 B2 SG2 RA3 F3 B3 SG3")
    # Fewer micro-batches than the warmup depth: all forwards then all backwards.
    assert format_schedule(one_f_one_b(4, 1, 0)) == "F0 SA0 RG0 B0"


def test_action_str_and_validation():
    assert str(Action("forward", 3)) == "F3"
    assert str(Action("backward", 3)) == "B3"
    assert str(Action("recv_act", 3)) == "RA3"
    assert str(Action("send_grad", 0, chunk=1)) == "SG0@1"
    assert len(ACTION_KINDS) == 8
    with pytest.raises(ValueError, match="unknown action kind"):
        Action("fwd", 0)
    with pytest.raises(ValueError, match="mb >= 0"):
        Action("forward", -1)


@pytest.mark.parametrize("fn", [gpipe, one_f_one_b])
def test_argument_validation(fn):
    with pytest.raises(ValueError, match="pp"):
        fn(0, 4, 0)
    with pytest.raises(ValueError, match="micro-batches"):
        fn(2, 0, 0)
    with pytest.raises(ValueError, match=r"stage must be .* \[0, 2\)"):
        fn(2, 4, 2)
    with pytest.raises(ValueError, match="stage"):
        fn(2, 4, -1)


def test_get_schedule():
    assert get_schedule("gpipe") is gpipe
    assert get_schedule("1f1b") is one_f_one_b
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'.*1f1b, dualpipev, gpipe"):
        get_schedule("zb")


def test_in_flight_peak_counts_backward_input_and_chunks():
    actions = [Action("forward", 0), Action("forward", 0, chunk=1), Action("backward_input", 0, 1),
               Action("forward", 1), Action("backward_weight", 0, 1), Action("backward", 0)]
    # (0,0) and (0,1) in flight -> 2; (0,1) leaves at backward_input; (1,0) joins -> 2 again.
    assert in_flight_peak(actions) == 2
    assert in_flight_peak([]) == 0
