"""Fault injection: a killed launcher, killed / stopped workers, signals, NaN runs, requeue.

Runs of `megapar-train` are forked from the test process (`os.fork` + `main(argv)`), so the
launcher is a real process the test can signal; its workers are forked from it.
"""

import ctypes
import json
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from forked import fork_running, join_or_kill

from megapar.cli.train import main
from megapar.data import asset_path
from megapar.faults import status as rank_status
from megapar.faults.stop import NonFiniteError, NonFiniteGuard
from megapar.optim import DynamicLossScaler
from megapar.launcher import WorkerError, run_local

TINY = ["--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--warmup-steps", "1",
        "--tokenizer", "sentencepiece"]


@pytest.fixture
def private_tmpdir(tmp_path, monkeypatch):
    """A TMPDIR of this test's own: launchers and ranks started by other tests at the same
    time (pytest -n 2) remove the stale stack and stopped-rank directories they find in
    theirs, which would take the ones a test here checks are left behind."""
    import tempfile

    path = tmp_path / "tmpdir"
    path.mkdir()
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


@pytest.fixture(scope="module")
def common(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    text = d / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:30_000])
    model = d / "m.json"
    model.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
                                 "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                 "attn_pdrop": 0.0}))
    return ["--model", str(model), "--data", str(text), "--data-cache", str(d / "cache"), *TINY]


def _fork_main(argv, out: Path) -> int:
    """Run `megapar-train argv` in a forked child (stdout/stderr to `out`); returns its pid."""
    return fork_running(lambda: main(argv), out)


def _wait_for(cond, timeout=120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        out += [int(k) for k in kids]
    return out


def _steps(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [json.loads(x)["step"] for x in log.read_text().splitlines() if x.strip()]


def _losses(log: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in log.read_text().splitlines()]


def test_sigkill_of_the_launcher_kills_its_workers_and_nothing_is_saved_after(tmp_path, common,
                                                                             private_tmpdir):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    pid = _fork_main([*common, "--tp", "2", "--max-steps", "400", "--save", str(ckpt),
                      "--save-interval", "1", "--log-json", str(log)], tmp_path / "out")
    assert _wait_for(lambda: (ckpt / "step_00000002").exists()), (tmp_path / "out").read_text()
    workers = _children(pid)
    assert len([w for w in workers if _alive(w)]) >= 2
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    killed_at = time.time()  # the launcher is gone (reaped): its workers were sent SIGKILL
    assert _wait_for(lambda: not any(_alive(w) for w in workers), timeout=5.0), \
        "workers outlived their launcher"
    time.sleep(1.0)
    late = [p.name for p in ckpt.iterdir() if p.stat().st_mtime > killed_at + 0.02]
    assert late == [], f"written after the launcher died: {late}"
    # its stack directory (TMPDIR/megapar-stacks-<pid>-*) outlives it, until the next launch
    import glob
    import tempfile

    left = glob.glob(os.path.join(tempfile.gettempdir(), f"megapar-stacks-{pid}-*"))
    assert left, "the killed launcher had a stack directory"
    run_local(_listening, 2)
    assert not any(os.path.exists(p) for p in left)


def test_sigterm_saves_exits_0_and_the_resumed_run_matches(tmp_path, common):
    args = [*common, "--pp", "2", "--lr-decay", "constant", "--max-steps", "8"]
    full = tmp_path / "full.jsonl"
    assert main([*args, "--log-json", str(full)]) == 0
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    pid = _fork_main([*args, "--save", str(ckpt), "--log-json", str(first)], tmp_path / "out")
    assert _wait_for(lambda: len(_steps(first)) >= 2)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    out = (tmp_path / "out").read_text()
    assert os.waitstatus_to_exitcode(status) == 0, out
    stopped = _steps(first)[-1]
    # the launcher forwards the signal to both ranks; the step's check may see one of them
    # only ("SIGTERM on rank 1 received": a CI run's)
    said = rf"SIGTERM( on rank \d| on 1 of 2 ranks)? received: stopping at step {stopped}\n"
    assert stopped < 8 and re.search(said, out), out
    assert (ckpt / "latest").read_text().strip() == f"step_{stopped:08d}"
    assert main([*args, "--load", str(ckpt), "--log-json", str(second)]) == 0
    assert _steps(second) == list(range(stopped + 1, 9))
    assert _losses(first) + _losses(second) == _losses(full)


@pytest.mark.parametrize("layout, interval", [([], "0"), (["--tp", "2"], "2")])
def test_a_sigterm_no_exit_signal_names_aborts_leaving_no_lock_nor_empty_save(
        tmp_path, common, layout, interval):
    """--exit-signals "": a SIGTERM is no clean stop, and it killed the run by its default
    action (exit -15), leaving --save's lock file behind, in a --save holding nothing else (the
    next run took the lock over with a note). Now it aborts as a second SIGINT does: one line,
    exit 143, the lock released, a --save this run made and saved nothing in removed, and the
    checkpoints saved before the signal (--save-interval 2) kept, with no staging left."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    pid = _fork_main([*common, *layout, "--max-steps", "200", "--save", str(ckpt),
                      "--save-interval", interval, "--exit-signals", "", "--log-json", str(log)],
                     tmp_path / "out")
    assert _wait_for(lambda: len(_steps(log)) >= 3)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    out = (tmp_path / "out").read_text()
    assert os.waitstatus_to_exitcode(status) == 143, out
    line = "megapar-train: aborted (SIGTERM, which --exit-signals '' does not name, so no save"
    assert line in out and "Traceback" not in out, out
    if interval == "0":
        assert not ckpt.exists(), sorted(p.name for p in ckpt.iterdir())
        assert "at the stop): nothing saved" in out
        return
    latest = (ckpt / "latest").read_text().strip()
    assert sorted(p.name for p in ckpt.iterdir() if p.name != "logs") == sorted(
        ["latest", *(f"step_{s:08d}" for s in range(2, int(latest[5:]) + 1, 2))])
    assert f"{ckpt}/latest is {latest}, the checkpoint to resume from" in out


def test_a_sighup_aborts_saying_so_and_releases_the_lock(tmp_path, common):
    """A closed terminal's SIGHUP (and SIGQUIT, SIGUSR2) killed megapar-train by its default
    action: nothing printed, exit -1, --save's lock left behind (a fault drill's finding). It
    aborts as an unnamed SIGTERM does: one line naming it and how to save at it, exit 129, the
    lock released, the checkpoints saved before it kept."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    pid = _fork_main([*common, "--tp", "2", "--max-steps", "200", "--save", str(ckpt),
                      "--save-interval", "2", "--log-json", str(log)], tmp_path / "out")
    assert _wait_for(lambda: len(_steps(log)) >= 3)
    os.kill(pid, signal.SIGHUP)
    _, status = os.waitpid(pid, 0)
    out = (tmp_path / "out").read_text()
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGHUP, out
    assert ("megapar-train: aborted (SIGHUP, which --exit-signals 'SIGTERM,SIGUSR1' does not "
            "name, so no save at the stop; name it there to save): ") in out, out
    assert "Traceback" not in out and not (ckpt / "megapar.lock").exists(), out
    latest = (ckpt / "latest").read_text().strip()
    assert f"{ckpt}/latest is {latest}, the checkpoint to resume from" in out


def test_first_sigint_saves_with_a_message(tmp_path, common, monkeypatch):
    """A first SIGINT stops the run at its step's end and saves, saying so; the same SIGINT
    again (as `timeout -s INT` sends it) is not a second one. In order, not by a sleep: the
    repeat is sent once the first has reached the launcher and the ranks (their save waits for
    it), within a window as long as the test (its 1 s is held by
    `test_an_interrupt_delivered_twice_is_one_and_a_later_one_aborts`). Sent 0.05 s after the
    first, on a loaded machine it came over 1 s late (a second Ctrl-C: abort, exit 130) or after
    the run had put back its handlers (a KeyboardInterrupt)."""
    import megapar.checkpoint.distributed as cd
    from megapar.faults import stop

    saving, repeated = tmp_path / "saving", tmp_path / "repeated"
    write_tensors = cd.write_tensors

    def after_the_repeat(path, tensors):  # in the ranks (forked): the interrupt's save
        saving.touch()
        assert _wait_for(repeated.exists, timeout=60.0)
        return write_tensors(path, tensors)

    monkeypatch.setattr(cd, "write_tensors", after_the_repeat)
    monkeypatch.setattr(stop, "SAME_INTERRUPT_S", 3600.0)  # the forked launcher's and ranks'
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    pid = _fork_main([*common, "--tp", "2", "--max-steps", "200", "--save", str(ckpt),
                      "--log-json", str(log)], tmp_path / "out")
    assert _wait_for(lambda: len(_steps(log)) >= 1)
    os.kill(pid, signal.SIGINT)
    assert _wait_for(saving.exists)  # forwarded, taken by the ranks: they stopped and save
    os.kill(pid, signal.SIGINT)  # the same SIGINT again, into the launcher's handler
    repeated.touch()
    _, status = os.waitpid(pid, 0)
    out = (tmp_path / "out").read_text()
    assert os.waitstatus_to_exitcode(status) == 0, out
    assert "KeyboardInterrupt" not in out and "aborted" not in out, out
    step = _steps(log)[-1]
    assert f"interrupted at step {step}, saving" in out
    assert (ckpt / f"step_{step:08d}" / "manifest.json").exists()
    # said at once by rank 0 alone, before the step ends (a long step said nothing until its
    # end, and a user pressing Ctrl-C again aborted the save: a re-test's finding)
    said = ("megapar-train: interrupt received: the run stops at the end of this step, then "
            "saves; Ctrl-C again aborts without saving")
    assert out.count(said) == 1 and out.index(said) < out.index("interrupted at step"), out


@pytest.mark.parametrize("where, sig", [("plan_run", "SIGTERM"), ("run_workers", "SIGTERM"),
                                        ("plan_run", "SIGHUP")])
def test_a_sigterm_while_starting_is_one_line_and_exit_143(tmp_path, common, monkeypatch, where,
                                                           sig):
    """A SIGTERM while megapar-train prepares its run (plan_run: e.g. tokenizing --data, no
    worker yet) killed it without a word (exit -15, a partial .bin.tmp left in --data-cache),
    where a Ctrl-C there says "aborted (SIGINT while starting)". So did one a moment later
    (run_workers: the run planned, --save's lock taken, the launcher not yet forwarding signals
    to the workers it starts; a new user's `timeout -s TERM 2`), which left --save holding only
    its lock. A SIGHUP there (a closed terminal) killed it silently, a cache's .bin.tmp left
    (a re-test): the same, exit 129."""
    import megapar.cli.train as train_cli

    real = getattr(train_cli, where)
    signum = getattr(signal, sig)

    def then_sigterm(*args, **kwargs):
        if where == "plan_run":
            real(*args, **kwargs)
        os.kill(os.getpid(), signum)
        time.sleep(5)

    monkeypatch.setattr(train_cli, where, then_sigterm)
    pid = _fork_main([*common, "--max-steps", "2", "--save", str(tmp_path / "ckpt")],
                     tmp_path / "out")
    _, status = os.waitpid(pid, 0)
    out = (tmp_path / "out").read_text()
    assert os.waitstatus_to_exitcode(status) == 128 + signum, out
    assert out.strip().splitlines()[-1] == (
        f"megapar-train: aborted ({sig} while starting): nothing saved"), out
    assert "Traceback" not in out and not (tmp_path / "ckpt").exists()


def test_a_sigterm_after_the_rank_in_this_process_trained_names_its_step(tmp_path, common,
                                                                          monkeypatch):
    """Under torchrun a rank killed mid-run left rank 0 saying "aborted (SIGTERM while
    starting)" after 50 steps (torchrun's SIGTERM to every rank came while rank 0 reported the
    lost connection; a re-test): the line names the step and action it was at, and that the
    launcher stops every rank when one fails."""
    import megapar.cli.train as train_cli
    from megapar.faults import status

    def trained_then_sigterm(*args, **kwargs):  # a torchrun rank in this process
        status.begin()
        status.set_step(51)
        status.set_action("all-reduce of the gradients")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    monkeypatch.setattr(train_cli, "run_workers", trained_then_sigterm)
    monkeypatch.setattr(train_cli, "under_launcher", lambda: True)
    pid = _fork_main([*common, "--max-steps", "2"], tmp_path / "out")
    _, code = os.waitpid(pid, 0)
    out = (tmp_path / "out").read_text()
    assert os.waitstatus_to_exitcode(code) == 143, out
    assert out.strip().splitlines()[-1] == (
        "megapar-train: aborted (SIGTERM at step 51, all-reduce of the gradients, as the "
        "launcher stops every rank when one fails: see the others' lines): nothing saved"), out


