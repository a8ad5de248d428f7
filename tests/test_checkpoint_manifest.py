"""An edited or damaged manifest is refused with a clear error before any weight is read."""

import json
import os
import shutil

import pytest
from test_checkpoint_helpers import save_serial, tiny_config

from megapar.checkpoint import convert as cv
from megapar.checkpoint.distributed import load_checkpoint
from megapar.checkpoint.format import CheckpointError
from megapar.checkpoint.manifest import DIGEST, read_manifest
from megapar.cli.convert import main
from megapar.mesh import Layout, Mesh
from megapar.pipeline.partition import build_stage


@pytest.fixture
def src(tmp_path):
    save_serial(tmp_path / "serial")
    return cv.convert_checkpoint(tmp_path / "serial", tmp_path / "src", 2, 2, progress=False)


def _edit(step, change, keep_digest=True):
    path = step / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest, indent=1))
    if not keep_digest:
        (step / DIGEST).unlink()


def _load_serial(step):
    mesh = Mesh(Layout(1, 1, 1))
    load_checkpoint(step, build_stage(tiny_config("gpt2"), mesh, 0), mesh)


def test_an_edited_layout_is_refused_by_load_convert_and_info(src, tmp_path, capsys):
    _edit(src, lambda m: m["layout"].update(tp=1))
    with pytest.raises(CheckpointError, match="was changed after it was saved"):
        _load_serial(src)
    assert main([str(src), str(tmp_path / "out"), "--tp", "1", "--pp", "1"]) == 2
    assert main(["--info", str(src), "--fast"]) == 2
    assert "was changed after it was saved" in capsys.readouterr().err


def test_a_layout_that_does_not_fit_the_shards_is_refused_without_the_digest(src):
    _edit(src, lambda m: m["layout"].update(tp=1), keep_digest=False)
    with pytest.raises(CheckpointError, match=r"does not fit the manifest's layout tp=1 pp=2"):
        _load_serial(src)


def test_a_shard_shape_that_differs_from_the_file_is_refused(src):
    def shrink(m):
        e = m["tensors"]["layers.0.attn.qkv.weight"]
        e["local_shape"][0] += 1
    _edit(src, shrink, keep_digest=False)
    with pytest.raises(CheckpointError, match=r"qkv.weight has shape \[48, 32\], the manifest "
                                              r"records \[49, 32\]"):
        _load_serial(src)


@pytest.mark.parametrize("key", ["tensors", "layout", "files", "step"])
def test_a_missing_key_is_named(src, key):
    _edit(src, lambda m: m.pop(key), keep_digest=False)
    with pytest.raises(CheckpointError, match=f"the manifest's '{key}' is missing"):
        read_manifest(src)


def test_info_verifies_checksums_unless_fast(src, capsys):
    shard = src / "model_tp01_pp00.safetensors"
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    assert main(["--info", str(src)]) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    assert main(["--info", str(src), "--fast"]) == 0
    assert "sizes only (--fast)" in capsys.readouterr().out


def test_converting_onto_the_source_is_an_error(src, capsys):
    """Onto the source, or into its checkpoint directory: refused, nothing written."""
    root = src.parent
    before = sorted(p.name for p in root.iterdir())
    assert main([str(root), str(root), "--tp", "1", "--pp", "1", "--overwrite"]) == 2
    assert "holds the source" in capsys.readouterr().err
    assert main([str(src), str(root), "--tp", "1", "--pp", "1", "--overwrite"]) == 2
    capsys.readouterr()
    for inside in (root / "sub", src / "sub"):  # it was written among the step directories
        assert main([str(root), str(inside), "--tp", "1", "--pp", "1"]) == 2
        assert "is inside the source's checkpoint directory" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == before
    alone = root.parent / "kept" / src.name  # a step directory kept on its own, not a --save
    alone.parent.mkdir()
    shutil.copytree(src, alone)
    assert main([str(alone), str(alone.parent / "converted"), "--tp", "1", "--pp", "1",
                 "--no-progress"]) == 0, capsys.readouterr().err
