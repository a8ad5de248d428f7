"""--record-step and --replay: a step of a run replayed in another layout (one process, or other
tp / cp / sequence-parallel slices than the run's), compared value by value with the run's
record (megapar-train, real text)."""

import json
from importlib.resources import files
from pathlib import Path

import pytest

from megapar.cli.train import main


@pytest.fixture(scope="module")
def common(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    text = files("megapar") / "assets" / "shakespeare_sample.txt"  # runs from a clone alone
    model = d / "m.json"
    model.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 4, "n_head": 4,
                                 "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                 "attn_pdrop": 0.0}))
    return ["--model", str(model), "--data", str(text), "--data-cache", str(d / "cache"),
            "--tokenizer", "sentencepiece", "--seq-len", "32", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--log-interval", "1", "--eval-interval", "0",
            "--no-progress", "--max-steps", "3"]


def _replay(common, tmp_path, capfd, fault, run=("--tp", "2", "--pp", "2"), replay=()):
    """A run of 3 steps (tp 2 x pp 2 by default) saving step 2 (and recording step 3, or
    failing there), then `--load step_00000002 --replay 3` (in one process by default): its
    output lines."""
    save = tmp_path / "ckpt"
    rc = main([*common, *run, "--save", str(save), "--save-interval", "2", *fault])
    err = capfd.readouterr().err
    assert rc == (1 if "--inject-corrupt" in fault else 0), err
    assert (save / "records" / "step_00000003.json").exists()
    rc = main(["--load", str(save / "step_00000002"), "--replay", "3", "--no-progress", *replay])
    captured = capfd.readouterr()
    out = captured.out
    assert rc == 0, captured.err
    assert "transformer.h.3.attn " in out and "transformer.h.3.mlp.c_fc " in out  # the norms
    return err, out.splitlines()


CORRUPT = ["--inject-corrupt", "step=3,module=transformer.h.3.attn,tp=1",
           "--max-nonfinite-steps", "1"]
NAMED = ("first difference: forward output of transformer.h.3.attn, micro-batch 0 (samples 0-1), "
         "computed by rank 3 (tp=1 cp=0 pp=1 dp=0): norm nan recorded")


def _verdict(out: list[str]) -> str:
    """The replay's one comparison line."""
    lines = [line for line in out if line.startswith("replay of step 3")]
    assert len(lines) == 1, out
    return lines[0]


def _agrees(out: list[str]) -> None:
    """No difference, every recorded value compared, and the record's parts combined (tp slices
    of c_fc's features, each tp rank's whole attn output once, cp tokens) are the replay's
    combined norms, as are the weight-gradient norms."""
    assert "no difference" in _verdict(out) and "not compared" not in _verdict(out), out
    for name in ("transformer.h.3.mlp.c_fc", "transformer.h.3.attn", "transformer.ln_f"):
        row = next(line.split() for line in out if line.startswith(name + " "))
        assert abs(float(row[1]) - float(row[2])) <= 1e-5 * float(row[1]), row
        if name != "transformer.h.3.attn":  # a container has no weights of its own
            assert abs(float(row[3]) - float(row[4])) <= 1e-5 * float(row[3]), row


def test_a_corrupted_value_is_named_by_a_one_process_replay(common, tmp_path, capfd):
    """nan in one value of block 3's attention output on tp rank 1 at step 3: the run stops
    there (naming it, item 1) and leaves the step's record; the replay in one process names
    that module and rank as the first whose values differ."""
    err, out = _replay(common, tmp_path, capfd, CORRUPT)
    assert "its record for --replay: " in err, err
    # the advice is the injection's ("Lower --lr" cannot help it; a new user's finding)
    assert "the fault injected on purpose (step=3,module=transformer.h.3.attn,tp=1) put it " \
        "there: leave out --inject-corrupt" in err and "Lower --lr" not in err, err
    assert NAMED in _verdict(out), out
    # the table's recorded column shows the fault where the line names it, not tp rank 0's
    # clean copy of the attention output (the first nan was in transformer.h.3.mlp.c_fc)
    row = next(line.split() for line in out if line.startswith("transformer.h.3.attn "))
    assert row[2] == "nan" and row[1] != "nan", row


def test_without_a_fault_the_replay_finds_no_difference(common, tmp_path, capfd):
    """--record-step 3 of a clean run: every recorded norm (each rank's output of each module
    per micro-batch, and the weight-gradient norms) agrees with the one-process replay."""
    _agrees(_replay(common, tmp_path, capfd, ["--record-step", "3"])[1])


def test_a_cp_record_agrees_with_a_tp_sp_replay(common, tmp_path, capfd):
    """A record made at tp 1 x cp 2 x pp 2 (each rank: whole features of its cp tokens, chunks
    0 and 3 or 1 and 2 of the sequence) replayed at tp 2 x pp 2 with sequence parallelism (each
    rank: a tp slice of the features, or the first or second half of the sequence): the replay
    ranks' shares of every recorded value add up to it within the tolerance."""
    _agrees(_replay(common, tmp_path, capfd, ["--record-step", "3"],
                    run=("--cp", "2", "--pp", "2"),
                    replay=("--tp", "2", "--pp", "2", "--sequence-parallel"))[1])


def test_a_corrupted_value_is_named_by_a_tp_cp_replay(common, tmp_path, capfd):
    """The corruption of the first test replayed at tp 2 x cp 2 (other slices than the run's
    tp 2 x pp 2): still block 3's attention output on the run's tp rank 1 (rank 3)."""
    _, out = _replay(common, tmp_path, capfd, CORRUPT, replay=("--tp", "2", "--cp", "2"))
    assert NAMED in _verdict(out), out


# --- the record is checked before any worker starts (issue 44, drill round 3) ----------------


@pytest.fixture(scope="module")
def recorded(common, tmp_path_factory):
    """A one-process run of 4 steps saving step 2 and recording step 3: its --save directory."""
    save = tmp_path_factory.mktemp("recorded") / "ckpt"
    rc = main([*common, "--max-steps", "4", "--save", str(save), "--save-interval", "2",
               "--record-step", "3"])
    assert rc == 0
    return save


def _refused(capfd, argv: list[str], *words: str) -> str:
    """`argv` exits 2 with one line holding `words`, before any worker started (no step ran)."""
    rc = main(argv)
    captured = capfd.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("megapar-train:")]
    assert rc == 2, captured.err
    assert len(lines) == 1 and all(w in lines[0] for w in words), captured.err
    assert "step 3 " not in captured.out and "loss" not in captured.out, captured.out
    return lines[0]


