"""Crash-safe publishing: a process killed at every point of a save leaves a root that loads.

A forked child re-saves step 3 of a root (another seed) and dies (os._exit) at one named point;
the parent then loads the root and gets one complete version of step 3, bit for bit."""

import os

import pytest
import torch
from test_checkpoint_helpers import save_serial, tiny_config

from megapar.checkpoint import publish
from megapar.checkpoint.distributed import load_checkpoint
from megapar.checkpoint.format import CheckpointError
from megapar.checkpoint.manifest import verify
from megapar.checkpoint.publish import resolve_checkpoint
from megapar.mesh import Layout, Mesh
from megapar.pipeline.partition import build_stage

POINTS = ["start", "after-aside", "after-rename", "after-latest-tmp", "after-latest"]


def _weights(root):
    mesh = Mesh(Layout(1, 1, 1))
    model = build_stage(tiny_config("gpt2"), mesh, 0)
    load_checkpoint(root, model, mesh)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _seeded(seed):
    model = build_stage(tiny_config("gpt2"), Mesh(Layout(1, 1, 1)), seed)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _save_and_die(root, point, step=3):
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        def crash(where):
            if where == point:
                os._exit(9)
        publish.crash_point = crash
        try:
            save_serial(root, seed=8, step=step)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_every_publish_point_leaves_a_loadable_root(tmp_path, point):
    root = tmp_path / "root"
    save_serial(root, seed=7, step=3)
    assert _save_and_die(root, point) == 9
    loaded = _weights(root)
    old, new = _seeded(7), _seeded(8)
    assert any(all(torch.equal(loaded[k], ref[k]) for k in ref) for ref in (old, new))
    verify(root)
    save_serial(root, seed=9, step=3)  # the next save cleans the dead save's leftovers
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003"]
    assert all(torch.equal(_weights(root)[k], v) for k, v in _seeded(9).items())


def test_a_dangling_latest_is_repaired_from_the_complete_copy(tmp_path):
    root = tmp_path / "root"
    save_serial(root, seed=7, step=3)
    assert _save_and_die(root, "after-aside") == 9
    assert not (root / "step_00000003").exists()  # the window the crash hit
    assert resolve_checkpoint(root) == root / "step_00000003"
    assert all(torch.equal(_weights(root)[k], v) for k, v in _seeded(8).items())  # the newer


def test_a_read_only_root_names_the_copy(tmp_path, monkeypatch):
    root = tmp_path / "root"
    save_serial(root, seed=7, step=3)
    assert _save_and_die(root, "after-aside") == 9

    def refuse(*a):
        raise PermissionError("read-only file system")
    monkeypatch.setattr(publish.os, "rename", refuse)
    with pytest.raises(CheckpointError, match=r"a complete copy is in .*\.tmp-step_3-.* rename "
                                              r"it to .*step_00000003"):
        resolve_checkpoint(root)


@pytest.mark.parametrize("step", [3, 5])
def test_a_full_disk_at_latest_takes_the_step_back(tmp_path, monkeypatch, step):
    """`latest` not written (the disk filled between the rename and it): the save fails and
    what is on disk is what the error says, the root as it was: the complete step_5 was left
    (40 MB a helper's requeue then had no room beside), and a re-saved step 3 goes back to the
    one it replaced. No temporary of latest is left."""
    import errno

    root = tmp_path / "root"
    save_serial(root, seed=7, step=3)
    before = sorted(p.name for p in root.iterdir())
    real_open = open

    def full(path, *a, **k):
        if ".latest.tmp-" in str(path):
            f = real_open(path, *a, **k)
            f.close()  # created, as a full disk does, then the write fails
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", full)
    with pytest.raises(CheckpointError, match=f"step {step} not saved: rank 0: No space left on "
                       f"device writing it in {root}; free space there, or give --save another "
                       f"directory"):
        save_serial(root, seed=8, step=step)
    monkeypatch.setattr("builtins.open", real_open)
    assert sorted(p.name for p in root.iterdir()) == before
    assert (root / "latest").read_text() == "step_00000003\n"
    assert all(torch.equal(_weights(root)[k], v) for k, v in _seeded(7).items())


def test_without_latest_the_newest_complete_step_loads(tmp_path):
    root = tmp_path / "root"
    save_serial(root, seed=7, step=3)
    save_serial(root, seed=8, step=5)
    (root / "latest").unlink()
    assert resolve_checkpoint(root) == root / "step_00000005"


