"""Draw a Gantt chart PNG of a saved pipeline timeline.

Usage::

    python tools/plot_trace.py TRACE.json [-o gantt.png] [--title TEXT]

TRACE.json is a Chrome trace written by ``megapar-bubble --trace`` (complete "X" events, one
thread per stage; other Chrome traces work too, one row per pid/thread, such as the
``--profile-steps`` traces of torch.profiler, whose thread ids mix numbers and names, with no
bubble table where no event is a pipeline compute) or a `Timeline` JSON
(``{"events": [{rank, kind, mb, start, end, chunk}, ...]}``, `Timeline.save`). Prints the bubble
table of the loaded timeline and writes the chart (default: TRACE with a .png suffix).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def load_timeline(path):
    """A `Timeline` from a Chrome trace (dict with traceEvents, or a bare event list) or from
    `Timeline.to_json` output."""
    from megapar.pipeline.timeline import Event, Timeline

    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and "events" in data:
        return Timeline.from_json(data)
    records = data["traceEvents"] if isinstance(data, dict) else data
    if records and "ph" not in records[0]:
        return Timeline.from_json(records)  # a bare list of Timeline event dicts
    spans = [r for r in records if r.get("ph") == "X"]
    # numbered threads first, then named ones (torch.profiler's traces mix the two)
    threads = sorted(
        {(r.get("pid", 0), r.get("tid", 0)) for r in spans},
        key=lambda t: [(isinstance(x, str), x if isinstance(x, int | float) else 0, str(x)) for x in t],
    )
    # megapar traces have one pid and tid = stage: keep the tid; otherwise number the threads.
    single_pid = len({pid for pid, _ in threads}) <= 1
    row = {t: (t[1] if single_pid else i) for i, t in enumerate(threads)}
    events = []
    for r in spans:
        args = r.get("args") or {}
        start = float(r["ts"]) / 1e6
        events.append(Event(row[(r.get("pid", 0), r.get("tid", 0))], r.get("cat") or r["name"],
                            args.get("mb"), start, start + float(r.get("dur", 0.0)) / 1e6,
                            int(args.get("chunk") or 0)))
    return Timeline(events)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="Chrome trace JSON or Timeline JSON")
    p.add_argument("-o", "--output", help="PNG to write (default: TRACE with .png suffix)")
    p.add_argument("--title", help="chart title (default: the file name)")
    p.add_argument("--row-name", help="row label prefix (default: stage, or thread for a "
                   "trace with no pipeline compute event, such as torch.profiler's)")
    args = p.parse_args(argv)
    from megapar.cli.bubble import plot_file
    from megapar.pipeline.timeline import (
        COMPUTE_KINDS,
        bubble_stats,
        format_bubble_table,
        plot_gantt,
    )
    from megapar.training.validate import check_writable

    output = args.output or str(Path(args.trace).with_suffix(".png"))
    try:  # before any work: a name matplotlib can write, in a directory that can be written
        output = plot_file(output, "--output")
        check_writable(output, "--output", kind="file")
    except ValueError as exc:
        print(f"plot_trace: error: {exc}", file=sys.stderr)
        return 2
    try:
        timeline = load_timeline(args.trace)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"plot_trace: error: cannot read {args.trace}: {exc}", file=sys.stderr)
        return 2
    if not timeline.events:
        print(f"plot_trace: error: {args.trace} has no events", file=sys.stderr)
        return 2
    pipeline = any(e.kind in COMPUTE_KINDS for e in timeline.events)
    if args.row_name is None:  # a profiler trace's rows are threads: "stage 7" of a pp 2 rank
        args.row_name = "stage" if pipeline else "thread"
    if pipeline:
        print(format_bubble_table(bubble_stats(timeline), row_name=args.row_name))
    else:  # e.g. a torch.profiler trace: its rows are threads, not stages
        print(f"no pipeline compute events ({', '.join(sorted(COMPUTE_KINDS))}) in {args.trace}: "
              f"no bubble table; the chart shows its threads' spans")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    plot_gantt(timeline, output, title=args.title or Path(args.trace).name, row_name=args.row_name)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