def test_a_sigint_after_a_step_just_saved_does_not_promise_another_save(tmp_path, common):
    """--save-interval 1: the step the SIGINT stops after is saved already, so no "saving"
    is followed by no "saved" line; the message says that step was saved."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    pid = _fork_main([*common, "--max-steps", "200", "--save", str(ckpt), "--save-interval",
                      "1", "--log-json", str(log)], tmp_path / "out")
    assert _wait_for(lambda: len(_steps(log)) >= 1)
    os.kill(pid, signal.SIGINT)
    _, status = os.waitpid(pid, 0)
    out = (tmp_path / "out").read_text()
    assert os.waitstatus_to_exitcode(status) == 0, out
    step = _steps(log)[-1]
    assert f"interrupted at step {step}, saving" not in out, out
    assert f"interrupted at step {step} (saved just before: {ckpt}/step_{step:08d})" in out, out
    assert (ckpt / "latest").read_text().strip() == f"step_{step:08d}"


def _stop_reason_when_signalled(signame, ranks):
    from megapar.faults import stop

    if dist.get_rank() in ranks:  # `signame`: one name, or {rank: name}
        name = signame if isinstance(signame, str) else signame[dist.get_rank()]
        stop._on_signal(signal.Signals[name].value, None)
    try:
        return stop.StopRequests().reason(7)
    finally:
        stop._requested.update(reason="")


def test_a_stop_names_the_rank_and_the_signal_it_came_from():
    """A signal delivered to one rank only (a node's preemption notice, an operator's kill)
    stops every rank, each naming that rank, rank 0 too: it said only 'a signal on another
    rank received', and later, signalled alone itself, what a signal to every rank says."""
    said = run_local(_stop_reason_when_signalled, 3, "SIGUSR1", (1,))
    assert said == ["SIGUSR1 on rank 1 received: stopping at step 7"] * 3, said
    said = run_local(_stop_reason_when_signalled, 3, "SIGTERM", (0,))
    assert said == ["SIGTERM on rank 0 received: stopping at step 7"] * 3, said
    said = run_local(_stop_reason_when_signalled, 3, "SIGTERM", (0, 2))
    assert said == ["SIGTERM on 2 of 3 ranks received: stopping at step 7"] * 3, said
    said = run_local(_stop_reason_when_signalled, 3, "SIGTERM", (0, 1, 2))
    assert said == ["SIGTERM received: stopping at step 7"] * 3, said
    said = run_local(_stop_reason_when_signalled, 2, "SIGINT", (0, 1))
    assert said == ["interrupted at step 7, saving"] * 2, said
    # two signals: both named (their numbers' mean named SIGABRT, 2 and 10 over two ranks)
    said = run_local(_stop_reason_when_signalled, 4, {0: "SIGINT", 1: "SIGUSR1"}, (0, 1))
    assert said == ["SIGINT and SIGUSR1 on 2 of 4 ranks received: stopping at step 7"] * 4, said


def test_exit_interval_stops_and_saves(tmp_path, common, capsys):
    ckpt = tmp_path / "ckpt"
    assert main([*common, "--max-steps", "10", "--exit-interval", "3", "--save", str(ckpt)]) == 0
    assert "--exit-interval 3 reached at step 3" in capsys.readouterr().out
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000003"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_log_that_cannot_be_written_is_named_at_the_step_it_failed(tmp_path, common, capsys):
    """--log-json on a full disk (/dev/full: every write fails with ENOSPC): the error said
    'rank 0 failed before training started: OSError: [Errno 28] No space left on device', the
    step's failure masked by closing the log (its flush failed again) and the file not named."""
    assert main([*common, "--max-steps", "2", "--log-json", "/dev/full",
                 "--save", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("megapar-train: error:"))
    assert line.startswith(  # (one rank's place, "of tp=1 pp=1 dp=1", is not said; a re-test)
        "megapar-train: error: rank 0 failed at step 1: --log-json /dev/full: No space left on "
        "device writing step 1's record; it holds no record (free space there, or give "
        "--log-json another file)"), err
    assert "traceback" not in err and os.path.exists("/dev/full")  # a device: left alone


def test_a_log_cut_short_by_a_full_disk_keeps_its_whole_records(tmp_path):
    """A full disk under --log-json was 'OSError: [Errno 28] ...', a traceback pointer, and a
    file left with half a line (or empty: a re-test). The file keeps its whole records, or
    goes where this run began it and holds none."""
    import errno
    from types import SimpleNamespace

    from megapar.faults.stop import RunStopped
    from megapar.training.logging import MetricsLogger

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[:7])  # half the line reaches the disk
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.f.close()

    for records in (1, 0):
        path = tmp_path / f"log{records}.jsonl"
        cfg = SimpleNamespace(progress=False, max_steps=3, log_json=str(path), tensorboard=None,
                              wandb_project=None)
        logger = MetricsLogger(cfg, 0, {})
        for step in range(1, records + 1):
            logger.log(step, {"loss": 1.5})
        whole = path.read_text()
        logger.json = Full(logger.json)
        with pytest.raises(RunStopped) as info:
            logger.log(records + 1, {"loss": 1.25})
        kept = "the records before it are kept" if records else "the file it began is removed"
        assert str(info.value) == (
            f"--log-json {path}: No space left on device writing step {records + 1}'s record; "
            f"{kept} (free space there, or give --log-json another file)")
        assert (path.read_text() == whole) if records else not path.exists()
        logger.close()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_diverging_run_stops_and_saves_nothing(tmp_path, common, capsys, precision):
    ckpt = tmp_path / "ckpt"
    rc = main([*common, "--tp", "2", "--lr", "1e6", "--precision", precision, "--max-steps", "60",
               "--max-nonfinite-steps", "3", "--save", str(ckpt), "--save-interval", "50"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "training diverged" in err and "Traceback" not in err, err
    # clipping is on (--clip-grad 1.0, the default): "lower" it, not "use" it
    assert "raise --warmup-steps or lower --clip-grad;" in err, err
    assert not ckpt.exists() or not any(p.name.startswith("step_") for p in ckpt.iterdir())


def test_guard_counts_consecutive_steps_and_the_fp16_floor():
    guard = NonFiniteGuard(3, "fp32")
    for step in (1, 2):
        guard.observe(step, float("nan"), 1.0, False, 1.0)
    guard.observe(3, 2.0, 1.0, False, 1.0)  # a finite step resets the count
    guard.observe(4, 2.0, float("inf"), True, 1.0)
    guard.observe(5, float("nan"), float("nan"), True, 1.0)
    with pytest.raises(NonFiniteError, match=r"3 consecutive steps \(4-6\)"):
        guard.observe(6, float("nan"), float("nan"), True, 1.0)
    scaler = DynamicLossScaler(init_scale=2.0**20, min_scale=1.0, hysteresis=2)
    fp16 = NonFiniteGuard(2, "fp16", scaler)
    step = 0
    while scaler.scale > 1.0:  # 21 overflows with a finite loss: skipped, none counted
        step += 1
        used = scaler.scale
        scaler.update(True)
        fp16.observe(step, 5.0, float("inf"), True, used)
    assert step == 21 and fp16.bad == 0
    fp16.observe(22, float("nan"), float("inf"), True, 4.0)  # a non-finite loss counts
    with pytest.raises(NonFiniteError, match=r"2 consecutive steps \(22-23\) had a non-finite "
                       r"loss \(last: loss \(nan\) and gradients \(norm inf\); skipped in fp16\)"):
        fp16.observe(23, float("nan"), float("inf"), True, 4.0)
    # a static scale (--loss-scale): nothing lowers it, so its overflows count
    static = NonFiniteGuard(2, "fp16", DynamicLossScaler(128.0, min_scale=128.0, dynamic=False))
    static.observe(1, 5.0, float("inf"), True, 128.0)
    with pytest.raises(NonFiniteError, match=r"2 consecutive steps \(1-2\) overflowed at the "
                       r"static fp16 loss scale 128 \(--loss-scale\).*skipped\): lower "
                       r"--loss-scale, or leave it out for the dynamic scale;"):
        static.observe(2, 5.0, float("inf"), True, 128.0)  # (the fix named: a new user's)
    fp16 = NonFiniteGuard(100, "fp16", scaler)
    scaler.update(True)  # at the floor, the hysteresis used up: the scaler cannot help
    with pytest.raises(NonFiniteError, match=r"loss scale reached its floor 1 \(--min-loss-scale"):
        fp16.observe(24, 5.0, float("inf"), True, 1.0)
    api = NonFiniteGuard(100, "fp16", scaler, keywords=True)  # megapar.prepare's terms
    with pytest.raises(NonFiniteError, match=r"floor 1 \(min_loss_scale\) and still"):
        api.observe(25, 5.0, float("inf"), True, 1.0)
    # a floor above 1 (a --min-loss-scale given): lowering it is the fix (the advice named
    # --lr and --clip-grad only; a re-test)
    high = DynamicLossScaler(2.0**23, min_scale=2.0**23, hysteresis=1)
    high.update(True)
    with pytest.raises(NonFiniteError, match=r"floor 8388608 \(--min-loss-scale\) and "
                       r"still overflowed \(lower --min-loss-scale to let it fall further\);"):
        NonFiniteGuard(100, "fp16", high).observe(26, 5.0, float("inf"), True, 2.0**23)


def test_fp16_overflows_are_skipped_not_failures_and_the_scale_resumes_mid_hysteresis(
        tmp_path, common):
    """A loss scale too large for every step's gradients (2^40, hysteresis 2): each step is
    skipped, none counts for --max-nonfinite-steps 2 (the loss is finite; the run was stopped
    at step 2), the scale follows Megatron-LM's sequence, and a resume between the hysteresis's
    two overflows halves at the next one, as the run that never stopped does."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    fp16 = ["--precision", "fp16", "--initial-loss-scale", str(2.0**40), "--hysteresis", "2",
            "--max-nonfinite-steps", "2", "--log-json", str(log)]
    assert main([*common, *fp16, "--max-steps", "1", "--save", str(ckpt)]) == 0
    assert main([*common, *fp16, "--max-steps", "3", "--load", str(ckpt)]) == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(m["step"], m["skipped"], m["loss_scale"]) for m in lines] == [
        (1, True, 2.0**40), (2, True, 2.0**40), (3, True, 2.0**39)]
    assert all(math.isfinite(m["loss"]) for m in lines)


def test_load_of_an_empty_dir_starts_fresh_unless_strict(tmp_path, common, capsys):
    ckpt = tmp_path / "requeue"
    same = ["--save", str(ckpt), "--load", str(ckpt)]  # what a requeued job passes again
    assert main([*common, "--max-steps", "2", *same]) == 0
    assert "no checkpoint there yet, starting from scratch" in capsys.readouterr().out
    assert main([*common, "--max-steps", "3", *same]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert (ckpt / "latest").read_text().strip() == "step_00000003"
    assert main([*common, "--max-steps", "2", "--load", str(tmp_path / "nothing"),
                 "--load-strict"]) == 2
    assert "nothing: no such checkpoint directory (--load-strict)" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([*common, "--max-steps", "2", "--load", str(tmp_path / "empty"),
                 "--load-strict"]) == 2
    assert "empty: no checkpoint there (--load-strict)" in capsys.readouterr().err


# --- the launcher names the rank that caused a failure --------------------------------------
def _rank1_killed():
    t = torch.zeros(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        from megapar.faults.status import set_action, set_step

        set_step(7)
        set_action("forward of micro-batch 2")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)
    return 0


def _rank2_stopped():
    t = torch.zeros(1)
    dist.all_reduce(t)
    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(t)
    return 0


def test_a_killed_rank_is_named_with_its_signal():
    with pytest.raises(WorkerError) as info:
        run_local(_rank1_killed, 4, timeout_s=60, collective_timeout_s=30)
    first = str(info.value).splitlines()[0]   # where it died: its last step and action
    assert first == "rank 1 was killed by SIGKILL (9) at step 7, forward of micro-batch 2", first


def test_a_rank_that_exits_143_is_said_to_have_ended_on_a_sigterm():
    """A SIGTERM's stop cut a rank blocked in a long save after its grace (exit 143); the
    launcher said it "exited with code 143 without reporting an error"."""
    from megapar.faults.blame import _how

    assert _how(143).startswith("exited with code 143 on a SIGTERM (a rank still blocked")
    assert _how(3) == "exited with code 3 without reporting an error"
    # a rank whose wait to join ran out writes its own line first, then exits 124: the
    # launcher said it exited "without reporting an error" under it (a re-test)
    assert _how(124) == "exited with code 124: its wait to join ran out (its own line above)"


def test_the_shared_status_line_follows_every_step_and_action_and_fits_its_buffer():
    """set_action writes a known action's bytes after the "step S, " prefix only: the line must
    still be whole after the prefix changes length, after a longer action and when truncated."""
    buffer = ctypes.create_string_buffer(40)
    saved = rank_status.use(rank_status.RankStatus(buffer))
    try:
        rank_status.set_step(7)
        for action in ["forward of micro-batch 3", "recv", "forward of micro-batch 3"]:
            rank_status.set_action(action)
            assert buffer.value == f"step 7, {action}".encode() == rank_status.status().encode()
        rank_status.set_action("a" * 50)
        assert buffer.value == b"step 7, " + b"a" * 31  # 39 bytes and the NUL
        rank_status.set_step(10)
        assert buffer.value == b"step 10, " + b"a" * 30
        rank_status.set_action("recv")
        assert buffer.value == b"step 10, recv"
        rank_status.set_step(None)
        rank_status.set_action("forward of micro-batch 3")
        assert buffer.value == b"forward of micro-batch 3"
    finally:
        rank_status.use(saved)


def test_a_loop_publishes_encoded_actions_through_the_line_and_status_reads_them():
    """The executor's walk writes pre-encoded actions into the shared line (no call per
    action); the line, status() and a later set_step / set_action stay whole and agree."""
    buffer = ctypes.create_string_buffer(40)
    saved = rank_status.use(rank_status.RankStatus())
    try:
        assert rank_status.action_line(10) is None  # no launcher: set_action it is
        rank_status.use(rank_status.RankStatus(buffer))
        rank_status.set_step(7)
        assert rank_status.action_line(33) is None  # 8 bytes of prefix + 33 > 40
        line = rank_status.action_line(32)
        for action in ["forward of micro-batch 3", "recv", "backward of micro-batch 12"]:
            data = rank_status.encode_action(action)
            line.value = data
            assert buffer.value == f"step 7, {action}".encode() == rank_status.status().encode()
        rank_status.set_step(10)  # a longer prefix: the action read back from the line
        assert buffer.value == b"step 10, backward of micro-batch 12"
        assert rank_status.status() == "step 10, backward of micro-batch 12"
        rank_status.set_action("recv")
        assert buffer.value == b"step 10, recv" == rank_status.status().encode()
    finally:
        rank_status.use(saved)


def test_a_stopped_rank_is_named_on_timeout():
    with pytest.raises(WorkerError) as info:
        run_local(_rank2_stopped, 4, timeout_s=60, collective_timeout_s=3)
    assert str(info.value).startswith("rank 2 did not answer (it is stopped"), str(info.value)


def _listening():
    """(local address, port) of every TCP socket this process listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                addr, port = cols[1].split(":")
                found.append((addr, int(port, 16)))
    return found


def test_local_runs_listen_on_loopback_only():
    ranks = run_local(_listening, 2)
    assert any(ranks[0]), "rank 0 serves the rendezvous store"
    loopback = {"0100007F", "00000000000000000000000001000000"}
    for sockets in ranks:
        assert all(addr in loopback for addr, _ in sockets), sockets


@pytest.mark.parametrize("flag", ["--save", "--log-json", "--tensorboard", "--data-cache"])
def test_unwritable_outputs_are_refused_before_any_work(tmp_path, common, capsys, flag):
    rc = main([*common, "--max-steps", "2", flag, "/proc/megapar-test/x"])
    assert rc == 2
    assert f"{flag} /proc/megapar-test/x is not writable: nothing can be created in /proc;" \
        in capsys.readouterr().err  # (it was "(No such file or directory ENOENT)")


@pytest.mark.parametrize("steps,interval,lost,latest", [
    ("4", "2", "steps 3-4 (last checkpoint: step 2; resume with --load ", 2),
    # one step lost said "not saved: steps 2-2"
    ("3", "1", "step 2 (last checkpoint: step 1; resume with --load ", 1)])
def test_a_disk_error_during_a_save_is_one_line_saying_what_was_lost(
        tmp_path, common, capsys, monkeypatch, steps, interval, lost, latest):
    import megapar.checkpoint.distributed as cd

    real = cd.write_tensors
    calls = []

    def full_disk(path, tensors):
        calls.append(path)
        if len(calls) > 2:  # the first save (shard + rng) fits, then the disk is full
            raise OSError(28, "No space left on device")
        return real(path, tensors)

    monkeypatch.setattr(cd, "write_tensors", full_disk)
    ckpt = tmp_path / "ckpt"
    rc = main([*common, "--max-steps", steps, "--save", str(ckpt), "--save-interval", interval])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    assert "No space left on device" in err
    assert f"not saved: {lost}{ckpt})" in err, err  # how to resume: a reviewer's drill
    assert (ckpt / "latest").read_text().strip() == f"step_{latest:08d}"


def test_a_failed_first_save_on_a_full_disk_leaves_no_directory_it_made(
        tmp_path, common, capsys, monkeypatch):
    """--save a/b/c (a new) on a full disk: the first save fails and so does the rank's log
    (its file made, nothing written); the run removes the empty log file and every directory it
    made (a/b/c, its logs/ and the new parents a/b were left), and nothing that was there."""
    import megapar.checkpoint.distributed as cd
    import megapar.cli.train as train_cli

    def full_disk(path, tensors):
        raise OSError(28, "No space left on device")

    class FullDiskPath(type(Path())):
        def write_text(self, *args, **kwargs):
            self.touch()  # the file is made, its text is not
            raise OSError(28, "No space left on device")

    real_log_dir = train_cli.log_dir_for
    monkeypatch.setattr(cd, "write_tensors", full_disk)
    monkeypatch.setattr(train_cli, "log_dir_for",
                        lambda *args: FullDiskPath(real_log_dir(*args)))
    (tmp_path / "kept").mkdir()
    rc = main([*common, "--max-steps", "1", "--save", str(tmp_path / "a" / "b" / "c")])
    err = capsys.readouterr().err
    assert rc == 1 and "not saved: step 1 (last checkpoint: none)" in err, err
    assert "full traceback in" not in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_a_rank_killed_while_saving_leaves_no_staging_directory(tmp_path, common, capsys,
                                                                monkeypatch):
    """kill -9 of one worker during a save left --save/.tmp-step_N-* behind (a half-written
    checkpoint) until some later save; megapar-train now removes it once its workers are gone,
    and latest stays the last complete checkpoint."""
    import megapar.checkpoint.distributed as cd

    real = cd.write_tensors

    def dies_in_step_2s_save(path, tensors):
        if ".tmp-step_2-" in str(path) and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, tensors)

    monkeypatch.setattr(cd, "write_tensors", dies_in_step_2s_save)
    ckpt = tmp_path / "ckpt"
    rc = main([*common, "--tp", "2", "--max-steps", "3", "--save", str(ckpt),
               "--save-interval", "1", "--timeout-s", "20"])
    err = capsys.readouterr().err
    assert rc == 1 and ("rank 1 (tp rank 1, pp rank 0, dp rank 0 of tp=2 pp=1 dp=1) was killed by SIGKILL "
                       "(9) at step 2, saving") in err, err
    # and where to resume: the failure line did not say that the save was lost
    assert (f"; any save in flight is lost; {ckpt}/latest is step_00000001, the checkpoint to "
            f"resume from (--load {ckpt})") in err, err
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "logs", "step_00000001"]
    assert (ckpt / "latest").read_text().strip() == "step_00000001"


