"""The step log names what it measures: a pipeline bubble only where there is a pipeline.

At pp 1 the idle share of the step the log called "bubble" (10.6 % at dp 2 in the field) is the
wait, after the last backward, for the data-parallel gradient reduction that the backward did
not hide (and for the slower dp ranks): it is logged as `grad_reduce_wait` there, and nothing
at pp 1 without data parallelism.
"""

import json
from pathlib import Path

import pytest

from megapar.cli.train import main
from megapar.data import asset_path
from megapar.training.logging import format_line

TINY = ["--model", "gpt2-tiny", "--tokenizer", "sentencepiece", "--seq-len", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--max-steps", "2",
        "--log-interval", "1", "--eval-interval", "0", "--no-progress"]


@pytest.mark.parametrize("layout, logged, absent", [
    (["--dp", "2"], "grad_reduce_wait", "bubble"),
    (["--pp", "2"], "bubble", "grad_reduce_wait")])
def test_the_log_calls_the_idle_share_a_bubble_only_with_a_pipeline(tmp_path, capfd, layout,
                                                                     logged, absent):
    text = tmp_path / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:20_000])
    log = tmp_path / "log.jsonl"
    assert main([*TINY, *layout, "--data", str(text), "--data-cache", str(tmp_path / "cache"),
                 "--log-json", str(log)]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        assert absent not in record and 0.0 <= record[logged] <= 1.0, record
    out = capfd.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("step ")]
    # the first line names the factors of the global batch, so that they multiply back to it
    # (2 x 2 x 2 = 8; "2 micro-batches per step of 2 on each of the 2 dp ranks" read
    # ambiguously: "of 2" the micro-batch size or the step's count?)
    header = {"2": "global batch 8 sequences of 32 tokens: 2 dp ranks x 2 micro-batches per "
                   "step x micro-batch size 2\n",
              "1": "global batch 8 sequences of 32 tokens: 4 micro-batches per step x "
                   "micro-batch size 2\n"}
    assert header[layout[1] if layout[0] == "--dp" else "1"] in out, out
    label = {"bubble": "bubble", "grad_reduce_wait": "grad-reduce wait"}
    assert len(lines) == 2 and all(f"| {label[logged]} " in x for x in lines), lines
    assert not any(f"| {label[absent]} " in x for x in lines), lines


def test_an_evaluation_between_log_lines_prints_its_validation_loss(tmp_path, capfd):
    """--eval-interval 3 --log-interval 2: step 3's val_loss was in --log-json only; the
    console showed the evaluations that fell on a logging step (Megatron prints each)."""
    text = tmp_path / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:20_000])
    log = tmp_path / "log.jsonl"
    argv = [*TINY, "--max-steps", "4", "--log-interval", "2", "--eval-interval", "3",
            "--data", str(text), "--data-cache", str(tmp_path / "cache"), "--log-json", str(log)]
    assert main(argv) == 0
    records = {r["step"]: r for r in map(json.loads, log.read_text().splitlines())}
    lines = [x for x in capfd.readouterr().out.splitlines() if x.startswith("step ")]
    assert [int(x.split()[1]) for x in lines] == [2, 3, 4], lines
    assert lines[1] == (f"step      3 | loss {records[3]['loss']:.4f} | val_loss "
                        f"{records[3]['val_loss']:.4f}")
    assert "val_loss" not in lines[0] and "val_loss" not in lines[2]


def test_a_step_without_pipeline_or_dp_logs_neither():
    metrics = {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e3, "tflops": 0.1,
               "tflops_per_rank": 0.05, "mfu": 0.01, "peak_mem_mb": 100.0}
    line = format_line(3, metrics)
    assert "| TFLOP/s/rank 0.050 |" in line  # per rank (GPU), not the job's 0.1
    assert "bubble" not in line and "wait" not in line
    assert "bubble 12.5%" in format_line(3, {**metrics, "bubble": 0.125})
    # steps skipped for inf / nan since the last line show, whether or not this one was
    assert "skipped" not in line
    assert "| skipped 1 (inf/nan)" in format_line(3, {**metrics, "skipped": True})
    assert "| skipped 2 (inf/nan)" in format_line(3, {**metrics, "skipped_steps": 2})
    # the fp16 loss scale: every line in fp16 (its floor 1 was left out), a floor below 1 as
    # itself (--min-loss-scale 0.5 was "scale 0")
    assert "scale" not in format_line(3, {**metrics, "loss_scale": 1.0})
    assert format_line(3, {**metrics, "loss_scale": 1.0}, fp16=True).endswith("| scale 1")
    assert format_line(3, {**metrics, "loss_scale": 0.5}, fp16=True).endswith("| scale 0.5")
    # an --initial-loss-scale 1e30 was printed as its 31 digits
    assert format_line(3, {**metrics, "loss_scale": 2.0**32}, fp16=True).endswith(
        "| scale 4294967296")
    assert format_line(3, {**metrics, "loss_scale": 1e30}, fp16=True).endswith("| scale 1e+30")
    assert format_line(3, {**metrics, "loss_scale": 2.0**32}, fp16=True).endswith(
        "| scale 4294967296")


