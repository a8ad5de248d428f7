"""ZB-V and DualPipeV as data: torch's own schedules as the reference order, deadlock freedom
over a grid, the in-memory turn, their bubble and in-flight activations, and the refusals."""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
)

from megapar.pipeline import messages
from megapar.pipeline import nccl_rules
from megapar.pipeline.schedules import (
    check_schedule,
    chunks_per_rank,
    format_schedule,
    in_flight_peak,
    peer_of,
    schedule_actions,
    stage_location,
    virtual_stage,
    zb_v,
)
from megapar.pipeline.simulate import Costs, simulate_schedule, theoretical_bubble
from megapar.pipeline.timeline import bubble_stats

COMPUTE = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
V = ("zb-v", "dualpipev")


def torch_order(cls, pp, m):
    """torch's per-rank compute order as (kind letter, micro-batch, chunk) from the class's own
    `_calculate_single_rank_operations` (the constructor needs real stages; the order does not).
    DualPipeV's overlapped F&B actions are listed as their sub-actions, forward first."""
    state = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp,
                            n_local_stages=2)
    out = []
    for rank in range(pp):
        ops = []
        for a in cls._calculate_single_rank_operations(state, rank):
            for s in (a.sub_actions or (a,)) if a is not None else ():
                ops.append((s.computation_type.value, s.microbatch_index,
                            stage_location(s.stage_index, pp, "v")[1]))
                assert stage_location(s.stage_index, pp, "v")[0] == rank
        out.append(ops)
    return out


def ours(name, pp, m):
    return [[(COMPUTE[a.kind], a.mb, a.chunk) for a in schedule_actions(name, pp, m, r)
             if a.kind in COMPUTE] for r in range(pp)]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_orders_equal_torch(pp):
    for m in range(1, 4 * pp + 1):
        assert ours("zb-v", pp, m) == torch_order(ScheduleZBVZeroBubble, pp, m), (pp, m)
        if m >= 2 * pp:
            assert ours("dualpipev", pp, m) == torch_order(ScheduleDualPipeV, pp, m), (pp, m)


def test_deadlock_free_complete_and_nccl_safe_over_a_grid():
    ran = 0
    for name in V:
        for pp in range(2, 9):
            for m in range(2 * pp if name == "dualpipev" else 1, 4 * pp + 1):
                kinds = [e.kind for e in simulate_schedule(name, pp, m, Costs(1, 2)).events]
                assert kinds.count("forward") == 2 * pp * m
                assert kinds.count("backward") + kinds.count("backward_input") == 2 * pp * m
                assert kinds.count("backward_input") == kinds.count("backward_weight")
                if pp <= 4:
                    for forward_only in (False, True):
                        nccl_rules.check_programs(messages.programs(name, pp, m, 1, forward_only),
                                                  name)
                ran += 1
    assert ran == 217  # ZB-V: 140 (pp, m), DualPipeV: 77


def test_the_turn_is_local_and_rank_0_holds_both_ends():
    pp = 3
    for r in range(pp):
        assert virtual_stage(r, 0, pp, "v") == r and virtual_stage(r, 1, pp, "v") == 5 - r
    assert stage_location(0, pp, "v") == (0, 0) and stage_location(5, pp, "v") == (0, 1)
    # rank pp-1 hands virtual stage 2 -> 3 over in memory: no message to itself
    for name in V:
        for r in range(pp):
            for a in schedule_actions(name, pp, 6, r):
                if a.kind in messages.CONSUMERS or a.kind.startswith("send"):
                    assert peer_of(r, a, pp, 2, "v")[0] != r, (name, r, a)
    # pp 2: rank 0 holds virtual stages 0 and 3 (the loss), rank 1 stages 1 and 2; rank 1's
    # F0 -> F0@1 and BI0@1 -> BI0 are the turn, without messages
    assert format_schedule(zb_v(2, 2, 0)) == (
        "F0 SA0 F1 SA1 RA0@1 F0@1 BI0@1 SG0@1 BW0@1 RA1@1 F1@1 BI1@1 SG1@1 BW1@1 RG0 BI0 BW0 RG1 "
        "BI1 BW1")
    assert format_schedule(zb_v(2, 2, 1)) == (
        "RA0 F0 F0@1 SA0@1 RA1 F1 F1@1 SA1@1 RG0@1 BI0@1 BW0@1 BI0 SG0 BW0 RG1@1 BI1@1 BW1@1 BI1 "
        "SG1 BW1")


def test_bubble_and_activations_against_zb_h1_and_1f1b():
    """The issue's command: pp 8, m 32, F 10 ms, B and W 10 ms each. ZB-V halves ZB-H1's bubble
    (6.8 % -> 3.5 %): what is left is the pipeline fill, (pp-1) chunk forwards before the last
    rank can start, which no two-chunk schedule with a synchronous step avoids (the formula).
    Its peak activations are 1F1B's: 2 pp half-stage chunks = pp stages on every rank."""
    costs = Costs(fwd_ms=10, bwd_ms=20)
    bubble = {name: bubble_stats(simulate_schedule(name, 8, 32, costs))["measured_bubble"]
              for name in ("1f1b", "zb-h1", "zb-v", "dualpipev")}
    assert bubble["zb-h1"] == pytest.approx(70 / 1030)
    assert bubble["zb-v"] == pytest.approx(70 / 1990) == pytest.approx(
        theoretical_bubble(8, 32, "zb-v", fwd_ms=10, bwd_input_ms=10, bwd_weight_ms=10))
    assert bubble["zb-v"] <= bubble["zb-h1"] / 1.9 and bubble["dualpipev"] <= bubble["zb-v"]
    one_f_one_b = max(in_flight_peak(schedule_actions("1f1b", 8, 32, s)) for s in range(8))
    for s in range(8):
        assert in_flight_peak(schedule_actions("zb-v", 8, 32, s)) / 2 <= one_f_one_b
        assert in_flight_peak(schedule_actions("dualpipev", 8, 32, s)) / 2 <= one_f_one_b + 0.5