def test_a_root_under_home_written_with_a_tilde_resolves(tmp_path, monkeypatch):
    """--load '~/ckpt' (quoted, or from a --config file) passed the checks before the workers,
    which expand ~, and then failed in every worker: '~/ckpt: no such checkpoint directory'."""
    save_serial(tmp_path / "root", seed=7, step=3)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_checkpoint("~/root") == tmp_path / "root" / "step_00000003"


def test_a_complete_staging_copy_of_a_step_latest_does_not_name_is_cleaned(tmp_path):
    """A save whose rank 0 died after writing the manifest, before the rename, left a complete
    hidden copy of its step in --save after the run ended (the next save of that step removed
    it): clean_stale kept every complete copy whose step was missing, not only the one a
    dangling ``latest`` needs."""
    root = tmp_path / "root"
    save_serial(root, seed=7, step=3)
    assert _save_and_die(root, "start", step=5) == 9
    assert [p.name[:11] for p in root.glob(".tmp-*")] == [".tmp-step_5"]
    assert [name[:11] for name in publish.clean_stale(root)] == [".tmp-step_5"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003"]
    assert resolve_checkpoint(root) == root / "step_00000003"


def test_a_live_runs_staging_dir_is_not_cleaned(tmp_path):
    root = tmp_path / "root"
    save_serial(root, seed=7, step=3)
    live = root / ".tmp-step_4-abc"
    live.mkdir()
    publish.mark_owner(live)  # this (live) process
    save_serial(root, seed=7, step=5)
    assert live.exists()


def test_steps_after_lists_the_complete_newer_steps(tmp_path):
    root = tmp_path / "root"
    save_serial(root, step=3)
    save_serial(root, step=6)
    (root / "step_00000009").mkdir()  # an interrupted copy: no manifest
    assert publish.steps_after(root, 3) == ["step_00000006"]
    assert publish.steps_after(root, 0) == ["step_00000003", "step_00000006"]
    assert publish.steps_after(root, 6) == [] == publish.steps_after(tmp_path / "none", 0)


def test_remove_steps_before_latest_keeps_the_newest_k_and_the_one_latest_names(tmp_path):
    root = tmp_path / "root"
    for step in (2, 4, 6, 8):
        save_serial(root, step=step)
    (root / "step_00000010").mkdir()  # an interrupted copy (no manifest): not a step, kept
    publish.set_latest(root, "step_00000004")  # a requeue resumed from 4: kept whatever K says
    assert publish.remove_steps_before_latest(root, 2) == ["step_00000002"]
    assert sorted(p.name for p in root.iterdir()) == [
        "latest", "step_00000004", "step_00000006", "step_00000008", "step_00000010"]
    publish.set_latest(root, "step_00000008")
    assert publish.remove_steps_before_latest(root, 1) == ["step_00000004", "step_00000006"]
    assert resolve_checkpoint(root).name == "step_00000008"
    assert publish.remove_steps_before_latest(root, 1) == []
    # a prune cut short leaves a hidden copy, which the next save's clean-up deletes
    (root / ".dropped-step_00000006-0a1b").mkdir()
    assert publish.clean_stale(root) == [".dropped-step_00000006-0a1b"]


@pytest.mark.parametrize("async_save", [False, True])
def test_keep_latest_k_leaves_the_newest_k_steps_and_a_resume_goes_on(tmp_path, capsys,
                                                                      async_save):
    """--keep-latest-k 2 with a save every step: after each publish (a background one's too)
    the older steps go, logged on rank 0; the run resumes from the newest (torchtitan's
    checkpoint.keep_latest_k; every step stayed, 40 of a user's 200-step run at 1.6 GB)."""
    import megapar.cli.train as train_cli

    root = tmp_path / "ckpt"
    common = ["--model", "gpt2-tiny", "--seq-len", "16", "--global-batch-size", "2",
              "--micro-batch-size", "2", "--eval-interval", "0", "--no-progress",
              "--save-interval", "1", "--keep-latest-k", "2", "--save", str(root),
              *(["--async-save"] if async_save else [])]
    assert train_cli.main([*common, "--max-steps", "4"]) == 0
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "latest", "step_00000003", "step_00000004"]
    out = capsys.readouterr().out
    assert "removed step_00000001 (--keep-latest-k 2)" in out
    assert "removed step_00000002 (--keep-latest-k 2)" in out
    assert train_cli.main([*common, "--max-steps", "5", "--load", str(root)]) == 0
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004", "step_00000005"]


