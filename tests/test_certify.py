"""The certificate of the pipeline programs (`megapar.pipeline.certify`, `megapar-bubble
--certify`): every schedule of the registry holds over the default grid, real steps issue the
certified groups, and each check fails on a program broken the way it guards against."""

import pytest
from test_nccl_rules import one_by_one

from megapar.cli.bubble import main as bubble
from megapar.pipeline import certify, certify_real, messages
from megapar.pipeline.schedules import (
    SCHEDULES,
    Action,
    MessageGroup,
    format_schedule,
    schedule_actions,
)


def test_the_default_grid_is_certified_for_every_schedule():
    points = certify.grid()
    assert certify.missing_schedules(points) == []
    assert {p[0] for p in points} == set(SCHEDULES)  # new schedules join by registering
    certs = certify.certify_grid(points)
    assert [c.name for c in certs if not c.ok] == []
    assert all(list(c.checks) == list(certify.CHECKS) for c in certs)
    # the numbers are the schedules' own: 1F1B's pp - s, reached (the bound is tight)
    one = certify.certify("1f1b", 4, 8)
    assert one.in_flight == (4, 3, 2, 1) == one.in_flight_bound
    assert (one.pair_sends, one.pair_recvs) == (4, 1)
    inter = certify.certify("interleaved", 4, 8, 2)
    assert inter.in_flight == inter.in_flight_bound == (11, 9, 7, 5)
    assert certify.certify("gpipe", 2, 8, forward_only=True).pair_sends == 8  # nothing acks


def swap_sends(program: list, first: Action, second: Action) -> list:
    """`program` with `first` issued right after `second` (their issue order swapped)."""
    out = []
    for step in program:
        if isinstance(step, MessageGroup):
            kept = [a for a in step.messages if a != first]
            if second in kept:
                kept.insert(kept.index(second) + 1, first)
            if kept:
                out.append(MessageGroup(tuple(kept)))
            continue
        out.append(step)
    return out


def test_two_swapped_sends_fail_the_certificate():
    # 1F1B pp 2 m 4, stage 0: F2 [SA2 RG1] B1 F3 [SA3 RG2]; SA2 goes after SA3: both are
    # produced when issued, but rank 1 receives RA2 first, so NCCL would hand it SA3's tensor
    first, last = (list(p) for p in messages.programs("1f1b", 2, 4))
    broken = swap_sends(first, Action("send_act", 2), Action("send_act", 3))
    assert format_schedule(broken) == \
        "F0 [SA0] F1 [SA1 RG0] B0 F2 [RG1] B1 F3 [SA3 SA2 RG2] B2 [RG3] B3"
    cert = certify.certify_programs([broken, last], "1f1b", 2, 4)
    assert not cert.ok
    assert cert.checks["data order"].ok and cert.checks["computes"].ok
    assert not cert.checks["paired"].ok
    assert "pairs rank 0's SA3" in cert.checks["paired"].detail
    assert "wrong tensor" in cert.checks["paired"].detail
    assert not cert.checks["progress"].ok
    assert "FAIL 1f1b pp=2 m=4: paired: message 2 from rank 0 to rank 1" in \
        certify.format_table([cert])


