"""Checkpoints of chunked stages are canonical: a run under interleaved 1F1B (pp=2, V=2) saved
at step 3 continues with the same losses under 1F1B at pp=4 (resharded on load) and, converted
offline by megapar-convert to tp=2 x pp=2, under ZB-H1."""

from test_layout_change import _assert_continues, _train_and_checkpoint, common  # noqa: F401

from megapar.checkpoint.manifest import read_manifest
from megapar.checkpoint.publish import resolve_checkpoint
from megapar.cli.convert import main as convert
from megapar.cli.train import main as train

INTERLEAVED = ["--tp", "1", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2"]


def test_interleaved_checkpoint_continues_under_1f1b_at_pp4_and_converted(tmp_path, common,
                                                                          capfd):
    reference, step3 = _train_and_checkpoint(tmp_path, common, INTERLEAVED)
    manifest = read_manifest(step3)
    assert manifest["layout"] == {"tp": 1, "pp": 2, "dp": 1}
    # canonical names only: blocks by global index, no chunk prefix
    assert {n.split(".")[0] for n in manifest["tensors"]} == {"embed", "layers", "final_norm"}
    assert manifest["tensors"]["layers.2.ln_1.weight"]["stage"] == 0  # chunk 1 of rank 0

    log_a = tmp_path / "a.jsonl"
    assert train([*common, "--pp", "4", "--schedule", "1f1b", "--load", str(step3),
                  "--log-json", str(log_a)]) == 0
    out = capfd.readouterr().out
    assert "resharded from tp=1 pp=2 dp=1" in out
    measured = [_assert_continues(reference, log_a, "interleaved pp=2 V=2 -> 1f1b pp=4")]

    dst = tmp_path / "tp2pp2"
    assert convert([str(step3), str(dst), "--tp", "2", "--pp", "2", "--no-progress"]) == 0
    assert read_manifest(resolve_checkpoint(dst))["layout"]["tp"] == 2
    log_b = tmp_path / "b.jsonl"
    assert train([*common, "--tp", "2", "--pp", "2", "--schedule", "zb-h1", "--load", str(dst),
                  "--rank-order", "tp-dp-pp", "--log-json", str(log_b)]) == 0
    measured.append(_assert_continues(reference, log_b,
                                      "interleaved 1x2 V=2 -> convert 2x2 -> zb-h1"))
    print("\n".join(measured))


def test_bad_virtual_stages_rejected_before_workers_start(common, capsys):
    assert train([*common, "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "1"]) == 2
    assert "--virtual-stages >= 2" in capsys.readouterr().err
    assert train([*common, "--pp", "2", "--virtual-stages", "2"]) == 2
    assert "needs --schedule interleaved" in capsys.readouterr().err
    # 4 layers cannot make pp=2 x V=4 chunks
    assert train([*common, "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "4"]) == 2
    assert "cannot be cut into --pp 2 x --virtual-stages 4" in capsys.readouterr().err
    # global batch 10 / micro-batch 2 = 5 micro-batches: 2 rounds at pp=2 cannot be equal
    assert train([*common, "--global-batch-size", "10", "--pp", "2", "--schedule",
                  "interleaved", "--virtual-stages", "2"]) == 2
    assert "m must be divisible by 2" in capsys.readouterr().err
    # the V schedules: always two chunks, DualPipeV at least 2 pp micro-batches, 2 pp layers
    assert train([*common, "--pp", "2", "--schedule", "zb-v", "--virtual-stages", "3"]) == 2
    err = capsys.readouterr().err
    assert "--virtual-stages 3 does not apply to --schedule zb-v" in err and err.count("\n") == 1
    assert train([*common, "--global-batch-size", "6", "--pp", "2", "--schedule",
                  "dualpipev"]) == 2
    assert "DualPipeV needs at least 2 x pp = 4 micro-batches" in capsys.readouterr().err
    # the V's line, as megapar-bubble's (one line for both; a re-test): a --pp that runs, not
    # "or less" (pp 1 fails), beyond the layers too, and none where no --pp can hold the V
    for pp in ("4", "8"):
        assert train([*common, "--pp", pp, "--schedule", "zb-v"]) == 2
        assert (f"4 layers cannot be cut into 2 x --pp {pp} = {2 * int(pp)} model chunks (zb-v "
                f"and dualpipev place two per rank in a V; each needs at least one layer); lower "
                f"--pp to 2, or use a schedule with one chunk per rank (1f1b, zb-h1)"
                ) in capsys.readouterr().err


def test_zb_v_checkpoint_continues_under_1f1b_at_pp2_one_process_and_dualpipev(tmp_path, common,
                                                                             capfd):
    """The V placement puts layers 0 and 3 (and the head) on rank 0, 1 and 2 on rank 1; the
    checkpoint is still canonical per layer, so it loads under any other schedule and layout."""
    reference, step3 = _train_and_checkpoint(tmp_path, common, ["--pp", "2", "--schedule", "zb-v"])
    manifest = read_manifest(step3)
    assert manifest["layout"] == {"tp": 1, "pp": 2, "dp": 1}
    stage = {n: e["stage"] for n, e in manifest["tensors"].items()}
    assert stage["layers.0.ln_1.weight"] == stage["layers.3.ln_1.weight"] == 0
    assert stage["layers.1.ln_1.weight"] == stage["layers.2.ln_1.weight"] == 1
    assert stage["embed.word.weight"] == stage["final_norm.weight"] == 0
    measured = []
    for layout, what in ((["--pp", "2", "--schedule", "1f1b"], "zb-v pp=2 -> 1f1b pp=2"),
                         (["--pp", "1"], "zb-v pp=2 -> one process"),
                         (["--pp", "2", "--schedule", "dualpipev"], "zb-v -> dualpipev pp=2")):
        log = tmp_path / f"{len(measured)}.jsonl"
        assert train([*common, *layout, "--load", str(step3), "--log-json", str(log)]) == 0
        measured.append(_assert_continues(reference, log, what))
    capfd.readouterr()
    print("\n".join(measured))