def test_tensorboard_and_wandb_plot_each_number_and_each_expert_count(tmp_path):
    """TensorBoard and W&B get every numeric field of a step, and a mixture of experts'
    `moe_tokens_per_expert` list as one curve per expert (`moe_tokens_per_expert/i`); the JSON
    log keeps the list whole."""
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megapar.training.logging import MetricsLogger

    cfg = SimpleNamespace(progress=False, log_json=str(tmp_path / "log.jsonl"),
                          tensorboard=str(tmp_path / "tb"), wandb_project=None)
    logger = MetricsLogger(cfg, 0, {})
    sent = []
    logger.wandb = SimpleNamespace(log=lambda scalars, step: sent.append((step, scalars)),
                                   finish=lambda: None)
    metrics = {"loss": 2.5, "lr": 1e-3, "moe_tokens_per_expert": [7, 0, 5], "note": "text"}
    logger.log(3, metrics)
    logger.close()
    want = {"loss": 2.5, "lr": 1e-3, "moe_tokens_per_expert/0": 7,
            "moe_tokens_per_expert/1": 0, "moe_tokens_per_expert/2": 5}
    assert sent == [(3, want)]
    events = EventAccumulator(cfg.tensorboard)
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(want)
    for tag, value in want.items():
        (event,) = events.Scalars(tag)
        assert (event.step, event.value) == (3, pytest.approx(value)), tag
    record = json.loads(Path(cfg.log_json).read_text())
    assert record["moe_tokens_per_expert"] == [7, 0, 5] and record["note"] == "text"


def test_a_resumed_run_replaces_the_steps_tensorboard_got_after_its_checkpoint(tmp_path):
    """A run logs steps 1-4, one resumed from its step-2 checkpoint logs steps 3-4 again into
    the same --tensorboard directory: TensorBoard shows steps 1-4 once each, 3 and 4 the
    resumed run's (as --log-json keeps the records up to the checkpoint's step)."""
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megapar.training.logging import MetricsLogger

    cfg = SimpleNamespace(progress=False, log_json=None, tensorboard=str(tmp_path / "tb"),
                          wandb_project=None)
    first = MetricsLogger(cfg, 0, {})
    for step in range(1, 5):
        first.log(step, {"loss": float(step)})
    first.close()
    resumed = MetricsLogger(cfg, 2, {})
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    events = EventAccumulator(cfg.tensorboard)
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("loss")]
    assert got == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)], got


def test_a_full_disk_under_tensorboard_is_one_error_and_no_thread_traceback(tmp_path,
                                                                           monkeypatch):
    """TensorBoard writes from a thread of its own: a full disk there printed that thread's
    traceback ("Exception in thread ...", threading.excepthook) beside the run's own line. The
    error is raised once, naming --tensorboard, at the next write, and the hook is not called
    (pytest's own hook would hide a printed traceback: a recording one stands in for it)."""
    import errno
    import threading
    import time
    from types import SimpleNamespace

    from megapar.training.logging import MetricsLogger

    printed = []
    monkeypatch.setattr(threading, "excepthook", printed.append)
    cfg = SimpleNamespace(progress=False, log_json=None, tensorboard=str(tmp_path / "tb"),
                          wandb_project=None)
    logger = MetricsLogger(cfg, 0, {})
    async_writer = logger.tb.file_writer.event_writer._async_writer

    def full(data):
        raise OSError(errno.ENOSPC, "No space left on device")

    async_writer._writer.write = full
    logger.log(1, {"loss": 1.0})
    end = time.monotonic() + 10
    while async_writer._worker.is_alive() and time.monotonic() < end:
        time.sleep(0.01)
    with pytest.raises(OSError, match=f"No space left on device: writing --tensorboard "
                                      f"{cfg.tensorboard}"):
        logger.log(2, {"loss": 2.0})
    assert not async_writer._worker.is_alive() and printed == [], printed
    other = threading.Thread(target=lambda: 1 / 0)  # any other thread's error: as before
    other.start()
    other.join()
    assert len(printed) == 1 and printed[0].exc_type is ZeroDivisionError, printed


class _FakeWandbRun:
    """What MetricsLogger reads of a wandb Run: its id, the first step it takes (a resumed
    online run's is after the steps it holds), log and finish."""

    def __init__(self, run_id="run-abc", starting_step=0):
        self.id, self.starting_step, self.logged = run_id, starting_step, []

    def log(self, scalars, step):
        self.logged.append(step)

    def finish(self):
        pass


