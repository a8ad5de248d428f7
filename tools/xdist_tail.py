"""How much of the suite's wall time pytest-xdist's scheduling leaves on the table.

Replays pytest-xdist 3.8's `--dist load` scheduler (`xdist.scheduler.load.LoadScheduling`:
the first quarter of the tests in two consecutive chunks, then refills of half the pending
share, each worker keeping two tests queued) over a collection order, with each test's
duration from a `--durations=0` log, and reports the makespan beyond a perfect split (the sum
of the durations over the workers): the tail a slow test started late leaves. Each of `--runs`
replays scales every duration by a log-normal factor (sigma `--spread`), as the machine's load
moves them from run to run.

    python3 -m pytest --collect-only -q tests > collected.txt
    python3 tools/xdist_tail.py durations.log collected.txt
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import re
from collections import defaultdict


def durations(log: str) -> dict[str, float]:
    """{test id: setup + call + teardown seconds} from a `--durations` listing."""
    out: dict[str, float] = defaultdict(float)
    with open(log) as f:
        for line in f:
            m = re.match(r"^([0-9.]+)s (?:call|setup|teardown)\s+(\S+)", line)
            if m:
                out[m.group(2)] += float(m.group(1))
    return out


def makespan(order: list[str], seconds: dict[str, float], workers: int = 2) -> float:
    """The wall time of `order` on `workers` under LoadScheduling (tests not in `seconds`:
    5 ms, what `--durations` hides)."""
    pending = list(range(len(order)))
    queue: dict[int, list[int]] = {w: [] for w in range(workers)}
    done = {w: False for w in range(workers)}  # shut down: no more tests will come
    running = {w: False for w in range(workers)}
    events: list[tuple[float, int, int]] = []

    def send(w: int, n: int) -> None:
        queue[w].extend(pending[:n])
        del pending[:n]

    def start(w: int, now: float) -> None:  # a worker runs a test once it knows the next one
        running[w] = bool(queue[w]) and (len(queue[w]) >= 2 or done[w])
        if running[w]:
            i = queue[w][0]
            heapq.heappush(events, (now + seconds.get(order[i], 0.005), w, i))

    for w in range(workers):
        send(w, max(len(order) // workers // 4, 2))
    for w in range(workers):
        done[w] = not pending
        start(w, 0.0)
    end = 0.0
    while events:
        now, w, i = heapq.heappop(events)
        queue[w].remove(i)
        end = max(end, now)
        if pending:
            low = max(2, len(pending) // workers // 4)
            high = max(2, len(pending) // workers // 2)
            long_test = seconds.get(order[i], 0.005) >= 0.1 and len(queue[w]) >= 2
            if len(queue[w]) < low and not long_test:
                send(w, high - len(queue[w]))
        else:
            done[w] = True
        start(w, now)
        for other in range(workers):
            if other != w and not running[other]:
                done[other] = done[other] or not pending
                start(other, now)
    return end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="a pytest log with --durations=0")
    parser.add_argument("collected", help="pytest --collect-only -q's output: the order")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--spread", type=float, default=0.3)
    args = parser.parse_args()
    if args.workers < 1 or args.runs < 1:
        parser.error("--workers and --runs take a whole number >= 1")
    for path in (args.log, args.collected):
        if not os.path.isfile(path):
            parser.error(f"{path}: no such file")
    seconds = durations(args.log)
    with open(args.collected) as f:
        order = [line.strip() for line in f if "::" in line]
    tails = []
    for run in range(args.runs):
        rng = random.Random(run)
        scaled = {t: seconds.get(t, 0.005) * rng.lognormvariate(0, args.spread) for t in order}
        tails.append(makespan(order, scaled, args.workers) - sum(scaled.values()) / args.workers)
    tails.sort()
    print(f"{len(order)} tests, {sum(seconds.get(t, 0.005) for t in order):.0f} s of durations; "
          f"wall time beyond a perfect split: mean {sum(tails) / len(tails):.1f} s, median "
          f"{tails[len(tails) // 2]:.1f} s, 95th percentile {tails[int(0.95 * len(tails))]:.1f} s, "
          f"most {tails[-1]:.1f} s")


if __name__ == "__main__":
    main()