def test_a_second_sigint_aborts_at_once(tmp_path, common, monkeypatch):
    from megapar.faults import stop

    # a window of 0.1 s (the forked launcher inherits it): the second SIGINT 0.2 s later is one
    monkeypatch.setattr(stop, "SAME_INTERRUPT_S", 0.1)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    # Steps of 32 micro-batches: the first SIGINT's step cannot end before the second arrives.
    pid = _fork_main([*common, "--tp", "2", "--max-steps", "400", "--save", str(ckpt),
                      "--log-json", str(log), "--global-batch-size", "64"], tmp_path / "out")
    assert _wait_for(lambda: len(_steps(log)) >= 1)
    workers = _children(pid)
    os.kill(pid, signal.SIGINT)
    time.sleep(0.2)  # two signals sent at once would merge into one
    os.kill(pid, signal.SIGINT)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 130, (tmp_path / "out").read_text()
    assert "aborted (second SIGINT)" in (tmp_path / "out").read_text()
    assert _wait_for(lambda: not any(_alive(w) for w in workers), timeout=5.0)


def test_a_signal_the_launcher_started_ignoring_stays_ignored():
    """A job started in a non-interactive shell's background (`megapar-generate ... &` in a
    script) starts with SIGINT ignored, and its workers inherit that: the launcher used to put
    its forwarder in place anyway, so a SIGINT was "forwarded" to workers that ignored it and
    the run went on as if it were stopping. As Python itself does, the launcher now leaves an
    ignored signal ignored; the others it forwards."""
    from types import SimpleNamespace

    from megapar.launcher import _forward_signals

    forwards = []
    worker = SimpleNamespace(pid=-1, is_alive=lambda: forwards.append(1) or False)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        restore = _forward_signals([worker], ("SIGINT", "SIGUSR1"))
        try:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
            assert forwards == []
            signal.raise_signal(signal.SIGUSR1)
            assert forwards == [1]
        finally:
            restore()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_an_interrupt_delivered_twice_is_one_and_a_later_one_aborts(monkeypatch):
    """`timeout -s INT` sends SIGINT to megapar-train and then to its process group (megapar-
    train again) microseconds apart; a terminal's Ctrl-C reaches a torchrun worker directly and
    through torchrun. Both the launcher and a worker read that as a second Ctrl-C: abort,
    nothing saved. A repeat within `SAME_INTERRUPT_S` is now the first again; a later one still
    aborts."""
    from types import SimpleNamespace

    from megapar.faults import stop
    from megapar.launcher import _forward_signals

    window = stop.SAME_INTERRUPT_S
    assert 0.5 <= window <= 2.0
    arrivals = stop.Interrupts()
    assert [arrivals.arrive(t) for t in (10.0, 10.00001, 10.0 + window - 0.01,
                                          10.0 + window + 0.01)] == [1, 0, 0, 2]
    # the launcher: forwards the first to the workers once, ignores its repeat
    forwards = []
    worker = SimpleNamespace(pid=-1, is_alive=lambda: forwards.append(1) or False)
    restore = _forward_signals([worker], ("SIGINT",))
    try:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # used to raise KeyboardInterrupt
        assert len(forwards) == 1
        monkeypatch.setattr(stop, "SAME_INTERRUPT_S", 0.02)
        time.sleep(0.05)
        with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
            signal.raise_signal(signal.SIGINT)
    finally:
        restore()
    # a worker: asks for a clean stop once, exits 130 on a later SIGINT only
    monkeypatch.setattr(stop, "SAME_INTERRUPT_S", window)
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    restore = stop.install_stop_handlers("")
    try:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # used to os._exit(130)
        assert exits == [] and stop._requested["reason"] == "SIGINT"
        monkeypatch.setattr(stop, "SAME_INTERRUPT_S", 0.02)
        time.sleep(0.05)
        signal.raise_signal(signal.SIGINT)
        assert exits == [130]
    finally:
        restore()
        stop._requested.update(reason="")


# --- one writer per --save directory ----------------------------------------------------------
def _manifests(ckpt: Path) -> dict[str, dict]:
    from megapar.checkpoint.manifest import verify

    return {p.name: verify(p) for p in sorted(ckpt.glob("step_*"))}


