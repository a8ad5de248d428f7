"""Pipeline messages follow NCCL's rules: every schedule's groups, and what real steps issue.

NCCL pairs a rank pair's messages in issue order (tags ignored), runs a rank's operations in
order on one stream, and finishes a large send only while its receive runs
(`megapar.pipeline.simulate` models exactly that). The old issue order, every message on its
own where the schedule lists it, deadlocks 1F1B, ZB-H1 and interleaved 1F1B under these rules;
the grouped programs never do, as schedule data and as the operations real steps issue.
"""

import pytest
import torch
from torch import nn
from tp_utils import make_mesh

from megapar.launcher import run_local
from megapar.pipeline import messages
from megapar.pipeline import nccl_rules
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.schedules import (
    MESSAGE_KINDS,
    Action,
    MessageGroup,
    format_schedule,
    placement_of,
    schedule_actions,
    virtual_stage,
)
from megapar.pipeline.simulate import CommMismatchError, DeadlockError

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3),
             ("zb-v", 2), ("dualpipev", 2)]


def one_by_one(schedules) -> list[list]:
    """Each message in a group of its own, where the schedule (or program) lists it: what
    issuing every message with a single ``isend`` / ``irecv`` call does (the old issue order)."""
    return [[MessageGroup((a,)) if a.kind in MESSAGE_KINDS else a
             for step in steps
             for a in (step.messages if isinstance(step, MessageGroup) else (step,))]
            for steps in schedules]


def valid(name, pp, m, v):
    try:
        schedule_actions(name, pp, m, 0, v)
        return True
    except ValueError:
        return False


CASES = [(name, v, pp, m) for name, v in SCHEDULES for pp in (2, 4) for m in range(1, 9)
         if valid(name, pp, m, v)]


@pytest.mark.parametrize("forward_only", [False, True])
def test_every_schedule_is_deadlock_free_and_paired_under_nccl_rules(forward_only):
    for name, v, pp, m in CASES:
        programs = messages.programs(name, pp, m, v, forward_only)
        nccl_rules.check_programs(programs, name)
        for stage, program in enumerate(programs):  # the schedule's compute order is kept
            computes = [a for a in schedule_actions(name, pp, m, stage, v)
                        if a.kind not in ("send_act", "recv_act", "send_grad", "recv_grad")
                        and (not forward_only or a.kind == "forward")]
            assert messages.computes_of(program) == computes, (name, v, pp, m, stage)


def test_the_old_order_deadlocks_under_nccl_rules_and_the_model_says_where():
    """Every message issued alone where the schedule lists it (megapar before grouping)."""
    deadlocked, mispaired = set(), set()
    for name, v, pp, m in CASES:
        old = one_by_one([schedule_actions(name, pp, m, s, v) for s in range(pp)])
        try:
            nccl_rules.check_programs(old, name)
        except DeadlockError:
            deadlocked.add((name, v, pp, m))
        except CommMismatchError:
            mispaired.add((name, v, pp, m))
    # In a V a rank pair carries activations one way for chunk 0 and gradients the same way
    # for chunk 1; listed where the computes are, they do not even pair in order (the
    # programs' global clock puts them in one order on both sides).
    assert {name for name, *_ in mispaired} == {"zb-v", "dualpipev"}
    for pp in (2, 4):
        for m in range(1, 9):
            assert (("1f1b", 1, pp, m) in deadlocked) == (m >= 2), (pp, m)
            assert (("zb-h1", 1, pp, m) in deadlocked) == (m >= 2), (pp, m)
            assert ("gpipe", 1, pp, m) not in deadlocked
        for m in (4, 8):
            assert ("interleaved", 2, pp, m) in deadlocked
    old = one_by_one([schedule_actions("1f1b", 2, 4, s) for s in range(2)])
    with pytest.raises(DeadlockError) as info:
        nccl_rules.check_programs(old)
    assert str(info.value) == (
        "the issued messages deadlock under NCCL's rules: rank 0 blocked in group 1 [SA1]: SA1 "
        "needs rank 1's group 2 [RA1], but rank 1 is at group 1 [SG0]; rank 1 blocked in group "
        "1 [SG0]: SG0 needs rank 0's group 2 [RG0], but rank 0 is at group 1 [SA1]")


def test_1f1b_pairs_as_megatron_does():
    first, last = messages.programs("1f1b", 2, 4)
    assert format_schedule(first) == \
        "F0 [SA0] F1 [SA1 RG0] B0 F2 [SA2 RG1] B1 F3 [SA3 RG2] B2 [RG3] B3"
    assert format_schedule(last) == \
        "[RA0] F0 [RA1] B0 [SG0] F1 B1 [SG1 RA2] F2 B2 [SG2 RA3] F3 B3 [SG3]"
    assert first[3].name == "send_forward_recv_backward"
    assert last[7].name == "send_backward_recv_forward"


