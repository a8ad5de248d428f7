"""Under torchrun / srun: each rank's step and action in the job's store, and the rank holding the
others up named from them.

megapar's own launcher reads every rank's status from memory it shares with its workers
(`megapar.faults.status`) and names the rank most behind when the others time out
(`megapar.faults.blame.most_behind`). Under torchrun / srun there is no such launcher and the
ranks may be on several nodes; what they all reach is the store torch.distributed's rendezvous
made (torchrun's agent store at MASTER_ADDR:MASTER_PORT, or rank 0's under srun). So each rank
publishes a small JSON record there ("step S, action", the share of a CPU its process used since
the record before, whether it has failed, and a heartbeat count): a daemon thread, every
`PUBLISH_S`, when the record changed and at least every `HEARTBEAT_S`, so the training loop
itself does nothing more per micro-batch. A rank whose wait timed out marks its own record
failed and reads every other rank's (`holding_up`): the one most behind by `blame.most_behind`'s
rule is named as the local launcher names it ("rank 3 did not answer at step 2, forward of
micro-batch 0 on pp stage 0"), and, when its heartbeat did not advance while the reader waited
`heartbeat_wait_s()`, as one whose process has stopped (frozen, or its node lost): what /proc
tells of a rank on this node, told of one on any. Every store call goes through this module's
own connection, with a timeout of `STORE_TIMEOUT_S`, a record is read only once the store says
it exists, and the report waits for its reads at most twice that on a thread of its own
(`_bounded`): a store that does not answer (its node frozen) is given up on.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from megapar.faults import status as _status
from megapar.faults.blame import BUSY_SHARE, SAME_CALLS, behind_first
from megapar.faults.processes import gone_siblings

PUBLISH_S = 1.0
"""How often the publishing thread looks at its rank's status (and sends it when it changed).
A hang is seen only after a collective's timeout (`--timeout-s`, far longer), so a record
is at most this much behind what the rank was doing when the others gave up."""

HEARTBEAT_S = 5.0
"""The longest a live rank goes without sending its record: a rank whose record did not change
over a longer wait has stopped (at one store write per rank per 5 s, a job of 4,096 ranks sends
the store about 800 a second)."""

STORE_TIMEOUT_S = 5.0
"""The longest any one store call (connection, write, read) of this module waits."""

_KEY = "megapar/progress"
T = TypeVar("T")


class ProgressRecords:
    """This rank's record in the store, published by a daemon thread, and the others' read."""

    def __init__(self, store, rank: int, world_size: int):
        """`store`: a connection to the job's store of its own (`connect`), `rank` this one's."""
        self.store, self.rank, self.world_size = store, rank, world_size
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's restarts
        self.prefix = f"{_KEY}/{attempt}/"
        self.failed = False
        self.returned = False  # the function returned on this rank (`mark_returned`)
        self.error = ""  # its own error's first line when it failed of itself
        self.found = ""  # the stopped ranks of its node it found when its wait timed out
        self.named = ""  # the rank holding the others up it named (`holding_up`)
        self._lock = threading.Lock()  # the thread's publish and `mark_failed`'s
        self._sent = ""
        self._sent_at = 0.0  # time.monotonic() of the last send
        self._beat = 0
        self._stop = threading.Event()
        self._cpu = (time.monotonic(), time.process_time())
        self.lost = False  # the connection to the store broke (its process is gone)

    def key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def record(self) -> dict:
        """This rank's record now: its status, the share of a CPU its process used since the
        record before (every thread: a rank computing uses one, a rank blocked in a wait
        none), the CPU seconds its process has used in all and when (`cpu_s`, `at`: this
        node's monotonic clock; the share over a longer time, `cpu_share`), whether it
        failed."""
        wall, cpu = time.monotonic(), time.process_time()
        share = (cpu - self._cpu[1]) / max(wall - self._cpu[0], 1e-3)
        self._cpu = (wall, cpu)
        record = {
            "status": _status.status(),
            "cpu": round(share, 2),
            "cpu_s": round(cpu, 3),
            "at": round(wall, 3),
            "failed": self.failed,
            **({"returned": True} if self.returned else {}),
        }
        if self.found:
            record["found"] = self.found
        if self.named:
            record["named"] = self.named
        return {**record, "error": self.error} if self.error else record

    def publish(self) -> None:
        """Send this rank's record when its status, its failure or whether it computes changed,
        or `HEARTBEAT_S` after the last send, with its heartbeat count one up (bounded by the
        store's timeout; a store gone is ignored: once its connection broke, nothing more is
        sent, since torch's client does not reconnect and prints a C++ stack for every try)."""
        with self._lock:
            if self.lost:
                return
            record = self.record()
            same = {**record, "cpu": record["cpu"] >= BUSY_SHARE, "cpu_s": 0, "at": 0}
            text, now = json.dumps(same), time.monotonic()
            if text == self._sent and now - self._sent_at < HEARTBEAT_S:
                return
            self._beat += 1
            try:
                self.store.set(self.key(self.rank), json.dumps({**record, "beat": self._beat}))
                self._sent, self._sent_at = text, now
            except dist.DistNetworkError:  # the store's process is gone (its agent exited)
                self.lost = True
            except (RuntimeError, ValueError):  # DistError: the store is slow
                pass

    def start(self) -> None:
        """Publish now, then every `PUBLISH_S` on a daemon thread until `stop`."""
        self.publish()

        def loop() -> None:
            while not self._stop.wait(PUBLISH_S):
                self.publish()

        threading.Thread(target=loop, name="megapar-progress", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def mark_failed(self, error: str = "", found: str = "") -> None:
        """Say in the store that this rank has failed: of itself (`error`: its first line),
        which the ranks that time out after it then name; or (no `error`) its wait timed out,
        and they do not name it (it waited, and it is no longer there to answer), but name
        what it `found`: the stopped ranks of its node (`blame.stopped_siblings`), which
        ranks on other nodes cannot see (a stopped rank, continued, may have exited since)."""
        self.failed, self.error = True, error.split("\n", 1)[0][:300]
        self.found = found[:300]
        self.publish()

    def mark_returned(self) -> None:
        """Say in the store that the function returned on this rank: ranks still waiting for
        it name that rather than a rank that stopped answering."""
        self.returned = True
        self.publish()

    def read(self) -> dict[int, dict]:
        """{rank: record} of every other rank that has one (bounded by the store's timeout);
        none once the connection to the store broke."""
        if self.lost:
            return {}
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [self.key(r) for r in others]
        try:
            if self.store.check(keys):  # all there: one round trip
                values = dict(zip(others, self.store.multi_get(keys), strict=True))
            else:  # a rank never published (it died starting): only those there
                values = {
                    r: self.store.get(k)
                    for r, k in zip(others, keys, strict=True)
                    if self.store.check([k])
                }
        except dist.DistNetworkError:
            self.lost = True
            return {}
        except (RuntimeError, ValueError):
            return {}
        records = {}
        for r, value in values.items():
            try:
                records[r] = json.loads(value)
            except ValueError:
                continue
        return records

    def _fail_and_read(self) -> dict[int, dict]:
        self.mark_failed()
        return self.read()

    def holding_up(self) -> str:
        """`_holding_up`'s line, recorded for the ranks that fail after this one (`named`):
        they give the same, the rank named too when it fails in the end."""
        named = self._holding_up()
        if named:
            self.named = named[:300]
            _bounded(self.publish, STORE_TIMEOUT_S, None)
        return named

    def _holding_up(self) -> str:
        """After this rank's wait timed out: "rank R did not answer at step S, action", the
        live rank most likely holding the others up, from the others' records read twice,
        `heartbeat_wait_s()` apart: a rank that failed of itself, else the rank another one
        named before (`named`: the lowest rank's), else the ranks whose function
        returned (a call made on some ranks only: `mark_returned`), else a rank of this node
        whose process is gone without a word in its record (`gone_siblings`: killed), else the
        ranks whose heartbeat did not move (stopped, frozen or lost: the others wait for them),
        else all live ranks,
        by `blame.behind_first` (the earliest step, then busy in its own work rather than
        waiting, then using a CPU between the two reads (`cpu_share`), then the lowest rank);
        the process that held the store when
        its connection broke before any record was read (`store_gone`); "" without records."""
        none: dict[int, dict] = {}
        first = _bounded(self._fail_and_read, 2 * STORE_TIMEOUT_S, none)
        if not first:
            return store_gone() if self.lost else ""
        if failed := _failed_of_itself(first) or _found_stopped(first) or _named(first):
            return failed
        if done := sorted(r for r, x in first.items() if x.get("returned")):
            own = _status.status() or "its start"
            if len(done) > 1:
                return (
                    f"ranks {', '.join(map(str, done))} returned from the function while rank "
                    f"{self.rank} still waited for them at {own}; {SAME_CALLS}"
                )
            last = first[done[0]].get("status")
            return (
                f"rank {done[0]} returned from the function"
                + (f" (its last call: {last})" if last else "")
                + f" while rank {self.rank} still waited for it at {own}; {SAME_CALLS}"
            )
        # a rank of this node whose process is gone without a word in the store (no error of
        # its own, no timed-out wait, no return): killed; named now, not after the heartbeats'
        # wait, which tells a stopped rank from a live one and cannot tell this one's death
        gone = [
            r
            for r in gone_siblings()
            if not (first.get(r, {}).get("failed") or first.get(r, {}).get("returned"))
        ]
        if gone:
            last = first.get(gone[0], {}).get("status")
            return (  # its record lags its work by up to PUBLISH_S (several short steps)
                f"rank {gone[0]}'s process is gone from this node without a report (killed, "
                f"e.g. by the OOM killer or SIGKILL?)"
                + (f"; its last record, up to {PUBLISH_S:g} s old: {last}" if last else "")
            )
        wait = heartbeat_wait_s()
        time.sleep(wait)
        later = _bounded(self.read, 2 * STORE_TIMEOUT_S, none)
        if failed := _failed_of_itself(later) or _found_stopped(later):
            return failed
        records = {r: x for r, x in (later or first).items() if not x.get("failed")}
        if not records:
            return ""
        stopped = [
            r
            for r in sorted(records)
            if later and "beat" in first.get(r, {}) and first[r]["beat"] == records[r].get("beat")
        ]
        statuses = {r: str(x.get("status", "")) for r, x in records.items()}
        cpu = {r: cpu_share(first.get(r, {}), x) for r, x in records.items()}
        named = behind_first(stopped or sorted(records), statuses, lambda alike: cpu)
        return (
            f"rank {named} did not answer"
            + (f" at {statuses[named]}" if statuses[named] else "")
            + (
                f"; its process sent no heartbeat in {wait:g} s (killed, stopped, frozen, or "
                f"its node lost?)"
                if stopped
                else ""
            )
        )


def cpu_share(before: dict, after: dict) -> float:
    """The share of a CPU a rank's process used between two of its records (`before`, `after`:
    as read `heartbeat_wait_s()` apart, so seconds apart: a rank computing on a loaded node
    may get less than `BUSY_SHARE` of a CPU in one `PUBLISH_S`, its record's own `cpu`, but
    not over seconds); `after`'s own share where the two are one record or lack the counts."""
    try:
        span = float(after["at"]) - float(before["at"])
        if span > 0:
            return max(0.0, (float(after["cpu_s"]) - float(before["cpu_s"])) / span)
    except (KeyError, TypeError, ValueError):
        pass
    return float(after.get("cpu", 0.0))


def store_gone() -> str:
    """What a broken connection to the job's store tells: the process holding it is gone. Under
    torchrun that is the agent at MASTER_ADDR (node 0's with --master-addr, the --rdzv-endpoint
    host's with --rdzv-backend c10d), which exits when a rank of its node fails; otherwise
    (srun, a launcher that sets RANK and WORLD_SIZE) rank 0, which made it."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return (
            f"the job's store at {where} is gone: the torchrun agent that held it exited (an "
            f"agent does when a rank of its node fails; see that node's log)"
        )
    return f"rank 0 is gone: its process held the job's store at {where}, which no longer answers"


def _failed_of_itself(records: dict[int, dict]) -> str:
    """ "rank R failed at step S, action: error" for the lowest rank whose record holds an error
    of its own (the others wait for it); "" when none does."""
    own = sorted(r for r, x in records.items() if x.get("error"))
    if not own:
        return ""
    r = own[0]
    return f"rank {r} failed at {records[r].get('status', '')}: {records[r]['error']}"


def _found_stopped(records: dict[int, dict]) -> str:
    """ "on rank R's node rank S (pid P) is stopped (SIGSTOP / SIGTSTP?)": what the lowest rank
    that found stopped ranks on its node recorded (`ProgressRecords.mark_failed`'s `found`);
    "" when none did."""
    found = sorted(r for r, x in records.items() if x.get("found"))
    if not found:
        return ""
    r = found[0]
    return str(records[r]["found"]).replace("on this node", f"on rank {r}'s node", 1)


def _named(records: dict[int, dict]) -> str:
    """What the lowest rank that named a rank holding the others up recorded (`holding_up`);
    "" when none did."""
    named = sorted(r for r, x in records.items() if x.get("named"))
    return str(records[named[0]]["named"]) if named else ""


def gave_up(cause: str, rank: int) -> str:
    """What follows `cause` (`holding_up`'s line) in rank `rank`'s error: it gave up waiting;
    or, where the cause names this rank itself (the others found it behind, and it failed
    once they were gone), that they gave up waiting for it."""
    if cause.startswith(f"rank {rank} did not answer"):
        return f"; the other ranks gave up waiting for rank {rank}, which then lost them"
    return f"; rank {rank} gave up waiting"


def heartbeat_wait_s() -> float:
    """How long a live rank's heartbeat certainly moves in: at most `HEARTBEAT_S` and one of its
    thread's looks apart, with as much again to spare for a thread the machine is slow to run."""
    return 2 * HEARTBEAT_S + PUBLISH_S


def _bounded(fn: Callable[[], T], within_s: float, otherwise: T) -> T:
    """`fn()`, or `otherwise` when it has not returned within `within_s`: run on a daemon
    thread left behind if it does not return. The store's own timeout bounds a wait for a key,
    not a reply: a call to a store whose process is stopped (its node frozen) never returns."""
    box: list[T] = []
    thread = threading.Thread(target=lambda: box.append(fn()), name="megapar-progress-read")
    thread.daemon = True
    thread.start()
    thread.join(within_s)
    return box[0] if box else otherwise


_records: dict[str, ProgressRecords] = {}  # this process's, by "rank": one per process


def connect(timeout_s: float = STORE_TIMEOUT_S):
    """A connection of this module's own to the default process group's store (its timeout
    `timeout_s`, not the group's); None when there is none."""
    try:
        store = dist.distributed_c10d._get_default_store().clone()  # type: ignore[attr-defined]
        store.set_timeout(timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, AttributeError):
        return None
    return store


def start(rank: int, world_size: int) -> ProgressRecords | None:
    """Start publishing this rank's record (under torchrun / srun, once the default process
    group exists); the records, or None when the store cannot be reached."""
    stop()
    store = _bounded(connect, STORE_TIMEOUT_S, None)
    if store is None:
        return None
    records = _records["rank"] = ProgressRecords(store, rank, world_size)
    records.start()
    return records


def rank0_value(rank: int, key: str, value: str) -> str:
    """Rank 0's `value` for `key`, through the job's store (once the default process group
    exists): rank 0 writes its own, every other rank waits for it at most `STORE_TIMEOUT_S`
    and keeps its own `value` when the store does not give it. `key` names the value in this
    job attempt (torchrun's store outlives a restart: `TORCHELASTIC_RESTART_COUNT` is part of
    the key)."""
    key = f"megapar/{key}/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def exchange() -> str:
        store = connect()
        if store is None:
            return value
        try:
            if rank == 0:
                store.set(key, value)
                return value
            return store.get(key).decode()
        except (RuntimeError, ValueError, UnicodeDecodeError):  # DistError: not in time
            return value

    return _bounded(exchange, 2 * STORE_TIMEOUT_S, value)


def stop() -> None:
    """Stop publishing (the process group is being released)."""
    records = _records.pop("rank", None)
    if records is not None:
        records.stop()


def holding_up() -> str:
    """`ProgressRecords.holding_up` of this process's records; "" when none are published
    (megapar's own launcher, which names the rank itself)."""
    records = _records.get("rank")
    return records.holding_up() if records is not None else ""


def mark_returned() -> None:
    """Record that the function returned on this rank (`ProgressRecords.mark_returned`);
    nothing when no records are published."""
    records = _records.get("rank")
    if records is not None:
        _bounded(records.mark_returned, STORE_TIMEOUT_S, None)


def mark_failed(error: str = "", found: str = "") -> None:
    """Record that this rank failed (`ProgressRecords.mark_failed`): with an error of its own
    (`error`), which the ranks that time out waiting for it then name, or (none) a wait that
    timed out, with the stopped ranks of its node it `found`; nothing when no records are
    published."""
    records = _records.get("rank")
    if records is not None:
        _bounded(lambda: records.mark_failed(error, found), STORE_TIMEOUT_S, None)


os.register_at_fork(after_in_child=_records.clear)  # a forked child publishes nothing of its own
