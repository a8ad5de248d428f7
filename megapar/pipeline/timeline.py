"""Timelines of a training step: events per rank, bubble statistics, Chrome traces, Gantt plots.

Used by both the pipeline simulator (`megapar.pipeline.simulate`) and the real executor's tracer,
so everything here works on plain `Event` records and knows nothing about how they were produced.
Times are in seconds on any monotonic clock (any origin); outputs are shifted so the step starts
at 0.

Bubble accounting: the step runs from the earliest event start to the latest event end over *all*
ranks. A rank is busy while at least one compute event (`COMPUTE_KINDS`) runs on it; everything
else (waiting for a receive, idling at the start or end of the step) is idle time.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

COMPUTE_KINDS = frozenset({"forward", "backward", "recompute", "backward_input", "backward_weight"})
"""Event kinds that count as useful work in bubble statistics."""

COMM_KINDS = frozenset({"send_act", "recv_act", "send_grad", "recv_grad"})
"""Pipeline point-to-point communication kinds."""

SHORT_NAMES = {
    "forward": "F",
    "backward": "B",
    "recompute": "R",
    "backward_input": "BI",
    "backward_weight": "BW",
    "recv_act": "RA",
    "send_act": "SA",
    "recv_grad": "RG",
    "send_grad": "SG",
}
"""Short labels of known kinds; other kinds are labelled by their full name."""


def short_label(kind: str, mb: int | None, chunk: int = 0) -> str:
    """A compact label such as "F3", "RG0", "F3@1" (chunk 1) or "optimizer"."""
    label = SHORT_NAMES.get(kind, kind)
    if mb is not None:
        label = f"{label}{mb}"
    if chunk:
        label = f"{label}@{chunk}"
    return label


@dataclass
class Event:
    """One interval of activity on one rank."""

    rank: int
    """Row of the timeline: pipeline stage or global rank."""
    kind: str
    """What happened: "forward", "backward", "recv_act", "wait", "optimizer", ... (free string)."""
    mb: int | None
    """Micro-batch index, or None for per-step work such as the optimizer."""
    start: float
    """Start time in seconds (monotonic clock, any origin)."""
    end: float
    """End time in seconds; `end >= start`."""
    chunk: int = 0
    """Model chunk (virtual stage) for interleaved schedules; 0 otherwise."""

    def __post_init__(self):
        if self.end < self.start:
            raise ValueError(
                f"event {self.label} on rank {self.rank} ends before it starts "
                f"({self.end} < {self.start})"
            )

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        return short_label(self.kind, self.mb, self.chunk)


@dataclass
class Timeline:
    """All events of one step (or several), over all ranks."""

    events: list[Event] = field(default_factory=list)
    """Events in any order; several may overlap on one rank (e.g. an isend during a forward)."""

    def ranks(self) -> list[int]:
        """Sorted ranks that have at least one event."""
        return sorted({e.rank for e in self.events})

    def for_rank(self, rank: int) -> list[Event]:
        """Events of one rank, sorted by start time."""
        return sorted((e for e in self.events if e.rank == rank), key=lambda e: (e.start, e.end))

    @property
    def start(self) -> float:
        return min(e.start for e in self.events) if self.events else 0.0

    @property
    def end(self) -> float:
        return max(e.end for e in self.events) if self.events else 0.0

    @property
    def step_time(self) -> float:
        """Seconds from the earliest start to the latest end over all ranks."""
        return self.end - self.start

    def busy_time(self, rank: int) -> float:
        """Seconds during which at least one compute event runs on `rank` (union of intervals)."""
        intervals = sorted(
            (e.start, e.end) for e in self.events if e.rank == rank and e.kind in COMPUTE_KINDS
        )
        busy, cur_start = 0.0, 0.0  # cur_start is read only once cur_end is set
        cur_end: float | None = None
        for s, e in intervals:
            if cur_end is None or s > cur_end:
                if cur_end is not None:
                    busy += cur_end - cur_start
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        if cur_end is not None:
            busy += cur_end - cur_start
        return busy

    def to_json(self) -> dict:
        """A JSON-serialisable dict: {"events": [{rank, kind, mb, start, end, chunk}, ...]}."""
        return {"events": [asdict(e) for e in self.events]}

    @classmethod
    def from_json(cls, data: dict | list) -> Timeline:
        """Inverse of `to_json`; also accepts the bare list of event dicts."""
        rows = data["events"] if isinstance(data, dict) else data
        return cls([Event(**row) for row in rows])

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def load(cls, path: str) -> Timeline:
        with open(path) as f:
            return cls.from_json(json.load(f))


def bubble_stats(timeline: Timeline) -> dict:
    """Busy / idle time and bubble fraction per rank, and overall.

    Returns {"step_time_s", "measured_bubble" (mean of per-rank bubbles),
    "per_rank": [{"rank", "busy_s", "idle_s", "bubble"}, ...]} with ranks in increasing order.
    """
    if not timeline.events:
        raise ValueError("bubble_stats needs a timeline with at least one event")
    step = timeline.step_time
    per_rank = []
    for rank in timeline.ranks():
        busy = timeline.busy_time(rank)
        idle = step - busy
        per_rank.append(
            {
                "rank": rank,
                "busy_s": busy,
                "idle_s": idle,
                "bubble": idle / step if step > 0 else 0.0,
            }
        )
    measured = sum(r["bubble"] for r in per_rank) / len(per_rank)
    return {"step_time_s": step, "measured_bubble": measured, "per_rank": per_rank}


def percent(fraction: float) -> str:
    """`fraction` as a percentage with one decimal, rounded from 9 decimals first, so that a
    simulated bubble a float's last bits away from its formula's prints the same (ZB-V at pp 3,
    m 5: 0.06250000000000006 and 0.0625 gave 6.3 and 6.2)."""
    return f"{round(100 * fraction, 9):.1f}"


def format_bubble_table(
    stats: dict, theoretical: float | None = None, row_name: str = "stage"
) -> str:
    """A fixed-width table of `bubble_stats` output, one line per rank plus a mean line."""
    theory = "-" if theoretical is None else percent(theoretical)
    lines = [f"{row_name:>6} {'busy ms':>10} {'idle ms':>10} {'bubble %':>9} {'theory %':>9}"]
    for r in stats["per_rank"]:
        lines.append(
            f"{r['rank']:>6} {1e3 * r['busy_s']:>10.3f} {1e3 * r['idle_s']:>10.3f} "
            f"{percent(r['bubble']):>9} {theory:>9}"
        )
    lines.append(
        f"{'mean':>6} {'':>10} {'':>10} {percent(stats['measured_bubble']):>9} {theory:>9}"
    )
    lines.append(f"step time {1e3 * stats['step_time_s']:.3f} ms")
    return "\n".join(lines)


def to_chrome_trace(timeline: Timeline, row_name: str = "stage") -> dict:
    """Chrome trace-event JSON (chrome://tracing, Perfetto): one thread per rank, times in us."""
    t0 = timeline.start
    trace = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "megapar"}}]
    for rank in timeline.ranks():
        trace.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"{row_name} {rank}"},
            }
        )
        trace.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": 0,
                "tid": rank,
                "args": {"sort_index": rank},
            }
        )
    for e in sorted(timeline.events, key=lambda e: (e.rank, e.start)):
        trace.append(
            {
                "ph": "X",
                "name": e.label,
                "cat": e.kind,
                "pid": 0,
                "tid": e.rank,
                "ts": 1e6 * (e.start - t0),
                "dur": 1e6 * e.duration,
                "args": {"mb": e.mb, "chunk": e.chunk},
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"writer": TRACE_WRITER}}


