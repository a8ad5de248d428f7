"""Which rank to blame when local workers fail: the cause first, then the ranks that followed.

A worker killed by a signal never reports; the ranks blocked in a collective with it fail a
moment later with connection errors or timeouts. `blame` puts the cause first: a rank that died
(with its signal or exit code), else a rank whose error is its own, else the live ranks that never
answered while the others timed out: the stopped ones (from /proc) when there are any, since the
others are still waiting for them, else the one most likely holding the others up
(`most_behind`: the earliest step, then busy in its own work rather than waiting for another
rank, then using CPU), named with its step and action.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from megapar.faults.processes import cpu_ticks, pid_alive, sibling_ranks, stopped
from megapar.wording import and_list

CUT_SHORT = 128 + signal.SIGTERM
"""A rank's exit code where `megapar.faults.stop` cut it short: still blocked in a wait when a
stop's grace was up."""


JOIN_BOUND_EXIT = 124
"""A rank's exit code where its wait to join a gloo process group ran out (`device.connect_bound`,
which writes its own line first; timeout(1)'s code)."""


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} ({-exitcode})"
    if exitcode == CUT_SHORT:  # megapar.faults.stop's exit of a rank it cut short
        return (
            f"exited with code {exitcode} on a SIGTERM (a rank still blocked in a wait when "
            f"the stop's grace is up exits so, writing its stacks)"
        )
    if exitcode == JOIN_BOUND_EXIT:  # its line above says how long and why
        return f"exited with code {exitcode}: its wait to join ran out (its own line above)"
    return f"exited with code {exitcode} without reporting an error"


def state(proc) -> str:
    """ "is stopped (SIGSTOP?)" when a live worker is stopped (Linux /proc), else ""."""
    return "is stopped (SIGSTOP / SIGTSTP?)" if stopped(proc.pid) else ""


_LOST = ("connection closed", "connection reset", "broken pipe", "connection refused")
"""Words of an error that says a connection was lost (by a peer that failed or gave up)."""

_CONSEQUENTIAL = (
    "timed out",
    "timeout",
    *_LOST,
    "did not complete",
    "gave up waiting",  # a rank's own error naming the rank it waited for (`progress`)
)

_PEER = re.compile(r"\bpeers?\b")
"""A lost peer ("closed by peer"): the word, not the letters (a TypeError's name holds them)."""


SAME_CALLS = (
    "every rank must make the same megapar calls (prepare, train_step, eval_step, save, load, "
    "export_hf, params_whole, poll_save, wait_save, stragglers) and collectives, in the same order"
)
"""What a report says where a rank returned from the function while the others waited."""


