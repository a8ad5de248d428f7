import os
import signal

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Real data beside the checkout (../shared/data: the Shakespeare corpus, the GPT-2 tokenizer's
# files), or where MEGAPAR_SHARED_DATA points. A user's clone has none: every test reaches it
# through `shared_data`, which skips with the reason, or uses the package's assets
# (tests/test_clone_alone.py holds the tests to that).
SHARED_DATA = os.environ.get("MEGAPAR_SHARED_DATA") or \
    os.path.join(os.path.dirname(ROOT), "shared", "data")


def shared_data(*parts: str) -> str:
    """The path of `parts` under the shared data; the calling test is skipped, naming the path
    and MEGAPAR_SHARED_DATA, when it is not there."""
    path = os.path.join(SHARED_DATA, *parts)
    if not os.path.exists(path):
        pytest.skip(f"{path} is not here (the shared data beside the checkout; set "
                    f"MEGAPAR_SHARED_DATA to a copy to run this test)")
    return path


def _write_megapar_bytecode() -> None:
    """Compile megapar's modules into their `__pycache__` (those out of date). Where
    PYTHONDONTWRITEBYTECODE is set (as on the development machines) Python reads bytecode but
    never writes it, so each process the suite starts that imports megapar (the commands the
    docs tests run, torchrun and spawned ranks, test_house's import of each module on its own,
    ranks forked before megapar's training modules were imported) would compile its source
    again."""
    import compileall

    # quiet=2: silent also where the checkout is not writable (imports then compile as before)
    compileall.compile_dir(os.path.join(ROOT, "megapar"), quiet=2)


_write_megapar_bytecode()
torch.set_num_threads(1)
# A suite started in the background by a shell without job control (`.ci/run &` in a script)
# inherits SIGINT ignored, as would every process it starts; megapar keeps an ignored SIGINT
# ignored (as Python does), so the tests of a terminal's Ctrl-C (test_faults, test_eval_cli,
# test_generate) would see none arrive. The suite takes Python's own handler back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# The suite runs on the CPU with gloo on any machine (many ranks on one device); the tests marked
# `cuda` (tests/test_cuda.py, tools/gpu_check.sh) run on the GPUs with NCCL instead.
os.environ.setdefault("MEGAPAR_CPU", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _refusals_without_the_lead(monkeypatch):
    """A process that does not print a start-up refusal under torchrun waits
    `REFUSAL_LEAD_S` (5 s) for the one that does (`worker_exit._after_the_printer`); tests
    that pose as such processes do not (`test_worker_exit_lead` checks the wait)."""
    monkeypatch.setattr("megapar.cli.worker_exit.REFUSAL_LEAD_S", 0.0)


@pytest.fixture
def run():
    """`run(fn, world_size, *args)`: fn on world_size forked gloo ranks, list of results."""
    from megapar.launcher import run_local

    return run_local


def transformers_converts(model_file: str) -> bool:
    """Whether the installed transformers turns a SentencePiece model into a fast tokenizer
    that encodes as the sentencepiece library does. transformers 5.17 (the lent GPU machines')
    does not for the botchan models (its first piece of "Hello world" differs), 5.24 does;
    megapar refuses to export a tokenizer that encodes differently, so the tests of such
    exports skip where it does not (`test_export_clients.py` checks the refusal there)."""
    import shutil
    import tempfile

    import sentencepiece
    from transformers import PreTrainedTokenizerFast

    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(model_file, os.path.join(d, "tokenizer.model"))
        hf = PreTrainedTokenizerFast.from_pretrained(d)
    texts = ("Hello world", "  two  spaces,\ta tab\nand a new line ")
    return all(hf(t, add_special_tokens=False)["input_ids"] == sp.encode(t) for t in texts)


def skip_unless_transformers_converts(spec: str = "sentencepiece") -> None:
    """Skip a test that exports the SentencePiece tokenizer `spec` (a .model file, or
    "sentencepiece": the shipped one) where transformers converts it differently."""
    import transformers

    from megapar.data import load_tokenizer

    path = load_tokenizer(spec).path
    if not transformers_converts(path):
        pytest.skip(f"transformers {transformers.__version__} converts {os.path.basename(path)} "
                    f"to a tokenizer that encodes differently, so megapar refuses to export it "
                    f"(test_a_sentencepiece_export_is_refused_where_transformers_converts_wrong)")


def gpu_count() -> int:
    """GPUs a `cuda` test can use (0 without CUDA). Asks torch without creating a CUDA context
    in this process, whose forked CPU workers must not inherit one."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


SLOW_FILES_FIRST = ("test_compile.py", "test_peak_memory.py", "test_process_peak.py")
"""Files holding the suite's slowest tests (30-55 s each in the clean-clone runs of 2026-12-01),
run first: pytest-xdist hands out the tests in collection order, so one of them started near the
end leaves the other worker idle until it finishes (simulated from a run's durations: 3 s of
the suite's wall time on average, 15 s in one run of 20 as collected; 1.5 s and 3 s with these
files first)."""


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` (`@pytest.mark.cuda(gpus=N)`) are skipped without N GPUs (unless
    MEGAPAR_CUDA_TIER_ON_CPU=1 rehearses them on gloo: see tests/test_cuda.py); the files of
    `SLOW_FILES_FIRST` run first, each file's tests together and in their order."""
    items.sort(key=lambda item: item.path.name not in SLOW_FILES_FIRST)  # stable
    have = 8 if os.environ.get("MEGAPAR_CUDA_TIER_ON_CPU") == "1" else None
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is None:
            continue
        have = gpu_count() if have is None else have
        need = marker.kwargs.get("gpus", 1)
        if have < need:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need} GPU(s) with CUDA, this machine has {have}; run "
                       f"tools/gpu_check.sh on a machine with GPUs"))
