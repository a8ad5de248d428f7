"""Offline conversion between layouts is exact: weights and optimizer moments, bitwise."""

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
from canonical import gather_canonical
from forked import exit_code, fork_running
from test_checkpoint_helpers import (
    KEYS,
    assert_same,
    canonical_state,
    file_tensors,
    moment,
    save_serial,
    tiny_config,
)

from megapar.checkpoint.convert import checkpoint_info, convert_checkpoint
from megapar.checkpoint.format import LATEST, RNG_FILE
from megapar.checkpoint.manifest import read_manifest
from megapar.checkpoint.publish import resolve_checkpoint
from megapar.cli.convert import main
from megapar.mesh import Layout, Mesh
from megapar.pipeline.partition import build_stage


@pytest.mark.parametrize("kind, hops", [("gpt2", [(2, 2), (4, 1), (1, 4), (1, 1)]),
                                        ("bert", [(2, 2), (4, 1), (1, 1)]),
                                        ("llama", [(2, 2), (4, 1), (2, 1), (1, 4), (1, 1)])])
def test_round_trip_through_layouts_is_bitwise(tmp_path, kind, hops):
    src = save_serial(tmp_path / "src", kind)
    weights, moments = canonical_state(src)
    # The 1x1 checkpoint holds the seeded model and the synthetic moments.
    reference = gather_canonical(build_stage(tiny_config(kind), Mesh(Layout()), seed=7))
    assert_same(weights, reference, "saved weights")
    assert_same(moments, {n: {k: moment(n, k, w.shape) for k in KEYS}
                          for n, w in reference.items()}, "saved moments")

    previous = src
    for i, (tp, pp) in enumerate(hops):
        out = convert_checkpoint(previous, tmp_path / f"hop{i}", tp, pp, progress=False)
        manifest = read_manifest(out)
        assert manifest["layout"] == {"tp": tp, "pp": pp, "dp": 1}
        assert sorted(manifest["files"]) == sorted(f"model_tp{t:02d}_pp{p:02d}.safetensors"
                                                   for t in range(tp) for p in range(pp))
        assert manifest["meta"]["consumed_samples"] == 96 and manifest["step"] == 3
        hop_weights, hop_moments = canonical_state(out)
        assert_same(hop_weights, weights, f"weights at {tp}x{pp}")
        assert_same(hop_moments, moments, f"moments at {tp}x{pp}")
        previous = out
    # Back at 1x1 every stored tensor, padding rows included, is the original one.
    name = "model_tp00_pp00.safetensors"
    assert_same(file_tensors(previous / name), file_tensors(src / name), "final shard file")


def test_shards_follow_the_partition_rule(tmp_path):
    """At tp=4 the vocab (101 -> 4 x 128) puts everything on tp rank 0; proj splits dim 1."""
    src = save_serial(tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "tp4", 4, 1, progress=False)
    weights, _ = canonical_state(src)
    shards = [file_tensors(out / f"model_tp{t:02d}_pp00.safetensors") for t in range(4)]
    word = weights["embed.word.weight"]
    assert torch.equal(shards[0]["model/embed.word.weight"][:101], word)
    assert not shards[0]["model/embed.word.weight"][101:].any()
    assert all(not s["model/embed.word.weight"].any() for s in shards[1:])
    proj = torch.cat([s["model/layers.2.mlp.proj.weight"] for s in shards], dim=1)
    assert torch.equal(proj, weights["layers.2.mlp.proj.weight"])
    assert shards[3]["model/layers.2.mlp.proj.weight"].shape == (32, 32)


def test_conversion_updates_layout_drops_rng_and_keeps_meta(tmp_path):
    src = save_serial(tmp_path / "src", meta={"consumed_samples": 5, "scheduler": {"lr": 0.1}})
    assert RNG_FILE in read_manifest(src)["files"]
    out = convert_checkpoint(tmp_path / "src", tmp_path / "dst", 2, 2, dp=3, progress=False)
    manifest = read_manifest(tmp_path / "dst")          # ROOT resolves through latest
    assert resolve_checkpoint(tmp_path / "dst") == out
    assert (tmp_path / "dst" / LATEST).read_text().strip() == "step_00000003"
    assert manifest["layout"] == {"tp": 2, "pp": 2, "dp": 3}
    assert RNG_FILE not in manifest["files"] and not (out / RNG_FILE).exists()
    assert "dropped" in manifest["meta"]["rng_note"]
    assert manifest["meta"]["scheduler"] == {"lr": 0.1}
    assert manifest["meta"]["converted_from"]["layout"] == {"tp": 1, "pp": 1, "dp": 1}
    assert manifest["model"] == read_manifest(src)["model"]
    assert manifest["tensors"]["layers.3.attn.qkv.weight"]["stage"] == 1
    assert manifest["tensors"]["layers.3.attn.qkv.weight"]["local_shape"] == [48, 32]


