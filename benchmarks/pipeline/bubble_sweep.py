"""Pipeline bubble vs number of micro-batches: measured, simulated and theoretical side by side.

For every (pp, schedule, m) the real engine runs on pp local processes (`bubble.measure`, the
last of --steps steps after a warm-up); the simulator then replays the same schedule with that
run's own per-action costs, each stage with its own (`bubble.stage_costs`: forward, backward, B
and W for zero-bubble schedules; the last stage also computes the LM head; p2p latency from
the receives), and the
theory is the schedule's formula, published where one is
((pp-1)/(m+pp-1) for GPipe and 1F1B, (pp-1)/(V m+pp-1) interleaved, Qi et al.'s for ZB-H1 with
the measured F, B, W; n/a in the table and null in --json where it does not apply: ZB-H1 when
the measured W > min(F, B) or m < pp, where the paper's count is below what the schedule
reaches; ZB-V and DualPipeV: the pipeline fill, megapar's own lower bound, not a published formula). m values a schedule cannot
take (interleaved: m % max(1, m // pp)) are skipped. Prints one table row per point (bubble %,
step times, simulated / measured step time ratio, in-flight micro-batches, activation MB of stage 0)
and writes a plot of bubble vs m: one line per source (measured solid, simulated dashed) per
schedule and pp, and the schedule's theory dotted in the same colour.

pp=4 needs 4 processes: on a 2-core machine they oversubscribe the cores, stages time-share a
core and "idle" waits partly hide other stages' compute, so only pp=2 (one core per stage) is
meaningful there; run pp=4 on a machine with at least 4 free cores.

    python benchmarks/pipeline/bubble_sweep.py [--pp 2 4] [--m 1 2 4 8 16]
                                      [--schedules gpipe 1f1b interleaved zb-h1 zb-v dualpipev]
                                      [--virtual-stages 2] [--steps 2] [--plot bubble_sweep.png]
                                      [--repeats 1]

--repeats N runs the whole sweep N times, the schedules taking turns in the order given (so a
load that changes during the run hits all of them alike), and ends with each point's measured
bubble as mean, min and max over the repeats: the run-to-run spread.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import json_number, output_file, positive, write_json  # noqa: E402


def sweep(args) -> list[dict]:
    rows = []
    for _ in range(args.repeats):
        rows += _sweep_once(args)
    return rows


def _sweep_once(args) -> list[dict]:
    from megapar.pipeline.schedules import CHUNKED_SCHEDULES, check_schedule
    from megapar.training import bubble

    rows = []
    for pp in args.pp:
        for schedule in args.schedules:
            v = args.virtual_stages if CHUNKED_SCHEDULES.get(schedule) == "loop" else \
                2 if schedule in CHUNKED_SCHEDULES else 1
            for m in args.m:
                try:
                    check_schedule(schedule, pp, m, v)
                except ValueError as exc:
                    print(f"skip {schedule} pp={pp} m={m}: {exc}", flush=True)
                    continue
                run = bubble.measure(pp, m, schedule, steps=args.steps,
                                     micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                                     virtual_stages=v)
                # each stage simulated with its own measured costs (the last one has the head)
                sim = bubble.simulate(pp, m, schedule, virtual_stages=v, **run.costs,
                                      stage_costs=run.stage_costs)
                row = {"pp": pp, "schedule": schedule, "m": m,
                       "measured": run.stats["measured_bubble"],
                       "simulated": sim.stats["measured_bubble"],
                       "theory": json_number(run.theoretical),
                       "step_ms": 1e3 * run.stats["step_time_s"],
                       "sim_step_ms": 1e3 * sim.stats["step_time_s"],
                       "in_flight": run.in_flight, "act_mb0": run.activation_mb[0],
                       "costs_ms": run.costs}
                row["sim_over_measured"] = row["sim_step_ms"] / row["step_ms"]
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


HEADER = (f"{'pp':>3} {'schedule':>11} {'m':>3} {'measured%':>9} {'simulated%':>10} "
          f"{'theory%':>7} {'step ms':>8} {'sim ms':>8} {'sim/meas':>8} {'in-flight':>10} "
          f"{'act MB s0':>9}")


def format_row(r: dict) -> str:
    theory = "n/a" if r["theory"] is None else f"{100 * r['theory']:.1f}"
    return (f"{r['pp']:>3} {r['schedule']:>11} {r['m']:>3} {100 * r['measured']:>9.1f} "
            f"{100 * r['simulated']:>10.1f} {theory:>7} {r['step_ms']:>8.1f} "
            f"{r['sim_step_ms']:>8.1f} {r['sim_over_measured']:>8.3f} "
            f"{str(r['in_flight']):>10} {r['act_mb0']:>9.1f}")


def spread(rows: list[dict]) -> str:
    """Per (pp, schedule, m): the measured bubble's mean, min and max over the repeats."""
    points: dict[tuple, list[float]] = {}
    for r in rows:
        points.setdefault((r["pp"], r["schedule"], r["m"]), []).append(100 * r["measured"])
    lines = ["measured bubble % over the repeats: mean [min, max]"]
    for (pp, schedule, m), values in points.items():
        lines.append(f"  pp={pp} {schedule:>11} m={m:<3} {sum(values) / len(values):5.1f} "
                     f"[{min(values):.1f}, {max(values):.1f}] (n={len(values)})")
    return "\n".join(lines)


