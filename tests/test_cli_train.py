"""megapar-train end to end: training on real text, exact resume, CLI parity, clear errors.

The CLI is called in-process (`main(argv)`), so its workers are forked from this test process
(fast); only the multi-node test starts real torchrun processes.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megapar.cli.train import main
from megapar.data import asset_path, tokenizers

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--warmup-steps", "2"]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A real text sample: the first ~40 KB of the shipped Shakespeare sample."""
    path = tmp_path_factory.mktemp("text") / "sample.txt"
    path.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:40_000])
    return str(path)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _model(tmp_path, kind="gpt2"):
    cfg = ({"model_type": "gpt2", "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if kind == "gpt2" else
           {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 64,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _losses(log_json):
    return [json.loads(line)["loss"] for line in Path(log_json).read_text().splitlines()]


def _tokenizer_loads(tmp_path, monkeypatch):
    """From now on, every tokenizer load (`tokenizers._load`, behind load_tokenizer's cache,
    empty here) in this process and the ranks forked from it, each appending its spec to a
    file; returns a callable that reads them."""
    record = tmp_path / "tokenizer_loads"
    load = tokenizers._load

    def counted(spec):
        with open(record, "a") as f:
            f.write(f"{spec}\n")
        return load(spec)

    monkeypatch.setattr(tokenizers, "_LOADED", {})
    monkeypatch.setattr(tokenizers, "_load", counted)
    return lambda: record.read_text().split() if record.exists() else []


@pytest.mark.parametrize("tokenizer", ["gpt2", "sentencepiece"])
def test_trains_at_tp2_pp2_and_loss_falls(tmp_path, text, cache, tokenizer, monkeypatch):
    loads = _tokenizer_loads(tmp_path, monkeypatch)
    log = tmp_path / "log.jsonl"
    rc = main(["--tp", "2", "--pp", "2", "--model", "gpt2-tiny", "--data", text,
               "--tokenizer", tokenizer, "--data-cache", cache, "--max-steps", "12",
               "--lr", "3e-3", "--log-json", str(log), *TINY])
    assert rc == 0
    records = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert all(key in r for r in records)
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.5, losses
    # loaded once: the checks, the data's preparation and the 4 forked ranks share it
    assert loads() == [tokenizer]


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path, text, cache, kind):
    """The uninterrupted run saves at step 3 (a save changes nothing it trains on after); the
    run resumed from that checkpoint logs its steps 4-6 bitwise."""
    common = ["--model", _model(tmp_path, kind), "--data", text, "--tokenizer", "sentencepiece",
              "--data-cache", cache, "--pp", "2", "--lr", "2e-3", *TINY]
    full, second = tmp_path / "full.jsonl", tmp_path / "b.jsonl"
    ckpt = tmp_path / "ckpt"
    assert main([*common, "--max-steps", "6", "--save", str(ckpt), "--save-interval", "3",
                 "--log-json", str(full)]) == 0
    assert main([*common, "--max-steps", "6", "--load", str(ckpt / "step_00000003"),
                 "--log-json", str(second)]) == 0
    resumed = _losses(full)[:3] + _losses(second)
    assert [json.loads(x)["step"] for x in second.read_text().splitlines()] == [4, 5, 6]
    assert resumed == _losses(full)


def test_an_fp16_resume_keeps_its_floor_restarts_a_given_scale_and_bf16_takes_none(
        tmp_path, text, cache, capsys):
    """A precision tryout's findings on resuming an fp16 run: a higher --min-loss-scale left
    the restored scale below it (and an overflow there was reported at the old scale as "its
    floor"); --initial-loss-scale given was ignored without a word; a bf16 resume said it took
    the fp16 scaler's settings from the checkpoint. The scale starts at the floor; a given
    initial scale restarts the scaler, said; a bf16 run takes no loss-scale setting (the floor:
    test_precision's test_a_restored_scale_below_the_floor_starts_at_it)."""
    common = ["--model", _model(tmp_path), "--data", text, "--tokenizer", "sentencepiece",
              "--data-cache", cache, *TINY]
    ckpt = tmp_path / "ckpt"
    assert main([*common, "--precision", "fp16", "--initial-loss-scale", "256",
                 "--loss-scale-window", "1000", "--max-steps", "2", "--save", str(ckpt)]) == 0
    capsys.readouterr()

    def resumed(*flags):
        log = tmp_path / "resumed.jsonl"
        log.unlink(missing_ok=True)
        assert main([*common, "--max-steps", "3", "--load", str(ckpt), "--log-json", str(log),
                     *flags]) == 0
        records = [json.loads(x) for x in log.read_text().splitlines()]
        return records[0].get("loss_scale"), capsys.readouterr()

    scale, _ = resumed("--precision", "fp16")
    assert scale == 256  # continued (no overflow at this scale)
    scale, said = resumed("--precision", "fp16", "--initial-loss-scale", "128")
    assert scale == 128 and ("the fp16 loss scale restarts at --initial-loss-scale 128, not at "
                             "the checkpoint's 256") in said.out + said.err, said
    # with a floor above the checkpoint's scale, the note named the raised scale as the
    # checkpoint's ("not at the checkpoint's 512" for 256: a tryout)
    scale, said = resumed("--precision", "fp16", "--initial-loss-scale", "1048576",
                          "--min-loss-scale", "512")  # as given, not 1.04858e+06
    assert scale == 1048576 and ("restarts at --initial-loss-scale 1048576, not at the "
                                 "checkpoint's 256 ") in said.out + said.err, said
    # (the same flag again, a requeued job's command line, continues the checkpoint's scale
    # mid-hysteresis: test_faults' test_fp16_overflows_are_skipped_not_failures_...)
    scale, said = resumed("--precision", "bf16")
    taken = [line for line in said.err.splitlines() if "from the checkpoint (not given)" in line]
    assert scale in (None, 1.0) and not any("loss-scale" in line for line in taken), taken


def test_a_resume_at_another_global_batch_continues_the_data_order(tmp_path, text, cache,
                                                                  capfd):
    """Stopped after 2 steps of --global-batch-size 8 and resumed at 16 on 2 data-parallel
    ranks, the run says where its data order continues, and its first step trains on the
    epoch order's next 16 samples: its loss is a one-process forward of the checkpoint's
    weights on exactly those (fp32, 1e-5; the samples before them miss it). Resumed at 8, the
    losses are the uninterrupted run's, bitwise."""
    import numpy as np
    import torch
    from tp_utils import assert_close, rel_err

    from megapar.checkpoint.distributed import load_checkpoint
    from megapar.cli.train import plan_run
    from megapar.data import collate
    from megapar.mesh import Layout, Mesh
    from megapar.models.config import config_from_dict
    from megapar.pipeline.partition import build_stage
    from megapar.training.config import parse_args
    from megapar.training.data import build_datasets

    common = ["--model", "gpt2-tiny", "--data", text, "--tokenizer", "sentencepiece",
              "--data-cache", cache, "--max-steps", "4", "--lr", "2e-3", *TINY]
    full, same, wider = (tmp_path / f"{name}.jsonl" for name in ("full", "same", "wider"))
    ckpt = tmp_path / "ckpt"
    assert main([*common, "--log-json", str(full)]) == 0
    assert main([*common, "--exit-interval", "2", "--save", str(ckpt)]) == 0
    resume = ["--load", str(ckpt), "--data-cache", cache, "--no-progress"]
    assert main([*resume, "--log-json", str(same)]) == 0
    assert _losses(same) == _losses(full)[2:]
    capfd.readouterr()
    assert main([*resume, "--global-batch-size", "16", "--dp", "2",
                 "--log-json", str(wider)]) == 0
    out = capfd.readouterr().out  # the workers' stdout (they are forked from this process)
    assert ("global batch 16 (the checkpoint's: 8): the data order continues at sample 16 of "
            "epoch 0") in out, out
    step3 = json.loads(wider.read_text().splitlines()[0])
    assert step3["step"] == 3

    cfg = parse_args(common)
    _, plan = plan_run(cfg)
    train, _ = build_datasets(cfg, plan.prefix, "gpt2")
    order = np.random.default_rng(cfg.seed).permutation(len(train))  # epoch 0's
    config = config_from_dict(plan.model_config)
    model = build_stage(config, Mesh(Layout()), seed=cfg.seed)
    load_checkpoint(ckpt, model, Mesh(Layout()))
    model.eval()

    def loss_on(indices):
        batch = collate([train[int(i)] for i in indices])
        with torch.no_grad():
            logits = model(None, {"input_ids": batch["input_ids"]})[..., :config.vocab_size]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 batch["labels"].reshape(-1))

    assert_close(torch.tensor(step3["loss"]), loss_on(order[16:32]), what="step 3 at G 16")
    assert rel_err(torch.tensor(step3["loss"]), loss_on(order[0:16])) > 1e-4


def test_cli_3d_parity_2x2x2_equals_1x1x1(tmp_path, text, cache):
    """tp 2 x pp 2 x dp 2 logs one process's losses (1e-5) under a WSD schedule whose 4 steps
    are 2 of warmup and 2 of decay (the first at --lr; the same lr at each step in both)."""
    from megapar.optim import LRScheduler

    common = ["--model", _model(tmp_path), "--data", text, "--tokenizer", "sentencepiece",
              "--data-cache", cache, "--max-steps", "4", "--clip-grad", "0.5", *TINY,
              "--lr-decay", "wsd", "--lr-wsd-decay-steps", "2", "--min-lr", "1e-4"]
    serial, parallel = tmp_path / "serial.jsonl", tmp_path / "parallel.jsonl"
    assert main([*common, "--log-json", str(serial)]) == 0
    assert main([*common, "--tp", "2", "--pp", "2", "--dp", "2", "--log-json", str(parallel)]) == 0
    a, b = _losses(serial), _losses(parallel)
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert abs(x - y) / abs(x) < 1e-5, (a, b)
    lrs = [[json.loads(line)["lr"] for line in log.read_text().splitlines()]
           for log in (serial, parallel)]
    wsd = LRScheduler(1e-3, 1e-4, 2, 4, "wsd", decay_steps=2)
    assert lrs[0] == lrs[1] == pytest.approx([wsd.lr(s) for s in range(4)], rel=1e-6)
    assert lrs[0] == pytest.approx([5e-4, 1e-3, 1e-3, 5.5e-4], rel=1e-6)


def test_cli_grad_norms_at_tp2_dp2_zero1_equal_1x1x1(tmp_path, text, cache):
    """gpt2-tiny (the real GPT-2 vocabulary: a 3.2 M-element embedding) at the CLI's AdamW,
    eps and clipping: tp 2 x dp 2 at ZeRO-1 logs one process's losses and gradient norms, within
    1e-5 over 4 steps (a norm summed in one fp32 running sum drifts ~1e-4 apart by step 3)."""
    common = ["--model", "gpt2-tiny", "--data", text, "--data-cache", cache, "--max-steps", "4",
              *TINY]
    serial, parallel = tmp_path / "serial.jsonl", tmp_path / "parallel.jsonl"
    assert main([*common, "--log-json", str(serial)]) == 0
    assert main([*common, "--tp", "2", "--dp", "2", "--zero", "1",
                 "--log-json", str(parallel)]) == 0
    a, b = ([json.loads(line) for line in log.read_text().splitlines()] for log in (serial,
                                                                                   parallel))
    assert len(a) == len(b) == 4
    assert all(r["grad_norm"] > 1.0 for r in a[:2]), a  # clipping is active
    for key in ("loss", "grad_norm"):
        x, y = [r[key] for r in a], [r[key] for r in b]
        assert all(abs(u - v) / abs(u) < 1e-5 for u, v in zip(x, y)), (key, x, y)


@pytest.mark.parametrize("flags", [["--pp", "2", "--dp", "2", "--zero", "3"],
                                   ["--dp", "2", "--zero", "3", "--zero3-reduce", "micro-batch"]])
def test_cli_zero3_equals_1x1x1(tmp_path, text, cache, flags):
    """--zero 3 on real text: at pp 2 x dp 2 (parameters sharded over dp, gathered per unit
    and micro-batch), and at dp 2 with --zero3-reduce micro-batch (m 2: a reduce-scatter per
    micro-batch, added into the shard): the serial run's losses."""
    common = ["--model", _model(tmp_path), "--data", text, "--tokenizer", "sentencepiece",
              "--data-cache", cache, "--max-steps", "4", "--clip-grad", "0.5", *TINY]
    serial, sharded = tmp_path / "serial.jsonl", tmp_path / "zero3.jsonl"
    assert main([*common, "--log-json", str(serial)]) == 0
    assert main([*common, *flags, "--log-json", str(sharded)]) == 0
    a, b = _losses(serial), _losses(sharded)
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert abs(x - y) / abs(x) < 1e-5, (a, b)


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--data", "/nonexistent/corpus"], "--data /nonexistent/corpus: corpus.bin"),
    (["--global-batch-size", "10", "--micro-batch-size", "4"],
     "global batch size 10 is not divisible by micro-batch size 4 x dp 1 = 4"),
    (["--tp", "3"], "attention heads are not divisible by --tp 3"),
    (["--pp", "8"], "4 layers cannot be cut into --pp 8 stages"),
    (["--max-steps", "4", "--warmup-steps", "20"], "warmup of 20 steps is longer than the 4"),
    (["--max-steps", "10", "--warmup-steps", "4", "--lr-decay", "wsd", "--lr-wsd-decay-fraction",
      "0.7"], "warmup of 4 steps and WSD decay of 7 steps are longer than the 10"),
    (["--max-steps", "8", "--lr-decay-steps", "3", "--warmup-steps", "5"],
     "warmup of 5 steps is longer than --lr-decay-steps 3; lower --warmup-steps or raise "
     "--lr-decay-steps"),
    (["--lr-decay", "constant", "--min-lr", "1e-05"],
     "--min-lr 1e-05 would be ignored: it is where the decay ends, and --lr-decay constant "
     "holds --lr after warmup: give --lr-decay cosine, linear or wsd, or drop --min-lr"),
    (["--lr-wsd-decay-steps", "5"], "--lr-wsd-decay-steps 5 would be ignored: it shapes the "
                                    "final decay of --lr-decay wsd, and --lr-decay is cosine"),
    (["--global-batch-size", "512"], "fewer than one global batch of 512"),
    (["--global-batch-size", "65536"], "samples of 128 tokens, fewer than one global "
                                       "batch of 65536"),
    (["--global-batch-size", "1000001"], "fewer than one global batch of 1000001: at most"),
])
def test_clear_errors_before_any_worker_starts(argv, message, capsys, cache, text):
    rc = main(["--data", text, "--data-cache", cache, "--tokenizer", "sentencepiece",
               "--model", "gpt2-tiny", "--no-progress", *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("batch, message", [
    ("1000001", "--data {text} holds fewer than one global batch of 1000001: at most"),
    ("512", "the training split of --data {text} has "),
])
def test_too_little_data_for_one_global_batch_names_the_data(batch, message, capsys, cache,
                                                             text):
    """Too little data for the global batch the user gave: the line names the --data path
    (from file sizes alone, or after the split), not just "--data"."""
    rc = main(["--data", text, "--data-cache", cache, "--tokenizer", "sentencepiece",
               "--model", "gpt2-tiny", "--no-progress", "--global-batch-size", batch])
    assert rc == 2
    assert message.format(text=text) in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    # the line ends there: "nothing written" is megapar-data's, whose output it is (megapar-train
    # and megapar-eval said it of a cache they write unasked; a re-test)
    ("", "no text in {path}: every input is empty or whitespace\n"),
    ("Short text.\n", "its documents hold 4 tokens, fewer than one window of --seq-len "
                      "+ 1 = 33"),
])
def test_a_global_batch_given_on_tiny_text_gets_the_texts_own_line(content, message, tmp_path,
                                                                   capsys):
    """An empty text, or one shorter than a window, with --global-batch-size given: the line it
    gets without the flag, where the bound from file sizes said it held "at most 1 sample" (2
    for the short one; the real-data tryout's finding)."""
    path = tmp_path / "tiny.txt"
    path.write_text(content)
    rc = main(["--data", str(path), "--data-cache", str(tmp_path / "cache"), "--model",
               "gpt2-tiny", "--seq-len", "32", "--global-batch-size", "4", "--no-progress"])
    assert rc == 2
    assert message.format(path=path) in capsys.readouterr().err


