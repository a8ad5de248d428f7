"""Training continues across a layout change (issue 6).

A run is checkpointed after k=3 of 6 steps; resuming from that checkpoint in another layout --
converted offline with megapar-convert, or resharded on load by megapar-train itself, or with a
different data-parallel size (ZeRO-1 on or off) -- must give the losses of the run that kept
going in its original layout (fp32, relative error < 1e-5).

The CLIs are called in-process (`main(argv)`), so their workers are forked from this process.
"""

import json
from pathlib import Path

import pytest

from megapar.checkpoint.manifest import read_manifest
from megapar.checkpoint.publish import resolve_checkpoint
from megapar.cli.convert import main as convert
from megapar.cli.train import main as train
from megapar.data import asset_path

TOL = 1e-5
TINY = ["--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--warmup-steps", "2",
        "--max-steps", "6", "--clip-grad", "0.5", "--lr", "3e-3", "--precision", "fp32"]


@pytest.fixture(scope="module")
def common(tmp_path_factory):
    """Flags shared by every run: a tiny dropout-free GPT-2 on real text (sentencepiece)."""
    root = tmp_path_factory.mktemp("layout")
    text = root / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:40_000])
    model = root / "gpt2.json"
    model.write_text(json.dumps({
        "model_type": "gpt2", "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}))
    return ["--model", str(model), "--data", str(text), "--tokenizer", "sentencepiece",
            "--data-cache", str(root / "cache"), *TINY]


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _assert_continues(reference: list[dict], resumed_log: Path, what: str) -> float:
    """The resumed run logged steps 4-6 with the reference's losses (and grad norms, lrs).

    Returns a line reporting the largest relative loss error seen."""
    resumed = _records(resumed_log)
    assert [r["step"] for r in resumed] == [4, 5, 6], what
    ref = [r for r in reference if r["step"] >= 4]
    worst = 0.0
    for a, b in zip(ref, resumed):
        err = abs(a["loss"] - b["loss"]) / abs(a["loss"])
        worst = max(worst, err)
        assert err < TOL, (what, a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] < TOL, (what, a, b)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-12), what
    return f"{what}: max relative loss error {worst:.3g}"


def _train_and_checkpoint(tmp_path, common, layout: list[str]) -> tuple[list[dict], Path]:
    """One uninterrupted 6-step run that also saves at step 3 (the reference and the source)."""
    log, ckpt = tmp_path / "reference.jsonl", tmp_path / "ckpt"
    assert train([*common, *layout, "--save", str(ckpt), "--save-interval", "3",
                  "--log-json", str(log)]) == 0
    reference = _records(log)
    assert [r["step"] for r in reference] == [1, 2, 3, 4, 5, 6]
    # the losses move, so matching them after the resume is not a coincidence of a flat curve
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.1, reference
    step3 = ckpt / "step_00000003"
    assert read_manifest(step3)["step"] == 3
    return reference, step3


def test_tp2_pp2_checkpoint_continues_at_tp1_pp4_and_tp4_pp1(tmp_path, common, capfd):
    reference, step3 = _train_and_checkpoint(tmp_path, common, ["--tp", "2", "--pp", "2"])
    assert read_manifest(step3)["layout"] == {"tp": 2, "pp": 2, "dp": 1}

    # (a) offline: megapar-convert to tp=1 x pp=4, then resume there
    dst = tmp_path / "tp1pp4"
    assert convert([str(step3), str(dst), "--tp", "1", "--pp", "4", "--no-progress"]) == 0
    manifest = read_manifest(resolve_checkpoint(dst))
    assert manifest["layout"]["tp"] == 1 and manifest["layout"]["pp"] == 4
    assert manifest["step"] == 3
    assert all(entry["optim"] for entry in manifest["tensors"].values()), \
        "the converted checkpoint lost Adam moments"
    log_a = tmp_path / "a.jsonl"
    assert train([*common, "--tp", "1", "--pp", "4", "--load", str(dst),
                  "--log-json", str(log_a)]) == 0
    measured = [_assert_continues(reference, log_a, "convert 2x2 -> 1x4")]

    # (b) online: megapar-train loads the 2x2 checkpoint straight into tp=4 x pp=1
    log_b = tmp_path / "b.jsonl"
    assert train([*common, "--tp", "4", "--pp", "1", "--load", str(step3),
                  "--log-json", str(log_b)]) == 0
    out = capfd.readouterr().out  # the workers' stdout (they are forked from this process)
    assert f"resumed from {step3} at step 3 (resharded from tp=2 pp=2 dp=1)" in out
    assert "tp=4 pp=1 dp=1" in out
    measured.append(_assert_continues(reference, log_b, "reshard on load 2x2 -> 4x1"))
    print("\n".join(measured))  # shown with -s


def test_zero1_dp2_checkpoint_continues_at_dp1_with_and_without_zero_and_at_dp4(tmp_path,
                                                                                common):
    # the global batch (8) stays the same; only how it is split over dp ranks changes
    reference, step3 = _train_and_checkpoint(
        tmp_path, common, ["--tp", "1", "--pp", "2", "--dp", "2", "--zero", "1"])
    assert read_manifest(step3)["layout"] == {"tp": 1, "pp": 2, "dp": 2}
    measured = []
    for zero in ("1", "0"):
        log = tmp_path / f"dp1_zero{zero}.jsonl"
        assert train([*common, "--tp", "1", "--pp", "2", "--dp", "1", "--zero", zero,
                      "--load", str(step3), "--log-json", str(log)]) == 0
        measured.append(_assert_continues(reference, log, f"zero=1 dp=2 -> zero={zero} dp=1"))
    # more dp ranks, each taking its (differently cut) slice of the state; pp 2 -> 1 as well
    log = tmp_path / "dp4_zero1.jsonl"
    assert train([*common, "--tp", "1", "--pp", "1", "--dp", "4", "--zero", "1",
                  "--load", str(step3), "--log-json", str(log)]) == 0
    measured.append(_assert_continues(reference, log, "zero=1 dp=2 pp=2 -> zero=1 dp=4 pp=1"))
    print("\n".join(measured))  # shown with -s


def test_zero2_checkpoint_continues_at_zero0_and_the_reverse(tmp_path, common, capfd):
    """A --zero 2 checkpoint (pp 2 x dp 2: gradients and state sharded) resumes at --zero 0 and
    --zero 1 with the losses of the run that did not stop (the resume line names the ZeRO
    change), and a --zero 0 one resumes at --zero 2 (dp 2, pp 1)."""
    measured = []
    (tmp_path / "a").mkdir()
    reference, step3 = _train_and_checkpoint(
        tmp_path / "a", common, ["--tp", "1", "--pp", "2", "--dp", "2", "--zero", "2"])
    for zero in ("0", "1"):
        log = tmp_path / f"zero2_to_zero{zero}.jsonl"
        assert train([*common, "--tp", "1", "--pp", "2", "--dp", "2", "--zero", zero,
                      "--load", str(step3), "--log-json", str(log)]) == 0
        measured.append(_assert_continues(reference, log, f"zero=2 -> zero={zero}"))
        assert f"at step 3 (same layout; --zero 2 -> {zero})" in capfd.readouterr().out
    (tmp_path / "b").mkdir()
    reference, step3 = _train_and_checkpoint(
        tmp_path / "b", common, ["--tp", "1", "--pp", "1", "--dp", "2", "--zero", "0"])
    log = tmp_path / "zero0_to_zero2.jsonl"
    assert train([*common, "--tp", "1", "--pp", "1", "--dp", "2", "--zero", "2",
                  "--load", str(step3), "--log-json", str(log)]) == 0
    measured.append(_assert_continues(reference, log, "zero=0 -> zero=2"))
    print("\n".join(measured))  # shown with -s