def test_train_refuses_a_save_holding_steps_its_saves_would_replace(tmp_path, capsys,
                                                                    monkeypatch):
    """--load ROOT/step_3 --save ROOT where step_6 is: one line naming it and the fixes, before
    any worker starts (it would be replaced at step 6); a fresh run into ROOT likewise. A
    requeue (--load ROOT --save ROOT) and --overwrite-newer go on."""
    import megapar.cli.train as train_cli

    root = tmp_path / "ckpt"
    common = ["--model", "gpt2-tiny", "--seq-len", "16", "--global-batch-size", "2",
              "--micro-batch-size", "2", "--eval-interval", "0", "--no-progress"]
    assert train_cli.main([*common, "--max-steps", "6", "--save-interval", "3", "--save",
                           str(root)]) == 0
    capsys.readouterr()
    started = []
    monkeypatch.setattr(train_cli, "run_workers", lambda *a, **k: started.append(a))
    branch = [*common, "--max-steps", "8", "--load", str(root / "step_00000003"), "--save",
              str(root)]
    assert train_cli.main(branch) == 2 and not started
    assert capsys.readouterr().err.strip() == (
        f"megapar-train: error: --save {root} holds step_00000006, newer than step 3, where "
        f"--load {root}/step_00000003 resumes: this run's saves would replace or mix with "
        f"them; give another --save, or pass --overwrite-newer to replace them")
    assert train_cli.main([*common, "--max-steps", "8", "--save", str(root)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and not started
    assert ("holds step_00000003, step_00000006, of an earlier run, and this run starts from "
            "scratch" in err and f"resume it with --load {root}, give another --save" in err)
    # a fresh run of another model: --load ROOT would resume the other model (a guide re-test)
    other = [*common[:1], "llama-tiny", *common[2:]]
    for rehearse in ([], ["--dry-run"]):  # (a rehearsal's model keeps its own vocabulary)
        assert train_cli.main([*other, *rehearse, "--max-steps", "8", "--save", str(root)]) == 2
        err = capsys.readouterr().err
        assert (f"megapar-train: error: --save {root} holds step_00000003, step_00000006, of an "
                f"earlier run of a gpt2 model, and this run trains a llama: this run's saves "
                f"would replace or mix with them; give another --save, or pass --overwrite-newer "
                f"to replace them") in err, err
    for rehearse in ([], ["--dry-run"]):  # the same model's: resume it (the generic line)
        assert train_cli.main([*common, *rehearse, "--max-steps", "8", "--save", str(root)]) == 2
        assert f"resume it with --load {root}" in capsys.readouterr().err
    assert train_cli.main([*common, "--max-steps", "8", "--load", str(root), "--save",
                           str(root)]) == 0
    assert train_cli.main([*branch, "--overwrite-newer"]) == 0 and len(started) == 2


def test_a_resume_into_a_save_of_another_model_is_refused(tmp_path):
    """--load LLAMA --save ROOT where ROOT holds only older steps of a GPT-2 (no newer step, so
    nothing was refused): the llama's step 7 was written beside them and `latest` named it, one
    root holding two models. Now one line naming the steps and the models; a --save of the same
    model (e.g. the run's own root, or a copy of it) goes on."""
    from types import SimpleNamespace

    from megapar.checkpoint.manifest import read_manifest
    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import check_newer_steps

    gpt2, llama, same = tmp_path / "gpt2", tmp_path / "llama", tmp_path / "same"
    save_serial(gpt2, step=3)
    save_serial(gpt2, step=6)
    save_serial(llama, "llama", step=6)
    save_serial(same, "llama", step=2)
    manifest = read_manifest(llama)

    def check(save):
        check_newer_steps(SimpleNamespace(save=str(save), load=str(llama), overwrite_newer=False),
                          manifest)

    with pytest.raises(UsageError) as exc:
        check(gpt2)
    assert str(exc.value) == (
        f"--save {gpt2} holds step_00000003, step_00000006 of a gpt2 model, and this run trains "
        f"a llama: this run's saves would be mixed with them; give another --save")
    check(same)
    check(tmp_path / "empty")


def test_overwrite_newer_removes_every_step_newer_than_the_start(tmp_path, capsys, monkeypatch):
    """--load ROOT/step_3 --save ROOT --max-steps 6 --overwrite-newer over steps 3, 6, 9: not
    only 6 (which the run replaces) but 9 goes too, named in a note, `latest` left on step 3
    until the run saves; no step of the earlier run is left mixed with this run's."""
    import megapar.cli.train as train_cli

    root = tmp_path / "ckpt"
    common = ["--model", "gpt2-tiny", "--seq-len", "16", "--global-batch-size", "2",
              "--micro-batch-size", "2", "--eval-interval", "0", "--no-progress"]
    assert train_cli.main([*common, "--max-steps", "9", "--save-interval", "3", "--save",
                           str(root)]) == 0
    capsys.readouterr()
    started = []
    monkeypatch.setattr(train_cli, "run_workers", lambda *a, **k: started.append(a))
    assert train_cli.main([*common, "--max-steps", "6", "--load", str(root / "step_00000003"),
                           "--save", str(root), "--overwrite-newer"]) == 0 and started
    err = capsys.readouterr().err
    assert (f"--overwrite-newer: removed step_00000006, step_00000009 of --save {root} (newer "
            f"than step 3, where this run starts)") in err, err
    assert publish.steps_after(root, 0) == ["step_00000003"]
    assert (root / "latest").read_text().strip() == "step_00000003"
    verify(resolve_checkpoint(root))


def test_train_refuses_a_save_that_holds_another_format(tmp_path, capsys, monkeypatch):
    """--save into a Hugging Face model's directory (or a DCP checkpoint's) would mix the
    checkpoint's files into it, as megapar-convert --to-hf refuses the other way round (and
    after it, --to-hf --overwrite of that export is refused): one line before any worker; so
    are a checkpoint's own directories and the --data directory."""
    import megapar.cli.train as train_cli

    started = []
    monkeypatch.setattr(train_cli, "run_workers", lambda *a, **k: started.append(a))
    hf, dcp = tmp_path / "exported", tmp_path / "titan"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    common = ["--model", "gpt2-tiny", "--seq-len", "16", "--max-steps", "1", "--no-progress"]
    for where, what in ((hf, "a Hugging Face model (config.json)"),
                        (dcp, "a torch.distributed.checkpoint (DCP) checkpoint")):
        assert train_cli.main([*common, "--save", str(where)]) == 2 and not started
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"megapar-train: error: --save {where} holds {what}"), err
        assert "would be mixed into it; give another --save" in err, err
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    # a step directory, or a directory inside a checkpoint: the run's root (`latest`, step_N)
    # was written among that checkpoint's files (`ckpt/step_00000003/step_00000001`)
    ckpt = tmp_path / "ckpt"
    save_serial(ckpt, step=3)
    step = ckpt / "step_00000003"
    for where, what in ((step, "is a checkpoint's step directory (it holds manifest.json)"),
                        (ckpt / "sub", f"is inside the megapar checkpoint {ckpt}"),
                        (step / "x" / "y", f"is inside the megapar checkpoint {step}")):
        assert train_cli.main([*common, "--save", str(where)]) == 2 and not started
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"megapar-train: error: --save {where} {what}"), err
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000003"]
    assert not (step / "x").exists()
    # the --data directory: its checkpoint made a later --data of it "a megapar checkpoint,
    # not data"; a directory inside it is taken (the text walk leaves a checkpoint out)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("To be, or not to be: that is the question.\n" * 50)
    assert train_cli.main([*common, "--data", str(corpus), "--save", str(corpus)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"megapar-train: error: --save {corpus} is the --data directory {corpus}: "
                   f"its checkpoints would make it a checkpoint, not data, for every later run; "
                   f"give --save another directory (a new one beside it, or one inside it: the "
                   f"text is read without it)") and not started
    assert [p.name for p in corpus.iterdir()] == ["a.txt"]


def test_a_damaged_load_names_the_newest_other_step_to_resume_from(tmp_path, capsys):
    """--load ROOT whose latest step has a truncated shard (a kill during a copy, a full disk)
    said 'restore it or use another checkpoint' without naming one; now the newest other step
    of its root, for the root and the step directory alike; none where there is no other."""
    from megapar.checkpoint.format import shard_file_name
    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import checkpoint_manifest

    root = tmp_path / "ckpt"
    save_serial(root, step=3)
    save_serial(root, step=6)
    with open(root / "step_00000006" / shard_file_name(0, 0), "r+b") as f:
        f.truncate(100)
    for path in (str(root), f"{root}/step_00000006/"):
        with pytest.raises(UsageError) as exc:
            checkpoint_manifest(path)
        assert "(file truncated or altered)" in str(exc.value)
        # the file with its step where the root is given (a re-test: the step was unnamed)
        shown = shard_file_name(0, 0) if path.endswith("/") else \
            f"step_00000006/{shard_file_name(0, 0)}"
        assert f"{path}: {shown}: 100 bytes" in str(exc.value), str(exc.value)
        assert str(exc.value).endswith(
            f"(the newest other step there: --load {root}/step_00000003)"), str(exc.value)
    # megapar-convert reading it says the same, in its own words: it named the file alone (a
    # re-test)
    from megapar.cli.convert import main as convert_main

    for args in ([str(root), str(tmp_path / "out")], ["--info", str(root)],
                 [str(root), "--to-hf", str(tmp_path / "hf")]):
        assert convert_main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"megapar-convert: error: {root}: ") and err.endswith(
            f"(the newest other step there: {root}/step_00000003)"), err
    assert not (tmp_path / "out").exists() and not (tmp_path / "hf").exists()
    # a corrupt manifest, or `latest` naming a step that is gone, was said without the step to
    # use instead (a re-test)
    manifest = root / "step_00000006" / "manifest.json"
    saved = manifest.read_text()
    manifest.write_text(saved[:50])
    assert convert_main([str(root), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not valid JSON" in err and err.endswith(
        f"(the newest other step there: {root}/step_00000003)"), err
    manifest.write_text(saved)
    # `latest` names a step that is gone: the step offered is the newest complete one, not
    # step 6, whose shard is truncated (it was offered, and refused in turn)
    (root / "latest").write_text("step_00000009\n")
    with pytest.raises(UsageError) as exc:
        checkpoint_manifest(str(root))
    assert str(exc.value).endswith(
        f"(the newest other step there: --load {root}/step_00000003)"), str(exc.value)
    (root / "step_00000003" / "manifest.json").unlink()
    with pytest.raises(UsageError) as exc:
        checkpoint_manifest(str(root))
    assert "newest other step" not in str(exc.value)


def test_a_resume_with_an_optimizer_of_other_state_is_refused_before_workers(tmp_path):
    """--load of an AdamW checkpoint with --optimizer sgd (or lars): rank 0 failed after the
    workers started ('KeyError: optimizer state ... has [exp_avg, exp_avg_sq], not
    [momentum_buffer]', exit 1, a logs/ directory left in --save). Now one line from the
    checks before the workers; LAMB (the same moments) goes on."""
    from megapar.training.config import TrainConfig
    from megapar.training.run_plan import read_resumed_settings
    from megapar.training.validate import UsageError

    root = tmp_path / "ckpt"
    save_serial(root, step=3, meta={"consumed_samples": 96, "optimizer": {"kind": "adamw"}})
    for kind in ("sgd", "lars"):
        with pytest.raises(UsageError) as exc:
            read_resumed_settings(TrainConfig(load=str(root), optimizer=kind), [])
        assert str(exc.value) == (
            f"--optimizer {kind} keeps momentum_buffer, but --load {root} holds exp_avg, "
            f"exp_avg_sq (it trained with --optimizer adamw): resume with --optimizer adamw (or "
            f"leave it out: the checkpoint's is taken)")
    read_resumed_settings(TrainConfig(load=str(root), optimizer="lamb"), [])


def test_latest_keeps_its_mode_when_it_moves_on(tmp_path):
    # a user's private 0600 latest became 0644 at the next save (a re-test); a new one is 0644
    import stat

    from megapar.checkpoint.publish import set_latest

    set_latest(tmp_path, "step_00000001")
    assert stat.S_IMODE(os.stat(tmp_path / "latest").st_mode) == 0o666 & ~_umask()
    os.chmod(tmp_path / "latest", 0o600)
    set_latest(tmp_path, "step_00000002")
    assert (tmp_path / "latest").read_text() == "step_00000002\n"
    assert stat.S_IMODE(os.stat(tmp_path / "latest").st_mode) == 0o600


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
