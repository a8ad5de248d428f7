"""The layout fuzzer's own checks (tools/layout_fuzz.py): a comparison that finds nothing to
compare, or two diverged runs, is no pass (a fuzz run's audit of the tool)."""

import math
from pathlib import Path

import pytest

from repo_script import load_script

ROOT = Path(__file__).resolve().parents[1]


def _fuzz():
    return load_script("tools/layout_fuzz.py")


def test_a_comparison_with_nothing_compared_or_two_diverged_runs_fails():
    fuzz = _fuzz()
    assert fuzz.compare([], [])[0] == math.inf  # passed: 0 == 0 steps
    assert fuzz.compare([{"step": 1}], [{"step": 1}])[0] == math.inf  # no number logged
    assert fuzz.rel(math.inf, math.inf) == math.inf == fuzz.rel(math.nan, math.nan)
    same = [{"step": 1, "loss": 2.5, "grad_norm": 1.0}]
    assert fuzz.compare(same, same) == (0.0, ["step 1 grad_norm: 1.0 vs 1.0 (rel 0.00e+00)",
                                              "step 1 loss: 2.5 vs 2.5 (rel 0.00e+00)"])
    worst, _ = fuzz.compare([{"step": 1, "loss": 2.5001}], [{"step": 1, "loss": 2.5}])
    assert math.isclose(worst, 4e-5, rel_tol=1e-6)


def test_an_fp16_range_rerun_needs_a_step_skipped_on_one_side():
    """The fp32-reduction rerun that may call a mismatch fp16-range ran for every fp16 case
    that logs a loss scale, equal ones too: a mismatch of another cause that an fp32 reduction
    happened to pass would have been hidden (a fuzz run's audit of the tool)."""
    fuzz = _fuzz()
    equal = [{"step": 1, "loss": 2.5, "loss_scale": 65536.0}]
    _, where = fuzz.compare(equal, [{"step": 1, "loss": 2.6, "loss_scale": 65536.0}])
    assert not fuzz.skipped_on_one_side(where), where
    _, where = fuzz.compare(equal, [{"step": 1, "loss": 2.5, "loss_scale": 32768.0}])
    assert fuzz.skipped_on_one_side(where), where
    _, where = fuzz.compare([{"step": 1, "loss": 2.5}], equal)
    assert fuzz.skipped_on_one_side(where), where  # not logged on one side


def test_a_results_file_cut_short_is_read_up_to_its_last_whole_record(tmp_path, capsys):
    """--replay of a results.jsonl whose last line a full disk cut short failed on every --case
    with a JSONDecodeError traceback (a fuzz run's finding): that line is left out, said."""
    fuzz = _fuzz()
    results = tmp_path / "results.jsonl"
    results.write_text('{"index": 0, "case": {"--tp": 2}}\n{"index": 1, "ca')
    assert [r["index"] for r in fuzz.read_records(results)] == [0]
    assert f"{results}:2 is no whole record" in capsys.readouterr().out
    # a whole line that is no record was a TypeError / KeyError traceback, a file not UTF-8 a
    # UnicodeDecodeError one (a re-test)
    results.write_text('{"index": 0, "case": {"--tp": 2}}\n[1, 2]\n{"index": 2}\n')
    assert [r["index"] for r in fuzz.read_records(results)] == [0]
    out = capsys.readouterr().out
    assert f"{results}:2 is no record (no index and case)" in out and f"{results}:3 is" in out
    results.write_bytes(b"\xff\xfeab")
    with pytest.raises(SystemExit, match=r"--replay .*results.jsonl: not a results file"):
        list(fuzz.read_records(results))


def test_the_references_keep_what_changes_the_computation_and_no_more():
    """PowerSGD on a tied model at pp 2 is compared with dp alone (its tied sum now precedes
    the compression: one process's computation); an --fp8 reference keeps what sums the
    gradients in another fp32 order (dp, ZeRO-2, pp on a tied model) under either recipe
    (rowwise's power-of-two scales absorb a scale's move, not an element's own: a fuzz run's
    bert-tiny under ZeRO-3, 3.1e-4 in a bias), and tp and cp."""
    fuzz = _fuzz()
    ref = fuzz.reference_case
    powersgd = {"model": "gpt2-tiny", "--pp": 2, "--dp": 2, "--grad-compression": "powersgd"}
    assert ref(powersgd) == {"model": "gpt2-tiny", "--grad-compression": "powersgd", "--dp": 2}
    f8 = {"model": "gpt2-tiny", "--pp": 2, "--dp": 2, "--zero": 2, "--tp": 2, "--fp8-emulate": True}
    assert ref({**f8, "--fp8": "tensorwise"}) == {
        "model": "gpt2-tiny", "--fp8-emulate": True, "--fp8": "tensorwise", "--tp": 2, "--dp": 2,
        "--zero": 2, "--pp": 2}
    assert ref({**f8, "--fp8": "rowwise"}) == {
        "model": "gpt2-tiny", "--fp8-emulate": True, "--fp8": "rowwise", "--tp": 2, "--dp": 2,
        "--zero": 2, "--pp": 2}
    assert ref({**f8, "--fp8": "rowwise", "model": "llama-tiny", "--zero": 1}) == {
        "model": "llama-tiny", "--fp8-emulate": True, "--fp8": "rowwise", "--tp": 2, "--dp": 2}
    moe = {**f8, "model": "qwen3-moe-tiny", "--fp8": "rowwise"}  # routing flips on a step
    assert ref(moe) == {"model": "qwen3-moe-tiny", "--fp8-emulate": True, "--fp8": "rowwise",
                        "--tp": 2, "--dp": 2, "--zero": 2, "--pp": 2}
    untied = {**f8, "model": "llama-tiny", "--zero": 1, "--fp8": "tensorwise"}
    assert ref(untied) == {"model": "llama-tiny", "--fp8-emulate": True, "--fp8": "tensorwise",
                           "--tp": 2, "--dp": 2}
    # a fuzz run's findings (2026-12-05): ZeRO-3 and the bucket size order the sums too, and
    # GPipe's loss makes its gradients by another path (under any recipe)
    assert ref({**untied, "--zero": 3, "--grad-bucket-mb": 0.01}) == {
        "model": "llama-tiny", "--fp8-emulate": True, "--fp8": "tensorwise", "--tp": 2,
        "--dp": 2, "--grad-bucket-mb": 0.01, "--zero": 3}
    # ... and a compressed reduction (its rounding, and ep's groups for the experts' gradients:
    # qwen3-moe-tiny dp 2 x ep 2, fp16 compression, tensorwise: 4.1e-3; seed 8007)
    compressed = {"model": "qwen3-moe-tiny", "--dp": 2, "--ep": 2, "--zero": 0,
                  "--grad-compression": "fp16", "--fp8": "tensorwise"}
    assert ref(compressed) == {"model": "qwen3-moe-tiny", "--fp8": "tensorwise", "--dp": 2,
                               "--grad-compression": "fp16", "--ep": 2}
    gpipe = {"model": "llama-tiny", "--pp": 2, "--schedule": "gpipe", "--fp8": "rowwise"}
    assert ref(gpipe) == gpipe
    assert ref({**gpipe, "--loss-chunk-tokens": 0}) == {"model": "llama-tiny", "--fp8": "rowwise",
                                                     "--loss-chunk-tokens": 0}
    # which ranks were slow is the machine's load, not a result to compare
    slow = [{"step": 1, "loss": 2.5, "straggler_suspects": [0]}]
    assert fuzz.compare([{"step": 1, "loss": 2.5}], slow)[0] == 0.0