def blame(
    procs,
    outputs: dict,
    errors: dict,
    statuses: list[str] | None = None,
    place: Callable[[int], str] | None = None,
) -> str:
    """The failure report: first the cause, then the ranks that failed because of it.

    Cause, in order: ranks that died without a report (their signal / exit code, and from
    `statuses`, each rank's last "step S, action", where they were); ranks whose error is not a
    communication timeout or lost connection (led by the rank an error every rank raised names
    as its origin, `_ORIGIN`); live ranks that never answered while the others
    timed out waiting for them: the stopped ones when some are, else the one most likely
    holding the others up (`most_behind`), each with where it was; ranks that returned while
    the others, still in a collective, lost their connection to them (a call made on some ranks
    only). `place`: where a rank sits in the job's mesh ("tp rank 0, pp rank 1, dp rank 0 of
    tp=1 pp=2 dp=2", `megapar.mesh.Layout.place`), named beside a rank that died or never
    answered (a rank's own error names its place itself)."""

    def named(r: int) -> str:
        return f"rank {r} ({place(r)})" if place is not None else f"rank {r}"

    def where(r: int) -> str:
        last = statuses[r] if statuses and r < len(statuses) else ""
        return f" at {last}" if last else ""

    dead = {
        r: _how(p.exitcode) + where(r)
        for r, p in enumerate(procs)
        if r not in outputs and r not in errors and p.exitcode not in (None, 0)
    }
    own = {r: e for r, e in errors.items() if not consequential(e)}
    silent = [
        r for r, p in enumerate(procs) if r not in outputs and r not in errors and r not in dead
    ]
    stuck = [r for r in silent if state(procs[r])]
    if dead and stuck and all(procs[r].exitcode == CUT_SHORT for r in dead):
        # a stop's grace ran out on ranks waiting for a stopped one: the stopped rank is the
        # cause, their exits its consequence
        lines = [f"{named(r)} did not answer (it {state(procs[r])}){where(r)}" for r in stuck]
        lines += [f"(rank {r} {how}, waiting for it)" for r, how in sorted(dead.items())]
        rest = errors
    elif dead:
        lines = [f"{named(r)} {how}" for r, how in sorted(dead.items())]
        rest = errors
    elif own:
        first = min(own)
        origin = _ORIGIN.search(own[first].split("\n", 1)[0])
        if origin is not None and int(origin.group(1)) in own:  # a collective report of it
            first = int(origin.group(1))
        lines = [f"rank {first} failed: {own[first]}"]
        rest = {r: e for r, e in errors.items() if r != first}
    elif silent and errors:
        causes = stuck or [most_behind(procs, silent, statuses or [])]
        lines = [
            f"{named(r)} did not answer"
            + (f" (it {state(procs[r])})" if r in stuck else "")
            + where(r)
            for r in causes
        ]
        if len(causes) < len(silent):  # waiting for it, their timeout not yet up
            waiting = [r for r in silent if r not in causes]
            lines.append(
                f"({_rank_words(waiting)} {'was' if len(waiting) == 1 else 'were'} still waiting)"
            )
        rest = errors
    else:  # every error a timeout or a lost connection: a timeout is the cause of the other
        first = min((r for r in errors if not lost_connection(errors[r])), default=min(errors))
        lines = [f"rank {first} failed: {without_gloo_noise(errors[first])}"]
        rest = {r: e for r, e in errors.items() if r != first}
        if outputs:  # they lost a peer that had returned: a call made on some ranks only
            done = sorted(outputs)
            lines.insert(
                0,
                f"rank{'s' if len(done) > 1 else ''} {_ranks(done)} returned from the function "
                f"while rank {first} still waited for {'them' if len(done) > 1 else 'it'}"
                f"{where(first)}; {SAME_CALLS}",
            )
    same = [r for r, e in rest.items() if _gist(e) == _gist(lines[-1])]
    if same:
        lines.append(f"({_rank_words(sorted(same))} stopped for the same reason)")
    rest = {r: e for r, e in rest.items() if r not in same}
    if rest:
        lines.append(
            "then: "
            + "; ".join(
                f"rank {r}: {shortened(without_gloo_noise(e.splitlines()[0]), 300)}"
                for r, e in sorted(rest.items())
            )
        )
    return "\n".join(lines)


_WAITS = re.compile(
    r"\b(waiting|joining|recv_\w+|send_\w+|receiving|sending|all-reduce|all-gather|"
    r"reduce-scatter|broadcast|barrier|collectives)\b"
)
"""Words of a rank's action (`megapar.faults.status`) that say it waits for other ranks: a
collective, a pipeline message, the process group. Other actions are its own work (a forward,
a backward, a save)."""

BUSY_SAMPLE_S = 0.2
"""How long `most_behind` watches the CPU time of ranks it cannot tell apart otherwise."""

BUSY_SHARE = 0.1
"""The share of a CPU above which a rank counts as computing (2 clock ticks in
`BUSY_SAMPLE_S`): below it, a watchdog's or a heartbeat's wake-ups."""


def waits(status: str) -> bool:
    """Whether a rank's status ("step S, action") says it waits for other ranks."""
    return bool(_WAITS.search(status.split(", ", 1)[-1] if status.startswith("step ") else status))


def step_of(status: str) -> int:
    """The step of a rank's status ("step S, action"); 0 when it has none (not training yet)."""
    match = re.match(r"step (\d+), ", status)
    return int(match.group(1)) if match else 0