def test_each_check_can_fail():
    # progress: every message issued on its own where the schedule lists it deadlocks 1F1B
    old = one_by_one([schedule_actions("1f1b", 2, 4, s) for s in range(2)])
    cert = certify.certify_programs(old, "1f1b", 2, 4)
    assert cert.checks["paired"].ok and not cert.checks["progress"].ok
    assert "deadlock under NCCL's rules" in cert.checks["progress"].detail
    # data order: a receive moved after the compute that consumes it
    first, last = (list(p) for p in messages.programs("1f1b", 2, 4))
    group = last.pop(next(i for i, s in enumerate(last) if isinstance(s, MessageGroup)
                          and Action("recv_act", 1) in s.messages))
    late = last[:last.index(Action("forward", 1)) + 1] + [group] + last[
        last.index(Action("forward", 1)) + 1:]
    assert format_schedule(late).startswith("[RA0] F0 B0 [SG0] F1 [RA1] B1")
    cert = certify.certify_programs([first, late], "1f1b", 2, 4)
    assert not cert.checks["data order"].ok
    assert cert.checks["data order"].detail == "rank 1 runs F1 before issuing RA1, the receive " \
                                               "it consumes"
    # activations and pairs: GPipe's programs claimed to be 1F1B's
    cert = certify.certify_programs(messages.programs("gpipe", 2, 4), "1f1b", 2, 4)
    assert not cert.checks["computes"].ok
    assert cert.checks["activations"].detail == (
        "stage 0: 4 micro-batches in flight as the program runs, 2 by the schedule "
        "(in_flight_peak)")
    assert "rank 0 holds 4 sends for one peer, more than the stated 3" in \
        cert.checks["pairs"].detail


def test_an_evaluation_steps_pairs_check_can_fail():
    """In evaluation the bound was C m, the number of sends there are: it could not fail (a
    new-user tryout). Receives are held to A(s) + C there as in training; a rank whose sends no
    message acknowledges holds them to the end, counted and said, not bounded."""
    first, last = (list(p) for p in messages.programs("1f1b", 2, 4, 1, True))
    assert format_schedule(last) == "[RA0] F0 [RA1] F1 [RA2] F2 [RA3] F3"
    early = [MessageGroup(tuple(a for g in last if isinstance(g, MessageGroup)
                                for a in g.messages))] + [a for a in last
                                                          if not isinstance(a, MessageGroup)]
    cert = certify.certify_programs([first, early], "1f1b", 2, 4, forward_only=True)
    assert cert.checks["data order"].ok and cert.checks["progress"].ok, cert.failures
    assert cert.checks["pairs"].detail.startswith(
        "rank 1 holds 4 receives for one peer, more than the stated 2"), cert.checks["pairs"]
    ok = certify.certify("1f1b", 2, 4, forward_only=True).checks["pairs"]
    assert ok.ok and ok.detail == ("at most 4 sends and 1 receives held per peer (sends to the "
                                   "step's end where no message comes back)")
    # a V placement's turn acknowledges them: bounded as in training
    assert certify.certify("zb-v", 2, 16, forward_only=True).checks["pairs"].detail == \
        "at most 3 sends and 2 receives held per peer"


def test_a_schedule_without_a_published_bound_fails(monkeypatch):
    monkeypatch.delitem(certify.IN_FLIGHT_BOUNDS, "zb-h1")
    cert = certify.certify("zb-h1", 2, 4)
    assert cert.checks["paired"].ok and cert.checks["progress"].ok
    assert not cert.ok
    assert "schedule 'zb-h1' states no bound on its activations in flight" in \
        cert.checks["activations"].detail


def test_real_steps_issue_the_certified_groups():
    points = certify.grid(pps=(2, 3), ms=(1, 2, 3, 4, 5))
    certs = certify.certify_grid(points)
    # and one certificate of a broken program: the real step (which runs the real programs)
    # must not match it
    first, last = (list(p) for p in messages.programs("1f1b", 2, 4))
    broken = certify.certify_programs(
        [swap_sends(first, Action("send_act", 2), Action("send_act", 3)), last], "1f1b", 2, 4)
    certify_real.check_real_steps(certs + [broken])
    assert [c.name for c in certs if not c.checks["real step"].ok] == []
    assert "issued groups = the certified ones" in certs[0].checks["real step"].detail
    detail = broken.checks["real step"].detail
    assert not broken.checks["real step"].ok
    assert detail == ("rank 0 issued 5 groups, the program has 5; first difference at group "
                      "2: issued [SA2->1 RG1<-1], certified [RG1<-1]"), detail