def test_a_swapped_or_missing_message_is_named():
    a, b = (list(p) for p in messages.programs("interleaved", 2, 4, 2))
    # rank 1 receives two messages from rank 0 in the other order: NCCL would swap the tensors
    i = next(i for i, s in enumerate(b) if isinstance(s, MessageGroup)
             and [x.kind for x in s.messages] == ["send_act", "recv_act"])
    j = next(j for j in range(i + 1, len(b)) if isinstance(b[j], MessageGroup)
             and any(x.kind == "recv_act" for x in b[j].messages))
    first = next(x for x in b[i].messages if x.kind == "recv_act")
    second = next(x for x in b[j].messages if x.kind == "recv_act")
    b[i] = MessageGroup(tuple(second if x == first else x for x in b[i].messages))
    b[j] = MessageGroup(tuple(first if x == second else x for x in b[j].messages))
    with pytest.raises(CommMismatchError, match=r"message \d+ from rank 0 to rank 1 pairs rank "
                                                r"0's SA.* with rank 1's RA.*wrong tensor"):
        nccl_rules.check_programs([a, b], "interleaved")
    b = [s for s in messages.programs("1f1b", 2, 2)[1] if not (
        isinstance(s, MessageGroup) and s.messages == (Action("send_grad", 1),))]
    with pytest.raises(CommMismatchError, match="rank 0's RG1 .* never paired: rank 1 issues no "
                                                "matching send"):
        nccl_rules.check_programs([messages.programs("1f1b", 2, 2)[0], b])


def test_in_flight_receives_stay_bounded():
    """A receive issued ahead holds a buffer until its compute: at most two per stage in 1F1B
    (one activation, one gradient), whatever m."""
    for m in (4, 16, 64):
        for program in messages.programs("1f1b", 4, m):
            held, most = set(), 0
            for step in program:
                if isinstance(step, MessageGroup):
                    held |= {(a.kind, a.mb) for a in step.messages if a.kind.startswith("recv")}
                    most = max(most, len(held))
                else:
                    held -= {("recv_act", step.mb), ("recv_grad", step.mb)}
            assert most <= 2, (m, most)


# real steps ---------------------------------------------------------------------------------
H = 4


class ToyChunk(nn.Module):
    """tanh(linear(x)); the model's first chunk reads batch["x"], its last returns the loss."""

    def __init__(self, vs, last, hidden=H):
        super().__init__()
        torch.manual_seed(vs)
        self.lin, self.vs, self.last = nn.Linear(hidden, hidden), vs, last

    def forward(self, hidden, batch):
        out = torch.tanh(self.lin(batch["x"] if self.vs == 0 else hidden))
        return ((out - batch["y"]) ** 2).mean() if self.vs == self.last else out


class ToyChunks(nn.Module):
    def __init__(self, mesh, v, hidden=H, placement="loop"):
        super().__init__()
        self.chunks = nn.ModuleList(
            ToyChunk(virtual_stage(mesh.pp_rank, c, mesh.pp, placement), mesh.pp * v - 1, hidden)
            for c in range(v))


def issued_worker(tp, pp, dp):
    mesh = make_mesh(tp, pp, dp)
    out = []
    for name, v in SCHEDULES:
        executor = PipelineExecutor(ToyChunks(mesh, v, placement=placement_of(name)), mesh, name,
                                    (2, H), virtual_stages=v,
                                    timeout_s=60)
        executor.post_ahead = False  # what NCCL issues: the program's order
        executor.p2p.issued = []  # record the groups issued
        for m in range(1, 9):
            if not valid(name, pp, m, v):
                continue
            gen = torch.Generator().manual_seed(m)
            batches = [{"x": torch.randn(2, H, generator=gen),
                        "y": torch.randn(2, H, generator=gen)} for _ in range(m)]
            for forward_only in (False, True):
                executor.run(batches, forward_only=forward_only)
                program = executor.program(m, forward_only)
                groups = [str(s) for s in program if isinstance(s, MessageGroup)]
                issued = executor.p2p.issued
                # what was issued is the program's groups
                assert ["[" + " ".join(op.label for op in g) + "]" for g in issued] == groups
                out.append(((name, v, m, forward_only), mesh.rank,
                            [mesh.stage_rank(s) for s in range(pp)], issued))
    return out


@pytest.mark.parametrize("tp,pp,dp", [(1, 2, 1), (1, 4, 1), (2, 2, 2)])
def test_what_real_steps_issue_follows_nccl_rules(tp, pp, dp):
    results = run_local(issued_worker, tp * pp * dp, tp, pp, dp)
    by_case = {}
    for rank_results in results:
        for case, rank, group, issued in rank_results:
            by_case.setdefault((case, tuple(group)), {})[rank] = issued
    assert len(by_case) == len(results[0]) * tp * dp  # every case in every pipeline group
    for (case, group), streams in by_case.items():
        assert sorted(streams) == sorted(group)
        nccl_rules.check(streams)  # peers are global ranks: each pipeline group on its own
        if case[0] == "1f1b" and case[2] >= 3 and not case[3]:
            with pytest.raises(DeadlockError):  # the model sees real ops: one by one deadlocks
                nccl_rules.check({r: [[op] for g in s for op in g] for r, s in streams.items()})
