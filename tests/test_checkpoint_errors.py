"""Every broken input gives an error naming the problem, and DST is never touched on failure."""

import json
import os
import re

import pytest
from test_checkpoint_helpers import save_serial, tiny_config

from megapar.checkpoint import convert as cv
from megapar.checkpoint.distributed import load_checkpoint
from megapar.checkpoint.export import export_hf
from megapar.checkpoint.format import LATEST, CheckpointError, ShardReader
from megapar.checkpoint.manifest import read_manifest, verify
from megapar.checkpoint.publish import resolve_checkpoint
from megapar.cli.convert import main
from megapar.mesh import Layout, LayoutError, Mesh
from megapar.pipeline.partition import build_stage

SHARD = "model_tp01_pp00.safetensors"


@pytest.fixture
def src(tmp_path):
    """A 2x2 checkpoint (converted from 1x1) to break in various ways."""
    save_serial(tmp_path / "serial")
    return cv.convert_checkpoint(tmp_path / "serial", tmp_path / "src", 2, 2, progress=False)


def _missing(step):
    os.remove(step / SHARD)


def _truncated(step):
    with open(step / SHARD, "r+b") as f:
        f.truncate(os.path.getsize(step / SHARD) - 10)


def _altered(step):
    with open(step / SHARD, "r+b") as f:
        f.seek(os.path.getsize(step / SHARD) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


BREAKS = {
    "missing": (_missing, f"missing shard {SHARD}"),
    "truncated": (_truncated, f"{SHARD}: .* bytes, the manifest records .* \\(file truncated"),
    "altered": (_altered, f"{SHARD}: checksum mismatch \\(file altered or truncated\\)"),
}


def _dst_with_marker(tmp_path, root: bool = True):
    """A DST that exists: an earlier conversion's root (its `latest`, which --overwrite
    replaces), or with `root` False a directory of other files (a tokenizer's)."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "marker").write_text("keep me")
    if root:
        (dst / LATEST).write_text("step_00000001\n")
    return dst


def _assert_untouched(dst):
    assert sorted(p.name for p in dst.iterdir()) == [LATEST, "marker"]
    assert (dst / "marker").read_text() == "keep me"
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == [], f"temporary directories left behind: {leftovers}"


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_corrupted_source_is_named_and_dst_untouched(src, tmp_path, case, capsys):
    breaker, message = BREAKS[case]
    breaker(src)
    with pytest.raises(CheckpointError, match=message):
        verify(src)
    dst = _dst_with_marker(tmp_path)
    assert main([str(src), str(dst), "--tp", "1", "--pp", "1", "--overwrite",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megapar-convert: error: ") and SHARD in err
    _assert_untouched(dst)
    # Loading into a model checks the files it reads too (tp rank 1 of stage 0 at 2x2).
    model = build_stage(tiny_config("gpt2"), Mesh(Layout()), seed=1)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(src, model, Mesh(Layout()))


def test_size_only_verification_misses_an_altered_byte_but_sha256_does_not(src):
    _altered(src)
    verify(src, checksums=False)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        verify(src)


@pytest.mark.parametrize("tp, pp, message", [
    (3, 1, "4 attention heads are not divisible by --tp 3"),
    (1, 5, "4 layers cannot be cut into --pp 5 stages"),
])
def test_impossible_target_layout(src, tmp_path, tp, pp, message, capsys):
    with pytest.raises(LayoutError, match=message):
        cv.convert_checkpoint(src, tmp_path / "out", tp, pp, progress=False)
    dst = _dst_with_marker(tmp_path)
    assert main([str(src), str(dst), "--tp", str(tp), "--pp", str(pp), "--overwrite"]) == 2
    assert message in capsys.readouterr().err
    _assert_untouched(dst)


def test_loading_into_another_model_is_refused(src):
    model = build_stage(tiny_config("gpt2", n_embd=64), Mesh(Layout()), seed=1)
    with pytest.raises(CheckpointError, match=r"different model: n_embd=32 \(checkpoint\) vs 64"):
        load_checkpoint(src, model, Mesh(Layout()))


def test_existing_dst_is_refused_without_overwrite(src, tmp_path, capsys):
    dst = _dst_with_marker(tmp_path)
    assert main([str(src), str(dst), "--tp", "1", "--pp", "1"]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    _assert_untouched(dst)


def test_an_empty_dst_is_taken_and_a_step_directory_named(src, tmp_path, capsys):
    """An empty DST made for the output needed --overwrite (megapar-train --save and --to-hf
    take one); a checkpoint's step directory as DST was "a directory of other files
    (manifest.json, ...), not a megapar checkpoint" (a checkpoints tryout): the root is named."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(src), str(empty), "--tp", "1", "--pp", "1"]) == 0
    assert (empty / "latest").is_file()
    capsys.readouterr()
    step = next(empty.glob("step_*"))
    assert main([str(src), str(step), "--tp", "1", "--pp", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (
        f"{step} is a checkpoint's step directory (it holds manifest.json), not a checkpoint "
        f"root; give the root that holds it ({empty}), with --overwrite") in err, err


def test_overwrite_that_cannot_put_its_output_in_place_puts_the_old_dst_back(
        src, tmp_path, monkeypatch, capsys):
    """--overwrite moves the old DST aside, then renames the output into its place: where that
    rename fails, the old DST is put back (it was left hidden as .dst.old-*, DST gone: a fault
    drill's finding) and no temporary is left."""
    dst = _dst_with_marker(tmp_path)
    real = os.rename

    def failing(source, target):
        if str(source).startswith(str(tmp_path / ".dst.tmp-")):
            raise OSError("Input/output error (simulated)")
        return real(source, target)

    monkeypatch.setattr(cv.os, "rename", failing)
    assert main([str(src), str(dst), "--tp", "1", "--pp", "1", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Input/output error (simulated)" in err, err
    _assert_untouched(dst)


def test_a_conversion_killed_between_its_renames_leaves_dst_as_it_was_for_the_next(
        src, tmp_path, capsys):
    """Killed -9 after the old DST was moved aside and before the output took its place: DST
    was gone, the old one hidden as .dst.old-* for good (a re-test's finding). The next
    conversion into DST puts it back first (saying so), also spelt dst/../dst; one beside a
    DST in place is an earlier DST, never removed (a second re-test: a run without --overwrite
    removed it)."""
    import subprocess

    from megapar.faults.processes import _host

    gone = subprocess.Popen(["true"])
    gone.wait()
    dst = _dst_with_marker(tmp_path)
    os.rename(dst, tmp_path / f".dst.old-{gone.pid}-{_host()}-0a1b2c3d")
    assert main([str(src), str(dst), "--tp", "1", "--pp", "1"]) == 2
    err = capsys.readouterr().err
    assert f"note: {dst}: put back as it was" in err and "already exists" in err, err
    _assert_untouched(dst)
    os.rename(dst, tmp_path / f".dst.old-{gone.pid}-{_host()}-4e5f6a7b")
    assert main([str(src), f"{dst}/../dst", "--tp", "1", "--pp", "1"]) == 2
    assert "put back as it was" in capsys.readouterr().err
    _assert_untouched(dst)
    earlier = tmp_path / f".dst.old-{gone.pid}-{_host()}-5a6b7c8d"
    earlier.mkdir()
    assert main([str(src), str(dst), "--tp", "1", "--pp", "1"]) == 2
    err = capsys.readouterr().err
    assert "put back" not in err and earlier.is_dir()
    # ... and kept without a word (an earlier DST the user may not know of): said now
    assert (f"note: {dst}: 1 earlier copy a killed conversion moved aside is kept beside it: "
            f"{earlier.name} (in {tmp_path.resolve()}); remove it when no longer needed") in err, err
    earlier.rmdir()
    _assert_untouched(dst)


def test_overwrite_of_a_dst_spelt_through_itself(src, tmp_path, capsys):
    """DST out/../out: the old out was moved aside, then out/.. named nothing, so the rename
    failed ('No such file or directory') and out was gone, left as two hidden directories;
    and a DST that is a file."""
    dst = _dst_with_marker(tmp_path)
    spelt = f"{dst}/../{dst.name}"
    assert main([str(src), spelt, "--tp", "1", "--pp", "2", "--overwrite", "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (dst / LATEST).is_file() and not (dst / "marker").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # --overwrite replaced a file, a dataset's directory or one of notes with the checkpoint
    # (the refusal without it suggested --overwrite): only a checkpoint root is replaced
    (tmp_path / "afile").write_text("x")
    (tmp_path / "n").mkdir()
    notes = _dst_with_marker(tmp_path / "n", root=False)
    for path, what in ((tmp_path / "afile", "is a file"),
                       (notes, "is a directory of other files (marker)")):
        assert main([str(src), str(path), "--overwrite", "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"{what}, not a megapar checkpoint: --overwrite replaces only a megapar " \
            "checkpoint (or an empty directory); give another DST" in err and "\n" not in err
    assert (tmp_path / "afile").read_text() == "x"
    assert [p.name for p in notes.iterdir()] == ["marker"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(src), str(empty), "--overwrite", "--no-progress"]) == 0
    assert (empty / LATEST).is_file()


def test_hf_export_keeps_other_files_and_replaces_an_export_only_when_asked(src, tmp_path):
    dst = _dst_with_marker(tmp_path, root=False)  # a tokenizer directory: exported into, as
    export_hf(src, dst)             # transformers' save_pretrained does, the marker kept
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "generation_config.json",
                                                     "marker", "model.safetensors"]
    assert (dst / "marker").read_text() == "keep me"
    weights = (dst / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="already holds an exported model"):
        export_hf(src, dst)
    export_hf(src, dst, overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "generation_config.json",
                                                     "marker", "model.safetensors"]
    modes = {p.name: p.stat().st_mode & 0o777 for p in dst.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == modes["marker"] == \
        modes["generation_config.json"], modes
    assert (dst / "model.safetensors").read_bytes() == weights
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_hf_export_over_a_sharded_save_removes_its_shards_and_index(src, tmp_path):
    """A directory that holds transformers' sharded save (model-0000N-of-0000M.safetensors and
    its index): the export was written beside them, and loaders that read the index first
    (vLLM) loaded the old weights."""
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    dst = tmp_path / "hf"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64)).save_pretrained(
        dst, max_shard_size="20KB")
    shards = sorted(p.name for p in dst.glob("model-*.safetensors"))
    assert len(shards) > 3 and (dst / "model.safetensors.index.json").is_file()
    listed = f"({len(shards) + 3} files: config.json, generation_config.json, {shards[0]}, ...)"
    with pytest.raises(CheckpointError, match=re.escape(f"{listed}; pass --overwrite")):
        export_hf(src, dst)
    assert sorted(p.name for p in dst.glob("model-*.safetensors")) == shards
    export_hf(src, dst, overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "generation_config.json",
                                                     "model.safetensors"]
    assert "h.0.attn.c_attn.weight" in " ".join(load_file(dst / "model.safetensors"))


def test_failure_midway_leaves_dst_untouched_and_no_temp_dirs(src, tmp_path, monkeypatch):
    calls = []
    real = ShardReader.shard

    def flaky(self, *args):
        calls.append(args)
        if len(calls) == 40:
            raise OSError("disk full (simulated)")
        return real(self, *args)

    monkeypatch.setattr(ShardReader, "shard", flaky)
    dst = _dst_with_marker(tmp_path)
    with pytest.raises(OSError, match="disk full"):
        cv.convert_checkpoint(src, dst, 1, 2, overwrite=True, progress=False)
    _assert_untouched(dst)
    fresh = tmp_path / "fresh"
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        cv.convert_checkpoint(src, fresh, 1, 2, progress=False)
    assert not fresh.exists()
    monkeypatch.setattr(ShardReader, "shard", real)
    out = cv.convert_checkpoint(src, dst, 1, 2, overwrite=True, progress=False)
    assert read_manifest(dst)["layout"]["pp"] == 2 and not (dst / "marker").exists()
    assert resolve_checkpoint(dst) == out


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint step directory"):
        resolve_checkpoint(tmp_path / "empty")
    # a file (the manifest, a shard, latest) was "neither a step directory (no manifest.json)
    # ... was the save interrupted?"; now named a file, with the directory to pass
    (tmp_path / "empty" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"empty/manifest.json is a file, not a checkpoint "
                                              r"directory; pass the directory that holds it"):
        resolve_checkpoint(tmp_path / "empty" / "manifest.json")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(CheckpointError, match=r"notes.txt is a file, not a checkpoint directory; "
                                              r"pass a directory written by --save"):
        resolve_checkpoint(tmp_path / "notes.txt")
    root = tmp_path / "root"
    root.mkdir()
    (root / "latest").write_text("step_00000009\n")
    with pytest.raises(CheckpointError, match="latest points to step_00000009"):
        resolve_checkpoint(root)


@pytest.mark.parametrize("mode", ["convert", "to-hf"])
def test_unwritable_output_is_named_with_the_fix_before_reading_the_source(src, tmp_path, mode,
                                                                           capsys, monkeypatch):
    """Used to print a raw "[Errno 2] No such file or directory: '/proc/x'" (naming neither the
    output nor the fix), and only after verifying every source file."""
    def no_verify(*args, **kwargs):
        raise AssertionError("the source was verified before the output was checked")

    monkeypatch.setattr(cv, "verify", no_verify)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "sub" / "y"
    argv = ([str(src), str(out), "--tp", "1", "--pp", "1"] if mode == "convert"
            else [str(src), "--to-hf", str(out)])
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megapar-convert: error: cannot create {out}: ")
    assert lines[0].endswith("; choose a writable directory") and "[Errno" not in err
    assert blocker.read_text() == ""


@pytest.mark.parametrize("mode", ["convert", "to-hf"])
def test_a_read_only_output_is_bad_input_not_a_full_disk(src, tmp_path, mode, capsys,
                                                          monkeypatch):
    """A destination on a read-only mount, refused before any work, was read as a disk gone
    read-only while writing ("nothing was written ...; free space or choose another
    destination", exit 1): its line names it and the fix, exit 2 (a new user's tryout)."""
    import errno

    def read_only(directory):  # as the probe file's creation fails (its name was said)
        probe = os.path.join(str(directory), ".megapar-probe-4vpyuosx")
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), probe)

    monkeypatch.setattr(cv, "probe_writable", read_only)
    out = tmp_path / "mnt" / "out"
    argv = ([str(src), str(out)] if mode == "convert" else [str(src), "--to-hf", str(out)])
    assert main(argv) == 2
    line = _one_line(capsys)
    assert line.startswith(f"megapar-convert: error: cannot create {out}: ") and line.endswith(
        f"{os.strerror(errno.EROFS)}; choose a writable directory"), line
    assert "free space" not in line and not out.exists()
    probed = out if mode == "to-hf" else out.parent  # the directory written into
    assert "megapar-probe" not in line and f": {probed}: " in line, line


def test_a_directory_no_file_can_be_created_in_is_named_so(src, tmp_path, capsys, monkeypatch):
    """/proc/x was "/proc: No such file or directory" (its probe file's errno; /proc is
    there): that no file can be created in it (a re-test)."""
    import errno

    def no_files(directory):
        probe = os.path.join(str(directory), ".megapar-probe-abc")
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), probe)

    monkeypatch.setattr(cv, "probe_writable", no_files)
    out = tmp_path / "x"
    assert main([str(src), str(out), "--tp", "1", "--pp", "1"]) == 2
    line = _one_line(capsys)
    assert line.endswith(f"cannot create {out}: {tmp_path}: no file can be created in it; "
                         f"choose a writable directory"), line


def test_a_destination_linked_to_a_directory_is_written_through_the_link(src, tmp_path,
                                                                          capsys):
    """megapar-convert SRC LINK (a symbolic link to an empty directory, or with --overwrite to
    a checkpoint) was refused: "LINK is a symbolic link, not a megapar checkpoint: --overwrite
    replaces only ..." (where --to-hf and megapar-train --save take a link; a new user's
    tryout): the directory is written, the link kept."""
    target = tmp_path / "e2"
    target.mkdir()
    link = tmp_path / "elink"
    link.symlink_to(target)
    assert main([str(src), str(link), "--tp", "1", "--pp", "1"]) == 0, capsys.readouterr().err
    assert link.is_symlink() and (target / LATEST).is_file()
    assert main([str(src), str(link), "--tp", "1", "--pp", "1"]) == 2  # it exists now
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main([str(src), str(link), "--tp", "1", "--pp", "1", "--overwrite"]) == 0
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert read_manifest(target / (target / LATEST).read_text().strip())["layout"]["tp"] == 1


def test_output_that_is_a_file_is_refused(src, tmp_path):
    target = tmp_path / "a_file"
    target.write_text("x")
    with pytest.raises(CheckpointError, match=f"cannot create {target}: it is a file"):
        export_hf(src, target)
    assert target.read_text() == "x"


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_a_forged_shard_behind_a_reforged_manifest_is_one_line(src, tmp_path, capsys):
    """A file that is not safetensors, whose size and sha256 were written into the manifest
    (and the manifest's own digest redone): every reader says so in one line, rc 2."""
    import json

    from megapar.checkpoint.format import MANIFEST, file_record
    from megapar.checkpoint.manifest import write_manifest

    (src / SHARD).write_bytes(b"this is not a safetensors file" * 100)
    manifest = json.loads((src / MANIFEST).read_text())
    manifest["files"][SHARD] = file_record(src / SHARD)
    write_manifest(src, manifest)
    verify(src)  # sizes and checksums match: only reading the file finds it
    for argv in ([str(src), str(tmp_path / "dst"), "--tp", "1", "--pp", "1", "--no-progress"],
                 [str(src), "--to-hf", str(tmp_path / "hf")]):
        assert main(argv) == 2
        line = _one_line(capsys)
        assert f"{SHARD}: not a readable safetensors shard (SafetensorError" in line, line
    assert not (tmp_path / "dst").exists() and not (tmp_path / "hf" / "model.safetensors").exists()


def test_a_manifest_reforged_to_another_dtype_is_one_line(src, tmp_path, capsys):
    """A manifest whose weight's dtype was edited (its digest redone) converted the fp32
    weights to float16 without a word (a re-test): the file's header is checked against it."""
    import json

    from megapar.checkpoint.format import MANIFEST
    from megapar.checkpoint.manifest import write_manifest

    manifest = json.loads((src / MANIFEST).read_text())
    name = next(n for n, e in manifest["tensors"].items() if e["dtype"] == "float32")
    manifest["tensors"][name]["dtype"] = "float16"
    write_manifest(src, manifest)
    assert main([str(src), str(tmp_path / "dst"), "--tp", "1", "--pp", "1", "--no-progress"]) == 2
    line = _one_line(capsys)
    assert f"model/{name} is float32, the manifest records float16; the manifest does not " \
           f"match its shards" in line, line
    assert not (tmp_path / "dst").exists()


def test_a_manifest_missing_a_tensor_is_one_line_for_every_reader(src, tmp_path, capsys):
    """A manifest without one of its model's tensors (its digest redone): --to-hf was a
    KeyError traceback and --info said nothing (a re-test); each reader now names it."""
    import json

    from megapar.checkpoint.format import MANIFEST
    from megapar.checkpoint.manifest import write_manifest

    manifest = json.loads((src / MANIFEST).read_text())
    gone = next(iter(manifest["tensors"]))
    del manifest["tensors"][gone]
    write_manifest(src, manifest)
    for argv in ([str(src), str(tmp_path / "dst"), "--tp", "1", "--pp", "1", "--no-progress"],
                 [str(src), "--to-hf", str(tmp_path / "hf")], ["--info", str(src)]):
        assert main(argv) == 2, argv
        line = _one_line(capsys)
        assert f"its tensors do not match its own model config: the config names 1 tensor the " \
               f"checkpoint lacks ({gone}); the manifest is damaged" in line, line
    assert not (tmp_path / "dst").exists() and not (tmp_path / "hf" / "model.safetensors").exists()


def test_a_load_refuses_a_manifest_of_fewer_layers_than_its_tensors(src):
    """A manifest whose n_layer was lowered and its digest deleted: megapar-convert --info
    refused it, --load trained the smaller model on the first layers' tensors unsaid (a
    re-test); --load refuses it in --info's words."""
    import json

    from megapar.checkpoint.format import MANIFEST
    from megapar.checkpoint.manifest import DIGEST
    from megapar.training.validate import UsageError
    from megapar.training.validate_resume import checkpoint_manifest

    manifest = json.loads((src / MANIFEST).read_text())
    layers = manifest["model"]["n_layer"]
    manifest["model"]["n_layer"] = layers - 1
    (src / MANIFEST).write_text(json.dumps(manifest))
    (src / DIGEST).unlink()
    with pytest.raises(UsageError) as info:
        checkpoint_manifest(str(src), checksums=False)
    assert ("its tensors do not match its own model config: the checkpoint holds "
            f"{len([n for n in manifest['tensors'] if n.startswith(f'layers.{layers - 1}.')])} "
            f"tensors the config does not name (layers.{layers - 1}.") in str(info.value) \
        and "the manifest is damaged" in str(info.value), str(info.value)  # which way: a re-test


def test_a_manifest_whose_model_config_was_edited_names_the_shape(src, tmp_path, capsys):
    """A manifest whose model's width was edited (its digest redone) said "its tensors do not
    match its own model config (e.g. [])": the names matched, only the shapes did not (a
    re-test); the first tensor of another shape is named with both shapes."""
    import json

    from megapar.checkpoint.format import MANIFEST
    from megapar.checkpoint.manifest import write_manifest

    manifest = json.loads((src / MANIFEST).read_text())
    manifest["model"]["n_embd"] *= 2
    write_manifest(src, manifest)
    for argv in ([str(src), "--to-hf", str(tmp_path / "hf")], ["--info", str(src)]):
        assert main(argv) == 2, argv
        line = _one_line(capsys)
        assert re.search(r"step_\d+: \S+ has shape \[\d+, \d+\], its own model config expects "
                         r"\[\d+, \d+\]; the manifest is damaged", line), line
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_a_pickled_hf_checkpoint_that_is_not_plain_weights_is_one_line(tmp_path, capsys):
    import torch
    from transformers import GPT2Config

    GPT2Config(vocab_size=64, n_positions=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=0,
               eos_token_id=0).save_pretrained(tmp_path / "hf")
    torch.save({"transformer.wte.weight": os.system}, tmp_path / "hf" / "pytorch_model.bin")
    assert main(["--from-hf", str(tmp_path / "hf"), str(tmp_path / "dst"), "--tp", "1", "--pp",
                 "1", "--no-progress"]) == 2
    line = _one_line(capsys)
    assert "pytorch_model.bin: refused: not a plain pickle of weights (UnpicklingError" in line
    assert "megapar reads tensors only, never code" in line
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"\x00" * 3)  # truncated
    assert main(["--from-hf", str(tmp_path / "hf"), str(tmp_path / "dst"), "--tp", "1", "--pp",
                 "1", "--no-progress"]) == 2
    assert "refused: not a plain pickle of weights" in _one_line(capsys)


