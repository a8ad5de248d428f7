"""megapar-bubble end to end: simulated numbers checked by hand, a measured run's trace and plot,
GPipe vs 1F1B memory, tracing off, and the operator plot scripts in tools/.

Measured runs assert structure (every micro-batch forwarded and backwarded once per stage, no
overlapping events, a bubble in [0, 1)) and deterministic memory, never wall-clock values.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_script import load_script

from megapar.cli.bubble import main
from megapar.cli.closed_stdout import quiet_when_stdout_closes
from megapar.mesh import Layout, Mesh
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.simulate import Costs
from megapar.training import bubble, bubble_run

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--micro-batch-size", "2", "--seq-len", "16", "--steps", "1"]


def run_cli(capsys, *argv) -> tuple[dict, str]:
    """Run megapar-bubble; its final JSON line and the whole stdout."""
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1], parse_constant=_not_json), out


def _not_json(name: str):
    raise AssertionError(f"the JSON line holds {name}, which strict JSON (jq, JavaScript) refuses")


def load_tool(name):
    return load_script(f"tools/{name}.py")


def assert_png(path):
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5_000  # a real chart, not an empty canvas


# simulated: by hand -------------------------------------------------------------------------
# Equal stages, forward f = 1 ms, backward b = 2 ms, free communication. Both schedules: the
# last stage starts its first forward after the forward wave crossed pp-1 stages ((pp-1)*f), and
# stage 0 finishes its last backward after the backward wave crossed them back ((pp-1)*b), with
# m*(f+b) of work per stage in between, so step = (m+pp-1)*(f+b) and every stage idles
# (pp-1)*(f+b) of it: bubble = (pp-1)/(m+pp-1).
#   pp=2, m=4: step = 5*3 = 15 ms, bubble = 1/5 = 0.2
#   pp=4, m=8: step = 11*3 = 33 ms, bubble = 3/11
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m, step_ms, bubble_frac", [(2, 4, 15.0, 1 / 5), (4, 8, 33.0, 3 / 11)])
def test_simulated_cli_matches_hand_computation(capsys, schedule, pp, m, step_ms, bubble_frac):
    result, out = run_cli(capsys, "--pp", str(pp), "--microbatches", str(m), "--schedule",
                          schedule, "--simulate", "--fwd-ms", "1", "--bwd-ms", "2")
    assert result["step_time_s"] == pytest.approx(step_ms / 1e3, rel=1e-12)
    assert result["measured_bubble"] == pytest.approx(bubble_frac, rel=1e-12)
    assert result["measured_bubble"] == pytest.approx(result["theoretical_bubble"], rel=1e-12)
    assert result["per_stage_bubble"] == pytest.approx([bubble_frac] * pp, rel=1e-12)
    assert f"simulated {schedule}, pp={pp}, m={m}" in out
    assert f"{100 * bubble_frac:.1f}" in out  # the table shows it too


def test_simulated_cli_latency_and_default_backward(capsys):
    # GPipe, pp=2, m=4, f=1, b=2 (the default 2 x f), p2p latency c=0.5. Stage 0 forwards over
    # [0, 4]; act i arrives at i+1.5, so stage 1 forwards over [1.5, 5.5] and backwards over
    # [5.5, 13.5] (grad i sent at 7.5+2i). Stage 0 gets grad i at 8+2i, backwards over [8, 16]:
    # step 16 ms = 15 + 2*c. Busy 12 ms per stage: bubble 4/16 = 0.25 > theory (0.2).
    result, _ = run_cli(capsys, "--pp", "2", "-m", "4", "--schedule", "gpipe", "--simulate",
                        "--fwd-ms", "1", "--p2p-ms", "0.5")
    assert result["step_time_s"] == pytest.approx(16e-3, rel=1e-12)
    assert result["source"] == "simulated"  # its "measured_bubble" is the simulation's
    assert result["measured_bubble"] == pytest.approx(0.25, rel=1e-12)
    assert result["theoretical_bubble"] == pytest.approx(0.2)


def test_simulate_from_measured_costs_gives_each_stage_its_own(capsys, monkeypatch):
    """--simulate without costs simulated every stage at the mean of the measured ones, so a
    last stage slowed by the head vanished (the sweep gives each stage its own). Here stage 1
    is twice stage 0: 1F1B at pp 2, m 4 takes F0 + 4 (F1 + B1) + B0 = 1 + 24 + 2 = 27 ms,
    stage 0 idle 15 of it; at the mean costs (1.5 / 3) it was 22.5 ms, 20 %."""
    stage = [{"fwd_ms": 1.0, "bwd_ms": 2.0, "p2p_ms": 0.0},
             {"fwd_ms": 2.0, "bwd_ms": 4.0, "p2p_ms": 0.0}]

    def measured(*args, **kwargs):
        run = bubble_run.simulate(2, 4, "1f1b", 1.0, 2.0, stage_costs=stage)
        run.costs = {"fwd_ms": 1.5, "bwd_ms": 3.0, "p2p_ms": 0.0}
        return run

    monkeypatch.setattr(bubble, "measure", measured)
    result, out = run_cli(capsys, "--pp", "2", "-m", "4", "--simulate")
    assert result["source"] == "simulated" and result["stage_costs_ms"] == stage
    assert result["step_time_s"] == pytest.approx(27e-3, rel=1e-12)
    assert result["per_stage_bubble"] == pytest.approx([15 / 27, 3 / 27], rel=1e-12)


# measured on real processes -----------------------------------------------------------------
def test_measured_run_writes_chrome_trace_and_gantt(capsys, tmp_path):
    trace, png = tmp_path / "trace.json", tmp_path / "gantt.png"
    pp, m = 2, 4
    result, out = run_cli(capsys, "--pp", str(pp), "-m", str(m), "--schedule", "1f1b", *SMALL,
                          "--trace", str(trace), "--plot", str(png))
    assert "measured 1f1b, pp=2, m=4" in out
    assert result["source"] == "measured"
    assert 0.0 <= result["measured_bubble"] < 1.0
    assert all(0.0 <= b < 1.0 for b in result["per_stage_bubble"])
    assert result["theoretical_bubble"] == pytest.approx(1 / 5)
    assert result["in_flight_peak"] == [2, 1]
    assert_png(png)

    doc = json.loads(trace.read_text())
    assert isinstance(doc["traceEvents"], list)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for e in spans:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= e.keys()
        assert e["dur"] >= 0 and e["ts"] >= 0
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "stage 0", 1: "stage 1"}
    for stage in range(pp):
        mine = sorted((e for e in spans if e["tid"] == stage), key=lambda e: e["ts"])
        for kind in ("forward", "backward"):  # every micro-batch exactly once per stage
            assert sorted(e["args"]["mb"] for e in mine if e["cat"] == kind) == list(range(m))
        for a, b in zip(mine, mine[1:]):  # one action at a time on a stage
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)

    # The operator script turns the saved trace back into the same Gantt chart.
    out_png = tmp_path / "from_trace.png"
    assert load_tool("plot_trace").main([str(trace), "-o", str(out_png)]) == 0
    assert_png(out_png)


def test_plot_trace_draws_a_profiler_trace_whose_thread_ids_mix_numbers_and_names(tmp_path,
                                                                                capsys,
                                                                                monkeypatch):
    """torch.profiler's traces (--profile-steps) hold spans on numbered threads and on named
    ones (pid "Spans", tid "PyTorch Profiler"): plot_trace failed sorting them ('<' not
    supported between str and int), a new user's finding. Now it draws each thread as a row
    and, having no pipeline compute, prints no bubble table."""
    trace = tmp_path / "trace_rank0.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 4242, "tid": 4242, "ts": 10,
         "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 4242, "tid": 17, "ts": 12,
         "dur": 2},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "pid": "Spans",
         "tid": "PyTorch Profiler", "ts": 0, "dur": 30}]}))
    out_png = tmp_path / "profile.png"
    from megapar.pipeline import timeline as timeline_module

    drawn, real = [], timeline_module.plot_gantt

    def plot_gantt(*args, **kwargs):
        drawn.append(kwargs["row_name"])
        return real(*args, **kwargs)

    monkeypatch.setattr(timeline_module, "plot_gantt", plot_gantt)
    assert load_tool("plot_trace").main([str(trace), "-o", str(out_png)]) == 0
    assert_png(out_png)
    out = capsys.readouterr().out
    assert "no pipeline compute events" in out and "bubble %" not in out, out
    assert drawn == ["thread"]  # its rows are threads: they read "stage 0" ... "stage 7"


def test_1f1b_holds_fewer_micro_batches_and_less_activation_memory_than_gpipe():
    kw = dict(steps=1, micro_batch_size=2, seq_len=16)
    gpipe, one_f = (bubble.measure(2, 8, s, **kw) for s in ("gpipe", "1f1b"))
    assert gpipe.in_flight == [8, 8] and one_f.in_flight == [2, 1]
    # Bytes autograd saved for backward: deterministic, unlike times. Stage 0 of 1F1B holds 2
    # micro-batches at a time instead of 8 (and stage 1 one instead of 8).
    assert one_f.activation_mb[0] < gpipe.activation_mb[0]
    assert one_f.activation_mb[1] < gpipe.activation_mb[1]
    assert one_f.activation_mb[0] < 0.5 * gpipe.activation_mb[0]


# tracing off ---------------------------------------------------------------------------------
class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, hidden, batch):
        return self.lin(batch["x"]).pow(2).mean()


def test_tracing_off_records_nothing_and_changes_no_numbers():
    mesh = Mesh(Layout())
    batches = [{"x": torch.full((2, 4), float(i))} for i in range(3)]
    results = []
    for trace in (True, False):
        torch.manual_seed(0)
        stage = Tiny()
        executor = PipelineExecutor(stage, mesh, "1f1b", (2, 4), trace=trace)
        loss = executor.run(batches)
        results.append((loss, stage.lin.weight.grad.clone(), executor.last_timeline.events))
    (loss_on, grad_on, events_on), (loss_off, grad_off, events_off) = results
    assert torch.equal(loss_on, loss_off) and torch.equal(grad_on, grad_off)
    assert [e.kind for e in events_on].count("forward") == 3
    assert events_off == []


# tools/plot_log.py ---------------------------------------------------------------------------
def test_plot_log_draws_loss_and_val_loss(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    rows = [{"step": s, "loss": 5.0 / s, "lr": 1e-3} for s in range(1, 11)]
    rows[4]["val_loss"], rows[9]["val_loss"] = 1.2, 0.7
    rows.append({"step": 10, "loss": 0.4, "lr": 1e-3})  # a resumed run re-logs step 10
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tool = load_tool("plot_log")
    series = tool.read_series(log, ["loss", "val_loss"])
    assert series["loss"][0] == list(range(1, 11)) and series["loss"][1][-1] == 0.4
    assert series["val_loss"] == ([5, 10], [1.2, 0.7])
    png = tmp_path / "new" / "loss.png"  # its directory made, as megapar-bubble --plot makes it
    assert tool.main([str(log), "-o", str(png)]) == 0
    assert_png(png)
    capsys.readouterr()
    # an output it cannot write was a traceback after the work (and no suffix printed a name
    # that was not the file written: matplotlib adds .png)
    for bad, message in (("/proc/loss.png", "--output /proc/loss.png is not writable"),
                         (str(tmp_path / "loss.xyz"), "matplotlib cannot write .xyz files")):
        assert tool.main([str(log), "-o", bad]) == 2
        assert message in capsys.readouterr().err
    assert tool.main([str(log), "-o", str(tmp_path / "curve")]) == 0
    assert f"wrote {tmp_path / 'curve.png'}" in capsys.readouterr().out
    # a metric no record holds (a typo) was skipped without a word, yet named on the y axis
    assert tool.main([str(log), "-o", str(png), "--metrics", "loss,lost"]) == 0
    assert f"plot_log: no lost records in {log}: left out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(["--help"])
    assert "--log-json" in capsys.readouterr().out


def test_plot_log_draws_a_list_per_element_and_names_a_file_without_points(tmp_path, capsys):
    """A MoE log's moe_tokens_per_expert (a list) is a curve per expert, and an fp16 log whose
    grad_norm is null on every step says so per file (it called the list field absent and left
    the null one out without a word: the metrics audit's finding)."""
    moe, fp16 = tmp_path / "moe.jsonl", tmp_path / "fp16.jsonl"
    moe.write_text("".join(json.dumps({"step": s, "grad_norm": 1.0,
                                       "moe_tokens_per_expert": [s, 2 * s]}) + "\n"
                           for s in (1, 2)))
    fp16.write_text("".join(json.dumps({"step": s, "grad_norm": None}) + "\n" for s in (1, 2)))
    tool = load_tool("plot_log")
    series = tool.read_series(moe, ["moe_tokens_per_expert"])
    assert series == {"moe_tokens_per_expert/0": ([1, 2], [1.0, 2.0]),
                      "moe_tokens_per_expert/1": ([1, 2], [2.0, 4.0])}
    assert tool.main([str(moe), str(fp16), "-o", str(tmp_path / "p.png"), "--metrics",
                      "grad_norm,moe_tokens_per_expert"]) == 0
    out, err = capsys.readouterr()
    assert f"{fp16}: grad_norm: 0 points" in out and f"{moe}: grad_norm: 2 points" in out, out
    assert "moe_tokens_per_expert/1: 2 points" in out and "left out" not in err, (out, err)


def test_show_schedule_prints_each_stage_program_with_its_message_groups(capsys):
    assert main(["--pp", "2", "--microbatches", "3", "--schedule", "1f1b", "--show-schedule"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["stage 0: F0 [SA0] F1 [SA1 RG0] B0 F2 [SA2 RG1] B1 [RG2] B2",
                       "stage 1: [RA0] F0 [RA1] B0 [SG0] F1 B1 [SG1 RA2] F2 B2 [SG2]"]
    assert out[2].startswith("key: F3 = forward of micro-batch 3") and "SA / RA" in out[2]
    assert "checked against NCCL's rules" in out[3]


# new schedules ---------------------------------------------------------------------------------
def test_simulated_cli_interleaved_and_zb_h1_by_hand(capsys):
    # Interleaved pp=2, m=2, V=2, f=1, b=2 per chunk: 15 ms step, 12 busy, bubble 1/5 =
    # (p-1)/(V m + p-1) (spelled out in test_schedules_new.test_simulated_interleaved_by_hand).
    result, out = run_cli(capsys, "--pp", "2", "-m", "2", "--schedule", "interleaved",
                          "--virtual-stages", "2", "--simulate", "--fwd-ms", "1")
    assert "simulated interleaved V=2, pp=2, m=2" in out
    assert result["step_time_s"] == pytest.approx(15e-3)
    assert result["measured_bubble"] == pytest.approx(0.2) == result["theoretical_bubble"]
    assert result["in_flight_peak"] == [4, 3]
    # ZB-H1 pp=2, m=2 with F=1, B=1, W=0.5: r1 F0[1,2] B0[2,3] F1[3,4] B1[4,5] W0 W1 -> 6;
    # r0 F0 F1 [0,2] B0[3,4] W0[4,4.5] B1[5,6] W1[6,6.5]: step 6.5, busy 5 per stage.
    result, _ = run_cli(capsys, "--pp", "2", "-m", "2", "--schedule", "zb-h1", "--simulate",
                        "--fwd-ms", "1", "--bwd-input-ms", "1", "--bwd-weight-ms", "0.5")
    assert result["step_time_s"] == pytest.approx(6.5e-3)
    assert result["measured_bubble"] == pytest.approx(1.5 / 6.5)
    # the paper's formula: (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W)) = 1.5 / 6.5
    assert result["theoretical_bubble"] == pytest.approx(1.5 / 6.5)
    # a W that costs nothing is a cost, not a missing one: pp 4, m 8, F = B = 1, W = 0 gives
    # 3 x 2 / (8 x 2 + 3 x 2) = 27.3 % by the formula and by the simulator
    result, _ = run_cli(capsys, "--pp", "4", "-m", "8", "--schedule", "zb-h1", "--simulate",
                        "--fwd-ms", "1", "--bwd-weight-ms", "0")
    assert result["theoretical_bubble"] == pytest.approx(6 / 22) == result["measured_bubble"]
    # the paper's formula holds where W <= min(F, B) (and m >= pp); beyond it there is none:
    # "-" and null (it was NaN, which is no JSON)
    result, out = run_cli(capsys, "--pp", "4", "-m", "8", "--schedule", "zb-h1", "--simulate",
                          "--fwd-ms", "1", "--bwd-input-ms", "1", "--bwd-weight-ms", "5")
    assert result["theoretical_bubble"] is None and 0 < result["measured_bubble"] < 1
    assert out.splitlines()[-4].split()[-1] == "-" and "nan" not in out


def test_simulated_cli_zb_v_against_zb_h1_and_1f1b(capsys):
    """The issue's command, pp 8, m 32, F 10 ms, backward 20 ms (B and W 10 each): ZB-V's
    bubble is the pipeline fill, 70 ms of 1990 (3.5 %, the formula's too), about half of
    ZB-H1's 6.8 %: no two-chunk schedule with a synchronous step can go below the fill. Its
    peak activations, 16 half-stage chunks on every rank, are 1F1B's 8 stages."""
    flags = ["--pp", "8", "-m", "32", "--simulate", "--fwd-ms", "10", "--bwd-ms", "20"]
    results = {}
    for schedule in ("1f1b", "zb-h1", "zb-v", "dualpipev"):
        results[schedule], _ = run_cli(capsys, *flags, "--schedule", schedule)
    zb_v, zb_h1, one = results["zb-v"], results["zb-h1"], results["1f1b"]
    assert zb_h1["measured_bubble"] == pytest.approx(70 / 1030)
    assert zb_v["measured_bubble"] == pytest.approx(70 / 1990) == zb_v["theoretical_bubble"]
    assert zb_v["measured_bubble"] < 0.52 * zb_h1["measured_bubble"]
    assert results["dualpipev"]["measured_bubble"] == pytest.approx(70 / 1990)
    assert max(zb_v["in_flight_peak"]) / 2 <= max(one["in_flight_peak"]) == 8
    assert main(["--pp", "2", "-m", "4", "--schedule", "zb-v", "--virtual-stages", "3",
                 "--show-schedule"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--virtual-stages 3 does not apply to --schedule zb-v" in err
    assert main(["--pp", "2", "-m", "3", "--schedule", "dualpipev", "--show-schedule"]) == 2
    err = capsys.readouterr().err  # megapar-bubble's flag for m, not megapar-train's too
    assert err.endswith("DualPipeV needs at least 2 x pp = 4 micro-batches (one per virtual "
                        "stage), got m = 3; use more micro-batches, or the zb-v schedule, which "
                        "takes any m; m is --microbatches (-m) 3\n"), err
    assert main(["--certify", "--pp", "2", "-m", "3", "--schedule", "dualpipev"]) == 2
    assert capsys.readouterr().err == err


def test_show_schedule_builds_no_model_and_answers_before_torch():
    """--show-schedule prints programs: no model is built, so none is checked. `--cp 3` was
    refused with "--seq-len 64 is not divisible by 6 ... choose a multiple of 6", and
    --seq-len is a flag --show-schedule refuses (a dead end); and it imported torch to check
    the model (2.4 s of a 0.3 s answer)."""
    import subprocess
    import sys

    script = ("import sys; from megapar.cli.bubble import main\n"
              "assert main(['--pp', '4', '-m', '8', '--cp', '3', '--show-schedule']) == 0\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    out = run.stdout.strip().splitlines()
    assert out[0].startswith("stage 0: F0 [SA0]") and any(x.startswith("cp 3: ") for x in out)
    assert out[-1] == "[]", out[-1]


def test_bubble_cli_rejects_bad_virtual_stages(capsys):
    assert main(["--pp", "2", "-m", "5", "--schedule", "interleaved", "--virtual-stages", "2",
                 "--simulate", "--fwd-ms", "1"]) == 2
    assert "m must be divisible by 2" in capsys.readouterr().err
    assert main(["--pp", "2", "-m", "4", "--virtual-stages", "2", "--show-schedule"]) == 2
    # megapar-bubble's own flags: the default schedule said so, no Python spelling (there is
    # none for megapar-bubble)
    assert capsys.readouterr().err.strip() == (
        "megapar-bubble: error: --virtual-stages 2 with --schedule 1f1b (the default) needs "
        "--schedule interleaved, zb-v or dualpipev: 1f1b runs one model chunk per rank; give "
        "one of them, or leave --virtual-stages out")


def test_virtual_stages_on_a_one_chunk_schedule_offer_what_the_model_holds(capsys, no_work):
    # "needs --schedule interleaved" with --virtual-stages 3, which 4 layers at --pp 2 refuse
    # in turn (a session's finding)
    assert main(["--pp", "2", "-m", "4", "--schedule", "zb-h1", "--virtual-stages", "3",
                 "--model", "gpt2-tiny"]) == 2
    line = _error_line(capsys)
    assert ("zb-h1 runs one model chunk per rank, and the model's 4 layers at --pp 2 hold 2 "
            "per rank at most; give --schedule interleaved, zb-v or dualpipev with "
            "--virtual-stages 2, or leave --virtual-stages out") in line, line
    assert main(["--pp", "4", "-m", "4", "--virtual-stages", "2", "--model", "gpt2-tiny"]) == 2
    assert _error_line(capsys).endswith(
        "--virtual-stages 2 with --schedule 1f1b (the default): 1f1b runs one model chunk per "
        "rank, and the model's 4 layers at --pp 4 hold no more than one per rank; leave "
        "--virtual-stages out")



def test_a_failed_measurement_is_one_line_and_a_log(capsys, monkeypatch, tmp_path):
    """A rank that fails in the measured run (on a CPU: out of memory in its steps, past the
    guard that refuses a model whose parameters alone do not fit) is one line naming the rank and the error, and the file with its
    traceback, exit 1, as megapar-train and megapar-eval say it; it was the WorkerError's
    traceback, then every rank's."""
    from megapar.launcher import WorkerError

    def fail(*args, **kwargs):
        raise WorkerError("rank 1 failed: RuntimeError: DefaultCPUAllocator: can't allocate "
                          "memory\nTraceback (most recent call last):\n  File ...\n")

    monkeypatch.setattr(bubble, "measure", fail)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["--pp", "2", "-m", "4", "--steps", "1"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines == [
        "megapar-bubble: error: rank 1 failed in the measured run: RuntimeError: "
        "DefaultCPUAllocator: can't allocate memory (full traceback in "
        + next(str(p) for p in tmp_path.rglob("rank1.log")) + ")"], captured.err
    assert "Traceback" in next(tmp_path.rglob("rank1.log")).read_text()

# bad inputs: one line, exit 2, before any work -----------------------------------------------
@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a measurement or simulation starts."""
    def refuse(*args, **kwargs):
        raise AssertionError("work started for a bad input")

    monkeypatch.setattr(bubble, "measure", refuse)  # measured runs and --simulate's costs
    monkeypatch.setattr(bubble_run, "simulate", refuse)  # what megapar-bubble simulates with


def _error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megapar-bubble: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


@pytest.mark.parametrize("costs", [["--fwd-ms", "1e308"],  # the default backward, 2 x F
                                   ["--fwd-ms", "1e307", "--bwd-ms", "1e307"],
                                   ["--fwd-ms", "1", "--p2p-ms", "1e308"]])
def test_costs_whose_step_overflows_a_float_are_refused(capsys, no_work, costs, tmp_path):
    # each cost finite, their step not: the simulation printed a NaN bubble and
    # "step_time_s": Infinity (not JSON) with exit code 0, and wrote the trace
    trace = tmp_path / "t.json"
    assert main(["--pp", "4", "-m", "8", "--simulate", *costs, "--trace", str(trace)]) == 2
    assert "add up to more than" in _error_line(capsys)
    assert not trace.exists()


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_too_few_layers_for_the_v_names_a_fix_that_applies(capsys, no_work, schedule):
    # the V always places two chunks per rank: the line said "--virtual-stages 2" (not given)
    # and "lower --virtual-stages", which zb-v and dualpipev refuse
    assert main(["--pp", "4", "-m", "8", "--schedule", schedule, "--model", "gpt2-tiny"]) == 2
    line = _error_line(capsys)
    assert "4 layers cannot be cut into 2 x --pp 4 = 8 model chunks" in line
    assert "--virtual-stages" not in line and "lower --pp to 2, or use" in line  # (not "2 or less": zb-v needs 2)
    # more stages than layers: the V's line too, not the model's "lower --pp" (to 4, which
    # the V refuses in turn; a re-test)
    assert main(["--pp", "8", "-m", "8", "--schedule", schedule, "--model", "gpt2-tiny"]) == 2
    line = _error_line(capsys)
    assert "4 layers cannot be cut into 2 x --pp 8 = 16 model chunks" in line, line
    assert "lower --pp to 2, or use" in line, line


def test_large_costs_whose_step_fits_a_float_simulate(capsys):
    assert main(["--pp", "4", "-m", "8", "--simulate", "--fwd-ms", "1e300", "--bwd-ms",
                 "1e300"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["measured_bubble"] == pytest.approx(3 / 11, rel=1e-9)


@pytest.mark.parametrize("flag", ["--fwd-ms", "--bwd-ms", "--bwd-input-ms", "--bwd-weight-ms",
                                  "--p2p-ms"])
def test_cost_flags_without_simulate_are_refused(capsys, no_work, flag):
    # measured mode used to ignore them silently
    assert main(["--pp", "2", "-m", "4", flag, "1"]) == 2
    assert f"{flag} is used only with --simulate" in _error_line(capsys)


def test_cost_flags_that_would_be_ignored_under_simulate_or_show_schedule(capsys, no_work):
    # without --fwd-ms, --simulate measures every cost: a lone --bwd-ms would be overwritten
    assert main(["--pp", "2", "-m", "4", "--simulate", "--bwd-ms", "2"]) == 2
    assert "--bwd-ms needs --fwd-ms" in _error_line(capsys)
    assert main(["--pp", "2", "-m", "4", "--show-schedule", "--fwd-ms", "1"]) == 2
    assert "--fwd-ms is not used with --show-schedule" in _error_line(capsys)
    assert main(["--pp", "2", "-m", "4", "--show-schedule", "--plot", "g.png"]) == 2
    assert "--plot is not used with --show-schedule" in _error_line(capsys)
    assert main(["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", "--bwd-weight-ms",
                 "nan"]) == 2
    assert "--bwd-weight-ms nan is invalid" in _error_line(capsys)
    # a schedule without a split backward ignored a lone B or W (1F1B ran its 2 x F backward)
    assert main(["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", "--bwd-input-ms",
                 "5"]) == 2
    assert "--bwd-input-ms is not used by --schedule 1f1b, whose backward is not split" \
        in _error_line(capsys)
    # all three given: they must add up (B 3 + W 2 against --bwd-ms 4 was told the halves were
    # unused, where 3 + 1 runs; a re-test), and then they are the backward
    assert main(["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", "--bwd-ms", "4",
                 "--bwd-input-ms", "3", "--bwd-weight-ms", "2"]) == 2
    assert ("--bwd-input-ms 3 + --bwd-weight-ms 2 = 5 is not --bwd-ms 4: --schedule 1f1b runs "
            "the backward whole; give --bwd-ms alone, or the two halves alone") \
        in _error_line(capsys)
    from types import SimpleNamespace

    from megapar.training.validate_bubble import check_split_costs

    check_split_costs(SimpleNamespace(schedule="1f1b", fwd_ms=1.0, bwd_ms=2.0, bwd_input_ms=1.0,
                                      bwd_weight_ms=1.0))  # three that agree: taken
    # B and W split the backward: --bwd-ms 4 --bwd-input-ms 3 simulated W 2 (B + W = 5)
    assert main(["--pp", "2", "-m", "4", "--schedule", "zb-h1", "--simulate", "--fwd-ms", "1",
                 "--bwd-ms", "4", "--bwd-input-ms", "3", "--bwd-weight-ms", "3"]) == 2
    assert "--bwd-input-ms 3 + --bwd-weight-ms 3 = 6 is not --bwd-ms 4" in _error_line(capsys)
    assert Costs(1.0, 4.0, bwd_input_ms=3.0).duration_ms("backward_weight") == 1.0
    assert Costs(1.0, 4.0, bwd_weight_ms=1.5).duration_ms("backward_input") == 2.5
    assert Costs(1.0, 4.0).duration_ms("backward_input") == 2.0
    assert main(["--pp", "2", "-m", "4", "--schedule", "zb-v", "--simulate", "--fwd-ms", "1",
                 "--bwd-weight-ms", "2.5"]) == 2
    assert "--bwd-weight-ms 2.5 is longer than the backward it is part of (2 x --fwd-ms = 2)" \
        in _error_line(capsys)
    # nor did a measurement's flags where nothing is measured
    assert main(["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", "--tp", "2"]) == 2
    assert "--tp is not used by --simulate with --fwd-ms" in _error_line(capsys)
    assert main(["--pp", "2", "-m", "4", "--simulate", "--steps", "2"]) == 2
    assert "--steps is not used by --simulate (it measures the costs in one step)" \
        in _error_line(capsys)


def test_a_split_backward_half_of_zero_is_a_cost(capsys):
    """A W of 0 is a cost: ZB-H1 at W 0 is 1F1B with a backward of B, so pp 2, m 4 at
    F = B = 1 gives 1F1B's (p-1)/(m+p-1) = 0.2, formula and simulator."""
    result, _ = run_cli(capsys, "--pp", "2", "-m", "4", "--schedule", "zb-h1", "--simulate",
                        "--fwd-ms", "1", "--bwd-ms", "1", "--bwd-input-ms", "1")
    assert result["costs_ms"]["bwd_weight_ms"] == 0.0
    assert result["measured_bubble"] == pytest.approx(0.2) == result["theoretical_bubble"]


def test_split_backward_halves_of_zero_and_halves_checked_before_the_size(capsys, no_work):
    """B and W both 0 made a backward of 0 ms, which --bwd-ms 0 is refused for, and was
    simulated. An oversized request with a half longer than its backward was told a formula's
    bubble computed with a negative W."""
    for schedule in ("zb-h1", "1f1b"):
        assert main(["--pp", "2", "-m", "4", "--schedule", schedule, "--simulate", "--fwd-ms",
                     "1", "--bwd-input-ms", "0", "--bwd-weight-ms", "0"]) == 2
        assert _error_line(capsys).endswith(
            "--bwd-input-ms 0 + --bwd-weight-ms 0 is a backward of 0 ms, and a backward must "
            "cost > 0 (as --bwd-ms must); give a positive --bwd-input-ms or --bwd-weight-ms")
    assert main(["--pp", "2", "-m", "40000", "--schedule", "zb-h1", "--simulate", "--fwd-ms",
                 "1", "--bwd-input-ms", "5"]) == 2
    assert "--bwd-input-ms 5 is longer than the backward it is part of (2 x --fwd-ms = 2)" \
        in _error_line(capsys)


@pytest.mark.parametrize("argv, message", [
    # each was ignored without a word; --steps 3 is its default value, and still given
    (["--certify", "--steps", "5"], "--steps is not used with --certify"),
    (["--certify", "--seq-len", "64"], "--seq-len is not used with --certify"),
    (["--certify", "--tp", "1"], "--tp is not used with --certify"),
    (["--pp", "2", "-m", "4", "--show-schedule", "--steps", "9"],
     "--steps is not used with --show-schedule"),
    (["--pp", "2", "-m", "4", "--show-schedule", "--model", "llama-tiny"],
     "--model is not used with --show-schedule"),
    (["--pp", "2", "-m", "4", "--show-schedule", "--simulate"],
     "--simulate is not used with --show-schedule"),
    (["--pp", "2", "-m", "4", "--simulate", "--steps", "3"],
     "--steps is not used by --simulate (it measures the costs in one step)"),
    (["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", "--micro-batch-size", "4"],
     "--micro-batch-size is not used by --simulate with --fwd-ms"),
])
def test_an_option_the_mode_ignores_is_refused_even_at_its_default(capsys, no_work, argv,
                                                                   message):
    assert main(argv) == 2
    assert message in _error_line(capsys)


def test_a_reader_that_stops_early_ends_the_command_without_a_traceback():
    # `megapar-bubble ... | head -1` printed BrokenPipeError's traceback (megapar-plan too)
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import sys; from megapar.cli.closed_stdout import "
             "quiet_when_stdout_closes as q; sys.exit(q(lambda argv: print('x' * 99999))())"],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (1, "")
    for name in ("bubble", "convert", "data", "eval", "plan", "train"):  # every command's
        main_of = importlib.import_module(f"megapar.cli.{name}").main
        assert main_of.__wrapped__.__module__ == f"megapar.cli.{name}", name
    # any other pipe's error is raised as it was
    with pytest.raises(BrokenPipeError):
        quiet_when_stdout_closes(lambda argv: (_ for _ in ()).throw(BrokenPipeError("a socket")))()


@pytest.mark.parametrize("mode", [["--simulate", "--fwd-ms", "1"], SMALL])
@pytest.mark.parametrize("flag", ["--trace", "--plot"])
def test_unwritable_output_is_refused_before_any_work(capsys, tmp_path, no_work, mode, flag):
    # used to fail with a traceback after the simulation (or after the workers ran)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "sub" / ("g.png" if flag == "--plot" else "t.json")
    assert main(["--pp", "2", "-m", "4", *mode, flag, str(out)]) == 2
    line = _error_line(capsys)
    assert f"{flag} {out} is not writable" in line and "choose a location" in line


@pytest.mark.parametrize("flag", ["--trace", "--plot"])
def test_output_naming_a_directory_is_refused(capsys, tmp_path, no_work, flag):
    assert main(["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", flag, str(tmp_path)]) == 2
    assert f"{flag} {tmp_path} is a directory; give a file name" in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--trace", "--plot"])
def test_a_file_it_did_not_write_is_replaced_only_with_overwrite(capsys, tmp_path, no_work,
                                                                  flag):
    """--trace held.txt replaced a user's text with a trace, without a word (a new user's
    tryout): refused before any work unless --overwrite; a trace or chart it wrote is replaced
    as before."""
    held = tmp_path / ("held.png" if flag == "--plot" else "held.txt")
    held.write_text("To be, or not to be\n")
    argv = ["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", flag, str(held)]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert f"{flag} {held} exists and is no " in line and "(it replaces only its own " \
        "outputs)" in line, line
    assert line.endswith("give another file name, or --overwrite to replace it"), line
    assert held.read_text() == "To be, or not to be\n"
    # --overwrite without a file to write is refused, not ignored
    assert main(["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", "--overwrite"]) == 2
    assert "--overwrite is used only with --trace or --plot" in _error_line(capsys)


def test_both_outputs_are_checked_at_once_and_a_profilers_trace_is_kept(capsys, tmp_path,
                                                                         no_work):
    """--trace held.txt --plot g.png (both a user's) named --trace alone, then --plot next; a
    PyTorch profiler's trace (traceEvents) or a user's PNG was replaced as one megapar-bubble
    wrote; --trace and --plot of one name wrote the chart over the trace (a re-test)."""
    trace = tmp_path / "prof.json"
    trace.write_text('{"traceEvents": [], "displayTimeUnit": "ms"}')
    image = tmp_path / "photo.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    base = ["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1"]
    assert main([*base, "--trace", str(trace), "--plot", str(image)]) == 2
    assert _error_line(capsys) == (
        f"megapar-bubble: error: --trace {trace} exists and is no trace megapar-bubble wrote; "
        f"--plot {image} exists and is no chart megapar-bubble wrote (it replaces only its own "
        f"outputs): give another file name, or --overwrite to replace them")
    same = tmp_path / "same.png"
    assert main([*base, "--trace", str(same), "--plot", str(same)]) == 2
    assert f"--trace and --plot both name {same}: give each its own" in _error_line(capsys)
    # ... through a link too (with --overwrite the chart replaced the trace; a re-test), and a
    # user's JPEG or GIF is kept (any file of the format's first bytes was taken as its own)
    ours = tmp_path / "t.json"  # a trace of its own (no_work: written here)
    ours.write_text('{"traceEvents": [], "otherData": {"writer": "megapar"}}')
    for link, make in (("link.png", os.symlink), ("hard.png", os.link)):
        make(ours, tmp_path / link)
        assert main([*base, "--trace", str(ours), "--plot", str(tmp_path / link),
                     "--overwrite"]) == 2
        assert f"--trace and --plot name one file ({ours} and {tmp_path / link})" in \
            _error_line(capsys)
    # a link to nothing, and a directory nothing can be created in, are refused before the run
    # (a traceback after it; "No such file or directory ENOENT" of /proc; a re-test)
    os.symlink(tmp_path / "gone" / "x.json", tmp_path / "dangling.json")
    for flag, path, said in (
            ("--trace", tmp_path / "dangling.json", f"--trace {tmp_path / 'dangling.json'}: "
             f"{tmp_path / 'dangling.json'} is a link to {tmp_path / 'gone' / 'x.json'}, which "
             f"does not exist; give another file name, or remove the link"),
            ("--plot", "/proc/megapar-test.png", "--plot /proc/megapar-test.png is not writable: "
             "nothing can be created in /proc;")):
        assert main([*base, flag, str(path)]) == 2
        assert said in _error_line(capsys)
    from PIL import Image

    for name in ("photo.jpg", "photo.gif"):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
        assert main([*base, "--plot", str(tmp_path / name)]) == 2
        assert "exists and is no chart megapar-bubble wrote" in _error_line(capsys)


@pytest.mark.parametrize("flag, name", [("--trace", "t.json"), ("--plot", "g.png"),
                                        ("--plot", "g.jpg"), ("--plot", "g.gif")])
def test_its_own_output_is_replaced_and_another_file_with_overwrite(capsys, tmp_path, flag,
                                                                     name):
    out = tmp_path / name
    argv = ["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", flag, str(out)]
    for _ in range(2):  # the second run replaces the first's output
        assert main(argv) == 0
        capsys.readouterr()
        os.chmod(out, 0o600)  # ... keeping its mode (a private file became 0644; a re-test)
    assert os.stat(out).st_mode & 0o777 == 0o600
    written = out.read_bytes()
    out.write_text("notes\n")
    assert main([*argv, "--overwrite"]) == 0
    assert out.read_bytes()[:8] == written[:8]


@pytest.mark.parametrize("flag", ["--trace", "--plot"])
def test_an_empty_output_name_is_refused(capsys, no_work, flag):
    """--trace "" ran and wrote nothing, without a word."""
    assert main(["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", flag, ""]) == 2
    assert f"{flag} is given an empty file name; give one" in _error_line(capsys)


def test_plot_format_is_checked_and_the_real_file_named(capsys, tmp_path):
    assert main(["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1", "--plot",
                 str(tmp_path / "g.txt")]) == 2
    assert "matplotlib cannot write .txt files; end the name with .png" in _error_line(capsys)
    # no suffix: matplotlib writes g.png, and that is the name reported
    _, out = run_cli(capsys, "--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1",
                     "--plot", str(tmp_path / "g"))
    assert f"wrote {tmp_path / 'g.png'}" in out
    assert_png(tmp_path / "g.png")
    assert not (tmp_path / "g").exists()
    # a device is written as named: --plot /dev/null wrote a file /dev/null.png (a tryout),
    # and then (plot_file's name alone mended) said it had not
    beside = Path(os.devnull + ".png")
    existed = beside.exists()
    try:
        _, out = run_cli(capsys, "--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1",
                         "--plot", os.devnull)
        assert f"wrote {os.devnull}" in out and (existed or not beside.exists()), out
    finally:
        if not existed:
            beside.unlink(missing_ok=True)


def test_simulated_plot_draws_no_comm_bars_when_messages_are_free(capsys, monkeypatch, tmp_path):
    """At --p2p-ms 0 (its default) a simulated receive is only a wait for the sender's compute,
    idle time; the chart drew it as a thin "comm" bar (and a comm legend entry). With a message
    latency the bars stay."""
    from matplotlib.colors import to_rgba
    from matplotlib.figure import Figure

    from megapar.pipeline.timeline import _COLOURS

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: saved.append(self))
    comm = to_rgba(_COLOURS["comm"])
    for p2p, bars in ((None, False), ("0.1", True)):
        flags = ["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1"]
        run_cli(capsys, *flags, *(["--p2p-ms", p2p] if p2p else []), "--plot",
                str(tmp_path / "g.png"))
        ax = saved[-1].axes[0]
        drawn = [f for c in ax.collections for f in c.get_facecolor() if tuple(f) == comm]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert bool(drawn) == bars and ("comm" in legend) == bars, (p2p, legend)
        assert "forward" in legend and "backward" in legend


def test_help_gives_the_default_of_every_flag_that_has_one(capsys):
    # --tp, --cp, --steps, --micro-batch-size and --seq-len had defaults (1, 1, 3, 4, 64) that
    # --help did not show; the last two had no help at all
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help by width
    for text in ("tensor-parallel size per stage (default: 1)",
                 "--seq-len a multiple of 2 x cp) (default: 1)",
                 "the earlier ones let caches and the allocator settle) (default: 3)",
                 "sequences per micro-batch of the measured model (default: 4)",
                 "tokens per sequence of the measured model (default: 64)"):
        assert text in out, text


@pytest.mark.parametrize(("schedule", "m", "own", "bound"), [
    ("zb-v", 4, "20.0", "a lower bound"), ("zb-v", 6, "7.7", "which it reaches"),
    ("dualpipev", 8, "5.9", "which it reaches")])
def test_a_v_schedules_theory_is_called_a_bound_beside_what_it_reaches(schedule, m, own, bound,
                                                                       capsys):
    """zb-v's and dualpipev's theory column is the pipeline fill, which the schedule reaches
    only with t_F = t_B = t_W and enough micro-batches: pp 4, m 4 showed 11.1 % beside a
    simulated 20.0 % on equal stages, as if the schedule ran badly. The report says the
    column is a lower bound, or, where the schedule reaches it (the simulator's count equal
    to the fill: from m = floor(3 pp / 2) on), that it does, and what the schedule itself
    reaches on equal stages at the mean costs."""
    assert main(["--pp", "4", "-m", str(m), "--schedule", schedule, "--simulate",
                 "--fwd-ms", "1", "--bwd-ms", "2"]) == 0
    out = capsys.readouterr().out
    assert (f"theory % is the pipeline fill, {bound}; {schedule} itself at pp 4, m {m} on "
            f"equal stages at the mean costs with free communication: {own} %") in out, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert float(own) >= round(100 * summary["theoretical_bubble"], 1)


def test_unequal_stages_are_said_beside_the_theory_column():
    """The theory column assumes equal stages; a measured model whose last stage held a 50k
    head showed 91.5 / 95.5 / 18.7 % beside a theory of 25 % with nothing saying why (a
    tryout). A line says so where the busiest stage is 1.2 x the least busy; none below."""
    from megapar.cli.bubble import unequal_stages_note

    def stats(*busy_ms):
        return {"per_rank": [{"busy_s": b / 1e3} for b in busy_ms]}

    assert unequal_stages_note(stats(34, 18, 324), 0.25) == (
        "theory % assumes equal stages; these differ (stage 2 busy 324.0 ms, stage 1 18.0 ms: "
        "the embedding or the head, layers not divided evenly, or other processes on the "
        "cores): the others wait for the busiest, so the measured bubble is not the schedule's "
        "alone")
    assert unequal_stages_note(stats(100, 119), 0.2) is None  # within 1.2 x
    assert unequal_stages_note(stats(100, 121), 0.2) is not None
    assert unequal_stages_note(stats(100, 300), None) is None  # no theory column to qualify
    assert unequal_stages_note(stats(100), 0.0) is None


def test_an_output_the_disk_refuses_is_one_line_and_leaves_no_file(tmp_path, capsys,
                                                                   monkeypatch):
    """A full disk under --trace / --plot was a traceback after the run, beside an empty file
    (a re-test): one line, exit 1, the file as it was (none; or the earlier one); a device
    (/dev/full) is written itself, never replaced by a file."""
    import errno
    import stat

    from megapar.cli import bubble as cli

    base = ["--pp", "2", "-m", "4", "--simulate", "--fwd-ms", "1"]

    def full(timeline, path, *args, **kwargs):
        with open(path, "w") as f:
            f.write("{")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli, "write_chrome_trace", full)
    monkeypatch.setattr(cli, "plot_gantt", full)
    earlier = tmp_path / "t.json"
    earlier.write_text('{"traceEvents": [], "otherData": {"writer": "megapar"}}')
    for flag, out in (("--trace", tmp_path / "new.json"), ("--trace", earlier),
                      ("--plot", tmp_path / "g.png")):
        assert main([*base, flag, str(out)]) == 1
        assert _last_error(capsys) == (
            f"megapar-bubble: error: {flag} {out}: No space left on device while writing it; "
            f"nothing was written (free space there, or give another file name)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]
    assert "megapar" in earlier.read_text()
    if os.path.exists("/dev/full"):
        monkeypatch.undo()
        assert main([*base, "--trace", "/dev/full", "--overwrite"]) == 1
        assert "--trace /dev/full: No space left on device" in _last_error(capsys)
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def _last_error(capsys) -> str:
    """The one error line of a run that reported (its report on stdout) and then failed."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]