def most_behind(procs, ranks: list[int], statuses: list[str]) -> int:
    """Of the live local `ranks` that did not answer, the one most likely holding the others
    up (`behind_first`), the CPU each used read from /proc during `BUSY_SAMPLE_S`."""

    def used(alike: list[int]) -> dict[int, float]:
        before = {r: cpu_ticks(procs[r].pid) for r in alike}
        time.sleep(BUSY_SAMPLE_S)
        ticks = {r: (cpu_ticks(procs[r].pid) or 0) - (before[r] or 0) for r in alike}
        per_s = os.sysconf("SC_CLK_TCK") * BUSY_SAMPLE_S
        return {r: ticks[r] / per_s if before[r] is not None else 0.0 for r in alike}

    return behind_first(ranks, dict(enumerate(statuses)), used)


def behind_first(
    ranks: list[int], statuses: dict[int, str], busy: Callable[[list[int]], dict[int, float]]
) -> int:
    """Of `ranks` that did not answer, the one most likely holding the others up: the
    earliest step (a rank cannot wait for one that already finished that step), then one busy
    in its own work (a forward, a backward) before one that waits for other ranks, then, among
    those still alike, the one whose process used the most CPU (`busy(alike)`: {rank: share of
    a CPU}, counted from `BUSY_SHARE`: computing, as a slow rank does, where one blocked in a
    wait uses none: a tp peer waits inside its forward); then the lowest rank. `statuses`:
    each rank's "step S, action" (`megapar.faults.status`)."""

    def key(r: int) -> tuple[int, bool]:
        status = statuses.get(r, "")
        return step_of(status), waits(status)

    first = min(key(r) for r in ranks)
    alike = sorted(r for r in ranks if key(r) == first)
    if len(alike) == 1:
        return alike[0]
    used = busy(alike)
    share = {r: used.get(r, 0.0) if used.get(r, 0.0) >= BUSY_SHARE else 0.0 for r in alike}
    return max(alike, key=lambda r: (share[r], -r))


_GLOO_SOURCE = re.compile(r"\[[^\]\s]*/gloo/[^\]\s]*\] ")
_GLOO_ADVICE = re.compile(
    r"\.? ?This is typically caused by a remote worker [^.]*\.(?: Check the logs of the "
    r"remote worker before reporting an error\.)?(?: GLHF!(?: [^\s;,)]+)?)?"
)


def without_gloo_noise(text: str) -> str:
    """`text` without what gloo adds to a lost connection's error beside the fact: its source
    file (`[/__w/pytorch/.../gloo/transport/tcp/pair.cc:553] `) and its advice ("This is
    typically caused by a remote worker crashing." or "... hanging or bugs in the application.",
    "Check the logs ... GLHF!"), which megapar's line says in its own words (which rank, and to
    look for its error)."""
    return _GLOO_ADVICE.sub("", _GLOO_SOURCE.sub("", text))


def lost_connection(error: str) -> bool:
    """Whether an error (its first line) is a lost connection, not a wait that timed out: the
    peer that timed out closed it."""
    first = error.split("\n", 1)[0].lower()
    return any(w in first for w in _LOST) or _PEER.search(first) is not None


def shortened(text: str, most: int) -> str:
    """`text` cut to at most `most` characters at a word's end, with " ..." where cut."""
    if len(text) <= most:
        return text
    return text[: most - 4].rsplit(" ", 1)[0] + " ..."


def consequential(error: str) -> bool:
    """Whether an error (its first line) is a communication timeout or a lost connection: what
    a rank reports when another one stopped answering or died."""
    first = error.split("\n", 1)[0].lower()
    return any(w in first for w in _CONSEQUENTIAL) or _PEER.search(first) is not None