CHART_MARK = "Matplotlib, megapar-bubble"
"""The comment a JPEG or GIF chart carries (Pillow writes no writer's name in them; matplotlib's
png, svg, pdf and ps name it): how megapar-bubble knows a chart of its own."""

TRACE_WRITER = "megapar"
"""A megapar trace's mark (its otherData's writer): a trace of another tool's is no output of
megapar-bubble's to replace without --overwrite."""


def write_chrome_trace(timeline: Timeline, path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_chrome_trace(timeline), f)


_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "recompute": "#dd8452",
    "backward_input": "#8fd18f",
    "backward_weight": "#2e7d32",
    "comm": "#8c8c8c",
    "other": "#8172b2",
    "idle": "#f2f2f2",
}


def _colour_key(kind: str) -> str:
    if kind in _COLOURS:
        return kind
    # a wait and the step's closing loss broadcast are communication: idle in `bubble_stats`
    return "comm" if kind in COMM_KINDS or kind in ("wait", "loss_broadcast") else "other"


def plot_gantt(
    timeline: Timeline,
    path: str,
    title: str | None = None,
    row_name: str = "stage",
    comm: bool = True,
) -> None:
    """Save a Gantt chart (`gantt_figure`) to `path` as named (PNG unless its suffix names
    another format matplotlib writes: given, savefig adds no .png to a name without one, such
    as a device's), rendered in memory first: a PNG writer seeks, which a FIFO cannot."""
    fmt = os.path.splitext(path)[1][1:].lower() or "png"
    image = io.BytesIO()
    marked: dict[str, Any] = {"comment": CHART_MARK} if fmt in ("jpg", "jpeg", "gif") else {}
    figure = gantt_figure(timeline, title, row_name, comm)
    if marked:
        figure.savefig(image, dpi=120, format=fmt, pil_kwargs=marked)
    else:
        figure.savefig(image, dpi=120, format=fmt)
    with open(path, "wb") as f:
        f.write(image.getvalue())