def test_a_split_far_above_val_fraction_says_why(tmp_path, capsys):
    """Two long documents: the validation split holds out one whole (about half the samples,
    where --val-fraction asks 5 %), and the data line says why and how to train on all (it gave
    the count alone: the real-data tryout's finding)."""
    from importlib.resources import files

    text = (files("megapar") / "assets/shakespeare_sample.txt").read_text()[:40000]
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in (text[:20000], text[20000:])))
    rc = main(["--data", str(path), "--data-cache", str(tmp_path / "cache"), "--model",
               "gpt2-tiny", "--seq-len", "32", "--max-steps", "1", "--global-batch-size", "4",
               "--no-progress"])
    assert rc == 0
    err = capsys.readouterr().err
    said = re.search(r"samples held out for validation: (\d+)%, where --val-fraction 0.05 asks "
                     r"5%, since the split holds out whole documents, at least one global batch "
                     r"of them; --val-fraction 0 trains on all\)", err)
    assert said and 40 <= int(said[1]) <= 60, err


def test_tokenizer_vocab_mismatch_with_the_model(tmp_path, capsys, cache, text):
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 500, "n_embd": 32,
                               "n_layer": 2, "n_head": 4, "n_positions": 64}))
    rc = main(["--data", text, "--data-cache", cache, "--tokenizer", "sentencepiece",
               "--model", str(cfg), "--no-progress"])
    assert rc == 2
    assert "vocab_size 500 but the data's tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("env, expected", [
    ({}, "set NNODES (number of nodes)"),
    ({"NNODES": "2"}, "set NODE_RANK (0 .. 1)"),
    ({"NNODES": "two"}, "NNODES=two: give a number of nodes"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2: give 0 .. 1 (NNODES=2)"),
    ({"NNODES": "1", "NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0: give the processes"),
    ({"NNODES": "2", "NODE_RANK": "1"}, "set NPROC_PER_NODE (processes a node, one per GPU"),
    ({"NNODES": "1", "NPROC_PER_NODE": "gpu"}, "NPROC_PER_NODE=gpu: give the processes (GPUs) "
     "per node as a number"),
    ({"NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "2"},
     "set MASTER_ADDR to node 0's address"),
    # torchrun repeated "The IPv6 network addresses of (node0.invalid, 29500) cannot be
    # retrieved" until its rendezvous timed out
    ({"NNODES": "2", "NODE_RANK": "0", "NPROC_PER_NODE": "2", "MASTER_ADDR": "node0.invalid"},
     "MASTER_ADDR=node0.invalid: this node cannot resolve that name"),
    ({"NNODES": "1", "NPROC_PER_NODE": "2", "MASTER_PORT": "http"},
     "MASTER_PORT=http: give a port (1 .. 65535)"),
    # (bash's "integer expression expected" came first)
    ({"NNODES": "1", "NPROC_PER_NODE": "2", "MASTER_PORT": "9" * 20},
     f"MASTER_PORT={'9' * 20}: give a port"),
    # NNODES=08 was bash's "value too great for base" and a launch with --nnodes 08
    ({"NNODES": "08", "NODE_RANK": "1"}, "NNODES=08: give a number of nodes"),
    ({"NNODES": "9" * 20}, f"NNODES={'9' * 20}: give a number of nodes"),
    ({"NNODES": "2", "NODE_RANK": "0", "NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1:29500"},
     "MASTER_ADDR=127.0.0.1:29500: give the address alone (MASTER_ADDR=127.0.0.1) and the "
     "port as MASTER_PORT=29500"),
], ids=["no-nnodes", "no-node-rank", "nnodes-word", "node-rank-too-big", "nproc-0",
        "no-nproc", "nproc-word", "no-master-addr", "unresolvable-master-addr", "port-word", "port-too-long",
        "nnodes-octal", "nnodes-too-long", "addr-with-port"])
def test_torchrun_multinode_refuses_a_wrong_environment_in_one_line(tmp_path, env, expected):
    """NODE_RANK=2 of NNODES=2 left torchrun waiting (and an AssertionError traceback);
    NPROC_PER_NODE=0 was torchrun's AssertionError traceback; a missing NNODES was bash's
    'line 15: NNODES: ...', exit 1; node 1 of 2 without MASTER_ADDR waited 600 s for a
    rendezvous on its own 127.0.0.1, then torchrun's traceback. Now each is one line, exit 2,
    and torchrun never starts (a stand-in python on PATH fails the test if it does)."""
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho started >&2\nexit 99\n")
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items()
            if k not in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run(["bash", str(ROOT / "launch" / "torchrun_multinode.sh"), "--tp", "2"],
                         env={**base, "PYTHON": str(fake), **env}, capture_output=True,
                         text=True, timeout=30)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, (out.returncode, err)
    assert err[0].startswith("torchrun_multinode.sh: error: ") and expected in err[0], err


def test_torchrun_multinode_refuses_a_port_in_use_on_node_0(tmp_path):
    """Two jobs on one node at the script's default MASTER_PORT: node 0's torchrun failed with
    a 30-line EADDRINUSE traceback (a launch-script tryout); one line now, torchrun not
    started."""
    import socket

    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho started >&2\nexit 99\n")
    fake.chmod(0o755)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = subprocess.run(
            ["bash", str(ROOT / "launch" / "torchrun_multinode.sh"), "--tp", "2"],
            env={**os.environ, "PYTHON": str(fake), "NNODES": "1", "NPROC_PER_NODE": "2",
                 "MASTER_PORT": str(port)}, capture_output=True, text=True, timeout=30)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and err == [
        f"torchrun_multinode.sh: error: MASTER_PORT={port} is in use on this node (another "
        f"job's rendezvous?); give another port, the same on every node (MASTER_PORT="
        f"{port + 1})"], err


def test_a_usage_error_under_torchrun_is_its_summarys_root_cause(tmp_path, monkeypatch, capsys):
    """torchrun --nproc-per-node 3 ... --tp 2: every rank printed its one line, but torchrun's
    summary said 'error_file: <N/A>' for each; the line is now in torchrun's error file, as a
    failure while running was."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["--model", "gpt2-tiny", "--tp", "2", "--max-steps", "1"]) == 2
    line = "world size 3 is not divisible by tp*pp = 2*1"
    assert line in capsys.readouterr().err
    message = json.loads(error_file.read_text())["message"]
    assert message["message"].startswith(line), message
    # the parser's own refusals too (a mistyped flag, a bad choice: "<N/A>" until 2026-12-04),
    # printed once a node and written on every rank
    for argv, said in ((["--max-step", "3"], "--max-step: did you mean --max-steps?"),
                       (["--precision", "fp64"], "argument --precision: invalid choice")):
        error_file.unlink()
        for rank in ("0", "1"):
            monkeypatch.setenv("RANK", rank)
            monkeypatch.setenv("LOCAL_RANK", rank)
            with pytest.raises(SystemExit) as exited:
                main(argv)
            assert exited.value.code == 2
            message = json.loads(error_file.read_text())["message"]["message"]
            assert message.startswith("megapar-train: error: ") and said in message, message
            assert (said in capsys.readouterr().err) == (rank == "0")


def test_two_torchrun_nodes_with_data_parallelism_across_them(tmp_path, text, cache):
    """launch/torchrun_multinode.sh twice on this machine: node 0 and node 1, two workers each,
    tp=2 inside a node and dp=2 across the nodes."""
    from megapar.launcher import free_port

    port = str(free_port())
    log = tmp_path / "log.jsonl"
    args = ["--tp", "2", "--model", "gpt2-tiny", "--data", text, "--tokenizer", "sentencepiece",
            "--data-cache", cache, "--max-steps", "3", "--log-json", str(log), *TINY]
    procs = []
    for node in (0, 1):
        env = {**os.environ, "NNODES": "2", "NODE_RANK": str(node), "NPROC_PER_NODE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "PYTHON": sys.executable,
               "OMP_NUM_THREADS": "1", "MEGAPAR_TIMEOUT_S": "120"}
        procs.append(subprocess.Popen(
            ["bash", str(ROOT / "launch" / "torchrun_multinode.sh"), *args], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=240)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node} exited with {p.returncode}:\n{out[-3000:]}"
    assert "tp=2 pp=1 dp=2" in outputs[0]
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3]


def test_from_hf_gpt2_with_the_real_vocabulary_trains_on_gpt2_tokenized_text(tmp_path, text, cache):
    """A transformers GPT-2 with the real 50257-token vocabulary, data tokenized with the GPT-2
    BPE (whose tokenizer appends BERT specials after 50257, never used by GPT data)."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf = tmp_path / "hf"
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    with torch.no_grad():  # a final norm scaled 30x: logits far from a fresh init's, so the
        model.transformer.ln_f.weight.mul_(30.0)  # first loss shows the weights were loaded
    model.save_pretrained(hf)
    log = tmp_path / "log.jsonl"
    assert main(["--from-hf", str(hf), "--data", text, "--tokenizer", "gpt2", "--data-cache",
                 cache, "--max-steps", "3", "--log-json", str(log), *TINY]) == 0
    losses = _losses(log)
    assert len(losses) == 3 and losses[0] > 13.0, losses  # a fresh init gives ~ln(50257) = 10.8


def test_a_failing_rank_brings_the_run_down_naming_rank_and_step(tmp_path, text, cache,
                                                                 capsys, monkeypatch):
    """Rank 3 raises inside its 2nd step (the workers are forked, so they inherit the patch);
    every rank stops and the error names the rank and the step."""
    import time

    import torch.distributed as dist

    from megapar.training.step import TrainStep

    real_step = TrainStep.step

    def flaky_step(self, micro_batches, step_index, *rest):
        if dist.get_rank() == 3 and step_index == 1:
            raise RuntimeError("injected failure")
        return real_step(self, micro_batches, step_index, *rest)

    monkeypatch.setattr(TrainStep, "step", flaky_step)
    start = time.monotonic()
    rc = main(["--tp", "2", "--pp", "2", "--model", "gpt2-tiny", "--data", text, "--tokenizer",
               "sentencepiece", "--data-cache", cache, "--max-steps", "4", *TINY])
    assert rc == 1
    err = capsys.readouterr().err
    assert "rank 3 failed" in err and "failed at step 2" in err and "injected failure" in err
    assert time.monotonic() - start < 60  # the other ranks were brought down, not left waiting


def test_under_torchrun_no_rank_logs_into_a_save_the_failed_run_made(tmp_path, text, cache,
                                                                    monkeypatch):
    """Two ranks forked with torchrun's variables, each running megapar-train; rank 1 fails at
    step 1. Rank 1 wrote SAVE/logs/rank1.log into the --save rank 0 had made (rank 0 then left
    it, or rank 1 made it again), so a run that saved nothing left a --save holding only logs;
    now every rank's log goes under --data-cache, as rank 0's did, and no --save is left."""
    import torch.distributed as dist

    from forked import torchrun_ranks
    from megapar.training.step import TrainStep

    real_step = TrainStep.step

    def flaky_step(self, micro_batches, step_index, *rest):
        if dist.get_rank() == 1:
            raise RuntimeError("injected failure")
        return real_step(self, micro_batches, step_index, *rest)

    monkeypatch.setattr(TrainStep, "step", flaky_step)
    save = tmp_path / "ckpt"
    argv = ["--dp", "2", "--model", "gpt2-tiny", "--data", text, "--tokenizer", "sentencepiece",
            "--data-cache", cache, "--max-steps", "2", "--save", str(save), "--timeout-s", "60",
            *TINY]
    codes, outs = torchrun_ranks(lambda: main(argv), 2, tmp_path)
    assert codes == [1, 1], outs
    out = outs[1]
    assert "rank 1 failed at step 1: RuntimeError: injected failure" in out, out
    log = Path(out.split("full traceback in ")[1].split(" (or ")[0])
    assert log.parent.parent == Path(cache) / "logs" and log.name == "rank1.log", out
    assert "injected failure" in log.read_text()
    assert not save.exists(), sorted(save.rglob("*"))


def test_nodes_started_with_other_flags_fail_in_one_line_each_in_its_own_log(tmp_path, cache,
                                                                           text):
    """Two torchrun ranks, rank 1 given another --lr: each printed the line and "full traceback
    in ...", a log of the line alone, and rank 0 wrote its log as rank1.log (the line names
    rank 1), where rank 1's own went. Each rank now prints the one line and its own log."""
    from forked import torchrun_ranks

    argv = ["--model", "gpt2-tiny", "--data", text, "--tokenizer", "sentencepiece",
            "--data-cache", cache, "--max-steps", "2", "--timeout-s", "60", *TINY]
    codes, outs = torchrun_ranks(
        lambda: main(argv + (["--lr", "1e-4"] if os.environ["RANK"] == "1" else [])), 2, tmp_path)
    assert codes == [1, 1], outs
    line = ("megapar-train: error: rank 1 was started with other megapar-train flags than rank "
            "0: --lr 0.001 on rank 0 but 0.0001 on rank 1")
    for rank, out in enumerate(outs):
        said = [x for x in out.splitlines() if x.startswith("megapar-train: ")]
        assert said and said[-1].startswith(line), out
        assert "full traceback" not in out and "Traceback" not in out, out
        logs = [log.name for log in (Path(cache) / "logs").glob("run-*/rank*.log")
                if "was started with other" in log.read_text()]  # (the module's cache)
        assert logs.count(f"rank{rank}.log") == 1, (logs, out)


@pytest.mark.parametrize("existed", [True, False], ids=["save-there", "save-made"])
def test_every_rank_of_a_run_logs_where_rank_0_does(tmp_path, capsys, monkeypatch, existed):
    """Under torchrun, a --save that was there before the run and holds no checkpoint: rank 0
    (the lock holder) wrote its log to SAVE/logs, the other ranks to --data-cache, each in a
    run-<time>-<pid> directory of its own. Every rank now reads where from the lock's record
    (rank 0's: whether the run made --save, and the run's directory name), so all write to
    SAVE/logs when --save was there, and to one CACHE/logs/run-... when the run made it (which
    a failed run removes); each rank's line names its own file."""
    import megapar.cli.train as train_cli
    from megapar.checkpoint.lock import SaveLock
    from megapar.made_dirs import missing_dirs
    from megapar.mesh import Layout
    from megapar.training.config import TrainConfig

    save, cache = tmp_path / "save", tmp_path / "cache"
    if existed:
        save.mkdir()
    made = missing_dirs(str(save))  # as rank 0's main takes them, before its lock
    run = "run-20260101-000000-4242"  # rank 0's, not this process's
    lock = SaveLock(save, "megapar-train", {"in_save": not made, "run": run}).acquire()

    def failing_workers(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(train_cli, "run_workers", failing_workers)
    monkeypatch.setenv("WORLD_SIZE", "2")  # with RANK: under torchrun
    want = save / "logs" if existed else cache / "logs" / run
    try:
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            cfg = TrainConfig(save=str(save), data_cache=str(cache))
            assert train_cli._run(cfg, Layout(1, 1, 2), None, [], made if rank == 0 else []) == 1
            err = capsys.readouterr().err
            assert f"full traceback in {want / f'rank{rank}.log'} (or rerun" in err, err
            assert "injected failure" in (want / f"rank{rank}.log").read_text()
    finally:
        lock.release()
    assert sorted(p.name for p in want.iterdir()) == ["rank0.log", "rank1.log"]


def test_paths_with_spaces_and_non_ascii_characters(tmp_path, text, capsys):
    """Paths are paths: --data (text and a prepared prefix), --from-hf, --tokenizer, --save
    and --load under "with space/ünïcødé" train, save and resume; none is read as a blend."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from megapar.cli.data import main as data

    odd = tmp_path / "with space" / "ünïcødé dir"
    odd.mkdir(parents=True)
    corpus, tokenizer = odd / "my text.txt", odd / "my tokenizer.model"
    corpus.write_text(Path(text).read_text())
    tokenizer.write_bytes(Path(asset_path("botchan_en_unigram_1000.model")).read_bytes())
    hf = odd / "hf model"
    GPT2LMHeadModel(GPT2Config(vocab_size=1004, n_positions=64, n_embd=32, n_layer=2,
                               n_head=4, bos_token_id=1, eos_token_id=2)).save_pretrained(hf)
    said = lambda: "".join(capsys.readouterr())  # noqa: E731 - out and err
    save, log = odd / "ckpt é", odd / "log é.jsonl"
    common = ["--tokenizer", str(tokenizer), "--data-cache", str(odd / "cache"), *TINY]
    assert main(["--data", str(corpus), "--from-hf", str(hf), "--save", str(save),
                 "--max-steps", "2", "--log-json", str(log), *common]) == 0
    assert "loaded weights from" in said()
    assert main(["--load", str(save), "--save", str(save), "--max-steps", "3", *common]) == 0
    assert "resumed from" in said()
    assert (save / "latest").read_text().strip() == "step_00000003"
    prefix = odd / "prepared set"  # a prepared prefix with a space
    assert data(["--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer",
                 str(tokenizer), "--no-progress", "--split-lines"]) == 0
    assert main(["--data", str(prefix), "--model", str(hf / "config.json"), "--max-steps", "2",
                 *common]) == 0
    # a real blend of the two still works, and a missing path is named whole
    assert main(["--data", "0.5", str(prefix), "0.5", str(corpus), "--model",
                 str(hf / "config.json"), "--max-steps", "2", *common]) == 0
    assert main(["--data", str(odd / "no such.txt"), "--max-steps", "2", *common]) == 2
    assert f"--data {odd / 'no such.txt'}: no such text file" in capsys.readouterr().err


def test_the_log_counts_parameters_as_convert_info_and_says_what_padding_adds(tmp_path, text,
                                                                             cache, capsys):
    import re

    from megapar.checkpoint.convert import checkpoint_info

    ckpt = tmp_path / "ckpt"
    assert main(["--data", text, "--data-cache", cache, "--tokenizer", "sentencepiece",
                 "--model", _model(tmp_path), "--max-steps", "2", "--save", str(ckpt),
                 *TINY]) == 0  # one process: its log is captured here
    line = next(x for x in capsys.readouterr().out.splitlines() if " parameters" in x)
    real, allocated = (int(x.replace(",", "")) for x in re.findall(r"([\d,]+) (?:parameters|"
                                                                    r"allocated)", line))
    assert f"{real:,} parameters (unpadded" in checkpoint_info(ckpt)
    # 1,004 ids padded to 1,024: 20 rows of the tied 32-wide embedding
    assert allocated - real == 20 * 32, line
    assert "the vocabulary of 1,004 padded to 1,024, a multiple of 128 x tp" in line


def test_the_log_counts_a_mixture_of_experts_active_parameters(text, cache, capsys):
    """A Mixtral's first line gives its active parameters per token beside the total:
    transformers' count of the model less the E - k experts a token is not routed to in each
    layer (it gave the total alone)."""
    import re

    from transformers import MixtralForCausalLM

    from megapar.models.recipes import resolve_model

    assert main(["--data", text, "--data-cache", cache, "--tokenizer", "sentencepiece",
                 "--model", "mixtral-tiny", *TINY, "--max-steps", "1",
                 "--warmup-steps", "0", "--global-batch-size", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if " parameters" in x)
    config = resolve_model("mixtral-tiny").to_hf()
    config.vocab_size = 1004  # the sentencepiece tokenizer's
    hf = MixtralForCausalLM(config)
    experts = hf.model.layers[0].mlp.experts
    per_expert = sum(p.numel() for p in experts.parameters()) // config.num_local_experts
    idle = config.num_hidden_layers * (config.num_local_experts - config.num_experts_per_tok)
    total, active = hf.num_parameters(), hf.num_parameters() - idle * per_expert
    assert re.search(rf"mixtral with {total:,} parameters \({active:,} active per token: 2 of 4 "
                     rf"experts; [\d,]+ allocated: the vocabulary", line), line


def test_load_checks_the_recorded_tokenizer_and_names_recorded_values(tmp_path, text, capsys):
    """--load compares the data's tokenizer with the one the checkpoint records (its files'
    sha256), not with the --tokenizer its train_config records (the default gpt2 when it
    trained on a prepared dataset, which keeps its own): --load alone resumes on that dataset,
    other data of the same tokenizer continues with --allow-data-change, data of another
    tokenizer is refused naming both, and a recorded --data that moved is named as recorded."""
    from megapar.cli.data import main as data
    from megapar.cli.train import plan_run
    from megapar.training.config import parse_args
    from megapar.training.data import resolve_model
    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import checkpoint_manifest, settings_from_checkpoint

    sp, sp2, gpt2 = (str(tmp_path / n) for n in ("sp", "sp2", "bpe"))
    for prefix, tokenizer, chars in ((sp, "sentencepiece", 20_000),
                                     (sp2, "sentencepiece", 30_000), (gpt2, "gpt2", 20_000)):
        (tmp_path / "part.txt").write_text(Path(text).read_text()[:chars])
        assert data(["--input", str(tmp_path / "part.txt"), "--output-prefix", prefix,
                     "--tokenizer", tokenizer, "--no-progress"]) == 0
    ck = str(tmp_path / "ck")
    assert main(["--model", _model(tmp_path), "--data", sp, *TINY, "--max-steps", "1",
                 "--warmup-steps", "0", "--save", ck]) == 0
    assert main(["--load", ck, "--max-steps", "2", "--save", ck]) == 0  # was: --tokenizer gpt2
    assert main(["--load", ck, "--data", sp2, "--allow-data-change", "--max-steps", "3"]) == 0
    # raw text with --load alone is tokenized with the recorded tokenizer, not the --tokenizer
    # gpt2 of the train_config (planned in this process: tokenized, split, checked)
    notes: list[str] = []
    cfg = parse_args(["--load", ck, "--data", text, "--data-cache", str(tmp_path / "cache"),
                      "--allow-data-change", "--max-steps", "4"])
    plan_run(cfg, notes)
    sp_model = asset_path("botchan_en_unigram_1000.model")
    assert cfg.tokenizer == sp_model and "tokenizer" in cfg.from_checkpoint
    assert f"--tokenizer {sp_model}" in next(n for n in notes if "from the checkpoint" in n)
    manifest = checkpoint_manifest(ck)  # its recorded tokenizer gone: named as recorded, and
    manifest["meta"]["tokenizer"]["path"] = str(tmp_path / "gone")  # the default as the default
    cfg = parse_args(["--load", ck, "--data", text, "--data-cache", str(tmp_path / "cache")])
    settings_from_checkpoint(cfg, manifest)
    assert cfg.tokenizer == "gpt2" and "tokenizer" not in cfg.from_checkpoint
    with pytest.raises(UsageError) as refused:
        resolve_model(cfg, None, manifest)
    assert (f"trained with the tokenizer {tmp_path / 'gone'} (sha256 " in str(refused.value)
            and f"--data {text} is tokenized with the default --tokenizer gpt2 (not given): "
            in str(refused.value)), refused.value
    capsys.readouterr()
    assert main(["--load", ck, "--data", gpt2, "--allow-data-change", "--max-steps", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tokenizer gpt2" not in err, err
    assert (f"--load {ck} trained with the tokenizer "
            f"{asset_path('botchan_en_unigram_1000.model')} (sha256 ") in err, err
    assert f"--data {gpt2} was made with gpt2: " in err, err
    os.rename(sp + ".bin", str(tmp_path / "elsewhere.bin"))  # the data moved (in part)
    assert main(["--load", ck, "--max-steps", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"megapar-train: error: --data {sp} (not given: the value --load {ck} "
                   f"recorded): sp.bin not found; pass --data with where that data is now"), err


def test_the_logged_mfu_counts_the_model_s_matmuls(tmp_path, text, cache):
    """TFLOP/s (the job's; per rank, TFLOP/s over the ranks) and MFU in the log are tokens/s x
    `training_flops_per_token` (SwiGLU's three products, grouped-query k / v, no FLOPs for the
    untied input embedding's lookup), the count
    megapar-plan's MFU uses; it was 6 x allocated parameters + 12 L h s, which counted the
    lookup as a product."""
    from megapar.models import config_from_dict
    from megapar.models.flops import training_flops_per_token

    cfg = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 64}
    model, log = tmp_path / "llama.json", tmp_path / "log.jsonl"
    model.write_text(json.dumps(cfg))
    assert main(["--data", text, "--data-cache", cache, "--tokenizer", "sentencepiece",
                 "--model", str(model), "--max-steps", "2", "--log-json", str(log),
                 "--peak-tflops", "2", "--tp", "2", *TINY]) == 0
    config = config_from_dict({**cfg, "vocab_size": 1004})  # the tokenizer's vocabulary
    steps = [m for m in map(json.loads, log.read_text().splitlines()) if "tflops" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["tflops"] * 1e12 / m["tokens_per_s"] == pytest.approx(
            training_flops_per_token(config, 32), rel=1e-9)
        # the job's TFLOP/s over its 2 ranks: per rank (per GPU, as Megatron's TFLOP/s/GPU),
        # against one device's --peak-tflops 2
        assert m["tflops_per_rank"] == pytest.approx(m["tflops"] / 2)
        assert m["mfu"] == pytest.approx(m["tflops_per_rank"] / 2)


def test_every_flag_has_a_group_and_the_groups_follow_in_order():
    """TrainConfig's fields are grouped by concern: each field in one group of `GROUPS`, each
    group's fields together and in `GROUPS`' order, and `--help` lists them under the groups."""
    import dataclasses

    from megapar.training.config import GROUPS, TrainConfig, build_parser, field_groups

    groups = field_groups()
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert list(groups) == names
    order = list(groups.values())
    seen = [g for i, g in enumerate(order) if i == 0 or g != order[i - 1]]
    assert seen == list(GROUPS), seen
    parser = build_parser()
    titled = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    for key, title in GROUPS.items():
        assert titled[title] == [n for n in names if groups[n] == key]


def test_load_whose_tokenizer_was_given_as_the_recorded_path_and_moved(tmp_path):
    """The checkpoint's run gave --tokenizer P, and P is also the recorded tokenizer's path;
    P moved since: --load took the saved --tokenizer P as it was and stopped on it ('unknown
    tokenizer P: use gpt2, sentencepiece, ...', a flag the user never gave). As for a recorded
    path elsewhere, a recorded tokenizer that no longer loads is not taken: the default
    tokenizes, and the tokenizer check names the recorded one."""
    from megapar.checkpoint.convert import recorded_tokenizer
    from megapar.training.config import parse_args
    from megapar.training.validate_resume import settings_from_checkpoint

    path = tmp_path / "tok.model"
    shutil.copy(asset_path("botchan_en_unigram_1000.model"), path)
    manifest = {"meta": {"train_config": {"tokenizer": str(path)},
                         "tokenizer": recorded_tokenizer(str(path))}}
    cfg = parse_args(["--load", str(tmp_path / "ck")])
    settings_from_checkpoint(cfg, manifest)
    assert cfg.tokenizer == str(path) and "tokenizer" in cfg.from_checkpoint  # still there
    os.rename(path, tmp_path / "moved.model")
    cfg = parse_args(["--load", str(tmp_path / "ck")])
    settings_from_checkpoint(cfg, manifest)
    assert cfg.tokenizer == "gpt2" and "tokenizer" not in cfg.from_checkpoint


def test_load_does_not_compile_because_the_checkpoints_run_did(tmp_path):
    """--compile is how a run executes (as --recompute): a --load run without it had compiled
    its blocks, tens of seconds of a first step nobody asked for, because the checkpoint's run
    gave --compile."""
    from megapar.training.config import parse_args
    from megapar.training.validate_resume import settings_from_checkpoint

    manifest = {"meta": {"train_config": {"compile": True, "recompute": "full", "seq_len": 48}}}
    cfg = parse_args(["--load", str(tmp_path / "ck")])
    settings_from_checkpoint(cfg, manifest)
    assert (cfg.compile, cfg.recompute, cfg.seq_len) == (False, "none", 48)
    assert cfg.from_checkpoint == {"seq_len"}


def test_slurm_sbatch_outside_a_job_says_to_submit_it(tmp_path):
    """bash launch/slurm.sbatch outside Slurm was bash's "SLURM_JOB_NODELIST: unbound
    variable", exit 1; it is one line naming sbatch, exit 2, and nothing starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), "--tp", "2"], env=env,
                         capture_output=True, text=True, timeout=30)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, (out.returncode, err)
    assert err[0].startswith("slurm.sbatch: error: not inside a Slurm job") and \
        "sbatch --nodes N launch/slurm.sbatch" in err[0], err


@pytest.mark.parametrize("torchrun_rc,requeued,rc", [(1, True, 0), (0, False, 0)],
                         ids=["stopped-by-the-time-limit-signal", "reached-max-steps"])
def test_slurm_requeues_a_run_the_time_limit_stopped_not_one_that_finished(
        tmp_path, torchrun_rc, requeued, rc):
    """launch/slurm.sbatch with stand-in srun / scontrol / squeue / date, in the job's last 3
    minutes after 10 of running: torchrun exiting non-zero (as it does after Slurm's SIGTERM)
    requeues the job; a run that reached --max-steps (torchrun exits 0) was requeued too, and
    the requeued run's "nothing left to train" (exit 2) ended the job FAILED. Now it ends."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    stand_ins = {
        "srun": 'echo "$MASTER_PORT $PYTHON $TORCH_ELASTIC_SHUTDOWN_TIMEOUT '
                f'$MEGAPAR_STOP_GRACE_S" > "$LOG.env"; exit {torchrun_rc}',
        "scontrol": 'if [ "$1" = requeue ]; then echo "$2" >> "$LOG"; else echo node0; fi',
        "squeue": "echo 3:00",  # minutes:seconds left
        "date": 'n=$(cat "$CLOCK" 2>/dev/null || echo 1000); echo $((n + 600)) > "$CLOCK"; '
                'echo $n',
    }
    for name, body in stand_ins.items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node0", "LOG": str(tmp_path / "log"),
           "CLOCK": str(tmp_path / "clock")}
    out = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), "--max-steps", "9"],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == rc, out.stderr
    log = tmp_path / "log"
    assert (log.read_text() if log.exists() else "") == ("77\n" if requeued else ""), out.stderr
    # the job's own port (a fixed 29500 until 2026-12-04), the environment's interpreter, and
    # a stop of up to 90 s inside the signal's 120 s lead (torchrun's SIGKILL came 30 s after
    # it, megapar's grace for a wait ended at 20 s: a cluster user's rehearsal)
    assert (tmp_path / "log.env").read_text() == "15077 python3 100 90\n"


@pytest.mark.parametrize("env, nproc", [({}, "8"), ({"SLURM_GPUS_PER_NODE": "a100:4"}, "4"),
                                        ({"SLURM_GPUS_PER_NODE": "4", "GPUS_PER_NODE": "2"}, "2"),
                                        ({"SLURM_GPUS_ON_NODE": "4"}, "4")])  # --gres=gpu:4
def test_slurm_sbatch_starts_the_workers_sbatch_gave_each_node_their_cores(tmp_path, env, nproc):
    """sbatch --gpus-per-node 4 still started 8 workers a node (GPUS_PER_NODE's default), and
    srun (Slurm 22.05 on) does not take sbatch's --cpus-per-task, so each node's torchrun and
    its workers shared one core (a launch-script tryout, read from Slurm's manual)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    # scontrol lists many nodes: `| head -n 1` killed it with SIGPIPE, which pipefail made the
    # script's exit 141 (a re-test)
    stand_ins = {"srun": 'echo "$SRUN_CPUS_PER_TASK $*" > "$LOG"',
                 "scontrol": "echo node0; for i in $(seq 1 20000); do echo node$i; done",
                 "squeue": "echo 60:00"}
    for name, body in stand_ins.items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")
            and k != "GPUS_PER_NODE"}
    out = subprocess.run(
        ["bash", str(ROOT / "launch" / "slurm.sbatch"), "--tp", "2"], capture_output=True,
        env={**base, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7",
             "SLURM_JOB_NODELIST": "node0", "SLURM_CPUS_PER_TASK": "32",
             "LOG": str(tmp_path / "log"), **env}, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    said = (tmp_path / "log").read_text()
    assert said.startswith("32 --kill-on-bad-exit=1 bash -c ") and (
        f"--nproc-per-node {nproc} " in said), said


def test_under_torchrun_each_process_hashes_only_the_files_it_reads(tmp_path, text, cache,
                                                                    monkeypatch):
    """A --tp 2 checkpoint (a 1-step run's, converted) resumed at --tp 2 by two processes
    forked with torchrun's variables, each running megapar-train's start-up itself, a byte of
    tp rank 1's file altered (its size kept). Every process hashed every file of --load at its
    start-up (both tp files each, and refused the run there); now its start-up checks only the
    manifest and the sizes, and its rank hashes what it reads, its own tp file (the checkpoint
    once over the job): rank 1 is refused in one line naming the step, the file and the fix,
    and rank 0, which loaded its own, stops with it (the ranks agree after the load), naming
    rank 1's failure."""
    import megapar.checkpoint.manifest as manifest_module
    from forked import torchrun_ranks
    from megapar.cli.convert import main as convert
    from megapar.training.loop import Trainer

    ckpt = tmp_path / "ckpt"
    args = ["--tp", "2", "--model", "gpt2-tiny", "--data", text, "--tokenizer", "sentencepiece",
            "--data-cache", cache, "--timeout-s", "30", *TINY, "--warmup-steps", "0"]
    assert main([*args, "--tp", "1", "--max-steps", "1", "--save", str(tmp_path / "tp1")]) == 0
    assert convert([str(tmp_path / "tp1"), str(ckpt), "--tp", "2", "--no-progress"]) == 0
    step = ckpt / "step_00000001"
    shard = step / "model_tp01_pp00.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's last byte: the header still reads
    shard.write_bytes(bytes(data))
    hashed = tmp_path / "hashed.txt"  # (rank, file) of every file hashed
    record = manifest_module.file_record

    def hashing(path):
        with open(hashed, "a") as f:
            f.write(f"{os.environ['RANK']} {Path(path).name}\n")
        return record(path)

    monkeypatch.setattr(manifest_module, "file_record", hashing)  # forked: inherited
    monkeypatch.setattr(Trainer, "run", lambda self: [])  # were it loaded: no step to train
    codes, outs = torchrun_ranks(lambda: main([*args, "--max-steps", "2", "--load", str(ckpt)]),
                                 2, tmp_path)
    assert codes == [1, 1], outs
    per_rank = {}
    for line in hashed.read_text().splitlines():
        rank, name = line.split()
        per_rank.setdefault(rank, []).append(name)
    assert per_rank == {"0": ["model_tp00_pp00.safetensors"],
                        "1": ["model_tp01_pp00.safetensors"]}
    refusal = (f"--load {step}: model_tp01_pp00.safetensors: checksum mismatch (file altered or "
               f"truncated); restore it or use another checkpoint")
    assert f"megapar-train: error: rank 1 failed before training started: {refusal}\n" in outs[1]
    assert (f"megapar-train: error: rank 0 failed before training started: --load {step}: rank 1 "
            f"failed at checking --load's files: ") in outs[0] and refusal in outs[0], outs[0]


@pytest.mark.parametrize("variable", ["TORCH_COMPILE_DISABLE", "TORCHDYNAMO_DISABLE"])
def test_compile_under_an_environment_that_turns_torch_compile_off_says_so(
        variable, monkeypatch, capsys, cache, text):
    """torch.compile returns the function as it is under either variable: --compile said the
    first step compiles and ran eager without a word (a new user's finding)."""
    monkeypatch.setenv(variable, "1")
    rc = main(["--data", text, "--data-cache", cache, "--tokenizer", "sentencepiece",
               "--model", "gpt2-tiny", "--no-progress", "--compile", "--dry-run"])
    assert rc == 0
    assert (f"megapar-train: warning: --compile does nothing: {variable}=1 is set, which turns "
            f"torch.compile off, so the blocks run eager") in capsys.readouterr().err


def test_compile_with_an_unusable_inductor_cache_is_one_line_before_any_worker(
        tmp_path, monkeypatch, capsys, cache, text):
    """TORCHINDUCTOR_CACHE_DIR under a file: every rank failed its first compile with a bare
    NotADirectoryError that named neither the variable nor --compile (a new user's finding)."""
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "afile" / "sub"))
    rc = main(["--data", text, "--data-cache", cache, "--tokenizer", "sentencepiece",
               "--model", "gpt2-tiny", "--no-progress", "--compile"])
    assert rc == 2
    assert (f"megapar-train: error: TORCHINDUCTOR_CACHE_DIR={tmp_path / 'afile' / 'sub'} cannot "
            f"be --compile's cache ({tmp_path / 'afile'} is a file, not a directory); point it at "
            f"a directory you can write, or unset it") in capsys.readouterr().err