def _copy_record(save: Path, into: Path, step: int = 3) -> Path:
    """The record of `step` copied into `into`: its JSON's path."""
    into.mkdir(parents=True, exist_ok=True)
    for suffix in (".json", ".safetensors"):
        src = save / "records" / f"step_{step:08d}{suffix}"
        (into / src.name).write_bytes(src.read_bytes())
    return into / f"step_{step:08d}.json"


def test_a_damaged_record_is_refused_before_any_worker_starts(recorded, tmp_path, capfd):
    """Flipped bytes in the values file: its sha256 no longer matches; the replay does not
    run (it would blame a rank for a difference the damage made)."""
    record = _copy_record(recorded, tmp_path / "r")
    values = record.with_suffix(".safetensors")
    raw = bytearray(values.read_bytes())
    for i in range(len(raw) - 64, len(raw)):
        raw[i] ^= 0xFF
    values.write_bytes(bytes(raw))
    _refused(capfd, ["--load", str(recorded / "step_00000002"), "--replay", "3",
                     "--replay-against", str(record), "--no-progress"],
             str(record), "checksum does not match")


def test_a_record_of_another_step_is_refused(recorded, capfd):
    _refused(capfd, ["--load", str(recorded / "step_00000002"), "--replay", "4", "--max-steps",
                     "4", "--replay-against", str(recorded / "records" / "step_00000003.json"),
                     "--no-progress"],
             "records step 3, not step 4")


def test_a_record_of_another_model_is_refused(recorded, tmp_path, capfd):
    """A record whose model (its config, under a valid checksum) is not the checkpoint's."""
    from megapar.diagnostics.replay import _digest

    record = _copy_record(recorded, tmp_path / "r")
    data = json.loads(record.read_text())
    data["model"]["n_layer"] = 2
    data["sha256"] = _digest(data, record.with_suffix(".safetensors").read_bytes())
    record.write_text(json.dumps(data))
    _refused(capfd, ["--load", str(recorded / "step_00000002"), "--replay", "3",
                     "--replay-against", str(record), "--no-progress"],
             "record of another model", "n_layer 2 recorded, 4 here")