def gantt_figure(
    timeline: Timeline, title: str | None = None, row_name: str = "stage", comm: bool = True
) -> Figure:
    """A matplotlib Figure of the step: one row per rank, compute as full boxes labelled with
    their micro-batch (and, where the schedule runs several model chunks per rank, its chunk:
    3@1, as --show-schedule writes it) where the label fits inside its box, communication as
    thin bars unless `comm` is False (a simulation with free messages, whose receives are only
    waits: idle, drawn as idle)."""
    from matplotlib import rcParams
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_rgba
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ranks = timeline.ranks()
    t0, span_ms = timeline.start, 1e3 * timeline.step_time
    fig = Figure(
        figsize=(
            max(8.0, min(24.0, 0.25 * len(timeline.events) / max(1, len(ranks)))),
            1.0 + 0.6 * max(1, len(ranks)),
        )
    )
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    used = {"idle"}
    rgba = {key: to_rgba(colour) for key, colour in _COLOURS.items()}  # converted once
    white, none = to_rgba("white"), to_rgba("none")
    chunked = any(e.chunk for e in timeline.events)
    # (x, width, row, text) of each label: drawn once the axes have their final size
    labels: list[tuple[float, float, int, str]] = []
    for row, rank in enumerate(ranks):
        ax.broken_barh([(0.0, span_ms)], (row - 0.4, 0.8), facecolors=_COLOURS["idle"])
        # the row's boxes, in start order (a later box is drawn over an earlier one: a
        # recompute over the backward it runs in), as one collection: one artist per box took
        # seconds to lay out and draw at thousands of events
        boxes: list[list[tuple[float, float]]] = []
        faces: list[tuple[float, float, float, float]] = []
        edges: list[tuple[float, float, float, float]] = []
        widths: list[float] = []
        for e in timeline.for_rank(rank):
            key = _colour_key(e.kind)
            x, w = 1e3 * (e.start - t0), 1e3 * e.duration
            if e.kind in COMPUTE_KINDS or key == "other":
                y0, h, edge, width = row - 0.4, 0.8, white, 0.5  # a full box, outlined
                if e.mb is not None and span_ms > 0 and w > 0:
                    labels.append((x, w, row, f"{e.mb}@{e.chunk}" if chunked else str(e.mb)))
            elif comm:
                # a thin bar at the top of the row, unoutlined (its line width, matplotlib's
                # default, still sets where Agg snaps its edges to pixels)
                y0, h, edge, width = row - 0.4, 0.15, none, rcParams["patch.linewidth"]
            else:
                continue
            used.add(key)
            boxes.append([(x, y0), (x, y0 + h), (x + w, y0 + h), (x + w, y0)])
            faces.append(rgba[key])
            edges.append(edge)
            widths.append(width)
        if boxes:
            ax.add_collection(
                PolyCollection(boxes, facecolors=faces, edgecolors=edges, linewidths=widths)
            )
    ax.set_yticks(range(len(ranks)), [f"{row_name} {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0.0, span_ms if span_ms > 0 else 1.0)
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title)
    order = [
        "forward",
        "backward",
        "backward_input",
        "backward_weight",
        "recompute",
        "comm",
        "other",
        "idle",
    ]
    ax.legend(
        handles=[
            Patch(facecolor=_COLOURS[k], edgecolor="#999999", label=k) for k in order if k in used
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    _label_boxes(canvas, ax, labels)
    return fig


def _label_boxes(
    canvas: FigureCanvasAgg, ax: Axes, labels: list[tuple[float, float, int, str]]
) -> None:
    """Each (x, width, row, text) drawn at the middle of its box where the text, with a point
    to spare on either side, fits inside the box's width on the laid-out axes; a narrower
    box stays unlabelled (its label would spill over its neighbours'). Each distinct text is
    measured once (a chart of thousands of boxes has a few dozen labels: "0" .. "63")."""
    renderer = canvas.get_renderer()
    points = canvas.figure.dpi / 72  # pixels per point
    size = 7  # points
    widths: dict[str, float] = {}  # pixels, per text
    for x, w, row, s in labels:
        (left, _), (right, _) = ax.transData.transform([(x, row), (x + w, row)])
        room = abs(right - left) - 2 * points  # a point to spare on either side
        if room < 0.5 * size * points * len(s) or widths.get(s, 0.0) > room:
            continue  # narrower than any such text (not measured), or than this one
        text = ax.text(
            x + w / 2, row, s, ha="center", va="center", fontsize=size, color="white", clip_on=True
        )
        if s not in widths:
            widths[s] = text.get_window_extent(renderer).width
        if widths[s] > room:
            text.remove()