def stopped_siblings() -> str:
    """Under torchrun / srun, where no launcher of ours watches the ranks: which ranks on this
    node are stopped (SIGSTOP / SIGTSTP), as "on this node rank 1 (pid P) is stopped (SIGSTOP /
    SIGTSTP?)", or "". A rank that timed out waiting calls it to name the cause. Each is sent
    SIGCONT, so that it sees that the run failed and ends too, releasing what it holds (its
    --save lock), instead of when torchrun's SIGKILL comes 30 s after the SIGTERM it cannot
    act on while stopped. A rank found stopped is first marked in the run's records
    (`StoppedMarks`), so that the ranks that time out after it was continued name it too:
    every rank's error, the first of which torchrun reports as the root cause, names the
    stopped one."""
    marks = _run_marks
    found = {}
    for rank, pid in sorted(sibling_ranks().items()):
        if stopped(pid):
            found[rank] = pid
            marks.mark(rank, pid)
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
    for rank, pid in marks.marked().items():
        found.setdefault(rank, pid)
    names = [
        f"rank {rank} (pid {pid}) is stopped (SIGSTOP / SIGTSTP?)"
        for rank, pid in sorted(found.items())
    ]
    return f"on this node {', '.join(names)}" if names else ""


_MARKS_PREFIX = f"megapar-{os.getuid()}-stopped-"


class StoppedMarks:
    """One run's record, on this node, of the ranks found stopped (`stopped_siblings`), shared
    by its ranks there: a directory named by the parent (torchrun's agent, the srun step), the
    restart count and `run`, the token the run's ranks agreed on, so that another run of the
    same parent (runs in sequence in one process: a test runner's, a notebook's) never reads
    it."""

    def __init__(self, run: str) -> None:
        self.run = run

    def path(self) -> Path:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        name = f"{_MARKS_PREFIX}{os.getppid()}-{attempt}-{self.run}"
        return Path(tempfile.gettempdir()) / name

    def mark(self, rank: int, pid: int) -> None:
        """Record rank `rank` (process `pid`) as found stopped."""
        try:
            path = self.path()
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            (path / f"{rank}-{pid}").touch()
        except OSError:
            pass

    def marked(self) -> dict[int, int]:
        """{rank: pid} of the ranks this run's ranks on this node found stopped."""
        found: dict[int, int] = {}
        try:
            for mark in self.path().iterdir():
                rank_text, _, pid_text = mark.name.partition("-")
                if rank_text.isdigit() and pid_text.isdigit():
                    found[int(rank_text)] = int(pid_text)
        except OSError:
            pass
        return found


def new_run_token() -> str:
    """A token naming one run (`begin_marks`)."""
    return secrets.token_hex(6)


_run_marks = StoppedMarks(new_run_token())
"""The stopped-rank records of the run this process is in now (`begin_marks`)."""


def begin_marks(run: str | None = None) -> StoppedMarks:
    """Start this process's stopped-rank records of a new run: `run`, the token its ranks on
    this node agreed on (default: a new one of this process's own, until they have)."""
    global _run_marks
    _run_marks = StoppedMarks(run or new_run_token())
    return _run_marks


def forget_stale_marks() -> None:
    """Remove the records of `stopped_siblings` whose parent (a finished job's agent) is gone:
    called as a rank starts under torchrun / srun."""
    try:
        entries = list(Path(tempfile.gettempdir()).glob(f"{_MARKS_PREFIX}*"))
    except OSError:
        return
    for entry in entries:
        parent = entry.name[len(_MARKS_PREFIX) :].split("-")[0]
        if parent.isdigit() and not pid_alive(int(parent)):
            shutil.rmtree(entry, ignore_errors=True)


def _rank_words(ranks: list[int]) -> str:
    """ "rank 1", or "ranks 1, 2 and 3"."""
    return f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}"


def _ranks(ranks: list[int]) -> str:
    """The ranks in words: 1, or 1, 2 and 3."""
    return and_list([str(r) for r in ranks])


_ORIGIN = re.compile(r": rank (\d+): \w+(Error|Exception)\b")
"""Where every rank raises one error that names the rank where it arose (a checkpoint save:
"checkpoint of step 4 not saved: rank 2: RuntimeError: ..."): that rank."""


def _gist(text: str) -> str:
    """An error's first line without the rank that reported it."""
    line = text.splitlines()[0] if text else ""
    return re.sub(r"rank \d+( \([^)]*\))?", "rank", line.split(" failed: ", 1)[-1])
