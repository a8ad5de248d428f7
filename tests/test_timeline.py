"""Timeline helpers: busy time, bubble stats, table, Chrome trace, JSON round trip, Gantt PNG."""

import json

import pytest

from megapar.pipeline.simulate import Costs, simulate_schedule, theoretical_bubble
from megapar.pipeline.timeline import (
    Event,
    Timeline,
    bubble_stats,
    format_bubble_table,
    plot_gantt,
    to_chrome_trace,
    write_chrome_trace,
)


def _small():
    # rank 0: forward [10, 12], backward [13, 16] overlapping a recompute [14, 15], a send.
    # rank 1: waits [10, 12], forward [12, 14], optimizer [17, 18] (not compute).
    return Timeline([
        Event(0, "forward", 0, 10.0, 12.0),
        Event(0, "send_act", 0, 12.0, 12.5),
        Event(0, "backward", 0, 13.0, 16.0),
        Event(0, "recompute", 0, 14.0, 15.0),
        Event(1, "recv_act", 0, 10.0, 12.0),
        Event(1, "forward", 0, 12.0, 14.0),
        Event(1, "optimizer", None, 17.0, 18.0),
    ])


def test_busy_time_is_union_of_compute():
    tl = _small()
    assert tl.ranks() == [0, 1]
    assert tl.step_time == pytest.approx(8.0)  # 10 .. 18 over all ranks
    assert tl.busy_time(0) == pytest.approx(5.0)  # 2 + 3, recompute overlaps the backward
    assert tl.busy_time(1) == pytest.approx(2.0)
    assert tl.busy_time(7) == 0.0


def test_bubble_stats_counts_idle_over_whole_step():
    stats = bubble_stats(_small())
    assert stats["step_time_s"] == pytest.approx(8.0)
    r0, r1 = stats["per_rank"]
    assert (r0["rank"], r0["busy_s"], r0["idle_s"]) == (0, pytest.approx(5.0), pytest.approx(3.0))
    assert r0["bubble"] == pytest.approx(3 / 8)
    assert r1["bubble"] == pytest.approx(6 / 8)
    assert stats["measured_bubble"] == pytest.approx((3 / 8 + 6 / 8) / 2)
    with pytest.raises(ValueError, match="at least one event"):
        bubble_stats(Timeline([]))


def test_format_bubble_table():
    table = format_bubble_table(bubble_stats(_small()), theoretical=0.25)
    lines = table.splitlines()
    assert lines[0].split() == ["stage", "busy", "ms", "idle", "ms", "bubble", "%", "theory", "%"]
    assert lines[1].split() == ["0", "5000.000", "3000.000", "37.5", "25.0"]
    assert lines[2].split() == ["1", "2000.000", "6000.000", "75.0", "25.0"]
    assert lines[3].split() == ["mean", "56.2", "25.0"]
    assert "-" in format_bubble_table(bubble_stats(_small())).splitlines()[1]


def test_a_bubble_equal_to_its_formula_prints_equal():
    """ZB-V at pp 3, m 5 (equal costs) reaches its fill, 1/16; the simulation's last bits
    differ from the formula's, and the table printed 6.3 against 6.2."""
    from megapar.training.bubble_run import simulate

    run = simulate(3, 5, "zb-v", 1.0, 2.0, 0.0, 1, 1.0, 1.0)
    assert run.stats["measured_bubble"] == pytest.approx(run.theoretical, abs=1e-12)
    assert run.stats["measured_bubble"] != run.theoretical  # the case: last bits apart
    rows = format_bubble_table(run.stats, run.theoretical).splitlines()[1:-1]
    assert [r.split()[-2:] for r in rows] == [["6.2", "6.2"]] * 4


def test_event_validation_and_label():
    assert Event(0, "forward", 3, 0.0, 1.0).label == "F3"
    assert Event(0, "backward", 2, 0.0, 1.0, chunk=1).label == "B2@1"
    assert Event(0, "optimizer", None, 0.0, 1.0).label == "optimizer"
    with pytest.raises(ValueError, match="ends before it starts"):
        Event(0, "forward", 0, 2.0, 1.0)


def test_json_round_trip(tmp_path):
    tl = simulate_schedule("1f1b", 3, 4, Costs(fwd_ms=1, bwd_ms=2, p2p_ms=0.1))
    again = Timeline.from_json(json.loads(json.dumps(tl.to_json())))
    assert again.events == tl.events
    path = tmp_path / "tl.json"
    tl.save(str(path))
    assert Timeline.load(str(path)).events == tl.events