def test_a_replay_at_another_global_batch_is_refused(recorded, capfd):
    """A resumed run may change the global batch (its data order continues), a replay may not:
    the recorded step's samples are the checkpoint's global batch's."""
    _refused(capfd, ["--load", str(recorded / "step_00000002"), "--replay", "3",
                     "--global-batch-size", "16", "--no-progress"],
             "--global-batch-size 16 with --replay 3", "global batches of 8",
             "drop --global-batch-size")


def test_a_replay_under_another_loss_mean_is_refused(recorded, tmp_path, capfd):
    """A record says which --loss-mean made its step (and --label-smoothing / --z-loss where
    not 0); a replay under the other one (another label smoothing) is refused
    before any worker starts (its gradients differ by design, and the replay would blame a
    module). A record from before records said it keeps its checksum and is not checked."""
    from megapar.diagnostics.replay import _digest, check_record

    record = recorded / "records" / "step_00000003.json"
    assert json.loads(record.read_text())["loss_mean"] == "microbatch"
    _refused(capfd, ["--load", str(recorded / "step_00000002"), "--replay", "3",
                     "--loss-mean", "token", "--no-progress"],
             "recorded step 3 under --loss-mean microbatch", "replay with --loss-mean microbatch")
    _refused(capfd, ["--load", str(recorded / "step_00000002"), "--replay", "3",
                     "--label-smoothing", "0.1", "--no-progress"],
             "recorded step 3 under --label-smoothing 0,", "replay with --label-smoothing 0")
    old = _copy_record(recorded, tmp_path / "r")
    data = json.loads(old.read_text())
    del data["loss_mean"]
    data["sha256"] = _digest(data, old.with_suffix(".safetensors").read_bytes())
    old.write_text(json.dumps(data))
    assert check_record(old, 3, data["model"], "--replay-against", "token") == []


@pytest.mark.parametrize("damage", ["json", "safetensors", "directory", "values-file"])
def test_an_unreadable_record_is_one_line_naming_the_file(recorded, tmp_path, capfd, damage):
    """A truncated .json or .safetensors, a directory, or the .safetensors given for the
    record: one line naming the file, exit 2, before any worker starts."""
    record = _copy_record(recorded, tmp_path / "r")
    given = record
    if damage == "json":
        record.write_text(record.read_text()[:100])
    elif damage == "safetensors":
        values = record.with_suffix(".safetensors")
        values.write_bytes(values.read_bytes()[:50])
        given = record
    elif damage == "directory":
        given = record.parent
    else:
        given = record.with_suffix(".safetensors")
    _refused(capfd, ["--load", str(recorded / "step_00000002"), "--replay", "3",
                     "--replay-against", str(given), "--no-progress"], str(given))


def test_an_old_record_without_a_checksum_is_read_with_a_note(recorded, tmp_path, capfd):
    record = _copy_record(recorded, tmp_path / "r")
    data = json.loads(record.read_text())
    del data["sha256"], data["model"]
    record.write_text(json.dumps(data))
    rc = main(["--load", str(recorded / "step_00000002"), "--replay", "3",
               "--replay-against", str(record), "--no-progress"])
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    assert "before records carried a checksum: not verified" in captured.err, captured.err
    assert "no difference" in _verdict(captured.out.splitlines()), captured.out


def test_a_replay_takes_its_progress_bar_off_before_the_report(recorded, capfd):
    """The bar stood at "2/4" below the report when the replay ended the run (tqdm prints its
    last state on closing): it read as a run stopped half-way."""
    rc = main(["--load", str(recorded / "step_00000002"), "--replay", "3", "--progress"])
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    assert "no difference" in _verdict(captured.out.splitlines()), captured.out
    assert "train:" in captured.err  # the bar was shown while the step ran ...
    assert "train:" not in captured.err.rsplit("\r", 1)[-1], repr(captured.err[-300:])  # ... not after


def test_a_replay_that_compared_nothing_never_says_no_difference():
    from megapar.diagnostics.replay import compare

    entry = {"module": "model.layers.0.mlp", "mb": 0, "key": 1, "samples": [0, 2],
             "part": "whole", "rank": 0, "tp": 0, "cp": 0, "pp": 0, "dp": 0, "tp_size": 1,
             "cp_size": 1, "sq": 1.0}
    line = compare({"step": 3, "entries": [entry] * 200}, {}, {})
    assert "nothing compared" in line and "no difference" not in line, line


