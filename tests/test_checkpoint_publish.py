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


def _save_and_die(root, point):
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        def crash(where):
            if where == point:
                os._exit(9)
        publish.crash_point = crash
        try:
            save_serial(root, seed=8, step=3)
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


def test_without_latest_the_newest_complete_step_loads(tmp_path):
    root = tmp_path / "root"
    save_serial(root, seed=7, step=3)
    save_serial(root, seed=8, step=5)
    (root / "latest").unlink()
    assert resolve_checkpoint(root) == root / "step_00000005"


def test_a_live_runs_staging_dir_is_not_cleaned(tmp_path):
    root = tmp_path / "root"
    save_serial(root, seed=7, step=3)
    live = root / ".tmp-step_4-abc"
    live.mkdir()
    publish.mark_owner(live)  # this (live) process
    save_serial(root, seed=7, step=5)
    assert live.exists()
