"""--async-save: a host copy written in the background, published only when complete.

The engine test runs 2 forked gloo ranks (tp 2) through `megapar.prepare(..., async_save=True)`:
the background checkpoint is byte for byte the synchronous one of the same step although
training changed the weights while it was written, a second save waits for the first, and a
write that fails on one rank raises on every rank at the same step. The CLI test kills a run
(kill -9) while its background write is held open and resumes from what is left.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from test_faults import _children, _fork_main, _wait_for, common  # noqa: F401 - a fixture

import megapar
import megapar.checkpoint.distributed as cd
from megapar.checkpoint.distributed import save_checkpoint
from megapar.checkpoint.format import CheckpointError
from megapar.checkpoint.manifest import read_manifest, verify
from megapar.cli.train import main
from megapar.launcher import WorkerError

VOCAB, SEQ, G = 64, 16, 8


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=None, eos_token_id=None))


def _batch(i):
    x = torch.randint(0, VOCAB, (G, SEQ), generator=torch.Generator().manual_seed(i))
    return {"input_ids": x, "labels": (x * 3 + 1) % VOCAB}


def _held(step: int, seconds: float):
    """`cd.write_tensors` that holds the write of a rank's shard file of `step` `seconds` long
    in its staging directory before it starts (a write to kill mid-way, a host copy that must
    not change meanwhile); put on in a rank (or before the ranks are forked)."""
    real = cd.write_tensors

    def write_tensors(path, tensors):
        path = Path(path)
        if path.parent.name.startswith(f".tmp-step_{step}-") and path.name != cd.RNG_FILE:
            time.sleep(seconds)
        return real(path, tensors)
    return write_tensors


def _async_then_sync(root):
    cd.write_tensors = _held(2, 1.0)  # step 2's writes are held open 1 s (this forked rank)
    root = Path(root)
    engine = megapar.prepare(_model(), tp=2, micro_batch_size=2, lr=1e-2, async_save=True)
    for i in range(2):
        engine.train_step(_batch(i))
    # the synchronous save of step 2, for comparison
    save_checkpoint(root / "sync", engine.step, engine.model, engine.mesh,
                    engine.optimizer.state_tensors(), {}, engine.rng_state())
    pending = engine.save(root / "bg")  # its write is held open 1 s (`_held`)
    early = (root / "bg" / "latest").exists()
    engine.train_step(_batch(2))  # changes every weight and moment while step 2 is written
    engine.save(root / "bg")  # step 3: waits for step 2's write first
    waited = (root / "bg" / "step_00000002" / "manifest.json").exists()
    published = engine.wait_save()
    # a write that fails on rank 1: every rank raises, at the same step
    real = cd.write_tensors
    if engine.mesh.rank == 1:
        cd.write_tensors = lambda path, tensors: (_ for _ in ()).throw(
            OSError(28, "No space left on device")) if "model_" in str(path) else \
            real(path, tensors)
    engine.train_step(_batch(3))
    engine.save(root / "bg")
    failed_at, message = None, ""
    for i in range(4, 40):
        try:
            engine.train_step(_batch(i))
        except CheckpointError as exc:
            failed_at, message = engine.step, str(exc)  # a full disk: no traceback said
            message += "" if getattr(exc, "no_traceback", False) else " [a traceback]"
            break
    return str(pending), early, waited, str(published), failed_at, message


def test_a_background_save_is_the_synchronous_one_and_fails_on_every_rank_together(run,
                                                                                    tmp_path):
    out = run(_async_then_sync, 2, str(tmp_path))
    bg, sync = tmp_path / "bg", tmp_path / "sync"
    for pending, early, waited, published, _, _ in out:
        assert pending == str(bg / "step_00000002")
        assert not early, "latest moved before the write was complete"
        assert waited, "a second save did not wait for the write in flight"
        assert published == str(bg / "step_00000003")
    # the host copy was taken at step 2: the files are those of a synchronous save of step 2
    ours, theirs = read_manifest(bg / "step_00000002"), read_manifest(sync)
    assert ours["files"] == theirs["files"] and ours["tensors"] == theirs["tensors"]
    assert ours["step"] == 2 and ours["meta"]["step"] == 2
    verify(bg / "step_00000002")
    # the failed write of step 4: raised on both ranks at the same step, naming rank 1
    assert out[0][4] == out[1][4] is not None, out
    for *_, message in out:
        assert (f"async checkpoint save at step 4 (to {bg / 'step_00000004'}) failed: "
                f"checkpoint of step 4 not saved: rank 1: No space left on device writing it in "
                f"{bg}; free space there, or give --save another directory") in message, message
        assert "[a traceback]" not in message, message
    assert (bg / "latest").read_text().strip() == "step_00000003"
    assert not [p.name for p in bg.iterdir() if p.name.startswith(".tmp-")]


def _rank_1_makes_no_writer():
    """Rank 0 prepares with --async-save, rank 1 without (as a rank that failed or hung before
    its writer's group would): rank 0's wait to create the group ends after its timeout."""
    import torch.distributed as dist

    rank = dist.get_rank()
    megapar.prepare(_model(), tp=2, micro_batch_size=2, lr=1e-2, async_save=rank == 0,
                    timeout_s=1)
    time.sleep(10)


def test_the_writers_group_is_named_and_bounded_by_the_timeout(run):
    """The background writer's own gloo group: a rank that never creates it was named only by
    store keys ("DistStoreError: wait timeout after 1000ms, keys: /default_pg//..."); it is
    named as the mesh's groups name theirs, after timeout_s (--timeout-s)."""
    with pytest.raises(WorkerError) as info:
        run(_rank_1_makes_no_writer, 2, timeout_s=60)
    message = str(info.value)
    assert message.startswith(
        "rank 0 failed: TimeoutError: rank 0 waited 1 s for ranks 0 and 1 to create process "
        "group async_save and rank 1 never did ("), message
    assert "keys:" not in message.splitlines()[0], message


def _save_and_return(root):
    cd.write_tensors = _held(1, 1.0)  # the write is still in flight at the return (this rank)
    engine = megapar.prepare(_model(), tp=2, pp=2, micro_batch_size=2, lr=1e-2,
                             async_save=True)
    engine.train_step(_batch(0))
    return str(engine.save(Path(root) / "ck"))  # no wait_save: the worker waits before exit


def test_a_write_in_flight_when_the_function_returns_is_finished_before_the_worker_exits(
        tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAPAR_CPU", "1")
    out = megapar.launch(_save_and_return, 4, str(tmp_path), timeout_s=120)
    ck = tmp_path / "ck"
    assert out == str(ck / "step_00000001")
    assert (ck / "latest").read_text().strip() == "step_00000001"
    verify(ck / "step_00000001")
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".tmp-")]