def test_chrome_trace(tmp_path):
    tl = simulate_schedule("gpipe", 3, 2, Costs(fwd_ms=1, bwd_ms=2, p2p_ms=0.1))
    path = tmp_path / "trace.json"
    write_chrome_trace(tl, str(path))
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(to_chrome_trace(tl)))
    assert trace["displayTimeUnit"] == "ms"
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(tl.events)
    for e in complete:
        assert {"ts", "dur", "pid", "tid", "name", "cat", "args"} <= e.keys()
        assert e["pid"] == 0 and e["ts"] >= 0 and e["dur"] >= 0
    assert {e["tid"] for e in complete} == {0, 1, 2}
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "stage 0", 1: "stage 1", 2: "stage 2"}
    # Stage 2's first backward: forwards end at (2+3-1)*1 ms + 2 links * 0.1 ms = 4.2 ms.
    b0 = next(e for e in complete if e["tid"] == 2 and e["name"] == "B0")
    assert b0["cat"] == "backward" and b0["args"]["mb"] == 0
    assert b0["ts"] == pytest.approx(4200.0) and b0["dur"] == pytest.approx(2000.0)
    rows = to_chrome_trace(tl, row_name="rank")["traceEvents"]
    assert any(e.get("args", {}).get("name") == "rank 1" for e in rows)


def test_gantt_png(tmp_path):
    tl = simulate_schedule("1f1b", 4, 8, Costs(fwd_ms=1, bwd_ms=2, p2p_ms=0.1))
    tl.events.append(Event(0, "optimizer", None, tl.end, tl.end + 1e-3))
    path = tmp_path / "gantt.png"
    plot_gantt(tl, str(path), title=f"1F1B pp=4 m=8 (theory {theoretical_bubble(4, 8):.0%})")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000


def test_gantt_draws_the_loss_broadcast_as_communication():
    """The step's closing loss broadcast is a collective a stage waits in (bubble_stats counts
    it idle): the chart draws it as communication, a thin bar. It was a full "other" box, so a
    measured pp 2 step's last stage looked busy for the 80 ms it waited for stage 0's last
    backward. Work that is not a pipeline compute (an optimizer step) stays "other"."""
    from megapar.pipeline.timeline import _colour_key

    assert _colour_key("loss_broadcast") == _colour_key("wait") == "comm"
    assert _colour_key("optimizer") == "other" and _colour_key("forward") == "forward"


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("interleaved", 2), ("zb-v", 2)])
def test_gantt_labels_say_the_model_chunk_where_a_rank_holds_several(schedule, chunks,
                                                                      monkeypatch, tmp_path):
    """Under interleaved 1F1B and the V schedules each micro-batch passes a rank once per chunk;
    the chart labelled both boxes "3", so which one was chunk 1 could not be read off it. With
    several chunks a label is micro-batch@chunk, as --show-schedule writes it."""
    from matplotlib.axes import Axes

    labels = []
    real_text = Axes.text
    monkeypatch.setattr(Axes, "text",
                        lambda self, x, y, s, *a, **k: labels.append(s) or real_text(self, x, y, s,
                                                                                     *a, **k))
    tl = simulate_schedule(schedule, 2, 4, Costs(fwd_ms=1, bwd_ms=2), virtual_stages=chunks)
    plot_gantt(tl, str(tmp_path / "g.png"))
    if chunks == 1:
        assert sorted(set(labels)) == ["0", "1", "2", "3"]
    else:
        assert sorted(set(labels)) == [f"{mb}@{c}" for mb in range(4) for c in range(2)]


def _saved_figures(monkeypatch) -> list:
    """The Figures plot_gantt would save, in order (kept, not written: the tests read their
    artists)."""
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: saved.append(self))
    return saved


def _label_boxes(fig, tl) -> list[tuple[str, float, float]]:
    """(label, its width, its box's width) in pixels, for every label drawn on the chart."""
    ax, renderer, out = fig.axes[0], fig.canvas.get_renderer(), []
    for text in ax.texts:
        centre, row = text.get_position()
        box = next(e for e in tl.for_rank(tl.ranks()[round(row)])
                   if 1e3 * (e.start - tl.start + e.duration / 2) == pytest.approx(centre))
        (left, _), (right, _) = ax.transData.transform(
            [(1e3 * (box.start - tl.start), row), (1e3 * (box.end - tl.start), row)])
        out.append((text.get_text(), text.get_window_extent(renderer).width, right - left))
    return out