def test_zb_v_reaches_the_fill_from_3p_over_2_micro_batches():
    """At t_F = t_B = t_W ZB-V's bubble is the pipeline fill (`theoretical_bubble`) exactly
    when m >= floor(3 pp / 2), and above it with fewer micro-batches: pp 8, m 8 idles 22.6 %
    against the fill's 12.7 % (the docs said it reached the fill at those costs, whatever m).
    DualPipeV (m >= 2 pp) reaches it at every m it takes."""
    costs = Costs(fwd_ms=1, bwd_ms=2)
    for pp in range(2, 9):
        for m in range(1, 3 * pp + 1):
            fill = theoretical_bubble(pp, m, "zb-v")
            got = bubble_stats(simulate_schedule("zb-v", pp, m, costs))["measured_bubble"]
            assert (got == pytest.approx(fill)) == (m >= 3 * pp // 2) and got >= fill - 1e-12
            if m >= 2 * pp:
                dual = simulate_schedule("dualpipev", pp, m, costs)
                assert bubble_stats(dual)["measured_bubble"] == pytest.approx(fill)
    eight = bubble_stats(simulate_schedule("zb-v", 8, 8, costs))["measured_bubble"]
    assert (round(100 * eight, 1), round(100 * theoretical_bubble(8, 8, "zb-v"), 1)) == (22.6, 12.7)

def test_virtual_stages_on_a_one_chunk_schedule_names_every_schedule_that_takes_them():
    """--virtual-stages 2 with gpipe named only interleaved, though zb-v and dualpipev take 2
    too; a v only interleaved takes names it alone. Both name the fix."""
    with pytest.raises(ValueError) as two:
        chunks_per_rank("gpipe", 2)
    assert str(two.value) == (
        "--virtual-stages 2 with --schedule gpipe (in Python: virtual_stages=2, "
        "schedule='gpipe') needs --schedule interleaved, zb-v or dualpipev: gpipe runs one model "
        "chunk per rank; give one of them, or leave --virtual-stages out (torch's "
        "ScheduleLoopedBFS, GPipe's order over several chunks per rank, is not built)")
    with pytest.raises(ValueError) as three:
        chunks_per_rank("zb-h1", 3)
    assert str(three.value) == (
        "--virtual-stages 3 with --schedule zb-h1 (in Python: virtual_stages=3, "
        "schedule='zb-h1') needs --schedule interleaved: zb-h1 runs one model chunk per rank; "
        "give it, or leave --virtual-stages out (torch's ScheduleInterleavedZeroBubble over "
        "several chunks per rank is not built; zb-v is the zero-bubble schedule with two)")


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="--virtual-stages 3 does not apply to --schedule zb-v"):
        check_schedule("zb-v", 4, 8, 3)
    with pytest.raises(ValueError, match="--virtual-stages 4 does not apply to --schedule "
                                         "dualpipev"):
        chunks_per_rank("dualpipev", 4)
    assert chunks_per_rank("zb-v") == chunks_per_rank("zb-v", 2) == 2
    # the same line serves megapar.prepare(..., schedule="zb-v", virtual_stages=3): both spellings
    with pytest.raises(ValueError, match=r"\(in Python: virtual_stages=3, schedule='zb-v'\).*"
                                         r"leave --virtual-stages / virtual_stages out, or give 2"):
        chunks_per_rank("zb-v", 3)
    with pytest.raises(ValueError, match=r"\(in Python: virtual_stages=2, schedule='1f1b'\) "
                                         r"needs --schedule interleaved, zb-v or dualpipev"):
        chunks_per_rank("1f1b", 2)
    with pytest.raises(ValueError, match="at least 2 x pp = 8 micro-batches.*the zb-v schedule, which takes any m"):
        check_schedule("dualpipev", 4, 7)
    with pytest.raises(ValueError, match="ZB-V needs --pp >= 2"):
        check_schedule("zb-v", 1, 4)


def test_in_flight_column_of_the_schedules_guide():
    """docs/guides/schedules.md's "in flight on stage s": min(m, p - s) under 1F1B and ZB-H1
    (fewer than p - s where m < p), at most 2p chunks per rank under ZB-V, 2p on every rank
    from m = 2p on."""
    for pp in range(2, 7):
        for m in range(1, 3 * pp + 1):
            for name in ("1f1b", "zb-h1"):
                assert [in_flight_peak(schedule_actions(name, pp, m, s)) for s in range(pp)] \
                    == [min(m, pp - s) for s in range(pp)], (name, pp, m)
            zb_v = [in_flight_peak(schedule_actions("zb-v", pp, m, s)) for s in range(pp)]
            assert max(zb_v) <= 2 * pp and (m < 2 * pp or zb_v == [2 * pp] * pp), (pp, m)