@pytest.mark.parametrize("target", ["absolute", "relative"])
def test_latest_naming_a_path_outside_the_root_is_refused(src, tmp_path, target, capsys):
    import shutil

    root = src.parent
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(root, elsewhere)  # a complete, valid checkpoint: still not this root's
    step = elsewhere / src.name
    (root / "latest").write_text(str(step) if target == "absolute" else
                                 os.path.relpath(step, root))
    with pytest.raises(CheckpointError, match="not the name of a step directory in"):
        resolve_checkpoint(root)
    assert main(["--info", str(root)]) == 2
    assert "latest holds" in _one_line(capsys)


def test_an_empty_config_or_shard_index_of_a_transformers_dir_is_one_line(tmp_path, capsys):
    """An empty model.safetensors.index.json was a KeyError traceback ('weight_map'), and an
    empty config.json was told its model (model_type None) is not one megapar builds (a
    re-test): each names the file and the fix, before anything is written."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = tmp_path / "hf"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64)).save_pretrained(
        hf, max_shard_size="20KB")
    capsys.readouterr()  # transformers' own lines
    for name, said in (("model.safetensors.index.json", "maps no tensor to its shards (no "
                        "weight_map): copy the model directory again"),
                       ("config.json", "is empty: a transformers model's config.json holds "
                        "its settings; copy the model directory again")):
        whole = (hf / name).read_text()
        for text in ("", "{}"):
            (hf / name).write_text(text)
            assert main(["--from-hf", str(hf), str(tmp_path / "ck"), "--no-progress"]) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and f"{hf / name} {said}" in err, err
            assert not (tmp_path / "ck").exists()
        (hf / name).write_text(whole)
    # a weight_map of other values: a list was "no weight_map", a file name that is a number a
    # TypeError traceback (a re-test)
    index = hf / "model.safetensors.index.json"
    whole = json.loads(index.read_text())
    key = next(iter(whole["weight_map"]))
    for weight_map, said in ((["a"], "maps no tensor to its shards (its weight_map is no "
                              "mapping)"),
                             ({**whole["weight_map"], key: 1}, f"maps {key} to 1, no shard's "
                              f"file name: the index is damaged")):
        index.write_text(json.dumps({**whole, "weight_map": weight_map}))
        assert main(["--from-hf", str(hf), str(tmp_path / "ck"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{index} {said}" in err, err
        assert not (tmp_path / "ck").exists()
