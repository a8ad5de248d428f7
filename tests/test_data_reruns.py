"""A run to a destination that an earlier run wrote (or left behind): megapar-data's output
prefix, megapar-train's data cache and --log-json, the temporaries of a killed writer, and a
checkpoint resumed on data that changed since."""

import json
from pathlib import Path

import pytest

from megapar.cli.data import main as data
from megapar.cli.train import main as train
from megapar.data import asset_path
from megapar.data.preprocess import ensure_dataset

TEXT = Path(asset_path("shakespeare_sample.txt")).read_text()
TINY = ["--model", "gpt2-tiny", "--tokenizer", "sentencepiece", "--seq-len", "32",
        "--micro-batch-size", "2", "--log-interval", "1", "--eval-interval", "0",
        "--no-progress", "--warmup-steps", "0"]
"""A tiny run; its global batch, not given, shrinks to what the data holds."""


def _one_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith(f"{prog}: error: "), err
    return lines[-1]


def _outputs(prefix) -> dict[str, bytes]:
    return {ext: Path(f"{prefix}{ext}").read_bytes() for ext in (".bin", ".idx", ".json")}


# --- megapar-data: an existing output prefix ----------------------------------------------------
def test_megapar_data_refuses_an_existing_prefix_unless_overwrite(tmp_path, capsys):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(TEXT[:3000])
    second.write_text(TEXT[3000:9000])
    prefix = tmp_path / "out" / "d"
    common = ["--output-prefix", str(prefix), "--tokenizer", "sentencepiece", "--no-progress"]
    assert data(["--input", str(first), *common]) == 0
    before = _outputs(prefix)
    capsys.readouterr()
    assert data(["--input", str(second), *common]) == 2
    line = _one_line(capsys, "megapar-data")
    assert f"{prefix}.bin" in line and "pass --overwrite" in line, line
    assert _outputs(prefix) == before  # untouched
    assert data(["--input", str(second), *common, "--overwrite"]) == 0
    after = _outputs(prefix)
    assert after[".bin"] != before[".bin"] and len(after[".bin"]) > len(before[".bin"])


def test_a_prefix_another_run_finished_meanwhile_is_not_replaced_without_overwrite(
        tmp_path, capsys, monkeypatch):
    """Two megapar-data runs to one prefix, the second started before the first finished:
    both passed the start-up check and both said 'wrote', the later rename winning silently."""
    from megapar.data.indexed import IndexedDatasetBuilder

    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(TEXT[:3000])
    second.write_text(TEXT[3000:9000])
    prefix = tmp_path / "out" / "d"
    common = ["--output-prefix", str(prefix), "--tokenizer", "sentencepiece", "--no-progress"]
    real = IndexedDatasetBuilder.finalize
    other = {}

    def the_other_run_finishes_first(self):
        monkeypatch.setattr(IndexedDatasetBuilder, "finalize", real)
        assert data(["--input", str(first), *common]) == 0
        other.update(_outputs(prefix))
        return real(self)

    monkeypatch.setattr(IndexedDatasetBuilder, "finalize", the_other_run_finishes_first)
    assert data(["--input", str(second), *common]) == 2
    line = _one_line(capsys, "megapar-data")
    assert "d.bin, " in line and "appeared while this run tokenized (another run wrote them); " \
        "this run's dataset is discarded: pass --overwrite" in line, line
    assert _outputs(prefix) == other
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["d.bin", "d.idx", "d.json"]