def theory_lines(rows: list[dict]) -> dict[tuple[int, str], list[tuple[int, float]]]:
    """Per (pp, schedule), its formula's (m, bubble) points in m order, where it applies (the
    repeats of a point give one). Each schedule has its own: ZB-H1's and interleaved's are not
    1F1B's."""
    lines: dict[tuple[int, str], dict[int, float]] = {}
    for r in rows:
        if r["theory"] is not None:
            lines.setdefault((r["pp"], r["schedule"]), {})[r["m"]] = r["theory"]
    return {key: sorted(points.items()) for key, points in lines.items()}


def plot(rows: list[dict], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colours = iter(["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860"])
    lines = theory_lines(rows)
    for pp in sorted({r["pp"] for r in rows}):
        mine = [r for r in rows if r["pp"] == pp]
        for schedule in sorted({r["schedule"] for r in mine}):
            pts = sorted((r for r in mine if r["schedule"] == schedule), key=lambda r: r["m"])
            colour = next(colours)
            x = [r["m"] for r in pts]
            ax.plot(x, [100 * r["measured"] for r in pts], "-o", color=colour,
                    label=f"measured {schedule} pp={pp}")
            ax.plot(x, [100 * r["simulated"] for r in pts], "--s", color=colour, alpha=0.7,
                    label=f"simulated {schedule} pp={pp}")
            theory = lines.get((pp, schedule), [])
            if theory:
                ax.plot([m for m, _ in theory], [100 * t for _, t in theory], ":", color=colour,
                        marker=".", label=f"theory {schedule} pp={pp}")
    ax.set_xscale("log", base=2)
    ms = sorted({r["m"] for r in rows})
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("bubble (% of step time idle)")
    ax.set_title("pipeline bubble vs micro-batches")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=positive, nargs="+", default=[2, 4], help="pipeline sizes")
    p.add_argument("--m", type=positive, nargs="+", default=[1, 2, 4, 8, 16], help="micro-batches")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb-h1"],
                   choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"])
    p.add_argument("--virtual-stages", type=positive, default=2,
                   help="model chunks per rank for interleaved")
    p.add_argument("--steps", type=positive, default=2,
                   help="steps run per point after a warm-up; the last one is measured")
    p.add_argument("--micro-batch-size", type=positive, default=4)
    p.add_argument("--seq-len", type=positive, default=64)
    p.add_argument("--plot", type=output_file, default="bubble_sweep.png",
                   help="PNG to write ('' for none)")
    p.add_argument("--json", type=output_file, help="also write the rows as JSON")
    p.add_argument("--repeats", type=positive, default=1,
                   help="run the sweep this many times; report each point's spread")
    args = p.parse_args(argv)

    print(HEADER, flush=True)
    rows = sweep(args)
    ratios = [r["sim_over_measured"] for r in rows]
    print(f"simulated / measured step time: min {min(ratios):.3f}, "
          f"mean {sum(ratios) / len(ratios):.3f}, max {max(ratios):.3f}")
    if args.repeats > 1:
        print(spread(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, rows)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
