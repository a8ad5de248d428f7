"""The lent-GPU machine's scripts where there is no GPU: `benchmarks/vs/gpu_bench.py` and
`fp8_bench.py` refuse `--device cuda` in one line (they failed with a traceback deep in torch's
CUDA calls), and `tools/gpu_session.sh` / `tools/gpu_session_report.py` answer --help and bad
arguments without starting a session (a helper's finds)."""

import subprocess
from pathlib import Path

import pytest
import torch
from repo_script import load_script

ROOT = Path(__file__).resolve().parents[1]


def _script(relative: str):
    return load_script(relative)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: nothing to refuse")
@pytest.mark.parametrize("relative", ["benchmarks/vs/gpu_bench.py", "benchmarks/vs/fp8_bench.py"])
def test_a_gpu_benchmark_without_a_gpu_is_one_line(relative, capsys):
    with pytest.raises(SystemExit) as exited:
        _script(relative).main([])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and err[-1].endswith(  # the parser's prog: pytest's here
        ": error: --device cuda: no CUDA device visible (--device cpu --tiny rehearses this "
        "script on the CPU)"), err
    assert not any("Traceback" in line for line in err)


def test_gpu_session_answers_help_and_refuses_what_it_does_not_take(tmp_path):
    """`tools/gpu_session.sh --help` handed --help to mkdir and cd and went on into a real
    session; an OUT_DIR was made under the repository wherever it was run from."""
    script = str(ROOT / "tools" / "gpu_session.sh")
    shown = subprocess.run(["bash", script, "--help"], capture_output=True, text=True,
                           cwd=tmp_path, timeout=30)
    assert shown.returncode == 0 and shown.stdout.startswith("One GPU session, start to finish")
    for argv, said in ((["--bogus"], "gpu_session: unknown option --bogus"),
                       (["a", "b"], "gpu_session: one OUT_DIR, not 2: a b")):
        out = subprocess.run(["bash", script, *argv], capture_output=True, text=True,
                             cwd=tmp_path, timeout=30)
        assert out.returncode == 2 and out.stderr.startswith(said), out.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("argv", "said"), [
    ([], "needs 3 arguments, got 0"),
    (["/nonexistent", "0", "5"], "/nonexistent is not a directory"),
    (["WORK", "2", "5"], "REHEARSE '2' is not 0 or 1"),
    (["WORK", "0", "abc"], "SECONDS 'abc' is not a whole number"),
])
def test_the_session_report_refuses_bad_arguments_in_one_line(tmp_path, argv, said):
    argv = [str(tmp_path) if a == "WORK" else a for a in argv]
    out = subprocess.run(["python3", str(ROOT / "tools" / "gpu_session_report.py"), *argv],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith(
        f"gpu_session_report.py: error: {said}; usage: "), out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("rehearse", ["0", "1"])
def test_a_rehearsals_report_says_its_speeds_test_the_script(tmp_path, rehearse):
    """A rehearsal's report put "tensorwise: 2,861 tokens/s (16.757 x bf16)" from one round of
    two steps of a tiny model on a shared CPU under its FP8 heading as a session's would be;
    each timed part of a rehearsal's report now says what its figures are. A GPU session's
    report says nothing of the kind."""
    (tmp_path / "fp8.log").write_text("fp8_bench on cpu\ntensorwise: 2,861 tokens/s "
                                      "(16.757 x bf16)\n")
    out = subprocess.run(["python3", str(ROOT / "tools" / "gpu_session_report.py"),
                          str(tmp_path), rehearse, "5"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report.md").read_text()
    fp8 = report.split("## FP8 against bf16")[1].split("```")[0]
    said = "the speeds and ratios below test the script, not megapar"
    assert (said in fp8) == (rehearse == "1"), report
    assert report.count(said) == (1 if rehearse == "1" else 0), report  # the parts run only
    for skipped in ("skipped: torchao is not installed (no wheels/torchao-*.whl)",
                    "fp8: skipped, 12 s of the budget left"):  # gpu_session.sh's two skips
        (tmp_path / "fp8.log").write_text(skipped + "\n")
        subprocess.run(["python3", str(ROOT / "tools" / "gpu_session_report.py"), str(tmp_path),
                        rehearse, "5"], check=True, timeout=60)
        assert said not in (tmp_path / "report.md").read_text()