def test_conversion_into_the_same_layout_keeps_the_rng_states(tmp_path):
    """The RNG states belong to the ranks of a layout: a conversion into that same layout
    copies them (it dropped them, and the resume said they belonged to another layout)."""
    from megapar.checkpoint.distributed import load_checkpoint

    src = save_serial(tmp_path / "src")
    out = convert_checkpoint(tmp_path / "src", tmp_path / "dst", 1, 1, progress=False)
    manifest = read_manifest(out)
    assert manifest["files"][RNG_FILE] == read_manifest(src)["files"][RNG_FILE]
    assert "rng_note" not in manifest["meta"]
    assert file_tensors(out / RNG_FILE).keys() == file_tensors(src / RNG_FILE).keys()
    mesh = Mesh(Layout())
    state = load_checkpoint(out, build_stage(tiny_config("gpt2"), mesh, seed=1), mesh)
    assert state.rng is not None and state.notes == []
    original = load_checkpoint(src, build_stage(tiny_config("gpt2"), mesh, seed=1), mesh)
    assert state.rng.keys() == original.rng.keys()
    assert all(torch.equal(state.rng[k], original.rng[k]) for k in state.rng)


def test_cli_convert_and_info(tmp_path, capsys, monkeypatch):
    """SRC, DST and --info written '~/x' (quoted) are under the home directory: DST '~/dst'
    was written to ./~/dst."""
    save_serial(tmp_path / "src")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["~/src", "~/dst", "--tp", "2", "--pp", "4", "--no-progress"]) == 0
    assert "tp=2 pp=4" in capsys.readouterr().out
    assert not (tmp_path / "~").exists()
    assert main(["--info", "~/dst", "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "layout      tp=2 pp=4 dp=1" in out and "step        3" in out
    assert "gpt2 (4 layers, hidden 32, vocab 101)" in out
    assert "model_tp01_pp03.safetensors" in out and "exp_avg, exp_avg_sq" in out
    n_params = sum(w.numel() for w in canonical_state(tmp_path / "src")[0].values())
    assert f"{n_params:,} parameters" in out
    assert "layers.3.mlp.fc.weight" in out and "128x32" in out
    manifest = json.loads((resolve_checkpoint(tmp_path / "dst") / "manifest.json").read_text())
    assert checkpoint_info(tmp_path / "dst").count(".safetensors") == len(manifest["files"])
    # the total is the step's bytes on disk, its manifest too (it left out 17.6 KB of a
    # 4-layer GPT-2's: a long-run tryout's finding at stop 85)
    step = resolve_checkpoint(tmp_path / "dst")
    on_disk = sum(p.stat().st_size for p in step.iterdir())
    assert f"  {'total':32s} {on_disk:>14,} bytes" in out, out
    assert "manifest.json" in out and "manifest.sha256" in out


def test_a_full_disk_is_one_line_naming_the_destination(tmp_path, capsys, monkeypatch):
    """A destination on a full disk said only "error: [Errno 28] No space left on device",
    exit 2 (bad input's); it names the destination, exit 1, and leaves nothing behind."""
    import errno

    from megapar.checkpoint import format as ckpt_format

    src = save_serial(tmp_path / "src")

    from megapar.checkpoint import hf

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_format.ShardWriter, "write", full)
    monkeypatch.setattr(hf, "save_file", full)
    for dst, argv in [(tmp_path / "tp2", ["--tp", "2"]), (tmp_path / "hf", ["--to-hf"])]:
        args = [str(src), *argv, str(dst)] if argv == ["--to-hf"] else [str(src), str(dst), *argv]
        assert main(args) == 1
        err = capsys.readouterr().err
        assert err.strip() == (
            f"megapar-convert: error: No space left on device while writing {dst}; nothing was "
            f"written (an output is renamed into place only when complete, so {dst} is as it "
            f"was); free space or choose another destination"
        ), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]

    def full_in_rust(*args, **kwargs):  # safetensors' and tokenizers' own exception types
        raise Exception("No space left on device (os error 28)")  # noqa: TRY002

    monkeypatch.setattr(hf, "save_file", full_in_rust)
    assert main([str(src), "--to-hf", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"megapar-convert: error: No space left on device while writing "
                          f"{tmp_path / 'hf'}; nothing was written") and "Traceback" not in err


def test_cli_usage_errors(tmp_path, capsys):
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert f"{tmp_path / 'a'}: no such checkpoint directory" in capsys.readouterr().err
    assert main([str(tmp_path / "a")]) == 2
    assert "expected SRC DST [--tp N] [--pp M], got 1 path(s)" in capsys.readouterr().err
    assert main(["--info", str(tmp_path / "nothing")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    save_serial(tmp_path / "src")
    assert main([str(tmp_path / "src"), "--to-hf", str(tmp_path / "hf"), "--tp", "2"]) == 2
    assert "--tp and --pp are not used with --to-hf" in capsys.readouterr().err
    assert main([str(tmp_path / "src"), str(tmp_path / "b"), "--tp", "0"]) == 2
    assert "--tp 0: a parallel size is at least 1" in capsys.readouterr().err
    # an option the mode does not read is refused, not ignored (each used to convert / export
    # as if it were not there)
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    for argv, words in [([src, out, "--tensors"], "--tensors is used only with --info CKPT; to "
                         f"describe a checkpoint run megapar-convert --info {src} --tensors, to "
                         "convert drop --tensors"),
                        (["--fast", "--tensors"], "--tensors and --fast are used only with --info "
                         "CKPT; to describe a checkpoint run megapar-convert --info CKPT --tensors "
                         "--fast, to convert drop --tensors --fast"),
                        ([src, out, "--seed", "3"], "--seed is used only with --from-hf"),
                        ([src, "--to-hf", out, "--dp", "2"], "--dp is used only where a checkpoint"),
                        (["--info", src, "--overwrite"], "--overwrite is not used with --info"),
                        (["--info", src, "--tp", "2"], "--tp and --pp are not used with --info"),
                        (["--info", src, "--pp", "2"], "--tp and --pp are not used with --info"),
                        ([src, "--to-dcp", out, "--tokenizer-rows"],
                         "--tokenizer-rows is used only with --to-hf (an export); drop "
                         "--tokenizer-rows"),
                        # --info printed the checkpoint and ignored them (a new user's finding);
                        # then named all four export flags, not the ones given (a re-test's)
                        (["--info", src, "--dtype", "bf16"],
                         "--dtype is used only with --to-hf (an export); drop --dtype"),
                        (["--info", src, "--dtype", "bf16", "--tokenizer", "gpt2"],
                         "--tokenizer and --dtype are used only with --to-hf (an export); drop "
                         "them")]:
        assert main(argv + ["--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("megapar-convert: error: ") and words in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    # --tokenizer-rows of a BERT: it cuts a causal LM's rows only, so it exported all of them
    # without a word
    bert = str(tmp_path / "bert")
    save_serial(bert, kind="bert")
    assert main([bert, "--to-hf", out, "--tokenizer-rows", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists(), err
    assert "--tokenizer-rows applies to a causal LM" in err and "this is a bert" in err, err
    # --to-hf into a checkpoint (root or step) mixed a transformers model into it
    step = resolve_checkpoint(src)
    for into in (src, str(step)):
        assert main([src, "--to-hf", into]) == 2
        assert (f"cannot export into {into}: it holds a megapar checkpoint"
                in capsys.readouterr().err)
        assert not (step / "config.json").exists() and not (tmp_path / "src" / "config.json").exists()
    # `--info | head` (stdout closed while printing) said "error: [Errno 32] Broken pipe", exit 2
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-u", "-c", "import sys; from megapar.cli.convert "
                               f"import main; sys.exit(main(['--info', {src!r}, '--fast']))"],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (1, ""), done.stderr
    # ... and into a directory inside one (it was written among the step's files)
    for into in (step / "hf", tmp_path / "src" / "hf"):
        assert main([src, "--to-hf", str(into)]) == 2
        err = capsys.readouterr().err
        assert f"cannot export into {into}: it is inside the megapar checkpoint" in err, err
        assert len(err.strip().splitlines()) == 1 and not into.exists()
    # ... and --to-dcp too (it wrote one inside the step directory)
    llama = tmp_path / "llama"
    save_serial(llama, kind="llama")
    lstep = resolve_checkpoint(llama)
    assert main([str(llama), "--to-dcp", str(lstep / "x")]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {lstep / 'x'}: it is inside the megapar checkpoint" in err, err
    assert not (lstep / "x").exists()
    # an output that is its own source, with --overwrite: the source was deleted (--from-hf HF
    # HF turned the transformers directory into a checkpoint; --to-dcp SRC SRC the reverse),
    # a new user's finding; refused, the source untouched
    hf = tmp_path / "hf_src"
    assert main([src, "--to-hf", str(hf), "--no-progress"]) == 0
    capsys.readouterr()
    for argv, shown in ((["--from-hf", str(hf), str(hf)], f"{hf} is the source"),
                        ([str(lstep), "--to-dcp", str(llama)],
                         f"{llama} holds the source {lstep}")):
        assert main([*argv, "--overwrite", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"megapar-convert: error: {shown}: writing there would delete" in err, err
    assert (hf / "config.json").exists() and resolve_checkpoint(llama) == lstep
    # an import of a directory without a tokenizer says so (it had recorded none silently)
    assert main(["--from-hf", str(hf), str(tmp_path / "back"), "--no-progress"]) == 0
    assert (f"note: {hf} holds no tokenizer (tokenizer.json, vocab.json + merges.txt, or "
            f"tokenizer.model), so the checkpoint records none") in capsys.readouterr().out
    # the line names the layout written, its dp too (it said tp and pp: a guide re-test)
    assert main(["--from-hf", str(hf), str(tmp_path / "dp2"), "--dp", "2", "--no-progress"]) == 0
    assert "(tp=1 pp=1 dp=2, step 0, no optimizer state)" in capsys.readouterr().out


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C during a conversion printed KeyboardInterrupt's traceback."""
    import megapar.cli.convert

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(megapar.cli.convert, "run", interrupted)
    assert main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 130
    err = capsys.readouterr().err
    assert err.startswith("megapar-convert: interrupted; nothing was written")
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("name,said", [("SIGTERM", "terminated (SIGTERM)"),
                                       ("SIGHUP", "hung up (SIGHUP)"), ("SIGQUIT", "quit (SIGQUIT)"),
                                       ("SIGUSR2", "ended (SIGUSR2)")])
def test_sigterm_is_one_line_exit_143_and_leaves_no_staging_directory(tmp_path, name, said):
    """A SIGTERM (timeout, a scheduler) in the middle of the writes ended the process at once:
    exit -15 without a word, and the hidden staging directory with the shards written so far
    left beside DST until the next conversion into it. SIGHUP (a closed terminal), SIGQUIT and
    SIGUSR2 likewise (a re-test: they ended it without a word), with 128 + their number."""
    import signal

    import megapar.checkpoint.convert as convert_module

    sig = getattr(signal, name)

    save_serial(tmp_path / "src")
    out = tmp_path / "out.txt"
    write = convert_module.ShardWriter.write

    def write_then_sigterm(self, *args, **kwargs):
        write(self, *args, **kwargs)
        os.kill(os.getpid(), sig)

    def run():  # in the child
        convert_module.ShardWriter.write = write_then_sigterm
        return main([str(tmp_path / "src"), str(tmp_path / "dst"), "--tp", "2", "--no-progress"])

    code = exit_code(fork_running(run, out))
    err = out.read_text()
    assert code == 128 + sig, err
    assert err.startswith(f"megapar-convert: {said}; nothing was written"), err
    assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt", "src"]


def test_from_hf_says_what_the_path_is_instead(tmp_path, capsys):
    """--from-hf of a path that is not a transformers directory: a missing one, a file, weights
    without a config.json and a megapar checkpoint (root or step) are each named as such, with
    what to do instead; the
    commands it suggests quote a path with a space ('out dir'), as a shell needs it."""
    save_serial(tmp_path / "ckpt")
    save_serial(tmp_path / "out dir")
    (tmp_path / "file.txt").write_text("text")
    (tmp_path / "empty").mkdir()
    step = resolve_checkpoint(tmp_path / "ckpt")
    nothere, file, empty = tmp_path / "nothere", tmp_path / "file.txt", tmp_path / "empty"
    weights = tmp_path / "z2f"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    cases = [(nothere, (f"{nothere}: no such directory; pass a transformers directory "
                        f"written by save_pretrained")),
             (file, (f"{file} is a file, not a directory; pass the transformers directory "
                     f"written by save_pretrained that holds it")),
             (empty, (f"{empty}: no config.json; expected a transformers directory written "
                      f"by save_pretrained")),
             # DeepSpeed's zero_to_fp32 output: was "no config.json", as for the empty one
             (weights, (f"{weights} holds model.safetensors but no config.json (a state dict "
                        f"alone, as DeepSpeed's zero_to_fp32.py writes); copy the config.json "
                        f"of the model it was trained as there"))]
    cases += [(ck, (f"{ck} is a megapar checkpoint, not a transformers directory: pass it to "
                    f"--load (megapar-train, megapar-eval), reshard it with megapar-convert "
                    f"{shlex.quote(str(ck))} DST --tp N --pp M, or export it with "
                    f"megapar-convert {shlex.quote(str(ck))} --to-hf HF_DIR"))
              for ck in (tmp_path / "ckpt", step, tmp_path / "out dir")]
    for path, message in cases:
        assert main(["--from-hf", str(path), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"megapar-convert: error: {message}", err
    assert not (tmp_path / "out").exists()


def test_from_hf_of_a_hub_id_says_nothing_is_downloaded(tmp_path, capsys, monkeypatch):
    """--from-hf meta-llama/Llama-3.2-1B (or gpt2), a hub id where no such directory is, said
    "no such directory" alone: it now says megapar downloads nothing and how to save a copy. A
    local name that is no hub name keeps the plain line."""
    monkeypatch.chdir(tmp_path)
    for hub in ("meta-llama/Llama-3.2-1B", "gpt2"):
        assert main(["--from-hf", hub, "out"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"megapar-convert: error: {hub}: no such directory, and megapar downloads "
                       f"nothing (a Hugging Face Hub id is read from a saved copy: "
                       f"from_pretrained({hub!r}).save_pretrained(DIR) where the hub can be "
                       f"reached, then --from-hf DIR)"), err
    for address in ("hf://gpt2", "https://huggingface.co/gpt2"):  # Path made it hf:/gpt2
        assert main(["--from-hf", address, "out"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"megapar-convert: error: {address} is an address, and megapar downloads nothing: "
            f"save the model with save_pretrained(DIR) where it can be reached, then pass DIR")
    (tmp_path / "meta-llama").mkdir()  # a local folder of that name: a path, not a hub id
    for path in ("meta-llama/Llama-3.2-1B", "my_hf_copy"):
        assert main(["--from-hf", path, "out"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"megapar-convert: error: {path}: no such directory; pass a transformers directory "
            f"written by save_pretrained")
    assert not (tmp_path / "out").exists()


class _RunsCode:
    """Pickles as a call of os.system: what a hostile DeepSpeed file could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_deepspeed_checkpoint_is_refused_naming_zero_to_fp32(tmp_path, capsys):
    """A DeepSpeed checkpoint (a root whose `latest` names global_stepN, a global_stepN
    directory of *_model_states.pt / *_optim_states.pt pickles, or one of those files), given to
    --from-hf, --load or megapar-convert, is one line naming DeepSpeed's zero_to_fp32.py and the
    --from-hf import (it was "a megapar checkpoint", "latest holds 'global_step2'", "no
    config.json"); no pickle is loaded."""
    from megapar.cli.train import main as train_main

    root, marker = tmp_path / "ds", tmp_path / "ran"
    (root / "global_step2").mkdir(parents=True)
    (root / "latest").write_text("global_step2")
    (root / "zero_to_fp32.py").write_text("")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"module": _RunsCode(marker)}, root / "global_step2" / name)
    how = (f"(mp_rank_00_model_states.pt: pickles, which megapar never loads), not a megapar "
           f"checkpoint; consolidate it with DeepSpeed's zero_to_fp32.py (python "
           f"{root}/zero_to_fp32.py {root} OUT_DIR --safe_serialization), copy the model's "
           f"config.json into OUT_DIR, then megapar-convert --from-hf OUT_DIR CKPT_DIR")
    step, file = root / "global_step2", root / "global_step2" / "mp_rank_00_model_states.pt"
    said = {root: f"{root} holds a DeepSpeed checkpoint (global_step2/" + how[1:],
            step: f"{step} holds a DeepSpeed checkpoint " + how,
            file: f"{file} is a file of a DeepSpeed checkpoint " + how}
    for path, message in said.items():
        for argv in (["--from-hf", str(path), str(tmp_path / "out")],
                     [str(path), str(tmp_path / "out"), "--tp", "1"]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err.strip()
            assert err == f"megapar-convert: error: {message}", err
        assert train_main(["--load", str(path), "--max-steps", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"megapar-train: error: --load {message}", err
    # a step `latest` does not name is read by --tag, and a universal checkpoint (ds_to_universal's
    # zero/) not by zero_to_fp32.py at all: the hint consolidated the latest step, or could not
    # run (a checkpoint review's finding)
    for name in ("global_step1", "global_step2_universal"):
        (root / name).mkdir()
        torch.save({"module": _RunsCode(marker)}, root / name / "mp_rank_00_model_states.pt")
    (root / "global_step2_universal" / "zero").mkdir()
    assert main(["--info", str(root / "global_step1")]) == 2
    assert (f"zero_to_fp32.py {root} OUT_DIR --tag global_step1 --safe_serialization"
            in capsys.readouterr().err)
    assert main(["--info", str(root / "global_step2_universal")]) == 2
    err = capsys.readouterr().err
    assert "a DeepSpeed universal checkpoint, which zero_to_fp32.py does not read" in err, err
    # a root without `latest` (or naming a step not there): the newest step by its number,
    # not by its name's spelling (global_step9 was taken over global_step10), and not a
    # universal one, by --tag
    (root / "global_step10").mkdir()
    torch.save({"module": _RunsCode(marker)}, root / "global_step10" / "mp_rank_00_model_states.pt")
    for latest in (None, "global_step7"):
        if latest is None:
            (root / "latest").unlink()
        else:
            (root / "latest").write_text(latest)
        assert main(["--info", str(root)]) == 2
        err = capsys.readouterr().err
        assert f"{root} OUT_DIR --tag global_step10 --safe_serialization" in err, (latest, err)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_from_hf_of_a_model_megapar_does_not_build(tmp_path, capsys):
    """--from-hf of a transformers directory of another model type (a GPT-NeoX, an OPT, one
    without `architectures`): megapar-convert and megapar-train each refuse it in one line
    naming the directory, its architecture and the ones megapar trains, before any worker
    starts, writing nothing."""
    from megapar.cli.train import main as train

    trains = ("GPT2LMHeadModel / BertForMaskedLM / LlamaForCausalLM / MixtralForCausalLM / "
              "Qwen3MoeForCausalLM / Qwen3ForCausalLM / Qwen2ForCausalLM / MistralForCausalLM / "
              "DeepseekV3ForCausalLM checkpoints")
    cases = [("neox", {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]},
              "GPTNeoXForCausalLM (model_type 'gpt_neox')"),
             ("opt", {"model_type": "opt", "architectures": ["OPTForCausalLM"]},
              "OPTForCausalLM (model_type 'opt')"),
             ("bare", {"hidden_size": 64}, "its model (model_type None)")]
    for name, config, what in cases:
        hf = tmp_path / name
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps(config))
        message = f"{hf}: {what} is not a model megapar builds; it trains {trains}"
        assert main(["--from-hf", str(hf), str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err.strip() == f"megapar-convert: error: {message}"
        assert train(["--from-hf", str(hf), "--save", str(tmp_path / "ckpt"),
                      "--data-cache", str(tmp_path / "cache")]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"megapar-train: error: {message}", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "neox", "opt"]


@pytest.mark.parametrize("short, full", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                         ("fp32", torch.float32)])
def test_to_hf_dtype_takes_the_short_names(tmp_path, capsys, short, full):
    """--dtype bf16 / fp16 / fp32 (the names --precision takes) are bfloat16 / float16 /
    float32."""
    from safetensors.torch import load_file

    save_serial(tmp_path / "src")
    assert main([str(tmp_path / "src"), "--to-hf", str(tmp_path / "hf"), "--dtype", short]) == 0
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {full}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == \
        str(full).removeprefix("torch.")
    with pytest.raises(SystemExit) as refused:  # argparse's usage error
        main([str(tmp_path / "src"), "--to-hf", str(tmp_path / "no"), "--dtype", "bf17"])
    assert refused.value.code == 2
    # the choices named the long names only, though the short ones are taken too
    assert ("argument --dtype: invalid choice: 'bf17' (choose from float32, bfloat16, float16, "
            "or their short names fp32, bf16, fp16)") in capsys.readouterr().err


def test_a_size_not_given_keeps_the_sources(tmp_path, capsys):
    save_serial(tmp_path / "src")
    assert main([str(tmp_path / "src"), str(tmp_path / "tp2"), "--tp", "2", "--pp", "2",
                 "--no-progress"]) == 0
    assert main([str(tmp_path / "tp2"), str(tmp_path / "pp4"), "--pp", "4", "--no-progress"]) == 0
    assert "tp=2 pp=4" in capsys.readouterr().out
    assert read_manifest(tmp_path / "pp4")["layout"] == {"tp": 2, "pp": 4, "dp": 1}


def test_a_root_a_live_run_saves_into_is_never_replaced(tmp_path, capsys):
    """--overwrite replaces a finished checkpoint, never the --save root of a live run (its
    checkpoints and its lock would be gone, and a second writer let in)."""
    from megapar.checkpoint.lock import SaveLock

    save_serial(tmp_path / "src")
    save_serial(tmp_path / "live")
    before = sorted(p.name for p in (tmp_path / "live").iterdir())
    with SaveLock(tmp_path / "live"):
        assert main([str(tmp_path / "src"), str(tmp_path / "live"), "--tp", "2", "--pp", "1",
                     "--overwrite", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is in use by another run" in err, err
        assert "or give another DST" in err and "another --save" not in err, err  # convert's
        assert sorted(p.name for p in (tmp_path / "live").iterdir()) == sorted(
            [*before, "megapar.lock"])
    assert main([str(tmp_path / "src"), str(tmp_path / "live"), "--tp", "2", "--pp", "1",
                 "--overwrite", "--no-progress"]) == 0  # the run has ended: replaced


def _to_separate_qkv(step_dir, heads):
    """Rewrite a checkpoint in place as megapar wrote it before q, k, v were fused: separate
    ``attn.q/k/v`` tensors, each tp shard holding its heads' rows of each."""
    from megapar.checkpoint.format import MANIFEST, file_record, write_tensors
    from megapar.tensor_parallel.partition import unfuse_heads

    manifest = json.loads((step_dir / MANIFEST).read_text())
    tp = manifest["layout"]["tp"]
    for fname in [f for f in manifest["files"] if f.startswith("model_")]:
        tensors = {}
        for key, value in file_tensors(step_dir / fname).items():
            value = value.clone()  # the file is about to be overwritten
            if ".attn.qkv." not in key:
                tensors[key] = value
                continue
            for x, part in zip("qkv", unfuse_heads(value, heads // tp)):
                tensors[key.replace(".attn.qkv.", f".attn.{x}.")] = part
        write_tensors(step_dir / fname, tensors)
        manifest["files"][fname] = file_record(step_dir / fname)
    for name in [n for n in manifest["tensors"] if ".attn.qkv." in n]:
        e = manifest["tensors"].pop(name)
        third = lambda shape: [shape[0] // 3, *shape[1:]]  # noqa: E731
        for x in "qkv":
            manifest["tensors"][name.replace(".qkv.", f".{x}.")] = dict(
                e, full_shape=third(e["full_shape"]), local_shape=third(e["local_shape"]))
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    (step_dir / "manifest.sha256").unlink(missing_ok=True)  # old checkpoints had none


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_checkpoint_with_separate_qkv_still_loads_converts_and_exports(tmp_path, kind):
    """Checkpoints written before the fused QKV projection read as the fused tensors."""
    from megapar.checkpoint.distributed import load_checkpoint
    from megapar.checkpoint.export import export_hf

    src = save_serial(tmp_path / "src", kind)
    weights, moments = canonical_state(src)
    old = convert_checkpoint(src, tmp_path / "old", 2, 2, progress=False)
    _to_separate_qkv(old, 4)
    assert "layers.0.attn.q.weight" in json.loads((old / "manifest.json").read_text())["tensors"]
    old_weights, old_moments = canonical_state(old)
    assert_same(old_weights, weights, "weights read from separate q, k, v")
    assert_same(old_moments, moments, "moments read from separate q, k, v")
    hop = convert_checkpoint(old, tmp_path / "hop", 4, 1, progress=False)
    assert_same(canonical_state(hop)[0], weights, "converted weights")
    model = build_stage(tiny_config(kind), Mesh(Layout()), seed=0)
    state = load_checkpoint(old, model, Mesh(Layout()))
    assert_same(gather_canonical(model), weights, "loaded weights")
    assert torch.equal(state.optim_tensors["layers.1.attn.qkv.weight"]["exp_avg"],
                       moments["layers.1.attn.qkv.weight"]["exp_avg"])
    export_hf(old, tmp_path / "hf")
    export_hf(src, tmp_path / "hf_new")
    assert_same(file_tensors(tmp_path / "hf" / "model.safetensors"),
                file_tensors(tmp_path / "hf_new" / "model.safetensors"), "exported HF tensors")


def test_resuming_a_converted_checkpoint_says_why_rng_states_are_missing(tmp_path):
    """The note used to read "the checkpoint has none RNG states of the tp=1 pp=4 dp=1 ranks
    were dropped by megapar-convert (they belong to ranks)"."""
    from megapar.checkpoint.distributed import load_checkpoint, missing_rng_note

    save_serial(tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "pp4", 1, 4, progress=False)
    convert_checkpoint(tmp_path / "pp4", tmp_path / "back", 1, 1, progress=False)
    meta = read_manifest(tmp_path / "back")["meta"]
    # the RNG states were those of the first checkpoint's ranks (1x1); the second hop keeps it
    assert meta["rng_note"] == ("megapar-convert dropped the RNG states of the tp=1 pp=1 dp=1 "
                                "ranks (they belong to the ranks of that layout)")
    mesh = Mesh(Layout())
    state = load_checkpoint(tmp_path / "back", build_stage(tiny_config("gpt2"), mesh, seed=1), mesh)
    assert state.rng is None
    assert state.notes == ["RNG states not restored: megapar-convert dropped them (they belong "
                           "to the ranks of the old layout); dropout masks differ from an "
                           "uninterrupted run"]
    # in another layout too: the states were dropped, the layout is not why (pp 4 -> 1)
    state = load_checkpoint(tmp_path / "pp4", build_stage(tiny_config("gpt2"), mesh, seed=1), mesh)
    assert state.rng is None and state.notes[0].startswith(
        "RNG states not restored: megapar-convert dropped them"), state.notes
    # an HF import, and a checkpoint saved without RNG states: one sentence each too
    assert missing_rng_note({"imported_from_hf": "/x", "rng_note": "imported from Hugging "
                             "Face: no RNG states, no optimizer state"}) == (
        "RNG states not restored: the checkpoint was imported from Hugging Face, which saves "
        "none; dropout is seeded from --seed")
    assert missing_rng_note({}) == ("RNG states not restored: the checkpoint has none; dropout "
                                    "masks differ from an uninterrupted run")


def test_info_says_a_checkpoint_was_trained_under_fp8(tmp_path, capsys):
    """--info showed nothing of a run's --fp8, which a --load takes (recipe and layers rule):
    its line comes from the recorded train_config; a run without fp8 has none."""
    trained = {"fp8": "rowwise", "fp8_layers": "all", "precision": "bf16"}
    save_serial(tmp_path / "fp8", meta={"consumed_samples": 96, "train_config": trained})
    save_serial(tmp_path / "plain", meta={"consumed_samples": 96, "train_config": {"fp8": "off"}})
    assert main(["--info", str(tmp_path / "fp8"), "--fast"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("fp8 ")]
    assert lines == ["fp8         trained under --fp8 rowwise --fp8-layers all (a --load takes "
                     "both; the weights are stored in the master dtype)"], lines
    assert "\nfp8 " not in checkpoint_info(tmp_path / "plain", checksums=False)