def test_cli_certifies_and_exits_1_on_a_failed_check(capsys, monkeypatch):
    assert bubble(["--certify", "--pp", "2", "-m", "3"]) == 0
    out = capsys.readouterr().out
    assert "certificate: every check holds" in out
    assert out.count("|") > 20 and "interleaved" in out and "zb-h1" in out

    real = messages.programs

    def broken(name, pp, m, v=1, forward_only=False):
        programs = [list(p) for p in real(name, pp, m, v, forward_only)]
        if name == "1f1b" and not forward_only:
            programs[0] = swap_sends(programs[0], Action("send_act", 4), Action("send_act", 5))
        return programs

    monkeypatch.setattr(certify.messages, "programs", broken)
    # pp 8: no real steps (they would run the broken programs)
    assert bubble(["--certify", "--pp", "8", "-m", "8", "--schedule", "1f1b"]) == 1
    out = capsys.readouterr().out
    assert "FAIL 1f1b pp=8 m=8: paired" in out and "certificate: FAILED" in out


@pytest.mark.parametrize("argv, message", [
    (["--certify", "--simulate"], "--simulate is not used with --certify"),
    (["--certify", "--tp", "2"], "--tp is not used with --certify"),
    (["--certify", "--pp", "1"], "--pp 1 has no pipeline messages to certify"),
    (["--certify", "--pp", "2", "-m", "5", "--schedule", "interleaved", "--virtual-stages", "2"],
     "m must be divisible by 2; the nearest valid m are 4 and 6"),
])
def test_cli_certify_refuses_in_one_line(capsys, argv, message):
    assert bubble(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.parametrize("argv", [
    ["--certify", "--schedule", "zb-v"],
    ["--certify", "--schedule", "dualpipev", "--pp", "2"],
    ["--certify", "--schedule", "1f1b", "-m", "4", "--pp", "2"],
])
def test_cli_certify_narrowed_by_schedule_names_no_other(capsys, argv):
    # --schedule narrows the grid: the schedules not asked for are neither failed nor named
    assert bubble(argv) == 0
    out = capsys.readouterr().out
    named = argv[argv.index("--schedule") + 1]
    assert "certificate: every check holds" in out
    assert "FAIL" not in out and "not certified" not in out
    rows = [line.split()[0] for line in out.splitlines()[2:] if line.count("|") >= 2]
    assert rows and set(rows) == {named}


def test_cli_certify_shows_the_chunks_a_v_schedule_holds(capsys):
    # zb-v and dualpipev hold 2 chunks per rank whether --virtual-stages is left out or is 2
    tables = []
    for extra in ([], ["--virtual-stages", "2"]):
        assert bubble(["--certify", "--pp", "2", "-m", "4", "--schedule", "zb-v", *extra]) == 0
        tables.append([line.split()[:3] for line in capsys.readouterr().out.splitlines()
                       if line.startswith("zb-v")])
    assert tables[0] == tables[1] == [["zb-v", "2", "2"]]
    assert bubble(["--certify", "--pp", "2", "-m", "4"]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0] in ("1f1b", "zb-v", "dualpipev")}
    assert rows == {"1f1b": "1", "zb-v": "2", "dualpipev": "2"}
    assert certify.certify("dualpipev", 2, 4).name == "dualpipev V=2 pp=2 m=4"


def test_cli_certify_size_limit_counts_each_schedules_own_chunks(capsys):
    # 1f1b holds one chunk per rank: pp 2 x m 5,000 is 20,000 actions, certified, not refused
    # as if it held the grid's V 3 (60,000 actions, naming a --virtual-stages never given)
    assert bubble(["--certify", "--pp", "2", "-m", "5000", "--schedule", "1f1b"]) == 0
    assert "certificate: every check holds" in capsys.readouterr().out
    # zb-v holds two: 2 x 2 x 20,000 x 2 = 160,000 actions, refused naming them and the fix
    assert bubble(["--certify", "--pp", "2", "-m", "20000", "--schedule", "zb-v"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "--certify: zb-v at --pp 2 x --microbatches 20000 x 2 model chunks per rank is "
        "160,000 actions, more than megapar-bubble certifies in seconds (50,000); give a "
        "smaller --microbatches or --pp"), err
    assert "\n" not in err and "virtual-stages" not in err