def test_a_second_writer_of_a_save_dir_is_refused_and_the_first_keeps_its_checkpoints(
        tmp_path, common, capsys):
    from megapar.checkpoint.lock import LOCK_NAME

    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    pid = _fork_main([*common, "--tp", "2", "--max-steps", "400", "--save", str(ckpt),
                      "--save-interval", "2", "--log-json", str(log), "--seed", "1"],
                     tmp_path / "out")
    assert _wait_for(lambda: (ckpt / "step_00000002").exists()), (tmp_path / "out").read_text()
    owner = json.loads((ckpt / LOCK_NAME).read_text())
    assert owner["pid"] == pid and owner["host"] and owner["started"]
    # the requeued job, started while the first still runs: refused before any worker starts
    rc = main([*common, "--max-steps", "4", "--save", str(ckpt), "--seed", "2",
               "--save-interval", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--save {ckpt} is in use by another run (pid {pid} on " in err
    assert ": megapar-train --model " in err  # the other run's command line
    assert "give this run another --save" in err
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, (tmp_path / "out").read_text()
    saved = _manifests(ckpt)
    stopped = _steps(log)[-1]
    assert f"step_{stopped:08d}" in saved and (ckpt / "latest").read_text().strip() == \
        f"step_{stopped:08d}"
    assert {m["meta"]["train_config"]["seed"] for m in saved.values()} == {1}  # all the first's
    assert not (ckpt / LOCK_NAME).exists()  # released on the clean stop


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_stale_lock_is_taken_over_and_another_hosts_live_one_refuses(tmp_path, common,
                                                                      capsys):
    import socket

    from megapar.checkpoint import lock as save_lock

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    path = ckpt / save_lock.LOCK_NAME
    # a run on this host that died (kill -9) left its lock: its pid is gone
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(),
                                "started": "2026-01-01T00:00:00+00:00", "command": "x"}))
    assert main([*common, "--max-steps", "2", "--save", str(ckpt)]) == 0
    assert "took over the stale lock" in capsys.readouterr().err
    assert (ckpt / "step_00000002").exists() and not path.exists()
    # another host's run, alive by its heartbeat: refused (its processes cannot be seen)
    path.write_text(json.dumps({"host": "node-b", "pid": 4242, "started": "2026-01-01T00:00",
                                "command": "megapar-train --save x"}))
    assert main([*common, "--max-steps", "3", "--save", str(ckpt), "--load", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "in use by another run (pid 4242 on node-b" in err and "last alive" in err, err
    assert f"delete {path} if that run is gone" in err
    # ... and once its heartbeat is older than STALE_AFTER_S, it is stale
    old = time.time() - save_lock.STALE_AFTER_S - 60
    os.utime(path, (old, old))
    assert main([*common, "--max-steps", "3", "--save", str(ckpt), "--load", str(ckpt)]) == 0
    assert "took over the stale lock" in capsys.readouterr().err and not path.exists()


def test_the_save_lock_is_exclusive_and_released_on_an_exception(tmp_path):
    from megapar.checkpoint.lock import SaveLock, SaveLockError, check_unlocked

    first = SaveLock(tmp_path / "ckpt").acquire()
    with pytest.raises(SaveLockError, match=f"pid {os.getpid()} on "):
        SaveLock(tmp_path / "ckpt").acquire()  # another holder, even in this process
    check_unlocked(tmp_path / "ckpt", allowed_pids=(os.getpid(),))  # its own saves may write
    with pytest.raises(SaveLockError):
        check_unlocked(tmp_path / "ckpt")
    first.release()
    with pytest.raises(RuntimeError, match="boom"):
        with SaveLock(tmp_path / "ckpt"):
            raise RuntimeError("boom")
    assert list((tmp_path / "ckpt").iterdir()) == []  # released: nothing left


def test_every_torchrun_rank_checks_the_save_lock_but_not_its_own_jobs(tmp_path, monkeypatch):
    """Under torchrun, rank 0 alone checked --save's lock: rank 1 went on to another refusal
    ('holds steps of an earlier run') of a live run's directory and was cut off, exit 143 (a
    new user's tryout of faults.md). Every rank checks it now; a rank but 0 does not refuse
    the lock its own job's rank 0 took meanwhile (the record names the job)."""
    from megapar.checkpoint.lock import SaveLock, SaveLockError, check_unlocked, launched_job

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    job = launched_job()
    assert job == "10.0.0.1:29500/abc"
    lock = SaveLock(tmp_path / "ckpt").acquire()  # this job's rank 0
    try:
        check_unlocked(tmp_path / "ckpt", job=job)  # its rank 1: its own job's
        with pytest.raises(SaveLockError):
            check_unlocked(tmp_path / "ckpt", job="10.0.0.2:29500/abc")  # another job's
        with pytest.raises(SaveLockError):
            check_unlocked(tmp_path / "ckpt")  # rank 0 of a job checks without one
    finally:
        lock.release()
    monkeypatch.delenv("MASTER_ADDR")
    assert launched_job() is None


def test_a_full_disk_under_save_is_one_line_before_training(tmp_path, common, capsys,
                                                            monkeypatch):
    """A --save on a full disk: the lock's record cannot be written. It was a traceback from
    os.pwrite, and an empty megapar.lock (and the --save the run made) were left behind."""
    import errno

    from megapar.checkpoint import lock as save_lock

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(save_lock.os, "pwrite", full)
    ckpt = tmp_path / "new" / "ckpt"
    assert main([*common, "--max-steps", "2", "--save", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"megapar-train: error: No space left on device: {ckpt / save_lock.LOCK_NAME} while "
        f"starting; nothing was trained; free space on that disk, or choose another directory"
    ), err
    assert "Traceback" not in err and not (tmp_path / "new").exists()


def test_a_save_directory_replaced_under_the_run_releases_its_lock_quietly(tmp_path):
    """--save moved away and a file put in its place (or made read-only) while the run went on:
    the run failed with its one line at the next save, then released its lock with a traceback
    (NotADirectoryError from the lock file's stat)."""
    from megapar.checkpoint.lock import SaveLock

    lock = SaveLock(tmp_path / "ckpt").acquire()
    (tmp_path / "ckpt").rename(tmp_path / "moved")
    (tmp_path / "ckpt").write_text("a file now")
    lock.release()
    assert lock._fd is None
    assert (tmp_path / "moved" / "megapar.lock").exists()  # not ours to delete any more


def test_a_copy_of_a_live_runs_directory_is_not_locked_by_that_run(tmp_path):
    """`cp -r ckpt ckpt-copy` while the run saving into ckpt goes on copies its lock file too;
    that run locks ckpt, not the copy, so a run may save into the copy (with a note)."""
    import shutil

    from megapar.checkpoint.lock import SaveLock, SaveLockError, check_unlocked

    live = SaveLock(tmp_path / "ckpt").acquire()
    try:
        shutil.copytree(tmp_path / "ckpt", tmp_path / "copy")
        check_unlocked(tmp_path / "copy")  # not "in use by another run"
        with pytest.raises(SaveLockError):
            check_unlocked(tmp_path / "ckpt")  # the original still is
        started = json.loads((tmp_path / "ckpt" / "megapar.lock").read_text())["started"]
        copy = SaveLock(tmp_path / "copy").acquire()
        assert copy.taken_over == (
            f"took over {tmp_path / 'copy' / 'megapar.lock'}, a copy of the lock of pid "
            f"{os.getpid()}'s run (started {started}), which locks "
            f"{(tmp_path / 'ckpt').resolve()}, not this directory")
        with pytest.raises(SaveLockError):  # and now the copy is locked by its own run
            check_unlocked(tmp_path / "copy")
        copy.release()
    finally:
        live.release()


def test_a_forked_worker_does_not_release_its_launchers_lock(tmp_path):
    """Local workers are forked from megapar-train's process, which holds the lock: a worker
    that ends (its inherited SIGTERM handler released the lock) deleted the launcher's file."""
    from megapar.checkpoint.lock import SaveLock

    lock = SaveLock(tmp_path / "ckpt").acquire()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            lock.release()
            os._exit(0)
        os.waitpid(pid, 0)
        assert (tmp_path / "ckpt" / "megapar.lock").exists()
    finally:
        lock.release()
    assert not (tmp_path / "ckpt" / "megapar.lock").exists()


def test_the_stopped_rank_is_blamed_not_the_ones_still_waiting_for_it():
    """Rank 1 stopped; ranks 2 and 3 timed out; rank 0, waiting for rank 1 as well, had not
    reported yet when the launcher gave up: rank 1 is the cause (it used to read "rank 0 did
    not answer", rank 1 second)."""
    import subprocess
    from types import SimpleNamespace

    from megapar.faults.blame import blame

    live, halted = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    try:
        os.kill(halted.pid, signal.SIGSTOP)
        assert _wait_for(lambda: _state(halted.pid) == "T", timeout=10)
        procs = [SimpleNamespace(pid=p.pid, exitcode=None) for p in (live, halted, live, live)]
        timeout = "P2PTimeoutError: rank {} (pp stage 1): receiving ... did not complete within 10 s"
        text = blame(procs, {}, {2: timeout.format(2), 3: timeout.format(3)},
                     ["step 5, forward", "step 5, forward of micro-batch 1", "", ""])
    finally:
        for p in (live, halted):
            p.kill()
            p.wait()
    lines = text.splitlines()
    assert lines[0] == ("rank 1 did not answer (it is stopped (SIGSTOP / SIGTSTP?)) at step 5, "
                        "forward of micro-batch 1"), text
    assert lines[1] == "(rank 0 was still waiting)", text


def test_a_stopped_rank_is_blamed_not_the_ranks_a_stops_grace_cut_short():
    """SIGTERM to megapar-train while rank 1 was stopped: rank 0, blocked waiting for it, was
    cut short when the stop's grace was up (exit 143) and was named as the cause, rank 1 not
    at all (a fault drill's finding). The stopped rank is the cause, the exit its consequence;
    a 143 beside no stopped rank is still the cause."""
    import subprocess
    from types import SimpleNamespace

    from megapar.faults.blame import CUT_SHORT, blame

    halted = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(halted.pid, signal.SIGSTOP)
        assert _wait_for(lambda: _state(halted.pid) == "T", timeout=10)
        procs = [SimpleNamespace(pid=0, exitcode=CUT_SHORT),
                 SimpleNamespace(pid=halted.pid, exitcode=None)]
        statuses = ["step 4, forward of micro-batch 0 on pp stage 0", "step 3, done"]
        text = blame(procs, {}, {}, statuses)
        alone = blame(procs[:1], {}, {}, statuses)
    finally:
        halted.kill()
        halted.wait()
    lines = text.splitlines()
    assert lines[0] == ("rank 1 did not answer (it is stopped (SIGSTOP / SIGTSTP?)) at step 3, "
                        "done"), text
    assert lines[1].startswith("(rank 0 exited with code 143 on a SIGTERM") and \
        lines[1].endswith("at step 4, forward of micro-batch 0 on pp stage 0, waiting for it)"), text
    assert alone.startswith("rank 0 exited with code 143 on a SIGTERM"), alone


def test_a_type_error_is_the_cause_not_the_lost_connections_it_left():
    """A loss_fn returning a vector at pp 2: the last stage's TypeError is the cause, the first
    stage's lost connection to it the consequence ("TypeError" holds the letters of "peer")."""
    from types import SimpleNamespace

    from megapar.faults.blame import blame

    procs = [SimpleNamespace(pid=0, exitcode=0) for _ in range(2)]
    lost = ("P2PTimeoutError: rank 0 (pp stage 0): receiving the gradient of micro-batch 0 from "
            "rank 1 did not complete: it failed after 0.1 s (Connection closed by peer)")
    own = "TypeError: megapar.prepare's loss_fn returned (2,), not a 0-dim floating tensor"
    lines = blame(procs, {}, {0: lost, 1: own}).splitlines()
    assert lines[0] == f"rank 1 failed: {own}", lines
    assert lines[1].startswith("then: rank 0: P2PTimeoutError"), lines


def test_a_timed_out_wait_is_the_cause_not_the_connection_it_closed():
    """--timeout-s 0.01 at tp 2: rank 1's send timed out and closed its connection, and the
    report led with rank 0's 'Connection closed by peer' (the lower rank; a new user's
    tryout). A later error is cut at a word's end with ' ...' (it ended 'a pee')."""
    from types import SimpleNamespace

    from megapar.faults.blame import blame

    procs = [SimpleNamespace(pid=0, exitcode=1) for _ in range(3)]
    lost = "RuntimeError: Connection closed by peer [127.0.0.1]:16779"
    timed = "RuntimeError: Timed out waiting 10ms for send operation to complete"
    long = "TrainingError: timed out, then " + "word " * 80
    lines = blame(procs, {}, {0: lost, 1: timed, 2: long.strip()}).splitlines()
    assert lines[0] == f"rank 1 failed: {timed}", lines
    assert lines[1].startswith(f"then: rank 0: {lost}; rank 2: TrainingError: timed out"), lines
    assert lines[1].endswith(" word ..."), lines
    assert len(lines[1]) < len(f"then: rank 0: {lost}; rank 2: ") + 300, lines
    assert blame(procs[:2], {}, {0: lost, 1: lost}).splitlines()[0] == f"rank 0 failed: {lost}"


def test_an_error_every_rank_raises_is_led_by_the_rank_it_names_as_its_origin():
    """A save whose write failed on rank 2: every rank raises the CheckpointError that names
    it, and the report led with rank 0 ("rank 0 failed ... rank 2: RuntimeError", rank 2 among
    those that "stopped for the same reason": a fault drill's finding)."""
    from types import SimpleNamespace

    from megapar.faults.blame import blame

    procs = [SimpleNamespace(pid=0, exitcode=1) for _ in range(4)]
    said = ("CheckpointError: checkpoint of step 4 not saved: rank 2: RuntimeError: disk "
            "controller reset")
    lines = blame(procs, {}, dict.fromkeys(range(4), said)).splitlines()
    assert lines == [f"rank 2 failed: {said}", "(ranks 0, 1 and 3 stopped for the same reason)"]
    one = "RuntimeError: rank 1: a message that names a rank"  # no collective report: rank 0's
    assert blame(procs[:2], {}, {0: one, 1: one}).splitlines()[0] == f"rank 0 failed: {one}"


def test_a_slow_rank_is_blamed_with_its_step_and_action_not_the_ranks_waiting_for_it(tmp_path):
    """`--inject-slow rank=3,ms=40000 --timeout-s 5`: rank 2 (its tp peer) timed out; ranks
    0 and 1 waited in the dp all-reduce and had not answered either. The console's one line
    said "rank 0 did not answer" (the lowest silent rank, no step or action): it names the rank
    most likely at fault now, with where it was."""
    import subprocess
    from types import SimpleNamespace

    from megapar.faults.blame import blame
    from megapar.faults.report import worker_failure

    idle = subprocess.Popen(["sleep", "60"])
    spinning = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    dp_wait = "step 2, waiting for the data-parallel gradient reduce-scatter"  # ZeRO's
    forward = "step 2, forward of micro-batch 0 on pp stage {}"
    timeout = "TrainingError: rank {} (...) failed at step 2: RuntimeError: [gloo] Timed out"
    try:
        procs = [SimpleNamespace(pid=idle.pid, exitcode=None) for _ in range(4)]
        # tp 2 x dp 2: the others wait in a collective, rank 3 computes
        text = blame(procs, {}, {2: timeout.format(2)},
                     [dp_wait, dp_wait, forward.format(0), forward.format(0)])
        assert text.splitlines()[:2] == [f"rank 3 did not answer at {forward.format(0)}",
                                         "(ranks 0 and 1 were still waiting)"], text
        line, log = worker_failure(text, tmp_path)
        assert line == f"rank 3 did not answer at {forward.format(0)}" and log.endswith("rank3.log")
        # pp 2 x dp 2: a receive waits for rank 3; the step behind comes first
        statuses = [dp_wait, dp_wait, "step 2, recv_grad of micro-batch 0 on pp stage 0 (from "
                    "rank 3)", forward.format(1)]
        assert blame(procs, {}, {0: timeout.format(0)}, statuses).startswith(
            f"rank 3 did not answer at {forward.format(1)}")
        statuses[1] = "step 1, send_forward [SA1] on pp stage 0 (with rank 2)"
        assert blame(procs, {}, {0: timeout.format(0)}, statuses).startswith(
            "rank 1 did not answer at step 1, send_forward")
        # a tp peer waits inside its forward (the same status): the one using CPU is slow
        procs[3] = SimpleNamespace(pid=spinning.pid, exitcode=None)
        text = blame(procs, {}, {0: timeout.format(0), 2: timeout.format(2)},
                     [dp_wait, forward.format(1), dp_wait, forward.format(1)])
        assert text.splitlines()[0] == f"rank 3 did not answer at {forward.format(1)}", text
    finally:
        for p in (idle, spinning):
            p.kill()
            p.wait()


def _holding_up_under_torchrun():
    """Rank 3 of tp 2 x dp 2 computes in its forward (slow), rank 2, its tp peer, waits inside
    its forward, ranks 0 and 1 in the dp all-reduce. Rank 0, its wait timed out, asks whom to
    blame (ranks 2 and 3 alike but for their CPU); then rank 2; then rank 1 fails of itself,
    and rank 3 asks. The store's keys order them."""
    from datetime import timedelta

    from megapar.faults import progress

    store = dist.distributed_c10d._get_default_store().clone()
    store.set_timeout(timedelta(seconds=30))
    rank = dist.get_rank()
    rank_status.set_step(2)
    rank_status.set_action("waiting for the data-parallel gradient all-reduce" if rank < 2
                           else "forward of micro-batch 0 on pp stage 0")
    answer = ""
    if rank == 0:  # the first to time out, once every record is published
        time.sleep(2.5 * progress.PUBLISH_S)
        answer = progress.holding_up()
        store.set("named-0", answer)
        store.wait(["done-1", "done-2", "done-3"])  # it holds the store (as rank 0 under srun)
    elif rank == 2:  # rank 3's tp peer: blocked (no CPU) until its timeout, after rank 0's
        store.wait(["named-0"])
        answer = progress.holding_up()
        store.set("named-2", answer)
    elif rank == 3:  # slow: computing until the others have named it
        while not store.check(["named-2"]):
            sum(range(10_000))
        store.wait(["failed-1"])
        answer = progress.holding_up()
    else:  # fails of itself, after that: who times out later names it
        store.wait(["named-2"])
        progress.mark_failed("ValueError: boom on purpose\nTraceback ...")
        store.set("failed-1", "")
    store.set(f"done-{rank}", "")
    return answer


def test_under_torchrun_the_rank_holding_the_others_up_is_named_from_the_store(monkeypatch):
    """Under torchrun there is no launcher of ours to read every rank's status: each rank
    timed out and named only the peer it waited for. Now each rank publishes its step and
    action in the job's store and the rank whose wait timed out names the one most behind, as
    the local launcher does (a slow rank computing, not its tp peer waiting inside its
    forward, nor the ranks in the dp all-reduce); a rank that failed of itself is named by
    those that time out after it."""
    from megapar.faults import progress
    from test_launcher import _run_as_torchrun

    from megapar.launcher import run_workers

    monkeypatch.setattr(progress, "PUBLISH_S", 0.5)
    monkeypatch.setattr(progress, "HEARTBEAT_S", 1.0)  # rank 3 computes: its heartbeat moves
    start = time.monotonic()
    named = _run_as_torchrun(lambda: run_workers(_holding_up_under_torchrun, 4)[0], 4)
    slow = "rank 3 did not answer at step 2, forward of micro-batch 0 on pp stage 0"
    assert named[2] == named[0] == slow, named
    assert named[3] == ("rank 1 failed at step 2, waiting for the data-parallel gradient "
                        "all-reduce: ValueError: boom on purpose"), named
    assert time.monotonic() - start < 30


def test_the_computing_rank_is_named_by_its_cpu_between_the_reads(monkeypatch):
    """Of two ranks alike but for their CPU (a slow rank computing, its tp peer waiting inside
    its forward), the one named is the one whose process used a CPU between the reader's two
    reads, `heartbeat_wait_s()` apart: each record's own share is of one `PUBLISH_S`, in which
    a rank computing on a loaded machine got under `BUSY_SHARE` of a CPU (rank 3 at 0.05 in
    its last record; the tp peer, rank 2, was named in one run of four of the torchrun test
    above under a loaded -n 2 run); over the seconds between the reads it got 0.3."""
    from datetime import timedelta
    from types import SimpleNamespace

    from megapar.faults import progress
    from megapar.faults.progress import ProgressRecords
    from megapar.launcher import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    forward = "step 2, forward of micro-batch 0 on pp stage 0"
    reader = ProgressRecords(store, 0, 4)

    def publish(beat: int, at: float, cpu_s3: float, cpu3: float) -> None:
        records = {1: ("step 2, waiting for the data-parallel gradient all-reduce", 0.0, 2.0),
                   2: (forward, 0.0, 2.0), 3: (forward, cpu3, cpu_s3)}
        for rank, (status, cpu, cpu_s) in records.items():
            store.set(reader.key(rank), json.dumps({
                "status": status, "cpu": cpu, "cpu_s": cpu_s, "at": at, "failed": False,
                "beat": beat}))

    publish(1, 100.0, 5.0, 0.4)
    clock = SimpleNamespace(monotonic=time.monotonic, process_time=time.process_time,
                            sleep=lambda s: publish(3, 102.0, 5.6, 0.05))
    monkeypatch.setattr(progress, "time", clock)
    assert reader.holding_up() == f"rank 3 did not answer at {forward}"
    assert progress.cpu_share({"cpu_s": 5.0, "at": 100.0}, {"cpu_s": 5.6, "at": 102.0,
                                                           "cpu": 0.05}) == pytest.approx(0.3)
    # one record read twice (or one without the counts): its own share
    assert progress.cpu_share({"cpu_s": 5.0, "at": 100.0}, {"cpu_s": 5.0, "at": 100.0,
                                                           "cpu": 0.4}) == 0.4
    assert progress.cpu_share({}, {"cpu": 0.2}) == 0.2


def test_the_rank_named_behind_gives_the_same_cause_when_it_fails_in_the_end():
    """Under torchrun an --inject-slow rank 3 was named by the ranks that timed out ("rank 3 did
    not answer at step 2, ..."), but its own error, once they were gone, was "rank 3 failed at
    step 2: RuntimeError: Connection closed by peer": its records showed every other rank
    failed, and nothing named. The rank that names one records it (`named`); a later reader
    gives it at once (no heartbeats' wait), and the rank named says the others gave up on it."""
    from datetime import timedelta

    from megapar.faults import progress
    from megapar.faults.progress import ProgressRecords
    from megapar.launcher import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    cause = "rank 3 did not answer at step 2, forward of micro-batch 0 on pp stage 0"
    first = ProgressRecords(store, 0, 4)
    first.named = cause
    first.failed = True
    first.publish()
    store.set(first.key(1), json.dumps({"status": "step 2", "failed": True, "beat": 1}))
    slow = ProgressRecords(store, 3, 4)
    started = time.monotonic()
    assert slow.holding_up() == cause
    assert time.monotonic() - started < progress.heartbeat_wait_s() / 2
    assert progress.gave_up(cause, 3) == (
        "; the other ranks gave up waiting for rank 3, which then lost them")
    assert progress.gave_up(cause, 1) == "; rank 1 gave up waiting"
    assert json.loads(store.get(slow.key(3)))["named"] == cause  # passed on in its turn


def test_a_killed_rank_of_this_node_is_named_at_once_under_torchrun(monkeypatch):
    """Under torchrun a kill -9 of rank 1 took 22 s to report (a first read bounded by the
    store's timeout, then the heartbeats' wait) and said "rank 1 did not answer": a rank of
    this node whose process is gone and whose record says no failure or return is named at
    once as gone; one that failed (its wait timed out) or returned is not, and outside
    torchrun nothing is read from /proc."""
    from datetime import timedelta
    from types import SimpleNamespace

    from megapar.faults import processes, progress
    from megapar.faults.progress import ProgressRecords
    from megapar.launcher import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    reader = ProgressRecords(store, 0, 4)
    backward = "step 4, backward of micro-batch 0 on pp stage 0"
    for rank in (1, 2, 3):
        store.set(reader.key(rank), json.dumps({
            "status": backward, "cpu": 0.0, "failed": rank == 3, "beat": 5}))
    slept = []
    monkeypatch.setattr(progress, "time", SimpleNamespace(
        monotonic=time.monotonic, process_time=time.process_time, sleep=slept.append))
    for name, value in (("TORCHELASTIC_RUN_ID", "x"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                        ("LOCAL_WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(processes, "sibling_ranks", lambda: {2: 1234})  # 1 and 3 gone
    # (this process's parent is pytest's, no torchrun: a wrapper's rank is not the agent's
    # child, and its live siblings were "gone", a re-test's finding)
    assert processes.gone_siblings() == []
    agent = processes._is_torchrun
    monkeypatch.setattr(processes, "_is_torchrun", lambda cmdline: True)  # as torchrun's
    assert processes.gone_siblings() == [1, 3]
    assert reader.holding_up() == (
        f"rank 1's process is gone from this node without a report (killed, e.g. by the OOM "
        f"killer or SIGKILL?); its last record, up to 1 s old: {backward}")  # not "at step 71"
    # of a rank killed at step 76: the record lags by up to a second (a new user's tryout)
    assert slept == []  # no heartbeats' wait
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert processes.gone_siblings() == []
    # the agent by its program or module, not a wrapper whose name holds the word (a re-test)
    assert agent(b"/usr/bin/python3\0/usr/local/bin/torchrun\0--standalone\0train.py")
    assert agent(b"python\0-m\0torch.distributed.run\0--nproc-per-node\0002")
    assert not agent(b"/bin/bash\0./torchrun_wrapper.sh")
    assert not agent(b"/bin/bash\0run.sh\0torchrun")


def test_a_stopped_rank_found_on_another_node_is_named(monkeypatch):
    """A reviewer's two-node drill: rank 3 (node 1) stopped; rank 2, its node's peer, found it
    stopped and continued it, both then failed, and node 0's ranks, timing out later, read only
    failed records: their error was gloo's bare "Timed out waiting 30000ms for recv". What rank
    2 found is in its record now, and the ranks of other nodes name it."""
    from datetime import timedelta
    from types import SimpleNamespace

    from megapar.faults import progress
    from megapar.faults.progress import ProgressRecords
    from megapar.launcher import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    reader = ProgressRecords(store, 0, 4)
    stopped_line = "on this node rank 3 (pid 21098) is stopped (SIGSTOP / SIGTSTP?)"
    for rank, extra in ((1, {}), (2, {"found": stopped_line}), (3, {})):
        store.set(reader.key(rank), json.dumps({
            "status": "step 26, backward of micro-batch 0", "cpu": 0.0, "failed": True,
            "beat": 5, **extra}))
    monkeypatch.setattr(progress, "time", SimpleNamespace(
        monotonic=time.monotonic, process_time=time.process_time, sleep=lambda s: None))
    assert reader.holding_up() == (
        "on rank 2's node rank 3 (pid 21098) is stopped (SIGSTOP / SIGTSTP?)")
    # what rank 2 writes: its record carries the finding
    finder = ProgressRecords(store, 2, 4)
    finder.mark_failed(found=stopped_line)
    assert json.loads(store.get(finder.key(2)))["found"] == stopped_line


def test_a_rank_that_gave_up_waiting_is_not_recorded_as_failing_of_itself(monkeypatch):
    """A reviewer's two-node drill: rank 1's error named rank 3 ("rank 3 did not answer ...;
    rank 1 gave up waiting: RuntimeError: [...] Connection closed by peer"), but its first line
    was cut to 300 characters before it was asked whether it was a lost peer's, which came
    later: it was recorded as an error of rank 1's own, so ranks 0 and 2 blamed rank 1 ("rank
    1 failed at step 30, ...: TrainingError: rank 1 (...) failed ... RuntimeError: [/__w/
    pytorch"). The whole line is asked now, and a rank that gave up waiting is consequential."""
    from megapar import launcher
    from megapar.faults import progress
    from megapar.faults.blame import consequential

    recorded = []
    monkeypatch.setattr(progress, "mark_failed", lambda error="", found="": recorded.append(
        (error, found)))
    monkeypatch.setattr(launcher, "stopped_siblings", lambda: "")
    monkeypatch.setattr(progress, "holding_up", lambda: "")
    long = ("rank 1 (tp rank 0, pp rank 1, dp rank 0 of tp=1 pp=2 dp=2) failed at step 30: rank 3 "
            "did not "
            "answer at step 30, waiting for the data-parallel gradient all-reduce; its process "
            "sent no heartbeat in 11 s (killed, stopped, frozen, or its node lost?); rank 1 gave "
            "up waiting: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/"
            "tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:62852")
    launcher._name_the_cause(RuntimeError(long))
    assert recorded == [], recorded
    assert consequential("TrainingError: rank 0 failed: rank 2 did not answer; rank 0 gave up "
                         "waiting: KeyError")
    launcher._name_the_cause(KeyError("x"))  # an error of its own is still recorded
    assert recorded == [("KeyError: 'x'", "")], recorded


def test_reading_the_records_is_bounded_when_the_store_does_not_answer(monkeypatch):
    """The store lives with torchrun's agent (or rank 0 under srun): when it stops answering
    (here its process stopped) the report must not wait for it: the store's own timeout (1 s
    here) bounds waiting for a key, not for a reply, so the report gives up on its reads after
    twice that, and no rank is named."""
    import multiprocessing as mp
    from datetime import timedelta

    from megapar.faults import progress
    from megapar.faults.processes import stopped
    from megapar.faults.progress import ProgressRecords
    from megapar.launcher import free_port

    monkeypatch.setattr(progress, "STORE_TIMEOUT_S", 1.0)
    port, ctx = free_port(), mp.get_context("fork")
    up = ctx.Event()
    server = ctx.Process(target=_store_server, args=(port, up), daemon=True)
    server.start()
    try:
        assert up.wait(30)
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=1))
        records = ProgressRecords(client, 0, 4)
        records.publish()
        assert json.loads(client.get(records.key(0)))["status"] == rank_status.status()
        client.set(records.key(3), json.dumps({"status": "step 1, forward", "cpu": 1.0}))
        assert records.read() == {3: {"status": "step 1, forward", "cpu": 1.0}}
        os.kill(server.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10  # stopped once scheduled: not yet when kill returns
        while not stopped(server.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
        assert records.holding_up() == ""
        assert time.monotonic() - start < 2.5  # not the 30 s a blocked reply would take
    finally:
        server.kill()
        server.join()


class _GoneStore:
    """A store client whose server's process is gone: every call fails as torch's TCPStore
    client does then (and torch prints a C++ stack trace for each)."""

    def __init__(self):
        self.calls = 0

    def _gone(self, *args):
        self.calls += 1
        raise dist.DistNetworkError("Broken pipe")

    set = get = check = multi_get = _gone


def test_a_store_whose_process_is_gone_is_written_to_once(monkeypatch):
    """torchrun's agent of node 0 holds the store; when it exits (its rank was killed) the other
    nodes' ranks still publish every second while they wait, and each try printed a C++ stack
    trace of torch's ("sendBytes failed ... Broken pipe"), six in the 11 s a report waits. The
    connection does not come back: after it broke, nothing more is sent or read, and the report
    names the process that held the store (under srun rank 0: its error was only "rank 1 failed
    at step 4: ... Connection reset by peer")."""
    from megapar.faults.progress import ProgressRecords

    store = _GoneStore()
    records = ProgressRecords(store, 1, 2)
    for _ in range(5):
        records.publish()
    assert store.calls == 1 and records.lost
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # srun: rank 0 held the store
    assert records.read() == {}
    assert records.holding_up() == ("rank 0 is gone: its process held the job's store at "
                                    "node0:29500, which no longer answers")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun: node 0's agent held it
    assert records.holding_up().startswith("the job's store at node0:29500 is gone: the "
                                           "torchrun agent that held it exited")
    assert store.calls == 1


def test_a_rank_whose_heartbeat_stops_is_named_as_stopped(monkeypatch):
    """A rank stopped on another node (frozen, or its node lost) cannot be seen in this node's
    /proc: its record kept the step it stopped at, and read like a hung rank's. Each record now
    carries a heartbeat count sent at least every HEARTBEAT_S: the rank named is said to have
    stopped when its count did not move while the reader waited, and not when it did."""
    from datetime import timedelta

    from megapar.faults import progress
    from megapar.faults.progress import ProgressRecords
    from megapar.launcher import free_port

    monkeypatch.setattr(progress, "PUBLISH_S", 0.05)
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.5)
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    reader, other = ProgressRecords(store, 0, 2), ProgressRecords(store, 1, 2)
    other.publish()  # one record, then nothing: stopped
    said = reader.holding_up()
    assert said.startswith("rank 1 did not answer") and said.endswith(
        "; its process sent no heartbeat in 1.05 s (killed, stopped, frozen, or its node "
        "lost?)"), said
    other.start()  # alive (hung in its own work): its thread beats
    try:
        reader.failed = False
        assert "heartbeat" not in reader.holding_up()
    finally:
        other.stop()


def _store_server(port, up):
    """A TCPStore's server, in a process of its own until killed."""
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    up.set()
    while store:
        time.sleep(1)


def test_a_rank_under_torchrun_names_a_stopped_rank_of_its_node_and_continues_it():
    """torchrun's workers are siblings (one parent, RANK in their environment): the rank whose
    wait timed out names the stopped one and sends it SIGCONT, so that it ends as well instead
    of when torchrun's SIGKILL comes 30 s after the SIGTERM a stopped process cannot act on."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    halted = subprocess.Popen(["sleep", "60"], env={**env, "RANK": "1"})
    try:
        os.kill(halted.pid, signal.SIGSTOP)
        assert _wait_for(lambda: _state(halted.pid) == "T", timeout=10)
        code = "from megapar.faults.blame import stopped_siblings; print(stopped_siblings())"
        asked = subprocess.run([sys.executable, "-c", code], env={**env, "RANK": "0"},
                               capture_output=True, text=True, timeout=120, check=False)
        assert asked.stdout.strip() == (f"on this node rank 1 (pid {halted.pid}) is stopped "
                                        f"(SIGSTOP / SIGTSTP?)"), asked
        assert _wait_for(lambda: _state(halted.pid) == "S", timeout=10)  # running again
    finally:
        halted.kill()
        halted.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _torchrun_rank0_alone(save, port, err, writes):
    """Rank 0 of 2 under torchrun (its environment), holding the --save lock as megapar-train's
    does, waits for rank 1, which never comes. Its stderr goes to `err`; the size of every
    os.write to it is appended to `writes`."""
    from megapar.checkpoint.lock import SaveLock
    from megapar.launcher import run_workers

    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    real = os.write

    def recording(f, data):
        if f == 2:
            with open(writes, "a") as w:
                w.write(f"{len(data)}\n")
        return real(f, data)

    os.write = recording
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS"):
        os.environ.pop(name, None)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    lock = SaveLock(save).acquire()
    try:
        run_workers(lambda: None, 2, collective_timeout_s=120)
    finally:
        lock.release()


def test_a_torchrun_rank_waiting_for_the_group_obeys_sigterm_and_releases_its_lock(tmp_path):
    """torchrun's SIGTERM while rank 0 waits in the rendezvous: Python runs no handler there,
    so the rank used to stay until torchrun's SIGKILL 30 s later, leaving its --save lock. It
    exits at once (143), the lock released, its stacks written as one block (one write)."""
    import multiprocessing as mp

    from megapar.launcher import free_port

    save, err, writes = tmp_path / "ckpt", tmp_path / "err.txt", tmp_path / "writes.txt"
    p = mp.get_context("fork").Process(target=_torchrun_rank0_alone,
                                       args=(save, free_port(), err, writes))
    p.start()
    try:
        assert _wait_for(lambda: (save / "megapar.lock").exists(), timeout=30)
        time.sleep(2.0)  # in the rendezvous by now
        start = time.monotonic()
        os.kill(p.pid, signal.SIGTERM)
        p.join(timeout=20)
        took = time.monotonic() - start
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    assert p.exitcode == 143 and took < 15, (p.exitcode, took, err.read_text())
    assert not (save / "megapar.lock").exists()
    text = err.read_text()
    first = text.splitlines()[0]
    assert first.startswith("megapar: rank 0: SIGTERM ") and (
        "joining the process group (all 2 ranks, bounded by --timeout-s 120) (a wait that "
        "cannot see the signal)" in first) and "; --save lock released" in first and (
        first.endswith("; its Python stacks:")), text
    assert "in init_distributed" in text, text
    sizes = [int(x) for x in writes.read_text().split()]  # one block, one write
    assert sizes == [len(text.encode())], text


def _torchrun_rank_preempted(err, port):
    """The only rank of a torchrun job (its environment) runs Python, stopping cleanly on
    SIGTERM (as megapar-train's loop does); stderr goes to `err`."""
    from megapar.faults.stop import StopRequests, install_stop_handlers
    from megapar.launcher import run_workers

    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS"):
        os.environ.pop(name, None)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def loop():
        install_stop_handlers("SIGTERM")
        stop, step = StopRequests(), 0
        (err.parent / "ready").touch()
        while not (why := stop.reason(step)):
            step += 1
            time.sleep(0.01)
        os.write(2, f"megapar-train: {why}\n".encode())

    run_workers(loop, 1, collective_timeout_s=30)
    os._exit(0)


def _torchrun_rank_log_name(rank, port, out):
    """Rank `rank` of 2 under torchrun (its environment): the run log name it would use."""
    from megapar.faults.report import run_log_name
    from megapar.launcher import run_workers

    for name in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS"):
        os.environ.pop(name, None)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    [name] = run_workers(run_log_name, 2, collective_timeout_s=30)
    out.write_text(name)
    os._exit(0)


def test_the_ranks_of_a_torchrun_job_without_save_share_one_log_directory(tmp_path):
    """Without --save no lock record tells the other ranks rank 0's run name: each rank's
    failure log went to a directory of its own (run-<time>-<its pid>). They take rank 0's
    through the job's store."""
    import multiprocessing as mp

    from megapar.faults.report import is_run_log_name
    from megapar.launcher import free_port

    port, ctx = free_port(), mp.get_context("fork")
    outs = [tmp_path / f"rank{r}.txt" for r in range(2)]
    procs = [ctx.Process(target=_torchrun_rank_log_name, args=(r, port, outs[r]))
             for r in range(2)]
    for p in procs:
        p.start()
    join_or_kill(procs, 60)
    names = [o.read_text() for o in outs]
    assert [p.exitcode for p in procs] == [0, 0] and names[0] == names[1], names
    assert is_run_log_name(names[0]) and names[0].endswith(f"-{procs[0].pid}"), names


def test_a_routine_sigterm_under_torchrun_writes_one_line_and_no_stacks(tmp_path):
    """torchrun's / Slurm's SIGTERM of a preemption to a rank that runs: the run's stop line,
    no Python stacks (they are for a rank blocked in a wait, above)."""
    from megapar.launcher import free_port

    err = tmp_path / "err.txt"
    exitcode, text = _sigterm_when_ready(_torchrun_rank_preempted, (err, free_port()), err)
    assert exitcode == 0, (exitcode, text)
    assert text.startswith("megapar-train: SIGTERM received: stopping at step ") and (
        text.count("\n") == 1), text


def _sigterm_when_ready(target, args, err, settle_s: float = 0.0) -> tuple[int | None, str]:
    """Fork `target(*args)`, SIGTERM it once it touches "ready" beside `err` (and `settle_s`
    later), and return its exit code and what it wrote to `err`."""
    import multiprocessing as mp

    p = mp.get_context("fork").Process(target=target, args=args)
    p.start()
    try:
        assert _wait_for(lambda: (err.parent / "ready").exists(), timeout=30)
        time.sleep(settle_s)
        os.kill(p.pid, signal.SIGTERM)
        p.join(timeout=30)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    return p.exitcode, err.read_text()


def _sigterm_while_blocked():
    """Rank 1 stops; rank 0, asked to stop cleanly (SIGTERM, as megapar-train's workers are),
    is blocked in a synchronous all-reduce that waits for rank 1 (the run's timeout: 120 s)."""
    import threading

    from megapar.faults.stop import install_stop_handlers
    from megapar.mesh import Layout, Mesh

    mesh = Mesh(Layout(2, 1, 1), dist.get_rank())
    install_stop_handlers("SIGTERM")
    dist.barrier()
    if mesh.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    dist.all_reduce(torch.zeros(1), group=mesh.tp_group)


def test_a_sigterm_ends_a_rank_blocked_in_a_wait_after_the_grace(monkeypatch):
    """A clean stop needs the step to end, which a wait that never completes prevents: the rank
    ends STOP_GRACE_S (1 s here) after the signal instead of when the wait times out (120 s;
    torchrun would SIGKILL it after 30 s, its --save lock left behind)."""
    from megapar.faults import stop

    monkeypatch.setattr(stop, "STOP_GRACE_S", 1.0, raising=False)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_local(_sigterm_while_blocked, 2, timeout_s=60, collective_timeout_s=120)
    assert time.monotonic() - start < 30
    # rank 0 exits 143 when the grace is up; the stopped rank 1 it waited for is the cause
    lines = str(info.value).splitlines()
    assert lines[0].startswith("rank 1 did not answer (it is stopped"), str(info.value)
    assert lines[1].startswith("(rank 0 exited with code 143 on a SIGTERM"), str(info.value)


def _watched_with_a_grace_of_1_s(err):
    """This process asks a SIGTERM for a clean stop with a grace of 1 s, its stderr to `err`,
    and says it is ready beside it."""
    from megapar.faults import stop

    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    stop.STOP_GRACE_S = 1.0
    stop.watch_sigterm()
    stop.install_stop_handlers("SIGTERM")
    (err.parent / "ready").touch()


def _sigterm_while_computing(err):
    """A rank asked to stop cleanly (SIGTERM) inside one long C call that runs no Python (as a
    CPU's backward of a large micro-batch can, for minutes): stderr to `err`."""
    import ctypes

    _watched_with_a_grace_of_1_s(err)
    # one C call that releases the GIL and runs no Python, as a torch kernel does (this one:
    # libc's usleep through ctypes, a minute, again after the signal cuts it short)
    kernel = ctypes.CDLL(None).usleep
    for _ in range(3):
        kernel(60_000_000)
    os._exit(0)


def test_a_sigterm_ends_a_rank_inside_a_long_computation_in_one_line(tmp_path):
    """A SIGTERM during a long step on a CPU (gpt2-124m, seq 1024, tp 2 x pp 2: minutes a step)
    printed each rank as "still blocked ... (a wait that cannot see the signal)" with 40 lines
    of stacks showing a backward, not a wait (a getting-started tryout). A computation is said
    as one: one line per rank naming the call, no stacks (they are for a wait); a process
    outside a job names no rank (it said "rank ?")."""
    err = tmp_path / "err.txt"
    exitcode, text = _sigterm_when_ready(_sigterm_while_computing, (err,), err, settle_s=0.5)
    assert exitcode == 143, (exitcode, text)
    assert text.count("\n") == 1 and "Python stacks" not in text, text
    assert text.startswith("megapar: SIGTERM ") and (  # one process: no rank to name
        " s ago and still computing at " in text) and (
        ", inside one call that runs no Python (_sigterm_while_computing at test_faults.py:"
        in text) and text.endswith(
        "so it could not stop at the step's end within the 1 s MEGAPAR_STOP_GRACE_S gives: "
        "exiting with code 143\n"), text


def _sigterm_while_waiting(err):
    """A rank asked to stop cleanly (SIGTERM) inside a wait (a sleep, as a store's or a
    collective's wait is): stderr to `err`."""
    _watched_with_a_grace_of_1_s(err)
    for _ in range(3):
        time.sleep(60)
    os._exit(0)


def test_a_sigterm_ends_a_rank_inside_a_wait_naming_the_grace(tmp_path):
    """A rank still blocked in a wait when the grace is up says which setting gave it the
    grace (a new user's finding: nothing named MEGAPAR_STOP_GRACE_S), then its stacks."""
    err = tmp_path / "err.txt"
    exitcode, text = _sigterm_when_ready(_sigterm_while_waiting, (err,), err, settle_s=0.5)
    assert exitcode == 143, (exitcode, text)
    assert " s ago and still blocked at " in text and "(a wait that cannot see the signal; " \
        "MEGAPAR_STOP_GRACE_S gives it 1 s): exiting with code 143; its Python stacks:" in text, \
        text


@pytest.mark.slow
def test_under_torchrun_a_stopped_rank_is_named_and_every_rank_exits(tmp_path, common,
                                                                    private_tmpdir):
    """torchrun, tp 2 x pp 2, --timeout-s 10, rank 1 SIGSTOPped mid-run: rank 0 used to sit in
    the grad-norm all-reduce of a subgroup (torch's 30 minutes), rank 3 in the tied embedding's
    (300 s), until torchrun's SIGKILL, with rank 0's --save lock left behind. Now every rank
    exits non-zero within 30 s, the stopped rank named, the lock released."""
    import re
    import subprocess

    log, ckpt, out = tmp_path / "log.jsonl", tmp_path / "ckpt", tmp_path / "out.txt"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "4", "-m", "megapar.cli.train", *common, "--tp", "2", "--pp", "2", "--timeout-s",
            "10", "--max-steps", "400", "--save", str(ckpt), "--save-interval", "2",
            "--log-json", str(log)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    with open(out, "w") as f:
        run = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        assert _wait_for(lambda: len(_steps(log)) >= 3 or run.poll() is not None), \
            out.read_text()
        ranks = {}
        for pid in _children(run.pid):
            with open(f"/proc/{pid}/environ", "rb") as f:
                env_of = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            ranks[int(env_of[b"RANK"])] = pid
        assert sorted(ranks) == [0, 1, 2, 3], out.read_text()
        start = time.monotonic()
        os.kill(ranks[1], signal.SIGSTOP)
        exits = {}
        while len(exits) < 4 and time.monotonic() - start < 60:
            exits.update({r: time.monotonic() - start for r, p in ranks.items()
                          if r not in exits and not _alive(p)})
            time.sleep(0.05)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    text = out.read_text()
    assert len(exits) == 4 and max(exits.values()) < 30, (exits, text)
    codes = dict(re.findall(r"rank\s+: (\d) \(local_rank: \d\)\s+exitcode\s+: (-?\d+)", text))
    assert sorted(codes) == ["0", "1", "2", "3"] and "0" not in codes.values(), (codes, text)
    assert "-9" not in codes.values(), (codes, text)  # nobody waited for torchrun's SIGKILL
    named = [x for x in text.splitlines() if re.match(
        r"megapar-train: error: rank \d failed at step \d+: on this node rank 1 \(pid \d+\) is "
        r"stopped \(SIGSTOP / SIGTSTP\?\); here: ", x)]
    assert named, text
    # every other rank that reports an error names it too, not only the first to find it
    # stopped (which continues it): torchrun's "root cause" may be any of them
    others = [x for x in text.splitlines() if re.match(r"megapar-train: error: rank [023] ", x)]
    assert others and all("on this node rank 1 (pid" in x for x in others), text
    # that record of the stopped rank goes once its job's agent is gone
    import tempfile

    from megapar.faults.blame import _MARKS_PREFIX, forget_stale_marks

    marks = f"{_MARKS_PREFIX}{run.pid}-*"
    assert list(Path(tempfile.gettempdir()).glob(marks)), text
    forget_stale_marks()
    assert not list(Path(tempfile.gettempdir()).glob(marks))
    assert not (ckpt / "megapar.lock").exists(), text


def test_an_exited_process_not_yet_reaped_is_not_alive():
    """A zombie (exited, its parent has not waited: a killed launcher's workers in a container
    whose PID 1 reaps late) owns no lock and no staging directory any more."""
    import time as _time

    from megapar.faults.processes import pid_alive

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = _time.monotonic() + 10
        while pid_alive(pid) and _time.monotonic() < deadline:
            _time.sleep(0.01)  # until it has exited (a zombie until the waitpid below)
        assert not pid_alive(pid)
        assert os.waitpid(pid, os.WNOHANG)[0] == pid  # it was a zombie: reaped only now
    finally:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    assert pid_alive(os.getpid())


@pytest.mark.parametrize("argv, expected", [
    (["--only"], "argument --only: expected at least one argument"),
    (["--only", "sigterm", "no-such-drill"], "argument --only: invalid choice: 'no-such-drill'"),
])
def test_fault_drill_with_no_or_unknown_drill_is_refused_before_any_work(tmp_path, argv, expected):
    """`tools/fault_drill.py --only` (no names) ran no drill, made a temporary directory and
    exited 0 as if the drills had passed."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "tools" / "fault_drill.py"
    out = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True,
                         env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=60)
    assert out.returncode == 2 and expected in out.stderr, (out.returncode, out.stderr)
    assert out.stdout == "" and not list(tmp_path.iterdir())


def test_ranks_that_returned_while_others_waited_are_named_as_the_cause():
    """A user's fn called engine.train_step on rank 0 only: rank 1 returned, rank 0 lost its
    peer inside the batch check's all-reduce. The report led with gloo's 'Connection closed by
    peer ... typically caused by a remote worker crashing' though no worker crashed."""
    from types import SimpleNamespace

    from megapar.faults.blame import blame

    procs = [SimpleNamespace(pid=0, exitcode=None), SimpleNamespace(pid=0, exitcode=0)]
    closed = ("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
              "[127.0.0.1]:14242. This is typically caused by a remote worker crashing.")
    statuses = ["step 1, train_step: checking the batch", "megapar.prepare returned; in the "
                "caller's code"]
    lines = blame(procs, {1: None}, {0: closed}, statuses).splitlines()
    assert lines[0] == (
        "rank 1 returned from the function while rank 0 still waited for it at step 1, "
        "train_step: checking the batch; every rank must make the same megapar calls (prepare, "
        "train_step, eval_step, save, load, export_hf, params_whole, poll_save, wait_save, "
        "stragglers) and collectives, in the same order")
    # gloo's source path and advice dropped (a Python API tryout)
    assert lines[1] == "rank 0 failed: RuntimeError: Connection closed by peer [127.0.0.1]:14242"
    procs.append(SimpleNamespace(pid=0, exitcode=0))
    lines = blame(procs, {1: None, 2: None}, {0: closed}, statuses + [""]).splitlines()
    assert lines[0].startswith("ranks 1 and 2 returned from the function while rank 0 still "
                               "waited for them at step 1")


def _optimizer_actions(layout: tuple, zero: int, kind: str) -> list[str]:
    """The `set_action` labels one training step of a tiny GPT-2 records for its optimizer
    step, at `layout` (tp, pp, dp) with ZeRO `zero` and `--optimizer kind`."""
    from test_parity_3d import CONFIG, MBS, SEED, SEQ, G, config, global_batches

    from megapar.data_parallel import build_grad_sync
    from megapar.mesh import Layout, Mesh
    from megapar.optim import Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.partition import build_stage
    from megapar.training import step as step_module

    mesh = Mesh(Layout(*layout), dist.get_rank() if dist.is_initialized() else 0)
    model = build_stage(config(), mesh, SEED)
    executor = PipelineExecutor(model, mesh, "1f1b", (MBS, SEQ, CONFIG["n_embd"]))
    optimizer = build_optimizer(model, mesh, 3e-3, 0.1, zero=zero, kind=kind)
    train = step_module.TrainStep(model, mesh, executor, optimizer, None,
                                  Precision("fp32", mesh.device), 1.0,
                                  build_grad_sync(model, mesh, zero))
    actions: list[str] = []
    original = step_module.set_action
    step_module.set_action = lambda what: (actions.append(what), original(what))[1]
    try:
        train.step(step_module.BatchPlan(G, MBS, mesh.dp).split(global_batches()[0],
                                                                mesh.dp_rank), 0)
    finally:
        step_module.set_action = original
    return [a for a in actions if a.startswith("optimizer step")]


def test_the_optimizer_steps_action_names_only_the_collectives_it_runs(run):
    """What a rank hung in the optimizer step is said to be doing names the collectives that
    step runs: none for AdamW without ZeRO (it read "ZeRO / trust-ratio collectives" for every
    optimizer), ZeRO's over dp x cp when sharded, LAMB's trust-ratio all-reduces."""
    assert _optimizer_actions((1, 1, 1), 0, "adamw") == ["optimizer step"]
    assert _optimizer_actions((1, 1, 1), 0, "lamb") == [
        "optimizer step (lamb's trust-ratio all-reduces)"]
    assert run(_optimizer_actions, 2, (1, 1, 2), 1, "adamw") == [
        ["optimizer step (ZeRO's collectives over dp x cp)"]] * 2


def _run_1_finds_rank_1_stopped():
    """Run 1's rank: at step 3 it finds its sibling rank 1 stopped (and continues it)."""
    rank_status.set_step(3)
    rank_status.set_action("forward of micro-batch 0")
    from megapar.faults.blame import stopped_siblings

    return stopped_siblings()


def _run_2_says_what_it_knows():
    """Run 2's rank: its status and the stopped ranks of its node, as a timed-out wait asks."""
    from megapar.faults.blame import stopped_siblings

    return rank_status.status(), stopped_siblings()


def test_two_runs_in_one_process_keep_their_own_status_and_stopped_rank_records(
        tmp_path, private_tmpdir):
    """Two runs in sequence in one process under torchrun's environment (a test runner's, a
    notebook's): the second one's status said the first one's step ("step 3, joined the
    process group"), and its stopped-rank records named the rank the first one had found
    stopped, long since continued ("on this node rank 1 (pid P) is stopped"). Each run now
    has its own: a fresh status, the records of its own ranks."""
    import subprocess

    from forked import exit_code

    from megapar.launcher import free_port, run_workers

    sibling = subprocess.Popen(["sleep", "60"], env={**os.environ, "RANK": "1"})
    out = tmp_path / "out.txt"
    said = tmp_path / "said.json"

    def both_runs():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1")
        runs = []
        for fn in (_run_1_finds_rank_1_stopped, _run_2_says_what_it_knows):
            os.environ["MASTER_PORT"] = str(free_port())
            runs.append(run_workers(fn, 1)[0])
        said.write_text(json.dumps(runs))
        return 0

    try:
        os.kill(sibling.pid, signal.SIGSTOP)
        assert _wait_for(lambda: _state(sibling.pid) == "T", timeout=10)
        code = exit_code(fork_running(both_runs, out))
        assert code == 0, out.read_text()
        first, (status, stopped) = json.loads(said.read_text())
    finally:
        sibling.kill()
        sibling.wait()
    assert first == f"on this node rank 1 (pid {sibling.pid}) is stopped (SIGSTOP / SIGTSTP?)"
    assert (status, stopped) == ("setting up after joining the process group", ""), \
        out.read_text()


def test_a_skipped_step_does_not_advance_the_lr_schedule_and_a_resume_keeps_the_lag(
        tmp_path, common):
    """An fp16 step made to overflow (an inf injected in an attention output at step 2) is
    skipped and leaves the schedule where it was: step 3 trains at step 2's warmup lr, and a
    run resumed from step 3's checkpoint goes on one position behind the step count."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    args = [*common, "--precision", "fp16", "--lr", "1e-3", "--warmup-steps", "4",
            "--lr-decay-steps", "10", "--log-json", str(log)]
    inject = ["--inject-corrupt", "step=2,module=transformer.h.1.attn,value=inf"]
    assert main([*args, *inject, "--max-steps", "3", "--save", str(ckpt)]) == 0
    from megapar.checkpoint.convert import checkpoint_info  # megapar-convert --info says so

    assert "\nstep        3 (the lr schedule at step 2: 1 step skipped)\n" in checkpoint_info(
        ckpt, checksums=False)
    assert main([*args, "--max-steps", "4", "--load", str(ckpt)]) == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(m["step"], m["skipped"]) for m in lines] == [
        (1, False), (2, True), (3, False), (4, False)]
    lrs = [m["lr"] for m in lines]  # warmup position s trains at 1e-3 x (s + 1) / 4
    assert lrs == pytest.approx([2.5e-4, 5e-4, 5e-4, 7.5e-4], rel=1e-12)


def test_exit_signals_take_names_and_numbers_and_refuse_what_cannot_be_caught():
    """--exit-signals 15 said 'SIG15 is not a signal that can be caught' (a new user's finding):
    numbers are taken as kill -l gives them; SIGKILL / SIGSTOP (by name or number) and a number
    no signal has are refused in one line."""
    import signal

    from megapar.faults.stop import parse_signals

    assert parse_signals("15, usr1") == [signal.SIGTERM, signal.SIGUSR1]
    assert parse_signals("") == []
    for spec, message in (("9", "SIGKILL is not a signal that can be caught"),
                          ("stop", "SIGSTOP is not a signal that can be caught"),
                          ("999", "999 is not a signal number here; use names")):
        with pytest.raises(ValueError, match=message):
            parse_signals(spec)


def test_a_failure_log_that_save_cannot_hold_goes_to_the_cache(tmp_path):
    """--save replaced by a file under the run (or made read-only): its failure line ended
    without naming any log; the log goes to the cache's log directory of the run instead."""
    from megapar.cli import train as train_cli
    from megapar.training.config import parse_args

    (tmp_path / "ckpt").write_text("a file now")
    cfg = parse_args(["--save", str(tmp_path / "ckpt"), "--data-cache", str(tmp_path / "cache")])
    text = "rank 1 failed: CheckpointError: cannot create a staging directory\nTraceback ..."
    line, log = train_cli._failure_log(cfg, [], text, None)
    assert line == "rank 1 failed before training started: CheckpointError: cannot create a " \
                   "staging directory"
    assert log is not None and log.startswith(str(tmp_path / "cache" / "logs" / "run-"))
    assert log.endswith("rank1.log") and open(log).read().startswith(text)



def test_a_timeout_under_a_bound_below_a_second_names_the_bound(tmp_path):
    """--timeout-s 0.01: a wait of 10 ms timed out at step 1 ("Timed out waiting 10ms for recv
    operation to complete") with no word on the bound given; the line says it may be too short.
    Not at the default bound, nor for another error."""
    from megapar.cli import train as train_cli
    from megapar.training.config import parse_args

    text = "rank 0 failed: step 1: RuntimeError: Timed out waiting 10ms for recv operation\nTb"
    for flags, said in ((["--timeout-s", "0.01"], True), ([], False)):
        cfg = parse_args([*flags, "--data-cache", str(tmp_path / "cache")])
        line, _ = train_cli._failure_log(cfg, [], text, None)
        assert line.endswith("(--timeout-s 0.01 bounds every wait on other ranks: under 1 s it "
                             "may be too short for them to answer; raise it)") is said, line
    cfg = parse_args(["--timeout-s", "0.01", "--data-cache", str(tmp_path / "cache")])
    line, _ = train_cli._failure_log(cfg, [], "rank 0 failed: ValueError: bad\nTb", None)
    assert "--timeout-s" not in line, line


def test_gloo_noise_is_left_out_of_a_ranks_error():
    """A reviewer's two-node drill: the lines carried gloo's source path and advice
    ("[/__w/pytorch/.../pair.cc:553] ... This is typically caused by a remote worker crashing.
    Check the logs of the remote worker before reporting an error. GLHF! 🏖️"), up to 900
    characters; the fact (the connection closed, by which peer) stays."""
    from megapar.faults.blame import without_gloo_noise

    gloo = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
            "closed by peer [127.0.0.1]:62852. This is typically caused by a remote worker "
            "crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️")
    assert without_gloo_noise(f"RuntimeError: {gloo}; any save in flight is lost") == (
        "RuntimeError: Connection closed by peer [127.0.0.1]:62852; any save in flight is lost")
    assert without_gloo_noise(f"P2PTimeoutError: it failed ({gloo}); a peer") == (
        "P2PTimeoutError: it failed (Connection closed by peer [127.0.0.1]:62852); a peer")
    timed = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed "
             "out waiting 30000ms for recv operation to complete")
    assert without_gloo_noise(timed) == (
        "RuntimeError: Timed out waiting 30000ms for recv operation to complete")
    assert without_gloo_noise("KeyError: 'x'") == "KeyError: 'x'"
    reset = ("RuntimeError: Read error [127.0.0.1]:23953: Connection reset by peer. This is "
             "typically caused by a remote worker hanging or bugs in the application. Check the "
             "logs of the remote worker before reporting an error. GLHF! 🏖️")  # its other words
    assert without_gloo_noise(reset) == (
        "RuntimeError: Read error [127.0.0.1]:23953: Connection reset by peer")


def test_a_lost_connection_in_the_report_is_said_without_gloo_s_noise():
    """A user's collective on some ranks only: the cause came first, then the waiting rank's
    gloo error with its source path and advice ("[.../pair.cc:553] ... GLHF! 🏖️"), which the
    report says in its own words (a Python API tryout): those are dropped there too."""
    from types import SimpleNamespace

    from megapar.faults.blame import blame

    procs = [SimpleNamespace(pid=0, exitcode=0) for _ in range(3)]
    gloo = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
            " Connection closed by peer [127.0.0.1]:1234. This is typically caused by a remote "
            "worker crashing. Check the logs of the remote worker before reporting an error. "
            "GLHF! \U0001f3d6\ufe0f")
    lines = blame(procs, {1: None}, {0: gloo + "\nTraceback ...", 2: gloo}).splitlines()
    assert lines[0].startswith("rank 1 returned from the function while rank 0 still waited")
    assert lines[1:] == ["rank 0 failed: RuntimeError: Connection closed by peer "
                         "[127.0.0.1]:1234", "Traceback ...",
                         "then: rank 2: RuntimeError: Connection closed by peer "
                         "[127.0.0.1]:1234"], lines


def test_an_inject_corrupt_stage_that_does_not_hold_the_module_is_refused():
    """`--inject-corrupt step=3,module=transformer.h.1.mlp,pp=1` at --pp 2 (h.1 is on stage 0)
    corrupted nothing and the run passed (a new user's finding): the rank of that stage refuses
    it, naming what the stage holds by names a spec may give (lm_head, which it named, is
    refused as a module; a re-test); the stage that holds it arms its hook."""
    from transformers import GPT2Config

    from megapar.diagnostics import inject
    from megapar.mesh import Layout, Mesh
    from megapar.models.config import config_from_dict
    from megapar.pipeline.partition import build_stage

    config = config_from_dict(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4,
                                         n_head=4, bos_token_id=0, eos_token_id=0).to_dict())
    layout = Layout(1, 2, 1)
    for pp, refused in ((0, False), (1, True)):
        mesh = Mesh.virtual(layout, rank=pp, device="cpu")
        stage = build_stage(config, mesh, seed=0)
        spec = inject.check(f"step=3,module=transformer.h.1.mlp,pp={pp}", config, layout)
        if refused:
            with pytest.raises(ValueError, match=r"--inject-corrupt: transformer.h.1.mlp is not "
                               r"on pp stage 1 \(it holds transformer.h.2 to transformer.ln_f\); "
                               r"give the pp= of the stage that holds it, or leave pp= out"):
                inject.CorruptInjector(spec, stage, config, mesh)
        else:
            assert len(inject.CorruptInjector(spec, stage, config, mesh).modules) == 1


def test_an_output_that_is_a_link_to_nothing_is_named_so(tmp_path):
    """--save LINK to a directory not there was "not writable (... is a file, not a
    directory)", and a loop of links "a link to loop2, which does not exist" (a re-test)."""
    from megapar.training.validate import check_writable

    os.symlink(tmp_path / "nowhere", tmp_path / "ckpt")
    os.symlink(tmp_path / "loop2", tmp_path / "loop1")
    os.symlink(tmp_path / "loop1", tmp_path / "loop2")
    os.symlink("ckpt", tmp_path / "chain")
    for path, kind, said in (
            (tmp_path / "ckpt", "dir", f"--out {tmp_path / 'ckpt'}: {tmp_path / 'ckpt'} is a "
             f"link to {tmp_path / 'nowhere'}, which does not exist; give another directory, or "
             f"remove the link"),
            (tmp_path / "loop1", "file", f"--out {tmp_path / 'loop1'}: {tmp_path / 'loop1'} is "
             f"a link in a loop of links; give another file name, or remove the link"),
            # below one too (it was "... is a file, not a directory"), and a chain to nothing
            (tmp_path / "ckpt" / "x", "dir", f"--out {tmp_path / 'ckpt' / 'x'}: "
             f"{tmp_path / 'ckpt'} is a link to {tmp_path / 'nowhere'}, which does not exist; "
             f"give another directory, or remove the link"),
            (tmp_path / "chain", "dir", f"--out {tmp_path / 'chain'}: {tmp_path / 'chain'} is "
             f"a link to ckpt, which leads nowhere; give another directory, or remove the link")):
        with pytest.raises(ValueError) as info:
            check_writable(str(path), "--out", kind)
        assert str(info.value) == said
    # --save's check of what holds it (a rehearsal's too) resolved a loop: a traceback
    from types import SimpleNamespace

    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import _check_save_outside_checkpoint

    with pytest.raises(UsageError, match="loop1 is a link in a loop of links; give another "
                       "directory, or remove the link"):
        _check_save_outside_checkpoint(SimpleNamespace(save=str(tmp_path / "loop1")))