def test_a_replay_with_no_record_is_refused_before_any_worker_starts(recorded, capfd):
    """--replay 4 where no record of step 4 exists: it would train and compare nothing."""
    _refused(capfd, ["--load", str(recorded / "step_00000002"), "--replay", "4", "--max-steps",
                     "4", "--no-progress"],
             "--replay 4: no record of step 4", "--record-step 4")


@pytest.mark.parametrize("flag", ["--save", "--record-step", "--log-json", "--tensorboard"])
def test_save_record_step_or_a_log_under_replay_is_refused(recorded, tmp_path, capfd, flag):
    """--save / --record-step under --replay were ignored silently (and --save's directory
    made): refused in one line, nothing made. A --log-json or --tensorboard of the run (its
    command line or --config repeated with --replay) lost its records after the checkpoint's
    step, a new user's finding: refused too, the log untouched."""
    out = tmp_path / "out"
    log = '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    if flag == "--log-json":
        out.write_text(log)
    extra = [flag, "3"] if flag == "--record-step" else [flag, str(out)]
    _refused(capfd, ["--load", str(recorded / "step_00000002"), "--replay", "3",
                     "--no-progress", *extra], f"{flag} with --replay 3", f"drop {flag}")
    assert out.read_text() == log if flag == "--log-json" else not out.exists()


@pytest.mark.parametrize("load", ["", "step_00000004"])
def test_a_replay_of_a_step_the_checkpoint_is_past_names_an_earlier_one(recorded, capfd, load):
    """--replay 3 from the run's latest (step 4) said 'nothing left to train; raise
    --max-steps', which led to a second refusal; it names the step directory to --load."""
    _refused(capfd, ["--load", str(recorded / load), "--replay", "3", "--no-progress"],
             f"--replay 3 re-runs step 3 from a checkpoint saved before it, and --load "
             f"{recorded / load} is at step 4; --load {recorded / 'step_00000002'}")


def test_a_zero_sharded_replay_says_why_the_gradient_norms_are_not_compared(recorded, capfd):
    """A replay at --zero 3 --dp 2 has no weight-gradient norms of its own: it says so rather
    than 'no weight-gradient norms were recorded' (the record holds them)."""
    rc = main(["--load", str(recorded / "step_00000002"), "--replay", "3", "--zero", "3",
               "--dp", "2", "--no-progress"])
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    line = _verdict(captured.out.splitlines())
    assert "no weight-gradient norms were recorded" not in line, line
    assert "weight-gradient norms are not compared: the replay's gradients are sharded" in line


def test_an_expert_parallel_record_agrees_with_a_one_process_replay(tmp_path, capfd):
    """A MoE run at dp 2 x ep 2 recorded its experts' weight-gradient norms from dp rank 0
    alone, whose ep block holds half of them (0.00137 of layer 0's 0.00316), so a replay in
    any other layout said the experts' gradients differ; they are summed over the ep ranks of
    the first block, and the table has their rows (they had none: no [b, s, h] output). Runs
    on the shipped sample (no shared data)."""
    model = tmp_path / "moe.json"
    model.write_text(json.dumps({
        "model_type": "mixtral", "vocab_size": 1000, "hidden_size": 32,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "num_local_experts": 4,
        "num_experts_per_tok": 2, "tie_word_embeddings": False}))
    save = tmp_path / "ckpt"
    assert main(["--model", str(model), "--tokenizer", "sentencepiece", "--seq-len", "32",
                 "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "0",
                 "--no-progress", "--max-steps", "3", "--dp", "2", "--ep", "2",
                 "--data-cache", str(tmp_path / "cache"), "--save", str(save),
                 "--save-interval", "2", "--record-step", "3"]) == 0
    capfd.readouterr()
    assert main(["--load", str(save / "step_00000002"), "--replay", "3", "--no-progress"]) == 0
    out = capfd.readouterr().out.splitlines()
    assert "no difference" in _verdict(out), out
    for layer in (0, 1):
        row = next(line.split() for line in out
                   if line.startswith(f"model.layers.{layer}.block_sparse_moe.experts "))
        assert row[1:3] == ["-", "-"] and float(row[3]) > 0, row
        assert abs(float(row[3]) - float(row[4])) <= 1e-5 * float(row[3]), row
