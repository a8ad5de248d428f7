"""The lent-GPU machine's scripts where there is no GPU: `benchmarks/vs/gpu_bench.py` and
`fp8_bench.py` refuse `--device cuda` in one line (they failed with a traceback deep in torch's
CUDA calls), and `tools/gpu_session.sh` / `tools/gpu_session_report.py` answer --help and bad
arguments without starting a session (a helper's finds)."""

import importlib.util
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