def _steps(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [json.loads(x)["step"] for x in log.read_text().splitlines() if x.endswith("}")]


def _losses(log: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in log.read_text().splitlines()]


def test_sigkill_during_a_background_write_keeps_the_previous_latest_and_resume_matches(
        tmp_path, common, monkeypatch):  # noqa: F811 - the fixture
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    args = [*common, "--tp", "2", "--lr-decay", "constant", "--max-steps", "6",
            "--save", str(ckpt), "--async-save"]
    with monkeypatch.context() as held:  # step 4's write is held open in the forked run
        held.setattr(cd, "write_tensors", _held(4, 120.0))
        pid = _fork_main([*args, "--save-interval", "2", "--log-json", str(first)],
                         tmp_path / "out")

    def out():
        return (tmp_path / "out").read_text()

    # training went on to its last step while step 4's write was open; step 2 is published
    assert _wait_for(lambda: _steps(first) == list(range(1, 7))), out()
    assert _wait_for(lambda: bool(list(ckpt.glob(".tmp-step_4-*")))), out()
    assert (ckpt / "latest").read_text().strip() == "step_00000002", out()
    workers = _children(pid)
    os.kill(pid, signal.SIGKILL)
    for w in workers:
        try:
            os.kill(w, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.waitpid(pid, 0)
    time.sleep(0.5)
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    assert not (ckpt / "step_00000004").exists() and not (ckpt / "step_00000006").exists()
    verify(ckpt)  # every file of the checkpoint latest names, against its manifest
    # a requeue: the same --save, resumed from it (the dead run's lock and staging are stale)
    assert main([*args, "--load", str(ckpt), "--log-json", str(second)]) == 0
    assert _steps(second) == [3, 4, 5, 6]
    assert _losses(second) == _losses(first)[2:]  # bitwise
    assert (ckpt / "latest").read_text().strip() == "step_00000006"
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-")]


def test_async_save_without_save_is_refused(tmp_path, common, capsys):  # noqa: F811
    assert main([*common, "--max-steps", "2", "--async-save"]) == 2
    assert "--async-save writes the checkpoints of --save in the background: give --save DIR" \
        in capsys.readouterr().err




def _save_to_a_full_disk(root):
    real = cd.write_tensors
    cd.write_tensors = lambda path, tensors: (_ for _ in ()).throw(
        OSError(28, "No space left on device")) if "model_" in str(path) else real(path, tensors)
    engine = megapar.prepare(_model(), tp=2, micro_batch_size=2, lr=1e-2)
    said = []
    for where in (Path(root) / "new" / "ckpt", Path(root) / "kept"):
        if where.name == "kept" and engine.mesh.rank == 0:
            where.mkdir()
        try:
            engine.save(where)
        except CheckpointError as exc:
            said.append(str(exc))
    return said


def test_a_failed_first_save_leaves_no_empty_save_directory(run, tmp_path):
    """engine.save(dir) on a full disk left an empty `dir` behind; the directories the save made
    (`dir` and its new parents: new/ was left) are removed again when nothing was published (one
    that was there before stays)."""
    out = run(_save_to_a_full_disk, 2, str(tmp_path))
    assert all(len(s) == 2 and all("No space left on device" in m for m in s) for s in out), out
    assert not (tmp_path / "new").exists()
    assert (tmp_path / "kept").is_dir() and not list((tmp_path / "kept").iterdir())