def test_megapar_data_refuses_an_existing_trained_tokenizer(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(TEXT[:3000])
    prefix = tmp_path / "bpe"
    (tmp_path / "bpe-tokenizer").mkdir()  # an earlier --train-tokenizer bpe's
    assert data(["--input", str(tmp_path / "a.txt"), "--output-prefix", str(prefix),
                 "--train-tokenizer", "bpe", "--vocab-size", "300", "--no-progress"]) == 2
    line = _one_line(capsys, "megapar-data")
    assert "bpe-tokenizer" in line and "pass --overwrite" in line, line
    assert not list(tmp_path.glob("bpe.*"))


def test_a_refused_run_leaves_no_tokenizer_it_trained(tmp_path, capsys):
    """Whitespace trains a byte-level BPE, then gives no document to write: refused, and the
    tokenizer trained for it goes too (a rerun would otherwise be refused as overwriting)."""
    (tmp_path / "blank.txt").write_text("   \n\n  \n")
    assert data(["--input", str(tmp_path / "blank.txt"), "--output-prefix",
                 str(tmp_path / "out" / "d"), "--train-tokenizer", "bpe", "--vocab-size", "300",
                 "--no-progress"]) == 2
    assert "no text in" in _one_line(capsys, "megapar-data")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("failure", [ValueError("a bad document"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])
def test_a_run_that_fails_after_training_sentencepiece_leaves_nothing(tmp_path, monkeypatch,
                                                                      capsys, failure):
    from megapar.data import preprocess

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(preprocess, "preprocess_files", fail)
    (tmp_path / "a.txt").write_text(TEXT[:3000])
    args = ["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "out" / "d"),
            "--train-sentencepiece", "--vocab-size", "100", "--no-progress"]
    if isinstance(failure, KeyboardInterrupt):  # Ctrl-C: one line, exit 130
        assert data(args) == 130
        assert "megapar-data: interrupted; nothing was written" in capsys.readouterr().err
    else:
        assert data(args) == 2
        assert "a bad document" in _one_line(capsys, "megapar-data")
    assert not list(tmp_path.glob("out/*"))


def test_a_sigterm_after_training_a_tokenizer_leaves_nothing_and_says_so(tmp_path, monkeypatch):
    """SIGTERM (timeout, a scheduler) killed megapar-data where it stood: the tokenizer it had
    trained stayed (a rerun was then refused as overwriting it), a half-written PREFIX.bin.tmp
    too, and nothing was said. Now as Ctrl-C: cleaned up, one line, exit 143. In a forked
    child, so that before the fix the signal kills the child, not the test."""
    import os
    import signal
    import time

    from megapar.data import preprocess

    def stopped(*args, **kwargs):  # the signal comes while tokenizing
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(preprocess, "preprocess_files", stopped)
    (tmp_path / "a.txt").write_text(TEXT[:3000])
    err = tmp_path / "err.txt"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        import sys

        code = 1
        try:
            sys.stderr = open(err, "w")  # noqa: SIM115 - flushed below
            code = data(["--input", str(tmp_path / "a.txt"), "--output-prefix",
                         str(tmp_path / "out" / "d"), "--train-tokenizer", "bpe",
                         "--vocab-size", "300", "--no-progress"])
        finally:
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 143, status
    assert err.read_text().strip().splitlines()[-1].startswith(
        "megapar-data: terminated (SIGTERM); nothing was written")
    assert not list(tmp_path.glob("out/*"))  # no d-tokenizer/


def _documents_then(event, after: int = 48):
    """Documents as iter_documents yields them: `after` of about 60 kB (a second's work a
    batch), then `event()`, then one every 0.1 s for 3 s (a run that outlives `event`
    failed to stop)."""
    import time

    for i in range(after):
        yield f"document {i}: {TEXT[:60_000]}", 60_000
    event()
    for i in range(30):
        time.sleep(0.1)
        yield f"later document {i}", 20


def test_a_tokenizer_worker_killed_is_one_line_not_a_hang(tmp_path, monkeypatch, capsys):
    """A pool worker killed mid-run (the OOM killer): multiprocessing.Pool starts another but
    never runs the dead one's batch again (CPython issue 22393), and a run waits for that batch
    forever. Now a worker's death ends the run at once with one line, and nothing is written."""
    import multiprocessing as mp
    import os
    import signal
    import time

    from megapar.data import preprocess

    def kill_a_worker():
        time.sleep(2)  # the workers started, each on a batch
        workers = [p for p in mp.active_children() if p.name.startswith("Spawn")]
        assert workers, mp.active_children()
        os.kill(workers[-1].pid, signal.SIGKILL)

    monkeypatch.setattr(preprocess, "iter_documents",
                        lambda *args, **kwargs: _documents_then(kill_a_worker))
    (tmp_path / "a.txt").write_text("unread: iter_documents is replaced")
    assert data(["--input", str(tmp_path / "a.txt"), "--output-prefix",
                 str(tmp_path / "out" / "d"), "--workers", "2", "--no-progress"]) == 2
    line = _one_line(capsys, "megapar-data")
    assert "a tokenizer worker process ended abruptly" in line and "nothing written" in line
    assert not list(tmp_path.glob("out/*"))


def test_a_ctrl_c_ends_the_tokenizer_workers_without_waiting_for_their_batches(
        tmp_path, monkeypatch, capsys):
    """Ctrl-C (the workers ignore it: the parent's to handle) waited for every batch under way
    before the one line, 4-6 s on a 10 MB input where SIGTERM took under 1 s. The workers are
    now ended at once (SIGTERM), their batches dropped."""
    import multiprocessing as mp
    import signal
    import time

    from megapar.data import preprocess

    workers = []

    def interrupt():
        time.sleep(2)  # the workers started, each on a batch
        workers.extend(p for p in mp.active_children() if p.name.startswith("Spawn"))
        raise KeyboardInterrupt

    monkeypatch.setattr(preprocess, "iter_documents",
                        lambda *args, **kwargs: _documents_then(interrupt))
    (tmp_path / "a.txt").write_text("unread: iter_documents is replaced")
    assert data(["--input", str(tmp_path / "a.txt"), "--output-prefix",
                 str(tmp_path / "out" / "d"), "--workers", "2", "--no-progress"]) == 130
    assert "megapar-data: interrupted; nothing was written" in capsys.readouterr().err
    assert len(workers) == 2 and all(w.exitcode == -signal.SIGTERM for w in workers), [
        w.exitcode for w in workers]  # ended, not left to finish and exit 0
    assert not list(tmp_path.glob("out/*"))


_GROUP_SIGTERM = """
import sys
from pathlib import Path
from megapar.data import preprocess
from megapar.cli.data import main

def documents(*args, **kwargs):
    for i in range(48):
        yield f"document {i} " * 40, 500
    Path(sys.argv[1]).write_text("tokenizing")
    end = __import__("time").monotonic() + 60
    while __import__("time").monotonic() < end:  # the workers busy until the signal
        yield f"later document {i} " * 40, 500

preprocess.iter_documents = documents
sys.exit(main(["--input", sys.argv[2], "--output-prefix", sys.argv[3], "--workers", "2",
               "--no-progress"]))
"""


def test_a_sigterm_to_the_process_group_ends_the_pool_and_the_run(tmp_path):
    """`timeout -s TERM` (a scheduler) signals megapar-data's whole process group, its pool's
    workers too. A worker that died holding the task queue's read lock could leave
    Pool.terminate() waiting for that lock forever (seen here about one try in three on a
    21.6 MB text). Now: exit 143 within seconds, one line, nothing written."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "a.txt").write_text("unread: iter_documents is replaced")
    started, out = tmp_path / "started", tmp_path / "out" / "d"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", _GROUP_SIGTERM, str(started),
                             str(tmp_path / "a.txt"), str(out)], start_new_session=True,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), proc.stderr.read() if proc.poll() is not None else "no start"
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1].startswith(
        "megapar-data: terminated (SIGTERM); nothing was written"), err
    assert not list(tmp_path.glob("out/*"))


def _children_of(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is `pid`, from /proc."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def test_the_tokenizer_workers_die_with_a_parent_killed_with_minus_9(tmp_path):
    """kill -9 of megapar-data left its workers idle for good (about 250 MB each), re-parented
    to init: the task queue they wait on never closes. They now die with it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "a.txt").write_text("unread: iter_documents is replaced")
    started = tmp_path / "started"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", _GROUP_SIGTERM, str(started),
                             str(tmp_path / "a.txt"), str(tmp_path / "out" / "d")],
                            start_new_session=True, stderr=subprocess.DEVNULL, env=env)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), "the run did not start"
        # both workers, waited for: on a loaded machine the second may not have exec'd its
        # spawn_main yet when the first batch is dispatched (a clean-clone run saw one)
        deadline = time.monotonic() + 30
        while True:
            workers = [c for c in _children_of(proc.pid)
                       if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
            if len(workers) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(workers) == 2, workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{w}").exists() for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [w for w in workers if Path(f"/proc/{w}").exists()
                 and Path(f"/proc/{w}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        assert not alive, f"workers {alive} outlived their parent"
    finally:
        for pid in [proc.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


# --- megapar-train: the cache of a text refused as too small ------------------------------------
def test_a_text_too_small_to_train_on_leaves_no_cache(tmp_path, capsys):
    tiny, cache = tmp_path / "tiny.txt", tmp_path / "cache"
    tiny.write_text("Too little text to train on.\n")
    assert train(["--data", str(tiny), "--data-cache", str(cache), *TINY]) == 2
    line = _one_line(capsys, "megapar-train")
    assert "fewer than one window" in line, line
    assert not list(cache.glob("tiny-*")), list(cache.iterdir())


def test_a_cache_made_earlier_is_kept_when_a_run_is_refused(tmp_path, capsys):
    tiny, cache = tmp_path / "tiny.txt", tmp_path / "cache"
    tiny.write_text("Too little text to train on.\n")
    prefix = ensure_dataset(str(tiny), "sentencepiece", str(cache))  # an earlier run's
    before = _outputs(prefix)
    assert train(["--data", str(tiny), "--data-cache", str(cache), *TINY]) == 2
    assert "fewer than one window" in _one_line(capsys, "megapar-train")
    assert _outputs(prefix) == before


# --- --log-json: a fresh run starts the file, a resumed one continues it -----------------------
def _steps(log: Path) -> list[int]:
    return [json.loads(line)["step"] for line in log.read_text().splitlines()]


def test_log_json_is_restarted_by_a_fresh_run_and_continued_by_a_resume(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT[:40_000])
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    common = ["--data", str(text), "--data-cache", str(tmp_path / "cache"), *TINY,
              "--log-json", str(log)]
    log.write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")  # an earlier run's
    assert train([*common, "--max-steps", "3", "--save", str(ckpt), "--save-interval", "2"]) == 0
    assert _steps(log) == [1, 2, 3]  # the earlier run's line is gone
    assert all(json.loads(x)["loss"] != 9.0 for x in log.read_text().splitlines())
    # resumed from step 2: step 3 of the first run is trained again, so logged once
    assert train([*common, "--max-steps", "4", "--load", str(ckpt / "step_00000002")]) == 0
    assert _steps(log) == [1, 2, 3, 4]
    assert train([*common, "--max-steps", "1"]) == 0  # fresh again
    assert _steps(log) == [1]


def test_a_resume_drops_the_records_it_trains_again_and_a_torn_last_line(tmp_path):
    from megapar.training.logging import keep_records_up_to

    log = tmp_path / "log.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)]
    log.write_text("".join(lines) + "not json, kept\n" + '{"step": 5, "lo')
    keep_records_up_to(str(log), 2)
    assert log.read_text() == "".join(lines[:2]) + "not json, kept\n"
    keep_records_up_to(str(tmp_path / "missing.jsonl"), 2)
    assert not (tmp_path / "missing.jsonl").exists()


# --- the temporaries of a writer killed with -9 -------------------------------------------------
def _dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _host() -> str:
    import re
    import socket

    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())


def test_megapar_data_killed_with_9_leaves_a_temporary_that_the_next_run_removes(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    big = tmp_path / "big.txt"
    big.write_text(TEXT * max(1, (4 << 20) // len(TEXT)))  # about 4 MB: seconds of tokenizing
    prefix = tmp_path / "out" / "d"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "megapar.cli.data", "--input", str(big),
                             "--output-prefix", str(prefix), "--workers", "1", "--no-progress"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("out/d.bin.tmp-*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "megapar-data never started writing"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = list(tmp_path.glob("out/d.bin.tmp-*"))
    assert left, "killed before writing: nothing to clean"
    (tmp_path / "small.txt").write_text(TEXT[:3000])
    assert data(["--input", str(tmp_path / "small.txt"), "--output-prefix", str(prefix),
                 "--no-progress"]) == 0
    assert not list(tmp_path.glob("out/*.tmp-*")), list((tmp_path / "out").iterdir())


def test_only_the_temporaries_of_dead_writers_of_this_host_are_removed(tmp_path):
    """A live writer's temporary (another run writing the same prefix now) and another host's
    (a shared file system) are kept; the cache megapar-train tokenizes into is cleaned too."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT[:3000])
    prefix = ensure_dataset(str(text), "sentencepiece", str(tmp_path / "cache"))
    for ext in (".bin", ".idx", ".json"):
        Path(prefix + ext).unlink()
    import os

    dead = [f"{prefix}{ext}.tmp-{_dead_pid()}-{_host()}-0123abcd" for ext in (".bin", ".json")]
    kept = [f"{prefix}.bin.tmp-{os.getpid()}-{_host()}-0123abcd",  # this live process's
            f"{prefix}.bin.tmp-{_dead_pid()}-another-host-0123abcd"]
    for path in dead + kept:
        Path(path).write_bytes(b"partial")
    assert ensure_dataset(str(text), "sentencepiece", str(tmp_path / "cache")) == prefix
    assert not any(Path(p).exists() for p in dead)
    assert all(Path(p).exists() for p in kept)


def test_megapar_convert_removes_the_staging_directory_of_a_dead_conversion(tmp_path):
    import os

    from megapar.cli.convert import main as convert

    text = tmp_path / "t.txt"
    text.write_text(TEXT[:20_000])
    ckpt, dst = tmp_path / "ckpt", tmp_path / "converted"
    assert train(["--data", str(text), "--data-cache", str(tmp_path / "cache"), *TINY,
                  "--max-steps", "1", "--save", str(ckpt)]) == 0
    dead = tmp_path / f".converted.tmp-{_dead_pid()}-{_host()}-0123456789ab"
    live = tmp_path / f".converted.tmp-{os.getpid()}-{_host()}-0123456789ab"
    for staging in (dead, live):
        (staging / "step_00000001").mkdir(parents=True)
        (staging / "step_00000001" / "model_tp00_pp00.safetensors").write_bytes(b"x" * 1000)
    assert convert([str(ckpt), str(dst), "--tp", "1", "--pp", "1", "--no-progress"]) == 0
    assert not dead.exists() and live.exists()
    assert [p.name for p in tmp_path.glob(".converted.tmp-*")] == [live.name]


# --- a resume on data whose tokens changed in place ----------------------------------------------
def _in_both_formats(tmp_path):
    """(text, megapar prefix, Megatron prefix): the same 20,000 characters tokenized into
    each index format."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT[:20_000])
    prefix, megatron = str(tmp_path / "d"), str(tmp_path / "mt")
    for out, fmt in ((prefix, "megapar"), (megatron, "megatron")):
        assert data(["--input", str(text), "--output-prefix", out, "--tokenizer",
                     "sentencepiece", "--split-lines", "--format", fmt, "--no-progress"]) == 0
    return text, prefix, megatron


def test_a_resume_on_data_changed_in_place_is_refused_unless_allowed(tmp_path, capsys):
    import numpy as np

    from megapar.checkpoint.manifest import read_manifest

    text, prefix, megatron = _in_both_formats(tmp_path)
    ckpt = tmp_path / "ckpt"
    common = [*TINY, "--save", str(ckpt), "--global-batch-size", "4"]
    assert train(["--data", prefix, *common, "--max-steps", "2"]) == 0
    recorded = read_manifest(ckpt / "step_00000002")["meta"]["data_fingerprint"]
    assert isinstance(recorded, list) and len(recorded) == 1
    # the same tokens resume, whatever the index format or the copy
    assert train(["--data", prefix, *common, "--load", str(ckpt), "--max-steps", "3"]) == 0
    assert train(["--data", megatron, *common, "--load", str(ckpt), "--max-steps", "4"]) == 0
    # the same size, other tokens: refused in one line naming the data and the flag
    tokens = np.fromfile(prefix + ".bin", dtype="<u2")
    tokens[10:40] = tokens[10:40][::-1].copy()
    tokens.tofile(prefix + ".bin")
    capsys.readouterr()
    assert train(["--data", prefix, *common, "--load", str(ckpt), "--max-steps", "5"]) == 2
    line = _one_line(capsys, "megapar-train")
    assert f"--data {prefix}" in line and "changed" in line and "--allow-data-change" in line, line
    assert train(["--data", prefix, *common, "--load", str(ckpt), "--max-steps", "5",
                  "--allow-data-change"]) == 0
    assert read_manifest(ckpt / "step_00000005")["meta"]["data_fingerprint"] != recorded
    # other data of another size: refused naming the flag; with it, the order starts anew
    other = str(tmp_path / "other")
    text.write_text(TEXT[20_000:50_000])
    assert data(["--input", str(text), "--output-prefix", other, "--tokenizer", "sentencepiece",
                 "--split-lines", "--no-progress"]) == 0
    capsys.readouterr()
    assert train(["--data", other, *common, "--load", str(ckpt), "--max-steps", "6"]) == 2
    line = _one_line(capsys, "megapar-train")
    assert "dataset_len" in line and "--allow-data-change" in line, line
    assert train(["--data", other, *common, "--load", str(ckpt), "--max-steps", "6",
                  "--allow-data-change"]) == 0
    assert "--allow-data-change: the data order starts anew" in capsys.readouterr().out
    assert read_manifest(ckpt / "step_00000006")["meta"]["sampler"]["consumed_samples"] == 4


def test_the_fingerprint_of_a_large_dataset_reads_samples_of_it(tmp_path, monkeypatch):
    import numpy as np

    from megapar.data import IndexedDataset

    text, prefix, megatron = _in_both_formats(tmp_path)
    monkeypatch.setattr(IndexedDataset, "FINGERPRINT_WHOLE", 64)  # "large": sampled
    monkeypatch.setattr(IndexedDataset, "FINGERPRINT_BLOCKS", 4)
    monkeypatch.setattr(IndexedDataset, "FINGERPRINT_BLOCK", 8)
    before = IndexedDataset(prefix).fingerprint()
    assert IndexedDataset(megatron, "sentencepiece").fingerprint() == before
    tokens = np.fromfile(prefix + ".bin", dtype="<u2")
    n = len(tokens)
    first = tokens.copy()
    first[3] = (first[3] + 1) % 1000  # in the first sampled block
    first.tofile(prefix + ".bin")
    assert IndexedDataset(prefix).fingerprint() != before
    between = tokens.copy()
    between[n // 6] = (between[n // 6] + 1) % 1000  # between the blocks: not read
    between.tofile(prefix + ".bin")
    assert IndexedDataset(prefix).fingerprint() == before


# --- a prepared dataset's tokenizer -------------------------------------------------------------
def test_a_tokenizer_other_than_the_datasets_own_is_refused(tmp_path, capsys):
    """A prepared dataset trains with the tokenizer it was made with: another --tokenizer is
    refused (it was silently ignored), the same files elsewhere are accepted, and a recorded
    tokenizer that no longer loads is named as the dataset's."""
    import shutil

    from megapar.data import load_tokenizer
    from megapar.training.config import TrainConfig
    from megapar.training.data import data_tokenizer

    text = tmp_path / "t.txt"
    text.write_text(TEXT[:5_000])
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(asset_path(f"gpt2_{name}"), bpe / name)
    prefix = str(tmp_path / "d")
    assert data(["--input", str(text), "--output-prefix", prefix, "--tokenizer", str(bpe),
                 "--no-progress"]) == 0

    def given(tokenizer):
        cfg = TrainConfig(data=prefix, tokenizer=tokenizer)
        cfg.explicit = frozenset({"data", "tokenizer"})
        return cfg

    assert data_tokenizer(given("gpt2"))[1].path == str(bpe)  # the same files elsewhere
    with pytest.raises(ValueError, match=r"--tokenizer sentencepiece is not the tokenizer "
                                         r"--data .* was made with .*leave --tokenizer out"):
        data_tokenizer(given("sentencepiece"))
    capsys.readouterr()
    assert train(["--data", prefix, "--tokenizer", "sentencepiece", "--model", "gpt2-tiny"]) == 2
    assert "is not the tokenizer" in _one_line(capsys, "megapar-train")
    alone = TrainConfig(data=prefix)
    alone.explicit = frozenset({"data"})
    (bpe / "merges.txt").write_text("")  # the recorded tokenizer damaged after the fact
    with pytest.raises(ValueError, match=r"--data .* was made with the tokenizer at .*bpe, "
                                         r"which does not load now: .*merges.txt is cut short"):
        data_tokenizer(alone)
    shutil.move(bpe, tmp_path / "moved")  # gone from where the dataset records it
    with pytest.raises(ValueError) as gone:
        data_tokenizer(alone)
    assert str(gone.value) == (
        f"--data {prefix} was made with the tokenizer at {bpe}, which is not there now (moved "
        f"or deleted?); give a copy of its files as --tokenizer DIR (the same files: their "
        f"sha256 is the dataset's), put them back there, or tokenize the text again with "
        f"megapar-data --tokenizer where they are now (a prepared dataset keeps the tokenizer it "
        f"was made with; another --tokenizer does not replace it)"), gone.value
    # (not 'unknown tokenizer: use gpt2'). A copy of the files it was made with, given as
    # --tokenizer, is read in its place: a dataset rsynced with its tokenizer beside it (it
    # was refused whatever --tokenizer said; a re-test); a copy of other files is not
    with pytest.raises(ValueError, match=r"which is not there now \(moved or deleted\?\); "
                                         r"--tokenizer .*moved is no copy of it \(its files' "
                                         r"sha256 are not the ones the dataset records\); give"):
        data_tokenizer(given(str(tmp_path / "moved")))  # the damaged files, moved
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(asset_path(f"gpt2_{name}"), copy / name)
    assert data_tokenizer(given(str(copy)))[1].path == str(copy)
    assert load_tokenizer(str(bpe)).path == str(copy)  # for the rest of the run (its workers)



def _bpe(directory: Path, vocab_size: int, text: str = TEXT[:20_000]) -> str:
    """A byte-level BPE of `vocab_size` trained on `text` (by default the sample's start), saved
    as vocab.json + merges.txt in `directory` (replacing what is there)."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text], vocab_size=vocab_size, show_progress=False)
    directory.mkdir(exist_ok=True)
    tok.save_model(str(directory))
    return str(directory)


def test_a_dataset_whose_tokenizer_files_changed_since_is_refused(tmp_path, capsys):
    """A prepared dataset records its tokenizer files' sha256: replaced at the recorded path by
    another tokenizer, a run (alone or in a blend) refuses it in one line naming the dataset,
    the path and the fix (it trained with the new one); unchanged, it is accepted; a dataset
    made before the sha256 were recorded is not checked."""
    from megapar.training.config import TrainConfig
    from types import SimpleNamespace

    from megapar.training.data import data_tokenizer, resolve_data_prefix
    from megapar.training.usage import UsageError
    from megapar.training.validate_tools import _check_data as check_eval_data

    text = tmp_path / "t.txt"
    text.write_text(TEXT[:5_000])
    bpe = _bpe(tmp_path / "bpe", 400)
    prefix = str(tmp_path / "d")
    assert data(["--input", str(text), "--output-prefix", prefix, "--tokenizer", bpe,
                 "--no-progress"]) == 0
    recorded = json.loads(Path(prefix + ".json").read_text())["tokenizer"]
    assert len(recorded["sha256"]) == 2  # vocab.json, merges.txt
    cfg = TrainConfig(data=prefix)
    assert resolve_data_prefix(cfg) == prefix  # unchanged: accepted
    assert data_tokenizer(cfg)[1].path == bpe
    assert train(["--data", prefix, *TINY[:2], "--seq-len", "32", "--micro-batch-size", "2",
                  "--max-steps", "1", "--no-progress"]) == 0
    made_with = {n: (tmp_path / "bpe" / n).read_bytes() for n in ("vocab.json", "merges.txt")}

    _bpe(tmp_path / "bpe", 300)  # another tokenizer where the dataset's was
    for run in (resolve_data_prefix, data_tokenizer):
        with pytest.raises(ValueError) as changed:
            run(cfg)
        message = str(changed.value)
        assert message.startswith(
            f"--data {prefix} was made with the tokenizer at {bpe}, whose files changed since "
            f"the dataset was made (sha256 "), message
        assert message.endswith(
            f"its token ids would be other tokens; restore the tokenizer the dataset was made "
            f"with at {bpe} (or give a copy of its files as --tokenizer DIR), or tokenize the "
            f"text again with megapar-data --tokenizer {bpe}")
    evaluated = SimpleNamespace(data=prefix, tokenizer=None, load=str(tmp_path / "ck"))
    with pytest.raises(UsageError, match=r"whose files changed since the dataset was made"):
        check_eval_data(evaluated, {}, True, 400)  # megapar-eval's check of its --data
    blend = TrainConfig(data=f"1 {prefix} 1 {prefix}")
    with pytest.raises(ValueError, match=r"whose files changed since the dataset was made"):
        resolve_data_prefix(blend)
    capsys.readouterr()
    assert train(["--data", prefix, *TINY[:2], "--max-steps", "1"]) == 2
    line = _one_line(capsys, "megapar-train")
    assert f"--data {prefix} was made with the tokenizer at {bpe}, whose files changed" in line
    for name, content in made_with.items():  # the tokenizer it was made with, restored
        (tmp_path / "bpe" / name).write_bytes(content)
    assert data_tokenizer(cfg)[1].vocab_size == recorded["vocab_size"]

    del recorded["sha256"]  # a dataset made before the sha256 were recorded: not checked
    meta = json.loads(Path(prefix + ".json").read_text())
    Path(prefix + ".json").write_text(json.dumps({**meta, "tokenizer": recorded}))
    assert resolve_data_prefix(cfg) == prefix


def test_a_disk_that_fills_while_the_index_is_written_leaves_nothing(tmp_path, monkeypatch,
                                                                     capsys):
    """The disk full at the index's metadata (the .bin had fitted): a 25-line OSError traceback,
    and the index's temporary (PREFIX.idx.tmp-*) was left, as the builder's abort removed the
    .bin's alone. Now one line, and no temporary."""
    import errno
    import os

    from megapar.data import indexed

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(indexed.json, "dump", full)
    (tmp_path / "a.txt").write_text(TEXT[:3000])
    assert data(["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "out" / "d"),
                 "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "megapar-data: error: No space left on device while writing "), err
    assert not list(tmp_path.glob("out/*"))  # no .bin, .idx or .json temporary


def test_a_moved_sentencepiece_models_copy_is_asked_for_as_its_file(tmp_path):
    """A dataset of a SentencePiece model that moved was told 'give a copy of its files as
    --tokenizer DIR', and a directory holding the copy is refused (the model file is what
    --tokenizer takes; a re-test): the line asks for the file, and the file is taken."""
    import shutil

    from megapar.cli.data import main as data
    from megapar.data.assets import asset_path
    from megapar.training.config import TrainConfig
    from megapar.training.data import data_tokenizer

    text = tmp_path / "t.txt"
    text.write_text("Some words of a corpus, a sentence or two of it.\n" * 40)
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(asset_path("botchan_en_unigram_1000.model"), tok / "sp.model")
    prefix = str(tmp_path / "d")
    assert data(["--input", str(text), "--output-prefix", prefix, "--tokenizer",
                 str(tok / "sp.model"), "--no-progress"]) == 0
    shutil.move(tok, tmp_path / "moved")
    alone = TrainConfig(data=prefix)
    alone.explicit = frozenset({"data"})
    with pytest.raises(ValueError, match=r"which is not there now \(moved or deleted\?\); give "
                                         r"a copy of its file as --tokenizer FILE\.model \(the "
                                         r"same files"):
        data_tokenizer(alone)
    folder = TrainConfig(data=prefix, tokenizer=str(tmp_path / "moved"))  # the file's folder
    folder.explicit = frozenset({"data", "tokenizer"})
    with pytest.raises(ValueError, match=r"--tokenizer .*moved is a directory holding its copy: "
                                         r"give the file, --tokenizer .*moved/sp\.model$"):
        data_tokenizer(folder)  # (it said the folder was no copy of it; a re-test)
    # megapar-eval's --data says the same (it said "tokenizer '.../tok/sp.model': no such
    # file", a path never typed, with --tokenizer given or not; a re-test)
    from types import SimpleNamespace

    from megapar.data import IndexedDataset
    from megapar.training.eval_text import data_tokenizer as eval_tokenizer

    for given, said in [(None, r"give a copy of its file as --tokenizer FILE\.model"),
                        (str(tmp_path / "moved"), r"is a directory holding its copy: give the "
                                                  r"file, --tokenizer .*moved/sp\.model$")]:
        with pytest.raises(ValueError, match=r"^--data .*d was made with the tokenizer at .*tok/"
                                             r"sp\.model, which is not there now .*" + said):
            eval_tokenizer(SimpleNamespace(data=prefix, tokenizer=given),
                           IndexedDataset(prefix, given))
    copy = TrainConfig(data=prefix, tokenizer=str(tmp_path / "moved" / "sp.model"))
    copy.explicit = frozenset({"data", "tokenizer"})
    assert data_tokenizer(copy)[1].path == str(tmp_path / "moved" / "sp.model")


def test_a_blend_of_moved_datasets_of_two_tokenizers_is_refused(tmp_path):
    """Two datasets of two tokenizers of one vocabulary size, moved with copies of their
    tokenizers, the originals deleted: --tokenizer naming the first's copy trained the blend on
    the second's ids too, compared by vocabulary size alone (a re-test; the other order was
    refused). The files each part recorded (sha256) are compared where one no longer loads."""
    import shutil

    from megapar.training.config import TrainConfig
    from megapar.training.data import resolve_data_prefix

    prefixes, copies = [], []
    for name, text in (("a", TEXT[:20_000]), ("b", TEXT[-20_000:])):
        tok = Path(_bpe(tmp_path / f"{name}-tok", 600, text))
        (tmp_path / f"{name}.txt").write_text(text)
        prefix = str(tmp_path / name)
        assert data(["--input", str(tmp_path / f"{name}.txt"), "--output-prefix", prefix,
                     "--tokenizer", str(tok), "--no-progress"]) == 0
        copies.append(shutil.copytree(tok, tmp_path / f"{name}-copy"))
        shutil.rmtree(tok)
        prefixes.append(prefix)
    for first, copy in ((0, copies[0]), (1, copies[1])):
        cfg = TrainConfig(data=["0.5", prefixes[first], "0.5", prefixes[1 - first]],
                          tokenizer=str(copy))
        cfg.explicit = frozenset({"data", "tokenizer"})
        with pytest.raises(ValueError, match=r"were made with different tokenizers"):
            resolve_data_prefix(cfg)
    same = TrainConfig(data=["0.5", prefixes[0], "0.5", prefixes[0]], tokenizer=str(copies[0]))
    same.explicit = frozenset({"data", "tokenizer"})
    assert resolve_data_prefix(same) == prefixes[0]  # one tokenizer's copy: taken