def _capture_wandb_init(monkeypatch, run) -> list[dict]:
    """wandb.init's keyword arguments, call by call; each call returns `run`. The module is a
    stand-in with only `init` (importing wandb takes a second; its init needs a service)."""
    import importlib.machinery
    import sys
    import types

    calls = []
    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # found: --wandb-project ok
    wandb.init = lambda **kwargs: calls.append(kwargs) or run
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    return calls


def test_a_resumed_run_continues_the_wandb_run_its_checkpoint_recorded(monkeypatch, capsys):
    """wandb.init was given no run id, so a resumed run (--load) showed as a new W&B run. A
    checkpoint records the W&B run (JSON metadata), and a run resumed from it in the same
    --wandb-project continues it (id, resume="allow"), as TensorBoard's and --log-json's
    curves continue; a run named by WANDB_RUN_ID, or another project, is not redirected."""
    from types import SimpleNamespace

    from megapar.training.logging import MetricsLogger

    cfg = SimpleNamespace(progress=False, log_json=None, tensorboard=None, wandb_project="p")
    calls = _capture_wandb_init(monkeypatch, _FakeWandbRun())
    first = MetricsLogger(cfg, 0, {})
    assert calls[-1]["id"] is None and calls[-1]["resume"] is None
    recorded = first.checkpoint_meta()
    assert recorded == {"wandb_run": {"project": "p", "id": "run-abc"}}
    assert json.loads(json.dumps(recorded)) == recorded  # the manifest's JSON, no pickle
    MetricsLogger(cfg, 2, {}, recorded["wandb_run"])
    assert (calls[-1]["id"], calls[-1]["resume"], calls[-1]["project"]) == ("run-abc", "allow",
                                                                            "p")
    assert "W&B: continuing run run-abc from step 2" in capsys.readouterr().out
    MetricsLogger(cfg, 0, {}, recorded["wandb_run"])  # not resumed: a run of its own
    assert calls[-1]["id"] is None
    monkeypatch.setenv("WANDB_RUN_ID", "run-abc")  # the checkpoint's: continued as without
    MetricsLogger(cfg, 2, {}, recorded["wandb_run"])
    assert (calls[-1]["id"], calls[-1]["resume"]) == ("run-abc", "allow")
    monkeypatch.setenv("WANDB_RUN_ID", "mine")  # another run, which wandb reads itself
    MetricsLogger(cfg, 2, {}, recorded["wandb_run"])
    assert calls[-1]["id"] is None
    assert "W&B: run mine (WANDB_RUN_ID), not the checkpoint's run run-abc" \
        in capsys.readouterr().out
    monkeypatch.delenv("WANDB_RUN_ID")
    MetricsLogger(SimpleNamespace(**{**vars(cfg), "wandb_project": "q"}), 2, {},
                  recorded["wandb_run"])
    assert calls[-1]["id"] is None
    assert "a new run in project q (the checkpoint's run run-abc is in project p)" \
        in capsys.readouterr().out


def test_a_continued_wandb_run_keeps_the_steps_it_holds(monkeypatch, capsys):
    """A W&B run's history only grows: resumed at step 2, a run that holds steps 1-4 takes
    logs from step 5 on (wandb warned, once a step, and dropped the others); they are not sent,
    and the console says so once."""
    from types import SimpleNamespace

    from megapar.training.logging import MetricsLogger

    cfg = SimpleNamespace(progress=False, log_json=None, tensorboard=None, wandb_project="p")
    run = _FakeWandbRun(starting_step=5)
    _capture_wandb_init(monkeypatch, run)
    logger = MetricsLogger(cfg, 2, {}, {"project": "p", "id": "run-abc"})
    for step in range(3, 7):
        logger.log(step, {"loss": 1.0})
    assert run.logged == [5, 6]
    assert ("W&B: run run-abc holds steps 3-4 from an earlier run, which it keeps (a W&B run's "
            "history only grows); this run logs to it from step 5") in capsys.readouterr().out


def test_megapar_train_records_its_wandb_run_and_a_resume_continues_it(tmp_path, monkeypatch):
    """Through megapar-train: the checkpoint's manifest holds the run, --load continues it."""
    calls = _capture_wandb_init(monkeypatch, _FakeWandbRun())
    text = tmp_path / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:5_000])
    flags = [*TINY, "--data", str(text), "--data-cache", str(tmp_path / "cache"),
             "--wandb-project", "p", "--save", str(tmp_path / "ckpt"), "--global-batch-size", "2"]
    assert main([*flags, "--max-steps", "1"]) == 0
    manifest = json.loads((tmp_path / "ckpt" / "step_00000001" / "manifest.json").read_text())
    assert manifest["meta"]["wandb_run"] == {"project": "p", "id": "run-abc"}
    assert main([*flags, "--max-steps", "2", "--load", str(tmp_path / "ckpt")]) == 0
    assert [(c["id"], c["resume"]) for c in calls] == [(None, None), ("run-abc", "allow")]
