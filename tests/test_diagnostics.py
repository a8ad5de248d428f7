"""Hang diagnosis and profiling: a provoked timeout reports every rank's action and stack;
--profile-steps writes a torch.profiler Chrome trace per rank."""

import json
import time

import pytest
import torch

import megapar
from megapar.launcher import WorkerError, run_local


def _config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                      bos_token_id=None, eos_token_id=None)


def _stuck_rank(timeout_s):
    engine = megapar.prepare(_config(), pp=2, micro_batch_size=2, timeout_s=timeout_s)
    x = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x, "labels": x}
    engine.train_step(batch)
    if engine.mesh.rank == 1:
        forward = engine.model.forward

        def stuck_forward(*args, **kwargs):
            time.sleep(120)  # e.g. a deadlock in user code on this rank
            return forward(*args, **kwargs)

        engine.model.forward = stuck_forward
    engine.train_step(batch)


def test_provoked_timeout_reports_every_rank_action_and_stack():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_local(_stuck_rank, 2, 3.0, timeout_s=100, collective_timeout_s=3.0)
    message = str(info.value)
    assert time.monotonic() - start < 60  # the run ends long before the stuck rank would wake
    # the stuck rank is blamed first; the waiting rank's error says whom it waited for
    assert message.startswith("rank 1 did not answer at step 2, forward of micro-batch 0 on pp "
                              "stage 1\n"), message
    assert "rank 0 (pp stage 0): receiving the gradient of micro-batch 0 from rank 1 did not " \
        "complete" in message
    # every rank's status, and the stuck rank's Python stack (faulthandler, all threads)
    assert "--- rank 0: step 2, " in message
    assert "--- rank 1: step 2, forward of micro-batch 0 on pp stage 1" in message
    stack = message.split("--- rank 1:")[1]
    assert "most recent call first" in stack and "in stuck_forward" in stack


def _tp2_run(tmp_path) -> list[str]:
    """megapar-train's flags of a 3-step tp 2 run of a tiny GPT-2 on a slice of the sample."""
    from megapar.data import asset_path

    text = tmp_path / "sample.txt"
    text.write_text(open(asset_path("shakespeare_sample.txt")).read()[:20_000])
    model = tmp_path / "gpt2.json"
    model.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
                                 "n_positions": 32}))
    return ["--tp", "2", "--model", str(model), "--data", str(text), "--data-cache",
            str(tmp_path / "cache"), "--seq-len", "16", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--max-steps", "3", "--warmup-steps", "1"]


def test_megapar_train_shows_a_slow_ranks_stack(tmp_path, capfd):
    """Under megapar-train (whose launcher makes SIGUSR2 an exit) the dump asked of a rank that
    did not answer killed it instead: each worker undid its launcher's exit after installing
    faulthandler's dump, not before, so --debug showed no stack (a new user's finding)."""
    from megapar.cli.train import main

    rc = main([*_tp2_run(tmp_path),
               "--eval-interval", "0", "--timeout-s", "3", "--debug", "--no-progress",
               "--inject-slow", "rank=1,ms=60000,from_step=2"])
    assert rc == 1
    err = capfd.readouterr().err
    assert "rank 1 (tp rank 1" in err and err.count("did not answer at step 2") == 1, err
    stack = err.split("--- rank 1: step 2, ")[1]
    assert "most recent call first" in stack and "in delay" in stack, err


def test_profile_steps_writes_a_chrome_trace_per_rank(tmp_path, capfd):
    from megapar.cli.train import main

    rc = main([*_tp2_run(tmp_path),
               "--profile-steps", "2:2", "--profile-dir", str(tmp_path / "prof"),
               "--eval-interval", "0", "--log-interval", "1", "--no-progress"])
    assert rc == 0
    out = capfd.readouterr().out
    assert f"profiler traces of step 2: {tmp_path / 'prof'}/trace_rank<R>.json" in out, out
    for rank in (0, 1):
        events = json.loads((tmp_path / "prof" / f"trace_rank{rank}.json").read_text())
        names = {e.get("name") for e in events["traceEvents"]}
        assert "gloo:all_reduce" in names  # tp's all-reduces were recorded on every rank


@pytest.mark.parametrize("spec", ["3:1", "x", "0:2"])
def test_bad_profile_steps_is_refused_before_workers_start(spec, capsys):
    from megapar.cli.train import main

    assert main(["--profile-steps", spec]) == 2
    assert "--profile-steps" in capsys.readouterr().err
