"""Offline checkpoint conversion (one process, no process group): another tp x pp layout,
Hugging Face import, and a summary of a checkpoint (the export: `megapar.checkpoint.export`).

Conversion streams one canonical tensor at a time: every target shard file is laid out up
front (`ShardWriter`), then for each tensor the target shards are assembled from the slices of
the source shards they overlap and written in place. Peak memory is about one tensor (plus its
target shard), whatever the model size. The output is built in a hidden sibling directory of
DST and renamed at the end, so a failure leaves DST untouched.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import math
import os
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from megapar.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    RNG_FILE,
    CheckpointError,
    CheckpointFileError,
    ShardReader,
    ShardWriter,
    dtype_from_name,
    dtype_name,
    file_record,
    fsync_dir,
    probe_writable,
    shard_file_name,
    staging_dir,
    step_dir_name,
)
from megapar.checkpoint.hf import HFReader, causal_rows
from megapar.checkpoint.hf_names import DEEPSEEK_ROUTER_TYPES
from megapar.checkpoint.lock import SaveLockError, check_unlocked
from megapar.checkpoint.manifest import DIGEST, verify, write_manifest
from megapar.checkpoint.publish import resolve_checkpoint, set_latest
from megapar.checkpoint.stage_tensors import is_routed_expert, saved_expert, stage_tensors
from megapar.data.hf_tokenizer import transformers_difference
from megapar.data.preprocess import file_sha256
from megapar.data.tokenizers import hf_dir_tokenizer, load_tokenizer, tokenizer_files
from megapar.faults.processes import owner_tag, remove_stale_temporaries, stale_temporaries
from megapar.mesh import Layout, LayoutError, Mesh
from megapar.models.config import CAUSAL_LM_TYPES, config_from_dict
from megapar.one_line_parser import shell_word
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import shard_of, unpad
from megapar.wording import counted

Fill = Callable[[str, "str | None", int, "int | None"], torch.Tensor]


def plan(config, layout: Layout) -> dict[str, dict]:
    """Manifest entries of every canonical tensor in `layout`, from meta-device stages (the
    parameters, then the buffers: `stage_tensors`); a routed expert's stack split along its
    experts over the tp files, as a run saves it (`saved_expert`)."""

    try:
        config.validate(layout)
    except LayoutError as exc:
        raise LayoutError(f"the model cannot take layout {layout}: {exc}") from exc
    entries: dict[str, dict] = {}
    grid = Layout(layout.tp, layout.pp, 1)
    for p in range(layout.pp):
        stage = build_stage(config, Mesh.virtual(grid, grid.rank(0, p, 0)), seed=0, init=False)
        for name, param, buffer in stage_tensors(stage):
            if hasattr(param, "tied_to"):
                continue
            full, dim = (
                list(getattr(param, "full_shape", param.shape)),
                getattr(param, "tp_dim", None),
            )
            local = list(param.shape)
            if is_routed_expert(param):  # split along its experts over the tp files
                dim, local = saved_expert(full, layout.tp)
            entries[name] = {
                "full_shape": full,
                "tp_dim": dim,
                "local_shape": local,
                "dtype": dtype_name(param.dtype),
                "stage": p,
                "optim": {},
                **({"buffer": True} if buffer else {}),
            }
    return entries


def _local(entry: dict) -> int | None:
    dim = entry["tp_dim"]
    return None if dim is None else entry["local_shape"][dim]


def output_dir(dst) -> Path:
    """Output `dst` as written: through a symbolic link to a directory, the directory (the
    link stays, naming the new output); a link was refused as "not a megapar checkpoint",
    where --to-hf and megapar-train --save take one."""
    path = Path(dst).expanduser()
    return path.resolve() if path.is_symlink() and path.is_dir() else path


def _refuse_existing(
    dst: Path, overwrite: bool, marks: tuple[str, ...] = (LATEST,), kind: str = "megapar checkpoint"
) -> None:
    """Refuse a `dst` that exists (unless `overwrite`) or that a live run saves into (always:
    replacing it would delete that run's checkpoints and its lock). Only an output of the
    same `kind` (a directory holding one of `marks`: a checkpoint root's `latest`) or an empty
    directory is replaced: anything else is refused, `overwrite` or not. First a `dst` a
    conversion killed midway left aside is put back (`recover_swap`, saying so on stderr). An
    empty directory is taken without `overwrite`: nothing in it is replaced."""
    note = recover_swap(dst)
    if note is not None:
        print(f"note: {note}", file=sys.stderr)
    try:
        check_unlocked(dst, other="give another DST")
    except SaveLockError as exc:
        raise CheckpointError(f"cannot replace {dst}: {exc}") from None
    if not os.path.lexists(dst):
        return
    if dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir()):
        return  # an empty directory (one made for the output): nothing to replace
    if dst.is_dir() and (dst / MANIFEST).is_file() and LATEST in marks:
        raise CheckpointError(
            f"{dst} is a checkpoint's step directory (it holds {MANIFEST}), not a checkpoint "
            f"root; give the root that holds it ({dst.parent}), with --overwrite to replace "
            f"that checkpoint, or another DST"
        )
    if dst.is_symlink() or not dst.is_dir():
        what = "a symbolic link" if dst.is_symlink() else "a file"
    elif any((dst / m).is_file() for m in marks):
        what = None
    else:
        names = sorted(p.name for p in itertools.islice(dst.iterdir(), 4))
        shown = ", ".join(names[:3]) + (", ..." if names[3:] else "")
        what = f"a directory of other files ({shown})"
    if what is not None:
        raise CheckpointError(
            f"{dst} is {what}, not a {kind}: --overwrite replaces only a {kind} (or an "
            f"empty directory); give another DST"
        )
    if not overwrite:
        raise CheckpointError(
            f"{dst} already exists; pass --overwrite to replace it (it is "
            f"replaced only once the new output is complete)"
        )


def _checkpoint_above(path: Path) -> Path | None:
    """The nearest directory above `path` that is a checkpoint root or step directory (holds
    `latest` or a manifest), or None."""
    return next(
        (a for a in path.resolve().parents if any((a / n).is_file() for n in (MANIFEST, LATEST))),
        None,
    )


def check_output(path, into: bool = False) -> None:
    """Raise CheckpointError (naming `path` and the fix) unless the output `path` can be
    written, before any source is read: a checkpoint root is built beside it (in its parent,
    then renamed), a transformers export (`into`) inside it. The directory that must take the
    files is created as the conversion would, and a probe file is written and removed there."""
    target = Path(path).expanduser()
    if into and target.exists() and not target.is_dir():
        raise CheckpointError(
            f"cannot create {path}: it is a file, and the export is a "
            f"directory; choose another path"
        )
    held = [n for n in (MANIFEST, LATEST) if into and (target / n).is_file()]
    if held:  # a root or step directory: the export's files would sit among the checkpoint's
        raise CheckpointError(
            f"cannot export into {path}: it holds a megapar checkpoint ({', '.join(held)}), "
            f"and the transformers files would be mixed into it; choose another directory"
        )
    outer = _checkpoint_above(target)
    if outer is not None:  # its step directories would hold, or sit beside, the output
        what = "the transformers files" if into else "the written checkpoint"
        raise CheckpointError(
            f"cannot {'export into' if into else 'write'} {path}: it is inside the megapar "
            f"checkpoint {outer}, and {what} would be mixed into it; choose a directory "
            f"outside it"
        )
    directory = target if into else target.parent
    try:
        probe_writable(directory)
    except OSError as exc:
        where = exc.filename or directory  # the part that failed, e.g. /proc/x of /proc/x/y
        if os.path.basename(str(where)).startswith(".megapar-probe-"):  # its probe's directory
            where = os.path.dirname(str(where))  # (the probe's own name was said; a re-test)
        why = (
            "is a file, not a directory"
            if isinstance(exc, FileExistsError)
            else "no file can be created in it"  # (/proc's "No such file or directory")
            if exc.errno == errno.ENOENT and os.path.isdir(str(where))
            else f"{exc.strerror or exc}"
        )
        sep = " " if isinstance(exc, FileExistsError) else ": "
        raise CheckpointError(
            f"cannot create {path}: {where}{sep}{why}; choose a writable directory"
        ) from None


def recover_swap(dst: Path) -> str | None:
    """Undo what a `_swap_into` killed -9 between its two renames left of `dst`: the old `dst`
    it had moved aside (``.DST.old-PID-HOST-...`` of a process gone) is put back where `dst` is
    missing (the newest, where there are several), so `dst` is as it was. None is removed
    here (beside a `dst` in place, one is an earlier `dst`: the user's to remove). Call before
    checking `dst`; returns a note where it put one back or keeps one beside `dst`, else
    None."""
    name = os.path.basename(os.path.abspath(dst))  # out/../out: out
    parent = Path(os.path.realpath(os.path.dirname(os.path.abspath(dst))))  # as _swap_into's
    stale = sorted(
        stale_temporaries(parent, f".{name}.old-"),
        key=lambda n: os.lstat(parent / n).st_ctime,  # when it was moved aside
    )
    if not stale:
        return None
    if os.path.lexists(parent / name):  # an earlier DST: never removed unasked, never unsaid
        return (
            f"{dst}: {counted(len(stale), 'earlier copy', 'earlier copies')} a killed "
            f"conversion moved aside {'is' if len(stale) == 1 else 'are'} kept beside it: "
            f"{', '.join(stale)} (in {parent}); remove {'it' if len(stale) == 1 else 'them'} "
            f"when no longer needed"
        )
    os.rename(parent / stale.pop(), parent / name)
    earlier = f"; earlier ones it had moved aside stay beside it: {', '.join(stale)}"
    return f"{dst}: put back as it was (a conversion into it was killed midway)" + (
        earlier if stale else ""
    )


def _swap_into(tmp: Path, dst: Path) -> None:
    """Move a finished output to `dst`, replacing an existing `dst` only at the very end (moved
    aside first, named with `owner_tag` for `recover_swap`, and back where the output cannot
    take its place)."""
    # both as the paths they name now: `dst` spelt through itself (out/../out) names nothing
    # once the old `dst` is moved aside
    tmp, dst = tmp.resolve(), dst.parent.resolve() / dst.name
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{owner_tag()}-{secrets.token_hex(4)}"
        os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException as exc:
        if old is not None:
            try:
                os.rename(old, dst)
            except OSError:
                raise CheckpointError(
                    f"{type(exc).__name__}: {exc}; and {dst} could not be put back: it is {old}"
                ) from exc
        raise
    fsync_dir(dst.parent)
    if old is not None and old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    elif old is not None:  # a file (or link) --overwrite replaced
        old.unlink(missing_ok=True)


def write_checkpoint(
    dst,
    step: int,
    layout: Layout,
    config,
    meta: dict,
    entries: dict[str, dict],
    fill: Fill,
    overwrite: bool = False,
    progress: bool = True,
    after_tensor: Callable[[], None] | None = None,
    copied: dict[str, Path] | None = None,
) -> Path:
    """Write checkpoint root `dst` (step dir + latest) tensor by tensor; returns the step dir.

    `fill(name, key, tp_rank, local)` gives one target shard (key None = weights). `meta` is
    written last, so `fill` may still add to it. `copied` names files copied into the step
    directory as they are (file name -> source path), listed in the manifest with the shards.
    """

    dst = output_dir(dst)
    _refuse_existing(dst, overwrite)
    check_output(dst)
    remove_stale_temporaries(dst.parent, f".{dst.name}.tmp-")  # of a conversion killed -9
    tmp = staging_dir(dst.parent, f".{dst.name}.tmp-{owner_tag()}-")
    writers: dict[tuple[int, int], ShardWriter] = {}
    try:
        step_dir = tmp / step_dir_name(step)
        step_dir.mkdir()
        for p in range(layout.pp):
            for t in range(layout.tp):
                specs = {}
                for name, e in entries.items():
                    if e["stage"] == p:
                        shape = tuple(e["local_shape"])
                        specs[f"model/{name}"] = (dtype_from_name(e["dtype"]), shape)
                        for key, dt in e["optim"].items():
                            specs[f"optim/{name}/{key}"] = (dtype_from_name(dt), shape)
                writers[t, p] = ShardWriter(step_dir / shard_file_name(t, p), specs)
        for name in tqdm(entries, desc=f"writing {layout}", unit="tensor", disable=not progress):
            e = entries[name]
            for t in range(layout.tp):
                writer = writers[t, e["stage"]]
                writer.write(f"model/{name}", fill(name, None, t, _local(e)))
                for key in e["optim"]:
                    writer.write(f"optim/{name}/{key}", fill(name, key, t, _local(e)))
            if after_tensor:
                after_tensor()
        for writer in writers.values():
            writer.close()
        files = {w.path.name: file_record(w.path) for w in writers.values()}
        for fname, source in (copied or {}).items():
            shutil.copyfile(source, step_dir / fname)
            files[fname] = file_record(step_dir / fname)
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "step": int(step),
            "layout": layout.to_dict(),
            "model": config.to_dict(),
            "meta": meta,
            "tensors": entries,
            "files": dict(sorted(files.items())),
        }
        write_manifest(step_dir, manifest)
        fsync_dir(step_dir)
        set_latest(tmp, step_dir.name)
        _refuse_existing(dst, overwrite)  # a run may have started saving there meanwhile
        _swap_into(tmp, dst)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst / step_dir_name(step)


def convert_checkpoint(
    src, dst, tp: int, pp: int, dp: int = 1, overwrite: bool = False, progress: bool = True
) -> Path:
    """Rewrite checkpoint `src` (ROOT or step dir) for layout tp x pp (x dp) as root `dst`.

    Weights and optimizer moments are resharded exactly; the manifest is carried over with the
    new layout (the source's ep and rank order kept where the new dp takes them). RNG states
    belong to ranks: they are copied into the same layout (the same tp, pp and dp keep the
    source's cp, ep and rank order too), and dropped (the fact noted in meta) into another."""
    step_dir = resolve_checkpoint(src)
    dst = output_dir(dst)
    if Path(dst).resolve() in (step_dir.resolve(), *step_dir.resolve().parents):
        raise CheckpointError(
            f"DST {dst} holds the source {step_dir}: converting a checkpoint "
            f"onto itself would delete it; give a new DST"
        )
    root = step_dir.resolve().parent  # the --save directory, where it is one
    if not ((root / LATEST).exists() or Path(src).resolve() == root):
        root = step_dir.resolve()  # a step directory kept on its own
    if Path(dst).resolve().is_relative_to(root):
        raise CheckpointError(
            f"DST {dst} is inside the source's checkpoint directory {root}: a checkpoint "
            f"written among another's step directories is mixed up with them; give a DST "
            f"outside it"
        )
    _refuse_existing(Path(dst), overwrite)
    check_output(dst)  # before the source is verified (sha256 of every file)
    manifest = verify(step_dir)
    config = config_from_dict(manifest["model"])
    layout = Layout(tp, pp, dp)
    if all(manifest["layout"].get(k, 1) == v for k, v in zip(("tp", "pp", "dp"), (tp, pp, dp))):
        layout = Layout(**manifest["layout"])  # a copy keeps the whole layout: its cp, ep, order
    else:  # its ep and rank order, which add no ranks, where the new dp still takes the ep
        kept = {k: manifest["layout"][k] for k in ("ep", "order") if k in manifest["layout"]}
        with contextlib.suppress(LayoutError):  # (it wrote tp=2 dp=2 of a dp=2 ep=2 source)
            layout = Layout(tp, pp, dp, **kept)
    source = manifest["tensors"]
    target = model_tensors(step_dir, manifest, layout)
    for name, e in target.items():
        e["dtype"], e["optim"] = source[name]["dtype"], dict(source[name]["optim"])
    meta = dict(manifest["meta"])
    meta["converted_from"] = {"path": str(step_dir), "layout": manifest["layout"]}
    rng = RNG_FILE in manifest["files"]
    same_layout = Layout(**manifest["layout"]) == layout
    if rng and not same_layout:
        meta["rng_note"] = (
            f"megapar-convert dropped the RNG states of the "
            f"{Layout(**manifest['layout'])} ranks (they belong to the ranks of "
            f"that layout)"
        )
    reader = ShardReader(step_dir, manifest)

    def fill(name, key, t, local):
        return reader.shard(name, key, tp, t, local, target[name]["tp_dim"])

    return write_checkpoint(
        dst,
        manifest["step"],
        layout,
        config,
        meta,
        target,
        fill,
        overwrite,
        progress,
        after_tensor=reader.release,
        copied={RNG_FILE: step_dir / RNG_FILE} if rng and same_layout else None,
    )


def recorded_tokenizer(spec) -> dict | None:
    """What a checkpoint records of a tokenizer (its spec and the sha256 of its files), or None
    when `spec` (e.g. a transformers directory without one) is not a loadable tokenizer."""

    try:
        tok = load_tokenizer(spec)
    except (OSError, ValueError):
        return None
    return _record_of(tok)


def _record_of(tok) -> dict:
    """A loaded tokenizer as a checkpoint records it: its spec, the id that starts each of its
    documents (None: none does) and its files' sha256."""
    return {
        **tok.spec(),
        "bos_id": tok.bos_id,
        "sha256": [file_sha256(p) for p in tokenizer_files(tok)],
    }


def _hf_dir_tokenizer(hf_dir, config) -> dict | None:
    """What the checkpoint imported from `hf_dir` records of the tokenizer that directory holds
    (`recorded_tokenizer`), as megapar-train --from-hf finds it (`hf_dir_tokenizer`: its
    tokenizer.json, vocab.json + merges.txt, or SentencePiece tokenizer.model); None where it
    holds none. CheckpointError for one that does not load (a damaged tokenizer.json), or whose
    ids the model `config`'s vocabulary lacks (as megapar-train --from-hf refuses it), before
    anything is written: recorded as none, raw text would later be refused as if the directory
    had had no tokenizer; recorded too large, every later command would fail on it."""
    spec = hf_dir_tokenizer(os.fspath(hf_dir))
    if spec is None:
        return None
    try:
        tok = load_tokenizer(spec)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{hf_dir}: its tokenizer does not load ({exc}); repair its tokenizer files, or "
            f"move them out to import the model without one"
        ) from None
    causal = config.model_type in CAUSAL_LM_TYPES  # reads no appended special token
    needed = causal_rows(tok) if causal else tok.vocab_size
    if config.vocab_size < needed:
        raise CheckpointError(
            f"{hf_dir}: its tokenizer has {needed:,} token ids, and its model a vocabulary of "
            f"{config.vocab_size:,}; put the model's own tokenizer there, or move its "
            f"tokenizer files out to import the model without one"
        )
    differs = transformers_difference(str(hf_dir), tok)
    if differs:  # as megapar-train --from-hf refuses it (`check_hf_tokenizer`)
        raise CheckpointError(
            f"{hf_dir}: transformers reads its tokenizer files otherwise than megapar does for "
            f"this model ({differs}), so the model's token ids and megapar's would differ; put "
            f"the model's own tokenizer there (AutoTokenizer.from_pretrained(<the model's "
            f"name>).save_pretrained({shell_word(str(hf_dir))})), or move its tokenizer files "
            f"out to import the model without one"
        )
    return _record_of(tok)


def _seeded(config, name: str, seed: int, stages: dict) -> torch.Tensor:
    """The full tensor `name` as `build_stage(..., seed)` initialises it (layout-independent):
    only the one-layer pipeline stage that holds it is built (and kept in `stages`)."""

    grid = Layout(1, config.num_layers, 1)
    stage = plan(config, grid)[name]["stage"]
    if stage not in stages:
        stages[stage] = build_stage(config, Mesh.virtual(grid, stage, device="cpu"), seed)
    param = dict(stages[stage].named_parameters())[name]
    return unpad(param.detach(), param.tp_dim, param.full_shape).clone()


def import_hf(
    hf_dir,
    dst,
    tp: int,
    pp: int,
    dp: int = 1,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
) -> tuple[Path, list[str]]:
    """A megapar checkpoint (step 0, no optimizer state) from a transformers directory.

    Tensors the HF model lacks outside its blocks (the MLM head of a plain BertModel; a block's
    are refused, `HFReader.check_files`) are initialised from `seed` exactly as training would;
    their names are returned and recorded in meta. Every tensor's
    shape is checked against the config first. The directory's ``generation_config.json``, if
    any, is recorded (meta ``hf_generation_config``), so that `export_hf` writes it back."""

    reader = HFReader(hf_dir)
    config, layout = reader.config, Layout(tp, pp, dp)
    target = {  # HF has no buffer but DeepSeek-V3's router bias (e_score_correction_bias)
        n: e
        for n, e in plan(config, layout).items()
        if not e.get("buffer") or config.model_type in DEEPSEEK_ROUTER_TYPES
    }
    reader.check_files()
    initialised: list[str] = []
    meta = {
        "imported_from_hf": str(Path(hf_dir).resolve()),
        "seed": seed,
        "initialised_from_seed": initialised,
        "hf_dtype": reader.dtype,
        "rng_note": "imported from Hugging Face: no RNG states, no optimizer state",
    }
    if reader.generation_config is not None:
        meta["hf_generation_config"] = reader.generation_config
    tokenizer = _hf_dir_tokenizer(hf_dir, config)
    if tokenizer is not None:
        meta["tokenizer"] = tokenizer
    current: dict[str, torch.Tensor] = {}
    stages: dict = {}

    def fill(name, key, t, local):
        if name not in current:
            current.clear()
            try:
                full = reader.canonical(name)
            except KeyError:
                full = _seeded(config, name, seed, stages)
                initialised.append(name)
            current[name] = full.to(dtype_from_name(target[name]["dtype"]))
        full = current[name]
        if list(full.shape) != target[name]["full_shape"]:
            raise CheckpointError(
                f"{hf_dir}: {name} has shape {list(full.shape)}, the config "
                f"implies {target[name]['full_shape']}"
            )
        return shard_of(full, target[name]["tp_dim"], local, t)

    path = write_checkpoint(dst, 0, layout, config, meta, target, fill, overwrite, progress)
    return path, initialised


def write_weights(
    reader, dst, layout: Layout, meta: dict, overwrite: bool = False, progress: bool = True
) -> Path:
    """Write checkpoint root `dst` at step 0 with `reader`'s weights alone (no optimizer
    state), in `layout`: each canonical tensor read once (`reader.canonical(name)`, its model
    `reader.config`), cast to its checkpoint dtype and cut into the layout's tp shards. The
    importers of torchtitan's and Megatron-LM's checkpoints write with it."""
    target = plan(reader.config, layout)
    current: dict[str, torch.Tensor] = {}

    def fill(name, key, t, local):
        if name not in current:
            current.clear()
            current[name] = reader.canonical(name).to(dtype_from_name(target[name]["dtype"]))
        return shard_of(current[name], target[name]["tp_dim"], local, t)

    return write_checkpoint(dst, 0, layout, reader.config, meta, target, fill, overwrite, progress)


def _some(names: list[str]) -> str:
    """Up to three of `names`, and how many more."""
    more = f", and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def model_tensors(step_dir, manifest: dict, layout: Layout | None = None) -> dict:
    """The tensors of the manifest's own model at `layout` (default: the checkpoint's), as
    `plan` lays them out; a CheckpointError where the manifest's tensors are not those (a
    manifest edited, its digest redone: a reader would fail on the one missing)."""
    config = config_from_dict(manifest["model"])
    source = manifest["tensors"]
    layout = layout or Layout(**manifest["layout"])
    target = {  # a checkpoint saved before buffers were kept has none
        n: e for n, e in plan(config, layout).items() if n in source or not e.get("buffer")
    }
    missing, extra = sorted(set(target) - set(source)), sorted(set(source) - set(target))
    if missing or extra:  # which way (a list of both did not say; a re-test)
        said = []
        if missing:
            lacks = f"{counted(len(missing), 'tensor')} the checkpoint lacks ({_some(missing)})"
            said.append(f"the config names {lacks}")
        if extra:
            unnamed = f"{counted(len(extra), 'tensor')} the config does not name ({_some(extra)})"
            said.append(f"the checkpoint holds {unnamed}")
        raise CheckpointFileError(
            f"{step_dir}: its tensors do not match its own model config: {' and '.join(said)}; "
            f"the manifest is damaged, restore it or use another checkpoint"
        )
    for name, entry in target.items():
        if source[name]["full_shape"] != entry["full_shape"]:
            raise CheckpointFileError(
                f"{step_dir}: {name} has shape {list(source[name]['full_shape'])}, its own "
                f"model config expects {list(entry['full_shape'])}; the manifest is damaged, "
                f"restore it or use another checkpoint"
            )
    return target


def checkpoint_info(path, tensors: bool = False, checksums: bool = True) -> str:
    """A readable summary: layout, step, model, parameter count, bytes per file (and tensors).
    Every file is verified against the manifest (sha256 unless `checksums` is False: sizes)."""
    step_dir = resolve_checkpoint(path)
    m = verify(step_dir, checksums=checksums)
    model_tensors(step_dir, m)
    model, entries = m["model"], m["tensors"]
    params = sum(math.prod(e["full_shape"]) for e in entries.values() if not e.get("buffer"))
    optim = sorted({k for e in entries.values() for k in e["optim"]})
    lines = [
        f"checkpoint  {step_dir}",
        f"step        {m['step']}{_skipped(m['meta'], m['step'])}",
        f"layout      {Layout(**m['layout'])}",  # with cp, ep and order where they are set
        f"model       {model['model_type']} ({_size(model)}), {params:,} parameters "
        f"(unpadded, as transformers counts them{_active(model, params)})",
        f"optimizer   {', '.join(optim) if optim else 'none'}",
        *_fp8_line(m["meta"]),
        f"meta keys   {', '.join(sorted(m['meta'])) or 'none'}",
        f"verified    {'sha256 of every file' if checksums else 'sizes only (--fast)'}",
        "files:",
    ]
    files = {name: r["bytes"] for name, r in m["files"].items()}
    for name in (MANIFEST, DIGEST):  # what the step holds besides its data: du's total too
        if (step_dir / name).exists():
            files[name] = (step_dir / name).stat().st_size
    lines += [f"  {name:32s} {size:>14,} bytes" for name, size in files.items()]
    lines.append(f"  {'total':32s} {sum(files.values()):>14,} bytes")
    if tensors:
        lines.append(f"{'tensor':44s} {'full shape':>16s} {'tp_dim':>6s} {'stage':>5s}  optim")
        for name, e in entries.items():
            shape = "x".join(map(str, e["full_shape"]))
            lines.append(
                f"{name:44s} {shape:>16s} {str(e['tp_dim']):>6s} {e['stage']:>5d}  "
                f"{','.join(e['optim']) or '-'}"
            )
    return "\n".join(lines)


def _skipped(meta: dict, step: int) -> str:
    """--info's note on the step line where the learning-rate schedule is behind the step (its
    `schedule_step`: the updates applied; skipped overflow or non-finite steps do not count)."""
    position = meta.get("schedule_step")
    if not isinstance(position, int) or position == step:
        return ""
    return f" (the lr schedule at step {position}: {counted(step - position, 'step')} skipped)"


def _fp8_line(meta: dict) -> list[str]:
    """--info's line for a checkpoint trained under --fp8 (its recorded train_config): the
    recipe and the layers rule, which a --load takes; none for another run."""
    saved = meta.get("train_config") or {}
    recipe = saved.get("fp8") if isinstance(saved, dict) else None
    if not recipe or recipe == "off":
        return []
    layers = saved.get("fp8_layers") or "auto"
    return [
        f"fp8         trained under --fp8 {recipe} --fp8-layers {layers} (a --load takes both; "
        f"the weights are stored in the master dtype)"
    ]


def _size(model: dict) -> str:
    """The model's shape as --info's model line gives it: layers, hidden, vocabulary and, for a
    mixture of experts, its routed experts (how many, how wide, the top-k, the router's score,
    a shared expert, an auxiliary-loss-free bias, in how many layers)."""
    config = config_from_dict(model)
    size = f"{config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}"
    moe_layers = getattr(config, "num_moe_layers", 0)
    if moe_layers:
        shared = getattr(config, "shared_expert_intermediate_size", None)
        size += (
            f"; {config.num_local_experts} routed experts of {config.expert_size}, top "
            f"{config.num_experts_per_tok}, {config.moe_router_score} router"
            + (f", a shared expert of {shared}" if shared else "")
            + (
                f", auxiliary-loss-free bias (rate {rate:g})"
                if (rate := getattr(config, "moe_bias_update_rate", 0))
                else ""
            )
            + f", in {moe_layers} of its layers"
        )
    return size


def _active(model: dict, params: int) -> str:
    """For a mixture of experts, its active parameters per token as --info's model line gives
    them ("; N active per token"); nothing for a dense model."""
    idle = getattr(config_from_dict(model), "idle_expert_params", 0)
    return f"; {params - idle:,} active per token" if idle else ""