def test_gantt_labels_only_boxes_they_fit_in(monkeypatch, tmp_path):
    """A label was drawn on every box wider than 2 % of the step, whatever its width in pixels:
    two 2.5 ms forwards of a 100 ms step (chunk labels 10@1 and 11@1, wider than their boxes)
    ran into each other. A label is drawn where it fits in its box; the 2 % rule also left
    boxes unlabelled that had room (1F1B pp 2, m 16: 32 of 64, every backward)."""
    saved = _saved_figures(monkeypatch)
    tl = Timeline([Event(0, "forward", 10, 0.0, 0.0025, 1),
                   Event(0, "forward", 11, 0.0025, 0.005, 1),
                   Event(0, "backward", 10, 0.005, 0.1, 1)])
    plot_gantt(tl, str(tmp_path / "narrow.png"))
    assert [label for label, _, _ in _label_boxes(saved[-1], tl)] == ["10@1"]  # the backward's
    tl = simulate_schedule("1f1b", 2, 16, Costs(fwd_ms=1, bwd_ms=2))
    plot_gantt(tl, str(tmp_path / "many.png"))
    boxes = _label_boxes(saved[-1], tl)
    assert len(boxes) == 2 * 2 * 16 and all(width < box for _, width, box in boxes)


def _drawn_boxes(fig) -> list[tuple]:
    """Every box the chart's collections draw, in drawing order: (row, x, width, y0, height,
    face RGBA, edge RGBA), read off each collection's paths and per-box colours."""
    import numpy as np

    ax, out = fig.axes[0], []
    for collection in sorted(ax.collections, key=lambda c: c.get_zorder()):  # stable: as drawn
        faces, edges = collection.get_facecolor(), collection.get_edgecolor()
        for i, path in enumerate(collection.get_paths()):
            (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            row = round(float(y0) + 0.4)
            assert np.isclose(y0, row - 0.4)  # every box hangs from the top of its row
            edge = edges[i % len(edges)] if len(edges) else (0.0, 0.0, 0.0, 0.0)
            out.append((row, float(x0), float(x1 - x0), float(y0), float(y1 - y0),
                        tuple(map(float, faces[i % len(faces)])), tuple(map(float, edge))))
    return out


def _expected_boxes(tl, comm=True) -> list[tuple]:
    """The boxes the chart should draw for `tl`, from its events: an idle bar across each row,
    each compute (and other work, an optimizer step) a full box outlined in white, each message
    or wait a thin unoutlined bar at the top of its row (none when `comm` is False); times in
    ms from the step's start, rows in rank order."""
    from matplotlib.colors import to_rgba

    from megapar.pipeline.timeline import _COLOURS

    colour = {"forward": "forward", "backward": "backward", "recompute": "recompute",
              "backward_input": "backward_input", "backward_weight": "backward_weight",
              "optimizer": "other", "send_act": "comm", "recv_act": "comm",
              "send_grad": "comm", "recv_grad": "comm", "wait": "comm", "loss_broadcast": "comm"}
    bar = ("send_act", "recv_act", "send_grad", "recv_grad", "wait", "loss_broadcast")
    out = []
    for row, rank in enumerate(tl.ranks()):
        out.append((row, 0.0, 1e3 * tl.step_time, row - 0.4, 0.8, to_rgba(_COLOURS["idle"]),
                    (0.0, 0.0, 0.0, 0.0)))
        for e in tl.events:
            if e.rank != rank or (e.kind in bar and not comm):
                continue
            thin = e.kind in bar
            height, edge = (0.15, (0.0, 0.0, 0.0, 0.0)) if thin else (0.8, to_rgba("white"))
            out.append((row, 1e3 * (e.start - tl.start), 1e3 * e.duration, row - 0.4, height,
                        to_rgba(_COLOURS[colour[e.kind]]), edge))
    return out


def _same_boxes(drawn, expected):
    """The same boxes, in any order: rows and colours equal, positions and sizes to 1e-9."""
    key = lambda b: (b[0], round(b[1], 6), round(b[2], 6), b[4], b[5])  # noqa: E731
    assert len(drawn) == len(expected)
    for d, e in zip(sorted(drawn, key=key), sorted(expected, key=key)):
        assert (d[0], d[5], d[6]) == (e[0], e[5], e[6]), (d, e)
        assert d[1:5] == pytest.approx(e[1:5], rel=1e-9, abs=1e-9), (d, e)


def test_gantt_boxes_are_the_timelines_events(monkeypatch, tmp_path):
    """The chart draws its boxes as collections (one artist per box took 14 s to lay out and
    draw a 5,500-event step): read back through them, the boxes are exactly the timeline's
    events, each at its time and row, in its colour, an idle bar under each row; a recompute
    inside a backward is drawn after it (on top), and comm=False draws no bars."""
    from matplotlib.colors import to_rgba

    from megapar.pipeline.timeline import _COLOURS

    saved = _saved_figures(monkeypatch)
    tl = Timeline([
        Event(0, "forward", 0, 10.0, 12.0),
        Event(0, "send_act", 0, 12.0, 12.5),
        Event(0, "backward", 0, 13.0, 16.0),
        Event(0, "recompute", 0, 14.0, 15.0),
        Event(0, "wait", None, 16.0, 16.5),
        Event(3, "recv_act", 0, 10.0, 12.0),
        Event(3, "forward", 0, 12.0, 14.0),
        Event(3, "backward_input", 0, 14.0, 15.0),
        Event(3, "backward_weight", 0, 15.0, 15.5),
        Event(3, "loss_broadcast", None, 15.5, 16.0),
        Event(3, "optimizer", None, 17.0, 18.0),
    ])
    plot_gantt(tl, str(tmp_path / "g.png"))
    drawn = _drawn_boxes(saved[-1])
    _same_boxes(drawn, _expected_boxes(tl))
    assert [t.get_text() for t in saved[-1].axes[0].get_yticklabels()] == ["stage 0", "stage 3"]
    order = [b[5] for b in drawn]  # face colours in drawing order: one recompute, one backward
    assert order.index(to_rgba(_COLOURS["recompute"])) > order.index(to_rgba(_COLOURS["backward"]))
    plot_gantt(tl, str(tmp_path / "g.png"), comm=False)
    _same_boxes(_drawn_boxes(saved[-1]), _expected_boxes(tl, comm=False))
    # a simulated step, messages with a latency, and one without: every event a box
    for costs, comm in ((Costs(fwd_ms=1, bwd_ms=2, p2p_ms=0.1), True),
                        (Costs(fwd_ms=1, bwd_ms=2), False)):
        tl = simulate_schedule("zb-v", 4, 8, costs)
        plot_gantt(tl, str(tmp_path / "s.png"), comm=comm)
        _same_boxes(_drawn_boxes(saved[-1]), _expected_boxes(tl, comm))
        assert len(saved[-1].axes[0].collections) <= 2 * len(tl.ranks())  # not one per box


def test_gantt_labels_every_box_it_fits_and_no_other(monkeypatch, tmp_path):
    """Boxes of 40 widths in a shuffled order, all labelled 10@1: a box is labelled exactly
    where the label (measured as a Text on the chart), with a point to spare on either side,
    fits in it; some are wide enough to be measured and still too narrow (the width of each
    distinct label is measured once and reused)."""
    saved = _saved_figures(monkeypatch)
    widths_ms = [0.05 * (1 + (17 * i) % 40) for i in range(40)]
    starts = [sum(widths_ms[:i]) for i in range(40)]
    tl = Timeline([Event(0, "forward", 10, 1e-3 * s, 1e-3 * (s + w), 1)
                   for s, w in zip(starts, widths_ms)])
    plot_gantt(tl, str(tmp_path / "ramp.png"))
    fig = saved[-1]
    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    probe = ax.text(0, 0, "10@1", fontsize=7)
    label = probe.get_window_extent(renderer).width
    probe.remove()
    points = fig.dpi / 72
    labelled = {round(text.get_position()[0], 9) for text in ax.texts}
    band = 0
    for s, w in zip(starts, widths_ms):
        (left, _), (right, _) = ax.transData.transform([(s, 0), (s + w, 0)])
        room = right - left - 2 * points
        assert (round(s + w / 2, 9) in labelled) == (label <= room), (w, room, label)
        band += 0.5 * 7 * points * 4 <= room < label  # measured, and too narrow
    assert band and len(labelled) > 5
