"""megapar-bubble: measure (or simulate) the pipeline bubble and show it.

    megapar-bubble --pp 2 --microbatches 8 --schedule 1f1b              # real processes
    megapar-bubble --pp 16 --microbatches 64 --simulate --fwd-ms 10 --bwd-ms 20
    megapar-bubble --pp 2 --microbatches 4 --trace trace.json --plot gantt.png
    megapar-bubble --pp 4 --microbatches 8 --show-schedule          # the schedule as data

Prints a table (per stage busy, idle, bubble %, theory %) and a JSON line with
measured_bubble, theoretical_bubble and step_time_s. --simulate without costs measures them
once on real processes and then simulates.
"""

from __future__ import annotations

import argparse
import json
import sys

from megapar.pipeline.schedules import SCHEDULES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megapar-bubble", description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, required=True, help="pipeline stages")
    p.add_argument("--microbatches", "-m", type=int, required=True, help="micro-batches per step")
    p.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size per stage")
    p.add_argument("--model", help="model recipe (default: a compute-bound GPT-2, 2 blocks/stage)")
    p.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--show-schedule", action="store_true",
                   help="print each stage's list of actions (F3 = forward mb 3, SA = send "
                        "activation, RG = receive gradient, ...) and exit")
    p.add_argument("--simulate", action="store_true", help="compute the timeline from costs")
    p.add_argument("--fwd-ms", type=float, help="forward cost per micro-batch and stage")
    p.add_argument("--bwd-ms", type=float, help="backward cost (default 2 x forward)")
    p.add_argument("--p2p-ms", type=float, default=0.0, help="point-to-point latency")
    p.add_argument("--trace", help="write a Chrome trace-event JSON (Perfetto, chrome://tracing)")
    p.add_argument("--plot", help="write the timeline as a Gantt chart PNG")
    return p


def main(argv=None) -> int:
    from megapar.pipeline.timeline import format_bubble_table, plot_gantt, write_chrome_trace
    from megapar.training import bubble

    args = build_parser().parse_args(argv)
    from megapar.training.validate import UsageError, check_bubble_args

    try:
        check_bubble_args(args)
    except UsageError as exc:
        print(f"megapar-bubble: error: {exc}", file=sys.stderr)
        return 2
    if args.show_schedule:
        from megapar.pipeline.schedules import format_schedule, get_schedule

        schedule = get_schedule(args.schedule)
        for stage in range(args.pp):
            print(f"stage {stage}: {format_schedule(schedule(args.pp, args.microbatches, stage))}")
        return 0
    if args.simulate:
        fwd, bwd, p2p = args.fwd_ms, args.bwd_ms, args.p2p_ms
        if fwd is None:  # measure the costs once on the real engine
            costs = bubble.measure(args.pp, args.microbatches, args.schedule, args.tp,
                                   args.model, 1, args.micro_batch_size, args.seq_len).costs
            fwd, bwd, p2p = costs["fwd_ms"], costs["bwd_ms"], costs["p2p_ms"]
        run = bubble.simulate(args.pp, args.microbatches, args.schedule, fwd,
                              bwd if bwd is not None else 2 * fwd, p2p)
        title = f"simulated {args.schedule}, pp={args.pp}, m={args.microbatches}"
    else:
        run = bubble.measure(args.pp, args.microbatches, args.schedule, args.tp, args.model,
                             args.steps, args.micro_batch_size, args.seq_len)
        title = f"measured {args.schedule}, pp={args.pp}, m={args.microbatches}"
    print(title)
    print(format_bubble_table(run.stats, run.theoretical))
    print(f"in-flight micro-batches per stage (peak): {run.in_flight}")
    if args.trace:
        write_chrome_trace(run.timeline, args.trace)
        print(f"wrote {args.trace}")
    if args.plot:
        plot_gantt(run.timeline, args.plot, title=title)
        print(f"wrote {args.plot}")
    print(json.dumps(run.summary()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
