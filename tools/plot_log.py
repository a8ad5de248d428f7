"""Plot training curves (loss and val_loss vs step) from megapar-train --log-json files.

Usage::

    python tools/plot_log.py LOG.jsonl [LOG2.jsonl ...] [-o loss.png] [--metrics loss,val_loss]
                             [--log-y] [--title TEXT]

Each LOG is a file written by ``megapar-train --log-json LOG``: one JSON record per logged step
({"step", "loss", "lr", ..., and "val_loss" on evaluation steps}). A resumed run keeps the
file's records up to its checkpoint's step and appends after them; a step logged twice (a file
joined from two) keeps its last record. A list field (`moe_tokens_per_expert`) is one curve per
element (`moe_tokens_per_expert/0`, ...), as TensorBoard draws it. A metric a file has no point
of (none recorded, or null on every step: grad_norm of an fp16 run that overflowed throughout)
is said per file as 0 points; one no file records is named on stderr and left out of the chart.
With several files (e.g. two layouts of the same run) every curve is labelled with its file name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megapar.cli.bubble import plot_file
from megapar.training.validate import check_writable

STYLES = {"loss": dict(linewidth=1.2), "val_loss": dict(marker="o", linewidth=1.5)}


def read_series(path, metrics) -> dict[str, tuple[list[int], list[float]]]:
    """{metric: (steps, values)} sorted by step, a list field's element i as `metric/i`; a step
    logged again (resume) keeps the last."""
    latest: dict[str, dict[int, float]] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON line ({exc})") from None
        if "step" not in record:
            continue
        for key in metrics:
            value = record.get(key)
            values = value if isinstance(value, list) else [value]
            for i, v in enumerate(values):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    name = f"{key}/{i}" if isinstance(value, list) else key
                    latest.setdefault(name, {})[int(record["step"])] = float(v)
    return {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in latest.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", help="--log-json files of megapar-train")
    p.add_argument("-o", "--output", default="loss.png", help="PNG to write (default: loss.png)")
    p.add_argument("--metrics", default="loss,val_loss",
                   help="comma-separated record keys to plot (default: loss,val_loss)")
    p.add_argument("--log-y", action="store_true", help="logarithmic y axis")
    p.add_argument("--title", help="chart title")
    args = p.parse_args(argv)
    try:  # before any work: a name matplotlib can write, in a directory that can be written
        args.output = plot_file(args.output, "--output")
        check_writable(args.output, "--output", kind="file")
    except ValueError as exc:
        print(f"plot_log: error: {exc}", file=sys.stderr)
        return 2
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    drawn: set[str] = set()  # the metrics some file has a curve of
    for log in args.logs:
        try:
            series = read_series(log, metrics)
        except (OSError, ValueError) as exc:
            print(f"plot_log: error: {exc}", file=sys.stderr)
            return 2
        for key, (steps, values) in series.items():
            label = key if len(args.logs) == 1 else f"{Path(log).name}: {key}"
            ax.plot(steps, values, label=label, **STYLES.get(key, {}))
            print(f"{log}: {key}: {len(steps)} points, steps {steps[0]}..{steps[-1]}, "
                  f"last {values[-1]:.4f}")
            drawn.add(key.split("/", 1)[0] if key.split("/", 1)[0] in metrics else key)
        for key in metrics:
            if not any(k == key or k.startswith(f"{key}/") for k in series):
                print(f"{log}: {key}: 0 points")
    if not drawn:
        print(f"plot_log: error: no {', '.join(metrics)} records in {', '.join(args.logs)}",
              file=sys.stderr)
        return 2
    plotted = [m for m in metrics if m in drawn]
    missing = [m for m in metrics if m not in drawn]
    if missing:
        print(f"plot_log: no {', '.join(missing)} records in {', '.join(args.logs)}: left out",
              file=sys.stderr)
    ax.set_xlabel("step")
    ax.set_ylabel(" / ".join(plotted))
    if args.log_y:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(args.title or ", ".join(Path(log).name for log in args.logs))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
